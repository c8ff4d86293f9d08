"""Built-in models for the demo, the tests and the benchmarks (no downloads)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "SimpleCNN",
    "LeNet",
    "MLP",
    "CifarCNN",
    "ResNet18GN",
    "TinyGPT",
    "TinyViT",
    "LSTMLanguageModel",
    "TinyUNet",
    "EmbedBlock",
]


class SimpleCNN(nn.Module):
    """The torch.func per-sample-gradients tutorial's CNN: 1x28x28 images, 10 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return self.fc2(x)


class LeNet(nn.Module):
    """LeNet-5 on 1x28x28 images (padding 2 on the first convolution)."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5, padding=2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(torch.tanh(self.conv1(x)), 2)
        x = F.max_pool2d(torch.tanh(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        x = torch.tanh(self.fc1(x))
        x = torch.tanh(self.fc2(x))
        return self.fc3(x)


class MLP(nn.Sequential):
    """Linear layers with ReLU between them, e.g. ``MLP(784, 512, 512, 10)``."""

    def __init__(self, *sizes: int) -> None:
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(a, b))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        super().__init__(*layers)


class CifarCNN(nn.Module):
    """A CIFAR-style CNN: four 3x3 convolutions (two max-pools) and a linear head; 3x32x32."""

    def __init__(self, classes: int = 10, width: int = 32) -> None:
        super().__init__()
        w = width
        self.features = nn.Sequential(
            nn.Conv2d(3, w, 3, padding=1), nn.ReLU(),
            nn.Conv2d(w, w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(),
            nn.Conv2d(2 * w, 2 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )  # fmt: skip
        self.head = nn.Linear(2 * w * 8 * 8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, groups: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.gn1 = nn.GroupNorm(groups, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.gn2 = nn.GroupNorm(groups, cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(groups, cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.gn1(self.conv1(x)))
        out = self.gn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18GN(nn.Module):
    """ResNet-18's shape (four stages of two basic blocks) with GroupNorm instead of BatchNorm,
    as DP training uses it. ``width`` is the first stage's channels (64 in the original)."""

    def __init__(self, classes: int = 10, width: int = 16, groups: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.gn = nn.GroupNorm(groups, width)
        blocks, cin = [], width
        for stage, stride in enumerate([1, 2, 2, 2]):
            cout = width * 2**stage
            blocks += [_BasicBlock(cin, cout, stride, groups), _BasicBlock(cout, cout, 1, groups)]
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.gn(self.stem(x)))
        x = self.blocks(x)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class _GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT-style decoder: token and learned position embeddings, causal self-attention
    blocks, and an output layer tied to the token embedding. Tokens ``[batch, seq]`` ->
    logits ``[batch, seq, vocab]``."""

    def __init__(
        self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2, max_seq: int = 128
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_seq, dim)
        self.blocks = nn.Sequential(*[_GPTBlock(dim, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.tok.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # Positions [batch, seq], not [seq]: a layer called without the batch dimension and
        # broadcast over it later has no per-example gradients of its own to capture.
        pos = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        x = self.tok(tokens) + self.pos(pos)
        return self.out(self.ln(self.blocks(x)))


class TinyViT(nn.Module):
    """A ViT-style classifier: patch embedding (a strided Conv2d), a class token and a learned
    positional embedding as bare parameters, ``nn.TransformerEncoderLayer`` blocks, a head."""

    def __init__(
        self, image: int = 16, patch: int = 4, channels: int = 3, dim: int = 32, heads: int = 4,
        layers: int = 2, classes: int = 10,
    ) -> None:  # fmt: skip
        super().__init__()
        self.patch = nn.Conv2d(channels, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embedding = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.encoder = nn.Sequential(
            *[
                nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True)
                for _ in range(layers)
            ]
        )
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.encoder(x + self.pos_embedding)
        return self.head(self.ln(x[:, 0]))


class LSTMLanguageModel(nn.Module):
    """Embedding -> two-layer LSTM -> linear decoder. Tokens ``[batch, seq]`` -> logits
    ``[batch, seq, vocab]``."""

    def __init__(self, vocab: int = 64, dim: int = 32, hidden: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, hidden, layers, batch_first=True)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(tokens))
        return self.decoder(out)


class TinyUNet(nn.Module):
    """A small U-Net: two down steps, a ConvTranspose2d up path with skip connections."""

    def __init__(self, channels: int = 1, width: int = 8, classes: int = 2) -> None:
        super().__init__()
        w = width
        self.down1 = nn.Sequential(nn.Conv2d(channels, w, 3, padding=1), nn.ReLU())
        self.down2 = nn.Sequential(nn.Conv2d(w, 2 * w, 3, stride=2, padding=1), nn.ReLU())
        self.bottom = nn.Sequential(nn.Conv2d(2 * w, 2 * w, 3, padding=1), nn.ReLU())
        self.up = nn.ConvTranspose2d(2 * w, w, 2, stride=2)
        self.fuse = nn.Sequential(nn.Conv2d(2 * w, w, 3, padding=1), nn.ReLU())
        self.out = nn.Conv2d(w, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d1 = self.down1(x)
        b = self.bottom(self.down2(d1))
        return self.out(self.fuse(torch.cat([self.up(b), d1], dim=1)))


class EmbedBlock(nn.Module):
    """Embedding, LayerNorm and an MLP on every token, mean-pooled to a class:
    tokens ``[batch, seq]`` -> logits ``[batch, classes]``."""

    def __init__(self, vocab: int = 1000, dim: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.ln = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.ln(self.embed(tokens))
        return self.head((x + self.mlp(x)).mean(1))

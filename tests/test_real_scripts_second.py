"""Published training scripts, a second set, rewritten small, each step checked against the
float64 oracle.

As in ``test_real_scripts.py``: each test follows one script of a public repository (cited in
its docstring: repository and path), its model and its training loop as written there (the
script's optimizer, scheduler, clipping and accumulation), at tiny sizes, on synthetic data, in
float64. At every step ``grad1`` (or the DP-SGD step, where private training is the point) is
compared with each example's own gradient at that step's parameters, by a per-example loop
(:func:`gradhooks.oracle.loop_grad`, or a loop written out where the script's loss is not a
plain mean over examples); where no per-example gradient exists, or the script cannot be
hooked as written, the test checks that gradhooks refuses with an error naming the module and
leaves the model as it was.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_close, assert_grad1

D = torch.float64


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: these models are tiny, and threads on a shared machine spend more
    time waiting for each other than computing."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def per_example(model, hooks, batch: int, loss_of) -> dict[str, torch.Tensor]:
    """``{name: [batch, *shape]}``: the gradient of ``loss_of(i)`` (example ``i``'s own loss)
    for every trainable parameter, with capture paused."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rows = []
    with hooks.paused():
        for i in range(batch):
            grads = torch.autograd.grad(loss_of(i), [p for _, p in named], allow_unused=True)
            rows.append(
                [torch.zeros_like(p) if g is None else g for g, (_, p) in zip(grads, named)]
            )
    return {n: torch.stack([r[k] for r in rows]) for k, (n, _) in enumerate(named)}


def assert_untouched(model, before: dict, what: str) -> None:
    """No parameter holds a ``grad1`` after a refusal, and every parameter is as it was."""
    for n, p in model.named_parameters():
        assert not hasattr(p, "grad1"), f"{what}: {n} kept a grad1"
        assert torch.equal(p.detach(), before[n]), f"{what}: {n} changed"


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# -- pytorch/examples vision_transformer/main.py ---------------------------------------------------


class PatchEmbedding(nn.Module):
    """pytorch/examples ``vision_transformer/main.py``'s ``InputEmbedding``: patches by two
    ``unfold``s, a Linear projection, a class token concatenated in front and a positional
    embedding added in place. The script makes both tables ``[batch_size, 1, latent]``
    parameters (a row per example of the configured batch); ``rows=1`` is the usual repair,
    one row expanded over the batch."""

    def __init__(self, rows: int, patch: int = 2, channels: int = 1, latent: int = 4) -> None:
        super().__init__()
        self.patch = patch
        self.LinearProjection = nn.Linear(patch * patch * channels, latent)
        self.class_token = nn.Parameter(torch.randn(rows, 1, latent))
        self.pos_embedding = nn.Parameter(torch.randn(rows, 1, latent))

    def forward(self, x):
        b, c, _, _ = x.shape
        p = self.patch
        patches = x.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).contiguous()
        projection = self.LinearProjection(patches.view(b, -1, c * p * p))
        n = projection.shape[1]
        projection = torch.cat((self.class_token.expand(b, -1, -1), projection), dim=1)
        projection += self.pos_embedding[:, : n + 1, :]
        return projection


class EncoderBlock(nn.Module):
    """The script's ``EncoderBlock``: one LayerNorm used twice, ``nn.MultiheadAttention``
    (sequence first unless ``batch_first``), a GELU MLP with dropout."""

    def __init__(self, latent: int = 4, heads: int = 2, batch_first: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(latent)
        self.attention = nn.MultiheadAttention(latent, heads, dropout=0.0, batch_first=batch_first)
        self.enc_MLP = nn.Sequential(
            nn.Linear(latent, 4 * latent), nn.GELU(), nn.Dropout(0.0),
            nn.Linear(4 * latent, latent), nn.Dropout(0.0),
        )  # fmt: skip

    def forward(self, emb):
        first = self.norm(emb)
        added = self.attention(first, first, first)[0] + emb
        return self.enc_MLP(self.norm(added)) + added


class ExamplesViT(nn.Module):
    def __init__(self, rows: int, batch_first: bool = False) -> None:
        super().__init__()
        self.embedding = PatchEmbedding(rows)
        self.encoders = nn.ModuleList([EncoderBlock(batch_first=batch_first) for _ in range(2)])
        self.MLPHead = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4), nn.Linear(4, 3))

    def forward(self, x):
        out = self.embedding(x)
        for layer in self.encoders:
            out = layer(out)
        return self.MLPHead(out[:, 0])


def test_examples_vit_attention_across_the_batch_is_refused_then_trains_once_batch_first():
    """pytorch/examples ``vision_transformer/main.py`` gives ``nn.MultiheadAttention``
    (sequence first) a ``[batch, tokens, latent]`` input: the attention runs over the batch,
    each image's output depends on the others', and no per-example gradient exists. gradhooks
    refuses naming the attention, leaving the model as it was. With ``batch_first=True`` and
    one class-token row expanded over the batch, the script's loop (Adam with weight decay,
    ``CrossEntropyLoss``, an evaluation pass between epochs) matches the loop at every step."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = ExamplesViT(rows=3).to(D)
    before = snapshot(model)
    x, y = torch.randn(3, 1, 4, 4, generator=g, dtype=D), torch.randint(3, (3,), generator=g)
    with gradhooks.add_hooks(model):
        loss = F.cross_entropy(model(x), y)
        with pytest.raises(gradhooks.BatchNotFoundError, match=r"'encoders\.\d\.attention'"):
            loss.backward()
    assert_untouched(model, before, "sequence-first attention")

    torch.manual_seed(0)
    model = ExamplesViT(rows=1, batch_first=True).to(D)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=3e-2)
    criterion = nn.CrossEntropyLoss()
    with gradhooks.add_hooks(model):
        for epoch in range(2):
            model.train()
            for step in range(2):
                x = torch.randn(4, 1, 4, 4, generator=g, dtype=D)
                y = torch.randint(3, (4,), generator=g)
                want = loop_grad(model, criterion, x, y)
                opt.zero_grad()
                criterion(model(x), y).backward()
                assert_grad1(model, want, f"epoch {epoch} step {step}")
                opt.step()
            model.eval()
            criterion(model(torch.randn(5, 1, 4, 4, generator=g, dtype=D)), y.new_zeros(5)).item()
            assert model.embedding.class_token.grad1.shape[0] == 4

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
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import (
    assert_close,
    assert_grad1,
    one_thread,  # noqa: F401 (autouse in this module)
)

D = torch.float64


def per_example(model, hooks, batch: int, loss_of) -> dict[str, torch.Tensor]:
    """``{name: [batch, *shape]}``: the gradient of ``loss_of(i)`` (example ``i``'s own loss)
    for every trainable parameter, with capture paused."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rows = []
    with hooks.paused():
        for i in range(batch):
            grads = torch.autograd.grad(loss_of(i), [p for _, p in named], allow_unused=True)
            rows.append([
                torch.zeros_like(p) if g is None else g.to_dense() for g, (_, p) in zip(grads, named)
            ])  # fmt: skip
    return {n: torch.stack([r[k] for r in rows]) for k, (n, _) in enumerate(named)}


def batch_rows(model, forward, losses_of) -> dict[str, torch.Tensor]:
    """``{name: [batch, *shape]}``: the gradient of each example's own loss, ``losses_of(out)[i]``,
    through one forward of the whole batch (``forward()``, run again with capture paused after
    the caller reseeded the generator, so that it draws the hooked forward's dropout masks).
    Autograd's exact derivative of row ``i``: where the examples mix, it differs from
    ``grad1``."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with gradhooks.paused():
        losses = losses_of(forward())
        rows = []
        for i in range(losses.shape[0]):
            grads = torch.autograd.grad(
                losses[i], [p for _, p in named], retain_graph=True, allow_unused=True
            )
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


# -- karpathy/minGPT mingpt/model.py and mingpt/trainer.py, projects/adder/adder.py ---------------


class NewGELU(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


class MinGPTAttention(nn.Module):
    """minGPT's ``CausalSelfAttention``: one ``c_attn`` for q, k and v, the causal mask a
    ``bias`` buffer, ``masked_fill`` then softmax, attention and residual dropout."""

    def __init__(self, n_embd: int, n_head: int, block_size: int, pdrop: float) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.attn_dropout, self.resid_dropout = nn.Dropout(pdrop), nn.Dropout(pdrop)
        mask = torch.tril(torch.ones(block_size, block_size))
        self.register_buffer("bias", mask.view(1, 1, block_size, block_size))
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MinGPTBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, pdrop: float) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = MinGPTAttention(n_embd, n_head, block_size, pdrop)
        self.mlp = nn.ModuleDict(dict(
            c_fc=nn.Linear(n_embd, 4 * n_embd), c_proj=nn.Linear(4 * n_embd, n_embd),
            act=NewGELU(), dropout=nn.Dropout(pdrop),
        ))  # fmt: skip
        m = self.mlp
        self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x))))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlpf(self.ln_2(x))


class MinGPT(nn.Module):
    """minGPT's ``GPT`` (its ``gpt-nano`` shrunk: 2 layers, 2 heads, 8 features), the loss
    computed inside with ``ignore_index=-1``, and its ``configure_optimizers``: AdamW, decay on
    the Linear weights only."""

    def __init__(self, vocab: int = 3, block_size: int = 5, pdrop: float = 0.1) -> None:
        super().__init__()
        n_layer, n_embd = 2, 8
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, n_embd), wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(pdrop), ln_f=nn.LayerNorm(n_embd),
            h=nn.ModuleList([MinGPTBlock(n_embd, 2, block_size, pdrop) for _ in range(n_layer)]),
        ))  # fmt: skip
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        for n, p in self.named_parameters():
            if n.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def configure_optimizers(self, lr: float, weight_decay: float):
        decay = {f"{mn}.weight" for mn, m in self.named_modules() if isinstance(m, nn.Linear)}
        params = dict(self.named_parameters())
        groups = [
            {"params": [params[n] for n in sorted(decay)], "weight_decay": weight_decay},
            {"params": [params[n] for n in sorted(set(params) - decay)], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device).unsqueeze(0)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
            )
        return logits, loss


def _adder_batch(g, batch: int, ndigit: int = 1):
    """``projects/adder/adder.py``'s ``AdditionDataset`` at one digit: ``a b`` then the sum's
    digits reversed, ``x = dix[:-1]``, ``y = dix[1:]`` with the prompt's targets set to -1
    (the same count in every example: the mean over the batch's tokens is the mean over
    examples of each one's own mean)."""
    a, b = torch.randint(3, (batch,), generator=g), torch.randint(3, (batch,), generator=g)
    c = a + b
    digits = torch.stack([a, b, c % 10, c // 10], 1) % 3  # a vocabulary of 3 at these sizes
    x, y = digits[:, :-1].clone(), digits[:, 1:].clone()
    y[:, : ndigit * 2 - 1] = -1
    return x, y


def test_mingpt_trainer_adder_with_masked_prompt_targets_dropout_and_clipping():
    """karpathy/minGPT ``mingpt/trainer.py`` running ``projects/adder/adder.py``'s model:
    ``model(x, y)`` returns ``(logits, loss)`` with the loss inside (``ignore_index=-1`` on the
    prompt), ``model.zero_grad(set_to_none=True)``, ``clip_grad_norm_`` at 1.0, AdamW from
    ``configure_optimizers`` (two weight-decay groups), dropout 0.1 everywhere (the loop
    replays the step's masks by reseeding: the examples do not mix, so each row's gradient
    through the batch's own forward is that example's)."""
    torch.manual_seed(0)
    model = MinGPT().to(D)
    opt = model.configure_optimizers(lr=5e-4, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)

    def losses_of(x, y):
        def each(out):
            logits, _ = out
            ce = F.cross_entropy(logits.transpose(1, 2), y, ignore_index=-1, reduction="none")
            return ce.sum(1) / (y != -1).sum(1)

        return each

    with gradhooks.add_hooks(model):
        model.train()
        for step in range(3):
            x, y = _adder_batch(g, 4)
            torch.manual_seed(10 + step)
            logits, loss = model(x, y)
            model.zero_grad(set_to_none=True)
            loss.backward()
            torch.manual_seed(10 + step)
            want = batch_rows(model, lambda x=x, y=y: model(x, y), losses_of(x, y))
            assert_grad1(model, want, f"step {step}")
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()


# -- pytorch/tutorials intermediate_source/spatial_transformer_tutorial.py -------------------------


class STNNet(nn.Module):
    """pytorch/tutorials ``intermediate_source/spatial_transformer_tutorial.py``'s ``Net``, its
    channels and hidden units shrunk (28x28 inputs kept, so its shapes are the script's): a
    localization network regressing an affine ``theta`` (the last layer initialised to the
    identity), ``F.affine_grid`` and ``F.grid_sample`` warping the input, then a classifier
    with ``Dropout2d`` and ``F.dropout``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 2, 5), nn.Conv2d(2, 3, 5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1, self.fc2 = nn.Linear(48, 6), nn.Linear(6, 10)
        self.localization = nn.Sequential(
            nn.Conv2d(1, 2, 7), nn.MaxPool2d(2, 2), nn.ReLU(True),
            nn.Conv2d(2, 2, 5), nn.MaxPool2d(2, 2), nn.ReLU(True),
        )  # fmt: skip
        self.fc_loc = nn.Sequential(nn.Linear(2 * 3 * 3, 4), nn.ReLU(True), nn.Linear(4, 3 * 2))
        self.fc_loc[2].weight.data.zero_()
        self.fc_loc[2].bias.data.copy_(torch.tensor([1, 0, 0, 0, 1, 0], dtype=torch.float))

    def stn(self, x):
        xs = self.localization(x).view(-1, 2 * 3 * 3)
        theta = self.fc_loc(xs).view(-1, 2, 3)
        grid = F.affine_grid(theta, x.size(), align_corners=False)
        return F.grid_sample(x, grid, align_corners=False)

    def forward(self, x):
        x = self.stn(x)
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = F.relu(self.fc1(x.view(-1, 48)))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def test_spatial_transformer_affine_grid_and_grid_sample_with_dropout():
    """The spatial transformer tutorial's ``train``: SGD at 0.01, ``F.nll_loss`` on the
    log-softmax, ``model.train()`` (both dropouts drawing masks; the loop replays them by
    reseeding), a ``no_grad`` test pass summing the loss between epochs. The warp's gradient
    reaches the localization network through ``grid_sample``; after the first step its last
    layer is no longer the identity, and each example's theta its own."""
    torch.manual_seed(0)
    model = STNNet().to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(model):
        for epoch in range(2):
            model.train()
            for step in range(2):
                data = torch.randn(3, 1, 28, 28, generator=g, dtype=D)
                target = torch.randint(10, (3,), generator=g)
                opt.zero_grad()
                torch.manual_seed(20 + step)
                F.nll_loss(model(data), target).backward()
                torch.manual_seed(20 + step)
                want = batch_rows(
                    model, lambda d=data: model(d),
                    lambda out, t=target: F.nll_loss(out, t, reduction="none"),
                )  # fmt: skip
                assert_grad1(model, want, f"epoch {epoch} step {step}")
                opt.step()
            model.eval()
            with torch.no_grad():
                data = torch.randn(4, 1, 28, 28, generator=g, dtype=D)
                F.nll_loss(model(data), torch.zeros(4, dtype=torch.long), reduction="sum").item()
    assert model.fc_loc[2].weight.abs().sum() > 0


# -- pytorch/tutorials intermediate_source/seq2seq_translation_tutorial.py -------------------------

SOS_token, EOS_token, MAX_LENGTH = 0, 1, 4


class EncoderRNN(nn.Module):
    def __init__(self, input_size: int, hidden_size: int, dropout_p: float = 0.1) -> None:
        super().__init__()
        self.embedding = nn.Embedding(input_size, hidden_size)
        self.gru = nn.GRU(hidden_size, hidden_size, batch_first=True)
        self.dropout = nn.Dropout(dropout_p)

    def forward(self, input):
        return self.gru(self.dropout(self.embedding(input)))


class BahdanauAttention(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.Wa, self.Ua = nn.Linear(hidden_size, hidden_size), nn.Linear(hidden_size, hidden_size)
        self.Va = nn.Linear(hidden_size, 1)

    def forward(self, query, keys):
        scores = self.Va(torch.tanh(self.Wa(query) + self.Ua(keys)))
        weights = F.softmax(scores.squeeze(2).unsqueeze(1), dim=-1)
        return torch.bmm(weights, keys), weights


class AttnDecoderRNN(nn.Module):
    """The tutorial's ``AttnDecoderRNN``: ``MAX_LENGTH`` steps from ``SOS``, each step's input
    the target's previous token (teacher forcing) or the argmax of its own output, a Bahdanau
    attention over the encoder's outputs, the step's outputs concatenated, log-softmax."""

    def __init__(self, hidden_size: int, output_size: int, dropout_p: float = 0.1) -> None:
        super().__init__()
        self.embedding = nn.Embedding(output_size, hidden_size)
        self.attention = BahdanauAttention(hidden_size)
        self.gru = nn.GRU(2 * hidden_size, hidden_size, batch_first=True)
        self.out = nn.Linear(hidden_size, output_size)
        self.dropout = nn.Dropout(dropout_p)

    def forward(self, encoder_outputs, encoder_hidden, target_tensor=None):
        batch_size = encoder_outputs.size(0)
        decoder_input = torch.empty(batch_size, 1, dtype=torch.long).fill_(SOS_token)
        decoder_hidden, decoder_outputs, attentions = encoder_hidden, [], []
        for i in range(MAX_LENGTH):
            decoder_output, decoder_hidden, attn_weights = self.forward_step(
                decoder_input, decoder_hidden, encoder_outputs
            )
            decoder_outputs.append(decoder_output)
            attentions.append(attn_weights)
            if target_tensor is not None:
                decoder_input = target_tensor[:, i].unsqueeze(1)
            else:
                _, topi = decoder_output.topk(1)
                decoder_input = topi.squeeze(-1).detach()
        decoder_outputs = F.log_softmax(torch.cat(decoder_outputs, dim=1), dim=-1)
        return decoder_outputs, decoder_hidden, torch.cat(attentions, dim=1)

    def forward_step(self, input, hidden, encoder_outputs):
        embedded = self.dropout(self.embedding(input))
        query = hidden.permute(1, 0, 2)
        context, attn_weights = self.attention(query, encoder_outputs)
        output, hidden = self.gru(torch.cat((embedded, context), dim=2), hidden)
        return self.out(output), hidden, attn_weights


class Seq2Seq(nn.Module):
    """Only to name both models' parameters for the per-example loop."""

    def __init__(self, encoder, decoder) -> None:
        super().__init__()
        self.encoder, self.decoder = encoder, decoder

    def forward(self, input_tensor, target_tensor=None):
        encoder_outputs, encoder_hidden = self.encoder(input_tensor)
        return self.decoder(encoder_outputs, encoder_hidden, target_tensor)[0]


def _pairs(g, batch: int, vocab: int):
    """The tutorial's ``get_dataloader`` arrays: token ids, ``EOS`` appended, zero-padded to
    ``MAX_LENGTH`` (0 is also ``SOS``, and the loss is not told to ignore it)."""
    ids = torch.zeros(2, batch, MAX_LENGTH, dtype=torch.long)
    for k in range(2):
        for b in range(batch):
            n = int(torch.randint(1, MAX_LENGTH, (1,), generator=g))
            ids[k, b, :n] = torch.randint(2, vocab, (n,), generator=g)
            ids[k, b, n] = EOS_token
    return ids[0], ids[1]


def test_seq2seq_tutorial_two_hooked_models_with_teacher_forcing():
    """pytorch/tutorials ``intermediate_source/seq2seq_translation_tutorial.py``'s
    ``train_epoch``: the encoder and the decoder are two models, each hooked and each with its
    own Adam; ``NLLLoss`` over ``decoder_outputs.view(-1, vocab)`` (every sentence padded to
    the same length, so the mean over tokens is the mean over sentences); dropout on both
    embeddings (the loop replays the masks by reseeding); then ``evaluate`` without targets,
    the decoder feeding back its own argmax, under ``no_grad``."""
    torch.manual_seed(0)
    encoder, decoder = EncoderRNN(7, 4).to(D), AttnDecoderRNN(4, 6).to(D)
    both = Seq2Seq(encoder, decoder)
    encoder_optimizer = torch.optim.Adam(encoder.parameters(), lr=0.001)
    decoder_optimizer = torch.optim.Adam(decoder.parameters(), lr=0.001)
    criterion = nn.NLLLoss()
    g = torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(encoder), gradhooks.add_hooks(decoder):
        for step in range(3):
            input_tensor, target_tensor = _pairs(g, 3, 6)
            encoder_optimizer.zero_grad()
            decoder_optimizer.zero_grad()
            torch.manual_seed(30 + step)
            encoder_outputs, encoder_hidden = encoder(input_tensor)
            decoder_outputs, _, _ = decoder(encoder_outputs, encoder_hidden, target_tensor)
            loss = criterion(
                decoder_outputs.view(-1, decoder_outputs.size(-1)), target_tensor.view(-1)
            )
            loss.backward()
            torch.manual_seed(30 + step)
            want = batch_rows(
                both, lambda i=input_tensor, t=target_tensor: both(i, t),
                lambda out, t=target_tensor: F.nll_loss(out.transpose(1, 2), t, reduction="none").mean(1),
            )  # fmt: skip
            for name, model in (("encoder", encoder), ("decoder", decoder)):
                own = {n[len(name) + 1 :]: w for n, w in want.items() if n.startswith(name + ".")}
                assert_grad1(model, own, f"step {step} {name}")
            encoder_optimizer.step()
            decoder_optimizer.step()
            with torch.no_grad():
                encoder.eval(), decoder.eval()
                both(input_tensor[:1]).topk(1)
                encoder.train(), decoder.train()


# -- pytorch/tutorials beginner_source/text_sentiment_ngrams_tutorial.py ---------------------------


class TextSentiment(nn.Module):
    """The text classification tutorial's model: a sparse ``nn.EmbeddingBag`` (mean mode) over
    one flat tensor of every text's tokens, each text starting at its offset, then a Linear;
    weights uniform in [-0.5, 0.5], bias zero."""

    def __init__(self, vocab_size: int, embed_dim: int, num_class: int) -> None:
        super().__init__()
        self.embedding = nn.EmbeddingBag(vocab_size, embed_dim, sparse=True)
        self.fc = nn.Linear(embed_dim, num_class)
        self.embedding.weight.data.uniform_(-0.5, 0.5)
        self.fc.weight.data.uniform_(-0.5, 0.5)
        self.fc.bias.data.zero_()

    def forward(self, text, offsets):
        return self.fc(self.embedding(text, offsets))


def generate_batch(batch):
    """The tutorial's ``collate_fn``: texts concatenated, offsets the cumulative lengths."""
    label = torch.tensor([entry[0] for entry in batch])
    text = [entry[1] for entry in batch]
    offsets = torch.tensor([0] + [len(entry) for entry in text][:-1]).cumsum(dim=0)
    return torch.cat(text), offsets, label


def test_text_sentiment_embedding_bag_with_offsets_sparse_sgd_and_steplr():
    """pytorch/tutorials ``beginner_source/text_sentiment_ngrams_tutorial.py``: the examples
    are not on a dimension of the input but cut out of one flat token tensor by ``offsets``;
    a sparse EmbeddingBag trained by SGD at lr 4.0 with ``StepLR`` per epoch, and a
    ``no_grad`` evaluation. Under ``batch_dim="auto"`` (the bag's rows, not the flat tokens,
    are the examples from the bag on) and under ``batch_dim=None`` (every hooked layer's rows
    are its examples), each text's grad1 is its own, by the loop over the texts (each its
    tokens and offset ``[0]``, as the tutorial's ``predict`` calls the model)."""
    torch.manual_seed(0)
    model = TextSentiment(12, 4, 3).to(D)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=4.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.9)
    g = torch.Generator().manual_seed(0)

    def entries(n):
        return [
            (int(torch.randint(3, (1,), generator=g)),
             torch.randint(12, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g))
            for _ in range(n)
        ]  # fmt: skip

    for epoch in range(4):
        with gradhooks.add_hooks(model, batch_dim="auto" if epoch < 2 else None) as h:
            for step in range(2):
                batch = entries(4)
                text, offsets, cls = generate_batch(batch)
                optimizer.zero_grad()
                output = model(text, offsets)
                loss = criterion(output, cls)
                loss.backward()
                want = per_example(
                    model, h, 4,
                    lambda i, b=batch: criterion(model(b[i][1], torch.tensor([0])), torch.tensor([b[i][0]])),
                )  # fmt: skip
                assert_grad1(model, want, f"epoch {epoch} step {step}")
                optimizer.step()
            scheduler.step()
            with torch.no_grad():
                text, offsets, cls = generate_batch(entries(3))
                criterion(model(text, offsets), cls).item()


# -- pytorch/tutorials beginner_source/transfer_learning_tutorial.py -------------------------------


class Block(nn.Module):
    """torchvision's ResNet ``BasicBlock`` with its BatchNorms."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class TinyResNet(nn.Module):
    """``resnet18`` in miniature: stem, two basic blocks, global pooling, ``fc``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 4, 3, 2, 1, bias=False), nn.BatchNorm2d(4)
        self.layer1, self.layer2 = Block(4, 4, 1), Block(4, 6, 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(6, 5)

    def forward(self, x):
        x = self.layer2(self.layer1(F.relu(self.bn1(self.conv1(x)))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _train_model(model, criterion, optimizer, scheduler, g, epochs: int):
    """The tutorial's ``train_model``: per epoch a ``train`` phase (``model.train()``, grad
    enabled, backward and step) and a ``val`` phase (``model.eval()``, grad disabled), the
    scheduler stepped after the train phase; each train step's grad1 against the loop, and
    no frozen parameter given one."""
    for epoch in range(epochs):
        for phase in ["train", "val"]:
            model.train() if phase == "train" else model.eval()
            for step in range(2):
                inputs = torch.randn(4, 3, 8, 8, generator=g, dtype=D)
                labels = torch.randint(2, (4,), generator=g)
                optimizer.zero_grad()
                with torch.set_grad_enabled(phase == "train"):
                    outputs = model(inputs)
                    _, preds = torch.max(outputs, 1)
                    loss = criterion(outputs, labels)
                    if phase == "train":
                        loss.backward()
                        want = loop_grad(model, criterion, inputs, labels)
                        assert_grad1(model, want, f"epoch {epoch} step {step}", frozen_clean=True)
                        optimizer.step()
                (preds == labels).sum().item()
            if phase == "train":
                scheduler.step()


def test_transfer_learning_fixed_feature_extractor_batch_norm_statistics_are_refused():
    """pytorch/tutorials ``beginner_source/transfer_learning_tutorial.py``, "ConvNet as fixed
    feature extractor": every parameter of the ResNet frozen, a new ``fc`` the only trainable
    layer, SGD with momentum on ``model_conv.fc.parameters()``, ``StepLR``. The train phase
    runs ``model.train()``: the frozen BatchNorms still normalize by the batch's statistics,
    so ``fc``'s input depends on every image of the batch and no per-example gradient exists;
    gradhooks refuses at the forward naming the first BatchNorm, its running statistics and
    the parameters as they were. With the backbone's
    BatchNorms kept in eval mode (``model.train()`` then ``.eval()`` on each frozen
    BatchNorm), the script's two phases match the loop at every train step."""
    torch.manual_seed(0)
    model_conv = TinyResNet().to(D)
    for param in model_conv.parameters():
        param.requires_grad = False
    model_conv.fc = nn.Linear(model_conv.fc.in_features, 2).to(D)
    before = snapshot(model_conv)
    criterion = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(0)
    buffers = {n: b.clone() for n, b in model_conv.named_buffers()}
    with gradhooks.add_hooks(model_conv):
        model_conv.train()
        with pytest.raises(gradhooks.MixedExamplesError, match=r"'bn1' \(BatchNorm2d\)"):
            model_conv(torch.randn(4, 3, 8, 8, generator=g, dtype=D))
    assert_untouched(model_conv, before, "frozen batch norms in training mode")
    for n, b in model_conv.named_buffers():
        assert torch.equal(b, buffers[n]), n

    optimizer_conv = torch.optim.SGD(model_conv.fc.parameters(), lr=0.001, momentum=0.9)
    exp_lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer_conv, step_size=1, gamma=0.1)
    train = model_conv.train

    def train_with_frozen_statistics(mode: bool = True):
        train(mode)
        for m in model_conv.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()
        return model_conv

    model_conv.train = train_with_frozen_statistics
    with gradhooks.add_hooks(model_conv):
        _train_model(model_conv, criterion, optimizer_conv, exp_lr_scheduler, g, epochs=2)


# -- pytorch/tutorials beginner_source/knowledge_distillation_tutorial.py --------------------------


class LightNN(nn.Module):
    """The distillation tutorial's student, ``LightNN`` (16 channels shrunk to 3, 32x32 images
    to 8x8); with ``hidden`` it is ``ModifiedLightNNCosine``, returning the flattened
    features average-pooled to the teacher's width besides the logits."""

    def __init__(self, hidden: bool = False) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, 2),
            nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, 2),
        )  # fmt: skip
        self.classifier = nn.Sequential(
            nn.Linear(16, 6), nn.ReLU(), nn.Dropout(0.1), nn.Linear(6, 5)
        )
        self.hidden = hidden

    def forward(self, x):
        x = torch.flatten(self.features(x), 1)
        if not self.hidden:
            return self.classifier(x)
        return self.classifier(x), F.avg_pool1d(x, 2)


class DeepNN(nn.Module):
    """The tutorial's teacher, ``DeepNN`` shrunk; with ``hidden`` its cosine variant."""

    def __init__(self, hidden: bool = False) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 4, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2, 2), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
            nn.Conv2d(4, 2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, 2),
        )  # fmt: skip
        self.classifier = nn.Sequential(
            nn.Linear(8, 6), nn.ReLU(), nn.Dropout(0.1), nn.Linear(6, 5)
        )
        self.hidden = hidden

    def forward(self, x):
        x = torch.flatten(self.features(x), 1)
        return (self.classifier(x), x) if self.hidden else self.classifier(x)


@pytest.mark.parametrize("variant", ["soft_targets", "cosine"])
def test_knowledge_distillation_student_hooked_teacher_under_no_grad(variant):
    """pytorch/tutorials ``beginner_source/knowledge_distillation_tutorial.py``: the teacher in
    eval mode under ``no_grad``, the student hooked and trained by Adam. ``soft_targets``
    (``train_knowledge_distillation``): ``sum(p_t * (log p_t - log p_s)) / batch * T**2``
    weighted with the cross-entropy; ``cosine`` (``train_cosine_loss``): the teacher's and the
    student's hidden representations through ``CosineEmbeddingLoss`` with target ones, plus
    the cross-entropy. The student's dropout is replayed by reseeding; each example's loss
    is its own row of both terms."""
    torch.manual_seed(0)
    hidden = variant == "cosine"
    teacher, student = DeepNN(hidden).to(D), LightNN(hidden).to(D)
    ce_loss, cosine_loss = nn.CrossEntropyLoss(), nn.CosineEmbeddingLoss()
    optimizer = torch.optim.Adam(student.parameters(), lr=0.001)
    T, soft_target_loss_weight, ce_loss_weight = 2.0, 0.25, 0.75
    g = torch.Generator().manual_seed(0)

    def losses(out, teacher_out, labels, reduce: bool):
        if variant == "soft_targets":
            soft_targets = F.softmax(teacher_out / T, dim=-1)
            soft_prob = F.log_softmax(out / T, dim=-1)
            rows = torch.sum(soft_targets * (soft_targets.log() - soft_prob), -1) * T**2
            soft = rows.sum() / soft_prob.size()[0] if reduce else rows
            label = (
                ce_loss(out, labels) if reduce else F.cross_entropy(out, labels, reduction="none")
            )
            return soft_target_loss_weight * soft + ce_loss_weight * label
        (logits, student_hidden), (_, teacher_hidden) = out, teacher_out
        ones = torch.ones(labels.size(0), dtype=D)
        if reduce:
            return 0.25 * cosine_loss(student_hidden, teacher_hidden, target=ones) + 0.75 * ce_loss(
                logits, labels
            )
        cos = F.cosine_embedding_loss(student_hidden, teacher_hidden, ones, reduction="none")
        return 0.25 * cos + 0.75 * F.cross_entropy(logits, labels, reduction="none")

    teacher.eval()
    student.train()
    with gradhooks.add_hooks(student):
        for step in range(3):
            inputs = torch.randn(4, 3, 8, 8, generator=g, dtype=D)
            labels = torch.randint(5, (4,), generator=g)
            optimizer.zero_grad()
            with torch.no_grad():
                teacher_out = teacher(inputs)
            torch.manual_seed(40 + step)
            losses(student(inputs), teacher_out, labels, reduce=True).backward()
            torch.manual_seed(40 + step)
            want = batch_rows(
                student, lambda x=inputs: student(x),
                lambda out, t=teacher_out, y=labels: losses(out, t, y, reduce=False),
            )  # fmt: skip
            assert_grad1(student, want, f"{variant} step {step}")
            optimizer.step()


# -- huggingface/transformers examples/pytorch/language-modeling/run_clm_no_trainer.py -------------


def _group_texts(g, texts: int, block_size: int, vocab: int):
    """The script's ``group_texts``: the tokenized texts concatenated and cut into blocks of
    ``block_size`` (the remainder dropped), ``labels`` a copy of ``input_ids``; the default
    collator adds an all-ones ``attention_mask``."""
    ids = torch.cat([torch.randint(4, vocab, (int(torch.randint(3, 9, (1,), generator=g)),),
                                   generator=g) for _ in range(texts)])  # fmt: skip
    total = (len(ids) // block_size) * block_size
    blocks = ids[:total].view(-1, block_size)
    return dict(input_ids=blocks, attention_mask=torch.ones_like(blocks), labels=blocks.clone())


def test_run_clm_no_trainer_opt_with_accumulation_warmup_and_dropout():
    """huggingface/transformers ``examples/pytorch/language-modeling/run_clm_no_trainer.py``
    on a tiny ``OPTForCausalLM`` (positions from the attention mask's cumulative sum, dropout
    0.1 kept): ``outputs = model(**batch)``, ``loss = outputs.loss`` (labels shifted inside,
    the mean over the batch's tokens, each block as long as the others), what
    ``accelerator.accumulate`` does at two steps (the loss halved, the optimizer, scheduler and
    ``zero_grad`` run every second micro-batch), AdamW over the script's no-decay groups
    (``bias``, ``layer_norm.weight``), ``get_scheduler("linear", ...)`` with warmup, then the
    evaluation's perplexity under ``no_grad``. grad1 after each update's two micro-batches,
    within float32's precision (the loss is computed in float32 inside the model):
    each row the halved sum of that row's gradients, each through its micro-batch's forward
    with the same dropout masks."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.OPTConfig(
        vocab_size=24, hidden_size=8, num_hidden_layers=1, ffn_dim=12, num_attention_heads=2,
        max_position_embeddings=16, word_embed_proj_dim=8, pad_token_id=1, bos_token_id=2,
        eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.OPTForCausalLM(config).to(D)
    no_decay = ["bias", "layer_norm.weight"]
    optimizer = torch.optim.AdamW([
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ], lr=1e-3)  # fmt: skip
    accumulation = 2
    lr_scheduler = transformers.get_scheduler(
        "linear", optimizer, num_warmup_steps=1, num_training_steps=4
    )
    g = torch.Generator().manual_seed(0)

    def rows(out, batch):
        logits, labels = out.logits[:, :-1], batch["labels"][:, 1:]
        return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none").mean(1)

    with gradhooks.add_hooks(model):
        model.train()
        want = None
        for step in range(2 * accumulation):
            batch = _group_texts(g, 4, 5, 24)
            batch = {k: v[:3] for k, v in batch.items()}
            torch.manual_seed(50 + step)
            outputs = model(**batch)
            (outputs.loss / accumulation).backward()
            torch.manual_seed(50 + step)
            own = batch_rows(model, lambda b=batch: model(**b), lambda out, b=batch: rows(out, b))
            want = {n: w / accumulation + (0 if want is None else want[n]) for n, w in own.items()}
            if (step + 1) % accumulation == 0:
                # (Hugging Face's causal-LM loss casts the logits to float32: its gradient is
                # float32's, rounded otherwise than each row's float64 loss)
                assert_grad1(model, want, f"update {step // accumulation}", rtol=1e-5, atol=1e-6)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                want = None
        model.eval()
        with torch.no_grad():
            batch = _group_texts(g, 3, 5, 24)
            math.exp(model(**batch).loss.item())


# -- karpathy/micrograd demo.ipynb, its MLP written in torch ---------------------------------------


def test_micrograd_demo_max_margin_loss_with_an_l2_penalty_in_the_loss():
    """karpathy/micrograd ``demo.ipynb``: ``MLP(2, [16, 16, 1])`` (here ``[4, 4, 1]``; ReLU
    neurons, the last linear; weights uniform in [-1, 1], biases zero), the SVM max-margin loss
    ``relu(1 - y * score)`` averaged, plus ``alpha * sum(p * p)`` over the parameters, then
    ``model.zero_grad()``, backward and ``p.data -= lr * p.grad`` with the learning rate decayed
    by ``1 - 0.9 * k / 100``. The penalty is no example's: as written, the first backward is
    refused (grad1 would not add up to ``.grad``) and no grad1 is written. With
    ``verify=False`` (as the error says), grad1 holds each example's data term, and ``.grad``
    its mean plus the penalty's ``2 * alpha * p``, at every step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    model = model.to(D)
    for m in model:
        if isinstance(m, nn.Linear):
            nn.init.uniform_(m.weight, -1, 1)
            nn.init.zeros_(m.bias)
    g = torch.Generator().manual_seed(0)
    X = torch.randn(6, 2, generator=g, dtype=D)
    y = torch.randint(2, (6,), generator=g).to(D) * 2 - 1
    alpha = 1e-4

    def loss():
        scores = model(X).squeeze(1)
        losses = (1 + -y * scores).relu()
        data_loss = losses.sum() * (1.0 / losses.numel())
        reg_loss = alpha * sum((p * p).sum() for p in model.parameters())
        return data_loss + reg_loss

    with gradhooks.add_hooks(model):
        with pytest.raises(gradhooks.CheckFailedError):
            loss().backward()
    assert not any(hasattr(p, "grad1") for p in model.parameters())

    def hinge(out, target):
        return (1 + -target * out.squeeze(1)).relu().mean()

    with gradhooks.add_hooks(model, verify=False):
        for k in range(4):
            want = loop_grad(model, hinge, X, y)
            total_loss = loss()
            model.zero_grad()
            total_loss.backward()
            assert_grad1(model, want, f"step {k}")
            for n, p in model.named_parameters():
                assert_close(
                    p.grad, p.grad1.mean(0) + 2 * alpha * p.detach(), f"step {k} .grad {n}"
                )
            learning_rate = 1.0 - 0.9 * k / 100
            for p in model.parameters():
                p.data -= learning_rate * p.grad


# -- pytorch/opacus examples/cifar10.py ------------------------------------------------------------


def opacus_convnet(num_classes: int = 10) -> nn.Sequential:
    """Opacus ``examples/cifar10.py``'s ``convnet``: four 3x3 convolutions with ReLU and
    average pooling (32, 64, 64, 128 channels shrunk to 4; 32x32 images to 8x8), global
    average pooling, ``Flatten``, a Linear."""
    return nn.Sequential(
        nn.Conv2d(3, 4, kernel_size=3, stride=1, padding=1), nn.ReLU(), nn.AvgPool2d(2, 2),
        nn.Conv2d(4, 4, kernel_size=3, stride=1, padding=1), nn.ReLU(), nn.AvgPool2d(2, 2),
        nn.Conv2d(4, 4, kernel_size=3, stride=1, padding=1), nn.ReLU(), nn.AvgPool2d(2, 2),
        nn.Conv2d(4, 4, kernel_size=3, stride=1, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(start_dim=1, end_dim=-1),
        nn.Linear(4, num_classes, bias=True),
    )  # fmt: skip


@pytest.mark.parametrize("clip_per_layer", [False, True], ids=["flat", "per_layer"])
def test_opacus_cifar10_example_momentum_cosine_lr_and_per_layer_clipping(clip_per_layer):
    """Opacus ``examples/cifar10.py`` with ``gradhooks.make_private`` where the script calls
    ``make_private`` (one bound ``C``) or ``make_private_per_layer`` (``--clip-per-layer``:
    every parameter its own bound ``C / sqrt(n_params)``, here ``clipping_groups=
    "parameter"``): SGD with momentum 0.9, the cosine learning rate written into the
    optimizer's groups at each epoch, ``CrossEntropyLoss`` per example, a ``no_grad`` test
    pass. Noise off, each step's update is an unhooked twin's, SGD with the same momentum and
    learning rate, fed the clipped sum of the batch's per-example gradients (by the loop, at
    the step's parameters) over the expected batch size."""
    from torch.utils.data import TensorDataset

    torch.manual_seed(0)
    model = opacus_convnet().to(D)
    twin = copy.deepcopy(model)
    lr, momentum, C, epochs = 0.1, 0.9, 1.0, 2
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    twin_optimizer = torch.optim.SGD(twin.parameters(), lr=lr, momentum=momentum)
    names = [n for n, _ in model.named_parameters()]
    bounds = {n: C / math.sqrt(len(names)) if clip_per_layer else C for n in names}
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(16, 3, 8, 8, generator=g, dtype=D), torch.randint(10, (16,), generator=g)
    )
    private = gradhooks.make_private(
        model, optimizer, data, delta=1e-5, noise_multiplier=0.0, steps=4, expected_batch_size=4,
        max_grad_norm=[bounds[n] for n in names] if clip_per_layer else C,
        clipping_groups="parameter" if clip_per_layer else None,
        generator=torch.Generator().manual_seed(1),
    )  # fmt: skip
    criterion = nn.CrossEntropyLoss(reduction="none")
    steps = 0
    try:
        batches = private.batches()
        for epoch in range(1, epochs + 1):
            epoch_lr = lr * 0.5 * (1 + math.cos(math.pi * epoch / (epochs + 1)))
            for o in (optimizer, twin_optimizer):
                for param_group in o.param_groups:
                    param_group["lr"] = epoch_lr
            model.train()
            for _ in range(2):
                images, target = next(batches)
                rows = loop_grad(model, lambda out, y: criterion(out, y).sum(), images, target)
                if clip_per_layer:
                    factors = {n: (bounds[n] / rows[n].flatten(1).norm(dim=1)).clamp(max=1.0)
                               for n in names}  # fmt: skip
                else:
                    norms = torch.cat([rows[n].flatten(1) for n in names], 1).norm(dim=1)
                    factors = dict.fromkeys(names, (C / norms).clamp(max=1.0))
                for n, q in twin.named_parameters():
                    q.grad = torch.einsum("b,b...->...", factors[n], rows[n]) / 4
                private.backward(criterion(model(images), target))
                assert private.step()
                twin_optimizer.step()
                for (n, p), q in zip(model.named_parameters(), twin.parameters()):
                    assert_close(p.detach(), q.detach(), f"epoch {epoch} step {steps}: {n}")
                steps += 1
            model.eval()
            with torch.no_grad():
                model(torch.randn(5, 3, 8, 8, generator=g, dtype=D)).argmax(1)
    finally:
        private.close()
    assert steps == 4


# -- pytorch/tutorials beginner_source/examples_nn/dynamic_net.py ----------------------------------


class DynamicNet(nn.Module):
    """The tutorial's ``DynamicNet``: five scalar parameters used directly in the forward (no
    child module), a cubic plus ``e * x**4`` and ``e * x**5`` for a number of terms drawn by
    ``random.randint(4, 6)`` at each forward (none, one or both)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d, self.e = (nn.Parameter(torch.randn(())) for _ in range(5))

    def forward(self, x):
        y = self.a + self.b * x + self.c * x**2 + self.d * x**3
        for exp in range(4, random.randint(4, 6)):
            y = y + self.e * x**exp
        return y


def test_dynamic_net_parameters_used_directly_with_a_random_depth():
    """pytorch/tutorials ``beginner_source/examples_nn/dynamic_net.py``: each point of
    ``x = linspace(-pi, pi, n)`` is an example of a 1-D input; ``MSELoss(reduction="sum")``,
    SGD with momentum 0.9. The loop replays each step's draw of Python's ``random`` (the
    hooks draw none: the script's stream is the same as without them); where the draw leaves
    ``e`` out, ``e`` has neither ``.grad`` nor ``grad1``."""
    torch.manual_seed(0)
    model = DynamicNet().to(D)
    criterion = nn.MSELoss(reduction="sum")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    x = torch.linspace(-math.pi, math.pi, 9, dtype=D)
    y = torch.sin(x)
    drawn, skipped = set(), 0
    state = random.getstate()
    try:
        random.seed(0)
        with gradhooks.add_hooks(model, loss_reduction="sum") as h:
            for t in range(8):
                before = random.getstate()
                y_pred = model(x)
                after = random.getstate()
                random.setstate(before)
                drawn.add(random.randint(4, 6))
                assert random.getstate() == after
                loss = criterion(y_pred, y)
                optimizer.zero_grad()
                loss.backward()
                assert random.getstate() == after

                def own(i, before=before):
                    random.setstate(before)
                    return criterion(model(x[i : i + 1]), y[i : i + 1])

                want = per_example(model, h, len(x), own)
                random.setstate(after)
                for n, p in model.named_parameters():
                    if p.grad is None:
                        assert not hasattr(p, "grad1"), f"step {t}: {n}"
                        skipped += 1
                    else:
                        assert_close(p.grad1, want[n], f"step {t}: {n}")
                optimizer.step()
    finally:
        random.setstate(state)
    assert drawn == {4, 5, 6} and skipped


# -- pytorch/tutorials intermediate_source/pruning_tutorial.py -------------------------------------


class LeNet(nn.Module):
    """The pruning tutorial's ``LeNet`` (6 and 16 channels, 120 and 84 units shrunk; 14x14
    inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 2, 3), nn.Conv2d(2, 3, 3)
        self.fc1, self.fc2, self.fc3 = nn.Linear(3 * 2 * 2, 8), nn.Linear(8, 6), nn.Linear(6, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), (2, 2))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = x.view(-1, int(x.nelement() / x.shape[0]))
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


def test_pruning_tutorial_masks_iterative_pruning_and_remove_while_training():
    """pytorch/tutorials ``intermediate_source/pruning_tutorial.py``'s pruning calls on a
    hooked LeNet trained by SGD between them: ``random_unstructured`` and ``l1_unstructured``
    (the weight and the bias of ``conv1``: ``weight_orig`` and ``weight_mask`` with a forward
    pre-hook writing ``weight``), ``ln_structured`` on ``conv2``, ``global_unstructured`` over
    several layers, then iterative pruning (a ``PruningContainer``) and ``prune.remove`` (the
    parameter is ``weight`` again). At every step each trainable parameter's grad1 (of
    ``weight_orig`` while pruned: zero where masked) is the loop's."""
    import torch.nn.utils.prune as prune

    torch.manual_seed(0)
    model = LeNet().to(D)
    prune.random_unstructured(model.conv1, name="weight", amount=0.3)
    prune.l1_unstructured(model.conv1, name="bias", amount=1)
    prune.ln_structured(model.conv2, name="weight", amount=0.5, n=2, dim=0)
    parameters_to_prune = ((model.fc1, "weight"), (model.fc2, "weight"), (model.fc3, "weight"))
    prune.global_unstructured(parameters_to_prune, pruning_method=prune.L1Unstructured, amount=0.2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)

    def train(what: str, steps: int = 2):
        for step in range(steps):
            x, y = (
                torch.randn(4, 1, 14, 14, generator=g, dtype=D),
                torch.randint(10, (4,), generator=g),
            )
            want = loop_grad(model, F.cross_entropy, x, y)
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"{what} step {step}")
            optimizer.step()

    with gradhooks.add_hooks(model):
        train("pruned")
        assert (model.conv1.weight_orig.grad1 * (1 - model.conv1.weight_mask)).abs().max() == 0
        prune.ln_structured(model.conv1, name="weight", amount=0.5, n=2, dim=0)
        hooks = model.conv1._forward_pre_hooks.values()
        assert any(isinstance(k, prune.PruningContainer) for k in hooks)
        train("pruned again")
        for module in (model.conv1, model.fc1):
            prune.remove(module, "weight")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        train("removed")
    assert "conv1.weight" in dict(model.named_parameters())


# -- pytorch/tutorials intermediate_source/per_sample_grads.py -------------------------------------


class SimpleCNN(nn.Module):
    """The per-sample-gradients tutorial's ``SimpleCNN`` (32 and 64 channels, 128 units shrunk;
    8x8 images), its output a log-softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 2, 3, 1), nn.Conv2d(2, 3, 3, 1)
        self.fc1, self.fc2 = nn.Linear(3 * 2 * 2, 5), nn.Linear(5, 10)

    def forward(self, x):
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        x = torch.flatten(F.max_pool2d(x, 2), 1)
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


def test_per_sample_grads_tutorial_its_two_methods_on_the_hooked_model_then_grad1():
    """pytorch/tutorials ``intermediate_source/per_sample_grads.py`` run on a hooked model: its
    loop (``torch.autograd.grad`` of each sample's ``nll_loss``, a batch of one each), then its
    ``vmap(grad(compute_loss), in_dims=(None, None, 0, 0))`` over ``functional_call`` with the
    detached parameters and buffers; then one backward of the batch's mean loss. Both of the
    tutorial's results are as without hooks (an unhooked twin's), and grad1 equals them."""
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = SimpleCNN().to(D)
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    data, targets = (
        torch.randn(4, 1, 8, 8, generator=g, dtype=D),
        torch.randint(10, (4,), generator=g),
    )

    def tutorial(m):
        def compute_grad(sample, target):
            loss = F.nll_loss(m(sample.unsqueeze(0)), target.unsqueeze(0))
            return torch.autograd.grad(loss, list(m.parameters()))

        per_sample_grads = [compute_grad(data[i], targets[i]) for i in range(4)]
        params = {k: v.detach() for k, v in m.named_parameters()}
        buffers = {k: v.detach() for k, v in m.named_buffers()}

        def compute_loss(params, buffers, sample, target):
            predictions = functional_call(m, (params, buffers), (sample.unsqueeze(0),))
            return F.nll_loss(predictions, target.unsqueeze(0))

        ft = vmap(grad(compute_loss), in_dims=(None, None, 0, 0))(params, buffers, data, targets)
        loop = {n: torch.stack([r[k] for r in per_sample_grads]) for k, n in enumerate(params)}
        return loop, ft

    want_loop, want_ft = tutorial(twin)
    with gradhooks.add_hooks(model):
        loop, ft = tutorial(model)
        F.nll_loss(model(data), targets).backward()
    for n in want_loop:
        assert_close(loop[n], want_loop[n], f"the tutorial's loop: {n}")
        assert_close(ft[n], want_ft[n], f"the tutorial's vmap: {n}")
        assert_close(ft[n], loop[n], f"vmap against the loop: {n}")
    assert_grad1(model, want_ft, "one backward")


# -- pytorch/tutorials intermediate_source/char_rnn_classification_tutorial.py ---------------------


class CharRNN(nn.Module):
    """The char-RNN classification tutorial's ``RNN``: ``i2h`` and ``i2o`` on the letter's
    one-hot vector concatenated with the hidden state, a log-softmax; called once per letter
    on a batch of one (``line_tensor[i]``, ``[1, n_letters]``)."""

    def __init__(self, input_size: int, hidden_size: int, output_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.i2h = nn.Linear(input_size + hidden_size, hidden_size)
        self.i2o = nn.Linear(input_size + hidden_size, output_size)
        self.softmax = nn.LogSoftmax(dim=1)

    def forward(self, input, hidden):
        combined = torch.cat((input, hidden), 1)
        return self.softmax(self.i2o(combined)), self.i2h(combined)

    def initHidden(self):
        return torch.zeros(1, self.hidden_size, dtype=D)


def test_char_rnn_classification_one_name_per_backward_letter_by_letter():
    """pytorch/tutorials ``intermediate_source/char_rnn_classification_tutorial.py``'s
    ``train``: ``rnn.zero_grad()``, the RNN called once per letter of one name (a batch of one,
    the hidden state carried), ``NLLLoss`` of the last output, backward, then
    ``p.data.add_(p.grad.data, alpha=-learning_rate)`` by hand. Each backward has one example,
    the name: grad1 has one row, its gradient (an unhooked twin's ``.grad``), every step."""
    torch.manual_seed(0)
    rnn = CharRNN(6, 4, 3).to(D)
    twin = copy.deepcopy(rnn)
    criterion = nn.NLLLoss()
    learning_rate = 0.005
    g = torch.Generator().manual_seed(0)

    def train(m, category_tensor, line_tensor):
        hidden = m.initHidden()
        m.zero_grad()
        for i in range(line_tensor.size()[0]):
            output, hidden = m(line_tensor[i], hidden)
        loss = criterion(output, category_tensor)
        loss.backward()
        for p in m.parameters():
            p.data.add_(p.grad.data, alpha=-learning_rate)
        return output, loss.item()

    with gradhooks.add_hooks(rnn):
        for step in range(4):
            letters = torch.randint(6, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
            line_tensor = F.one_hot(letters, 6).to(D).unsqueeze(1)  # [len, 1, n_letters]
            category_tensor = torch.randint(3, (1,), generator=g)
            train(twin, category_tensor, line_tensor)
            train(rnn, category_tensor, line_tensor)
            want = {n: q.grad.unsqueeze(0) for n, q in twin.named_parameters()}
            assert_grad1(rnn, want, f"name {step}")
            for (n, p), q in zip(rnn.named_parameters(), twin.parameters()):
                assert_close(p.detach(), q.detach(), f"name {step}: {n}")


# -- pytorch/torchtune recipes/lora_finetune_single_device.py, in miniature ------------------------


class LoRALinear(nn.Module):
    """torchtune's ``LoRALinear``: the frozen ``weight`` and ``bias`` used by ``F.linear``, plus
    ``(alpha / rank) * lora_b(lora_a(dropout(x)))`` (``lora_b`` zero-initialised)."""

    def __init__(self, in_dim: int, out_dim: int, rank: int = 2, alpha: float = 4.0) -> None:
        super().__init__()
        self.rank, self.alpha = rank, alpha
        self.weight = nn.Parameter(torch.randn(out_dim, in_dim) / math.sqrt(in_dim))
        self.bias = nn.Parameter(torch.zeros(out_dim))
        self.dropout = nn.Dropout(0.05)
        self.lora_a, self.lora_b = (
            nn.Linear(in_dim, rank, bias=False),
            nn.Linear(rank, out_dim, bias=False),
        )
        nn.init.kaiming_uniform_(self.lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x):
        out = F.linear(x, self.weight, self.bias)
        return out + (self.alpha / self.rank) * self.lora_b(self.lora_a(self.dropout(x)))


class TinyDecoder(nn.Module):
    """A torchtune ``TransformerDecoder`` shrunk to one layer: token embedding, RMSNorm,
    causal attention with LoRA on ``q_proj`` and ``v_proj`` (``lora_attn_modules``), an MLP,
    the final norm and the output projection."""

    def __init__(self, vocab: int = 11, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.sa_norm, self.mlp_norm, self.norm = nn.RMSNorm(dim), nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.q_proj, self.v_proj = LoRALinear(dim, dim), LoRALinear(dim, dim)
        self.k_proj, self.output_proj = (
            nn.Linear(dim, dim, bias=False),
            nn.Linear(dim, dim, bias=False),
        )
        self.w1, self.w2 = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(2 * dim, dim, bias=False)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        b, t = tokens.shape
        h = self.tok_embeddings(tokens)
        x = self.sa_norm(h)
        q, k, v = (u.view(b, t, self.heads, -1).transpose(1, 2)
                   for u in (self.q_proj(x), self.k_proj(x), self.v_proj(x)))  # fmt: skip
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.output_proj(y.transpose(1, 2).reshape(b, t, -1))
        h = h + self.w2(F.silu(self.w1(self.mlp_norm(h))))
        return self.output(self.norm(h))


def test_torchtune_lora_recipe_token_sum_losses_and_grads_scaled_after_accumulation():
    """pytorch/torchtune ``recipes/lora_finetune_single_device.py`` in miniature:
    ``set_trainable_params(model, get_adapter_params(model))`` (only ``lora_a``/``lora_b``
    trainable), labels shifted by ``hstack`` with the ignore cache, ``current_loss = loss *
    current_num_tokens`` (each micro-batch's token sum; padding ignored at -100) backward per
    micro-batch, then ``scale_grads(model, 1 / num_tokens)``, ``clip_grad_norm_``, AdamW, a
    cosine schedule with warmup, ``zero_grad(set_to_none=True)``. Under
    ``loss_reduction="sum"`` grad1 after each update's two micro-batches is each row's token
    sum's gradient, added over the micro-batches (dropout replayed by reseeding), the frozen
    weights have none, and the scaled ``.grad`` is grad1's sum over the token count."""
    torch.manual_seed(0)
    model = TinyDecoder().to(D)
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-4)
    warmup, total = 1, 4  # (torchtune's get_cosine_schedule_with_warmup)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: step / warmup if step < warmup
        else 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup))),
    )  # fmt: skip
    ignore_index, accumulation = -100, 2
    ignore_labels_cache = torch.full((3, 1), ignore_index)
    g = torch.Generator().manual_seed(0)

    def micro_batch():
        tokens = torch.randint(11, (3, 6), generator=g)
        labels = tokens.clone()
        labels[0, 4:], labels[2, 3:] = ignore_index, ignore_index  # (padded)
        return tokens, torch.hstack((labels[..., 1:], ignore_labels_cache[: labels.shape[0]]))

    def token_sums(logits, labels):
        ce = F.cross_entropy(
            logits.transpose(1, 2), labels, ignore_index=ignore_index, reduction="none"
        )
        return ce.sum(1)

    with gradhooks.add_hooks(model, loss_reduction="sum"):
        model.train()
        for update in range(2):
            num_tokens, want = 0, None
            for micro in range(accumulation):
                tokens, labels = micro_batch()
                current_num_tokens = (labels != ignore_index).sum()
                num_tokens += current_num_tokens
                torch.manual_seed(60 + micro)
                logits = model(tokens)
                loss = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=ignore_index)
                (loss * current_num_tokens).backward()
                torch.manual_seed(60 + micro)
                rows = batch_rows(
                    model, lambda t=tokens: model(t), lambda out, y=labels: token_sums(out, y)
                )
                want = rows if want is None else {n: want[n] + w for n, w in rows.items()}
            assert_grad1(model, want, f"update {update}", frozen_clean=True)
            for p in model.parameters():
                if p.grad is not None:
                    p.grad *= 1 / num_tokens
            for n, p in model.named_parameters():
                if p.requires_grad:
                    assert_close(p.grad, p.grad1.sum(0) / num_tokens, f"update {update} .grad {n}")
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            lr_scheduler.step()

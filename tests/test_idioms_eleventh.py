"""Training-loop idioms, an eleventh set: learned queries, decoders, odd batches, misuse.

Each test writes again, on a small model and over several steps (``zero_grad``, an optimizer's
step), an idiom the earlier sets do not run: DETR's object queries (an ``nn.Embedding``'s
weight repeated along the batch, decoded against each image's features, matched by the
Hungarian algorithm) and a Perceiver's latents expanded to the batch, as the attention's query;
the PyTorch seq2seq tutorial's decoder, started from a start token the same for every example;
a diffusion step (a timestep embedding, a learned null condition for classifier-free guidance,
min-SNR weights, an EMA copy); several noise samples per example by repeating the batch inside
the model; hard examples mined by the top-k of their focal losses; grad1 read after the
optimizer's step (Adam with ``amsgrad`` and ``foreach``, an embedding renormalized in place by
``max_norm``); a batch given as a dataclass or a namedtuple; a forward pre-hook of the user's
that changes a layer's input; a cosine or distance classifier over learned prototypes. And
misuse: reentrant checkpointing of an input that does not require grad, a backward of the
regulariser alone, graphs batched as one tensor of nodes; Glow's ActNorm initialized from the
first batch inside the hooked forward, a batch given as a list of examples, a layer run on
each example in a Python loop over the batch.
Each is compared with each example's own gradient by a per-example loop in float64
(:func:`gradhooks.oracle.loop_grad`), or checked to stop with an error that says what went
wrong and leaves the model as it was.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment
from torch import nn
from torch.nn.utils.rnn import pack_sequence, pad_sequence
from torch.utils.checkpoint import checkpoint

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_close, assert_grad1

D = torch.float64


def norms_of(want: dict) -> torch.Tensor:
    """Each example's gradient norm over every parameter of ``want`` (the loop's rows)."""
    return torch.sqrt(sum(g.flatten(1).square().sum(1) for g in want.values()))


# -- learned queries expanded to the batch, attending to each example --------------------------


class _DETR(nn.Module):
    """DETR's head on a small backbone: the image's features, sequence-first ``[HW, B, C]``
    with DETR's learned positions (two ``nn.Embedding`` called on ``arange``) added; ``query_embed.weight.unsqueeze(1).repeat(1, bs, 1)``
    (the object queries, the same for every image) added to a zero target, decoded by an
    ``nn.TransformerDecoderLayer`` against the features (its padded positions masked), then
    a class head and a box head per query."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Conv2d(2, 8, 3, padding=1)
        self.row_embed, self.col_embed = nn.Embedding(4, 4), nn.Embedding(4, 4)
        self.query_embed = nn.Embedding(3, 8)
        self.decoder = nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0)
        self.class_embed = nn.Linear(8, 3)  # two classes and "no object"
        self.bbox_embed = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, img, mask):
        h, w = img.shape[-2:]
        pos = torch.cat(  # DETR's PositionEmbeddingLearned, [H, W, C]
            [
                self.col_embed(torch.arange(w)).unsqueeze(0).expand(h, -1, -1),
                self.row_embed(torch.arange(h)).unsqueeze(1).expand(-1, w, -1),
            ],
            -1,
        )
        src = self.backbone(img).flatten(2).permute(2, 0, 1) + pos.flatten(0, 1).unsqueeze(1)
        query = self.query_embed.weight.unsqueeze(1).repeat(1, img.shape[0], 1)
        h = self.decoder(torch.zeros_like(query) + query, src, memory_key_padding_mask=mask)
        h = h.transpose(0, 1)  # [B, queries, C]
        return torch.cat([self.class_embed(h), self.bbox_embed(h).sigmoid()], -1)


def _detr_loss(out, target):
    """DETR's set loss, per image: each query matched to a target box or to "no object" by the
    Hungarian algorithm on the detached costs (one image's matching reads only its own
    outputs), then cross-entropy over the queries' classes and L1 over the matched boxes; the
    mean over the images."""
    logits, boxes = out[..., :3], out[..., 3:]
    losses = []
    for b in range(out.shape[0]):
        labels, tboxes = target[b, :, 0].long(), target[b, :, 1:]
        cost = torch.cdist(boxes[b], tboxes, p=1) - logits[b].softmax(-1)[:, labels]
        rows, cols = linear_sum_assignment(cost.detach().numpy())
        classes = torch.full((out.shape[1],), 2)
        classes[rows] = labels[cols]
        l1 = (boxes[b, rows] - tboxes[cols]).abs().sum() / len(cols)
        losses.append(F.cross_entropy(logits[b], classes) + l1)
    return torch.stack(losses).mean()


def _images(step: int):
    g = torch.Generator().manual_seed(step)
    img = torch.randn(3, 2, 4, 4, generator=g, dtype=D)
    mask = torch.zeros(3, 16, dtype=torch.bool)
    mask[step % 3, -4:] = True  # one image padded by its last row
    target = torch.cat(
        [torch.randint(2, (3, 2, 1), generator=g).to(D), torch.rand(3, 2, 2, generator=g, dtype=D)],
        -1,
    )
    return img, mask, target


def test_detr_object_queries_repeated_along_the_batch_through_the_decoder():
    """DETR's training loop: AdamW, ``clip_grad_norm_(0.1)``, three steps. The object queries
    (an ``nn.Embedding`` whose weight is used directly, never called) are repeated along the
    sequence-first batch, so the decoder's self-attention sees a batch-free query and its
    cross-attention a batch-free query against each image's features. Before, the tracker did
    not follow ``multi_head_attention_forward`` past a batch-free query: the class head's rule
    was given the queries as examples (a BatchNotFoundError naming it, advising ``batch_dim``),
    and batch first, the queries' weight was refused. grad1 (the queries' weight's included:
    each image's share of their gradient) is the float64 loop's, and so are the norms."""
    model = _DETR().to(D)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as hooks:
        for step in range(3):
            img, mask, target = _images(step)
            want = loop_grad(model, _detr_loss, (img, mask), target)
            opt.zero_grad()
            _detr_loss(model(img, mask), target).backward()
            assert_grad1(model, want, f"step {step}")
            torch.testing.assert_close(hooks.norms(), norms_of(want), rtol=1e-9, atol=1e-12)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            opt.step()


class _Perceiver(nn.Module):
    """A Perceiver's cross-attention: learned latents (a submodule's parameter) expanded to the
    batch, ``latents.expand(B, -1, -1)``, as the query against each example's projected
    inputs, batch first or sequence first."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.latents = nn.ParameterDict({"z": nn.Parameter(torch.randn(3, 8))})
        self.inp = nn.Linear(2, 8)
        self.cross = nn.MultiheadAttention(8, 2, batch_first=batch_first)
        self.head = nn.Linear(8, 2)
        self.batch_first = batch_first

    def forward(self, x):
        kv = self.inp(x)  # [B, S, C]
        z = self.latents["z"]
        if self.batch_first:
            q = z.expand(x.shape[0], -1, -1)
            h, _ = self.cross(q, kv, kv, need_weights=False)
            return self.head((h + q).mean(1))
        kv = kv.transpose(0, 1)
        q = z.unsqueeze(1).expand(-1, x.shape[0], -1)
        h, _ = self.cross(q, kv, kv)
        return self.head((h + q).mean(0))


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch first", "sequence first"])
def test_perceiver_latents_expanded_to_the_batch_as_the_attentions_query(batch_first):
    """Three steps of Adam on batches of 4, 5 and 4: grad1 (the latents' each example's share)
    is the float64 loop's. Before, the latents were refused ('multi_head_attention_forward'
    combines it with the batch in a way gradhooks cannot follow), or, sequence first, the head
    was given the latents as examples."""
    model = _Perceiver(batch_first).to(D)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with gradhooks.add_hooks(model):
        for step, n in enumerate((4, 5, 4)):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(n, 6, 2, generator=g, dtype=D), torch.randint(2, (n,), generator=g)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


# -- a decoder's first step: the start token's embedding, batch-free, from each example's state


_SOS, _VOCAB, _HIDDEN, _STEPS = 0, 7, 6, 4


class _Attention(nn.Module):
    """The tutorial's ``BahdanauAttention``."""

    def __init__(self) -> None:
        super().__init__()
        self.Wa, self.Ua = nn.Linear(_HIDDEN, _HIDDEN), nn.Linear(_HIDDEN, _HIDDEN)
        self.Va = nn.Linear(_HIDDEN, 1)

    def forward(self, query, keys):
        scores = self.Va(torch.tanh(self.Wa(query) + self.Ua(keys))).squeeze(2).unsqueeze(1)
        return torch.bmm(F.softmax(scores, dim=-1), keys)


class _Seq2Seq(nn.Module):
    """PyTorch's tutorial "Translation with a Sequence to Sequence Network and Attention"
    (batched): an ``EncoderRNN`` (Embedding, GRU, batch first) and a ``DecoderRNN`` that
    starts from ``torch.empty(batch, 1, dtype=torch.long).fill_(SOS_token)`` (the same for
    every example) and the encoder's last state, then feeds the target's token (teacher
    forcing) or its own detached ``topk`` choice back, one step at a time; with ``attention``,
    ``AttnDecoderRNN``. ``cell``: the recurrent layer (an LSTM's state is a pair)."""

    def __init__(self, cell: str, attention: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        rnn = getattr(nn, cell)
        self.enc_emb, self.enc_rnn = (
            nn.Embedding(_VOCAB, _HIDDEN),
            rnn(_HIDDEN, _HIDDEN, batch_first=True),
        )
        self.dec_emb = nn.Embedding(_VOCAB, _HIDDEN)
        width = 2 * _HIDDEN if attention else _HIDDEN
        self.dec_rnn = rnn(width, _HIDDEN, batch_first=True)
        self.attention = _Attention() if attention else None
        self.out = nn.Linear(_HIDDEN, _VOCAB)

    def forward(self, x, target=None):
        keys, state = self.enc_rnn(self.enc_emb(x))
        dec_in = torch.empty(x.shape[0], 1, dtype=torch.long).fill_(_SOS)
        outs = []
        for i in range(_STEPS):
            e = F.relu(self.dec_emb(dec_in))
            if self.attention is not None:
                h = state[0] if isinstance(state, tuple) else state
                e = torch.cat([e, self.attention(h.permute(1, 0, 2), keys)], dim=2)
            o, state = self.dec_rnn(e, state)
            o = self.out(o)
            outs.append(o)
            if target is not None:
                dec_in = target[:, i].unsqueeze(1)
            else:
                dec_in = o.topk(1)[1].squeeze(-1).detach()
        return F.log_softmax(torch.cat(outs, 1), dim=-1)


def _nll(out, target):
    return F.nll_loss(out.reshape(-1, _VOCAB), target.reshape(-1))


@pytest.mark.parametrize(
    "cell, attention, forcing",
    [
        ("GRU", False, True),
        ("GRU", False, False),
        ("LSTM", False, False),
        ("LSTM", False, True),
        ("GRU", True, False),
        ("LSTM", True, False),
    ],
    ids=[
        "GRU, teacher forcing",
        "GRU, greedy",
        "LSTM, greedy",
        "LSTM, teacher forcing",
        "attention, greedy",
        "LSTM, attention, greedy",
    ],
)
def test_seq2seq_tutorial_decoder_started_from_a_start_token_the_same_for_every_example(
    cell, attention, forcing
):
    """Two steps of Adam: grad1 of every parameter, the decoder's embedding's included (each
    example's share of the start token's gradient), is the float64 loop's. Before, without
    attention (whose context, concatenated, brings the examples into the first step's input),
    the decoder's recurrent layer was refused: its first step's input holds no examples, and
    the tracker took them from the state, on dimension 1, where a batch-first layer does not
    read them (a BatchNotFoundError), and the ``gru`` operation was not followed past a
    batch-free input (the embedding refused). With an LSTM (attention or not), the run-time
    check's backward failed in torch ('Trying to backward through the graph a second time'):
    the first step, its input from a batch-free call, runs under autograd, the next ones
    owned (without autograd), and the check's rerun of an owned step, differentiating with
    respect to the LSTM's parameters, went on through its inputs into the first step (whose
    share it would have counted again), freeing the forward's graph there."""
    model = _Seq2Seq(cell, attention).to(D)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with gradhooks.add_hooks(model):
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            x = torch.randint(1, _VOCAB, (3, 5), generator=g)
            target = torch.randint(1, _VOCAB, (3, _STEPS), generator=g)
            inputs = (x, target) if forcing else (x,)
            want = loop_grad(model, _nll, inputs, target)
            opt.zero_grad()
            _nll(model(*inputs), target).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


# -- diffusion: noised inputs, a timestep embedding, a learned null condition, min-SNR weights --


class _Denoiser(nn.Module):
    """A conditional noise predictor, as diffusers' ``train_text_to_image.py`` trains a UNet:
    the sinusoidal embedding of each example's timestep through an MLP; the class embedding,
    replaced by a learned null embedding (a parameter of the model's own, broadcast by
    ``torch.where``) for the examples whose condition is dropped (classifier-free guidance)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.time_mlp = nn.Sequential(nn.Linear(4, 8), nn.SiLU(), nn.Linear(8, 8))
        self.class_emb = nn.Embedding(5, 8)
        self.null = nn.Parameter(0.1 * torch.randn(8))
        self.net = nn.Sequential(nn.Linear(3 + 8, 16), nn.SiLU(), nn.Linear(16, 3))

    def forward(self, x_t, t, c, drop):
        freqs = torch.exp(-torch.arange(2, dtype=x_t.dtype) * 2.0)
        angles = t[:, None].to(x_t.dtype) * freqs
        emb = self.time_mlp(torch.cat([angles.sin(), angles.cos()], -1))
        cond = torch.where(drop[:, None], self.null, self.class_emb(c))
        return self.net(torch.cat([x_t, emb + cond], -1))


def _weighted_mse(out, target):
    """diffusers' min-SNR loss: each example's mean squared error times its weight (the last
    column of ``target``), averaged over the batch."""
    noise, weight = target[:, :-1], target[:, -1]
    return (F.mse_loss(out, noise, reduction="none").mean(1) * weight).mean()


def test_diffusion_step_with_a_learned_null_condition_and_min_snr_weights():
    """Three steps of AdamW with an EMA copy: each example's timestep and noise drawn, the
    noised input ``sqrt(ᾱ_t) x₀ + sqrt(1 - ᾱ_t) ε`` formed outside the model, 30% of the
    conditions dropped to the null embedding, the loss weighted by ``min(SNR, 5) / SNR``.
    grad1 (the null embedding's: nonzero for the dropped examples alone) is the float64
    loop's, each row with its example's weight."""
    model = _Denoiser().to(D)
    ema = torch.optim.swa_utils.AveragedModel(
        model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    alpha_bar = torch.linspace(0.99, 0.05, 10, dtype=D)
    with gradhooks.add_hooks(model):
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x0, noise = (
                torch.randn(6, 3, generator=g, dtype=D),
                torch.randn(6, 3, generator=g, dtype=D),
            )
            t, c = torch.randint(10, (6,), generator=g), torch.randint(5, (6,), generator=g)
            drop = torch.rand(6, generator=g) < 0.3
            drop[step] = True  # (at least one)
            a = alpha_bar[t]
            x_t = a.sqrt()[:, None] * x0 + (1 - a).sqrt()[:, None] * noise
            snr = a / (1 - a)
            target = torch.cat([noise, (snr.clamp(max=5.0) / snr)[:, None]], -1)
            want = loop_grad(model, _weighted_mse, (x_t, t, c, drop), target)
            opt.zero_grad()
            _weighted_mse(model(x_t, t, c, drop), target).backward()
            assert_grad1(model, want, f"step {step}")
            assert model.null.grad1[~drop].abs().max() == 0
            opt.step()
            ema.update_parameters(model)


# -- several samples per example: the batch repeated inside the model --------------------------


class _Importance(nn.Module):
    """An IWAE-like model: each example's code perturbed by ``K`` noise samples, decoded, and
    the ``K`` results combined by ``logsumexp``. The batch is repeated three ways:
    ``repeat_interleave(K, 0)`` (each example's samples together), ``repeat(K, 1)`` (the batch
    ``K`` times over) or ``unsqueeze(1).expand(-1, K, -1)`` then ``reshape``."""

    def __init__(self, how: str, k: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.dec = nn.Linear(3, 4), nn.Linear(4, 2)
        self.how, self.k = how, k

    def forward(self, x, eps):  # eps [B, K, 4]
        h, b, k = self.enc(x), x.shape[0], self.k
        if self.how == "repeat_interleave":
            z = h.repeat_interleave(k, dim=0) + eps.reshape(b * k, 4)
            out = self.dec(torch.tanh(z)).view(b, k, 2)
        elif self.how == "repeat":
            z = h.repeat(k, 1) + eps.transpose(0, 1).reshape(k * b, 4)
            out = self.dec(torch.tanh(z)).view(k, b, 2).transpose(0, 1)
        else:
            z = h.unsqueeze(1).expand(-1, k, -1) + eps
            out = self.dec(torch.tanh(z.reshape(b * k, 4))).view(b, k, 2)
        return torch.logsumexp(out, 1)


@pytest.mark.parametrize("how", ["repeat_interleave", "repeat", "expand"])
def test_several_noise_samples_per_example_by_repeating_the_batch(how):
    """Batches of 4, 5 and 4 over three SGD steps: grad1 is the float64 loop's, each
    example's samples summed into its row."""
    model = _Importance(how).to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with gradhooks.add_hooks(model):
        for step, n in enumerate((4, 5, 4)):
            g = torch.Generator().manual_seed(step)
            x, eps = (
                torch.randn(n, 3, generator=g, dtype=D),
                torch.randn(n, 3, 4, generator=g, dtype=D),
            )
            y = torch.randint(2, (n,), generator=g)
            want = loop_grad(model, F.cross_entropy, (x, eps), y)
            opt.zero_grad()
            F.cross_entropy(model(x, eps), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


# -- online hard example mining over a focal loss ----------------------------------------------


def _focal(out, y, gamma: float = 2.0):
    """The focal loss per example, ``(1 - p_y)^γ · CE``."""
    ce = F.cross_entropy(out, y, reduction="none", label_smoothing=0.05)
    return (1 - torch.exp(-ce)) ** gamma * ce


def test_hard_examples_mined_by_top_k_of_their_focal_losses():
    """OHEM: each step keeps the ``k = 3`` of 8 examples with the largest focal loss
    (``losses.topk(k).indices``, read from the batch's own losses) and backwards their mean.
    grad1 follows the batched model: the unselected examples' rows are zero, the selected
    ones are their own loss's gradient times ``8 / 3`` (``loss_reduction="mean"`` over 8)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.GELU(), nn.LayerNorm(6), nn.Linear(6, 3)).to(D)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, amsgrad=True)
    with gradhooks.add_hooks(model):
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 3, generator=g, dtype=D), torch.randint(3, (8,), generator=g)
            per = loop_grad(model, lambda o, t: _focal(o, t).sum(), x, y)
            opt.zero_grad()
            losses = _focal(model(x), y)
            hard = losses.topk(3).indices
            losses[hard].mean().backward()
            weight = torch.zeros(8, dtype=D)
            weight[hard] = 8 / 3
            want = {n: v * weight.view(-1, *[1] * (v.dim() - 1)) for n, v in per.items()}
            assert_grad1(model, want, f"step {step}")
            opt.step()


# -- grad1 read after the optimizer's step ------------------------------------------------------


class _Tagger(nn.Module):
    """An embedding whose rows are renormalized in place at each forward (``max_norm``), a
    convolution, a LayerNorm, a GRU and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 4, max_norm=1.0)
        with torch.no_grad():
            self.emb.weight.mul_(3)  # (rows longer than max_norm: renormalized when used)
        self.conv, self.norm = nn.Conv1d(4, 4, 3, padding=1), nn.LayerNorm(4)
        self.gru, self.head = nn.GRU(4, 4, batch_first=True), nn.Linear(4, 3)

    def forward(self, tokens):
        h = self.conv(self.emb(tokens).transpose(1, 2)).transpose(1, 2)
        return self.head(self.gru(self.norm(h))[0][:, -1])


@pytest.mark.parametrize(
    "options",
    [dict(amsgrad=True, foreach=True), dict(foreach=False, weight_decay=0.1)],
    ids=["amsgrad, foreach", "for loop, weight decay"],
)
def test_grad1_read_after_the_optimizers_step_is_the_gradient_the_step_used(options):
    """A logger that reads grad1 after ``optimizer.step()`` (which rewrote every parameter in
    place) and before the next ``zero_grad``: it is the gradient at the weights the step
    started from, the float64 loop's of the batch, as ``.grad`` is; the embedding's rows
    renormalized in place by ``max_norm`` at each forward change nothing of that."""
    model = _Tagger().to(D)
    opt = torch.optim.Adam(model.parameters(), lr=0.1, **options)
    with gradhooks.add_hooks(model):
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            tokens, y = torch.randint(10, (5, 6), generator=g), torch.randint(3, (5,), generator=g)
            model(tokens)  # (the rows it uses renormalized first, as the loop's forwards will)
            want = loop_grad(model, F.cross_entropy, tokens, y)
            opt.zero_grad()
            F.cross_entropy(model(tokens), y).backward()
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt.step()
            assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())
            assert_grad1(model, want, f"step {step}, after the step")
            for p in model.parameters():
                torch.testing.assert_close(p.grad1.sum(0) / 5, p.grad, rtol=1e-10, atol=1e-12)


# -- a batch in a dataclass or a namedtuple ------------------------------------------------------


@dataclasses.dataclass
class _Batch:
    features: torch.Tensor
    mask: torch.Tensor


_Pair = collections.namedtuple("_Pair", "features mask")


class _Masked(nn.Module):
    """A model given its batch as one object (``batch.features``, ``batch.mask``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, batch):
        return self.b(torch.tanh(self.a(batch.features)) * batch.mask)


class _Unpacked(nn.Module):
    """The loop's view of the same model: the batch's fields as tensors, for ``loop_grad``."""

    def __init__(self, model: nn.Module, kind: type) -> None:
        super().__init__()
        self.model, self.kind = model, kind

    def forward(self, features, mask):
        return self.model(self.kind(features, mask))


@pytest.mark.parametrize("kind", [_Batch, _Pair], ids=["dataclass", "namedtuple"])
def test_a_batch_given_as_a_dataclass_or_a_namedtuple(kind):
    """A collate function that returns a dataclass (or a namedtuple) of the batch's tensors,
    passed whole to the model: three SGD steps, batches of 5, 3 and 5; grad1 is the float64
    loop's."""
    model = _Masked().to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step, n in enumerate((5, 3, 5)):
            g = torch.Generator().manual_seed(step)
            features = torch.randn(n, 3, generator=g, dtype=D)
            mask = (torch.rand(n, 4, generator=g) > 0.3).to(D)
            y = torch.randint(2, (n,), generator=g)
            want = loop_grad(_Unpacked(model, kind), F.cross_entropy, (features, mask), y)
            opt.zero_grad()
            F.cross_entropy(model(kind(features, mask)), y).backward()
            assert_grad1(model, {n[len("model.") :]: v for n, v in want.items()}, f"step {step}")
            opt.step()


# -- a forward pre-hook of the user's that changes a layer's input ------------------------------


def _standardize(module, args, kwargs=None):
    """An input normalization put on a layer as a forward pre-hook: its first input, shifted
    and scaled (also given as a keyword hook, ``with_kwargs=True``)."""
    new = (2.0 * args[0] + 1.0, *args[1:])
    return new if kwargs is None else (new, kwargs)


@pytest.mark.parametrize(
    "when, prepend, with_kwargs",
    [("before", False, False), ("before", True, False), ("after", False, False),
     ("after", True, True)],
    ids=["before add_hooks", "before, prepended", "after add_hooks", "after, prepended, kwargs"],
)  # fmt: skip
def test_a_forward_pre_hook_that_changes_a_layers_input(when, prepend, with_kwargs):
    """A pre-hook on a Linear and one on a Conv1d (layers with rules, not recomputed by the
    fallback), put on before or after ``add_hooks``, first or last among the module's
    pre-hooks: the rules are given the input the layer computed with, the hook's. grad1 is
    the float64 loop's (the loop's forwards run the hooks too) over three SGD steps."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv1d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(9, 4), nn.Tanh(), nn.Linear(4, 2)
    ).to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def put_on():
        return [
            model[i].register_forward_pre_hook(
                _standardize, prepend=prepend, with_kwargs=with_kwargs
            )
            for i in (0, 3)
        ]

    handles = put_on() if when == "before" else []
    with gradhooks.add_hooks(model):
        handles = handles or put_on()
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(5, 2, 5, generator=g, dtype=D), torch.randint(2, (5,), generator=g)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()
    for h in handles:
        h.remove()


# -- misuse --------------------------------------------------------------------------------------


class _Checkpointed(nn.Module):
    """A block run through ``torch.utils.checkpoint`` on the model's input itself, which does
    not require grad, then a head."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Sequential(nn.Linear(3, 4), nn.Tanh())
        self.head = nn.Linear(4, 2)
        self.reentrant = reentrant

    def forward(self, x):
        return self.head(checkpoint(self.block, x, use_reentrant=self.reentrant))


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_reentrant_checkpointing_of_an_input_without_grad_leaves_the_block_without_grad1(
    reentrant,
):
    """The known trap of reentrant checkpointing: with no input that requires grad, the
    checkpointed block's parameters get no gradient at all (torch warns, ``.grad`` stays
    ``None``), step after step with ``zero_grad(set_to_none=False)``. gradhooks follows the
    batched model: the block's parameters get no grad1 either, the head's is the float64
    loop's; non-reentrant, every parameter's is the loop's."""
    model = _Checkpointed(reentrant).to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "None of the inputs have requires_grad")
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(5, 3, generator=g, dtype=D), torch.randint(2, (5,), generator=g)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad(set_to_none=False)
            F.cross_entropy(model(x), y).backward()
            for n, p in model.named_parameters():
                if reentrant and n.startswith("block"):
                    assert p.grad is None and not hasattr(p, "grad1"), n
                else:
                    assert_close(p.grad1, want[n], f"step {step}: {n}")
            opt.step()


def test_a_backward_of_the_regulariser_alone_warns_and_writes_no_grad1():
    """A loop that, for one step, backwards only its L2 penalty (the batch's loss forgotten,
    the forward run for nothing): autograd gives every parameter a gradient, which no example
    owns. gradhooks warns (a GradhooksWarning naming the parameters) and writes no grad1; the
    next step's grad1 is the float64 loop's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4, 3, generator=g, dtype=D), torch.randint(2, (4,), generator=g)
            opt.zero_grad()
            out = model(x)
            if step == 1:
                penalty = 1e-2 * sum(p.square().sum() for p in model.parameters())
                with pytest.warns(gradhooks.GradhooksWarning, match="0.weight"):
                    penalty.backward()
                assert all(p.grad is not None for p in model.parameters())
                assert not any(hasattr(p, "grad1") for p in model.parameters())
            else:
                want = loop_grad(model, F.cross_entropy, x, y)
                F.cross_entropy(out, y).backward()
                assert_grad1(model, want, f"step {step}")
            opt.step()


class _GraphClassifier(nn.Module):
    """Graph classification batched as PyTorch Geometric does: every graph's nodes stacked in
    one ``[nodes, features]`` tensor, a ``batch`` vector giving each node's graph, a
    node-wise layer, then a sum pool per graph (``index_add``) and a head over the graphs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.node, self.head = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x, batch, graphs: int):
        h = torch.tanh(self.node(x))
        return self.head(torch.zeros(graphs, 4, dtype=h.dtype).index_add(0, batch, h))


def test_graphs_batched_as_one_tensor_of_nodes_are_refused_naming_the_head():
    """The batch gradhooks finds is the model's first input's dimension 0: the nodes, not the
    graphs. The pool sums nodes into graphs, so the head's input mixes those "examples": the
    backward is refused with a MixedExamplesError naming the head and ``index_add``, leaving
    ``.grad`` and grad1 as they were (``None``) and the parameters untouched."""
    model = _GraphClassifier().to(D)
    before = [p.detach().clone() for p in model.parameters()]
    batch = torch.repeat_interleave(torch.arange(3), torch.tensor([3, 2, 4]))
    x, y = torch.randn(9, 3, dtype=D), torch.tensor([0, 1, 1])
    with gradhooks.add_hooks(model):
        with pytest.raises(gradhooks.MixedExamplesError, match=r"'head'.*index_add"):
            F.cross_entropy(model(x, batch, 3), y).backward()
    for p, q in zip(model.parameters(), before, strict=True):
        assert p.grad is None and not hasattr(p, "grad1")
        assert torch.equal(p.detach(), q)


class _ActNorm(nn.Module):
    """Glow's ActNorm: at its first forward in training, its shift and log-scale are set from
    the batch's statistics (``loc.data.copy_(-x.mean(0))``, under ``no_grad``), once; a flag
    (a buffer, as glow-pytorch keeps it, or a plain attribute) says it is done."""

    def __init__(self, features: int, flag: str) -> None:
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(1, features))
        self.logs = nn.Parameter(torch.zeros(1, features))
        self.flag = flag
        if flag == "buffer":
            self.register_buffer("initialized", torch.tensor(0, dtype=torch.uint8))
        else:
            self.initialized = False

    def forward(self, x):
        if not bool(self.initialized):
            with torch.no_grad():
                self.loc.data.copy_(-x.mean(0, keepdim=True))
                self.logs.data.copy_(-torch.log(x.std(0, keepdim=True) + 1e-6))
            if self.flag == "buffer":
                self.initialized.fill_(1)
            else:
                self.initialized = True
        return (x + self.loc) * torch.exp(self.logs)


class _Flow(nn.Module):
    def __init__(self, flag: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm, self.lin, self.out = _ActNorm(3, flag), nn.Linear(3, 3), _ActNorm(3, flag)

    def forward(self, x):
        return self.out(torch.tanh(self.lin(self.norm(x))))


def _energy(out):
    return 0.5 * out.square().sum()


@pytest.mark.filterwarnings("ignore:std\\(\\)")  # (the recomputation's one example)
@pytest.mark.parametrize("flag", ["buffer", "attribute"])
def test_actnorm_initialized_from_the_first_batch_inside_the_hooked_forward(flag):
    """Glow's data-dependent initialization, run by the first hooked forward. The ActNorms
    have no rule: the fallback recomputes them per example at the backward. With the flag a
    buffer, the recomputation from the state the call found initializes again from one example
    and does not reproduce the forward's output; the one from the state the call left does.
    From the first step, grad1 is the float64 loop's over the model as its forward left it
    (``loss_reduction="sum"``)."""
    model = _Flow(flag).to(D)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for step in range(3):
            x = torch.randn(6, 3, generator=torch.Generator().manual_seed(step), dtype=D) * 3 + 1
            opt.zero_grad()
            out = model(x)
            want = loop_grad(model, _energy, x)
            _energy(out).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


class _Stacker(nn.Module):
    """A token tagger given its batch as a list of examples, ``[tokens, features]`` each,
    joined in its forward (a ``collate_fn`` that returns the list as it is): stacked, each
    given a dimension of one and concatenated, or each run through the layers and the results
    stacked. A tensor (the examples already stacked) is taken as it is."""

    def __init__(self, join: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)
        self.join = join

    def layers(self, x):
        return self.b(torch.tanh(self.a(x)))

    def forward(self, examples):
        if isinstance(examples, torch.Tensor):
            return self.layers(examples)
        if self.join == "stack":
            return self.layers(torch.stack(list(examples)))
        if self.join == "cat":
            return self.layers(torch.cat([e[None] for e in examples]))
        return torch.stack([self.layers(e) for e in examples])


def _tagging(out, target):
    return F.cross_entropy(out.reshape(-1, 2), target.reshape(-1))


@pytest.mark.parametrize("join", ["stack", "cat", "each"])
def test_a_batch_given_as_a_list_of_examples_joined_in_the_forward(join):
    """Five sequences of 4 tokens each, in a list: the batch is taken from dimension 0 of the
    first (its 4 tokens), and the join puts the list's index in front of it. Before, every
    grad1 had a row per token position, summed over the examples, with no error; the forward
    is now refused, naming the model and the join, and leaves no grad1. The same handle then
    gives the examples stacked before the call the float64 loop's grad1 (one row per
    sequence)."""
    model = _Stacker(join).to(D)
    examples = [torch.randn(4, 3, generator=torch.Generator().manual_seed(i), dtype=D)
                for i in range(5)]  # fmt: skip
    y = torch.randint(2, (5, 4), generator=torch.Generator().manual_seed(9))
    batch = torch.stack(examples)
    want = loop_grad(model, _tagging, batch, y)
    with gradhooks.add_hooks(model):
        with pytest.raises(gradhooks.BatchNotFoundError, match=r"'_Stacker'.*torch\.(stack|cat)"):
            model(examples)
        assert not any(hasattr(p, "grad1") for p in model.parameters())
        _tagging(model(batch), y).backward()
        assert_grad1(model, want, "the examples stacked before the call")


class _Padder(nn.Module):
    """A tagger given a list of sequences of different lengths, ``[length, features]`` each,
    padded in its forward by ``pad_sequence`` (``batch_first`` or time-first, turned to
    batch-first), or packed by ``pack_sequence`` after each is run through a Linear on its own
    and given to an LSTM (the common form of this idiom). A tensor (padded before the call) is
    taken as it is."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)
        self.rnn = nn.LSTM(4, 4, batch_first=True) if how == "packed" else None
        self.how = how

    def forward(self, seqs):
        if isinstance(seqs, torch.Tensor):
            return self.b(torch.tanh(self.a(seqs)))
        if self.how == "batch_first":
            x = pad_sequence(list(seqs), batch_first=True)
        elif self.how == "time_first":
            x = pad_sequence(list(seqs)).transpose(0, 1)
        else:
            packed = pack_sequence([self.a(s) for s in seqs], enforce_sorted=False)
            return self.b(self.rnn(packed)[1][0][-1])
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("lengths", [(4, 4, 4, 4, 4), (4, 2, 3, 4, 1), (5, 2, 3, 4, 1)])
@pytest.mark.parametrize("how", ["batch_first", "time_first", "packed"])
def test_a_list_of_sequences_padded_in_the_forward(how, lengths):
    """A list of 5 sequences padded (or packed) inside the forward: the batch is taken from the
    first sequence's length. Before, a first sequence as long as the list and shorter others
    gave grad1 rows that were no example's, with no error (all as long as the list: right by
    that coincidence); other lengths an error that pointed to batch_dim, where no batch_dim
    helps. Now refused at the forward whatever the lengths, naming the model and
    pad_sequence, with no grad1 left; the sequences padded before the call (one length) then
    give the float64 loop's grad1."""
    model = _Padder(how).to(D)
    seqs = [torch.randn(n, 3, generator=torch.Generator().manual_seed(i), dtype=D)
            for i, n in enumerate(lengths)]  # fmt: skip
    with gradhooks.add_hooks(model):
        with pytest.raises(gradhooks.UnsupportedInputError, match=r"'_Padder'.*pad_sequence"):
            model(seqs)
        assert not any(hasattr(p, "grad1") for p in model.parameters())
        if how == "packed":
            return
        batch = torch.randn(5, 4, 3, generator=torch.Generator().manual_seed(7), dtype=D)
        y = torch.randint(2, (5, 4), generator=torch.Generator().manual_seed(9))
        want = loop_grad(model, _tagging, batch, y)
        _tagging(model(batch), y).backward()
        assert_grad1(model, want, "the sequences padded before the call")


class _Views(nn.Module):
    """An encoder given several views of each example of one batch (augmentations, crops),
    each ``[batch, features]``, in a list: run on them concatenated along the batch (SimCLR's
    and DINO's ``torch.cat(views)``), stacked behind the batch (``torch.stack(views, 1)``),
    each on its own (its outputs a tuple, or stacked behind the batch), stacked in front of
    the batch (``torch.stack(views)``), or on their sum over a last dimension they are stacked
    along. A tensor ``[batch, views, features]`` is taken as its views (the loop's input)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
        self.how = how

    def forward(self, views):
        if isinstance(views, torch.Tensor):
            views = list(views.unbind(1))
        if self.how == "cat":
            return self.enc(torch.cat(views))
        if self.how == "stack_behind":
            return self.enc(torch.stack(views, 1))
        if self.how == "each":
            return tuple(self.enc(v) for v in views)
        if self.how == "each_stacked_behind":
            return torch.stack([self.enc(v) for v in views], 1)
        if self.how == "stack_last":
            return self.enc(torch.stack(views, -1).sum(-1))
        return self.enc(torch.stack(views))


def _energy_of_all(out):
    return sum(0.5 * o.square().sum() for o in (out if isinstance(out, tuple) else (out,)))


@pytest.mark.parametrize("batch", [4, 1])
@pytest.mark.parametrize(
    "how", ["cat", "stack_behind", "each", "each_stacked_behind", "stack_last"]
)
@pytest.mark.parametrize("box", [list, tuple])
def test_a_list_of_views_of_one_batch(box, how, batch):
    """Three views of each of the batch's examples in a list (or a tuple), each ``[batch,
    features]``, as self-supervised methods give them: joined along the batch or behind it, or
    run one by one, grad1 is the float64 loop's over the examples (each example's views
    together), for a batch of one too."""
    model = _Views(how).to(D)
    x = torch.randn(batch, 3, 3, generator=torch.Generator().manual_seed(1), dtype=D)
    want = loop_grad(model, _energy_of_all, x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        _energy_of_all(model(box(x.unbind(1)))).backward()
    assert_grad1(model, want, f"{how}, {box.__name__}")


def test_a_list_of_views_stacked_in_front_of_the_batch():
    """``torch.stack(views)`` (``[views, batch, features]``) looks as a list of examples
    stacked does: refused under the default batch_dim; with ``batch_dim=0`` said, grad1 is the
    float64 loop's."""
    model = _Views("stack_front").to(D)
    x = torch.randn(4, 3, 3, generator=torch.Generator().manual_seed(1), dtype=D)
    want = loop_grad(model, _energy_of_all, x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with pytest.raises(gradhooks.BatchNotFoundError, match="batch_dim=0"):
            model(list(x.unbind(1)))
    with gradhooks.add_hooks(model, loss_reduction="sum", batch_dim=0):
        _energy_of_all(model(list(x.unbind(1)))).backward()
    assert_grad1(model, want, "batch_dim=0")


class _Pair(nn.Module):
    """A siamese encoder given two inputs as arguments (``model(a, b)``), its two embeddings
    stacked in front of the batch, or a list of feature maps of other sizes
    (``[batch, positions, features]`` each, an FPN's levels) pooled and added."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))

    def forward(self, a, b=None):
        if b is not None:
            return torch.stack([self.enc(a), self.enc(b)])
        return sum(self.enc(level).sum(1) for level in a)


def test_siamese_inputs_and_a_list_of_feature_maps():
    """``model(a, b)`` stacked in front of the batch, and a list of feature maps: grad1 is the
    float64 loop's (the arguments are no list)."""
    model = _Pair().to(D)
    a, b = (torch.randn(4, 3, generator=torch.Generator().manual_seed(i), dtype=D) for i in (1, 2))
    want = loop_grad(model, _energy_of_all, (a, b))
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        _energy_of_all(model(a, b)).backward()
    assert_grad1(model, want, "siamese")
    levels = [torch.randn(4, n, 3, generator=torch.Generator().manual_seed(n), dtype=D)
              for n in (7, 5)]  # fmt: skip
    rows = []
    for i in range(4):  # (the loop by hand: loop_grad takes the batch from a first tensor)
        model.zero_grad()
        _energy_of_all(model([level[i : i + 1] for level in levels])).backward()
        rows.append({n: p.grad.clone() for n, p in model.named_parameters()})
    want = {n: torch.stack([r[n] for r in rows]) for n in rows[0]}
    model.zero_grad()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        _energy_of_all(model(levels)).backward()
    assert_grad1(model, want, "feature maps")


# -- a cosine or distance classifier over learned prototypes ----------------------------------


class _PrototypeHead(nn.Module):
    """A classifier scoring each example's features against learned class prototypes (an
    ``nn.Embedding``'s weight, used directly): ``scale · cos(h, p_c)`` by
    ``F.cosine_similarity(h.unsqueeze(1), protos.unsqueeze(0), dim=-1)``, or ``-‖h - p_c‖`` by
    ``F.pairwise_distance`` broadcast the same way."""

    def __init__(self, score: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 4))
        self.protos = nn.Embedding(5, 4)
        self.score = score

    def forward(self, x):
        h, p = self.enc(x).unsqueeze(1), self.protos.weight.unsqueeze(0)
        if self.score == "cosine":
            return 10.0 * F.cosine_similarity(h, p, dim=-1)
        return -F.pairwise_distance(h, p)


@pytest.mark.parametrize("score", ["cosine", "distance"])
def test_a_cosine_or_distance_classifier_over_learned_prototypes(score):
    """Three Adam steps: grad1 (the prototypes' each example's share included) is the float64
    loop's, and so are the norms. Before, the tracker had no handler for
    ``cosine_similarity`` or ``pairwise_distance``: the prototypes were refused
    ('cosine_similarity' combines it with the batch in a way gradhooks cannot follow)."""
    model = _PrototypeHead(score).to(D)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as hooks:
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(6, 3, generator=g, dtype=D), torch.randint(5, (6,), generator=g)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            torch.testing.assert_close(hooks.norms(), norms_of(want), rtol=1e-9, atol=1e-12)
            opt.step()


class _RowByRow(nn.Module):
    """A forward that runs its first layer on each example alone, in a Python loop over the
    batch (``for row in x``, ``x.split(1)``, ``x.chunk(len(x))``, ``x[i : i + 1]``,
    ``x.narrow(0, i, 1)``), and puts the rows back together."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)
        self.how = how

    def rows(self, x) -> list:
        n = len(x)
        return {
            "iterate": lambda: list(x),
            "unbind": lambda: list(x.unbind()),
            "index": lambda: [x[i] for i in range(n)],
            "split": lambda: list(x.split(1)),
            "chunk": lambda: list(x.chunk(n)),
            "slice": lambda: [x[i : i + 1] for i in range(n)],
            "narrow": lambda: [x.narrow(0, i, 1) for i in range(n)],
        }[self.how]()

    def forward(self, x):
        outs = [self.a(row) for row in self.rows(x)]
        h = torch.stack(outs) if outs[0].dim() == 1 else torch.cat(outs)
        return self.b(torch.tanh(h))


_ALONE = pytest.mark.xfail(
    strict=True,
    raises=gradhooks.MixedExamplesError,
    reason="a refusal, not a wrong number: an example taken out of the batch alone by x[i], "
    "unbind or iteration has no dimension that holds it (a layout says which dimension holds "
    "the examples; for x[i] none does), so the layer given it is refused (saying that it is "
    "one example taken out alone, and to keep its batch dimension). A part of the batch dimension "
    "(split(1), chunk, x[i:i+1], narrow) is followed: rows picked from the batch, as by an index",
)


@pytest.mark.parametrize(
    "how",
    [
        pytest.param("iterate", marks=_ALONE),
        pytest.param("unbind", marks=_ALONE),
        pytest.param("index", marks=_ALONE),
        "split",
        "chunk",
        "slice",
        "narrow",
    ],
)
def test_a_layer_run_on_each_example_in_a_python_loop_over_the_batch(how):
    """grad1 is the float64 loop's: each call of ``a`` is one example's."""
    model = _RowByRow(how).to(D)
    x, y = torch.randn(4, 3, dtype=D), torch.tensor([0, 1, 1, 0])
    want = loop_grad(model, F.cross_entropy, x, y)
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x), y).backward()
    assert_grad1(model, want, how)


class _Shuffled(nn.Module):
    """The row-by-row loop over the examples in a random order (each run draws its own), put
    back in order by the inverse permutation before the next layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)
        self.g = torch.Generator().manual_seed(3)

    def forward(self, x):
        order = torch.randperm(len(x), generator=self.g)
        h = torch.cat([self.a(x[j : j + 1]) for j in order.tolist()])
        return self.b(torch.tanh(h[order.argsort()]))


def test_the_row_loop_in_another_order_put_back_by_the_inverse_permutation():
    """Each call of ``a`` sees one example, in a shuffled order; the rows, indexed back into
    order, are the batch again: grad1 is the loop's."""
    model = _Shuffled().to(D)
    x, y = torch.randn(5, 3, dtype=D), torch.tensor([0, 1, 1, 0, 1])
    want = loop_grad(model, F.cross_entropy, x, y)
    with gradhooks.add_hooks(model):
        out = model(x)
        F.cross_entropy(out, y).backward()
    assert_grad1(model, want, "shuffled")


class _Permuted(nn.Module):
    """The rows kept in a permuted order (``x[perm[i] : perm[i] + 1]``), not put back."""

    def __init__(self, perm: list[int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.perm = nn.Linear(3, 2), perm

    def forward(self, x):
        return torch.cat([self.a(x[j : j + 1]) for j in self.perm])


def test_the_row_loop_in_a_permuted_order_to_the_output_is_refused():
    """The rows stay in the permuted order to the loss: row ``r`` is example ``perm[r]``'s, and
    a loss that pairs the rows with targets (a weight per row, ``w[r]``) pairs example
    ``perm[r]`` with example ``r``'s target, which the per-example loop never does (each
    example alone meets its own). Once, grad1 was each example's row's gradient with another's
    target, with no error; refused at the forward, naming the output."""
    perm = [2, 0, 3, 1]
    model = _Permuted(perm).to(D)
    x = torch.randn(4, 3, dtype=D)
    w = torch.randn(4, 2, dtype=D)  # (a weight per row of the output, to tell them apart)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with pytest.raises(gradhooks.BatchNotFoundError, match=r"output .* another order"):
            (model(x) * w).sum().backward()
    assert all(p.grad is None and not hasattr(p, "grad1") for p in model.parameters())


def test_an_example_taken_by_a_tensor_index_alone_is_refused():
    """``x[perm[i]]`` (a tensor index of no dimension) takes one example out of the batch
    alone: no dimension holds it, and the layer given it is refused, never misread."""
    model = _Permuted([0]).to(D)
    perm = torch.tensor([2, 0, 3, 1])

    def forward(x):
        return torch.stack([model.a(x[perm[i]]) for i in range(len(x))])

    model.forward = forward
    with gradhooks.add_hooks(model), pytest.raises(gradhooks.MixedExamplesError):
        model(torch.randn(4, 3, dtype=D)).sum().backward()


class _Dropping(nn.Module):
    """The row-by-row loop over all examples but the last."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x, keep: int):
        h = torch.cat([self.a(r) for r in x.split(1)[:keep]])
        return self.b(torch.tanh(h))


def test_the_row_loop_that_drops_an_example_is_refused():
    """The last example never reaches the loss by its place in the batch: the per-example
    loop, which runs the model on each example alone (where it stands first, and is kept),
    gives it its gradient. Once its grad1 was zero with no error; refused at the forward,
    naming the layer the others' rows reach (tests/test_fixed_rows.py), nothing written."""
    model = _Dropping().to(D)
    x = torch.randn(4, 3, dtype=D)
    want = loop_grad(model, lambda out: out.sum(), (x, 3))
    assert want["a.weight"][3].any()  # (the loop keeps the last example)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with pytest.raises(gradhooks.MixedExamplesError, match=r"'a' \(Linear\)"):
            model(x, 3).sum().backward()
    assert all(p.grad is None and not hasattr(p, "grad1") for p in model.parameters())


@pytest.mark.parametrize("how", ["split", "chunk"])
def test_the_row_loop_over_several_training_steps(how):
    """Three SGD steps of the row-by-row loop: at every step grad1 is the loop's at that
    step's weights."""
    model = _RowByRow(how).to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(5)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x = torch.randn(4, 3, dtype=D, generator=gen)
            y = torch.randint(0, 2, (4,), generator=gen)
            with gradhooks.paused():
                want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"{how}, step {step}")
            opt.step()


@pytest.mark.parametrize(
    "mix",
    [
        pytest.param(lambda p, x: p[0] + p[1], id="two-examples-added"),
        pytest.param(lambda p, x: p[0] * x, id="one-example-broadcast-to-all"),
        pytest.param(lambda p, x: p[0].sum(0, keepdim=True) + p[1], id="a-sum-added"),
        pytest.param(lambda p, x: torch.cat(p[:2]).sum(0, keepdim=True), id="two-summed"),
    ],
)
def test_rows_of_different_examples_combined_are_refused(mix):
    """Parts of the batch followed as rows of their examples: combining two examples' rows,
    or one example's with the whole batch, is refused at the layer that reads them."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 2).to(D)
    x = torch.randn(4, 3, dtype=D)
    model = nn.Module()
    model.lin = lin
    model.forward = lambda x: lin(mix(x.split(1), x))
    with gradhooks.add_hooks(model), pytest.raises(gradhooks.MixedExamplesError):
        model(x).sum().backward()

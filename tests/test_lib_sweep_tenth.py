"""A tenth round of other projects' models, each trained a few steps with gradhooks and checked
at every step against the float64 per-example loop; and five training scripts' loops.

Each model is a small excerpt of a public project's model code, rewritten in plain torch (each
class cites the repository and file it follows), at a tiny configuration: language models
(Transformer-XL's relative attention over a memory of the last segment, sequence first, with its
``_rel_shift`` by zero padding and a view; Hyena's implicit long convolutions by FFT; FNet's
Fourier mixing), vision (CBAM's channel and spatial gates, milesial's U-Net with its padded
upsampling and dice loss, EfficientDet's BiFPN with its fusion weights normalized by their sum,
ResMLP's affine layers, MAE's per-image random masking by argsort and ``gather``, DiT's adaLN
modulation), generative models (VQ-VAE's codebook by ``scatter_`` and the straight-through
estimator, AdaIN's style transfer through a frozen encoder, HiFi-GAN's ``weight_norm``
generator, Glow's ActNorm, LU-decomposed invertible convolutions and affine couplings),
reinforcement learning (Rainbow's noisy dueling distributional network, each
transition's action picked by ``log_ps[range(batch), actions]``), time series (RevIN around
DLinear's per-channel Linears, iTransformer's variates as tokens), tabular and recommendation
(TabNet's ghost batch norm, shared GLU blocks and sparsemax ``autograd.Function``, FiBiNET's
SENET and bilinear interactions, DCN-Mix's low-rank cross experts), text pairs and
summarization (ESIM's encoder, which sorts its batch by length, packs it and puts it back, and
its soft alignment; the pointer-generator's copy distribution by ``scatter_add`` and coverage
loss), speech (ECAPA-TDNN's Res2Net blocks, attentive statistics pooling and additive angular
margin; Conv-TasNet's gLN, separation masks, ``overlap_and_add`` and permutation-invariant
SI-SNR), graphs (EGNN's equivariant messages by ``index_add_``).

Each is built in float64 and training mode and trained three steps by AdamW under one
``add_hooks(model, loss_reduction="mean")``: the first and third a ``backward`` of the batch's
mean loss, whose ``grad1`` and per-example norms must equal each example's own gradient at that
step's weights (``rtol=1e-7``; ``1e-5`` where the model computes in float32 inside, as its
authors wrote it), the second gradhooks' DP step, whose clipped ``.grad`` must equal the loop's:
24 match. Eleven of them are also trained under CPU bfloat16 autocast
(``test_lib_sweep_eighth.train_bf16``). Four whose examples meet (example 0's loss moves with the
other examples' inputs) are refused by gradhooks' own error naming the layer, leaving the model,
``.grad``, ``grad1`` and the hooks as they were: TabNet and the U-Net with their batch norms in
training, and Barlow Twins, also with its projector's batch norm made a GroupNorm (the
cross-correlation's affine-free batch norm, without parameters, is left). Four of these models
once failed: Rainbow's ``range`` index was refused as mixing the examples
(``tests/test_tracking_ops.py``); TabNet's ghost batch norm in eval mode, over chunks of the
batch, was refused as in train mode (``tests/test_tracking_ops.py``); ESIM's encoder,
whose recurrent layer is given the batch in its sorted order, gave each example another's
gradient: refused at the first backward by the check against autograd, but silently wrong at a
later unchecked one where the first batches came sorted (``tests/test_layers_rnn.py``); and
Glow's layers, which have no rule and return beside their output a log-determinant of their
parameters alone, were refused by the fallback, where each example's share of its gradient is
now found where the forward adds it to the examples' own (``tests/test_stateful_forward.py``).

Five training scripts' loops follow, with gradhooks where their users would put it and each
step against the float64 loop: llm.c's ``train_gpt2.py`` (decay groups, warmup and cosine
decay, accumulated micro-steps of the loss inside the model over the micro-batch's counted
tokens, the prompts' targets ignored, clipping); MoCo v2's queue and momentum encoder
(updated inside the forward) under its SGD and cosine schedule; TD3's critic every iteration
and its actor every second through the critic's ``Q1`` method, two hooked networks;
word2vec's sparse embeddings under ``SparseAdam`` and a cosine schedule with the loss inside
the model; and denoising-diffusion-pytorch's ``Trainer``, its timesteps and noise drawn
inside the forward, over accumulated micro-batches, clipping and an EMA. No script found a
wrong number or a false refusal.
"""

from __future__ import annotations

import copy
import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange
from test_lib_sweep_eighth import Spec, built, train_bf16
from test_lib_sweep_seventh import cross_entropy, mse, own_gradients
from test_real_scripts_fifth import assert_all, flat, follow, loop, trainable
from torch import Tensor, nn

import gradhooks
from harness import corrupting, one_thread, raised  # noqa: F401 (one_thread: an autouse fixture)

B = 3  # the batch


# -- the checks: a few training steps, each against the float64 loop at its weights -----------


def flat_norms(per: dict[str, Tensor]) -> Tensor:
    return torch.cat([g.flatten(1) for g in per.values()], 1).norm(dim=1)


def assert_trains_as_the_loop(factory, steps: int = 3, lr: float = 1e-2) -> None:
    """The model in float64 and training mode, trained by AdamW for ``steps`` steps under one
    ``add_hooks(model, loss_reduction="mean")``: the even steps a ``backward`` of the batch's
    mean loss, whose ``grad1`` and per-example norms must equal each example's own gradient at
    that step's weights (a loop of batches of one, ``rtol`` of the spec) and whose ``grad1``
    must average to ``.grad`` (``atol`` a hundredth of ``rtol`` of the largest entry: where the
    model computes in float32 inside, a gradient near zero is its rounding); the odd steps
    gradhooks' DP step (clipping to half the largest norm, no noise), whose ``.grad`` must
    equal the loop's clipped mean."""
    spec = built(factory)
    model = spec.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    hooks = dict(loss_reduction="mean", quantities=("grad1", "norms"), **spec.hooks)
    with gradhooks.add_hooks(model, **hooks) as h:
        for step in range(steps):
            optimizer.zero_grad()
            want = own_gradients(spec)
            norms = flat_norms(want)
            scale = max(float(w.abs().max()) for w in want.values())
            tol = dict(rtol=spec.rtol, atol=spec.rtol * 1e-2 * scale)
            losses = spec.losses(model(*spec.args), *spec.targets)
            assert losses.shape == (len(norms),), losses.shape
            if step % 2:
                C = 0.5 * float(norms.max())
                gradhooks.dp_sgd_step(h, losses, max_norm=C, noise_multiplier=0.0)
                factor = (C / norms).clamp(max=1.0)
                for n, p in trainable.items():
                    clipped = (want[n] * factor.view(-1, *[1] * p.dim())).mean(0)
                    got = torch.zeros_like(p) if p.grad is None else p.grad
                    torch.testing.assert_close(
                        got, clipped, **tol, msg=lambda m, n=n, step=step: f"step {step} {n}: {m}"
                    )
            else:
                losses.mean().backward()
                for n, p in trainable.items():
                    if p.grad is None:
                        assert getattr(p, "grad1", None) is None and not want[n].any(), n
                        continue
                    assert getattr(p, "grad1", None) is not None, f"{n} has no grad1"
                    torch.testing.assert_close(
                        p.grad1,
                        want[n],
                        **tol,
                        msg=lambda m, n=n, step=step: f"step {step} {n}: {m}",
                    )
                    torch.testing.assert_close(p.grad1.mean(0), p.grad, **tol)
                torch.testing.assert_close(h.norms(), norms.to(h.norms().dtype), **tol)
            optimizer.step()


def really_mixes(spec: Spec) -> bool:
    """Whether example 0's loss changes where only the other examples' inputs do (their
    floating-point inputs moved): the examples meet somewhere in the model."""
    n = len(spec.args[0])

    def moved(t):
        if not (isinstance(t, Tensor) and t.is_floating_point() and len(t) == n):
            return t
        return torch.cat([t[:1], t[1:] + torch.randn_like(t[1:])])

    with torch.no_grad():
        before = spec.losses(spec.model(*spec.args), *spec.targets)[0]
        after = spec.losses(spec.model(*map(moved, spec.args)), *spec.targets)[0]
    return not torch.allclose(before, after)


def assert_refused(factory, error: type, says: list[str]) -> None:
    """The examples really meet (:func:`really_mixes`), and
    gradhooks refuses with its own ``error``, naming ``says``, leaving the parameters, ``.grad``,
    ``grad1`` and the model's hooks as they were."""
    spec = built(factory)
    assert really_mixes(spec), "the examples do not meet: a refusal would be false"
    before = {n: p.detach().clone() for n, p in spec.model.named_parameters()}
    hooks = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in spec.model.modules()]

    def run():
        with gradhooks.add_hooks(spec.model, loss_reduction="sum", **spec.hooks):
            spec.losses(spec.model(*spec.args), *spec.targets).sum().backward()

    raised(error, says, run)
    for n, p in spec.model.named_parameters():
        assert p.grad is None and getattr(p, "grad1", None) is None, n
        assert torch.equal(p.detach(), before[n]), n
    assert [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in spec.model.modules()] == (
        hooks
    )


def bn_eval(model: nn.Module) -> nn.Module:
    """The model with its batch norms in eval mode (a pretrained backbone's, frozen)."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
    return model


def seq_first(args, i):
    """Example ``i`` of sequence-first inputs ``[time, batch, ...]``."""
    return tuple(a[:, i : i + 1] for a in args)


def image_batch(side=8, classes=3, channels=3):
    return (torch.randn(B, channels, side, side),), (torch.randint(0, classes, (B,)),)


# -- language models ------------------------------------------------------------------------------


class XLPositionalEmbedding(nn.Module):
    """kimiyoung/transformer-xl, ``pytorch/mem_transformer.py``: ``PositionalEmbedding``, the
    sinusoids of the relative distances, ``[klen, 1, d]``."""

    def __init__(self, demb):
        super().__init__()
        self.register_buffer("inv_freq", 1 / (10000 ** (torch.arange(0.0, demb, 2.0) / demb)))

    def forward(self, pos_seq):
        sinusoid_inp = torch.outer(pos_seq, self.inv_freq)
        return torch.cat([sinusoid_inp.sin(), sinusoid_inp.cos()], dim=-1)[:, None, :]


class RelPartialLearnableMultiHeadAttn(nn.Module):
    """``mem_transformer.py``'s ``RelPartialLearnableMultiHeadAttn`` (post-norm): the memory
    concatenated in front of the segment, the content and position terms with the model's
    ``r_w_bias`` and ``r_r_bias`` added to the queries, the relative shift by zero padding and
    a view of the padded scores, the causal mask filled in float, softmax over the keys, all
    sequence first (``[qlen, klen, bsz, n_head]``)."""

    def __init__(self, n_head, d_model, d_head):
        super().__init__()
        self.n_head, self.d_head = n_head, d_head
        self.qkv_net = nn.Linear(d_model, 3 * n_head * d_head, bias=False)
        self.r_net = nn.Linear(d_model, n_head * d_head, bias=False)
        self.o_net = nn.Linear(n_head * d_head, d_model, bias=False)
        self.layer_norm = nn.LayerNorm(d_model)
        self.scale = 1 / (d_head**0.5)

    @staticmethod
    def _rel_shift(x):
        zero_pad = torch.zeros((x.size(0), 1, *x.size()[2:]), dtype=x.dtype)
        x_padded = torch.cat([zero_pad, x], dim=1)
        x_padded = x_padded.view(x.size(1) + 1, x.size(0), *x.size()[2:])
        return x_padded[1:].view_as(x)

    def forward(self, w, r, r_w_bias, r_r_bias, attn_mask, mems):
        qlen, rlen, bsz = w.size(0), r.size(0), w.size(1)
        w_heads = self.qkv_net(torch.cat([mems, w], 0))
        r_head_k = self.r_net(r)
        w_head_q, w_head_k, w_head_v = torch.chunk(w_heads, 3, dim=-1)
        w_head_q = w_head_q[-qlen:]
        klen = w_head_k.size(0)
        w_head_q = w_head_q.view(qlen, bsz, self.n_head, self.d_head)
        w_head_k = w_head_k.view(klen, bsz, self.n_head, self.d_head)
        w_head_v = w_head_v.view(klen, bsz, self.n_head, self.d_head)
        r_head_k = r_head_k.view(rlen, self.n_head, self.d_head)
        AC = torch.einsum("ibnd,jbnd->ijbn", (w_head_q + r_w_bias, w_head_k))
        BD = self._rel_shift(torch.einsum("ibnd,jnd->ijbn", (w_head_q + r_r_bias, r_head_k)))
        attn_score = AC + BD
        attn_score.mul_(self.scale)
        if attn_mask is not None and attn_mask.any().item():
            attn_score = (
                attn_score.float().masked_fill(attn_mask[:, :, :, None], -float("inf"))
            ).type_as(attn_score)
        attn_prob = F.softmax(attn_score, dim=1)
        attn_vec = torch.einsum("ijbn,jbnd->ibnd", (attn_prob, w_head_v))
        attn_vec = attn_vec.contiguous().view(qlen, bsz, self.n_head * self.d_head)
        return self.layer_norm(w + self.o_net(attn_vec))


class MemTransformerLM(nn.Module):
    """``mem_transformer.py``'s ``MemTransformerLM`` (``attn_type=0``, one cutoff: a plain
    embedding scaled by ``sqrt(d)`` and a softmax tied to it): two layers of the attention above
    and a position-wise feed-forward, each layer given its memory of the last segment (the
    hidden states ``_update_mems`` kept, detached, here an input ``[mlen, bsz, d]`` per layer);
    the causal mask shifted by the memory's length, ``triu(..., 1 + mlen)``."""

    def __init__(self, vocab=13, d_model=8, n_head=2, d_head=4, d_inner=12, n_layer=2):
        super().__init__()
        self.d_model = d_model
        self.word_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = XLPositionalEmbedding(d_model)
        self.r_w_bias = nn.Parameter(torch.randn(n_head, d_head) * 0.1)
        self.r_r_bias = nn.Parameter(torch.randn(n_head, d_head) * 0.1)
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                dict(
                    dec_attn=RelPartialLearnableMultiHeadAttn(n_head, d_model, d_head),
                    ff=nn.Sequential(
                        nn.Linear(d_model, d_inner), nn.ReLU(), nn.Linear(d_inner, d_model)
                    ),
                    ff_norm=nn.LayerNorm(d_model),
                )
            )
            for _ in range(n_layer)
        )
        self.out_bias = nn.Parameter(torch.zeros(vocab))

    def forward(self, data, *mems):  # data [qlen, bsz], each mems [mlen, bsz, d]
        qlen, mlen = data.size(0), mems[0].size(0)
        klen = mlen + qlen
        word_emb = self.word_emb(data) * self.d_model**0.5
        dec_attn_mask = torch.triu(word_emb.new_ones(qlen, klen), diagonal=1 + mlen).bool()
        pos_seq = torch.arange(klen - 1, -1, -1.0, dtype=word_emb.dtype)
        pos_emb = self.pos_emb(pos_seq)
        core_out = word_emb
        for i, layer in enumerate(self.layers):
            core_out = layer["dec_attn"](
                core_out, pos_emb, self.r_w_bias, self.r_r_bias, dec_attn_mask[:, :, None], mems[i]
            )
            core_out = layer["ff_norm"](core_out + layer["ff"](core_out))
        return F.linear(core_out, self.word_emb.weight, self.out_bias)


def xl_cross_entropy(logits, target):
    """Each sequence's summed token loss; ``logits`` ``[qlen, bsz, vocab]``, target
    ``[bsz, qlen]``."""
    return F.cross_entropy(logits.permute(1, 2, 0), target, reduction="none").sum(1)


def transformer_xl():
    data = torch.randint(0, 13, (5, B))
    mems = [torch.randn(3, B, 8) for _ in range(2)]  # (as long as the batch)
    return Spec(
        MemTransformerLM(),
        (data, *mems),
        xl_cross_entropy,
        (torch.randint(0, 13, (B, 5)),),
        split=seq_first,
        hooks=dict(batch_dim=1),
        rtol=1e-5,
    )  # (rtol: the scores masked in float32, as written)


def fftconv(u, k, D):
    """HazyResearch/safari, ``src/models/sequence/hyena.py``: ``fftconv``, the long
    convolution by a real FFT of twice the length, plus the skip ``D``."""
    seqlen = u.shape[-1]
    fft_size = 2 * seqlen
    k_f = torch.fft.rfft(k, n=fft_size) / fft_size
    u_f = torch.fft.rfft(u.to(dtype=k.dtype), n=fft_size)
    y = torch.fft.irfft(u_f * k_f, n=fft_size, norm="forward")[..., :seqlen]
    return (y + u * D.unsqueeze(-1)).to(dtype=u.dtype)


class Sin(nn.Module):
    """``hyena.py``'s ``Sin``: a sine of a learned frequency per channel."""

    def __init__(self, dim, w=10):
        super().__init__()
        self.freq = nn.Parameter(w * torch.ones(1, dim))

    def forward(self, x):
        return torch.sin(self.freq * x)


class HyenaFilter(nn.Module):
    """``hyena.py``'s ``HyenaFilter``: the implicit filter, an MLP with sine activations of a
    positional embedding (a time ramp and the real and imaginary parts of complex exponentials,
    here a buffer), decayed by ``ExponentialModulation``; its ``bias`` the skip ``D``."""

    def __init__(self, d_model, emb_dim=3, order=8, seq_len=8, w=1):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(d_model))
        act = Sin(order, w)
        t = torch.linspace(0, 1, seq_len)[None, :, None]
        bands = (emb_dim - 1) // 2
        t_rescaled = torch.linspace(0, seq_len - 1, seq_len)[None, :, None]
        f = torch.linspace(1e-4, bands - 1, bands)[None, None]
        z = torch.exp(-1j * f * 2 * math.pi * t_rescaled / seq_len)
        self.register_buffer("z", torch.cat([t, z.real, z.imag], dim=-1))
        self.register_buffer("t", t)
        self.implicit_filter = nn.Sequential(
            nn.Linear(emb_dim, order),
            act,
            nn.Linear(order, order),
            act,
            nn.Linear(order, d_model, bias=False),
        )
        max_decay, min_decay = math.log(1e-2) / 0.3, math.log(1e-2) / 1.5
        self.register_buffer("deltas", torch.linspace(min_decay, max_decay, d_model)[None, None])

    def filter(self, L):
        h = self.implicit_filter(self.z[:, :L])
        return h * torch.exp(-self.t[:, :L] * self.deltas.abs())

    def forward(self, x, L, k, bias):
        return fftconv(x, k, bias)


class HyenaOperator(nn.Module):
    """``hyena.py``'s ``HyenaOperator`` of order 2: the input projected to three streams, a
    short depthwise convolution, the long implicit convolution of the value gated by one
    stream before and by the other after, and the output projection."""

    def __init__(self, d_model=4, l_max=8, order=2):
        super().__init__()
        self.d_model, self.l_max, self.order = d_model, l_max, order
        inner_width = d_model * (order + 1)
        self.in_proj = nn.Linear(d_model, inner_width)
        self.out_proj = nn.Linear(d_model, d_model)
        self.short_filter = nn.Conv1d(inner_width, inner_width, 3, padding=2, groups=inner_width)
        self.filter_fn = HyenaFilter(d_model * (order - 1), seq_len=l_max)

    def forward(self, u):
        l_filter = min(u.size(-2), self.l_max)
        u = rearrange(self.in_proj(u), "b l d -> b d l")
        uc = self.short_filter(u)[..., :l_filter]
        *x, v = uc.split(self.d_model, dim=1)
        k = self.filter_fn.filter(l_filter)[0]
        k = rearrange(k, "l (o d) -> o d l", o=self.order - 1)
        bias = rearrange(self.filter_fn.bias, "(o d) -> o d", o=self.order - 1)
        for o, x_i in enumerate(reversed(x[1:])):
            v = self.filter_fn(v * x_i, l_filter, k=k[o], bias=bias[o])
        return self.out_proj(rearrange(v * x[0], "b d l -> b l d"))


class HyenaLM(nn.Module):
    """A pre-norm residual language model around the operator, as safari's ``SimpleLMHeadModel``
    wraps its mixers: token embeddings, one block of the operator and an MLP, a tied head."""

    def __init__(self, vocab=11, d=4, length=8):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, d)
        self.norm1, self.mixer = nn.LayerNorm(d), HyenaOperator(d, length)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, ids):
        h = self.embeddings(ids)
        h = h + self.mixer(self.norm1(h))
        h = h + self.mlp(self.norm2(h))
        return self.ln_f(h) @ self.embeddings.weight.T


def hyena():
    ids = torch.randint(0, 11, (B, 9))
    return Spec(HyenaLM(), (ids[:, :-1],), cross_entropy, (ids[:, 1:],))


# -- vision ----------------------------------------------------------------------------------------


class ChannelGate(nn.Module):
    """Jongchan/attention-module, ``MODELS/cbam.py``: ``ChannelGate``, a shared MLP on the
    average- and max-pooled channels (``F.avg_pool2d``/``F.max_pool2d`` over the whole map), summed,
    a sigmoid scaling each channel."""

    def __init__(self, gate_channels, reduction_ratio=2):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Flatten(),
            nn.Linear(gate_channels, gate_channels // reduction_ratio),
            nn.ReLU(),
            nn.Linear(gate_channels // reduction_ratio, gate_channels),
        )

    def forward(self, x):
        size = (x.size(2), x.size(3))
        channel_att_sum = self.mlp(F.avg_pool2d(x, size, stride=size)) + self.mlp(
            F.max_pool2d(x, size, stride=size)
        )
        return x * torch.sigmoid(channel_att_sum).unsqueeze(2).unsqueeze(3).expand_as(x)


class SpatialGate(nn.Module):
    """``cbam.py``'s ``SpatialGate``: ``ChannelPool`` (the channels' max and mean, concatenated),
    a 7x7 ``BasicConv`` (convolution and batch norm) to one map, a sigmoid scaling every
    position."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 1, 7, padding=3, bias=False)
        self.bn = nn.BatchNorm2d(1, eps=1e-5, momentum=0.01)

    def forward(self, x):
        x_compress = torch.cat((torch.max(x, 1)[0].unsqueeze(1), torch.mean(x, 1).unsqueeze(1)), 1)
        return x * torch.sigmoid(self.bn(self.conv(x_compress)))


class CBAMBasicBlock(nn.Module):
    """``MODELS/model_resnet.py``'s ``BasicBlock`` with ``use_cbam``: two 3x3 convolutions with
    batch norm, the channel then spatial gates on the residual branch, the shortcut added."""

    def __init__(self, planes=4):
        super().__init__()
        self.conv1, self.bn1 = (
            nn.Conv2d(planes, planes, 3, padding=1, bias=False),
            nn.BatchNorm2d(planes),
        )
        self.conv2, self.bn2 = (
            nn.Conv2d(planes, planes, 3, padding=1, bias=False),
            nn.BatchNorm2d(planes),
        )
        self.channel, self.spatial = ChannelGate(planes), SpatialGate()

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.spatial(self.channel(self.bn2(self.conv2(out))))
        return F.relu(out + x)


class CBAMNet(nn.Module):
    def __init__(self, classes=3, planes=4):
        super().__init__()
        self.conv1, self.bn1 = (
            nn.Conv2d(3, planes, 3, padding=1, bias=False),
            nn.BatchNorm2d(planes),
        )
        self.layer1 = CBAMBasicBlock(planes)
        self.fc = nn.Linear(planes, classes)

    def forward(self, x):
        x = self.layer1(F.relu(self.bn1(self.conv1(x))))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def cbam(bn_eval=True):
    (x,), (y,) = image_batch()
    return Spec(CBAMNet(), (x,), cross_entropy, (y,), bn_eval=bn_eval)


class DoubleConv(nn.Module):
    """milesial/Pytorch-UNet, ``unet/unet_parts.py``: ``DoubleConv``, (conv, batch norm, ReLU)
    twice."""

    def __init__(self, in_channels, out_channels, mid_channels=None):
        super().__init__()
        mid_channels = mid_channels or out_channels
        self.double_conv = nn.Sequential(
            nn.Conv2d(in_channels, mid_channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(mid_channels),
            nn.ReLU(inplace=True),
            nn.Conv2d(mid_channels, out_channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True),
        )

    def forward(self, x):
        return self.double_conv(x)


class Up(nn.Module):
    """``unet_parts.py``'s ``Up`` (``bilinear=True``): upsampled, padded to the skip's size by
    ``F.pad`` of the difference, concatenated with it on the channels, ``DoubleConv``."""

    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True)
        self.conv = DoubleConv(in_channels, out_channels, in_channels // 2)

    def forward(self, x1, x2):
        x1 = self.up(x1)
        diffY, diffX = x2.size()[2] - x1.size()[2], x2.size()[3] - x1.size()[3]
        x1 = F.pad(x1, [diffX // 2, diffX - diffX // 2, diffY // 2, diffY - diffY // 2])
        return self.conv(torch.cat([x2, x1], dim=1))


class UNet(nn.Module):
    """``unet/unet_model.py``'s ``UNet``, two levels deep (``Down`` a max pool and
    ``DoubleConv``), on images of an odd side so that ``Up`` pads."""

    def __init__(self, n_channels=1, n_classes=3, w=4):
        super().__init__()
        self.inc = DoubleConv(n_channels, w)
        self.down1 = nn.Sequential(nn.MaxPool2d(2), DoubleConv(w, 2 * w))
        self.down2 = nn.Sequential(nn.MaxPool2d(2), DoubleConv(2 * w, 2 * w))
        self.up1, self.up2 = Up(4 * w, w), Up(2 * w, w)
        self.outc = nn.Conv2d(w, n_classes, kernel_size=1)

    def forward(self, x):
        x1 = self.inc(x)
        x2 = self.down1(x1)
        x = self.up1(self.down2(x2), x2)
        return self.outc(self.up2(x, x1))


def unet_loss(masks_pred, true_masks):
    """milesial's ``train.py``: cross-entropy plus ``1 - multiclass_dice_coeff`` of the softmax
    against the one-hot masks (``utils/dice_score.py``, each image's dice, ``epsilon=1e-6``), here
    each image's own (``reduce_batch_first=False`` averages the images' dice: per example)."""
    ce = F.cross_entropy(masks_pred, true_masks, reduction="none").mean((1, 2))
    probs = F.softmax(masks_pred, dim=1).flatten(0, 1)
    target = F.one_hot(true_masks, masks_pred.shape[1]).permute(0, 3, 1, 2).float().flatten(0, 1)
    inter = 2 * (probs * target).sum(dim=(-1, -2))
    sets_sum = probs.sum(dim=(-1, -2)) + target.sum(dim=(-1, -2))
    sets_sum = torch.where(sets_sum == 0, inter, sets_sum)
    dice = ((inter + 1e-6) / (sets_sum + 1e-6)).view(len(masks_pred), -1).mean(1)
    return ce + (1 - dice)


def unet(bn_eval=True):
    return Spec(
        UNet(),
        (torch.randn(B, 1, 9, 9),),
        unet_loss,
        (torch.randint(0, 3, (B, 9, 9)),),
        bn_eval=bn_eval,
    )


class SeparableConvBlock(nn.Module):
    """zylo117/Yet-Another-EfficientDet-Pytorch, ``efficientdet/model.py``: a depthwise then
    pointwise convolution (batch norm left out: ``norm=False``)."""

    def __init__(self, channels):
        super().__init__()
        self.depthwise_conv = nn.Conv2d(
            channels, channels, 3, padding=1, groups=channels, bias=False
        )
        self.pointwise_conv = nn.Conv2d(channels, channels, 1)

    def forward(self, x):
        return self.pointwise_conv(self.depthwise_conv(x))


class BiFPN(nn.Module):
    """``efficientdet/model.py``'s ``BiFPN`` with ``attention=True`` on three levels: each
    fusion's weights a parameter passed through ReLU and normalized by their sum
    (``weight / (torch.sum(weight, dim=0) + epsilon)``), the inputs weighted by them and
    summed, swished (``MemoryEfficientSwish``, written as ``x * sigmoid(x)``) and convolved;
    top-down by nearest upsampling, bottom-up by max pooling."""

    def __init__(self, c=4, epsilon=1e-4):
        super().__init__()
        self.epsilon = epsilon
        self.conv4_up, self.conv3_up = SeparableConvBlock(c), SeparableConvBlock(c)
        self.conv4_down, self.conv5_down = SeparableConvBlock(c), SeparableConvBlock(c)
        self.p4_w1, self.p3_w1 = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
        self.p4_w2, self.p5_w2 = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))

    def _w(self, p):
        weight = F.relu(p)
        return weight / (torch.sum(weight, dim=0) + self.epsilon)

    @staticmethod
    def swish(x):
        return x * torch.sigmoid(x)

    def forward(self, p3, p4, p5):
        w = self._w(self.p4_w1)
        p4_up = self.conv4_up(self.swish(w[0] * p4 + w[1] * F.interpolate(p5, scale_factor=2)))
        w = self._w(self.p3_w1)
        p3_out = self.conv3_up(self.swish(w[0] * p3 + w[1] * F.interpolate(p4_up, scale_factor=2)))
        w = self._w(self.p4_w2)
        p4_out = self.conv4_down(
            self.swish(w[0] * p4 + w[1] * p4_up + w[2] * F.max_pool2d(p3_out, 2))
        )
        w = self._w(self.p5_w2)
        p5_out = self.conv5_down(self.swish(w[0] * p5 + w[1] * F.max_pool2d(p4_out, 2)))
        return p3_out, p4_out, p5_out


class EfficientDetLite(nn.Module):
    """A stem giving three levels, the BiFPN above with its weights learned from ones
    (``torch.ones``, as written) moved off them by a few steps, and ``Classifier``'s shared
    head applied to every level, its anchors' scores concatenated."""

    def __init__(self, c=4, classes=2):
        super().__init__()
        self.p3 = nn.Conv2d(3, c, 3, stride=2, padding=1)
        self.p4 = nn.Conv2d(c, c, 3, stride=2, padding=1)
        self.p5 = nn.Conv2d(c, c, 3, stride=2, padding=1)
        self.bifpn = BiFPN(c)
        self.header = nn.Conv2d(c, classes, 3, padding=1)

    def forward(self, x):
        p3 = self.p3(x)
        p4 = self.p4(F.relu(p3))
        p5 = self.p5(F.relu(p4))
        feats = self.bifpn(p3, p4, p5)
        return torch.cat([self.header(f).permute(0, 2, 3, 1).flatten(1, 2) for f in feats], 1)


def focal_loss(scores, target, alpha=0.25, gamma=2.0):
    """``efficientdet/loss.py``'s ``FocalLoss`` classification term of each image, summed over
    its anchors (the regression and the positives' count left out)."""
    p = torch.sigmoid(scores).clamp(1e-4, 1.0 - 1e-4)
    alpha_factor = torch.where(target == 1.0, alpha, 1.0 - alpha)
    focal_weight = alpha_factor * torch.where(target == 1.0, 1.0 - p, p) ** gamma
    bce = -(target * torch.log(p) + (1.0 - target) * torch.log(1.0 - p))
    return (focal_weight * bce).flatten(1).sum(1)


def efficientdet():
    return Spec(
        EfficientDetLite(),
        (torch.randn(B, 3, 16, 16),),
        focal_loss,
        ((torch.rand(B, 84, 2) < 0.2).float(),),
    )


class Affine(nn.Module):
    """facebookresearch/deit, ``resmlp_models.py``: ``Affine``, ``alpha * x + beta``."""

    def __init__(self, dim):
        super().__init__()
        self.alpha, self.beta = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return self.alpha * x + self.beta


class LayersScaleMLP(nn.Module):
    """``resmlp_models.py``'s ``layers_scale_mlp_blocks``: a Linear across the patches (the
    tokens transposed in and out), then a per-patch MLP, each after an ``Affine`` and scaled by
    its ``gamma`` (LayerScale)."""

    def __init__(self, dim, num_patches, init_values=0.1):
        super().__init__()
        self.norm1, self.norm2 = Affine(dim), Affine(dim)
        self.attn = nn.Linear(num_patches, num_patches)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.gamma_1 = nn.Parameter(init_values * torch.ones(dim))
        self.gamma_2 = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x):
        x = x + self.gamma_1 * self.attn(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.gamma_2 * self.mlp(self.norm2(x))


class ResMLP(nn.Module):
    """``resmlp_models.py``'s ``resmlp_models``: a convolutional patch embedding (timm's
    ``PatchEmbed``), the blocks, an ``Affine`` norm, the patches averaged, the head."""

    def __init__(self, img=8, patch=2, dim=6, depth=2, classes=3):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        n = (img // patch) ** 2
        self.blocks = nn.ModuleList(LayersScaleMLP(dim, n) for _ in range(depth))
        self.norm, self.head = Affine(dim), nn.Linear(dim, classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x).mean(dim=1))


def resmlp():
    (x,), (y,) = image_batch()
    return Spec(ResMLP(), (x,), cross_entropy, (y,))


class ViTBlock(nn.Module):
    """timm's ``vision_transformer.Block`` as MAE and DiT use it: pre-norm attention by
    ``F.scaled_dot_product_attention`` on a fused ``qkv``, and an MLP."""

    def __init__(self, dim, heads=2, mlp_ratio=2):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim),
            nn.GELU(approximate="tanh"),
            nn.Linear(mlp_ratio * dim, dim),
        )

    def attn(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(b, n, c))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def sincos_2d(dim, side):
    """MAE's ``util/pos_embed.py``: ``get_2d_sincos_pos_embed``, a fixed table."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float64) / (dim / 4.0))
    grid = (
        torch.stack(
            torch.meshgrid(torch.arange(side * 1.0), torch.arange(side * 1.0), indexing="xy")
        )
        .reshape(2, -1)
        .double()
    )
    out = [
        torch.cat([torch.sin(g[:, None] * omega), torch.cos(g[:, None] * omega)], 1) for g in grid
    ]
    return torch.cat(out, 1).float()


class MaskedAutoencoderViT(nn.Module):
    """facebookresearch/mae, ``models_mae.py``: ``MaskedAutoencoderViT``: the patches embedded
    with a fixed sin-cos table, ``random_masking`` (each image's noise argsorted, the kept
    patches gathered by ``torch.gather``, the binary mask unshuffled by ``ids_restore``), the
    class token prepended, the encoder, the decoder's mask tokens ``repeat``-ed, concatenated,
    unshuffled by ``gather`` and decoded, and ``forward_loss`` with ``norm_pix_loss`` (each
    patch's pixels normalized by their mean and variance). The noise, drawn by ``torch.rand``
    inside, is here an input, so that each example's own loss draws the same."""

    def __init__(
        self,
        img_size=8,
        patch_size=2,
        in_chans=3,
        embed_dim=8,
        decoder_embed_dim=6,
        mask_ratio=0.75,
    ):
        super().__init__()
        self.p, self.mask_ratio = patch_size, mask_ratio
        side = img_size // patch_size
        self.patch_embed = nn.Conv2d(in_chans, embed_dim, patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.randn(1, 1, embed_dim) * 0.02)
        pos = sincos_2d(embed_dim, side)
        self.register_buffer("pos_embed", torch.cat([torch.zeros(1, embed_dim), pos])[None])
        self.blocks = nn.ModuleList([ViTBlock(embed_dim)])
        self.norm = nn.LayerNorm(embed_dim)
        self.decoder_embed = nn.Linear(embed_dim, decoder_embed_dim)
        self.mask_token = nn.Parameter(torch.randn(1, 1, decoder_embed_dim) * 0.02)
        dpos = sincos_2d(decoder_embed_dim + 2, side)[:, :decoder_embed_dim]
        self.register_buffer(
            "decoder_pos_embed", torch.cat([torch.zeros(1, decoder_embed_dim), dpos])[None]
        )
        self.decoder_blocks = nn.ModuleList([ViTBlock(decoder_embed_dim)])
        self.decoder_norm = nn.LayerNorm(decoder_embed_dim)
        self.decoder_pred = nn.Linear(decoder_embed_dim, patch_size**2 * in_chans)

    def patchify(self, imgs):
        p, h = self.p, imgs.shape[2] // self.p
        x = imgs.reshape(shape=(imgs.shape[0], 3, h, p, h, p))
        return torch.einsum("nchpwq->nhwpqc", x).reshape(shape=(imgs.shape[0], h * h, p**2 * 3))

    def random_masking(self, x, noise):
        N, L, D = x.shape
        len_keep = int(L * (1 - self.mask_ratio))
        ids_shuffle = torch.argsort(noise, dim=1)
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        ids_keep = ids_shuffle[:, :len_keep]
        x_masked = torch.gather(x, dim=1, index=ids_keep.unsqueeze(-1).repeat(1, 1, D))
        mask = torch.ones([N, L], dtype=x.dtype)
        mask[:, :len_keep] = 0
        return x_masked, torch.gather(mask, dim=1, index=ids_restore), ids_restore

    def forward(self, imgs, noise):
        x = self.patch_embed(imgs).flatten(2).transpose(1, 2) + self.pos_embed[:, 1:, :]
        x, mask, ids_restore = self.random_masking(x, noise)
        cls_token = self.cls_token + self.pos_embed[:, :1, :]
        x = torch.cat((cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        for blk in self.blocks:
            x = blk(x)
        x = self.decoder_embed(self.norm(x))
        mask_tokens = self.mask_token.repeat(x.shape[0], ids_restore.shape[1] + 1 - x.shape[1], 1)
        x_ = torch.cat([x[:, 1:, :], mask_tokens], dim=1)
        x_ = torch.gather(x_, dim=1, index=ids_restore.unsqueeze(-1).repeat(1, 1, x.shape[2]))
        x = torch.cat([x[:, :1, :], x_], dim=1) + self.decoder_pos_embed
        for blk in self.decoder_blocks:
            x = blk(x)
        pred = self.decoder_pred(self.decoder_norm(x))[:, 1:, :]
        target = self.patchify(imgs)
        mean, var = target.mean(dim=-1, keepdim=True), target.var(dim=-1, keepdim=True)
        target = (target - mean) / (var + 1.0e-6) ** 0.5
        loss = ((pred - target) ** 2).mean(dim=-1)
        return (loss * mask).sum(1) / mask.sum(1)  # (each image's: MAE's sums over the batch)


def identity_loss(out):
    return out


def mae():
    return Spec(MaskedAutoencoderViT(), (torch.randn(B, 3, 8, 8), torch.rand(B, 16)), identity_loss)


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class TimestepEmbedder(nn.Module):
    """facebookresearch/DiT, ``models.py``: ``TimestepEmbedder``, sinusoids of the timesteps
    through an MLP."""

    def __init__(self, hidden_size, frequency_embedding_size=8):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size),
        )
        self.frequency_embedding_size = frequency_embedding_size

    @staticmethod
    def timestep_embedding(t, dim, max_period=10000):
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(0, half, dtype=torch.float32) / half)
        args = t[:, None].float() * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

    def forward(self, t):
        t_freq = self.timestep_embedding(t, self.frequency_embedding_size)
        return self.mlp(t_freq.to(self.mlp[0].weight.dtype))


class DiTBlock(nn.Module):
    """``models.py``'s ``DiTBlock``: adaLN-Zero, six modulations of the conditioning by one
    Linear, ``chunk``-ed, shifting, scaling and gating the attention and the MLP."""

    def __init__(self, hidden_size, num_heads=2):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.block = ViTBlock(hidden_size, num_heads)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))

    def forward(self, x, c):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(
            c
        ).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.block.attn(
            modulate(self.norm1(x), shift_msa, scale_msa)
        )
        return x + gate_mlp.unsqueeze(1) * self.block.mlp(
            modulate(self.norm2(x), shift_mlp, scale_mlp)
        )


class DiT(nn.Module):
    """``models.py``'s ``DiT``: the patch embedding, a fixed sin-cos table, the timestep and
    the label embedded (``LabelEmbedder``'s table with its extra row for the dropped label, the
    labels dropped given here as ``force_drop_ids``), their sum the conditioning, the blocks,
    ``FinalLayer``'s modulated projection and ``unpatchify`` by ``torch.einsum``; the weights
    random (its zero initialisation would leave most gradients zero)."""

    def __init__(
        self,
        input_size=8,
        patch_size=2,
        in_channels=2,
        hidden_size=8,
        num_classes=3,
        learn_sigma=True,
    ):
        super().__init__()
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.patch_size, self.num_classes = patch_size, num_classes
        self.x_embedder = nn.Conv2d(in_channels, hidden_size, patch_size, stride=patch_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = nn.Embedding(num_classes + 1, hidden_size)
        self.register_buffer("pos_embed", sincos_2d(hidden_size, input_size // patch_size)[None])
        self.blocks = nn.ModuleList([DiTBlock(hidden_size) for _ in range(2)])
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * self.out_channels)
        self.final_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def unpatchify(self, x):
        c, p = self.out_channels, self.patch_size
        h = w = int(x.shape[1] ** 0.5)
        x = x.reshape(shape=(x.shape[0], h, w, p, p, c))
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(shape=(x.shape[0], c, h * p, h * p))

    def forward(self, x, t, y, force_drop_ids):
        x = self.x_embedder(x).flatten(2).transpose(1, 2) + self.pos_embed
        y = torch.where(force_drop_ids == 1, self.num_classes, y)
        c = self.t_embedder(t) + self.y_embedder(y)
        for block in self.blocks:
            x = block(x, c)
        shift, scale = self.final_modulation(c).chunk(2, dim=1)
        return self.unpatchify(self.linear(modulate(self.norm_final(x), shift, scale)))


def dit_loss(model_output, noise):
    """``diffusion/gaussian_diffusion.py``'s ``training_losses`` with ``learn_sigma``: the
    output split into the predicted noise and the variance's channels, the noise's MSE
    (``mean_flat``, each image's); the variational bound's term left out."""
    eps, _ = torch.split(model_output, noise.shape[1], dim=1)
    return ((noise - eps) ** 2).mean(dim=(1, 2, 3))


def dit():
    x_t = torch.randn(B, 2, 8, 8)
    t = torch.randint(0, 1000, (B,))
    y = torch.randint(0, 3, (B,))
    drop = torch.tensor([0, 1, 0])
    return Spec(DiT(), (x_t, t, y, drop), dit_loss, (torch.randn(B, 2, 8, 8),))


# -- generative flows ------------------------------------------------------------------------------


class ActNorm(nn.Module):
    """rosinality/glow-pytorch, ``model.py``: ``ActNorm``, a scale and shift per channel set
    from the first batch it sees (under ``no_grad``: the script's first pass), its
    log-determinant ``H·W·Σ log|scale|``, one number for every example."""

    def __init__(self, in_channel):
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(1, in_channel, 1, 1))
        self.scale = nn.Parameter(torch.ones(1, in_channel, 1, 1))
        self.register_buffer("initialized", torch.tensor(0, dtype=torch.uint8))

    def initialize(self, input):
        with torch.no_grad():
            flatten = input.permute(1, 0, 2, 3).contiguous().view(input.shape[1], -1)
            mean = flatten.mean(1)[None, :, None, None]
            std = flatten.std(1)[None, :, None, None]
            self.loc.data.copy_(-mean)
            self.scale.data.copy_(1 / (std + 1e-6))

    def forward(self, input):
        _, _, height, width = input.shape
        if self.initialized.item() == 0:
            self.initialize(input)
            self.initialized.fill_(1)
        logdet = height * width * torch.sum(torch.log(torch.abs(self.scale)))
        return self.scale * (input + self.loc), logdet


class InvConv2dLU(nn.Module):
    """``model.py``'s ``InvConv2dLU``: a 1x1 convolution whose weight is rebuilt at every call
    from its LU factors (``w_p @ (w_l·l_mask + I) @ (w_u·u_mask + diag(s_sign·exp(w_s)))``), the
    log-determinant ``H·W·Σ w_s``."""

    def __init__(self, in_channel):
        super().__init__()
        q, _ = torch.linalg.qr(torch.randn(in_channel, in_channel))
        w_p, w_l, w_u = torch.linalg.lu(q)
        w_s = torch.diag(w_u)
        u_mask = torch.triu(torch.ones_like(w_u), 1)
        self.register_buffer("w_p", w_p)
        self.register_buffer("u_mask", u_mask)
        self.register_buffer("l_mask", u_mask.T.contiguous())
        self.register_buffer("s_sign", torch.sign(w_s))
        self.register_buffer("l_eye", torch.eye(in_channel))
        self.w_l = nn.Parameter(w_l)
        self.w_s = nn.Parameter(torch.log(torch.abs(w_s)))
        self.w_u = nn.Parameter(torch.triu(w_u, 1))

    def calc_weight(self):
        weight = (
            self.w_p
            @ (self.w_l * self.l_mask + self.l_eye)
            @ ((self.w_u * self.u_mask) + torch.diag(self.s_sign * torch.exp(self.w_s)))
        )
        return weight.unsqueeze(2).unsqueeze(3)

    def forward(self, input):
        _, _, height, width = input.shape
        return F.conv2d(input, self.calc_weight()), height * width * torch.sum(self.w_s)


class ZeroConv2d(nn.Module):
    """``model.py``'s ``ZeroConv2d``: padded with ones, a 3x3 convolution, scaled by
    ``exp(3·scale)``; started near zero here (its zeros would leave the layers before it no
    gradient in the first step)."""

    def __init__(self, in_channel, out_channel):
        super().__init__()
        self.conv = nn.Conv2d(in_channel, out_channel, 3, padding=0)
        self.conv.weight.data.mul_(0.1)
        self.scale = nn.Parameter(torch.randn(1, out_channel, 1, 1) * 0.01)

    def forward(self, input):
        return self.conv(F.pad(input, [1, 1, 1, 1], value=1)) * torch.exp(self.scale * 3)


class AffineCoupling(nn.Module):
    """``model.py``'s ``AffineCoupling`` (``affine=True``): half the channels give the other
    half's ``sigmoid(log_s + 2)`` scale and shift; the log-determinant each example's."""

    def __init__(self, in_channel, filter_size=6):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(in_channel // 2, filter_size, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(filter_size, filter_size, 1),
            nn.ReLU(inplace=True),
            ZeroConv2d(filter_size, in_channel),
        )

    def forward(self, input):
        in_a, in_b = input.chunk(2, 1)
        log_s, t = self.net(in_a).chunk(2, 1)
        s = torch.sigmoid(log_s + 2)
        out_b = (in_b + t) * s
        return torch.cat([in_a, out_b], 1), torch.sum(torch.log(s).view(input.shape[0], -1), 1)


def gaussian_log_p(x, mean, log_sd):
    return -0.5 * math.log(2 * math.pi) - log_sd - 0.5 * (x - mean) ** 2 / torch.exp(2 * log_sd)


class GlowBlock(nn.Module):
    """``model.py``'s ``Glow`` of one ``Block`` (``split=False``): the image squeezed by view
    and permute, ``Flow``s of ``ActNorm``, ``InvConv2dLU`` and ``AffineCoupling``, and the
    learned prior, a ``ZeroConv2d`` of zeros shaped like the output, giving each latent's mean and
    log-deviation; it returns each image's ``log_p`` and ``logdet``."""

    def __init__(self, in_channel=2, n_flow=2):
        super().__init__()
        squeeze_dim = in_channel * 4
        self.flows = nn.ModuleList(
            nn.ModuleList(
                [ActNorm(squeeze_dim), InvConv2dLU(squeeze_dim), AffineCoupling(squeeze_dim)]
            )
            for _ in range(n_flow)
        )
        self.prior = ZeroConv2d(in_channel * 4, in_channel * 8)

    def forward(self, input):
        b_size, n_channel, height, width = input.shape
        squeezed = input.view(b_size, n_channel, height // 2, 2, width // 2, 2)
        squeezed = squeezed.permute(0, 1, 3, 5, 2, 4)
        out = squeezed.contiguous().view(b_size, n_channel * 4, height // 2, width // 2)
        logdet = 0
        for flow in self.flows:
            for layer in flow:
                out, det = layer(out)
                logdet = logdet + det
        mean, log_sd = self.prior(torch.zeros_like(out)).chunk(2, 1)
        log_p = gaussian_log_p(out, mean, log_sd).view(b_size, -1).sum(1)
        return log_p, logdet


def glow_loss(out, n_bins=32.0, n_pixel=2 * 4 * 4):
    """``train.py``'s ``calc_loss``, each image's bits per dimension."""
    log_p, logdet = out
    loss = -math.log(n_bins) * n_pixel + logdet + log_p
    return -loss / (math.log(2) * n_pixel)


def glow():
    model = GlowBlock()
    x = torch.rand(B, 2, 4, 4) - 0.5
    with torch.no_grad():  # (train.py's first batch, which sets the ActNorms)
        model(x + torch.rand_like(x) / 32)
    return Spec(model, (x,), glow_loss)


# -- reinforcement learning ------------------------------------------------------------------------


class NoisyLinear(nn.Module):
    """Kaixhin/Rainbow, ``model.py``: ``NoisyLinear``, factorised Gaussian noise: in training
    ``F.linear`` of ``weight_mu + weight_sigma * weight_epsilon`` (and the bias alike), the
    noise buffers redrawn by ``reset_noise`` (the outer product of two ``sign·sqrt|x|`` draws)."""

    def __init__(self, in_features, out_features, std_init=0.5):
        super().__init__()
        self.in_features, self.out_features, self.std_init = in_features, out_features, std_init
        self.weight_mu = nn.Parameter(torch.empty(out_features, in_features))
        self.weight_sigma = nn.Parameter(torch.empty(out_features, in_features))
        self.register_buffer("weight_epsilon", torch.empty(out_features, in_features))
        self.bias_mu = nn.Parameter(torch.empty(out_features))
        self.bias_sigma = nn.Parameter(torch.empty(out_features))
        self.register_buffer("bias_epsilon", torch.empty(out_features))
        mu_range = 1 / math.sqrt(in_features)
        self.weight_mu.data.uniform_(-mu_range, mu_range)
        self.weight_sigma.data.fill_(std_init / math.sqrt(in_features))
        self.bias_mu.data.uniform_(-mu_range, mu_range)
        self.bias_sigma.data.fill_(std_init / math.sqrt(out_features))
        self.reset_noise()

    @staticmethod
    def _scale_noise(size):
        x = torch.randn(size)
        return x.sign().mul_(x.abs().sqrt_())

    def reset_noise(self):
        epsilon_in = self._scale_noise(self.in_features)
        epsilon_out = self._scale_noise(self.out_features)
        self.weight_epsilon.copy_(epsilon_out.ger(epsilon_in))
        self.bias_epsilon.copy_(epsilon_out)

    def forward(self, input):
        if self.training:
            return F.linear(
                input,
                self.weight_mu + self.weight_sigma * self.weight_epsilon,
                self.bias_mu + self.bias_sigma * self.bias_epsilon,
            )
        return F.linear(input, self.weight_mu, self.bias_mu)


class RainbowDQN(nn.Module):
    """Rainbow's ``DQN`` (``architecture="data-efficient"``): two convolutions, the dueling
    value and advantage streams of noisy layers over ``atoms`` each, ``q = v + a - a.mean(1)``,
    and a (log-)softmax over the atoms (``log=True`` for the loss)."""

    def __init__(self, action_space=3, atoms=5, history=2, hidden=8):
        super().__init__()
        self.atoms, self.action_space = atoms, action_space
        self.convs = nn.Sequential(
            nn.Conv2d(history, 4, 3, stride=2), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=1), nn.ReLU()
        )
        self.conv_output_size = 4 * 2 * 2
        self.fc_h_v = NoisyLinear(self.conv_output_size, hidden)
        self.fc_h_a = NoisyLinear(self.conv_output_size, hidden)
        self.fc_z_v = NoisyLinear(hidden, atoms)
        self.fc_z_a = NoisyLinear(hidden, action_space * atoms)

    def forward(self, x, actions, log=True):
        x = self.convs(x).view(-1, self.conv_output_size)
        v = self.fc_z_v(F.relu(self.fc_h_v(x)))
        a = self.fc_z_a(F.relu(self.fc_h_a(x)))
        v, a = v.view(-1, 1, self.atoms), a.view(-1, self.action_space, self.atoms)
        q = v + a - a.mean(1, keepdim=True)
        q = F.log_softmax(q, dim=2) if log else F.softmax(q, dim=2)
        return q[range(len(actions)), actions]  # (agent.py's log_ps[range(batch), actions])


def rainbow_loss(log_ps_a, m, weights):
    """``agent.py``'s ``learn``: the cross-entropy with the projected target distribution
    ``m``, weighted by the prioritized replay's importance weights (``(weights * loss).mean()``:
    each transition's ``weights · loss``)."""
    return weights * -torch.sum(m * log_ps_a, 1)


def rainbow():
    states = torch.randn(B, 2, 9, 9)
    actions = torch.tensor([2, 0, 1])
    m = torch.softmax(torch.randn(B, 5), 1)
    weights = torch.rand(B) + 0.5
    return Spec(RainbowDQN(), (states, actions), rainbow_loss, (m, weights))


# -- time series -----------------------------------------------------------------------------------


class RevIN(nn.Module):
    """ts-kim/RevIN, ``RevIN.py``: reversible instance normalization, each series' mean and
    deviation over time (detached) taken out with a learned affine, and put back after the
    model (``mode="denorm"``: the affine undone, ``/ (affine_weight + eps²)``)."""

    def __init__(self, num_features, eps=1e-5, affine=True):
        super().__init__()
        self.eps, self.affine = eps, affine
        self.affine_weight = nn.Parameter(torch.ones(num_features))
        self.affine_bias = nn.Parameter(torch.zeros(num_features))

    def forward(self, x, mode):
        if mode == "norm":
            self.mean = torch.mean(x, dim=1, keepdim=True).detach()
            self.stdev = torch.sqrt(
                torch.var(x, dim=1, keepdim=True, unbiased=False) + self.eps
            ).detach()
            x = (x - self.mean) / self.stdev
            return x * self.affine_weight + self.affine_bias
        x = (x - self.affine_bias) / (self.affine_weight + self.eps * self.eps)
        return x * self.stdev + self.mean


class MovingAvg(nn.Module):
    """cure-lab/LTSF-Linear, ``models/DLinear.py``: ``moving_avg``, the series padded at both
    ends by repeating its first and last steps, averaged by ``nn.AvgPool1d`` over time."""

    def __init__(self, kernel_size):
        super().__init__()
        self.kernel_size = kernel_size
        self.avg = nn.AvgPool1d(kernel_size=kernel_size, stride=1, padding=0)

    def forward(self, x):
        front = x[:, 0:1, :].repeat(1, (self.kernel_size - 1) // 2, 1)
        end = x[:, -1:, :].repeat(1, (self.kernel_size - 1) // 2, 1)
        x = torch.cat([front, x, end], dim=1)
        return self.avg(x.permute(0, 2, 1)).permute(0, 2, 1)


class DLinear(nn.Module):
    """``models/DLinear.py``'s ``Model`` (``individual=True``: a Linear per channel, in
    ``nn.ModuleList``s): ``series_decomp`` into the moving average and the residual, each mapped
    over time to the horizon and summed; wrapped in RevIN, as its users add it."""

    def __init__(self, seq_len=12, pred_len=4, channels=2, kernel_size=5):
        super().__init__()
        self.channels, self.pred_len = channels, pred_len
        self.revin = RevIN(channels)
        self.moving_avg = MovingAvg(kernel_size)
        self.Linear_Seasonal = nn.ModuleList(nn.Linear(seq_len, pred_len) for _ in range(channels))
        self.Linear_Trend = nn.ModuleList(nn.Linear(seq_len, pred_len) for _ in range(channels))

    def forward(self, x):  # [batch, seq_len, channels]
        x = self.revin(x, "norm")
        moving_mean = self.moving_avg(x)
        seasonal_init, trend_init = (x - moving_mean).permute(0, 2, 1), moving_mean.permute(0, 2, 1)
        seasonal_output = torch.zeros([x.size(0), self.channels, self.pred_len], dtype=x.dtype)
        trend_output = torch.zeros_like(seasonal_output)
        for i in range(self.channels):
            seasonal_output[:, i, :] = self.Linear_Seasonal[i](seasonal_init[:, i, :])
            trend_output[:, i, :] = self.Linear_Trend[i](trend_init[:, i, :])
        return self.revin((seasonal_output + trend_output).permute(0, 2, 1), "denorm")


def dlinear():
    t = torch.arange(16.0)
    x = torch.sin(t[None, :, None] / 3 + torch.randn(B, 1, 2)) * 2 + torch.randn(B, 16, 2) * 0.1
    return Spec(DLinear(), (x[:, :12],), mse, (x[:, 12:],))


class DataEmbeddingInverted(nn.Module):
    """thuml/iTransformer, ``layers/Embed.py``: ``DataEmbedding_inverted``, each variate's whole
    series one token (``x.permute(0, 2, 1)`` then a Linear over time)."""

    def __init__(self, c_in, d_model):
        super().__init__()
        self.value_embedding = nn.Linear(c_in, d_model)

    def forward(self, x):
        return self.value_embedding(x.permute(0, 2, 1))


class ITransformer(nn.Module):
    """``model/iTransformer.py``'s ``Model`` (``use_norm=True``): each series normalized by its
    own mean and deviation (``stdev`` detached, as written), the variates as tokens through an
    encoder of ``nn.TransformerEncoderLayer`` (``FullAttention`` and the convolutional
    feed-forward of kernel 1, written as Linears), projected to the horizon, permuted back and
    de-normalized."""

    def __init__(self, seq_len=12, pred_len=4, d_model=8):
        super().__init__()
        self.pred_len = pred_len
        self.enc_embedding = DataEmbeddingInverted(seq_len, d_model)
        self.encoder = nn.TransformerEncoderLayer(
            d_model, 2, 16, dropout=0.0, activation="gelu", batch_first=True
        )
        self.norm = nn.LayerNorm(d_model)
        self.projector = nn.Linear(d_model, pred_len)

    def forward(self, x_enc):
        means = x_enc.mean(1, keepdim=True).detach()
        x_enc = x_enc - means
        stdev = torch.sqrt(torch.var(x_enc, dim=1, keepdim=True, unbiased=False) + 1e-5)
        x_enc = x_enc / stdev
        N = x_enc.shape[2]
        enc_out = self.norm(self.encoder(self.enc_embedding(x_enc)))
        dec_out = self.projector(enc_out).permute(0, 2, 1)[:, :, :N]
        dec_out = dec_out * stdev[:, 0, :].unsqueeze(1).repeat(1, self.pred_len, 1)
        return dec_out + means[:, 0, :].unsqueeze(1).repeat(1, self.pred_len, 1)


def itransformer():
    x = torch.randn(B, 16, 4).cumsum(1)
    return Spec(ITransformer(), (x[:, :12],), mse, (x[:, 12:],))


# -- tabular and recommendation --------------------------------------------------------------------


class SparsemaxFunction(torch.autograd.Function):
    """dreamquark-ai/tabnet, ``pytorch_tabnet/sparsemax.py``: ``SparsemaxFunction``, the
    Euclidean projection onto the simplex along ``dim`` by sorting, with its own backward."""

    @staticmethod
    def forward(ctx, input, dim=-1):
        ctx.dim = dim
        max_val, _ = input.max(dim=dim, keepdim=True)
        input = input - max_val
        tau, supp_size = SparsemaxFunction._threshold_and_support(input, dim=dim)
        output = torch.clamp(input - tau, min=0)
        ctx.save_for_backward(supp_size, output)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        supp_size, output = ctx.saved_tensors
        grad_input = grad_output.clone()
        grad_input[output == 0] = 0
        v_hat = grad_input.sum(dim=ctx.dim) / supp_size.to(output.dtype).squeeze(ctx.dim)
        v_hat = v_hat.unsqueeze(ctx.dim)
        return torch.where(output != 0, grad_input - v_hat, grad_input), None

    @staticmethod
    def _threshold_and_support(input, dim=-1):
        input_srt, _ = torch.sort(input, descending=True, dim=dim)
        input_cumsum = input_srt.cumsum(dim) - 1
        rhos = torch.arange(1, input.size(dim) + 1, dtype=input.dtype)
        support = rhos * input_srt > input_cumsum
        support_size = support.sum(dim=dim).unsqueeze(dim)
        tau = input_cumsum.gather(dim, support_size - 1) / support_size.to(input.dtype)
        return tau, support_size


class GBN(nn.Module):
    """``pytorch_tabnet/tab_network.py``: ``GBN``, ghost batch norm: the batch cut into
    ``virtual_batch_size`` chunks, each normalized by its own statistics in training."""

    def __init__(self, input_dim, virtual_batch_size=2, momentum=0.02):
        super().__init__()
        self.virtual_batch_size = virtual_batch_size
        self.bn = nn.BatchNorm1d(input_dim, momentum=momentum)

    def forward(self, x):
        chunks = x.chunk(int(math.ceil(x.shape[0] / self.virtual_batch_size)), 0)
        return torch.cat([self.bn(x_) for x_ in chunks], dim=0)


class GLULayer(nn.Module):
    def __init__(self, input_dim, output_dim, fc=None):
        super().__init__()
        self.output_dim = output_dim
        self.fc = fc or nn.Linear(input_dim, 2 * output_dim, bias=False)
        self.bn = GBN(2 * output_dim)

    def forward(self, x):
        x = self.bn(self.fc(x))
        return torch.mul(x[:, : self.output_dim], torch.sigmoid(x[:, self.output_dim :]))


class FeatTransformer(nn.Module):
    """``tab_network.py``'s ``FeatTransformer``: a ``GLU_Block`` shared by every step (its
    Linear the same module) then one of the step's own, each layer after the first added to
    its input and scaled by ``sqrt(0.5)``."""

    def __init__(self, input_dim, output_dim, shared_fc):
        super().__init__()
        self.shared = GLULayer(input_dim, output_dim, fc=shared_fc)
        self.specific = GLULayer(output_dim, output_dim)
        self.scale = math.sqrt(0.5)

    def forward(self, x):
        x = self.shared(x)
        return (x + self.specific(x)) * self.scale


class AttentiveTransformer(nn.Module):
    """``tab_network.py``'s ``AttentiveTransformer``: a Linear and ghost batch norm, times the
    prior, through sparsemax."""

    def __init__(self, input_dim, group_dim):
        super().__init__()
        self.fc = nn.Linear(input_dim, group_dim, bias=False)
        self.bn = GBN(group_dim)

    def forward(self, priors, processed_feat):
        return SparsemaxFunction.apply(self.bn(self.fc(processed_feat)) * priors, -1)


class TabNet(nn.Module):
    """``tab_network.py``'s ``TabNetEncoder`` and ``TabNetNoEmbeddings``: the input's batch
    norm, the initial splitter, ``n_steps`` of an attentive mask (the prior updated by
    ``gamma - M``), the masked features through the step's transformer, ``ReLU`` of the
    decision part summed over the steps, the sparsity loss ``M_loss`` (each example's
    entropy of its masks, here per example) and the final mapping."""

    def __init__(self, input_dim=5, output_dim=3, n_d=4, n_a=4, n_steps=2, gamma=1.3):
        super().__init__()
        self.n_d, self.n_steps, self.gamma = n_d, n_steps, gamma
        self.initial_bn = nn.BatchNorm1d(input_dim, momentum=0.01)
        shared_fc = nn.Linear(input_dim, 2 * (n_d + n_a), bias=False)
        self.initial_splitter = FeatTransformer(input_dim, n_d + n_a, shared_fc)
        self.feat_transformers = nn.ModuleList(
            FeatTransformer(input_dim, n_d + n_a, shared_fc) for _ in range(n_steps)
        )
        self.att_transformers = nn.ModuleList(
            AttentiveTransformer(n_a, input_dim) for _ in range(n_steps)
        )
        self.final_mapping = nn.Linear(n_d, output_dim, bias=False)

    def forward(self, x):
        x = self.initial_bn(x)
        prior = torch.ones_like(x)
        M_loss = 0
        att = self.initial_splitter(x)[:, self.n_d :]
        res = 0
        for step in range(self.n_steps):
            M = self.att_transformers[step](prior, att)
            M_loss = M_loss + torch.sum(M * torch.log(M + 1e-15), dim=1)
            prior = torch.mul(self.gamma - M, prior)
            out = self.feat_transformers[step](torch.mul(M, x))
            res = torch.add(res, F.relu(out[:, : self.n_d]))
            att = out[:, self.n_d :]
        return self.final_mapping(res), M_loss / self.n_steps


def tabnet_loss(out, y, lambda_sparse=1e-3):
    """``abstract_model.py``'s ``train_batch``: the task's loss less ``lambda_sparse`` times
    the sparsity term (each example's)."""
    logits, m_loss = out
    return F.cross_entropy(logits, y, reduction="none") - lambda_sparse * m_loss


def tabnet(bn_eval=True):
    return Spec(
        TabNet(), (torch.randn(4, 5),), tabnet_loss, (torch.randint(0, 3, (4,)),), bn_eval=bn_eval
    )


class SENETLayer(nn.Module):
    """shenweichen/DeepCTR-Torch, ``deepctr_torch/layers/interaction.py``: ``SENETLayer``, each
    field's embedding squeezed to its mean, excited by two Linears with ReLU, and reweighted."""

    def __init__(self, filed_size, reduction_ratio=2):
        super().__init__()
        reduction_size = max(1, filed_size // reduction_ratio)
        self.excitation = nn.Sequential(
            nn.Linear(filed_size, reduction_size, bias=False),
            nn.ReLU(),
            nn.Linear(reduction_size, filed_size, bias=False),
            nn.ReLU(),
        )

    def forward(self, inputs):
        Z = torch.mean(inputs, dim=-1, out=None)
        A = self.excitation(Z)
        return torch.mul(inputs, torch.unsqueeze(A, dim=2))


class BilinearInteraction(nn.Module):
    """``interaction.py``'s ``BilinearInteraction`` (``bilinear_type="each"``): a Linear per
    field ``i``, applied to it and multiplied with each field ``j > i``
    (``itertools.combinations``), the products concatenated."""

    def __init__(self, filed_size, embedding_size):
        super().__init__()
        self.bilinear = nn.ModuleList(
            nn.Linear(embedding_size, embedding_size, bias=False) for _ in range(filed_size - 1)
        )

    def forward(self, inputs):
        inputs = torch.split(inputs, 1, dim=1)
        p = [
            torch.mul(self.bilinear[i](inputs[i]), inputs[j])
            for i in range(len(inputs) - 1)
            for j in range(i + 1, len(inputs))
        ]
        return torch.cat(p, dim=1)


class FiBiNET(nn.Module):
    """``deepctr_torch/models/fibinet.py``'s ``FiBiNET``: the sparse fields' embeddings, the
    SENET-reweighted and the plain embeddings' bilinear interactions, flattened with the dense
    features into a DNN, plus the linear part, a sigmoid."""

    def __init__(self, vocab=(5, 7, 4), emb=4, dense=2, hidden=8):
        super().__init__()
        self.embeddings = nn.ModuleList(nn.Embedding(v, emb) for v in vocab)
        self.linear_embeddings = nn.ModuleList(nn.Embedding(v, 1) for v in vocab)
        self.linear_dense = nn.Linear(dense, 1, bias=False)
        f = len(vocab)
        self.SE = SENETLayer(f)
        self.Bilinear = BilinearInteraction(f, emb)
        pairs = f * (f - 1) // 2
        self.dnn = nn.Sequential(nn.Linear(2 * pairs * emb + dense, hidden), nn.ReLU())
        self.dnn_linear = nn.Linear(hidden, 1, bias=False)
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, sparse, dense):
        emb = torch.stack([e(sparse[:, i]) for i, e in enumerate(self.embeddings)], 1)
        senet_bilinear_out = self.Bilinear(self.SE(emb))
        bilinear_out = self.Bilinear(emb)
        linear_logit = sum(e(sparse[:, i]) for i, e in enumerate(self.linear_embeddings))
        linear_logit = linear_logit + self.linear_dense(dense)
        dnn_input = torch.cat(
            [torch.flatten(torch.cat((senet_bilinear_out, bilinear_out), dim=1), 1), dense], -1
        )
        return torch.sigmoid(linear_logit + self.dnn_linear(self.dnn(dnn_input)) + self.bias)


def bce(p, y):
    return F.binary_cross_entropy(p.squeeze(1), y, reduction="none")


def click_inputs(vocab=(5, 7, 4)):
    sparse = torch.stack([torch.randint(0, v, (B,)) for v in vocab], 1)
    return sparse, torch.randn(B, 2)


def fibinet():
    return Spec(FiBiNET(), click_inputs(), bce, (torch.randint(0, 2, (B,)).float(),))


class CrossNetMix(nn.Module):
    """``deepctr_torch/layers/interaction.py``: ``CrossNetMix``, DCN-M's mixture of low-rank
    cross experts: per layer and expert ``x_0 ⊙ (U (tanh(C tanh(Vᵀ x_l))) + b)``, the experts
    gated by a softmax of Linear gates of ``x_l``, added to ``x_l``; the experts' matrices
    raw parameters used by ``torch.matmul``."""

    def __init__(self, in_features, low_rank=2, num_experts=2, layer_num=2):
        super().__init__()
        self.layer_num, self.num_experts = layer_num, num_experts

        def param(*shape):
            return nn.Parameter(nn.init.xavier_normal_(torch.empty(*shape)))

        self.U_list = param(layer_num, num_experts, in_features, low_rank)
        self.V_list = param(layer_num, num_experts, in_features, low_rank)
        self.C_list = param(layer_num, num_experts, low_rank, low_rank)
        self.gating = nn.ModuleList(
            nn.Linear(in_features, 1, bias=False) for _ in range(num_experts)
        )
        self.bias = nn.Parameter(torch.zeros(layer_num, in_features, 1))

    def forward(self, inputs):
        x_0 = inputs.unsqueeze(2)
        x_l = x_0
        for i in range(self.layer_num):
            output_of_experts, gating_score_of_experts = [], []
            for expert_id in range(self.num_experts):
                gating_score_of_experts.append(self.gating[expert_id](x_l.squeeze(2)))
                v_x = torch.tanh(torch.matmul(self.V_list[i][expert_id].t(), x_l))
                v_x = torch.tanh(torch.matmul(self.C_list[i][expert_id], v_x))
                uv_x = torch.matmul(self.U_list[i][expert_id], v_x)
                output_of_experts.append((x_0 * (uv_x + self.bias[i])).squeeze(2))
            output_of_experts = torch.stack(output_of_experts, 2)
            gating_score_of_experts = torch.stack(gating_score_of_experts, 1)
            moe_out = torch.matmul(output_of_experts, gating_score_of_experts.softmax(1))
            x_l = moe_out + x_l
        return x_l.squeeze(2)  # (squeeze() as written: a batch of one loses its dimension)


class DCNMix(nn.Module):
    """``deepctr_torch/models/dcnmix.py``'s ``DCNMix`` (``cross_parameterization="matrix"``,
    parallel): the embeddings flattened with the dense features, through the cross network and
    a DNN side by side, concatenated into the logit, a sigmoid."""

    def __init__(self, vocab=(5, 7, 4), emb=3, dense=2, hidden=6):
        super().__init__()
        self.embeddings = nn.ModuleList(nn.Embedding(v, emb) for v in vocab)
        d = len(vocab) * emb + dense
        self.crossnet = CrossNetMix(d)
        self.dnn = nn.Sequential(nn.Linear(d, hidden), nn.ReLU())
        self.dnn_linear = nn.Linear(d + hidden, 1, bias=False)

    def forward(self, sparse, dense):
        emb = torch.cat([e(sparse[:, i]) for i, e in enumerate(self.embeddings)], 1)
        dnn_input = torch.cat([emb, dense], 1)
        stack_out = torch.cat((self.crossnet(dnn_input), self.dnn(dnn_input)), dim=-1)
        return torch.sigmoid(self.dnn_linear(stack_out))


def dcn_mix():
    return Spec(DCNMix(), click_inputs(), bce, (torch.randint(0, 2, (B,)).float(),))


# -- text pairs and summarization ------------------------------------------------------------------


def sort_by_seq_lens(batch, sequences_lengths, descending=True):
    """coetaur0/ESIM, ``esim/utils.py``: ``sort_by_seq_lens``: the batch sorted by length, with
    the index that restores its order."""
    sorted_seq_lens, sorting_index = sequences_lengths.sort(0, descending=descending)
    sorted_batch = batch.index_select(0, sorting_index)
    idx_range = torch.arange(0, len(sequences_lengths))
    _, revese_mapping = sorting_index.sort(0, descending=False)
    restoration_index = idx_range.index_select(0, revese_mapping)
    return sorted_batch, sorted_seq_lens, sorting_index, restoration_index


def masked_softmax(tensor, mask):
    """``esim/utils.py``'s ``masked_softmax``: the softmax times the mask, renormalized."""
    tensor_shape = tensor.size()
    reshaped_tensor = tensor.view(-1, tensor_shape[-1])
    while mask.dim() < tensor.dim():
        mask = mask.unsqueeze(1)
    mask = mask.expand_as(tensor).contiguous().float().to(tensor.dtype)
    reshaped_mask = mask.view(-1, mask.size()[-1])
    result = F.softmax(reshaped_tensor * reshaped_mask, dim=-1) * reshaped_mask
    result = result / (result.sum(dim=-1, keepdim=True) + 1e-13)
    return result.view(*tensor_shape)


def weighted_sum(tensor, weights, mask):
    """``esim/utils.py``'s ``weighted_sum``."""
    weighted = weights.bmm(tensor)
    while mask.dim() < weighted.dim():
        mask = mask.unsqueeze(1)
    return weighted * mask.transpose(-1, -2).expand_as(weighted).contiguous().to(weighted.dtype)


def replace_masked(tensor, mask, value):
    mask = mask.unsqueeze(1).transpose(2, 1).to(tensor.dtype)
    return tensor * mask + (1 - mask) * value


class Seq2SeqEncoder(nn.Module):
    """``esim/layers.py``'s ``Seq2SeqEncoder``: the batch sorted by length, packed, through a
    bidirectional LSTM, padded back and put in its order again by ``index_select``."""

    def __init__(self, input_size, hidden_size):
        super().__init__()
        self._encoder = nn.LSTM(input_size, hidden_size, batch_first=True, bidirectional=True)

    def forward(self, sequences_batch, sequences_lengths):
        sorted_batch, sorted_lengths, _, restoration_idx = sort_by_seq_lens(
            sequences_batch, sequences_lengths
        )
        packed_batch = nn.utils.rnn.pack_padded_sequence(
            sorted_batch, sorted_lengths, batch_first=True
        )
        outputs, _ = self._encoder(packed_batch, None)
        outputs, _ = nn.utils.rnn.pad_packed_sequence(outputs, batch_first=True)
        return outputs.index_select(0, restoration_idx)


class ESIM(nn.Module):
    """``esim/model.py``'s ``ESIM``: both sentences encoded, ``SoftmaxAttention`` (each
    premise word against each hypothesis word, ``bmm``, masked softmaxes both ways), the
    enhanced ``[a; ã; a - ã; a ⊙ ã]`` projected with ReLU, composed by a second encoder, pooled
    by masked average and max (padding replaced by ``-1e7``), and classified."""

    def __init__(self, vocab=13, emb=4, hidden=3, classes=3):
        super().__init__()
        self._word_embedding = nn.Embedding(vocab, emb, padding_idx=0)
        self._encoding = Seq2SeqEncoder(emb, hidden)
        self._projection = nn.Sequential(nn.Linear(4 * 2 * hidden, hidden), nn.ReLU())
        self._composition = Seq2SeqEncoder(hidden, hidden)
        self._classification = nn.Sequential(
            nn.Linear(2 * 4 * hidden, hidden), nn.Tanh(), nn.Linear(hidden, classes)
        )

    def forward(self, premises, premises_lengths, hypotheses, hypotheses_lengths):
        premises_mask = (premises != 0).to(self._word_embedding.weight.dtype)
        hypotheses_mask = (hypotheses != 0).to(self._word_embedding.weight.dtype)
        encoded_premises = self._encoding(self._word_embedding(premises), premises_lengths)
        encoded_hypotheses = self._encoding(self._word_embedding(hypotheses), hypotheses_lengths)
        similarity_matrix = encoded_premises.bmm(encoded_hypotheses.transpose(2, 1).contiguous())
        prem_hyp_attn = masked_softmax(similarity_matrix, hypotheses_mask)
        hyp_prem_attn = masked_softmax(
            similarity_matrix.transpose(1, 2).contiguous(), premises_mask
        )
        attended_premises = weighted_sum(encoded_hypotheses, prem_hyp_attn, premises_mask)
        attended_hypotheses = weighted_sum(encoded_premises, hyp_prem_attn, hypotheses_mask)
        enhanced_premises = torch.cat(
            [
                encoded_premises,
                attended_premises,
                encoded_premises - attended_premises,
                encoded_premises * attended_premises,
            ],
            dim=-1,
        )
        enhanced_hypotheses = torch.cat(
            [
                encoded_hypotheses,
                attended_hypotheses,
                encoded_hypotheses - attended_hypotheses,
                encoded_hypotheses * attended_hypotheses,
            ],
            dim=-1,
        )
        v_ai = self._composition(self._projection(enhanced_premises), premises_lengths)
        v_bj = self._composition(self._projection(enhanced_hypotheses), hypotheses_lengths)
        v_a_avg = torch.sum(v_ai * premises_mask.unsqueeze(1).transpose(2, 1), dim=1) / torch.sum(
            premises_mask, dim=1, keepdim=True
        )
        v_b_avg = torch.sum(v_bj * hypotheses_mask.unsqueeze(1).transpose(2, 1), dim=1) / torch.sum(
            hypotheses_mask, dim=1, keepdim=True
        )
        v_a_max, _ = replace_masked(v_ai, premises_mask, -1e7).max(dim=1)
        v_b_max, _ = replace_masked(v_bj, hypotheses_mask, -1e7).max(dim=1)
        return self._classification(torch.cat([v_a_avg, v_a_max, v_b_avg, v_b_max], dim=1))


def esim():
    """Each batch padded to its longest sentence (as ESIM's ``NLIDataset`` pads), so an example
    alone is cut to its own length."""
    p_len, h_len = torch.tensor([5, 3, 4]), torch.tensor([2, 4, 3])
    premises = torch.randint(1, 13, (B, 5)) * (torch.arange(5) < p_len[:, None])
    hypotheses = torch.randint(1, 13, (B, 4)) * (torch.arange(4) < h_len[:, None])

    def split(args, i):
        p, pl, h, hl = args
        return p[i : i + 1, : int(pl[i])], pl[i : i + 1], h[i : i + 1, : int(hl[i])], hl[i : i + 1]

    return Spec(
        ESIM(),
        (premises, p_len, hypotheses, h_len),
        cross_entropy,
        (torch.randint(0, 3, (B,)),),
        split=split,
    )


class PGAttention(nn.Module):
    """atulkum/pointer_summarizer, ``training_ptr_gen/model.py``: ``Attention`` with coverage:
    the decoder state's projection added to the encoder features and ``W_c`` of the coverage,
    ``v(tanh(...))`` masked by the padding, renormalized, the context by ``bmm``, the coverage
    accumulated."""

    def __init__(self, hidden):
        super().__init__()
        self.W_c = nn.Linear(1, 2 * hidden, bias=False)
        self.decode_proj = nn.Linear(2 * hidden, 2 * hidden)
        self.v = nn.Linear(2 * hidden, 1, bias=False)

    def forward(self, s_t_hat, encoder_outputs, encoder_feature, enc_padding_mask, coverage):
        b, t_k, n = list(encoder_outputs.size())
        dec_fea = self.decode_proj(s_t_hat)
        dec_fea_expanded = dec_fea.unsqueeze(1).expand(b, t_k, n).contiguous().view(-1, n)
        att_features = encoder_feature + dec_fea_expanded + self.W_c(coverage.view(-1, 1))
        scores = self.v(torch.tanh(att_features)).view(-1, t_k)
        attn_dist_ = F.softmax(scores, dim=1) * enc_padding_mask
        attn_dist = attn_dist_ / attn_dist_.sum(1, keepdim=True)
        c_t = torch.bmm(attn_dist.unsqueeze(1), encoder_outputs).view(-1, 2 * n // 2)
        return c_t, attn_dist, coverage + attn_dist


class PointerGenerator(nn.Module):
    """``training_ptr_gen/model.py``'s ``Encoder``, ``ReduceState`` and ``Decoder``: a
    bidirectional LSTM over the article, its outputs' features by ``W_h`` on the rows flattened
    (``view(-1, 2 * hidden)``), the final states reduced, then per decoder step an LSTM cell
    step, the attention, ``p_gen`` from the context, state and input, the vocabulary
    distribution mixed with the attention ``scatter_add``-ed onto the article's extended
    vocabulary ids, and ``train.py``'s coverage loss."""

    def __init__(self, vocab=11, emb=4, hidden=3, extra=2):
        super().__init__()
        self.hidden, self.extra = hidden, extra
        self.embedding = nn.Embedding(vocab, emb)
        self.lstm = nn.LSTM(emb, hidden, batch_first=True, bidirectional=True)
        self.W_h = nn.Linear(2 * hidden, 2 * hidden, bias=False)
        self.reduce_h, self.reduce_c = nn.Linear(2 * hidden, hidden), nn.Linear(2 * hidden, hidden)
        self.x_context = nn.Linear(2 * hidden + emb, emb)
        self.dec_lstm = nn.LSTM(emb, hidden, batch_first=True)
        self.attention_network = PGAttention(hidden)
        self.p_gen_linear = nn.Linear(4 * hidden + emb, 1)
        self.out1, self.out2 = nn.Linear(3 * hidden, hidden), nn.Linear(hidden, vocab)

    def forward(self, enc_batch, enc_padding_mask, enc_extend_vocab, dec_batch, target_batch):
        b = enc_batch.size(0)
        encoder_outputs, (h, c) = self.lstm(self.embedding(enc_batch))
        encoder_feature = self.W_h(encoder_outputs.contiguous().view(-1, 2 * self.hidden))
        h_in = h.transpose(0, 1).contiguous().view(-1, 2 * self.hidden)
        c_in = c.transpose(0, 1).contiguous().view(-1, 2 * self.hidden)
        s_t = (F.relu(self.reduce_h(h_in)).unsqueeze(0), F.relu(self.reduce_c(c_in)).unsqueeze(0))
        c_t = torch.zeros(b, 2 * self.hidden, dtype=encoder_outputs.dtype)
        coverage = torch.zeros(enc_batch.size(), dtype=encoder_outputs.dtype)
        extra_zeros = torch.zeros(b, self.extra, dtype=encoder_outputs.dtype)
        step_losses = []
        for di in range(dec_batch.size(1)):
            y_t_1_embd = self.embedding(dec_batch[:, di])
            x = self.x_context(torch.cat((c_t, y_t_1_embd), 1))
            lstm_out, s_t = self.dec_lstm(x.unsqueeze(1), s_t)
            h_decoder, c_decoder = s_t
            s_t_hat = torch.cat(
                (h_decoder.view(-1, self.hidden), c_decoder.view(-1, self.hidden)), 1
            )
            c_t, attn_dist, next_coverage = self.attention_network(
                s_t_hat, encoder_outputs, encoder_feature, enc_padding_mask, coverage
            )
            p_gen = torch.sigmoid(self.p_gen_linear(torch.cat((c_t, s_t_hat, x), 1)))
            output = self.out2(self.out1(torch.cat((lstm_out.view(-1, self.hidden), c_t), 1)))
            vocab_dist = F.softmax(output, dim=1)
            vocab_dist_ = torch.cat([p_gen * vocab_dist, extra_zeros], 1)
            final_dist = vocab_dist_.scatter_add(1, enc_extend_vocab, (1 - p_gen) * attn_dist)
            gold_probs = torch.gather(final_dist, 1, target_batch[:, di].unsqueeze(1)).squeeze()
            step_loss = -torch.log(gold_probs + 1e-12)
            step_loss = step_loss + torch.sum(torch.min(attn_dist, coverage), 1)
            coverage = next_coverage
            step_losses.append(step_loss)
        return torch.stack(step_losses, 1).sum(1)  # (train.py divides by each target's length)


def pointer_generator():
    enc = torch.randint(0, 11, (B, 5))
    mask = torch.ones(B, 5)
    mask[1, 3:] = 0
    extend = torch.where(torch.rand(B, 5) < 0.3, 11 + torch.randint(0, 2, (B, 5)), enc)
    dec = torch.randint(0, 11, (B, 3))
    target = torch.randint(0, 13, (B, 3))
    return Spec(PointerGenerator(), (enc, mask, extend, dec, target), identity_loss)


# -- speech ----------------------------------------------------------------------------------------


class TDNNBlock(nn.Module):
    """speechbrain, ``speechbrain/lobes/models/ECAPA_TDNN.py``: ``TDNNBlock``, a dilated
    ``Conv1d`` (``padding="same"``), ReLU and batch norm."""

    def __init__(self, in_channels, out_channels, kernel_size, dilation=1):
        super().__init__()
        self.conv = nn.Conv1d(
            in_channels,
            out_channels,
            kernel_size,
            dilation=dilation,
            padding=dilation * (kernel_size - 1) // 2,
        )
        self.norm = nn.BatchNorm1d(out_channels)

    def forward(self, x):
        return self.norm(F.relu(self.conv(x)))


class Res2NetBlock(nn.Module):
    """``ECAPA_TDNN.py``'s ``Res2NetBlock``: the channels ``torch.chunk``-ed into ``scale``
    parts, each after the first through its own TDNN block added to the last one's output."""

    def __init__(self, channels, scale=2, kernel_size=3, dilation=2):
        super().__init__()
        self.blocks = nn.ModuleList(
            TDNNBlock(channels // scale, channels // scale, kernel_size, dilation)
            for _ in range(scale - 1)
        )

    def forward(self, x):
        y = []
        for i, x_i in enumerate(torch.chunk(x, len(self.blocks) + 1, dim=1)):
            if i == 0:
                y_i = x_i
            elif i == 1:
                y_i = self.blocks[i - 1](x_i)
            else:
                y_i = self.blocks[i - 1](x_i + y_i)
            y.append(y_i)
        return torch.cat(y, dim=1)


class SEBlock(nn.Module):
    """``ECAPA_TDNN.py``'s ``SEBlock``: the time-mean (here without lengths: every frame)
    through two 1x1 convolutions, a sigmoid scaling the channels."""

    def __init__(self, channels, se_channels):
        super().__init__()
        self.conv1, self.conv2 = (
            nn.Conv1d(channels, se_channels, 1),
            nn.Conv1d(se_channels, channels, 1),
        )

    def forward(self, x):
        s = x.mean(dim=2, keepdim=True)
        return torch.sigmoid(self.conv2(F.relu(self.conv1(s)))) * x


class AttentiveStatisticsPooling(nn.Module):
    """``ECAPA_TDNN.py``'s ``AttentiveStatisticsPooling`` (``global_context=True``): each
    frame's features with the utterance's mean and deviation, ``repeat``-ed over time, through a
    TDNN block, ``tanh`` and a 1x1 convolution to attention over time; the attended mean and
    deviation (``_compute_statistics``, ``clamp(eps)``), concatenated."""

    def __init__(self, channels, attention_channels=4, eps=1e-12):
        super().__init__()
        self.eps = eps
        self.tdnn = TDNNBlock(channels * 3, attention_channels, 1)
        self.conv = nn.Conv1d(attention_channels, channels, 1)

    def _stats(self, x, m, dim=2):
        mean = (m * x).sum(dim)
        return mean, torch.sqrt((m * (x - mean.unsqueeze(dim)).pow(2)).sum(dim).clamp(self.eps))

    def forward(self, x):
        L = x.shape[-1]
        mask = torch.ones(x.shape[0], 1, L, dtype=x.dtype) / L
        mean, std = self._stats(x, mask)
        attn = torch.cat(
            [x, mean.unsqueeze(2).repeat(1, 1, L), std.unsqueeze(2).repeat(1, 1, L)], 1
        )
        attn = F.softmax(self.conv(torch.tanh(self.tdnn(attn))), dim=2)
        mean, std = self._stats(x, attn)
        return torch.cat((mean, std), dim=1).unsqueeze(2)


class ECAPA_TDNN(nn.Module):  # noqa: N801 (speechbrain's name)
    """``ECAPA_TDNN.py``'s ``ECAPA_TDNN``: a TDNN block, an ``SERes2NetBlock`` (TDNN, Res2Net,
    TDNN, squeeze-excitation, the shortcut added), multi-layer feature aggregation (the
    blocks' outputs concatenated), attentive statistics pooling, batch norm and the embedding's
    1x1 convolution; features ``[batch, time, mels]`` transposed in."""

    def __init__(self, input_size=5, channels=8, lin_neurons=6):
        super().__init__()
        self.block0 = TDNNBlock(input_size, channels, 5)
        self.se_res2 = nn.ModuleList(
            [
                TDNNBlock(channels, channels, 1),
                Res2NetBlock(channels),
                TDNNBlock(channels, channels, 1),
                SEBlock(channels, 4),
            ]
        )
        self.mfa = TDNNBlock(2 * channels, 2 * channels, 1)
        self.asp = AttentiveStatisticsPooling(2 * channels)
        self.asp_bn = nn.BatchNorm1d(4 * channels)
        self.fc = nn.Conv1d(4 * channels, lin_neurons, 1)

    def forward(self, x):
        x = self.block0(x.transpose(1, 2))
        h = x
        for layer in self.se_res2:
            h = layer(h)
        x = self.mfa(torch.cat([x, h + x], dim=1))
        x = self.asp_bn(self.asp(x))
        return self.fc(x).transpose(1, 2)


class AdditiveAngularMargin(nn.Module):
    """speechbrain, ``lobes/models/ECAPA_TDNN.py``'s ``Classifier``: cosine logits of the
    normalized embedding against the normalized class weights
    (``F.linear(F.normalize(x), F.normalize(self.weight))``)."""

    def __init__(self, lin_neurons=6, classes=4):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(classes, lin_neurons) * 0.5)

    def forward(self, emb):
        return F.linear(F.normalize(emb.squeeze(1)), F.normalize(self.weight))


class SpeakerNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding_model, self.classifier = ECAPA_TDNN(), AdditiveAngularMargin()

    def forward(self, feats):
        return self.classifier(self.embedding_model(feats))


def aam_loss(cosine, targets, margin=0.2, scale=10.0):
    """speechbrain, ``speechbrain/nnet/losses.py``: ``AdditiveAngularMargin`` (``cos(θ + m)``
    for the target, ``easy_margin=False``, scaled by ``s``) and ``LogSoftmaxWrapper``'s
    ``KLDivLoss`` of the one-hot targets, each utterance's."""
    cos_m, sin_m = math.cos(margin), math.sin(margin)
    th, mm = math.cos(math.pi - margin), math.sin(math.pi - margin) * margin
    cosine = cosine.float()
    sine = torch.sqrt((1.0 - torch.pow(cosine, 2)).clamp(1e-12))
    phi = torch.where(cosine - th > 0, cosine * cos_m - sine * sin_m, cosine - mm)
    one_hot = F.one_hot(targets, cosine.shape[1]).to(cosine.dtype)
    predictions = scale * ((one_hot * phi) + ((1.0 - one_hot) * cosine))
    return -(F.log_softmax(predictions, 1) * one_hot).sum(1)


def ecapa(bn_eval=True):
    return Spec(
        SpeakerNet(),
        (torch.randn(B, 10, 5),),
        aam_loss,
        (torch.randint(0, 4, (B,)),),
        bn_eval=bn_eval,
        rtol=1e-5,
    )  # (rtol: the margin in float32, as written)


# -- graphs ----------------------------------------------------------------------------------------


def unsorted_segment_sum(data, segment_ids, num_segments):
    """vgsatorras/egnn, ``models/egnn_clean/egnn_clean.py``: ``unsorted_segment_sum`` by
    ``scatter_add_`` of the rows into their segments."""
    result = data.new_full((num_segments, data.size(1)), 0)
    segment_ids = segment_ids.unsqueeze(-1).expand(-1, data.size(1))
    return result.scatter_add_(0, segment_ids, data)


class E_GCL(nn.Module):  # noqa: N801 (the repository's name)
    """``egnn_clean.py``'s ``E_GCL``: messages from each edge's two nodes and squared
    distance, summed into their rows, a node update, and the coordinates moved along the
    normalized differences (``coords_agg="mean"``), on one graph's nodes."""

    def __init__(self, nf, hidden_nf):
        super().__init__()
        self.edge_mlp = nn.Sequential(
            nn.Linear(2 * nf + 1, hidden_nf), nn.SiLU(), nn.Linear(hidden_nf, hidden_nf), nn.SiLU()
        )
        self.node_mlp = nn.Sequential(
            nn.Linear(hidden_nf + nf, hidden_nf), nn.SiLU(), nn.Linear(hidden_nf, nf)
        )
        self.coord_mlp = nn.Sequential(
            nn.Linear(hidden_nf, hidden_nf), nn.SiLU(), nn.Linear(hidden_nf, 1, bias=False)
        )

    def forward(self, h, edge_index, coord):
        row, col = edge_index
        coord_diff = coord[:, row] - coord[:, col]
        radial = torch.sum(coord_diff**2, -1, keepdim=True)
        coord_diff = coord_diff / (torch.sqrt(radial).detach() + 1.0)
        edge_feat = self.edge_mlp(torch.cat([h[:, row], h[:, col], radial], dim=-1))
        n = h.shape[1]
        counts = torch.zeros(n, dtype=h.dtype).index_add_(
            0, row, torch.ones(len(row), dtype=h.dtype)
        )
        trans = coord_diff * self.coord_mlp(edge_feat)
        agg = torch.zeros_like(coord).index_add_(1, row, trans) / counts[:, None]
        coord = coord + agg
        agg = torch.zeros(h.shape[0], n, edge_feat.shape[-1], dtype=h.dtype).index_add_(
            1, row, edge_feat
        )
        return h + self.node_mlp(torch.cat([h, agg], dim=-1)), coord


class EGNN(nn.Module):
    """``egnn_clean.py``'s ``EGNN`` on a batch of molecules of one size, ``[batch, nodes, ...]``
    (its ``get_edges_batch`` offsets the edges of a flattened batch instead), the graph's
    edges ``[2, edges]`` shared; a readout of the nodes' mean, as its QM9 model predicts a
    property."""

    def __init__(self, in_node_nf=3, hidden_nf=6, n_layers=2):
        super().__init__()
        self.embedding_in = nn.Linear(in_node_nf, hidden_nf)
        self.layers = nn.ModuleList(E_GCL(hidden_nf, hidden_nf) for _ in range(n_layers))
        self.readout = nn.Sequential(
            nn.Linear(hidden_nf, hidden_nf), nn.SiLU(), nn.Linear(hidden_nf, 1)
        )

    def forward(self, h, x, edges):
        h = self.embedding_in(h)
        for layer in self.layers:
            h, x = layer(h, edges, x)
        return self.readout(h.mean(1)) + x.pow(2).sum((1, 2))[:, None] * 0.01


def egnn():
    n = 4
    row, col = zip(*[(i, j) for i in range(n) for j in range(n) if i != j])
    edges = torch.tensor([row, col])
    return Spec(
        EGNN(),
        (torch.randn(B, n, 3), torch.randn(B, n, 3), edges),
        mse,
        (torch.randn(B, 1),),
        split=lambda a, i: (a[0][i : i + 1], a[1][i : i + 1], a[2]),
    )


# -- self-supervised -------------------------------------------------------------------------------


class BarlowTwins(nn.Module):
    """facebookresearch/barlowtwins, ``main.py``: ``BarlowTwins``: both views through the
    backbone and the projector (Linear, BatchNorm1d, ReLU, Linear), the cross-correlation
    ``bn(z1).T @ bn(z2)`` of the batch normalized by an affine-free BatchNorm1d, divided by the
    batch size, and its loss, the diagonal pulled to one and the rest to zero, returned by the
    forward: one number of the whole batch, here spread over the examples as its mean.
    ``converted``: the projector's batch norm made a GroupNorm, as for private training (the
    affine-free one of the cross-correlation, without parameters, left)."""

    def __init__(self, dim=6, proj=8, lambd=0.0051, converted=False):
        super().__init__()
        self.lambd = lambd
        self.backbone = nn.Sequential(nn.Linear(5, dim), nn.ReLU())
        norm = nn.GroupNorm(2, proj) if converted else nn.BatchNorm1d(proj)
        self.projector = nn.Sequential(
            nn.Linear(dim, proj, bias=False), norm, nn.ReLU(), nn.Linear(proj, proj, bias=False)
        )
        self.bn = nn.BatchNorm1d(proj, affine=False)

    def forward(self, y1, y2):
        z1, z2 = self.projector(self.backbone(y1)), self.projector(self.backbone(y2))
        c = self.bn(z1).T @ self.bn(z2)
        c = c / y1.shape[0]
        on_diag = torch.diagonal(c).add_(-1).pow_(2).sum()
        off_diag = (
            c.flatten()[:-1].view(c.shape[0] - 1, c.shape[0] + 1)[:, 1:].flatten().pow_(2).sum()
        )
        loss = on_diag + self.lambd * off_diag
        return loss.expand(y1.shape[0]) / y1.shape[0]


def barlow_twins(converted=False):
    x = torch.randn(4, 5)
    return Spec(
        BarlowTwins(converted=converted),
        (x + 0.1 * torch.randn(4, 5), x + 0.1 * torch.randn(4, 5)),
        identity_loss,
    )


# -- more generative models ------------------------------------------------------------------------


class VectorQuantizer(nn.Module):
    """zalandoresearch/pytorch-vq-vae, ``vq-vae.ipynb``: ``VectorQuantizer``: the inputs
    ``[B, C, H, W]`` permuted to channels last and flattened, their squared distances to the
    codebook, the nearest code's one-hot encodings by ``scatter_``, quantized by ``matmul``
    with the codebook's weight, the codebook and commitment losses (here each image's mean,
    where the notebook takes the batch's), and the straight-through estimator."""

    def __init__(self, num_embeddings=6, embedding_dim=4, commitment_cost=0.25):
        super().__init__()
        self._embedding_dim, self._num_embeddings = embedding_dim, num_embeddings
        self._embedding = nn.Embedding(num_embeddings, embedding_dim)
        self._embedding.weight.data.uniform_(-1 / num_embeddings, 1 / num_embeddings)
        self._commitment_cost = commitment_cost

    def forward(self, inputs):
        inputs = inputs.permute(0, 2, 3, 1).contiguous()
        input_shape = inputs.shape
        flat_input = inputs.view(-1, self._embedding_dim)
        distances = (
            torch.sum(flat_input**2, dim=1, keepdim=True)
            + torch.sum(self._embedding.weight**2, dim=1)
            - 2 * torch.matmul(flat_input, self._embedding.weight.t())
        )
        encoding_indices = torch.argmin(distances, dim=1).unsqueeze(1)
        encodings = torch.zeros(encoding_indices.shape[0], self._num_embeddings, dtype=inputs.dtype)
        encodings.scatter_(1, encoding_indices, 1)
        quantized = torch.matmul(encodings, self._embedding.weight).view(input_shape)
        per = (quantized.detach() - inputs) ** 2, (quantized - inputs.detach()) ** 2
        e_latent_loss, q_latent_loss = (t.flatten(1).mean(1) for t in per)
        loss = q_latent_loss + self._commitment_cost * e_latent_loss
        quantized = inputs + (quantized - inputs).detach()
        return loss, quantized.permute(0, 3, 1, 2).contiguous()


class VQVAE(nn.Module):
    """The notebook's ``Model``: a strided convolutional encoder, ``_pre_vq_conv``, the
    quantizer, and a transposed-convolution decoder; the loss its training loop's,
    reconstruction MSE (over the data variance) plus the quantizer's."""

    def __init__(self, hidden=6, embedding_dim=4):
        super().__init__()
        self._encoder = nn.Sequential(
            nn.Conv2d(3, hidden, 4, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(hidden, hidden, 3, padding=1),
        )
        self._pre_vq_conv = nn.Conv2d(hidden, embedding_dim, 1)
        self._vq_vae = VectorQuantizer(embedding_dim=embedding_dim)
        self._decoder = nn.Sequential(
            nn.Conv2d(embedding_dim, hidden, 3, padding=1),
            nn.ReLU(),
            nn.ConvTranspose2d(hidden, 3, 4, stride=2, padding=1),
        )

    def forward(self, x):
        loss, quantized = self._vq_vae(self._pre_vq_conv(self._encoder(x)))
        return loss, self._decoder(quantized)


def vq_loss(out, data, data_variance=0.5):
    vq, x_recon = out
    return ((x_recon - data) ** 2).flatten(1).mean(1) / data_variance + vq


def vq_vae():
    x = torch.rand(B, 3, 8, 8) - 0.5
    return Spec(VQVAE(), (x,), vq_loss, (x,))


def calc_mean_std(feat, eps=1e-5):
    """naoto0804/pytorch-AdaIN, ``function.py``: ``calc_mean_std``, each image's channel means
    and deviations."""
    N, C = feat.size()[:2]
    feat_var = feat.view(N, C, -1).var(dim=2) + eps
    return feat.view(N, C, -1).mean(dim=2).view(N, C, 1, 1), feat_var.sqrt().view(N, C, 1, 1)


def adaptive_instance_normalization(content_feat, style_feat):
    size = content_feat.size()
    style_mean, style_std = calc_mean_std(style_feat)
    content_mean, content_std = calc_mean_std(content_feat)
    normalized_feat = (content_feat - content_mean.expand(size)) / content_std.expand(size)
    return normalized_feat * style_std.expand(size) + style_mean.expand(size)


class AdaINNet(nn.Module):
    """``net.py``'s ``Net``: a frozen encoder (VGG's first layers, here two reflection-padded
    convolutions) whose intermediate features ``encode_with_intermediate`` keeps, AdaIN of the
    content's features to the style's, the decoder (reflection padding, convolutions, nearest
    upsampling) trained; the content loss to the AdaIN target and the style loss of the means
    and deviations at each level (``calc_content_loss``/``calc_style_loss``, here each
    image's), weighted as ``train.py`` weights them."""

    def __init__(self, c=4):
        super().__init__()
        self.enc_1 = nn.Sequential(
            nn.Conv2d(3, 3, 1), nn.ReflectionPad2d(1), nn.Conv2d(3, c, 3), nn.ReLU()
        )
        self.enc_2 = nn.Sequential(
            nn.MaxPool2d(2), nn.ReflectionPad2d(1), nn.Conv2d(c, c, 3), nn.ReLU()
        )
        for p in [*self.enc_1.parameters(), *self.enc_2.parameters()]:
            p.requires_grad = False
        self.decoder = nn.Sequential(
            nn.ReflectionPad2d(1),
            nn.Conv2d(c, c, 3),
            nn.ReLU(),
            nn.Upsample(scale_factor=2, mode="nearest"),
            nn.ReflectionPad2d(1),
            nn.Conv2d(c, 3, 3),
        )

    def encode_with_intermediate(self, x):
        results = [self.enc_1(x)]
        results.append(self.enc_2(results[-1]))
        return results

    def forward(self, content, style, alpha=1.0, content_weight=1.0, style_weight=10.0):
        style_feats = self.encode_with_intermediate(style)
        content_feat = self.enc_2(self.enc_1(content))
        t = adaptive_instance_normalization(content_feat, style_feats[-1])
        t = alpha * t + (1 - alpha) * content_feat
        g_t_feats = self.encode_with_intermediate(self.decoder(t))
        loss_c = (g_t_feats[-1] - t).pow(2).flatten(1).mean(1)
        loss_s = 0
        for g, s in zip(g_t_feats, style_feats):
            (gm, gs), (sm, ss) = calc_mean_std(g), calc_mean_std(s)
            loss_s = (
                loss_s + (gm - sm).pow(2).flatten(1).mean(1) + (gs - ss).pow(2).flatten(1).mean(1)
            )
        return content_weight * loss_c + style_weight * loss_s


def adain():
    return Spec(AdaINNet(), (torch.rand(B, 3, 8, 8), torch.rand(B, 3, 8, 8)), identity_loss)


def init_weights(m):
    if isinstance(m, nn.Conv1d | nn.ConvTranspose1d):
        m.weight.data.normal_(0.0, 0.1)


class HiFiResBlock2(nn.Module):
    """jik876/hifi-gan, ``models.py``: ``ResBlock2``, dilated convolutions under
    ``weight_norm``, each after a leaky ReLU, added to their input."""

    def __init__(self, channels, kernel_size=3, dilation=(1, 3)):
        super().__init__()
        wn = torch.nn.utils.weight_norm
        self.convs = nn.ModuleList(
            wn(
                nn.Conv1d(
                    channels,
                    channels,
                    kernel_size,
                    1,
                    dilation=d,
                    padding=d * (kernel_size - 1) // 2,
                )
            )
            for d in dilation
        )
        self.convs.apply(init_weights)

    def forward(self, x):
        for c in self.convs:
            x = c(F.leaky_relu(x, 0.1)) + x
        return x


class HiFiGenerator(nn.Module):
    """``models.py``'s ``Generator`` (``resblock="2"``): a ``weight_norm`` pre-convolution of
    the mel frames, ``weight_norm`` transposed convolutions upsampling, each followed by the
    mean of its residual blocks, a post-convolution and ``tanh``; trained (``train.py``) by
    the L1 loss of the waveforms (the discriminators left out)."""

    def __init__(self, mels=4, ch=6, rates=(2, 2), kernels=(4, 4)):
        super().__init__()
        wn = torch.nn.utils.weight_norm
        self.conv_pre = wn(nn.Conv1d(mels, ch, 7, 1, padding=3))
        self.ups = nn.ModuleList(
            wn(nn.ConvTranspose1d(ch // 2**i, ch // 2 ** (i + 1), k, u, padding=(k - u) // 2))
            for i, (u, k) in enumerate(zip(rates, kernels))
        )
        self.resblocks = nn.ModuleList(
            HiFiResBlock2(ch // 2 ** (i + 1), ks) for i in range(len(rates)) for ks in (3, 5)
        )
        self.conv_post = wn(nn.Conv1d(ch // 2 ** len(rates), 1, 7, 1, padding=3))
        self.ups.apply(init_weights)
        self.conv_post.apply(init_weights)

    def forward(self, x):
        x = self.conv_pre(x)
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, 0.1))
            xs = self.resblocks[2 * i](x) + self.resblocks[2 * i + 1](x)
            x = xs / 2
        return torch.tanh(self.conv_post(F.leaky_relu(x)))


def l1(out, target):
    return (out - target).abs().flatten(1).sum(1)


def hifigan():
    return Spec(HiFiGenerator(), (torch.randn(B, 4, 5),), l1, (torch.rand(B, 1, 20) - 0.5,))


class ChannelwiseLayerNorm(nn.Module):
    """kaituoxu/Conv-TasNet, ``src/conv_tasnet.py``: ``ChannelwiseLayerNorm``, over the channels
    at each time step, ``gamma`` and ``beta`` parameters used directly."""

    def __init__(self, channel_size):
        super().__init__()
        self.gamma, self.beta = (
            nn.Parameter(torch.ones(1, channel_size, 1)),
            nn.Parameter(torch.zeros(1, channel_size, 1)),
        )

    def forward(self, y):
        mean = torch.mean(y, dim=1, keepdim=True)
        var = torch.var(y, dim=1, keepdim=True, unbiased=False)
        return self.gamma * (y - mean) / torch.pow(var + 1e-8, 0.5) + self.beta


class GlobalLayerNorm(ChannelwiseLayerNorm):
    """``conv_tasnet.py``'s ``GlobalLayerNorm``: over each example's channels and time."""

    def forward(self, y):
        mean = y.mean(dim=1, keepdim=True).mean(dim=2, keepdim=True)
        var = (torch.pow(y - mean, 2)).mean(dim=1, keepdim=True).mean(dim=2, keepdim=True)
        return self.gamma * (y - mean) / torch.pow(var + 1e-8, 0.5) + self.beta


class TemporalBlock(nn.Module):
    """``conv_tasnet.py``'s ``TemporalBlock`` with ``DepthwiseSeparableConv``: a 1x1 convolution,
    PReLU, gLN, a dilated depthwise convolution (``Chomp1d`` where causal: not here), PReLU, gLN
    and a pointwise convolution, added to the input."""

    def __init__(self, B_, H, P, dilation):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv1d(B_, H, 1, bias=False),
            nn.PReLU(),
            GlobalLayerNorm(H),
            nn.Conv1d(
                H, H, P, padding=(P - 1) * dilation // 2, dilation=dilation, groups=H, bias=False
            ),
            nn.PReLU(),
            GlobalLayerNorm(H),
            nn.Conv1d(H, B_, 1, bias=False),
        )

    def forward(self, x):
        return x + self.net(x)


class ConvTasNet(nn.Module):
    """``conv_tasnet.py``'s ``ConvTasNet``: the ``Encoder`` (a strided ``Conv1d`` of the
    waveform, ReLU), the ``TemporalConvNet`` separator (cLN, a bottleneck, temporal blocks of
    growing dilation, masks by softmax over ``C`` speakers), and the ``Decoder``'s basis
    (``nn.Linear``) and ``overlap_and_add`` (frames summed by ``index_add_`` at the hop's
    positions)."""

    def __init__(self, N=6, L=4, B_=4, H=6, P=3, X=2, C=2):
        super().__init__()
        self.N, self.L, self.C = N, L, C
        self.conv1d_U = nn.Conv1d(1, N, kernel_size=L, stride=L // 2, bias=False)
        self.separator = nn.Sequential(
            ChannelwiseLayerNorm(N),
            nn.Conv1d(N, B_, 1, bias=False),
            *[TemporalBlock(B_, H, P, 2**x) for x in range(X)],
            nn.Conv1d(B_, C * N, 1, bias=False),
        )
        self.basis_signals = nn.Linear(N, L, bias=False)

    def overlap_and_add(self, signal, frame_step):
        outer_dimensions = signal.size()[:-2]
        frames, frame_length = signal.size()[-2:]
        output_size = frame_step * (frames - 1) + frame_length
        subframe_length = math.gcd(frame_length, frame_step)
        subframe_step = frame_step // subframe_length
        subframes_per_frame = frame_length // subframe_length
        output_subframes = output_size // subframe_length
        subframe_signal = signal.view(*outer_dimensions, -1, subframe_length)
        frame = torch.arange(0, output_subframes).unfold(0, subframes_per_frame, subframe_step)
        frame = frame.contiguous().view(-1)
        result = signal.new_zeros(*outer_dimensions, output_subframes, subframe_length)
        result.index_add_(-2, frame, subframe_signal)
        return result.view(*outer_dimensions, -1)

    def forward(self, mixture):
        mixture_w = F.relu(self.conv1d_U(mixture.unsqueeze(1)))
        M, N, K = mixture_w.size()
        est_mask = F.softmax(self.separator(mixture_w).view(M, self.C, N, K), dim=1)
        source_w = torch.transpose(mixture_w.unsqueeze(1) * est_mask, 2, 3)
        est_source = self.basis_signals(source_w)
        return self.overlap_and_add(est_source, self.L // 2)


def si_snr_pit(est, source, eps=1e-8):
    """``src/pit_criterion.py``'s ``cal_si_snr_with_pit``: the scale-invariant SNR of each
    (estimate, source) pair, zero-mean, best over the permutations of the speakers (``max``
    of each mixture's), its negative each mixture's loss (``cal_loss`` averages them)."""
    est = est[..., : source.shape[-1]]
    est = est - est.mean(-1, keepdim=True)
    source = source - source.mean(-1, keepdim=True)
    s_target = source.unsqueeze(1)  # [B, 1, C, T]
    s_estimate = est.unsqueeze(2)  # [B, C, 1, T]
    pair_wise_dot = torch.sum(s_estimate * s_target, dim=3, keepdim=True)
    s_target_energy = torch.sum(s_target**2, dim=3, keepdim=True) + eps
    pair_wise_proj = pair_wise_dot * s_target / s_target_energy
    e_noise = s_estimate - pair_wise_proj
    pair_wise_si_snr = torch.sum(pair_wise_proj**2, dim=3) / (torch.sum(e_noise**2, dim=3) + eps)
    pair_wise_si_snr = 10 * torch.log10(pair_wise_si_snr + eps)  # [B, C, C]
    perms = torch.tensor([[0, 1], [1, 0]])
    index = torch.arange(2)
    snr_set = torch.stack([pair_wise_si_snr[:, index, p].sum(1) for p in perms], 1)
    return -snr_set.max(dim=1)[0] / 2


def conv_tasnet():
    sources = torch.randn(B, 2, 16)
    return Spec(ConvTasNet(), (sources.sum(1),), si_snr_pit, (sources,))


class FNetFourierTransform(nn.Module):
    """google-research's FNet as Hugging Face's ``modeling_fnet.py`` writes it:
    ``FNetBasicFourierTransform``, the real part of the 2-D FFT over the tokens and the
    hidden units (``torch.fft.fftn(..., dim=(1, 2)).real``), then ``FNetBasicOutput``'s
    residual LayerNorm."""

    def __init__(self, d):
        super().__init__()
        self.LayerNorm = nn.LayerNorm(d)

    def forward(self, hidden_states):
        return self.LayerNorm(torch.fft.fftn(hidden_states, dim=(1, 2)).real + hidden_states)


class FNet(nn.Module):
    """``modeling_fnet.py``'s ``FNetModel`` and its sequence classifier, small: word, position
    and token type embeddings, their projection, layers of the Fourier mixing and a GELU
    feed-forward with its residual LayerNorm, the first token's pooler, the head."""

    def __init__(self, vocab=13, d=8, layers=2, classes=3, length=6):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, d)
        self.position_embeddings = nn.Embedding(length, d)
        self.token_type_embeddings = nn.Embedding(2, d)
        self.emb_norm, self.projection = nn.LayerNorm(d), nn.Linear(d, d)
        self.fourier = nn.ModuleList(FNetFourierTransform(d) for _ in range(layers))
        self.ff = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
            for _ in range(layers)
        )
        self.ff_norm = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.pooler, self.classifier = nn.Linear(d, d), nn.Linear(d, classes)

    def forward(self, input_ids, token_type_ids):
        pos = torch.arange(input_ids.shape[1])[None]
        h = self.word_embeddings(input_ids) + self.position_embeddings(pos)
        h = self.projection(self.emb_norm(h + self.token_type_embeddings(token_type_ids)))
        for fourier, ff, norm in zip(self.fourier, self.ff, self.ff_norm):
            h = fourier(h)
            h = norm(ff(h) + h)
        return self.classifier(torch.tanh(self.pooler(h[:, 0])))


def fnet():
    ids = torch.randint(0, 13, (B, 6))
    types = (torch.arange(6) >= 3).long().expand(B, -1)
    return Spec(FNet(), (ids, types), cross_entropy, (torch.randint(0, 3, (B,)),))


# -- the checks ------------------------------------------------------------------------------------

MATCH = {
    "transformer-xl": transformer_xl,
    "hyena": hyena,
    "cbam-frozen-bn": cbam,
    "unet-frozen-bn": unet,
    "efficientdet-bifpn": efficientdet,
    "resmlp": resmlp,
    "mae": mae,
    "dit": dit,
    "rainbow": rainbow,
    "revin-dlinear": dlinear,
    "itransformer": itransformer,
    "tabnet-frozen-bn": tabnet,
    "fibinet": fibinet,
    "dcn-mix": dcn_mix,
    "esim": esim,
    "pointer-generator": pointer_generator,
    "ecapa-tdnn-frozen-bn": ecapa,
    "egnn": egnn,
    "vq-vae": vq_vae,
    "adain": adain,
    "hifigan": hifigan,
    "conv-tasnet": conv_tasnet,
    "fnet": fnet,
    "glow": glow,
}

REFUSED = {
    "tabnet-ghost-bn": (
        partial(tabnet, False),
        gradhooks.MixedExamplesError,
        ["'initial_bn' (BatchNorm1d)", "train mode"],
    ),
    "unet": (
        partial(unet, False),
        gradhooks.MixedExamplesError,
        ["'inc.double_conv.1' (BatchNorm2d)", "train mode"],
    ),
    "barlow-twins": (
        barlow_twins,
        gradhooks.MixedExamplesError,
        ["'projector.1' (BatchNorm1d)", "train mode"],
    ),
    "barlow-twins-converted": (
        partial(barlow_twins, True),
        gradhooks.MixedExamplesError,
        ["BarlowTwins", "mixes the 4 examples", "batch_norm"],
    ),
}


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated")
@pytest.mark.parametrize("name", MATCH)
def test_model_trains_as_the_loop(name):
    assert_trains_as_the_loop(MATCH[name])


@pytest.mark.parametrize("name", REFUSED)
def test_model_refused(name):
    factory, error, says = REFUSED[name]
    assert_refused(factory, error, says)


def test_the_check_tells_a_wrong_grad1_or_step(monkeypatch):
    """Two examples' ``grad1`` of one parameter swapped after each backward, or the DP step's
    ``.grad`` of one parameter of the wrong sign: the training check fails."""
    with monkeypatch.context() as m:
        m.setattr(gradhooks, "add_hooks", corrupting(gradhooks.add_hooks))
        backward = Tensor.backward

        def swapped(self, *args, **kwargs):
            backward(self, *args, **kwargs)
            p = specs[0].model.layers[0].dec_attn.qkv_net.weight
            p.grad1 = p.grad1[[1, 0, 2]]

        specs = []

        def kept():
            specs.append(transformer_xl())
            return specs[-1]

        m.setattr(Tensor, "backward", swapped)
        with pytest.raises(AssertionError):
            assert_trains_as_the_loop(kept, steps=1)
    step = gradhooks.dp_sgd_step

    def wrong_sign(hooks, *args, **kwargs):
        out = step(hooks, *args, **kwargs)
        hooks.model.word_emb.weight.grad.neg_()
        return out

    monkeypatch.setattr(gradhooks, "dp_sgd_step", wrong_sign)
    with pytest.raises(AssertionError):
        assert_trains_as_the_loop(transformer_xl, steps=2)


def test_a_refusal_is_checked_to_be_right():
    """The refusal check fails for a model whose examples do not meet."""
    with pytest.raises(AssertionError, match="do not meet"):
        assert_refused(fnet, gradhooks.MixedExamplesError, [])


TRAINED = {
    "transformer-xl": (transformer_xl, "grad1"),
    "hyena": (hyena, "dp"),
    "mae": (mae, "grad1"),
    "dit": (dit, "dp"),
    "rainbow": (rainbow, "grad1"),
    "itransformer": (itransformer, "dp"),
    "esim": (esim, "grad1"),
    "efficientdet-bifpn": (efficientdet, "dp"),
    "fnet": (fnet, "grad1"),
    "conv-tasnet": (conv_tasnet, "grad1"),
    "glow": (glow, "dp"),
}


@pytest.mark.parametrize("name", TRAINED)
def test_model_trained_under_bf16_autocast(name):
    factory, how = TRAINED[name]
    train_bf16(factory, how)


# -- training scripts' loops, with gradhooks where their users would put it ------------------------

D = torch.float64


class SmallEncoder(nn.Module):
    """The ``base_encoder`` MoCo is given (torchvision's ResNet-50 there): here two
    convolutions with GroupNorm (as for private training, in place of batch norm), pooling and
    the ``fc`` whose width is the feature dimension; ``mlp=True`` puts MoCo v2's hidden layer in
    front of it."""

    def __init__(self, num_classes=6, width=4):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, width, 3, stride=2, padding=1),
            nn.GroupNorm(2, width),
            nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x):
        return self.fc(self.body(x))


class MoCo(nn.Module):
    """facebookresearch/moco, ``moco/builder.py``: ``MoCo`` (v2: ``mlp=True``): the query
    encoder, the key encoder a momentum copy without gradients (updated inside the forward,
    under ``no_grad``, before the keys are computed), the positive logit by
    ``einsum('nc,nc->n')``, the negatives against the queue of past keys (a buffer, cloned and
    detached), the logits over the temperature, labels of zeros, and the batch's keys
    enqueued at ``queue_ptr`` after (one process: ``concat_all_gather`` and the batch shuffle
    of ``_batch_shuffle_ddp`` are the identity)."""

    def __init__(self, dim=6, K=8, m=0.9, T=0.2):
        super().__init__()
        self.K, self.m, self.T = K, m, T
        self.encoder_q, self.encoder_k = SmallEncoder(dim), SmallEncoder(dim)
        for enc in (self.encoder_q, self.encoder_k):
            dim_mlp = enc.fc.weight.shape[1]
            enc.fc = nn.Sequential(nn.Linear(dim_mlp, dim_mlp), nn.ReLU(), enc.fc)
        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            param_k.data.copy_(param_q.data)
            param_k.requires_grad = False
        self.register_buffer("queue", F.normalize(torch.randn(dim, K), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    @torch.no_grad()
    def _momentum_update_key_encoder(self):
        for param_q, param_k in zip(self.encoder_q.parameters(), self.encoder_k.parameters()):
            param_k.data = param_k.data * self.m + param_q.data * (1.0 - self.m)

    @torch.no_grad()
    def _dequeue_and_enqueue(self, keys):
        batch_size = keys.shape[0]
        ptr = int(self.queue_ptr)
        assert self.K % batch_size == 0
        self.queue[:, ptr : ptr + batch_size] = keys.T
        self.queue_ptr[0] = (ptr + batch_size) % self.K

    def forward(self, im_q, im_k):
        q = F.normalize(self.encoder_q(im_q), dim=1)
        with torch.no_grad():
            self._momentum_update_key_encoder()
            k = F.normalize(self.encoder_k(im_k), dim=1)
        l_pos = torch.einsum("nc,nc->n", [q, k]).unsqueeze(-1)
        l_neg = torch.einsum("nc,ck->nk", [q, self.queue.clone().detach()])
        logits = torch.cat([l_pos, l_neg], dim=1)
        logits /= self.T
        labels = torch.zeros(logits.shape[0], dtype=torch.long)
        self._dequeue_and_enqueue(k)
        return logits, labels


def test_moco_v2_queue_and_momentum_encoder_per_example_gradients_each_step():
    """facebookresearch/moco ``main_moco.py``'s ``train`` and ``adjust_learning_rate`` (its
    ``--cos`` schedule), with MoCo v2's builder: SGD with momentum and weight decay, the
    cross-entropy of the logits the model returns with its labels, ``zero_grad``, ``backward``
    and ``step``, over 2 epochs of 2 batches of two augmented views. A user logs each image's
    gradient and its norm (for DP-SGD or data selection): at every step ``grad1`` and the
    norms are each image's own gradient, computed alone from the model as the step found it
    (its key encoder and queue: the forward updates both, the momentum update before the keys,
    which depends on the query encoder alone, and the enqueue after the logits); the queue
    holds the batch's keys after it, and the key encoder took no gradient."""
    torch.manual_seed(0)
    B_, EPOCHS, LR = 4, 2, 0.03
    model = MoCo().to(D)
    twin = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), LR, momentum=0.9, weight_decay=1e-4)
    criterion = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(1)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for epoch in range(EPOCHS):
            lr = LR * 0.5 * (1.0 + math.cos(math.pi * epoch / EPOCHS))
            for group in optimizer.param_groups:
                group["lr"] = lr
            for _ in range(2):
                x = torch.rand(B_, 3, 8, 8, generator=g, dtype=D)
                images = [x + 0.1 * torch.randn(x.shape, generator=g, dtype=D) for _ in range(2)]
                state = copy.deepcopy(model.state_dict())

                def own_loss(im_q, im_k, state=state):
                    twin.load_state_dict(state)  # (the model as the step found it)
                    output, target = twin(im_q, im_k)
                    return criterion(output, target)

                want = loop(twin, own_loss, images[0], images[1])
                output, target = model(im_q=images[0], im_k=images[1])
                loss = criterion(output, target)
                optimizer.zero_grad()
                loss.backward()
                got = {n: p.grad1 for n, p in trainable(model).items()}
                assert_all(got, want, f"epoch {epoch}")
                torch.testing.assert_close(h.norms(), flat(want).norm(dim=1), rtol=1e-9, atol=0)
                assert all(p.grad is None for p in model.encoder_k.parameters())
                start = (int(model.queue_ptr) - B_) % model.K
                keys = model.queue[:, start : start + B_].T
                torch.testing.assert_close(keys, F.normalize(model.encoder_k(images[1]), dim=1))
                optimizer.step()


class Actor(nn.Module):
    """sfujim/TD3, ``TD3.py``: ``Actor``, three Linears, ``max_action · tanh``."""

    def __init__(self, state_dim, action_dim, max_action, hidden=8):
        super().__init__()
        self.l1, self.l2 = nn.Linear(state_dim, hidden), nn.Linear(hidden, hidden)
        self.l3 = nn.Linear(hidden, action_dim)
        self.max_action = max_action

    def forward(self, state):
        a = F.relu(self.l2(F.relu(self.l1(state))))
        return self.max_action * torch.tanh(self.l3(a))


class Critic(nn.Module):
    """``TD3.py``'s ``Critic``: twin Q-networks on the state and action concatenated; ``Q1``,
    a method other than ``forward``, the first alone (the actor's loss)."""

    def __init__(self, state_dim, action_dim, hidden=8):
        super().__init__()
        self.l1, self.l2, self.l3 = (
            nn.Linear(state_dim + action_dim, hidden),
            nn.Linear(hidden, hidden),
            nn.Linear(hidden, 1),
        )
        self.l4, self.l5, self.l6 = (
            nn.Linear(state_dim + action_dim, hidden),
            nn.Linear(hidden, hidden),
            nn.Linear(hidden, 1),
        )

    def forward(self, state, action):
        sa = torch.cat([state, action], 1)
        q1 = self.l3(F.relu(self.l2(F.relu(self.l1(sa)))))
        q2 = self.l6(F.relu(self.l5(F.relu(self.l4(sa)))))
        return q1, q2

    def Q1(self, state, action):  # noqa: N802 (the repository's name)
        sa = torch.cat([state, action], 1)
        return self.l3(F.relu(self.l2(F.relu(self.l1(sa)))))


def test_td3_train_critic_every_step_actor_delayed_through_the_critics_q1():
    """sfujim/TD3 ``TD3.py``'s ``TD3.train``: a replay batch, the target from the target
    networks under ``no_grad`` (clipped policy noise, the smaller twin Q), the critic's two MSE
    losses, its Adam step; every ``policy_freq`` iterations the actor's loss
    ``-critic.Q1(state, actor(state)).mean()`` (``Q1``, not the critic's ``forward``, whose
    backward also writes the critic's ``.grad``), the actor's Adam step, and the soft updates
    of both targets by ``tau``. Each network hooked by its own ``add_hooks``: at every critic
    step the critic's ``grad1`` is each transition's own gradient of its two squared errors
    (the targets fixed), and at every actor step the actor's is each state's own gradient of
    its ``-Q1``, against the float64 loop, over 4 iterations."""
    torch.manual_seed(0)
    state_dim, action_dim, max_action, n = 3, 2, 1.0, 5
    discount, tau, policy_noise, noise_clip, policy_freq = 0.99, 0.005, 0.2, 0.5, 2
    actor, critic = (
        Actor(state_dim, action_dim, max_action).to(D),
        Critic(state_dim, action_dim).to(D),
    )
    actor_target, critic_target = copy.deepcopy(actor), copy.deepcopy(critic)
    actor_twin, critic_twin = copy.deepcopy(actor), copy.deepcopy(critic)
    actor_optimizer = torch.optim.Adam(actor.parameters(), lr=3e-4)
    critic_optimizer = torch.optim.Adam(critic.parameters(), lr=3e-4)
    g = torch.Generator().manual_seed(3)
    with gradhooks.add_hooks(actor) as ha, gradhooks.add_hooks(critic) as hc:
        for total_it in range(1, 5):
            state, next_state = (torch.randn(n, state_dim, generator=g, dtype=D) for _ in range(2))
            action = torch.rand(n, action_dim, generator=g, dtype=D) * 2 - 1
            reward = torch.randn(n, 1, generator=g, dtype=D)
            not_done = (torch.rand(n, 1, generator=g) > 0.2).to(D)
            with torch.no_grad():
                noise = (torch.randn(action.shape, generator=g, dtype=D) * policy_noise).clamp(
                    -noise_clip, noise_clip
                )
                next_action = (actor_target(next_state) + noise).clamp(-max_action, max_action)
                target_Q1, target_Q2 = critic_target(next_state, next_action)
                target_Q = reward + not_done * discount * torch.min(target_Q1, target_Q2)
            follow(critic_twin, critic)
            want = loop(
                critic_twin,
                lambda s, a, y: sum((q - y).pow(2).sum() for q in critic_twin(s, a)),
                state,
                action,
                target_Q,
            )
            current_Q1, current_Q2 = critic(state, action)
            critic_loss = F.mse_loss(current_Q1, target_Q) + F.mse_loss(current_Q2, target_Q)
            critic_optimizer.zero_grad()
            critic_loss.backward()
            assert hc.accumulated == 1
            assert_all(
                {k: p.grad1 for k, p in critic.named_parameters()}, want, f"critic {total_it}"
            )
            critic_optimizer.step()
            if total_it % policy_freq == 0:
                follow(actor_twin, actor)
                follow(critic_twin, critic)
                want = loop(actor_twin, lambda s: -critic_twin.Q1(s, actor_twin(s)).sum(), state)
                actor_loss = -critic.Q1(state, actor(state)).mean()
                actor_optimizer.zero_grad()
                actor_loss.backward()
                assert ha.accumulated == 1
                assert_all(
                    {k: p.grad1 for k, p in actor.named_parameters()}, want, f"actor {total_it}"
                )
                torch.testing.assert_close(actor.l1.weight.grad1.mean(0), actor.l1.weight.grad)
                actor_optimizer.step()
                for net, target in ((critic, critic_target), (actor, actor_target)):
                    for param, target_param in zip(net.parameters(), target.parameters()):
                        target_param.data.copy_(tau * param.data + (1 - tau) * target_param.data)


class SkipGramModel(nn.Module):
    """Adoni/word2vec_pytorch, ``model.py``: ``SkipGramModel``: two sparse embeddings (the
    centre words' initialised uniformly, the contexts' at zero), the positive pair's score
    and the negatives' by ``bmm``, clamped, through ``logsigmoid``; the mean over the batch
    returned by the forward. (``neg_score``'s ``squeeze()`` written ``squeeze(2)``: the script
    skips batches of one, whose ``squeeze()`` drops their batch dimension.)"""

    def __init__(self, emb_size=12, emb_dimension=4):
        super().__init__()
        self.u_embeddings = nn.Embedding(emb_size, emb_dimension, sparse=True)
        self.v_embeddings = nn.Embedding(emb_size, emb_dimension, sparse=True)
        initrange = 1.0 / emb_dimension
        nn.init.uniform_(self.u_embeddings.weight.data, -initrange, initrange)
        nn.init.constant_(self.v_embeddings.weight.data, 0)

    def forward(self, pos_u, pos_v, neg_v):
        emb_u = self.u_embeddings(pos_u)
        emb_v = self.v_embeddings(pos_v)
        emb_neg_v = self.v_embeddings(neg_v)
        score = torch.clamp(torch.sum(torch.mul(emb_u, emb_v), dim=1), max=10, min=-10)
        score = -F.logsigmoid(score)
        neg_score = torch.bmm(emb_neg_v, emb_u.unsqueeze(2)).squeeze(2)
        neg_score = torch.clamp(neg_score, max=10, min=-10)
        neg_score = -torch.sum(F.logsigmoid(-neg_score), dim=1)
        return torch.mean(score + neg_score)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler")  # (the step order as written)
def test_word2vec_sparse_adam_cosine_schedule_with_the_loss_inside_the_model():
    """Adoni/word2vec_pytorch ``word2vec.py``'s ``Word2VecTrainer.train``: ``SparseAdam`` on
    the sparse embeddings, ``CosineAnnealingLR`` over the loader's length stepped before each
    batch, ``zero_grad``, the model's own mean loss, ``backward``, ``step`` and the running
    loss by ``loss.item()``. A user reads each pair's gradient and its norm (to clip them for
    private embeddings, or to find the pairs that move a word most): at each of 4 steps,
    ``grad1`` (dense, ``[batch, vocabulary, dim]``) is each pair's own gradient with its
    negatives, the norms are theirs, ``.grad`` stays sparse for ``SparseAdam`` and is
    ``grad1``'s mean, and the rows of words no pair touched are zero."""
    torch.manual_seed(0)
    n, negatives, vocab, steps = 5, 3, 12, 4
    model = SkipGramModel(vocab).to(D)
    twin = copy.deepcopy(model)
    optimizer = torch.optim.SparseAdam(list(model.parameters()), lr=0.05)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    g = torch.Generator().manual_seed(5)
    running_loss = 0.0
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for _ in range(steps):
            pos_u, pos_v = torch.randint(0, vocab, (2, n), generator=g)
            neg_v = torch.randint(0, vocab, (n, negatives), generator=g)
            follow(twin, model)
            want = {k: w.to_dense() for k, w in loop(twin, twin, pos_u, pos_v, neg_v).items()}
            scheduler.step()
            optimizer.zero_grad()
            loss = model.forward(pos_u, pos_v, neg_v)
            loss.backward()
            assert model.u_embeddings.weight.grad.is_sparse
            assert_all({k: p.grad1 for k, p in model.named_parameters()}, want, "pairs")
            torch.testing.assert_close(h.norms(), flat(want).norm(dim=1), rtol=1e-9, atol=0)
            for k, p in model.named_parameters():
                torch.testing.assert_close(p.grad1.mean(0), p.grad.to_dense(), msg=k)
            untouched = torch.ones(vocab, dtype=torch.bool)
            untouched[pos_u] = False
            assert not model.u_embeddings.weight.grad1[:, untouched].any()
            optimizer.step()
            running_loss = running_loss * 0.9 + loss.item() * 0.1
    assert math.isfinite(running_loss)


def extract(a, t, x_shape):
    """lucidrains/denoising-diffusion-pytorch, ``denoising_diffusion_pytorch.py``: ``extract``,
    each example's entry of a schedule, shaped to broadcast."""
    b, *_ = t.shape
    return a.gather(-1, t).reshape(b, *((1,) * (len(x_shape) - 1)))


class TimeConditionedDenoiser(nn.Module):
    """A small stand-in for the repository's ``Unet``: sinusoidal time embeddings through an
    MLP giving a scale and shift of the features (``ResnetBlock``'s ``scale_shift``), group
    norms and SiLU, convolutions in and out; called ``model(x, t, x_self_cond)``."""

    def __init__(self, channels=2, dim=6):
        super().__init__()
        self.dim = dim
        self.time_mlp = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, 2 * dim))
        self.init_conv = nn.Conv2d(channels, dim, 3, padding=1)
        self.norm, self.block = nn.GroupNorm(2, dim), nn.Conv2d(dim, dim, 3, padding=1)
        self.final_conv = nn.Conv2d(dim, channels, 1)

    def forward(self, x, time, x_self_cond=None):
        half = self.dim // 2
        emb = math.log(10000) / (half - 1)
        emb = torch.exp(torch.arange(half, dtype=x.dtype) * -emb)
        emb = time[:, None].to(x.dtype) * emb[None, :]
        scale, shift = self.time_mlp(torch.cat((emb.sin(), emb.cos()), dim=-1))[
            ..., None, None
        ].chunk(2, 1)
        h = self.init_conv(x)
        h = F.silu(self.norm(h) * (scale + 1) + shift)
        return self.final_conv(self.block(h) + self.init_conv(x))


class GaussianDiffusion(nn.Module):
    """``denoising_diffusion_pytorch.py``'s ``GaussianDiffusion`` (``objective="pred_v"``, the
    linear schedule, ``min_snr_loss_weight=True``): ``forward`` draws each image's timestep
    by ``torch.randint``, normalizes to ``[-1, 1]`` and calls ``p_losses``, which draws the
    noise (``randn_like``), ``q_sample``s, predicts, and returns the mean over the batch of
    each image's mean squared error to ``v`` weighted by its timestep's clipped SNR."""

    def __init__(self, model, timesteps=50, min_snr_gamma=5):
        super().__init__()
        self.model, self.num_timesteps = model, timesteps
        scale = 1000 / timesteps
        betas = torch.linspace(scale * 0.0001, scale * 0.02, timesteps, dtype=torch.float64)
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        self.register_buffer("sqrt_alphas_cumprod", torch.sqrt(alphas_cumprod).float())
        self.register_buffer(
            "sqrt_one_minus_alphas_cumprod", torch.sqrt(1.0 - alphas_cumprod).float()
        )
        snr = alphas_cumprod / (1 - alphas_cumprod)
        self.register_buffer(
            "loss_weight", (snr.clone().clamp_(max=min_snr_gamma) / (snr + 1)).float()
        )

    def q_sample(self, x_start, t, noise):
        return (
            extract(self.sqrt_alphas_cumprod, t, x_start.shape) * x_start
            + extract(self.sqrt_one_minus_alphas_cumprod, t, x_start.shape) * noise
        )

    def p_losses(self, x_start, t, noise=None):
        noise = torch.randn_like(x_start) if noise is None else noise
        x = self.q_sample(x_start=x_start, t=t, noise=noise)
        model_out = self.model(x, t, None)
        target = (
            extract(self.sqrt_alphas_cumprod, t, x_start.shape) * noise
            - extract(self.sqrt_one_minus_alphas_cumprod, t, x_start.shape) * x_start
        )
        loss = F.mse_loss(model_out, target, reduction="none")
        loss = loss.flatten(1).mean(1)  # (reduce(loss, "b ... -> b", "mean"))
        loss = loss * extract(self.loss_weight, t, loss.shape)
        return loss.mean()

    def forward(self, img):
        t = torch.randint(0, self.num_timesteps, (img.shape[0],)).long()
        return self.p_losses(img * 2 - 1, t)


def test_denoising_diffusion_trainer_accumulation_clipping_and_ema_with_each_images_gradient():
    """lucidrains/denoising-diffusion-pytorch ``Trainer.train``: ``gradient_accumulate_every``
    micro-batches, each ``loss = self.model(data) / gradient_accumulate_every`` (the timesteps
    and the noise drawn inside the forward) and its backward, the total loss by ``.item()``,
    ``clip_grad_norm_`` to ``max_grad_norm``, Adam with ``adam_betas=(0.9, 0.99)``,
    ``zero_grad`` and the EMA of the weights (``ema_pytorch``'s update, every step here). A user
    reads each image's gradient after each micro-batch and ``h.clear()``s it (as gradhooks'
    accumulation asks, to keep the micro-batches' examples apart): each is the image's own
    gradient of its weighted loss with the timestep and noise the forward drew (drawn again
    from the same random state), over the accumulation steps; ``.grad`` is their sum over the
    micro-batches, before the clipping."""
    torch.manual_seed(0)
    ACC, n, steps = 2, 3, 2
    diffusion = GaussianDiffusion(TimeConditionedDenoiser()).to(D)
    twin, ema = copy.deepcopy(diffusion), copy.deepcopy(diffusion)
    opt = torch.optim.Adam(diffusion.parameters(), lr=8e-5, betas=(0.9, 0.99))
    g = torch.Generator().manual_seed(2)
    with gradhooks.add_hooks(diffusion) as h:
        for step in range(steps):
            total_loss, summed = 0.0, {}
            for _ in range(ACC):
                data = torch.rand(n, 2, 6, 6, generator=g, dtype=D)
                state = torch.get_rng_state()
                t = torch.randint(0, twin.num_timesteps, (n,)).long()
                noise = torch.randn_like(data)
                torch.set_rng_state(state)  # (the forward draws the same again)
                follow(twin, diffusion)
                want = loop(
                    twin, lambda x, t, z: twin.p_losses(x * 2 - 1, t, z) / ACC, data, t, noise
                )
                loss = diffusion(data)
                loss = loss / ACC
                total_loss += loss.item()
                loss.backward()
                assert_all(
                    {k: p.grad1 for k, p in trainable(diffusion).items()}, want, f"step {step}"
                )
                for k, w in want.items():
                    summed[k] = summed.get(k, 0) + w.sum(0) / n
                h.clear()
            assert_all({k: p.grad for k, p in trainable(diffusion).items()}, summed, "summed")
            torch.nn.utils.clip_grad_norm_(diffusion.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for p_ema, p in zip(ema.parameters(), diffusion.parameters()):
                    p_ema.lerp_(p, 1 - 0.995)
    assert math.isfinite(total_loss)


class NewGELU(nn.Module):
    """karpathy/llm.c, ``train_gpt2.py``: ``NewGELU``, the tanh approximation written out."""

    def forward(self, input):
        return (
            0.5
            * input
            * (
                1.0
                + torch.tanh(math.sqrt(2.0 / math.pi) * (input + 0.044715 * torch.pow(input, 3.0)))
            )
        )


class LLMCBlock(nn.Module):
    """``train_gpt2.py``'s ``Block``: ``CausalSelfAttention`` by
    ``F.scaled_dot_product_attention(is_causal=True)`` on a fused ``c_attn``, and the MLP with
    ``NewGELU``, each after a LayerNorm."""

    def __init__(self, n_embd=8, n_head=2):
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.c_attn, self.c_proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), NewGELU(), nn.Linear(4 * n_embd, n_embd)
        )

    def attn(self, x):
        B_, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B_, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B_, T, C))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class LLMCGPT(nn.Module):
    """``train_gpt2.py``'s ``GPT``: token and position embeddings, the blocks, ``ln_f``, the
    ``lm_head`` tied to ``wte``, and with targets the loss inside,
    ``F.cross_entropy(..., ignore_index=-1)`` over the micro-batch's tokens."""

    def __init__(self, vocab_size=13, block_size=8, n_embd=8, n_layer=2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(LLMCBlock(n_embd) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None, return_logits=True):
        pos = torch.arange(0, idx.size(1), dtype=torch.long)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
            )
        return (logits if return_logits else None), loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decay_params = [p for p in param_dict.values() if p.dim() >= 2]
        nodecay_params = [p for p in param_dict.values() if p.dim() < 2]
        optim_groups = [
            {"params": decay_params, "weight_decay": weight_decay},
            {"params": nodecay_params, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas)


def test_llmc_train_gpt2_accumulation_clipping_and_lr_schedule_with_prompts_ignored():
    """karpathy/llm.c ``train_gpt2.py``'s loop: ``configure_optimizers``' decay groups,
    ``get_lr``'s warmup and cosine decay to ``learning_rate_decay_frac``, ``grad_accum_steps``
    micro-steps of ``loss = model(x, y, return_logits=False)[1] / grad_accum_steps`` and its
    backward, ``clip_grad_norm_`` (the norm it returns logged), the step and
    ``zero_grad(set_to_none=True)``; the targets of each sequence's prompt set to ``-1``
    (ignored). The loss is the mean over the micro-batch's counted tokens, one number of the
    batch dividing each sequence's sum: a user logs each sequence's gradient norm after each
    micro-step and clears ``grad1`` (gradhooks' accumulation keeps the micro-batches apart so).
    At each micro-step ``grad1`` and the norms are each sequence's own summed token loss over
    the micro-batch's token count, times the batch size, against the float64 loop; ``.grad``
    before the clipping is their mean over the micro-steps, and the clipping's norm is its."""
    torch.manual_seed(0)
    ACC, n, T, steps, max_lr, warmup = 2, 3, 6, 3, 3e-3, 2
    model = LLMCGPT().to(D)
    twin = copy.deepcopy(model)
    optimizer = model.configure_optimizers(0.1, max_lr, (0.9, 0.95))

    def get_lr(it, min_lr=max_lr * 0.1):
        if it < warmup:
            return max_lr * (it + 1) / warmup
        decay_ratio = (it - warmup) / (steps - warmup)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (max_lr - min_lr)

    g = torch.Generator().manual_seed(4)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for step in range(steps):
            follow(twin, model)
            summed, lossf = {}, 0.0
            for _ in range(ACC):
                tokens = torch.randint(0, 13, (n, T + 1), generator=g)
                x, y = tokens[:, :-1], tokens[:, 1:].clone()
                y[torch.arange(T) < torch.tensor([1, 3, 2])[:, None]] = -1  # (the prompts)
                counted = int((y != -1).sum())

                def own(x1, y1, counted=counted):
                    logits = twin(x1)[0]
                    return (
                        F.cross_entropy(
                            logits.view(-1, 13), y1.view(-1), ignore_index=-1, reduction="sum"
                        )
                        * n
                        / counted
                        / ACC
                    )

                want = loop(twin, own, x, y)
                _, loss = model(x, y, return_logits=False)
                loss = loss / ACC
                lossf += loss.detach()
                loss.backward()
                assert_all({k: p.grad1 for k, p in trainable(model).items()}, want, f"step {step}")
                torch.testing.assert_close(h.norms(), flat(want).norm(dim=1), rtol=1e-9, atol=0)
                for k, w in want.items():
                    summed[k] = summed.get(k, 0) + w.mean(0)
                h.clear()
            assert_all({k: p.grad for k, p in trainable(model).items()}, summed, "the step's")
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            assert float(norm) == pytest.approx(
                float(flat({k: v[None] for k, v in summed.items()}).norm()), rel=1e-9
            )
            for param_group in optimizer.param_groups:
                param_group["lr"] = get_lr(step)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            assert math.isfinite(float(lossf))

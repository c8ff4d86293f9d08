"""A seventh round of other projects' models against the per-example loop, and thirteen of
them trained as their users train them.

Each model is a small excerpt of a public repository's model code, rewritten in plain torch
(each class cites the repository and file it follows), at a tiny configuration: sequence models
(mamba-minimal, RWKV-4, S4D, LRU, TimesNet), ConvNeXt-V2's global response norm, point clouds
(PointNet, DGCNN), graph networks written in torch (dense GCN, GIN and GAT, a mesh network
passing messages by ``index_add_``), tabular and recommendation models (SAINT, NODE's oblivious
trees, DeepFM, DCN, xDeepFM, DLRM's ``EmbeddingBag`` with offsets, NeuMF, SASRec), audio
(WaveNet, torchaudio's Conformer, Whisper), generative models (the denoising-diffusion U-Net
with weight-standardized convolutions, StyleGAN2's modulated convolutions with the batch in the
groups, PixelCNN's masked convolutions, a VAE, a NeRF with volume rendering), efficient-KAN,
the Set Transformer with its heads folded into the batch, torchtitan's Llama, capsules' dynamic
routing and the Decision Transformer on Hugging Face's GPT-2.

Each is built in float64 and training mode; ``grad1`` and the per-example norms of one backward
are compared with a loop of batches of one (``rtol=1e-7``; ``1e-5`` where the model computes in
float32 inside, as its authors wrote it): 32 match. Six, whose examples meet (BatchNorm in
training mode in PointNet and DeepFM, SAINT's attention between the rows of the batch, a graph
whose nodes are the examples, graphs concatenated into one list of nodes, TimesNet's periods
chosen by the batch's spectrum and read into NumPy), are refused by gradhooks' own error naming
the layer and the shapes (TimesNet's once had a ``grad1`` off the loop's). DGCNN's neighbours
gathered from the flattened batch are refused where the loop works (a strict xfail, with the
reason). Thirteen are then trained in float32 as their users train them: three steps of
``zero_grad``, a forward under CPU bfloat16 autocast, ``backward`` (or gradhooks' DP step) and
an AdamW step; at each step ``grad1`` (or the clipped ``.grad``) equals the same model's
per-example loop under the same autocast within bfloat16's tolerance, and ``grad1`` reduces to
``.grad``. Whisper (its decoder's logits by the token embedding's weight, beside the
embedding's call) and the diffusion U-Net under autocast (a convolution that branches on its
input's dtype) were once refused; PixelCNN's backward once failed.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from einops import rearrange, reduce, repeat
from torch import Tensor, nn

import gradhooks
from harness import corrupting, one_thread, raised  # noqa: F401 (one_thread: an autouse fixture)

B = 3  # the batch


@dataclass
class Spec:
    """A model, its inputs (batched along dimension 0 unless ``split`` says how to take
    example ``i`` out of them), the targets and each example's own loss ``losses(out,
    *targets)``, ``[batch]``."""

    model: nn.Module
    args: tuple
    losses: Callable[..., Tensor]
    targets: tuple = ()
    rtol: float = 1e-7
    split: Callable[[tuple, int], tuple] | None = None
    bn_eval: bool = False  # the BatchNorms in eval mode (a trained backbone's, frozen)


def _cast(t, dtype):
    return t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() else t


def _example(spec: Spec, i: int) -> tuple:
    if spec.split is not None:
        return spec.split(spec.args, i)
    return tuple(a[i : i + 1] for a in spec.args)


def own_gradients(spec: Spec) -> dict[str, Tensor]:
    """Each example's own gradient: one forward and backward of the batch of one."""
    params = {n: p for n, p in spec.model.named_parameters() if p.requires_grad}
    rows = {n: [] for n in params}
    with gradhooks.paused():  # (inside a training loop's hooks: without them)
        for i in range(len(spec.targets[0]) if spec.targets else B):
            _one(spec, i, params, rows)
    return {n: torch.stack(r) for n, r in rows.items()}


def _one(spec: Spec, i: int, params: dict, rows: dict) -> None:
    out = spec.model(*_example(spec, i))
    loss = spec.losses(out, *(t[i : i + 1] for t in spec.targets)).float().sum()
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    for n, g in zip(params, grads):
        rows[n].append(torch.zeros_like(params[n]) if g is None else g)


def build(factory, dtype=torch.float64) -> Spec:
    torch.manual_seed(0)
    spec = factory()
    with warnings.catch_warnings():  # (a complex buffer, made again by init_buffers)
        warnings.filterwarnings("ignore", "Casting complex values to real")
        spec.model = spec.model.to(dtype).train()
    if hasattr(spec.model, "init_buffers"):
        spec.model.init_buffers()
    if spec.bn_eval:
        for m in spec.model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()
    spec.args = tuple(_cast(a, dtype) for a in spec.args)
    spec.targets = tuple(_cast(t, dtype) for t in spec.targets)
    return spec


def assert_matches_loop(factory) -> None:
    """``grad1`` and the per-example norms of one backward against the loop, in float64."""
    spec = build(factory)
    want = own_gradients(spec)
    assert want, "no trainable parameter"
    with gradhooks.add_hooks(spec.model, loss_reduction="sum", quantities=("grad1", "norms")) as h:
        spec.losses(spec.model(*spec.args), *spec.targets).sum().backward()
    tol = dict(rtol=spec.rtol, atol=spec.rtol * 1e-3)
    for n, p in spec.model.named_parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:  # (unused: WaveNet's last residual output; as .grad, no grad1)
            assert getattr(p, "grad1", None) is None and not want[n].any(), n
            continue
        assert getattr(p, "grad1", None) is not None, f"{n} has no grad1"
        torch.testing.assert_close(p.grad1, want[n], **tol, msg=lambda m, n=n: f"{n}: {m}")
        torch.testing.assert_close(p.grad1.sum(0), p.grad, **tol, msg=lambda m, n=n: f"{n}: {m}")
    norms = torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)
    torch.testing.assert_close(h.norms(), norms, **tol)


def assert_refused(factory, error: type, says: list[str]) -> None:
    """Refused by gradhooks' own ``error``, whose message names ``says``; no ``grad1``."""
    spec = build(factory)

    def run():
        with gradhooks.add_hooks(spec.model, loss_reduction="sum"):
            spec.losses(spec.model(*spec.args), *spec.targets).sum().backward()

    raised(error, says, run)
    assert all(getattr(p, "grad1", None) is None for p in spec.model.parameters())


def cross_entropy(logits, target):
    """Each example's summed token (or single) cross-entropy."""
    per = F.cross_entropy(logits.transpose(1, -1), target, reduction="none")
    return per.flatten(1).sum(1) if per.dim() > 1 else per


def channels_cross_entropy(logits, target):
    """Each example's summed cross-entropy of logits ``[batch, classes, time]``."""
    return F.cross_entropy(logits, target, reduction="none").sum(1)


def mse(out, target):
    return (out - target).pow(2).flatten(1).sum(1)


# -- sequence models ----------------------------------------------------------------------------


class MambaRMSNorm(nn.Module):
    """johnma2006/mamba-minimal, ``model.py``: ``RMSNorm``."""

    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MambaBlock(nn.Module):
    """johnma2006/mamba-minimal, ``model.py``: ``MambaBlock``, the selective scan a Python loop
    over time; ``A_log`` taken to float32 (``-torch.exp(self.A_log.float())``) as written."""

    def __init__(self, d_model=6, d_state=4, d_conv=3, expand=2):
        super().__init__()
        self.d_inner, self.dt_rank, self.n = expand * d_model, math.ceil(d_model / 16), d_state
        self.in_proj = nn.Linear(d_model, self.d_inner * 2, bias=False)
        self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, d_conv, groups=self.d_inner,
                                padding=d_conv - 1)  # fmt: skip
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + d_state * 2, bias=False)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True)
        A = repeat(torch.arange(1, d_state + 1), "n -> d n", d=self.d_inner)
        self.A_log = nn.Parameter(torch.log(A))
        self.D = nn.Parameter(torch.ones(self.d_inner))
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=False)

    def forward(self, x):
        length = x.shape[1]
        x_and_res = rearrange(self.in_proj(x), "b l x -> b x l")
        (x, res) = x_and_res.split(split_size=[self.d_inner, self.d_inner], dim=1)
        x = F.silu(self.conv1d(x)[:, :, :length])
        y = self.ssm(x) * F.silu(res)
        return self.out_proj(rearrange(y, "b d_model l -> b l d_model"))

    def ssm(self, x):
        A = -torch.exp(self.A_log.float())
        D = self.D.float()
        x_dbl = self.x_proj(rearrange(x, "b d l -> b l d"))
        (delta, B_, C) = x_dbl.split(split_size=[self.dt_rank, self.n, self.n], dim=-1)
        delta = F.softplus(self.dt_proj(delta))
        deltaA = torch.exp(torch.einsum("bld,dn->bdln", delta, A))
        deltaB_u = torch.einsum("bld,bln,bdl->bdln", delta, B_, x)
        h = torch.zeros((x.shape[0], self.d_inner, self.n), dtype=x.dtype)
        ys = []
        for i in range(x.shape[2]):
            h = deltaA[:, :, i] * h + deltaB_u[:, :, i]
            ys.append(torch.einsum("bdn,bn->bd", h, C[:, i, :]))
        return torch.stack(ys, dim=2) + x * rearrange(D, "d_in -> d_in 1")


class Mamba(nn.Module):
    """johnma2006/mamba-minimal, ``model.py``: ``Mamba`` (its ``lm_head`` tied to the
    embedding) and ``ResidualBlock`` (``mixer(norm(x)) + x``)."""

    def __init__(self, vocab=11, d_model=6, n_layer=2):
        super().__init__()
        self.embedding = nn.Embedding(vocab, d_model)
        self.norms = nn.ModuleList(MambaRMSNorm(d_model) for _ in range(n_layer))
        self.mixers = nn.ModuleList(MambaBlock(d_model) for _ in range(n_layer))
        self.norm_f = MambaRMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.lm_head.weight = self.embedding.weight

    def forward(self, input_ids):
        x = self.embedding(input_ids)
        for norm, mixer in zip(self.norms, self.mixers):
            x = mixer(norm(x)) + x
        return self.lm_head(self.norm_f(x))


def mamba_minimal():
    tokens = torch.randint(11, (B, 6))
    return Spec(Mamba(), (tokens[:, :-1],), cross_entropy, (tokens[:, 1:],), rtol=1e-5)


class RWKVTimeMix(nn.Module):
    """BlinkDL/RWKV-LM, ``RWKV-v4/src/model.py``: ``RWKV_TimeMix`` (token shift by
    ``nn.ZeroPad2d``, mixing coefficients and decays as parameters of the block), its WKV the
    numerically safe recurrence of ``RWKV-v4/src/model_run.py`` over time."""

    def __init__(self, d):
        super().__init__()
        self.time_decay = nn.Parameter(torch.linspace(-1.0, 0.5, d))
        self.time_first = nn.Parameter(torch.full((d,), math.log(0.3)) + 0.1 * torch.randn(d))
        self.time_shift = nn.ZeroPad2d((0, 0, 1, -1))
        self.time_mix_k = nn.Parameter(torch.rand(1, 1, d))
        self.time_mix_v = nn.Parameter(torch.rand(1, 1, d))
        self.time_mix_r = nn.Parameter(torch.rand(1, 1, d))
        self.key = nn.Linear(d, d, bias=False)
        self.value = nn.Linear(d, d, bias=False)
        self.receptance = nn.Linear(d, d, bias=False)
        self.output = nn.Linear(d, d, bias=False)

    def forward(self, x):
        xx = self.time_shift(x)
        xk = x * self.time_mix_k + xx * (1 - self.time_mix_k)
        xv = x * self.time_mix_v + xx * (1 - self.time_mix_v)
        xr = x * self.time_mix_r + xx * (1 - self.time_mix_r)
        k, v, sr = self.key(xk), self.value(xv), torch.sigmoid(self.receptance(xr))
        w, u = -torch.exp(self.time_decay), self.time_first
        aa = torch.zeros_like(k[:, 0])
        bb = torch.zeros_like(k[:, 0])
        pp = torch.full_like(k[:, 0], -1e38)
        out = []
        for t in range(x.shape[1]):
            kk, vv = k[:, t], v[:, t]
            ww = u + kk
            p = torch.maximum(pp, ww)
            e1, e2 = torch.exp(pp - p), torch.exp(ww - p)
            out.append((e1 * aa + e2 * vv) / (e1 * bb + e2))
            ww = pp + w
            p = torch.maximum(ww, kk)
            e1, e2 = torch.exp(ww - p), torch.exp(kk - p)
            aa, bb, pp = e1 * aa + e2 * vv, e1 * bb + e2, p
        return self.output(sr * torch.stack(out, 1))


class RWKVChannelMix(nn.Module):
    """BlinkDL/RWKV-LM, ``RWKV-v4/src/model.py``: ``RWKV_ChannelMix`` (squared ReLU)."""

    def __init__(self, d):
        super().__init__()
        self.time_shift = nn.ZeroPad2d((0, 0, 1, -1))
        self.time_mix_k = nn.Parameter(torch.rand(1, 1, d))
        self.time_mix_r = nn.Parameter(torch.rand(1, 1, d))
        self.key = nn.Linear(d, 4 * d, bias=False)
        self.receptance = nn.Linear(d, d, bias=False)
        self.value = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        xx = self.time_shift(x)
        xk = x * self.time_mix_k + xx * (1 - self.time_mix_k)
        xr = x * self.time_mix_r + xx * (1 - self.time_mix_r)
        k = torch.square(torch.relu(self.key(xk)))
        return torch.sigmoid(self.receptance(xr)) * self.value(k)


class RWKV(nn.Module):
    """BlinkDL/RWKV-LM, ``RWKV-v4/src/model.py``: ``GPT`` of ``Block``s (``ln0`` before the
    first), a head without bias."""

    def __init__(self, vocab=11, d=6, n_layer=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln0 = nn.LayerNorm(d)
        self.ln1 = nn.ModuleList(nn.LayerNorm(d) for _ in range(n_layer))
        self.ln2 = nn.ModuleList(nn.LayerNorm(d) for _ in range(n_layer))
        self.att = nn.ModuleList(RWKVTimeMix(d) for _ in range(n_layer))
        self.ffn = nn.ModuleList(RWKVChannelMix(d) for _ in range(n_layer))
        self.ln_out = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.ln0(self.emb(idx))
        for ln1, ln2, att, ffn in zip(self.ln1, self.ln2, self.att, self.ffn):
            x = x + att(ln1(x))
            x = x + ffn(ln2(x))
        return self.head(self.ln_out(x))


def rwkv4():
    tokens = torch.randint(11, (B, 6))
    return Spec(RWKV(), (tokens[:, :-1],), cross_entropy, (tokens[:, 1:],))


class S4DKernel(nn.Module):
    """state-spaces/s4, ``models/s4/s4d.py``: ``S4DKernel``, a complex diagonal SSM's
    convolution kernel (``C`` kept as ``view_as_real``)."""

    def __init__(self, d_model, N=8, dt_min=0.001, dt_max=0.1):
        super().__init__()
        H = d_model
        log_dt = torch.rand(H) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)
        self.C = nn.Parameter(torch.view_as_real(torch.randn(H, N // 2, dtype=torch.cfloat)))
        self.log_dt = nn.Parameter(log_dt)
        self.log_A_real = nn.Parameter(torch.log(0.5 * torch.ones(H, N // 2)))
        self.A_imag = nn.Parameter(math.pi * repeat(torch.arange(N // 2).float(), "n -> h n", h=H))

    def forward(self, L):
        dt = torch.exp(self.log_dt)
        C = torch.view_as_complex(self.C)
        A = -torch.exp(self.log_A_real) + 1j * self.A_imag
        dtA = A * dt.unsqueeze(-1)
        K = dtA.unsqueeze(-1) * torch.arange(L, device=A.device)
        C = C * (torch.exp(dtA) - 1.0) / A
        return 2 * torch.einsum("hn, hnl -> hl", C, torch.exp(K)).real


class S4D(nn.Module):
    """state-spaces/s4, ``models/s4/s4d.py``: ``S4D``, the kernel applied by FFT, a skip
    ``D``, GELU and a 1x1 convolution with a GLU."""

    def __init__(self, d_model, d_state=8):
        super().__init__()
        self.h = d_model
        self.D = nn.Parameter(torch.randn(self.h))
        self.kernel = S4DKernel(self.h, N=d_state)
        self.activation = nn.GELU()
        self.output_linear = nn.Sequential(nn.Conv1d(self.h, 2 * self.h, kernel_size=1),
                                           nn.GLU(dim=-2))  # fmt: skip

    def forward(self, u):
        L = u.size(-1)
        k = self.kernel(L=L)
        k_f = torch.fft.rfft(k, n=2 * L)
        u_f = torch.fft.rfft(u, n=2 * L)
        y = torch.fft.irfft(u_f * k_f, n=2 * L)[..., :L]
        y = y + u * self.D.unsqueeze(-1)
        return self.output_linear(self.activation(y)), None


class S4Model(nn.Module):
    """state-spaces/s4, ``example.py``: ``S4Model``, an encoder, pre-norm S4D layers with
    residuals (the layers transposed, ``B H L``), mean pooling and a decoder."""

    def __init__(self, d_input=2, d_output=3, d_model=6, n_layers=2):
        super().__init__()
        self.encoder = nn.Linear(d_input, d_model)
        self.s4_layers = nn.ModuleList(S4D(d_model) for _ in range(n_layers))
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(n_layers))
        self.decoder = nn.Linear(d_model, d_output)

    def forward(self, x):
        x = self.encoder(x).transpose(-1, -2)
        for layer, norm in zip(self.s4_layers, self.norms):
            z = norm(x.transpose(-1, -2)).transpose(-1, -2)
            z, _ = layer(z)
            x = z + x
        return self.decoder(x.transpose(-1, -2).mean(dim=1))


def FFT_for_Period(x, k=2):
    """thuml/Time-Series-Library, ``models/TimesNet.py``: ``FFT_for_Period``, the periods
    of the batch's largest mean amplitudes, read into NumPy."""
    xf = torch.fft.rfft(x, dim=1)
    frequency_list = abs(xf).mean(0).mean(-1)
    frequency_list[0] = 0
    _, top_list = torch.topk(frequency_list, k)
    top_list = top_list.detach().cpu().numpy()
    period = x.shape[1] // top_list
    return period, abs(xf).mean(-1)[:, top_list]


class TimesBlock(nn.Module):
    """thuml/Time-Series-Library, ``models/TimesNet.py``: ``TimesBlock`` (each period's 2D
    view through a convolution, weighted by the amplitudes), its Inception block one
    convolution pair."""

    def __init__(self, seq_len=8, d_model=3, k=2):
        super().__init__()
        self.seq_len, self.k = seq_len, k
        self.conv = nn.Sequential(nn.Conv2d(d_model, 4, 3, padding=1), nn.GELU(),
                                  nn.Conv2d(4, d_model, 3, padding=1))  # fmt: skip

    def forward(self, x):
        B_, T, N = x.size()
        period_list, period_weight = FFT_for_Period(x, self.k)
        res = []
        for i in range(self.k):
            period = period_list[i]
            if self.seq_len % period != 0:
                length = ((self.seq_len // period) + 1) * period
                padding = torch.zeros(
                    [x.shape[0], (length - self.seq_len), x.shape[2]], dtype=x.dtype
                )
                out = torch.cat([x, padding], dim=1)
            else:
                length, out = self.seq_len, x
            out = out.reshape(B_, length // period, period, N).permute(0, 3, 1, 2).contiguous()
            out = self.conv(out).permute(0, 2, 3, 1).reshape(B_, -1, N)
            res.append(out[:, : self.seq_len, :])
        res = torch.stack(res, dim=-1)
        period_weight = F.softmax(period_weight, dim=1)
        period_weight = period_weight.unsqueeze(1).unsqueeze(1).repeat(1, T, N, 1)
        return torch.sum(res * period_weight, -1) + x


class TimesNet(nn.Module):
    """thuml/Time-Series-Library, ``models/TimesNet.py``: ``Model`` for classification, an
    embedding, a TimesBlock under LayerNorm, a head on the flattened output."""

    def __init__(self):
        super().__init__()
        self.enc_embedding = nn.Linear(2, 3)
        self.model = TimesBlock()
        self.layer_norm = nn.LayerNorm(3)
        self.projection = nn.Linear(3 * 8, 3)

    def forward(self, x_enc):
        enc_out = self.layer_norm(self.model(self.enc_embedding(x_enc)))
        return self.projection(F.gelu(enc_out).reshape(enc_out.shape[0], -1))


def timesnet():
    return Spec(TimesNet(), (torch.randn(B, 8, 2),), cross_entropy, (torch.randint(3, (B,)),))


def s4d():
    return Spec(S4Model(), (torch.randn(B, 7, 2),), cross_entropy, (torch.randint(3, (B,)),))


class LRU(nn.Module):
    """NicolasZucchet/minimal-LRU, ``lru/model.py``: ``LRU`` (Orvieto et al.'s Linear
    Recurrent Unit), in torch: a complex diagonal recurrence ``exp(-exp(nu_log) +
    i exp(theta_log))``, ``B`` normalized by ``exp(gamma_log)``, the output's real part, a
    skip ``D``; the scan a loop over time."""

    def __init__(self, N=4, H=5, r_min=0.4, r_max=0.9, max_phase=6.28):
        super().__init__()
        u1, u2 = torch.rand(N), torch.rand(N)
        nu_log = torch.log(-0.5 * torch.log(u1 * (r_max**2 - r_min**2) + r_min**2))
        theta_log = torch.log(max_phase * u2)
        diag = torch.exp(-torch.exp(nu_log) + 1j * torch.exp(theta_log))
        self.nu_log, self.theta_log = nn.Parameter(nu_log), nn.Parameter(theta_log)
        self.gamma_log = nn.Parameter(torch.log(torch.sqrt(1 - torch.abs(diag) ** 2)))
        self.B_re = nn.Parameter(torch.randn(N, H) / math.sqrt(2 * H))
        self.B_im = nn.Parameter(torch.randn(N, H) / math.sqrt(2 * H))
        self.C_re = nn.Parameter(torch.randn(H, N) / math.sqrt(N))
        self.C_im = nn.Parameter(torch.randn(H, N) / math.sqrt(N))
        self.D = nn.Parameter(torch.randn(H))

    def forward(self, u):
        lam = torch.exp(-torch.exp(self.nu_log) + 1j * torch.exp(self.theta_log))
        B_norm = (self.B_re + 1j * self.B_im) * torch.exp(self.gamma_log).unsqueeze(-1)
        C = self.C_re + 1j * self.C_im
        Bu = u.to(B_norm.dtype) @ B_norm.T
        h, hs = torch.zeros_like(Bu[:, 0]), []
        for t in range(u.shape[1]):
            h = lam * h + Bu[:, t]
            hs.append(h)
        return (torch.stack(hs, 1) @ C.T).real + self.D * u


class LRUClassifier(nn.Module):
    """minimal-LRU's ``StackedEncoderModel`` and ``ClassificationModel``: an encoder, LRU
    layers under LayerNorm with a GELU-gated residual, mean pooling."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(2, 5)
        self.norm = nn.LayerNorm(5)
        self.lru = LRU()
        self.out1, self.out2 = nn.Linear(5, 5), nn.Linear(5, 5)
        self.decoder = nn.Linear(5, 3)

    def forward(self, x):
        x = self.encoder(x)
        y = F.gelu(self.lru(self.norm(x)))
        x = x + self.out1(y) * torch.sigmoid(self.out2(y))
        return self.decoder(x.mean(1))


def lru():
    return Spec(LRUClassifier(), (torch.randn(B, 6, 2),), cross_entropy, (torch.randint(3, (B,)),))


# -- vision and point clouds ---------------------------------------------------------------------


class ConvNeXtLayerNorm(nn.Module):
    """facebookresearch/ConvNeXt-V2, ``models/utils.py``: ``LayerNorm`` over channels last
    (``F.layer_norm``) or first (written out)."""

    def __init__(self, normalized_shape, eps=1e-6, data_format="channels_last"):
        super().__init__()
        self.weight = nn.Parameter(
            torch.ones(normalized_shape) + 0.1 * torch.randn(normalized_shape)
        )
        self.bias = nn.Parameter(0.1 * torch.randn(normalized_shape))
        self.eps, self.data_format = eps, data_format
        self.normalized_shape = (normalized_shape,)

    def forward(self, x):
        if self.data_format == "channels_last":
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class GRN(nn.Module):
    """facebookresearch/ConvNeXt-V2, ``models/utils.py``: ``GRN``, global response
    normalization over each image's positions (``gamma`` and ``beta`` drawn, as after
    training, not zero)."""

    def __init__(self, dim):
        super().__init__()
        self.gamma = nn.Parameter(0.1 * torch.randn(1, 1, 1, dim))
        self.beta = nn.Parameter(0.1 * torch.randn(1, 1, 1, dim))

    def forward(self, x):
        Gx = torch.norm(x, p=2, dim=(1, 2), keepdim=True)
        Nx = Gx / (Gx.mean(dim=-1, keepdim=True) + 1e-6)
        return self.gamma * (x * Nx) + self.beta + x


class ConvNeXtV2Block(nn.Module):
    """facebookresearch/ConvNeXt-V2, ``models/convnextv2.py``: ``Block``."""

    def __init__(self, dim):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = ConvNeXtLayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.grn = GRN(4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        input = x
        x = self.dwconv(x).permute(0, 2, 3, 1)
        x = self.pwconv2(self.grn(self.act(self.pwconv1(self.norm(x)))))
        return input + x.permute(0, 3, 1, 2)


class ConvNeXtV2(nn.Module):
    """facebookresearch/ConvNeXt-V2, ``models/convnextv2.py``: ``ConvNeXtV2``, two stages."""

    def __init__(self, in_chans=3, num_classes=3, dims=(4, 8)):
        super().__init__()
        self.downsample_layers = nn.ModuleList([
            nn.Sequential(nn.Conv2d(in_chans, dims[0], kernel_size=4, stride=4),
                          ConvNeXtLayerNorm(dims[0], data_format="channels_first")),
            nn.Sequential(ConvNeXtLayerNorm(dims[0], data_format="channels_first"),
                          nn.Conv2d(dims[0], dims[1], kernel_size=2, stride=2)),
        ])  # fmt: skip
        self.stages = nn.ModuleList(ConvNeXtV2Block(d) for d in dims)
        self.norm = nn.LayerNorm(dims[-1], eps=1e-6)
        self.head = nn.Linear(dims[-1], num_classes)

    def forward(self, x):
        for down, stage in zip(self.downsample_layers, self.stages):
            x = stage(down(x))
        return self.head(self.norm(x.mean([-2, -1])))


def convnext_v2():
    return Spec(
        ConvNeXtV2(), (torch.randn(B, 3, 16, 16),), cross_entropy, (torch.randint(3, (B,)),)
    )


class STN3d(nn.Module):
    """fxia22/pointnet.pytorch, ``pointnet/model.py``: ``STN3d``, a 3x3 transform per cloud
    regressed from its points, the identity added."""

    def __init__(self, w=(4, 6, 8, 6, 5)):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv1d(3, w[0], 1), nn.Conv1d(w[0], w[1], 1)
        self.conv3 = nn.Conv1d(w[1], w[2], 1)
        self.fc1, self.fc2, self.fc3 = (
            nn.Linear(w[2], w[3]),
            nn.Linear(w[3], w[4]),
            nn.Linear(w[4], 9),
        )
        self.bn1, self.bn2, self.bn3 = (
            nn.BatchNorm1d(w[0]),
            nn.BatchNorm1d(w[1]),
            nn.BatchNorm1d(w[2]),
        )
        self.bn4, self.bn5 = nn.BatchNorm1d(w[3]), nn.BatchNorm1d(w[4])

    def forward(self, x):
        batchsize = x.size()[0]
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.relu(self.bn3(self.conv3(x)))
        x = torch.max(x, 2, keepdim=True)[0].view(-1, self.conv3.out_channels)
        x = F.relu(self.bn4(self.fc1(x)))
        x = F.relu(self.bn5(self.fc2(x)))
        x = self.fc3(x)
        iden = torch.eye(3, dtype=x.dtype).view(1, 9).repeat(batchsize, 1)
        return (x + iden).view(-1, 3, 3)


class PointNetCls(nn.Module):
    """fxia22/pointnet.pytorch, ``pointnet/model.py``: ``PointNetfeat`` (the cloud turned by
    its ``STN3d`` with ``torch.bmm``, max-pooled) and ``PointNetCls`` (``log_softmax``)."""

    def __init__(self, k=3, w=(4, 6, 8)):
        super().__init__()
        self.stn = STN3d()
        self.conv1, self.conv2 = nn.Conv1d(3, w[0], 1), nn.Conv1d(w[0], w[1], 1)
        self.conv3 = nn.Conv1d(w[1], w[2], 1)
        self.bn1, self.bn2, self.bn3 = (
            nn.BatchNorm1d(w[0]),
            nn.BatchNorm1d(w[1]),
            nn.BatchNorm1d(w[2]),
        )
        self.fc1, self.fc2, self.fc3 = nn.Linear(w[2], 6), nn.Linear(6, 5), nn.Linear(5, k)
        self.dropout = nn.Dropout(p=0.0)
        self.bn4, self.bn5 = nn.BatchNorm1d(6), nn.BatchNorm1d(5)

    def forward(self, x):
        trans = self.stn(x)
        x = torch.bmm(x.transpose(2, 1), trans).transpose(2, 1)
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        x = self.bn3(self.conv3(x))
        x = torch.max(x, 2, keepdim=True)[0].view(-1, self.conv3.out_channels)
        x = F.relu(self.bn4(self.fc1(x)))
        x = F.relu(self.bn5(self.dropout(self.fc2(x))))
        return F.log_softmax(self.fc3(x), dim=1)


def nll(out, target):
    return F.nll_loss(out, target, reduction="none")


def pointnet(mode="train"):
    model = PointNetCls()
    if mode == "eval":
        trained_statistics(model)
    elif mode == "groupnorm":
        gradhooks.convert_batch_norm(model)
    x, y = torch.randn(B, 3, 10), torch.randint(3, (B,))
    return Spec(model, (x,), nll, (y,), bn_eval=mode == "eval")


def trained_statistics(model: nn.Module) -> None:
    """Running statistics as a trained model's (not the initial zeros and ones)."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.uniform_(-0.1, 0.1)
            m.running_var.uniform_(0.5, 1.5)


def knn(x, k):
    """WangYueFTW/dgcnn, ``pytorch/model.py``: ``knn``."""
    inner = -2 * torch.matmul(x.transpose(2, 1), x)
    xx = torch.sum(x**2, dim=1, keepdim=True)
    pairwise_distance = -xx - inner - xx.transpose(2, 1)
    return pairwise_distance.topk(k=k, dim=-1)[1]


def get_graph_feature(x, k=3):
    """WangYueFTW/dgcnn, ``pytorch/model.py``: ``get_graph_feature``, each point's neighbours
    gathered from the batch's points flattened, ``view(batch_size * num_points, -1)[idx]``,
    by indices offset by each cloud's start."""
    batch_size, num_points = x.size(0), x.size(2)
    x = x.view(batch_size, -1, num_points)
    idx = knn(x, k=k)
    idx_base = torch.arange(0, batch_size).view(-1, 1, 1) * num_points
    idx = (idx + idx_base).view(-1)
    _, num_dims, _ = x.size()
    x = x.transpose(2, 1).contiguous()
    feature = x.view(batch_size * num_points, -1)[idx, :]
    feature = feature.view(batch_size, num_points, k, num_dims)
    x = x.view(batch_size, num_points, 1, num_dims).repeat(1, 1, k, 1)
    return torch.cat((feature - x, x), dim=3).permute(0, 3, 1, 2).contiguous()


class DGCNN(nn.Module):
    """WangYueFTW/dgcnn, ``pytorch/model.py``: ``DGCNN`` (EdgeConv twice, max and mean
    pooling, a BatchNorm'd head), its BatchNorms frozen."""

    def __init__(self, k=3, emb_dims=8, output_channels=3):
        super().__init__()
        self.k = k
        self.conv1 = nn.Sequential(nn.Conv2d(6, 4, kernel_size=1, bias=False), nn.BatchNorm2d(4),
                                   nn.LeakyReLU(negative_slope=0.2))  # fmt: skip
        self.conv2 = nn.Sequential(nn.Conv2d(8, 4, kernel_size=1, bias=False), nn.BatchNorm2d(4),
                                   nn.LeakyReLU(negative_slope=0.2))  # fmt: skip
        self.conv5 = nn.Sequential(nn.Conv1d(8, emb_dims, kernel_size=1, bias=False),
                                   nn.BatchNorm1d(emb_dims), nn.LeakyReLU(negative_slope=0.2))  # fmt: skip
        self.linear1 = nn.Linear(emb_dims * 2, 6, bias=False)
        self.bn6 = nn.BatchNorm1d(6)
        self.dp1 = nn.Dropout(p=0.0)
        self.linear3 = nn.Linear(6, output_channels)

    def forward(self, x):
        batch_size = x.size(0)
        x1 = self.conv1(get_graph_feature(x, k=self.k)).max(dim=-1, keepdim=False)[0]
        x2 = self.conv2(get_graph_feature(x1, k=self.k)).max(dim=-1, keepdim=False)[0]
        x = self.conv5(torch.cat((x1, x2), dim=1))
        x1 = F.adaptive_max_pool1d(x, 1).view(batch_size, -1)
        x2 = F.adaptive_avg_pool1d(x, 1).view(batch_size, -1)
        x = torch.cat((x1, x2), 1)
        x = self.dp1(F.leaky_relu(self.bn6(self.linear1(x)), negative_slope=0.2))
        return self.linear3(x)


def dgcnn():
    model = DGCNN()
    trained_statistics(model)
    x, y = torch.randn(B, 3, 7), torch.randint(3, (B,))
    return Spec(model, (x,), cross_entropy, (y,), bn_eval=True)


# -- graphs --------------------------------------------------------------------------------------


def graphs(n=5, features=3):
    """``B`` graphs of ``n`` nodes as dense, symmetric adjacencies, node features and a mask of
    each graph's real nodes (the last graph smaller)."""
    a = (torch.rand(B, n, n) < 0.5).float()
    adj = ((a + a.transpose(1, 2)) > 0).float() * (1 - torch.eye(n))
    mask = torch.ones(B, n, dtype=torch.bool)
    mask[-1, -2:] = False
    adj = adj * mask[:, :, None] * mask[:, None, :]
    return torch.randn(B, n, features) * mask[..., None], adj, mask


class DenseGCNConv(nn.Module):
    """pyg-team/pytorch_geometric, ``torch_geometric/nn/dense/dense_gcn_conv.py``:
    ``DenseGCNConv``, self-loops set in a clone, the symmetric normalization, the mask."""

    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.lin = nn.Linear(in_channels, out_channels, bias=False)
        self.bias = nn.Parameter(0.1 * torch.randn(out_channels))

    def forward(self, x, adj, mask=None):
        B_, N, _ = adj.size()
        adj = adj.clone()
        idx = torch.arange(N, dtype=torch.long)
        adj[:, idx, idx] = 1
        out = self.lin(x)
        deg_inv_sqrt = adj.sum(dim=-1).clamp(min=1).pow(-0.5)
        adj = deg_inv_sqrt.unsqueeze(-1) * adj * deg_inv_sqrt.unsqueeze(-2)
        out = torch.matmul(adj, out) + self.bias
        return out * mask.view(B_, N, 1).to(x.dtype) if mask is not None else out


class DenseGINConv(nn.Module):
    """pyg-team/pytorch_geometric, ``torch_geometric/nn/dense/dense_gin_conv.py``:
    ``DenseGINConv`` with ``train_eps=True``: ``eps`` a parameter of the layer."""

    def __init__(self, net):
        super().__init__()
        self.nn = net
        self.eps = nn.Parameter(torch.tensor([0.1]))

    def forward(self, x, adj, mask=None):
        B_, N, _ = adj.size()
        out = torch.matmul(adj, x)
        out = out + (1 + self.eps) * x
        out = self.nn(out)
        return out * mask.view(B_, N, 1).to(x.dtype) if mask is not None else out


class DenseGraphClassifier(nn.Module):
    """Two dense graph convolutions, a masked mean over each graph's nodes, a head (PyG's
    ``examples/proteins_diff_pool.py`` without the pooling)."""

    def __init__(self, kind):
        super().__init__()
        if kind == "gcn":
            self.conv1, self.conv2 = DenseGCNConv(3, 6), DenseGCNConv(6, 6)
        else:
            mlp = lambda i: nn.Sequential(nn.Linear(i, 6), nn.ReLU(), nn.Linear(6, 6))  # noqa: E731
            self.conv1, self.conv2 = DenseGINConv(mlp(3)), DenseGINConv(mlp(6))
        self.lin = nn.Linear(6, 3)

    def forward(self, x, adj, mask):
        x = F.relu(self.conv1(x, adj, mask))
        x = F.relu(self.conv2(x, adj, mask))
        x = x.sum(1) / mask.sum(1, keepdim=True).to(x.dtype)
        return self.lin(x)


def dense_graphs(kind):
    return Spec(DenseGraphClassifier(kind), graphs(), cross_entropy, (torch.randint(3, (B,)),))


class GraphAttentionLayer(nn.Module):
    """Diego999/pyGAT, ``layers.py``: ``GraphAttentionLayer`` (``W`` and ``a`` parameters,
    ``e = leakyrelu(Wh1 + Wh2.T)``, attention masked by the adjacency). ``batched``: as ports
    for many graphs write it, ``matmul`` for ``mm`` and the last two dimensions transposed."""

    def __init__(self, in_features, out_features, alpha=0.2, concat=True, batched=True):
        super().__init__()
        self.out_features, self.concat, self.batched = out_features, concat, batched
        self.W = nn.Parameter(torch.empty(size=(in_features, out_features)))
        nn.init.xavier_uniform_(self.W.data, gain=1.414)
        self.a = nn.Parameter(torch.empty(size=(2 * out_features, 1)))
        nn.init.xavier_uniform_(self.a.data, gain=1.414)
        self.leakyrelu = nn.LeakyReLU(alpha)

    def forward(self, h, adj):
        Wh = torch.matmul(h, self.W) if self.batched else torch.mm(h, self.W)
        Wh1 = torch.matmul(Wh, self.a[: self.out_features, :])
        Wh2 = torch.matmul(Wh, self.a[self.out_features :, :])
        e = self.leakyrelu(Wh1 + (Wh2.transpose(-1, -2) if self.batched else Wh2.T))
        zero_vec = -9e15 * torch.ones_like(e)
        attention = F.softmax(torch.where(adj > 0, e, zero_vec), dim=-1)
        h_prime = torch.matmul(attention, Wh)
        return F.elu(h_prime) if self.concat else h_prime


class GAT(nn.Module):
    """Diego999/pyGAT, ``models.py``: ``GAT``, heads concatenated, an output attention layer,
    ``log_softmax``."""

    def __init__(self, nfeat=3, nhid=4, nclass=3, nheads=2, batched=True):
        super().__init__()
        self.attentions = nn.ModuleList(
            GraphAttentionLayer(nfeat, nhid, batched=batched) for _ in range(nheads)
        )
        self.out_att = GraphAttentionLayer(nhid * nheads, nclass, concat=False, batched=batched)

    def forward(self, x, adj):
        x = torch.cat([att(x, adj) for att in self.attentions], dim=-1)
        return F.log_softmax(F.elu(self.out_att(x, adj)), dim=-1)


def gat_batched():
    """Each graph an example: its nodes' mean log-probability read out."""
    x, adj, mask = graphs()
    adj = adj + torch.eye(adj.shape[-1])
    model = nn.Sequential()  # (named for the Spec only)
    del model
    return Spec(GAT(), (x, adj), lambda out, y: nll(out.mean(1), y), (torch.randint(3, (B,)),))


def pygat_one_graph():
    """pyGAT's ``train.py``: one graph (Cora's), its nodes the rows, a loss over the training
    nodes: the nodes are not independent examples."""
    n = 6
    a = (torch.rand(n, n) < 0.5).float()
    adj = ((a + a.T) > 0).float() + torch.eye(n)
    idx_train = torch.arange(4)
    labels = torch.randint(3, (n,))
    return Spec(GAT(batched=False), (torch.randn(n, 3), adj),
                lambda out, y: F.nll_loss(out[idx_train], y[idx_train], reduction="none"),
                (labels,))  # fmt: skip


class MeshGraphNet(nn.Module):
    """echowve/meshGraphNets_pytorch, ``model/blocks.py``: ``EdgeBlock`` and ``NodeBlock`` of
    an encode-process-decode network on a fixed mesh (one edge list for every example in
    the batch), the edges' messages summed into their receivers along the node dimension by
    ``index_add_`` (``torch_scatter.scatter_add`` there)."""

    def __init__(self, senders, receivers, hidden=5):
        super().__init__()
        self.senders, self.receivers = senders, receivers
        self.node_encoder = nn.Sequential(nn.Linear(3, hidden), nn.ReLU(), nn.LayerNorm(hidden))
        self.edge_encoder = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.LayerNorm(hidden))
        self.edge_mlp = nn.Sequential(nn.Linear(3 * hidden, hidden), nn.ReLU())
        self.node_mlp = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU())
        self.decoder = nn.Linear(hidden, 2)

    def forward(self, x, edge_attr):
        x, e = self.node_encoder(x), self.edge_encoder(edge_attr)
        for _ in range(2):
            collected = torch.cat([x[:, self.senders], x[:, self.receivers], e], dim=-1)
            e = e + self.edge_mlp(collected)
            agg = torch.zeros_like(x).index_add_(1, self.receivers, e)
            x = x + self.node_mlp(torch.cat([x, agg], dim=-1))
        return self.decoder(x)


def mesh_graph_net():
    senders = torch.tensor([0, 1, 1, 2, 3, 4, 0, 2])
    receivers = torch.tensor([1, 0, 2, 1, 4, 3, 2, 0])
    model = MeshGraphNet(senders, receivers)
    return Spec(model, (torch.randn(B, 5, 3), torch.randn(B, 8, 4)), mse, (torch.randn(B, 5, 2),))


class GINFlat(nn.Module):
    """pyg-team/pytorch_geometric, ``torch_geometric/nn/conv/gin_conv.py`` (``GINConv``,
    messages summed by scatter, here ``index_add_``) and ``global_add_pool``: the batch's
    graphs concatenated into one list of nodes, ``batch`` naming each node's graph."""

    def __init__(self):
        super().__init__()
        self.nn1 = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 5))
        self.eps = nn.Parameter(torch.tensor([0.0]))
        self.lin = nn.Linear(5, 3)

    def forward(self, x, edge_index, batch):
        src, dst = edge_index
        out = torch.zeros_like(x).index_add_(0, dst, x[src])
        x = F.relu(self.nn1(out + (1 + self.eps) * x))
        pooled = torch.zeros(int(batch.max()) + 1, x.shape[1], dtype=x.dtype)
        return self.lin(pooled.index_add_(0, batch, x))


def gin_flat():
    sizes = [4, 3, 5]
    batch = torch.cat([torch.full((s,), g) for g, s in enumerate(sizes)])
    starts = [0, 4, 7]
    edges = [(s + i, s + (i + 1) % n) for s, n in zip(starts, sizes) for i in range(n)]
    edge_index = torch.tensor(edges).T
    edge_index = torch.cat([edge_index, edge_index.flip(0)], 1)
    return Spec(GINFlat(), (torch.randn(12, 3), edge_index, batch), cross_entropy,
                (torch.randint(3, (B,)),))  # fmt: skip


# -- tabular and recommendation -------------------------------------------------------------------


class SAINTAttention(nn.Module):
    """somepago/saint, ``models/model.py``: ``Attention`` (einsum heads)."""

    def __init__(self, dim, heads=2, dim_head=4):
        super().__init__()
        inner_dim = dim_head * heads
        self.heads, self.scale = heads, dim_head**-0.5
        self.to_qkv = nn.Linear(dim, inner_dim * 3, bias=False)
        self.to_out = nn.Linear(inner_dim, dim)

    def forward(self, x):
        h = self.heads
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = (rearrange(t, "b n (h d) -> b h n d", h=h) for t in (q, k, v))
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        out = torch.einsum("b h i j, b h j d -> b h i d", sim.softmax(dim=-1), v)
        return self.to_out(rearrange(out, "b h n d -> b n (h d)", h=h))


class SAINT(nn.Module):
    """somepago/saint, ``models/pretrainmodel.py`` (``SAINT``: categorical embeddings by
    offsets, each continuous feature by its own MLP written into a preallocated tensor, as
    ``augmentations.embed_data_mask`` does) and ``models/model.py`` (``RowColTransformer``:
    attention over the columns and, with ``attentiontype="colrow"``, over the rows of the
    batch, ``b n d -> 1 b (n d)``)."""

    def __init__(self, categories=(3, 4), num_continuous=2, dim=4, attentiontype="colrow"):
        super().__init__()
        self.nfeats = len(categories) + num_continuous
        offsets = torch.tensor([0, *categories[:-1]]).cumsum(-1)
        self.register_buffer("categories_offset", offsets)
        self.embeds = nn.Embedding(sum(categories), dim)
        self.simple_MLP = nn.ModuleList(
            nn.Sequential(nn.Linear(1, 6), nn.ReLU(), nn.Linear(6, dim))
            for _ in range(num_continuous)
        )
        self.dim, self.attentiontype = dim, attentiontype
        self.norm1, self.attn1 = nn.LayerNorm(dim), SAINTAttention(dim)
        self.norm2, self.ff1 = (
            nn.LayerNorm(dim),
            nn.Sequential(nn.Linear(dim, 8), nn.GELU(), nn.Linear(8, dim)),
        )
        if attentiontype == "colrow":
            row_dim = dim * self.nfeats
            self.norm3, self.attn2 = nn.LayerNorm(row_dim), SAINTAttention(row_dim, dim_head=6)
            self.norm4 = nn.LayerNorm(row_dim)
            self.ff2 = nn.Sequential(nn.Linear(row_dim, 8), nn.GELU(), nn.Linear(8, row_dim))
        self.mlpfory = nn.Sequential(nn.Linear(dim, 6), nn.ReLU(), nn.Linear(6, 2))

    def forward(self, x_categ, x_cont):
        x_categ_enc = self.embeds(x_categ + self.categories_offset)
        n1, n2 = x_cont.shape
        x_cont_enc = torch.empty(n1, n2, self.dim, dtype=x_categ_enc.dtype)
        for i in range(n2):
            x_cont_enc[:, i, :] = self.simple_MLP[i](x_cont[:, i : i + 1])
        x = torch.cat((x_categ_enc, x_cont_enc), dim=1)
        x = x + self.attn1(self.norm1(x))
        x = x + self.ff1(self.norm2(x))
        if self.attentiontype == "colrow":
            n = x.shape[1]
            x = rearrange(x, "b n d -> 1 b (n d)")
            x = x + self.attn2(self.norm3(x))
            x = x + self.ff2(self.norm4(x))
            x = rearrange(x, "1 b (n d) -> b n d", n=n)
        return self.mlpfory(x[:, 0, :])


def saint(attentiontype):
    x_categ = torch.stack([torch.randint(3, (B,)), torch.randint(4, (B,))], 1)
    model = SAINT(attentiontype=attentiontype)
    return Spec(model, (x_categ, torch.randn(B, 2)), cross_entropy, (torch.randint(2, (B,)),))


class Entmax15Function(torch.autograd.Function):
    """Qwicen/node, ``lib/nn_utils.py``: ``Entmax15Function``, its own backward."""

    @staticmethod
    def forward(ctx, input, dim=0):
        ctx.dim = dim
        max_val, _ = input.max(dim=dim, keepdim=True)
        input = (input - max_val) / 2
        Xsrt, _ = torch.sort(input, descending=True, dim=dim)
        rho = torch.arange(1, input.size(dim) + 1, dtype=input.dtype)
        rho = rho.view([-1] + [1] * (input.dim() - 1)).transpose(0, dim)
        mean = Xsrt.cumsum(dim) / rho
        mean_sq = (Xsrt**2).cumsum(dim) / rho
        delta = (1 - rho * (mean_sq - mean**2)) / rho
        tau = mean - torch.sqrt(torch.clamp(delta, 0))
        support_size = (tau <= Xsrt).sum(dim).unsqueeze(dim)
        tau_star = tau.gather(dim, support_size - 1)
        output = torch.clamp(input - tau_star, min=0) ** 2
        ctx.save_for_backward(output)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (Y,) = ctx.saved_tensors
        gppr = Y.sqrt()
        dX = grad_output * gppr
        q = (dX.sum(ctx.dim) / gppr.sum(ctx.dim)).unsqueeze(ctx.dim)
        return dX - q * gppr, None


class Entmoid15(torch.autograd.Function):
    """Qwicen/node, ``lib/nn_utils.py``: ``Entmoid15``, elementwise, its own backward."""

    @staticmethod
    def forward(ctx, input):
        is_pos = input >= 0
        input = abs(input)
        tau = (input + torch.sqrt(F.relu(8 - input**2))) / 2
        tau.masked_fill_(tau <= input, 2.0)
        y_neg = 0.25 * F.relu(tau - input) ** 2
        output = torch.where(is_pos, 1 - y_neg, y_neg)
        ctx.save_for_backward(output)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (output,) = ctx.saved_tensors
        gppr0, gppr1 = output.sqrt(), (1 - output).sqrt()
        grad_input = grad_output * gppr0
        q = grad_input / (gppr0 + gppr1)
        return grad_input - q * gppr0


class ODST(nn.Module):
    """Qwicen/node, ``lib/odst.py``: ``ODST``, oblivious decision trees: features chosen by
    entmax over learned logits, soft splits by entmoid, each leaf's weight a product over the
    depth; thresholds and temperatures set from a first batch (``initialize``: data-aware
    initialization, run once before training)."""

    def __init__(self, in_features, num_trees, depth=2, tree_dim=2):
        super().__init__()
        self.depth, self.num_trees, self.tree_dim = depth, num_trees, tree_dim
        self.response = nn.Parameter(torch.randn([num_trees, tree_dim, 2**depth]))
        self.feature_selection_logits = nn.Parameter(torch.rand([in_features, num_trees, depth]))
        self.feature_thresholds = nn.Parameter(torch.zeros([num_trees, depth]))
        self.log_temperatures = nn.Parameter(torch.zeros([num_trees, depth]))
        with torch.no_grad():
            indices = torch.arange(2**depth)
            offsets = 2 ** torch.arange(depth)
            bin_codes = (indices.view(1, -1) // offsets.view(-1, 1) % 2).to(torch.float32)
            bin_codes_1hot = torch.stack([bin_codes, 1.0 - bin_codes], dim=-1)
            self.bin_codes_1hot = nn.Parameter(bin_codes_1hot, requires_grad=False)

    def forward(self, input):
        feature_selectors = Entmax15Function.apply(self.feature_selection_logits, 0)
        feature_values = torch.einsum("bi,ind->bnd", input, feature_selectors)
        threshold_logits = (feature_values - self.feature_thresholds) * torch.exp(
            -self.log_temperatures
        )
        threshold_logits = torch.stack([-threshold_logits, threshold_logits], dim=-1)
        bins = Entmoid15.apply(threshold_logits)
        bin_matches = torch.einsum("btds,dcs->btdc", bins, self.bin_codes_1hot)
        response_weights = torch.prod(bin_matches, dim=-2)
        return torch.einsum("bnd,ncd->bnc", response_weights, self.response)

    @torch.no_grad()
    def initialize(self, input, eps=1e-6):
        feature_selectors = Entmax15Function.apply(self.feature_selection_logits, 0)
        feature_values = torch.einsum("bi,ind->bnd", input, feature_selectors)
        percentiles_q = 100 * torch.rand(self.num_trees * self.depth, dtype=input.dtype)
        flat = feature_values.flatten(1, 2).T
        self.feature_thresholds.data[...] = torch.stack(
            [torch.quantile(row, q / 100) for row, q in zip(flat, percentiles_q)]
        ).view(self.num_trees, self.depth)
        temperatures = torch.quantile(abs(feature_values - self.feature_thresholds), 0.9, dim=0)
        self.log_temperatures.data[...] = torch.log(temperatures + eps)


class NODE(nn.Module):
    """Qwicen/node, ``lib/arch.py`` (``DenseBlock``: each layer's trees read the input and
    the layers before) and the notebooks' head, ``Lambda(lambda x: x[..., 0].mean(dim=-1))``."""

    def __init__(self, in_features=4, num_trees=3, num_layers=2, tree_dim=2):
        super().__init__()
        self.layers = nn.ModuleList(
            ODST(in_features + i * num_trees * tree_dim, num_trees, tree_dim=tree_dim)
            for i in range(num_layers)
        )

    def forward(self, x):
        outputs = []
        for layer in self.layers:
            h = layer(x).flatten(1, 2)
            x = torch.cat([x, h], dim=-1)
            outputs.append(h)
        out = torch.cat(outputs, dim=-1).view(x.shape[0], -1, self.layers[0].tree_dim)
        return out[..., 0].mean(dim=-1)


def node():
    model = NODE().double()
    warm = torch.randn(32, 4, dtype=torch.float64)
    with torch.no_grad():  # the notebooks' "data-aware init" on a first batch
        x = warm
        for layer in model.layers:
            layer.initialize(x)
            x = torch.cat([x, layer(x).flatten(1, 2)], dim=-1)
    return Spec(model, (torch.randn(B, 4),), lambda out, y: (out - y) ** 2, (torch.randn(B),))


class FeaturesLinear(nn.Module):
    """rixwew/pytorch-fm, ``torchfm/layer.py``: ``FeaturesLinear`` (a bias parameter of its
    own)."""

    def __init__(self, field_dims, output_dim=1):
        super().__init__()
        self.fc = nn.Embedding(sum(field_dims), output_dim)
        self.bias = nn.Parameter(torch.zeros((output_dim,)))
        self.register_buffer("offsets", torch.tensor([0, *field_dims[:-1]]).cumsum(0))

    def forward(self, x):
        return torch.sum(self.fc(x + self.offsets.unsqueeze(0)), dim=1) + self.bias


class FeaturesEmbedding(nn.Module):
    """rixwew/pytorch-fm, ``torchfm/layer.py``: ``FeaturesEmbedding``."""

    def __init__(self, field_dims, embed_dim):
        super().__init__()
        self.embedding = nn.Embedding(sum(field_dims), embed_dim)
        nn.init.xavier_uniform_(self.embedding.weight.data)
        self.register_buffer("offsets", torch.tensor([0, *field_dims[:-1]]).cumsum(0))

    def forward(self, x):
        return self.embedding(x + self.offsets.unsqueeze(0))


def fm_mlp(input_dim, embed_dims, output_layer=True):
    """rixwew/pytorch-fm, ``torchfm/layer.py``: ``MultiLayerPerceptron`` (Linear,
    BatchNorm1d, ReLU, Dropout)."""
    layers = []
    for embed_dim in embed_dims:
        layers += [nn.Linear(input_dim, embed_dim), nn.BatchNorm1d(embed_dim), nn.ReLU(),
                   nn.Dropout(p=0.0)]  # fmt: skip
        input_dim = embed_dim
    if output_layer:
        layers.append(nn.Linear(input_dim, 1))
    return nn.Sequential(*layers)


class DeepFM(nn.Module):
    """rixwew/pytorch-fm, ``torchfm/model/dfm.py``: ``DeepFactorizationMachineModel``
    (``FactorizationMachine`` of ``torchfm/layer.py`` written in)."""

    def __init__(self, field_dims=(3, 4, 2), embed_dim=4, mlp_dims=(6,)):
        super().__init__()
        self.linear = FeaturesLinear(field_dims)
        self.embedding = FeaturesEmbedding(field_dims, embed_dim)
        self.embed_output_dim = len(field_dims) * embed_dim
        self.mlp = fm_mlp(self.embed_output_dim, mlp_dims)

    def forward(self, x):
        embed_x = self.embedding(x)
        square_of_sum = torch.sum(embed_x, dim=1) ** 2
        sum_of_square = torch.sum(embed_x**2, dim=1)
        fm = 0.5 * torch.sum(square_of_sum - sum_of_square, dim=1, keepdim=True)
        x = self.linear(x) + fm + self.mlp(embed_x.view(-1, self.embed_output_dim))
        return torch.sigmoid(x.squeeze(1))


class CrossNetwork(nn.Module):
    """rixwew/pytorch-fm, ``torchfm/layer.py``: ``CrossNetwork`` (biases in a
    ``ParameterList``)."""

    def __init__(self, input_dim, num_layers):
        super().__init__()
        self.w = nn.ModuleList(nn.Linear(input_dim, 1, bias=False) for _ in range(num_layers))
        self.b = nn.ParameterList(
            nn.Parameter(0.1 * torch.randn(input_dim)) for _ in range(num_layers)
        )

    def forward(self, x):
        x0 = x
        for i in range(len(self.w)):
            x = x0 * self.w[i](x) + self.b[i] + x
        return x


class DCN(nn.Module):
    """rixwew/pytorch-fm, ``torchfm/model/dcn.py``: ``DeepCrossNetworkModel``."""

    def __init__(self, field_dims=(3, 4, 2), embed_dim=4, num_layers=2, mlp_dims=(6,)):
        super().__init__()
        self.embedding = FeaturesEmbedding(field_dims, embed_dim)
        self.embed_output_dim = len(field_dims) * embed_dim
        self.cn = CrossNetwork(self.embed_output_dim, num_layers)
        self.mlp = fm_mlp(self.embed_output_dim, mlp_dims, output_layer=False)
        self.linear = nn.Linear(mlp_dims[-1] + self.embed_output_dim, 1)

    def forward(self, x):
        embed_x = self.embedding(x).view(-1, self.embed_output_dim)
        x_stack = torch.cat([self.cn(embed_x), self.mlp(embed_x)], dim=1)
        return torch.sigmoid(self.linear(x_stack).squeeze(1))


class CompressedInteractionNetwork(nn.Module):
    """rixwew/pytorch-fm, ``torchfm/layer.py``: ``CompressedInteractionNetwork`` (outer
    products of fields, 1x1 convolutions, halves split off)."""

    def __init__(self, input_dim, cross_layer_sizes=(4, 4), split_half=True):
        super().__init__()
        self.num_layers, self.split_half = len(cross_layer_sizes), split_half
        self.conv_layers = nn.ModuleList()
        prev_dim, fc_input_dim = input_dim, 0
        for i, cross_layer_size in enumerate(cross_layer_sizes):
            self.conv_layers.append(nn.Conv1d(input_dim * prev_dim, cross_layer_size, 1))
            if self.split_half and i != self.num_layers - 1:
                cross_layer_size //= 2
            prev_dim = cross_layer_size
            fc_input_dim += prev_dim
        self.fc = nn.Linear(fc_input_dim, 1)

    def forward(self, x):
        xs = []
        x0, h = x.unsqueeze(2), x
        for i in range(self.num_layers):
            x = x0 * h.unsqueeze(1)
            batch_size, f0_dim, fin_dim, embed_dim = x.shape
            x = F.relu(self.conv_layers[i](x.view(batch_size, f0_dim * fin_dim, embed_dim)))
            if self.split_half and i != self.num_layers - 1:
                x, h = torch.split(x, x.shape[1] // 2, dim=1)
            else:
                h = x
            xs.append(x)
        return self.fc(torch.sum(torch.cat(xs, dim=1), 2))


class XDeepFM(nn.Module):
    """rixwew/pytorch-fm, ``torchfm/model/xdfm.py``: ``ExtremeDeepFactorizationMachineModel``."""

    def __init__(self, field_dims=(3, 4, 2), embed_dim=4, mlp_dims=(6,)):
        super().__init__()
        self.embedding = FeaturesEmbedding(field_dims, embed_dim)
        self.embed_output_dim = len(field_dims) * embed_dim
        self.cin = CompressedInteractionNetwork(len(field_dims))
        self.mlp = fm_mlp(self.embed_output_dim, mlp_dims)
        self.linear = FeaturesLinear(field_dims)

    def forward(self, x):
        embed_x = self.embedding(x)
        x = self.linear(x) + self.cin(embed_x) + self.mlp(embed_x.view(-1, self.embed_output_dim))
        return torch.sigmoid(x.squeeze(1))


def click_data():
    x = torch.stack([torch.randint(n, (B,)) for n in (3, 4, 2)], 1)
    return x, torch.randint(2, (B,)).float()


def bce(p, y):
    return F.binary_cross_entropy(p, y, reduction="none")


def recommender(cls, batch_norm="groupnorm"):
    """A pytorch-fm model as written (its MLP's BatchNorm1d in training mode), or with the
    BatchNorms converted to GroupNorm by ``gradhooks.convert_batch_norm``."""
    model = cls()
    if batch_norm == "groupnorm":
        gradhooks.convert_batch_norm(model)
    return Spec(model, click_data()[:1], bce, click_data()[1:])


class DLRM(nn.Module):
    """facebookresearch/dlrm, ``dlrm_s_pytorch.py``: ``DLRM_Net`` (``create_mlp``,
    ``create_emb``: ``EmbeddingBag(mode="sum")``; ``apply_emb`` given each table's offsets and
    flat indices; ``interact_features`` with ``"dot"``: the pairwise dot products below the
    diagonal picked by ``Z[:, li, lj]``), called as its loop calls it, ``dlrm(X, lS_o, lS_i)``."""

    def __init__(self, m_spa=3, ln_emb=(5, 7), ln_bot=(4, 5, 3), ln_top=(6, 4, 1)):
        super().__init__()
        self.emb_l = nn.ModuleList(nn.EmbeddingBag(n, m_spa, mode="sum") for n in ln_emb)
        self.bot_l = self.create_mlp(ln_bot, sigmoid_layer=-1)
        self.top_l = self.create_mlp(ln_top, sigmoid_layer=len(ln_top) - 2)

    @staticmethod
    def create_mlp(ln, sigmoid_layer):
        layers = nn.ModuleList()
        for i in range(len(ln) - 1):
            layers.append(nn.Linear(int(ln[i]), int(ln[i + 1]), bias=True))
            layers.append(nn.Sigmoid() if i == sigmoid_layer else nn.ReLU())
        return nn.Sequential(*layers)

    def interact_features(self, x, ly):
        (batch_size, d) = x.shape
        T = torch.cat([x] + ly, dim=1).view((batch_size, -1, d))
        Z = torch.bmm(T, torch.transpose(T, 1, 2))
        _, ni, nj = Z.shape
        li = torch.tensor([i for i in range(ni) for j in range(i)])
        lj = torch.tensor([j for i in range(nj) for j in range(i)])
        return torch.cat([x, Z[:, li, lj]], dim=1)

    def forward(self, dense_x, lS_o, *lS_i):
        x = self.bot_l(dense_x)
        ly = [E(i, o) for E, i, o in zip(self.emb_l, lS_i, lS_o)]
        return self.top_l(self.interact_features(x, ly)).squeeze(1)


def dlrm_batch():
    """``dlrm_data_pytorch.py``'s ``collate_wrapper_random_offset``: each example's bag of
    each table (of 1 to 3 indices) flattened, with offsets."""
    bags = [[torch.randint(n, (int(torch.randint(1, 4, ())),)) for _ in range(B)] for n in (5, 7)]
    lS_o = torch.stack([torch.tensor([0, *[len(b) for b in t][:-1]]).cumsum(0) for t in bags])
    lS_i = [torch.cat(t) for t in bags]
    return (torch.randn(B, 4), lS_o, *lS_i), bags


def dlrm():
    args, bags = dlrm_batch()

    def split(args, i):
        return (args[0][i : i + 1], torch.zeros(len(bags), 1, dtype=torch.long),
                *(t[i] for t in bags))  # fmt: skip

    y = torch.randint(2, (B,)).float()
    return Spec(DLRM(), args, bce, (y,), split=split)


class NeuMF(nn.Module):
    """guoyang9/NCF, ``model.py``: ``NCF`` as NeuMF-end (GMF and MLP towers, concatenated)."""

    def __init__(self, user_num=4, item_num=6, factor_num=2, num_layers=2):
        super().__init__()
        self.embed_user_GMF = nn.Embedding(user_num, factor_num)
        self.embed_item_GMF = nn.Embedding(item_num, factor_num)
        self.embed_user_MLP = nn.Embedding(user_num, factor_num * (2 ** (num_layers - 1)))
        self.embed_item_MLP = nn.Embedding(item_num, factor_num * (2 ** (num_layers - 1)))
        MLP_modules = []
        for i in range(num_layers):
            input_size = factor_num * (2 ** (num_layers - i))
            MLP_modules += [nn.Dropout(p=0.0), nn.Linear(input_size, input_size // 2), nn.ReLU()]
        self.MLP_layers = nn.Sequential(*MLP_modules)
        self.predict_layer = nn.Linear(factor_num * 2, 1)

    def forward(self, user, item):
        output_GMF = self.embed_user_GMF(user) * self.embed_item_GMF(item)
        interaction = torch.cat((self.embed_user_MLP(user), self.embed_item_MLP(item)), -1)
        concat = torch.cat((output_GMF, self.MLP_layers(interaction)), -1)
        return self.predict_layer(concat).view(-1)


def neumf():
    user, item = torch.tensor([0, 0, 2]), torch.tensor([1, 1, 4])  # (a user and item repeated)
    label = torch.tensor([1.0, 0.0, 1.0])
    return Spec(NeuMF(), (user, item),
                lambda out, y: F.binary_cross_entropy_with_logits(out, y, reduction="none"),
                (label,))  # fmt: skip


class PointWiseFeedForward(nn.Module):
    """pmixer/SASRec.pytorch, ``model.py``: ``PointWiseFeedForward`` (1x1 convolutions, the
    residual added in place)."""

    def __init__(self, hidden_units):
        super().__init__()
        self.conv1 = nn.Conv1d(hidden_units, hidden_units, kernel_size=1)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv1d(hidden_units, hidden_units, kernel_size=1)

    def forward(self, inputs):
        outputs = self.conv2(self.relu(self.conv1(inputs.transpose(-1, -2))))
        outputs = outputs.transpose(-1, -2)
        outputs += inputs
        return outputs


class SASRec(nn.Module):
    """pmixer/SASRec.pytorch, ``model.py``: ``SASRec`` (item and position embeddings scaled
    and masked in place, ``nn.MultiheadAttention`` on time-first tensors with a causal mask,
    the item embedding scoring the positive and negative items)."""

    def __init__(self, item_num=9, hidden_units=4, maxlen=5, num_blocks=2, num_heads=2):
        super().__init__()
        self.item_emb = nn.Embedding(item_num + 1, hidden_units, padding_idx=0)
        self.pos_emb = nn.Embedding(maxlen + 1, hidden_units, padding_idx=0)
        self.attention_layernorms = nn.ModuleList(
            nn.LayerNorm(hidden_units, eps=1e-8) for _ in range(num_blocks)
        )
        self.attention_layers = nn.ModuleList(
            nn.MultiheadAttention(hidden_units, num_heads, 0.0) for _ in range(num_blocks)
        )
        self.forward_layernorms = nn.ModuleList(
            nn.LayerNorm(hidden_units, eps=1e-8) for _ in range(num_blocks)
        )
        self.forward_layers = nn.ModuleList(
            PointWiseFeedForward(hidden_units) for _ in range(num_blocks)
        )
        self.last_layernorm = nn.LayerNorm(hidden_units, eps=1e-8)

    def log2feats(self, log_seqs):
        seqs = self.item_emb(log_seqs)
        seqs *= self.item_emb.embedding_dim**0.5
        poss = torch.arange(1, log_seqs.shape[1] + 1).repeat(log_seqs.shape[0], 1)
        poss = poss * (log_seqs != 0)
        seqs += self.pos_emb(poss)
        timeline_mask = log_seqs == 0
        seqs *= ~timeline_mask.unsqueeze(-1)
        tl = seqs.shape[1]
        attention_mask = ~torch.tril(torch.ones((tl, tl), dtype=torch.bool))
        for i in range(len(self.attention_layers)):
            seqs = torch.transpose(seqs, 0, 1)
            Q = self.attention_layernorms[i](seqs)
            mha_outputs, _ = self.attention_layers[i](Q, seqs, seqs, attn_mask=attention_mask)
            seqs = Q + mha_outputs
            seqs = torch.transpose(seqs, 0, 1)
            seqs = self.forward_layernorms[i](seqs)
            seqs = self.forward_layers[i](seqs)
            seqs *= ~timeline_mask.unsqueeze(-1)
        return self.last_layernorm(seqs)

    def forward(self, log_seqs, pos_seqs, neg_seqs):
        log_feats = self.log2feats(log_seqs)
        pos_logits = (log_feats * self.item_emb(pos_seqs)).sum(dim=-1)
        neg_logits = (log_feats * self.item_emb(neg_seqs)).sum(dim=-1)
        return pos_logits, neg_logits


def sasrec_loss(out, pos_seqs):
    """``main.py``'s loss over the positions with an item (``indices = pos_seqs != 0``), each
    example's share summed."""
    pos_logits, neg_logits = out
    keep = (pos_seqs != 0).to(pos_logits.dtype)
    pos = F.binary_cross_entropy_with_logits(
        pos_logits, torch.ones_like(pos_logits), reduction="none"
    )
    neg = F.binary_cross_entropy_with_logits(
        neg_logits, torch.zeros_like(neg_logits), reduction="none"
    )
    return ((pos + neg) * keep).sum(1)


def sasrec():
    seq = torch.randint(1, 10, (B, 6))
    seq[0, :2] = 0  # (left-padded, as the sampler pads)
    log_seqs, pos_seqs, neg_seqs = seq[:, :-1], seq[:, 1:], torch.randint(1, 10, (B, 5))
    return Spec(SASRec(), (log_seqs, pos_seqs, neg_seqs), sasrec_loss, (pos_seqs,))


# -- audio ----------------------------------------------------------------------------------------


class ResidualConv1dGLU(nn.Module):
    """r9y9/wavenet_vocoder, ``wavenet_vocoder/modules.py``: ``ResidualConv1dGLU``, a dilated
    causal convolution (weight-normalized, ``torch.nn.utils.parametrizations.weight_norm``
    for the old ``nn.utils.weight_norm``), tanh-sigmoid gates with a global condition, skip and
    residual 1x1 convolutions."""

    def __init__(self, residual_channels, gate_channels, kernel_size, skip_out_channels,
                 gin_channels, dilation=1):  # fmt: skip
        super().__init__()
        padding = (kernel_size - 1) * dilation
        wn = nn.utils.parametrizations.weight_norm
        self.conv = wn(nn.Conv1d(residual_channels, gate_channels, kernel_size, padding=padding,
                                 dilation=dilation))  # fmt: skip
        self.conv1x1g = wn(nn.Conv1d(gin_channels, gate_channels, 1, bias=False))
        gate_out_channels = gate_channels // 2
        self.conv1x1_out = wn(nn.Conv1d(gate_out_channels, residual_channels, 1))
        self.conv1x1_skip = wn(nn.Conv1d(gate_out_channels, skip_out_channels, 1))

    def forward(self, x, g):
        residual = x
        x = self.conv(x)[:, :, : residual.size(-1)]
        a, b = x.split(x.size(1) // 2, dim=1)
        ga, gb = self.conv1x1g(g).split(x.size(1) // 2, dim=1)
        x = torch.tanh(a + ga) * torch.sigmoid(b + gb)
        s = self.conv1x1_skip(x)
        x = (self.conv1x1_out(x) + residual) * math.sqrt(0.5)
        return x, s


class WaveNet(nn.Module):
    """r9y9/wavenet_vocoder, ``wavenet_vocoder/wavenet.py``: ``WaveNet`` with a speaker
    embedding as its global condition (expanded over time, ``_expand_global_features``),
    skips summed in place and scaled in place."""

    def __init__(self, out_channels=8, layers=4, stacks=2, residual_channels=4, gate_channels=6,
                 skip_out_channels=4, kernel_size=2, n_speakers=3, gin_channels=3):  # fmt: skip
        super().__init__()
        self.first_conv = nn.Conv1d(out_channels, residual_channels, 1)
        layers_per_stack = layers // stacks
        self.conv_layers = nn.ModuleList(
            ResidualConv1dGLU(residual_channels, gate_channels, kernel_size, skip_out_channels,
                              gin_channels, dilation=2 ** (layer % layers_per_stack))
            for layer in range(layers)
        )  # fmt: skip
        self.last_conv_layers = nn.Sequential(nn.ReLU(inplace=True),
                                              nn.Conv1d(skip_out_channels, skip_out_channels, 1),
                                              nn.ReLU(inplace=True),
                                              nn.Conv1d(skip_out_channels, out_channels, 1))  # fmt: skip
        self.embed_speakers = nn.Embedding(n_speakers, gin_channels)

    def forward(self, x, g):
        B_, _, T = x.size()
        g = self.embed_speakers(g.view(B_, -1)).transpose(1, 2)
        g_bct = g.expand(B_, -1, T)
        x = self.first_conv(x)
        skips = 0
        for f in self.conv_layers:
            x, h = f(x, g_bct)
            skips += h
        skips *= math.sqrt(1.0 / len(self.conv_layers))
        return self.last_conv_layers(skips)


def wavenet():
    q = torch.randint(8, (B, 7))
    x = F.one_hot(q[:, :-1], 8).transpose(1, 2).float()
    return Spec(WaveNet(), (x, torch.randint(3, (B,))), channels_cross_entropy, (q[:, 1:],))


class ConvolutionModule(nn.Module):
    """pytorch/audio, ``src/torchaudio/models/conformer.py``: ``_ConvolutionModule`` with
    ``use_group_norm=True`` (a GroupNorm of one group for its BatchNorm1d)."""

    def __init__(self, input_dim, num_channels, depthwise_kernel_size):
        super().__init__()
        self.layer_norm = nn.LayerNorm(input_dim)
        self.sequential = nn.Sequential(
            nn.Conv1d(input_dim, 2 * num_channels, 1, bias=False), nn.GLU(dim=1),
            nn.Conv1d(num_channels, num_channels, depthwise_kernel_size,
                      padding=(depthwise_kernel_size - 1) // 2, groups=num_channels, bias=False),
            nn.GroupNorm(num_groups=1, num_channels=num_channels), nn.SiLU(),
            nn.Conv1d(num_channels, input_dim, kernel_size=1, bias=False), nn.Dropout(0.0),
        )  # fmt: skip

    def forward(self, input):
        x = self.layer_norm(input).transpose(1, 2)
        return self.sequential(x).transpose(1, 2)


class ConformerLayer(nn.Module):
    """pytorch/audio, ``src/torchaudio/models/conformer.py``: ``ConformerLayer`` (half-step
    feed-forwards, ``nn.MultiheadAttention`` on time-first tensors, the convolution module
    between two transposes)."""

    def __init__(self, input_dim=4, ffn_dim=6, num_attention_heads=2, kernel=3):
        super().__init__()
        ffn = lambda: nn.Sequential(nn.LayerNorm(input_dim), nn.Linear(input_dim, ffn_dim),  # noqa: E731
                                    nn.SiLU(), nn.Linear(ffn_dim, input_dim))  # fmt: skip
        self.ffn1, self.ffn2 = ffn(), ffn()
        self.self_attn_layer_norm = nn.LayerNorm(input_dim)
        self.self_attn = nn.MultiheadAttention(input_dim, num_attention_heads, dropout=0.0)
        self.conv_module = ConvolutionModule(input_dim, input_dim, kernel)
        self.final_layer_norm = nn.LayerNorm(input_dim)

    def forward(self, input):
        x = self.ffn1(input) * 0.5 + input
        residual = x
        x = self.self_attn_layer_norm(x)
        x, _ = self.self_attn(query=x, key=x, value=x, need_weights=False)
        x = x + residual
        x = x + self.conv_module(x.transpose(0, 1)).transpose(0, 1)
        x = self.ffn2(x) * 0.5 + x
        return self.final_layer_norm(x)


class Conformer(nn.Module):
    """pytorch/audio, ``src/torchaudio/models/conformer.py``: ``Conformer`` (batch-first in,
    time-first inside), a classifier over the time-pooled output."""

    def __init__(self):
        super().__init__()
        self.conformer_layers = nn.ModuleList(ConformerLayer() for _ in range(2))
        self.head = nn.Linear(4, 3)

    def forward(self, input):
        x = input.transpose(0, 1)
        for layer in self.conformer_layers:
            x = layer(x)
        return self.head(x.transpose(0, 1).mean(1))


def conformer():
    return Spec(Conformer(), (torch.randn(B, 6, 4),), cross_entropy, (torch.randint(3, (B,)),))


class WhisperLayerNorm(nn.LayerNorm):
    """openai/whisper, ``whisper/model.py``: ``LayerNorm`` (``super().forward(x.float())`` in
    its weights' dtype here, ``.type(x.dtype)``: float32 in a float32 model)."""

    def forward(self, x):
        return super().forward(x.to(self.weight.dtype)).type(x.dtype)


class WhisperLinear(nn.Linear):
    """openai/whisper, ``whisper/model.py``: ``Linear``, its weights cast to the input's dtype
    in its own forward."""

    def forward(self, x):
        return F.linear(
            x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype)
        )


class WhisperConv1d(nn.Conv1d):
    """openai/whisper, ``whisper/model.py``: ``Conv1d`` (``_conv_forward`` overridden)."""

    def _conv_forward(self, x, weight, bias):
        return super()._conv_forward(
            x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype)
        )


def sinusoids(length, channels, max_timescale=10000):
    """openai/whisper, ``whisper/model.py``: ``sinusoids``."""
    log_timescale_increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_timescale_increment * torch.arange(channels // 2))
    scaled_time = torch.arange(length)[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)], dim=1)


class WhisperAttention(nn.Module):
    """openai/whisper, ``whisper/model.py``: ``MultiHeadAttention`` (``key`` without bias),
    ``qkv_attention``'s written path (``qk`` in float, the softmax cast back)."""

    def __init__(self, n_state, n_head):
        super().__init__()
        self.n_head = n_head
        self.query = WhisperLinear(n_state, n_state)
        self.key = WhisperLinear(n_state, n_state, bias=False)
        self.value = WhisperLinear(n_state, n_state)
        self.out = WhisperLinear(n_state, n_state)

    def forward(self, x, xa=None, mask=None):
        q = self.query(x)
        k = self.key(x if xa is None else xa)
        v = self.value(x if xa is None else xa)
        n_batch, n_ctx, n_state = q.shape
        scale = (n_state // self.n_head) ** -0.25
        q = q.view(*q.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)
        k = k.view(*k.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)
        v = v.view(*v.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)
        qk = (q * scale) @ (k * scale).transpose(-1, -2)
        if mask is not None:
            qk = qk + mask[:n_ctx, :n_ctx]
        w = F.softmax(qk.to(torch.promote_types(qk.dtype, torch.float32)), dim=-1).to(q.dtype)
        return self.out((w @ v).permute(0, 2, 1, 3).flatten(start_dim=2))


class ResidualAttentionBlock(nn.Module):
    """openai/whisper, ``whisper/model.py``: ``ResidualAttentionBlock``."""

    def __init__(self, n_state, n_head, cross_attention=False):
        super().__init__()
        self.attn, self.attn_ln = WhisperAttention(n_state, n_head), WhisperLayerNorm(n_state)
        self.cross_attn = WhisperAttention(n_state, n_head) if cross_attention else None
        self.cross_attn_ln = WhisperLayerNorm(n_state) if cross_attention else None
        self.mlp = nn.Sequential(WhisperLinear(n_state, 4 * n_state), nn.GELU(),
                                 WhisperLinear(4 * n_state, n_state))  # fmt: skip
        self.mlp_ln = WhisperLayerNorm(n_state)

    def forward(self, x, xa=None, mask=None):
        x = x + self.attn(self.attn_ln(x), mask=mask)
        if self.cross_attn is not None:
            x = x + self.cross_attn(self.cross_attn_ln(x), xa)
        return x + self.mlp(self.mlp_ln(x))


class Whisper(nn.Module):
    """openai/whisper, ``whisper/model.py``: ``AudioEncoder`` (two GELU convolutions, fixed
    sinusoids) and ``TextDecoder`` (a learned positional parameter sliced, a causal mask
    buffer, logits by the token embedding's weight outside the embedding,
    ``x @ token_embedding.weight.to(x.dtype).T``), ``Whisper.forward(mel, tokens)``."""

    def __init__(self, n_mels=4, n_audio_ctx=4, n_state=4, n_head=2, n_vocab=9, n_text_ctx=5):
        super().__init__()
        self.conv1 = WhisperConv1d(n_mels, n_state, kernel_size=3, padding=1)
        self.conv2 = WhisperConv1d(n_state, n_state, kernel_size=3, stride=2, padding=1)
        self.register_buffer("audio_positional_embedding", sinusoids(n_audio_ctx, n_state))
        self.encoder_blocks = nn.ModuleList([ResidualAttentionBlock(n_state, n_head)])
        self.ln_post = WhisperLayerNorm(n_state)
        self.token_embedding = nn.Embedding(n_vocab, n_state)
        self.positional_embedding = nn.Parameter(0.1 * torch.randn(n_text_ctx, n_state))
        self.decoder_blocks = nn.ModuleList([ResidualAttentionBlock(n_state, n_head, True)])
        self.ln = WhisperLayerNorm(n_state)
        self.register_buffer("mask", torch.empty(n_text_ctx, n_text_ctx).fill_(-math.inf).triu_(1))

    def forward(self, mel, tokens):
        x = F.gelu(self.conv1(mel))
        x = F.gelu(self.conv2(x)).permute(0, 2, 1)
        x = (x + self.audio_positional_embedding).to(x.dtype)
        for block in self.encoder_blocks:
            x = block(x)
        xa = self.ln_post(x)
        x = self.token_embedding(tokens) + self.positional_embedding[: tokens.shape[-1]]
        x = x.to(xa.dtype)
        for block in self.decoder_blocks:
            x = block(x, xa, mask=self.mask)
        x = self.ln(x)
        return (x @ torch.transpose(self.token_embedding.weight.to(x.dtype), 0, 1)).float()


def whisper():
    tokens = torch.randint(9, (B, 6))
    return Spec(Whisper(), (torch.randn(B, 4, 8), tokens[:, :-1]), cross_entropy, (tokens[:, 1:],))


# -- generative models ----------------------------------------------------------------------------


class WeightStandardizedConv2d(nn.Conv2d):
    """lucidrains/denoising-diffusion-pytorch, ``denoising_diffusion_pytorch.py`` (1.x):
    ``WeightStandardizedConv2d``, its weight standardized in its own forward."""

    def forward(self, x):
        eps = 1e-5 if x.dtype == torch.float32 else 1e-3
        weight = self.weight
        mean = reduce(weight, "o ... -> o 1 1 1", "mean")
        var = reduce(weight, "o ... -> o 1 1 1", partial(torch.var, unbiased=False))
        normalized_weight = (weight - mean) * (var + eps).rsqrt()
        return F.conv2d(
            x, normalized_weight, self.bias, self.stride, self.padding, self.dilation, self.groups
        )


class DiffusionBlock(nn.Module):
    """denoising-diffusion-pytorch 1.x: ``Block`` (weight-standardized convolution, GroupNorm,
    the time embedding's scale and shift, SiLU)."""

    def __init__(self, dim, dim_out, groups=2):
        super().__init__()
        self.proj = WeightStandardizedConv2d(dim, dim_out, 3, padding=1)
        self.norm = nn.GroupNorm(groups, dim_out)
        self.act = nn.SiLU()

    def forward(self, x, scale_shift=None):
        x = self.norm(self.proj(x))
        if scale_shift is not None:
            scale, shift = scale_shift
            x = x * (scale + 1) + shift
        return self.act(x)


class ResnetBlock(nn.Module):
    """denoising-diffusion-pytorch 1.x: ``ResnetBlock``."""

    def __init__(self, dim, dim_out, time_emb_dim, groups=2):
        super().__init__()
        self.mlp = nn.Sequential(nn.SiLU(), nn.Linear(time_emb_dim, dim_out * 2))
        self.block1 = DiffusionBlock(dim, dim_out, groups=groups)
        self.block2 = DiffusionBlock(dim_out, dim_out, groups=groups)
        self.res_conv = nn.Conv2d(dim, dim_out, 1) if dim != dim_out else nn.Identity()

    def forward(self, x, time_emb):
        time_emb = rearrange(self.mlp(time_emb), "b c -> b c 1 1")
        h = self.block1(x, scale_shift=time_emb.chunk(2, dim=1))
        return self.block2(h) + self.res_conv(x)


class LinearAttention(nn.Module):
    """denoising-diffusion-pytorch 1.x: ``LinearAttention`` under ``PreNorm``'s GroupNorm of
    one group, inside ``Residual``."""

    def __init__(self, dim, heads=2, dim_head=4):
        super().__init__()
        self.scale, self.heads = dim_head**-0.5, heads
        hidden_dim = dim_head * heads
        self.prenorm = nn.GroupNorm(1, dim)
        self.to_qkv = nn.Conv2d(dim, hidden_dim * 3, 1, bias=False)
        self.to_out = nn.Sequential(nn.Conv2d(hidden_dim, dim, 1), nn.GroupNorm(1, dim))

    def forward(self, x):
        b, c, h, w = x.shape
        qkv = self.to_qkv(self.prenorm(x)).chunk(3, dim=1)
        q, k, v = (rearrange(t, "b (h c) x y -> b h c (x y)", h=self.heads) for t in qkv)
        q = q.softmax(dim=-2) * self.scale
        k = k.softmax(dim=-1)
        context = torch.einsum("b h d n, b h e n -> b h d e", k, v)
        out = torch.einsum("b h d e, b h d n -> b h e n", context, q)
        out = rearrange(out, "b h c (x y) -> b (h c) x y", h=self.heads, x=h, y=w)
        return self.to_out(out) + x


class SinusoidalPosEmb(nn.Module):
    """denoising-diffusion-pytorch: ``SinusoidalPosEmb`` of the integer timesteps."""

    def __init__(self, dim, theta=10000):
        super().__init__()
        self.dim, self.theta = dim, theta

    def forward(self, x):
        half_dim = self.dim // 2
        emb = math.log(self.theta) / (half_dim - 1)
        emb = torch.exp(torch.arange(half_dim) * -emb)
        emb = x[:, None] * emb[None, :]
        return torch.cat((emb.sin(), emb.cos()), dim=-1)


class Unet(nn.Module):
    """denoising-diffusion-pytorch 1.x: ``Unet``, one level down and up (a skip concatenated),
    its time MLP; the DDPM loss of ``GaussianDiffusion.p_losses`` (each image's mean squared
    error against its noise)."""

    def __init__(self, dim=4, channels=2):
        super().__init__()
        time_dim = dim * 2
        self.init_conv = nn.Conv2d(channels, dim, 7, padding=3)
        self.time_mlp = nn.Sequential(SinusoidalPosEmb(dim), nn.Linear(dim, time_dim), nn.GELU(),
                                      nn.Linear(time_dim, time_dim))  # fmt: skip
        self.down = ResnetBlock(dim, dim, time_dim)
        self.down_attn = LinearAttention(dim)
        self.downsample = nn.Conv2d(dim, dim, 4, 2, 1)
        self.mid = ResnetBlock(dim, dim, time_dim)
        self.upsample = nn.Sequential(nn.Upsample(scale_factor=2, mode="nearest"),
                                      nn.Conv2d(dim, dim, 3, padding=1))  # fmt: skip
        self.up = ResnetBlock(dim * 2, dim, time_dim)
        self.final_conv = nn.Conv2d(dim, channels, 1)

    def forward(self, x, time):
        x = self.init_conv(x)
        t = self.time_mlp(time)
        h = self.down_attn(self.down(x, t))
        x = self.mid(self.downsample(h), t)
        x = self.up(torch.cat((self.upsample(x), h), dim=1), t)
        return self.final_conv(x)


def ddpm_unet():
    x_t, noise = torch.randn(B, 2, 8, 8), torch.randn(B, 2, 8, 8)
    t = torch.randint(0, 1000, (B,)).float()  # (in the model's dtype: float64 here)
    return Spec(Unet(), (x_t, t), lambda out, n: (out - n).pow(2).flatten(1).mean(1), (noise,))


class EqualLinear(nn.Module):
    """rosinality/stylegan2-pytorch, ``model.py``: ``EqualLinear`` (equalized learning rate:
    the weight scaled in the forward), its ``fused_leaky_relu`` written in torch."""

    def __init__(self, in_dim, out_dim, bias_init=0.0, lr_mul=1.0, activation=False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_dim, in_dim).div_(lr_mul))
        self.bias = nn.Parameter(torch.zeros(out_dim).fill_(bias_init))
        self.scale, self.lr_mul, self.activation = (
            (1 / math.sqrt(in_dim)) * lr_mul,
            lr_mul,
            activation,
        )

    def forward(self, input):
        if self.activation:
            out = F.linear(input, self.weight * self.scale)
            return F.leaky_relu(out + self.bias * self.lr_mul, 0.2) * math.sqrt(2)
        return F.linear(input, self.weight * self.scale, bias=self.bias * self.lr_mul)


class ModulatedConv2d(nn.Module):
    """rosinality/stylegan2-pytorch, ``model.py``: ``ModulatedConv2d`` with ``fused=True``:
    each example's weight modulated by its style and demodulated, the batch folded into the
    convolution's groups (``input.view(1, batch * in_channel, height, width)``,
    ``groups=batch``)."""

    def __init__(self, in_channel, out_channel, kernel_size, style_dim, demodulate=True):
        super().__init__()
        self.eps, self.kernel_size = 1e-8, kernel_size
        self.in_channel, self.out_channel = in_channel, out_channel
        fan_in = in_channel * kernel_size**2
        self.scale, self.padding = 1 / math.sqrt(fan_in), kernel_size // 2
        self.weight = nn.Parameter(
            torch.randn(1, out_channel, in_channel, kernel_size, kernel_size)
        )
        self.modulation = EqualLinear(style_dim, in_channel, bias_init=1)
        self.demodulate = demodulate

    def forward(self, input, style):
        batch, in_channel, height, width = input.shape
        style = self.modulation(style).view(batch, 1, in_channel, 1, 1)
        weight = self.scale * self.weight * style
        if self.demodulate:
            demod = torch.rsqrt(weight.pow(2).sum([2, 3, 4]) + 1e-8)
            weight = weight * demod.view(batch, self.out_channel, 1, 1, 1)
        weight = weight.view(
            batch * self.out_channel, in_channel, self.kernel_size, self.kernel_size
        )
        input = input.view(1, batch * in_channel, height, width)
        out = F.conv2d(input, weight, padding=self.padding, groups=batch)
        _, _, height, width = out.shape
        return out.view(batch, self.out_channel, height, width)


class StyledConv(nn.Module):
    """rosinality/stylegan2-pytorch, ``model.py``: ``StyledConv`` (``NoiseInjection``'s
    weight times the noise, given here as an input; ``FusedLeakyReLU``'s bias)."""

    def __init__(self, in_channel, out_channel, kernel_size, style_dim):
        super().__init__()
        self.conv = ModulatedConv2d(in_channel, out_channel, kernel_size, style_dim)
        self.noise_weight = nn.Parameter(torch.full((1,), 0.1))
        self.bias = nn.Parameter(0.1 * torch.randn(1, out_channel, 1, 1))

    def forward(self, input, style, noise):
        out = self.conv(input, style) + self.noise_weight * noise
        return F.leaky_relu(out + self.bias, 0.2) * math.sqrt(2)


class StyleGenerator(nn.Module):
    """rosinality/stylegan2-pytorch, ``model.py``: ``Generator`` cut to a mapping network
    (``PixelNorm`` then ``EqualLinear`` with ``lr_mul=0.01``), a learned constant input
    repeated over the batch, two styled convolutions and a ``ToRGB`` (modulated, without
    demodulation)."""

    def __init__(self, style_dim=4, channels=3):
        super().__init__()
        self.style = nn.Sequential(EqualLinear(style_dim, style_dim, lr_mul=0.01, activation=True),
                                   EqualLinear(style_dim, style_dim, lr_mul=0.01, activation=True))  # fmt: skip
        self.input = nn.Parameter(torch.randn(1, channels, 4, 4))
        self.conv1 = StyledConv(channels, channels, 3, style_dim)
        self.conv2 = StyledConv(channels, channels, 3, style_dim)
        self.to_rgb = ModulatedConv2d(channels, 3, 1, style_dim, demodulate=False)
        self.rgb_bias = nn.Parameter(torch.zeros(1, 3, 1, 1))

    def forward(self, z, noise):
        z = z * torch.rsqrt(torch.mean(z**2, dim=1, keepdim=True) + 1e-8)
        latent = self.style(z)
        out = self.input.repeat(z.shape[0], 1, 1, 1)
        out = self.conv1(out, latent, noise[:, :1])
        out = self.conv2(out, latent, noise[:, 1:])
        return self.to_rgb(out, latent) + self.rgb_bias


def stylegan2():
    """The generator's output against a target image (a reconstruction loss, each example's)."""
    return Spec(StyleGenerator(), (torch.randn(B, 4), torch.randn(B, 2, 4, 4)), mse,
                (torch.randn(B, 3, 4, 4),))  # fmt: skip


class MaskedConv2d(nn.Conv2d):
    """jzbontar/pixelcnn-pytorch, ``main.py``: ``MaskedConv2d``, its weight masked in place
    through ``.data`` at every forward (``self.weight.data *= self.mask``), then
    ``Conv2d.forward``."""

    def __init__(self, mask_type, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("mask", self.weight.data.clone())
        _, _, kH, kW = self.weight.size()
        self.mask.fill_(1)
        self.mask[:, :, kH // 2, kW // 2 + (mask_type == "B") :] = 0
        self.mask[:, :, kH // 2 + 1 :] = 0

    def forward(self, x):
        self.weight.data *= self.mask
        return super().forward(x)


def pixelcnn():
    """jzbontar/pixelcnn-pytorch, ``main.py``: the network (its BatchNorm2d converted to
    GroupNorm by ``gradhooks.convert_batch_norm``), each pixel's cross-entropy over 4 levels."""
    fm = 4
    net = nn.Sequential(
        MaskedConv2d("A", 1, fm, 5, 1, 2, bias=False), nn.BatchNorm2d(fm), nn.ReLU(True),
        MaskedConv2d("B", fm, fm, 5, 1, 2, bias=False), nn.BatchNorm2d(fm), nn.ReLU(True),
        nn.Conv2d(fm, 4, 1),
    )  # fmt: skip
    gradhooks.convert_batch_norm(net)
    levels = torch.randint(4, (B, 1, 6, 6))
    return Spec(net, (levels.float() / 3,), channels_cross_entropy_2d, (levels[:, 0],))


def channels_cross_entropy_2d(logits, target):
    return F.cross_entropy(logits, target, reduction="none").flatten(1).sum(1)


class VAE(nn.Module):
    """pytorch/examples, ``vae/main.py``: ``VAE``; ``reparameterize`` takes its noise as an
    input (drawn by ``torch.randn_like`` there), so the loop sees each example's own draw."""

    def __init__(self, d=12, h=6, z=2):
        super().__init__()
        self.d = d
        self.fc1, self.fc21, self.fc22 = nn.Linear(d, h), nn.Linear(h, z), nn.Linear(h, z)
        self.fc3, self.fc4 = nn.Linear(z, h), nn.Linear(h, d)

    def forward(self, x, eps):
        h1 = F.relu(self.fc1(x.view(-1, self.d)))
        mu, logvar = self.fc21(h1), self.fc22(h1)
        z = mu + eps * torch.exp(0.5 * logvar)
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z)))), mu, logvar


def vae_loss(out, x):
    """``loss_function``: binary cross-entropy plus KL divergence, each example's own."""
    recon_x, mu, logvar = out
    BCE = F.binary_cross_entropy(recon_x, x.view(-1, 12), reduction="none").sum(1)
    KLD = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp(), dim=1)
    return BCE + KLD


def vae():
    x = torch.rand(B, 1, 3, 4)
    return Spec(VAE(), (x, torch.randn(B, 2)), vae_loss, (x,))


class Embedder:
    """yenchenlin/nerf-pytorch, ``run_nerf_helpers.py``: ``Embedder`` (the input and sines and
    cosines of it at ``2**k`` frequencies)."""

    def __init__(self, multires):
        self.fns = [lambda x: x]
        for freq in 2.0 ** torch.linspace(0.0, multires - 1, steps=multires):
            for p_fn in (torch.sin, torch.cos):
                self.fns.append(lambda x, p_fn=p_fn, freq=freq: p_fn(x * freq))
        self.out_dim = 3 * len(self.fns)

    def embed(self, inputs):
        return torch.cat([fn(inputs) for fn in self.fns], -1)


class NeRF(nn.Module):
    """yenchenlin/nerf-pytorch, ``run_nerf_helpers.py``: ``NeRF`` with view directions and a
    skip."""

    def __init__(self, D=3, W=8, input_ch=15, input_ch_views=9, skips=(1,)):
        super().__init__()
        self.input_ch, self.input_ch_views, self.skips = input_ch, input_ch_views, skips
        self.pts_linears = nn.ModuleList(
            [nn.Linear(input_ch, W)]
            + [
                nn.Linear(W, W) if i not in skips else nn.Linear(W + input_ch, W)
                for i in range(D - 1)
            ]
        )
        self.views_linears = nn.ModuleList([nn.Linear(input_ch_views + W, W // 2)])
        self.feature_linear = nn.Linear(W, W)
        self.alpha_linear = nn.Linear(W, 1)
        self.rgb_linear = nn.Linear(W // 2, 3)

    def forward(self, x):
        input_pts, input_views = torch.split(x, [self.input_ch, self.input_ch_views], dim=-1)
        h = input_pts
        for i, _ in enumerate(self.pts_linears):
            h = F.relu(self.pts_linears[i](h))
            if i in self.skips:
                h = torch.cat([input_pts, h], -1)
        alpha = self.alpha_linear(h)
        h = torch.cat([self.feature_linear(h), input_views], -1)
        for layer in self.views_linears:
            h = F.relu(layer(h))
        return torch.cat([self.rgb_linear(h), alpha], -1)


class NeRFRender(nn.Module):
    """yenchenlin/nerf-pytorch, ``run_nerf.py``: ``render_rays`` without stratified sampling
    (points along each ray), ``run_network`` (every ray's points flattened, encoded, and
    ``batchify``'d: run in chunks of ``netchunk`` rows that cut across the rays, then
    concatenated) and ``raw2outputs`` (alpha compositing by ``cumprod``): each ray an
    example."""

    def __init__(self, n_samples=4, netchunk=5):
        super().__init__()
        self.network_fn = NeRF()
        self.embed, self.embeddirs = Embedder(2), Embedder(1)
        self.n_samples, self.netchunk = n_samples, netchunk

    def forward(self, rays_o, rays_d):
        viewdirs = rays_d / torch.norm(rays_d, dim=-1, keepdim=True)
        near, far = 2.0, 6.0
        t_vals = torch.linspace(0.0, 1.0, steps=self.n_samples, dtype=rays_o.dtype)
        z_vals = (near * (1.0 - t_vals) + far * t_vals).expand([rays_o.shape[0], self.n_samples])
        pts = rays_o[..., None, :] + rays_d[..., None, :] * z_vals[..., :, None]
        inputs_flat = torch.reshape(pts, [-1, pts.shape[-1]])
        embedded = self.embed.embed(inputs_flat)
        input_dirs = viewdirs[:, None].expand(pts.shape)
        embedded_dirs = self.embeddirs.embed(torch.reshape(input_dirs, [-1, input_dirs.shape[-1]]))
        embedded = torch.cat([embedded, embedded_dirs], -1)
        outputs_flat = torch.cat([self.network_fn(embedded[i : i + self.netchunk])
                                  for i in range(0, embedded.shape[0], self.netchunk)], 0)  # fmt: skip
        raw = torch.reshape(outputs_flat, list(pts.shape[:-1]) + [outputs_flat.shape[-1]])
        dists = z_vals[..., 1:] - z_vals[..., :-1]
        dists = torch.cat([dists, torch.full_like(dists[..., :1], 1e10)], -1)
        dists = dists * torch.norm(rays_d[..., None, :], dim=-1)
        rgb = torch.sigmoid(raw[..., :3])
        alpha = 1.0 - torch.exp(-F.relu(raw[..., 3]) * dists)
        ones = torch.ones((alpha.shape[0], 1), dtype=alpha.dtype)
        weights = alpha * torch.cumprod(torch.cat([ones, 1.0 - alpha + 1e-10], -1), -1)[:, :-1]
        return torch.sum(weights[..., None] * rgb, -2)


def nerf():
    rays_o, rays_d = torch.randn(B, 3) * 0.1, torch.randn(B, 3)
    return Spec(NeRFRender(), (rays_o, rays_d), mse, (torch.rand(B, 3),))


# -- others ---------------------------------------------------------------------------------------


class KANLinear(nn.Module):
    """Blealtan/efficient-kan, ``src/efficient_kan/kan.py``: ``KANLinear``, B-spline bases of
    each input (a grid buffer, the Cox-de Boor recursion), ``F.linear`` with a SiLU base
    weight and a spline weight scaled by its own scaler."""

    def __init__(self, in_features, out_features, grid_size=3, spline_order=2, grid_range=(-1, 1)):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.grid_size, self.spline_order = grid_size, spline_order
        h = (grid_range[1] - grid_range[0]) / grid_size
        grid = torch.arange(-spline_order, grid_size + spline_order + 1) * h + grid_range[0]
        self.register_buffer("grid", grid.expand(in_features, -1).contiguous())
        self.base_weight = nn.Parameter(
            torch.randn(out_features, in_features) / math.sqrt(in_features)
        )
        self.spline_weight = nn.Parameter(
            0.1 * torch.randn(out_features, in_features, grid_size + spline_order)
        )
        self.spline_scaler = nn.Parameter(
            torch.ones(out_features, in_features) + 0.1 * torch.randn(out_features, in_features)
        )
        self.base_activation = nn.SiLU()

    def b_splines(self, x):
        grid = self.grid
        x = x.unsqueeze(-1)
        bases = ((x >= grid[:, :-1]) & (x < grid[:, 1:])).to(x.dtype)
        for k in range(1, self.spline_order + 1):
            bases = (
                (x - grid[:, : -(k + 1)]) / (grid[:, k:-1] - grid[:, : -(k + 1)]) * bases[:, :, :-1]
            ) + ((grid[:, k + 1 :] - x) / (grid[:, k + 1 :] - grid[:, 1:(-k)]) * bases[:, :, 1:])
        return bases.contiguous()

    @property
    def scaled_spline_weight(self):
        return self.spline_weight * self.spline_scaler.unsqueeze(-1)

    def forward(self, x):
        original_shape = x.shape
        x = x.reshape(-1, self.in_features)
        base_output = F.linear(self.base_activation(x), self.base_weight)
        spline_output = F.linear(self.b_splines(x).view(x.size(0), -1),
                                 self.scaled_spline_weight.view(self.out_features, -1))  # fmt: skip
        return (base_output + spline_output).reshape(*original_shape[:-1], self.out_features)


class KAN(nn.Module):
    """Blealtan/efficient-kan: ``KAN``, KANLinear layers in turn."""

    def __init__(self, layers_hidden=(3, 4, 3)):
        super().__init__()
        self.layers = nn.ModuleList(
            KANLinear(i, o) for i, o in zip(layers_hidden, layers_hidden[1:])
        )

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def efficient_kan():
    return Spec(KAN(), (torch.rand(B, 3) * 1.8 - 0.9,), cross_entropy, (torch.randint(3, (B,)),))


class MAB(nn.Module):
    """juho-lee/set_transformer, ``modules.py``: ``MAB``, its heads split off the features
    and concatenated along the batch, ``torch.cat(Q.split(dim_split, 2), 0)``, attended by
    ``bmm`` and put back by ``split(Q.size(0), 0)``."""

    def __init__(self, dim_Q, dim_K, dim_V, num_heads, ln=False):
        super().__init__()
        self.dim_V, self.num_heads = dim_V, num_heads
        self.fc_q, self.fc_k, self.fc_v = (
            nn.Linear(dim_Q, dim_V),
            nn.Linear(dim_K, dim_V),
            nn.Linear(dim_K, dim_V),
        )
        if ln:
            self.ln0, self.ln1 = nn.LayerNorm(dim_V), nn.LayerNorm(dim_V)
        self.fc_o = nn.Linear(dim_V, dim_V)

    def forward(self, Q, K):
        Q = self.fc_q(Q)
        K, V = self.fc_k(K), self.fc_v(K)
        dim_split = self.dim_V // self.num_heads
        Q_ = torch.cat(Q.split(dim_split, 2), 0)
        K_ = torch.cat(K.split(dim_split, 2), 0)
        V_ = torch.cat(V.split(dim_split, 2), 0)
        A = torch.softmax(Q_.bmm(K_.transpose(1, 2)) / math.sqrt(self.dim_V), 2)
        O = torch.cat((Q_ + A.bmm(V_)).split(Q.size(0), 0), 2)  # noqa: E741
        O = O if getattr(self, "ln0", None) is None else self.ln0(O)  # noqa: E741
        O = O + F.relu(self.fc_o(O))  # noqa: E741
        return O if getattr(self, "ln1", None) is None else self.ln1(O)


class SAB(nn.Module):
    def __init__(self, dim_in, dim_out, num_heads, ln=False):
        super().__init__()
        self.mab = MAB(dim_in, dim_in, dim_out, num_heads, ln=ln)

    def forward(self, X):
        return self.mab(X, X)


class ISAB(nn.Module):
    """juho-lee/set_transformer, ``modules.py``: ``ISAB`` (inducing points ``I`` repeated
    over the batch)."""

    def __init__(self, dim_in, dim_out, num_heads, num_inds, ln=False):
        super().__init__()
        self.I = nn.Parameter(torch.empty(1, num_inds, dim_out))
        nn.init.xavier_uniform_(self.I)
        self.mab0 = MAB(dim_out, dim_in, dim_out, num_heads, ln=ln)
        self.mab1 = MAB(dim_in, dim_out, dim_out, num_heads, ln=ln)

    def forward(self, X):
        return self.mab1(X, self.mab0(self.I.repeat(X.size(0), 1, 1), X))


class PMA(nn.Module):
    """juho-lee/set_transformer, ``modules.py``: ``PMA`` (seeds ``S`` repeated)."""

    def __init__(self, dim, num_heads, num_seeds, ln=False):
        super().__init__()
        self.S = nn.Parameter(torch.empty(1, num_seeds, dim))
        nn.init.xavier_uniform_(self.S)
        self.mab = MAB(dim, dim, dim, num_heads, ln=ln)

    def forward(self, X):
        return self.mab(self.S.repeat(X.size(0), 1, 1), X)


class SetTransformer(nn.Module):
    """juho-lee/set_transformer, ``models.py``: ``SetTransformer``."""

    def __init__(
        self,
        dim_input=2,
        num_outputs=1,
        dim_output=1,
        num_inds=3,
        dim_hidden=4,
        num_heads=2,
        ln=True,
    ):
        super().__init__()
        self.enc = nn.Sequential(ISAB(dim_input, dim_hidden, num_heads, num_inds, ln=ln),
                                 ISAB(dim_hidden, dim_hidden, num_heads, num_inds, ln=ln))  # fmt: skip
        self.dec = nn.Sequential(PMA(dim_hidden, num_heads, num_outputs, ln=ln),
                                 SAB(dim_hidden, dim_hidden, num_heads, ln=ln),
                                 nn.Linear(dim_hidden, dim_output))  # fmt: skip

    def forward(self, X):
        return self.dec(self.enc(X))


def set_transformer():
    """``max_regression_demo.ipynb``: the largest of each set, an L1 loss."""
    X = torch.randn(B, 5, 2)
    return Spec(
        SetTransformer(), (X,), lambda out, y: (out.view(-1) - y).abs(), (X[..., 0].max(1).values,)
    )


def precompute_freqs_cis(dim, end, theta=10000.0):
    """pytorch/torchtitan, ``torchtitan/models/llama3/model/model.py``: complex rotations."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    freqs = torch.outer(torch.arange(end, device=freqs.device), freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    """torchtitan: ``apply_rotary_emb`` (``view_as_complex`` of the float queries and keys)."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[0 : xq_.shape[1]].view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x, n_rep):
    """torchtitan: ``repeat_kv`` (grouped-query attention's keys and values expanded)."""
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        torch.unsqueeze(x, dim=3)
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


class TitanAttention(nn.Module):
    """torchtitan: ``Attention`` (GQA, rotary, ``F.scaled_dot_product_attention``, causal)."""

    def __init__(self, dim=8, n_heads=4, n_kv_heads=2):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.n_rep, self.head_dim = n_heads // n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, freqs_cis):
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        xq, xk = xq.transpose(1, 2), repeat_kv(xk, self.n_rep).transpose(1, 2)
        xv = repeat_kv(xv, self.n_rep).transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        return self.wo(output.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class TitanFeedForward(nn.Module):
    """torchtitan: ``FeedForward`` (SwiGLU)."""

    def __init__(self, dim=8, hidden_dim=12):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TitanBlock(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.attention, self.feed_forward = TitanAttention(dim), TitanFeedForward(dim)
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim, eps=1e-5), nn.RMSNorm(dim, eps=1e-5)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class TitanLlama(nn.Module):
    """torchtitan: ``Transformer`` (a ``ModuleDict`` of layers, the rotations a buffer,
    ``nn.RMSNorm``, an untied output)."""

    def __init__(self, vocab=11, dim=8, n_layers=2, max_seq_len=8):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.register_buffer(
            "freqs_cis", precompute_freqs_cis(dim // 4, max_seq_len), persistent=True
        )
        self.layers = nn.ModuleDict({str(i): TitanBlock(dim) for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)

    def init_buffers(self):
        """The rotations made again after the model is cast (as ``init_weights`` makes them
        after the model is materialized): ``Module.to(torch.float64)`` casts the complex
        buffer to a real one."""
        self.freqs_cis = precompute_freqs_cis(
            self.tok_embeddings.embedding_dim // 4, len(self.freqs_cis)
        )

    def forward(self, tokens):
        assert self.freqs_cis.is_complex()
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def torchtitan_llama():
    tokens = torch.randint(11, (B, 7))
    return Spec(TitanLlama(), (tokens[:, :-1],), cross_entropy, (tokens[:, 1:],), rtol=1e-5)


class CapsuleLayer(nn.Module):
    """gram-ai/capsule-networks, ``capsule_network.py``: ``CapsuleLayer``, primary capsules
    by convolutions, digit capsules by routing by agreement (``priors`` with the batch on
    their second dimension, ``x[None, :, :, None, :] @ route_weights[:, None, :, :, :]``)."""

    def __init__(self, num_capsules, num_route_nodes, in_channels, out_channels, kernel_size=None,
                 stride=None, num_iterations=3):  # fmt: skip
        super().__init__()
        self.num_route_nodes, self.num_iterations = num_route_nodes, num_iterations
        if num_route_nodes != -1:
            self.route_weights = nn.Parameter(
                0.3 * torch.randn(num_capsules, num_route_nodes, in_channels, out_channels)
            )
        else:
            self.capsules = nn.ModuleList(
                nn.Conv2d(in_channels, out_channels, kernel_size=kernel_size, stride=stride)
                for _ in range(num_capsules)
            )

    @staticmethod
    def squash(tensor, dim=-1):
        squared_norm = (tensor**2).sum(dim=dim, keepdim=True)
        return squared_norm / (1 + squared_norm) * tensor / torch.sqrt(squared_norm)

    def forward(self, x):
        if self.num_route_nodes != -1:
            priors = x[None, :, :, None, :] @ self.route_weights[:, None, :, :, :]
            logits = torch.zeros(*priors.size(), dtype=priors.dtype)
            for i in range(self.num_iterations):
                probs = F.softmax(logits, dim=2)
                outputs = self.squash((probs * priors).sum(dim=2, keepdim=True))
                if i != self.num_iterations - 1:
                    logits = logits + (priors * outputs).sum(dim=-1, keepdim=True)
            return outputs
        outputs = [capsule(x).view(x.size(0), -1, 1) for capsule in self.capsules]
        return self.squash(torch.cat(outputs, dim=-1))


class CapsuleNet(nn.Module):
    """gram-ai/capsule-networks, ``capsule_network.py``: ``CapsuleNet`` (the lengths of the
    digit capsules, a decoder of the true class's capsule); its ``.squeeze()`` of every
    dimension of size 1 written for the ones it means, which keeps a batch of one."""

    def __init__(self, classes=3):
        super().__init__()
        self.classes = classes
        self.conv1 = nn.Conv2d(1, 4, kernel_size=3, stride=1)
        self.primary_capsules = CapsuleLayer(4, -1, 4, 2, kernel_size=3, stride=2)
        self.digit_capsules = CapsuleLayer(classes, 2 * 2 * 2, 4, 3)
        self.decoder = nn.Sequential(nn.Linear(3 * classes, 8), nn.ReLU(inplace=True),
                                     nn.Linear(8, 49), nn.Sigmoid())  # fmt: skip

    def forward(self, x, y):
        x = F.relu(self.conv1(x), inplace=True)
        x = self.primary_capsules(x)
        x = self.digit_capsules(x).squeeze(2).squeeze(2).squeeze(2).transpose(0, 1)
        classes = F.softmax((x**2).sum(dim=-1) ** 0.5, dim=-1)
        reconstructions = self.decoder((x * y[:, :, None]).reshape(x.size(0), -1))
        return classes, reconstructions


def capsule_loss(out, images, labels):
    """``CapsuleLoss``: the margin loss and the reconstruction's squared error, each
    example's own."""
    classes, reconstructions = out
    left = F.relu(0.9 - classes, inplace=True) ** 2
    right = F.relu(classes - 0.1, inplace=True) ** 2
    margin_loss = (labels * left + 0.5 * (1.0 - labels) * right).sum(1)
    reconstruction = (reconstructions - images.view(images.size(0), -1)) ** 2
    return margin_loss + 0.0005 * reconstruction.sum(1)


def capsnet():
    images = torch.rand(B, 1, 7, 7)
    labels = F.one_hot(torch.randint(3, (B,)), 3).float()
    return Spec(CapsuleNet(), (images, labels), capsule_loss, (images, labels))


class DecisionTransformer(nn.Module):
    """kzl/decision-transformer, ``gym/decision_transformer/models/decision_transformer.py``:
    ``DecisionTransformer`` on Hugging Face's ``GPT2Model`` (returns, states and actions
    embedded, interleaved by ``stack``, ``permute`` and ``reshape``, run with
    ``inputs_embeds`` and a left-padded attention mask; the repository's GPT-2 has no
    positional embeddings: here ``wpe`` is zero and frozen)."""

    def __init__(self, state_dim=3, act_dim=2, hidden_size=8, max_ep_len=20):
        super().__init__()
        from harness import hf

        config = hf("GPT2Config")(vocab_size=1, n_embd=hidden_size, n_layer=1, n_head=2,
                                  n_inner=16, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0)  # fmt: skip
        self.hidden_size = hidden_size
        self.transformer = hf("GPT2Model")(config)
        self.transformer.wpe.weight.data.zero_()
        self.transformer.wpe.weight.requires_grad_(False)
        self.embed_timestep = nn.Embedding(max_ep_len, hidden_size)
        self.embed_return = nn.Linear(1, hidden_size)
        self.embed_state = nn.Linear(state_dim, hidden_size)
        self.embed_action = nn.Linear(act_dim, hidden_size)
        self.embed_ln = nn.LayerNorm(hidden_size)
        self.predict_action = nn.Sequential(nn.Linear(hidden_size, act_dim), nn.Tanh())

    def forward(self, states, actions, returns_to_go, timesteps, attention_mask):
        batch_size, seq_length = states.shape[0], states.shape[1]
        time_embeddings = self.embed_timestep(timesteps)
        state_embeddings = self.embed_state(states) + time_embeddings
        action_embeddings = self.embed_action(actions) + time_embeddings
        returns_embeddings = self.embed_return(returns_to_go) + time_embeddings
        stacked_inputs = torch.stack(
            (returns_embeddings, state_embeddings, action_embeddings), dim=1
        )
        stacked_inputs = stacked_inputs.permute(0, 2, 1, 3).reshape(
            batch_size, 3 * seq_length, self.hidden_size
        )
        stacked_inputs = self.embed_ln(stacked_inputs)
        stacked_attention_mask = torch.stack(
            (attention_mask, attention_mask, attention_mask), dim=1
        )
        stacked_attention_mask = stacked_attention_mask.permute(0, 2, 1).reshape(
            batch_size, 3 * seq_length
        )
        x = self.transformer(inputs_embeds=stacked_inputs, attention_mask=stacked_attention_mask)
        x = (
            x["last_hidden_state"]
            .reshape(batch_size, seq_length, 3, self.hidden_size)
            .permute(0, 2, 1, 3)
        )
        return self.predict_action(x[:, 1])


def decision_transformer():
    """``SequenceTrainer.train_step``: the actions' squared error over the unpadded steps."""
    T = 4
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :2] = 0  # (left-padded, as get_batch pads)
    actions = torch.rand(B, T, 2) * 2 - 1
    args = (torch.randn(B, T, 3), actions, torch.randn(B, T, 1), torch.randint(20, (B, T)), mask)
    return Spec(DecisionTransformer(), args,
                lambda out, a, m: ((out - a) ** 2).sum(-1).mul(m).sum(1), (actions, mask))  # fmt: skip


MATCH = {
    "mamba-minimal": mamba_minimal,
    "rwkv-4": rwkv4,
    "s4d": s4d,
    "lru": lru,
    "convnext-v2": convnext_v2,
    "pointnet-bn-eval": partial(pointnet, "eval"),
    "pointnet-groupnorm": partial(pointnet, "groupnorm"),
    "dense-gcn": partial(dense_graphs, "gcn"),
    "dense-gin": partial(dense_graphs, "gin"),
    "gat-batched": gat_batched,
    "mesh-graph-net": mesh_graph_net,
    "saint-s": partial(saint, "col"),
    "node-odst": node,
    "deepfm-groupnorm": partial(recommender, DeepFM),
    "dcn-groupnorm": partial(recommender, DCN),
    "xdeepfm-groupnorm": partial(recommender, XDeepFM),
    "dlrm": dlrm,
    "neumf": neumf,
    "sasrec": sasrec,
    "wavenet": wavenet,
    "conformer-torchaudio": conformer,
    "whisper": whisper,
    "ddpm-unet": ddpm_unet,
    "vae": vae,
    "stylegan2": stylegan2,
    "pixelcnn-groupnorm": pixelcnn,
    "nerf": nerf,
    "efficient-kan": efficient_kan,
    "set-transformer": set_transformer,
    "torchtitan-llama": torchtitan_llama,
    "capsnet": capsnet,
    "decision-transformer": decision_transformer,
}


REFUSED = {
    "pointnet": (pointnet, gradhooks.MixedExamplesError, ["'stn.bn1' (BatchNorm1d)", "GroupNorm"]),
    "deepfm": (
        partial(recommender, DeepFM, "batchnorm"),
        gradhooks.MixedExamplesError,
        ["'mlp.1' (BatchNorm1d)", "GroupNorm"],
    ),
    "pygat-one-graph": (
        pygat_one_graph,
        gradhooks.MixedExamplesError,
        ["'out_att' (GraphAttentionLayer)", "(6, 8)"],
    ),
    "gin-flat": (gin_flat, gradhooks.MixedExamplesError, ["'nn1.0' (Linear)", "(12, 3)"]),
    "timesnet": (
        timesnet,
        gradhooks.MixedExamplesError,
        ["'layer_norm' (LayerNorm)", "numpy of a tensor computed across the batch"],
    ),
    "saint": (
        partial(saint, "colrow"),
        gradhooks.MixedExamplesError,
        ["'attn2.to_out' (Linear)", "(1, 3, 12)"],
    ),
}


@pytest.mark.parametrize("name", REFUSED)
def test_model_refused(name):
    factory, error, says = REFUSED[name]
    assert_refused(factory, error, says)


@pytest.mark.parametrize("name", MATCH)
def test_model_matches_the_loop(name):
    assert_matches_loop(MATCH[name])


def test_the_check_tells_a_wrong_grad1(monkeypatch):
    """Two examples' ``grad1`` of one parameter swapped: the comparison with the loop fails."""
    monkeypatch.setattr(gradhooks, "add_hooks", corrupting(gradhooks.add_hooks))
    with pytest.raises(AssertionError):
        assert_matches_loop(neumf)


@pytest.mark.xfail(
    strict=True,
    raises=gradhooks.MixedExamplesError,
    reason=(
        "DGCNN gathers each point's neighbours from the batch's points flattened, "
        "x.view(batch * points, -1)[idx], idx offset by each cloud's start: the rows picked are "
        "followed as rows picked by an index (one cloud each, in order), and 'feature - x' "
        "meets them with the plain batch of the same owners, which the tracker takes for two "
        "examples combined. Taking such rows for the plain batch would also let a later cut by "
        "position through (a mixture of experts' capacity), where an example alone would keep "
        "other rows: left refused."
    ),
)
def test_dgcnn_neighbours_gathered_from_the_flattened_batch():
    """A false refusal: each cloud's neighbours are its own, and the loop works."""
    assert_matches_loop(dgcnn)


# -- trained as users train: bfloat16 autocast, a few steps ----------------------------------------

BF16_TOL = 5e-2  # (about 16 units of bfloat16's rounding, 2**-9, relative to the largest entry)


def relative(got: Tensor, want: Tensor) -> float:
    """The largest error relative to the largest entry of ``want`` (of a parameter)."""
    scale = want.abs().max().clamp_min(1e-6)
    return float((got.float() - want.float()).abs().max() / scale)


def autocast_gradients(spec: Spec) -> dict[str, Tensor]:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return own_gradients(spec)


def train_bf16(factory, how: str, steps: int = 3) -> None:
    """The model in float32, trained as its users train it: ``zero_grad``, a forward under CPU
    bfloat16 autocast, the loss (in float32) averaged over the batch, ``backward`` (or
    gradhooks' DP step, ``how="dp"``, clipping without noise) and an AdamW step. At each step,
    ``grad1`` against the same model's per-example loop under the same autocast, and its mean
    against ``.grad`` (or ``.grad`` against the loop's clipped mean)."""
    spec = build(factory, torch.float32)
    model = spec.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    with gradhooks.add_hooks(model, loss_reduction="mean") as hooks:
        for step in range(steps):
            optimizer.zero_grad()
            want = autocast_gradients(spec)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses = spec.losses(model(*spec.args), *spec.targets).float()
            if how == "dp":
                C = 0.5 * float(
                    torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1).max()
                )
                gradhooks.dp_sgd_step(hooks, losses, max_norm=C, noise_multiplier=0.0)
                norms = torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)
                factor = (C / (norms + 1e-6)).clamp(max=1.0)
                for n, p in trainable.items():
                    clipped = (want[n] * factor.view(-1, *[1] * p.dim())).mean(0)
                    assert relative(p.grad, clipped) < BF16_TOL, (
                        step,
                        n,
                        relative(p.grad, clipped),
                    )
            else:
                losses.mean().backward()
                for n, p in trainable.items():
                    if p.grad is None:
                        assert getattr(p, "grad1", None) is None and not want[n].any(), n
                        continue
                    assert p.grad1.shape == (B, *p.shape), n
                    assert relative(p.grad1, want[n]) < BF16_TOL, (
                        step,
                        n,
                        relative(p.grad1, want[n]),
                    )
                    assert relative(p.grad1.mean(0), p.grad) < BF16_TOL, (step, n)
            optimizer.step()


TRAINED = {
    "mamba-minimal": (mamba_minimal, "grad1"),
    "rwkv-4": (rwkv4, "dp"),
    "convnext-v2": (convnext_v2, "grad1"),
    "dlrm": (dlrm, "dp"),
    "sasrec": (sasrec, "grad1"),
    "wavenet": (wavenet, "grad1"),
    "whisper": (whisper, "grad1"),
    "ddpm-unet": (ddpm_unet, "dp"),
    "nerf": (nerf, "grad1"),
    "stylegan2": (stylegan2, "dp"),
    "efficient-kan": (efficient_kan, "grad1"),
    "set-transformer": (set_transformer, "dp"),
    "torchtitan-llama": (torchtitan_llama, "grad1"),
}


@pytest.mark.parametrize("name", TRAINED)
def test_model_trained_under_bf16_autocast(name):
    factory, how = TRAINED[name]
    train_bf16(factory, how)

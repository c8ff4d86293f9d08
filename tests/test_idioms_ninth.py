"""Published training loops, a ninth set: how people train on GPUs, emulated on the CPU.

Each test writes again, on a small model, the idioms of one published loop that the earlier
sets do not run: fused layers written as custom ``torch.autograd.Function`` s (apex's
``FusedDense``, Liger-Kernel's RMSNorm and LayerNorm, with ``torch.amp.custom_fwd`` under
autocast, and in the DP step); Megatron-LM's ``skip_bias_add`` with the bias fused into
``bias_gelu``; a layer's forward replaced on the module itself or its class swapped (Liger's
patches of a built model, ``accelerate``'s hooks, a masked sparse-training forward), before
``add_hooks`` or after it; activation checkpointing of a block that uses its parameters
directly; reformer's reversible residual blocks rebuilt in a custom backward; StyleGAN2-ADA's
lazy R1 regularization; transformers' flash_attention_2 path (unpad, varlen attention, pad);
litgpt's loop on Lightning Fabric (``16-mixed``, ``no_backward_sync``, a chunked loss);
nanoGPT's compiled float16 loop with a ``GradScaler``, accumulation and clipping; CUDA graphs'
static input buffers. Each is compared with each example's own gradient by a per-example loop
in float64 (:func:`gradhooks.oracle.loop_grad`), or checked to stop with an error that says
what went wrong and leaves the model as it was; what is not right yet is a strict xfail saying
why.
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_idioms_seventh import assert_unchanged, snapshot
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_grad1

D = torch.float64


def relative_error(model: nn.Module, want: dict, scale: float = 1.0) -> float:
    """``max |grad1 / scale - want| / max |want|`` over every trainable parameter together."""
    err = max(
        ((p.grad1.double() / scale) - want[n]).abs().max().item()
        for n, p in model.named_parameters()
        if p.requires_grad
    )
    return err / max(want[n].abs().max().item() for n in want)


# -- fused layers as custom autograd Functions: apex FusedDense, Liger-Kernel's RMSNorm ----------


class LinearFunction(torch.autograd.Function):
    """apex's ``FusedDenseFunc`` / Megatron-LM's ``LinearWithGradAccumulationAndAsync...``
    reduced to its contract: ``x @ w.T + b`` forward, and a backward written by hand that
    forms the weight's and the bias's batch gradients itself (over every row of ``[*, in]``).
    ``custom_fwd`` runs it in float32 under autocast, as apex does."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return x @ weight.t() + bias

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        rows, x_rows = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        return g @ weight, rows.t() @ x_rows, rows.sum(0)


class FusedDense(nn.Linear):
    """apex's ``FusedDense``: an ``nn.Linear`` whose forward is the fused Function."""

    def forward(self, x):
        return LinearFunction.apply(x, self.weight, self.bias)


class RMSNormFunction(torch.autograd.Function):
    """Liger-Kernel's ``LigerRMSNormFunction``: ``x / rms(x) * w`` in one kernel, its backward
    written by hand (the weight's gradient summed over every row)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x, weight, eps):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        normed = x * rstd
        ctx.save_for_backward(normed, rstd, weight)
        return normed * weight

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        normed, rstd, weight = ctx.saved_tensors
        g_weight = (g * normed).reshape(-1, normed.shape[-1]).sum(0)
        g_normed = g * weight
        g_x = rstd * (g_normed - normed * (g_normed * normed).mean(-1, keepdim=True))
        return g_x, g_weight, None


class LigerRMSNorm(nn.Module):
    """Liger-Kernel's ``LigerRMSNorm``, which replaces a Llama model's ``LlamaRMSNorm``."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return RMSNormFunction.apply(x, self.weight, self.eps)


class FusedLM(nn.Module):
    """A pre-norm block of a small language model whose norms are Liger's and whose
    projections are fused Linears; ``fused_head=True`` also makes the model's own output
    scale go through a Function in its own forward (a parameter of the root module)."""

    def __init__(self, vocab: int = 11, dim: int = 8):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.norm1, self.norm2 = LigerRMSNorm(dim), LigerRMSNorm(dim)
        self.up, self.down = FusedDense(dim, 2 * dim), FusedDense(2 * dim, dim)
        self.head = nn.Linear(dim, vocab)
        self.logit_scale = nn.Parameter(torch.ones(vocab))

    def forward(self, idx):
        h = self.emb(idx)
        h = h + self.down(torch.tanh(self.up(self.norm1(h))))
        out = self.head(self.norm2(h))
        return RMSNormFunction.apply(out, self.logit_scale, 1e-6)


def tokens(g: torch.Generator, n: int = 4, length: int = 5, vocab: int = 11):
    """``n`` sequences of ``length`` token ids and their targets."""
    return torch.randint(vocab, (n, length), generator=g), torch.randint(
        vocab, (n, length), generator=g
    )


def token_ce(out, y):
    return F.cross_entropy(out.float().flatten(0, 1), y.flatten())


@pytest.mark.parametrize("autocast", [False, True], ids=["float64", "bf16 autocast"])
def test_fused_layers_written_as_custom_autograd_functions_over_adamw_steps(autocast):
    """apex's ``FusedDense`` and Liger-Kernel's RMSNorm (and a scale applied by the same
    Function in the model's own forward) compute their parameters' gradients in a backward
    written by hand. The forward of a custom ``autograd.Function`` runs without a graph, so
    the uses of the parameters inside it cannot be followed; before, a bias added or a norm's
    weight multiplied there was taken for a use gradhooks follows (as ``F.linear``'s bias is),
    its gradient never came, and grad1 was missing with a warning that no forward was
    captured (and the DP step refused). Those modules now go to the ``torch.func`` fallback,
    which recomputes them per example: grad1 of every parameter is the float64 loop's, at
    each of three AdamW steps (under bfloat16 autocast, with the Functions in float32 by
    ``custom_fwd``, within bfloat16's rounding: 5e-2 of the largest entry, as
    docs/mixed-precision.md)."""
    torch.manual_seed(0)
    dtype = torch.float32 if autocast else D
    model = FusedLM().to(dtype)
    with torch.no_grad():
        for norm in (model.norm1, model.norm2):
            norm.weight.add_(0.3 * torch.randn_like(norm.weight))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no warning that a gradient was not captured)
        with gradhooks.add_hooks(model):
            for step in range(3):
                x, y = tokens(g)
                want = loop_grad(copy.deepcopy(model).double(), token_ce, x, y)
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    out = model(x)
                token_ce(out, y).backward()
                if autocast:
                    err = relative_error(model, want)
                    assert err < 5e-2, f"step {step}: relative error {err:.3g}"
                else:
                    assert_grad1(model, want, f"step {step}")
                opt.step()


def test_fused_layers_in_the_dp_step():
    """The DP step over the same model (per-sequence losses): the norms are the float64
    loop's, and ``.grad`` the mean of the clipped per-example gradients (no noise)."""
    torch.manual_seed(0)
    model = FusedLM().to(D)
    g = torch.Generator().manual_seed(2)
    x, y = tokens(g)

    def seq_ce(out, t):
        return F.cross_entropy(out.flatten(0, 1), t.flatten(), reduction="sum") / t.shape[1]

    want = loop_grad(model, seq_ce, x, y)
    norms = torch.sqrt(sum(w.flatten(1).pow(2).sum(1) for w in want.values()))
    factors = (0.5 / norms).clamp(max=1.0)
    with gradhooks.add_hooks(model, quantities=("norms",)) as hooks:
        losses = F.cross_entropy(model(x).transpose(1, 2), y, reduction="none").mean(1)
        got = gradhooks.dp_sgd_step(hooks, losses, max_norm=0.5, noise_multiplier=0.0)
    torch.testing.assert_close(got, norms, rtol=1e-9, atol=1e-12)
    for n, p in model.named_parameters():
        clipped = (want[n] * factors.view(-1, *[1] * (want[n].dim() - 1))).mean(0)
        torch.testing.assert_close(p.grad, clipped, rtol=1e-9, atol=1e-12, msg=n)


class ScaledBlock(nn.Module):
    """A block with parameters of its own used directly (a module without a rule: the
    tracker follows ``* scale + shift``) around a Linear."""

    def __init__(self, dim: int = 6):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.scale, self.shift = nn.Parameter(torch.randn(dim)), nn.Parameter(torch.randn(dim))

    def forward(self, x):
        return torch.tanh(self.fc(x)) * self.scale + self.shift


class Checkpointed(nn.Module):
    """Megatron-LM's ``--recompute-granularity full`` in small: the block under
    ``torch.utils.checkpoint`` in training, its first forward without a graph, run again in
    the backward; a second head tied to the block's Linear, used by ``F.linear``."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(3, 6), ScaledBlock(), nn.Linear(6, 2)
        self.reentrant = reentrant

    def forward(self, x):
        h = self.inp(x)
        if self.training:
            h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=self.reentrant)
        else:
            h = self.block(h)
        return self.out(h) + F.linear(h, self.block.fc.weight[:2])


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_activation_checkpointing_of_a_block_using_its_parameters_directly(reentrant):
    """The forward without a graph of a custom Function (reentrant checkpointing) is not one
    whose parameters get their gradient from a hand-written backward: the block is run again
    with a graph in the backward, and followed there. grad1 is the float64 loop's (in eval
    mode, without checkpointing) at each of three SGD steps."""
    torch.manual_seed(0)
    model = Checkpointed(reentrant).to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(6)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = torch.randn(4, 3, generator=g, dtype=D), torch.randint(2, (4,), generator=g)
            model.eval()
            want = loop_grad(model, F.cross_entropy, x, y)
            model.train()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


class ReversibleFunction(torch.autograd.Function):
    """reformer_pytorch's / RevViT's reversible residual block ``y1 = x1 + f(x2)``,
    ``y2 = x2 + g(y1)``: the forward without a graph, keeping only the output; the backward
    rebuilds the inputs from it, runs ``g`` and ``f`` again with a graph and
    ``torch.autograd.backward`` through each (their parameters' ``.grad`` filled there)."""

    @staticmethod
    def forward(ctx, x, f, g):
        x1, x2 = x.chunk(2, -1)
        with torch.no_grad():
            y1 = x1 + f(x2)
            y2 = x2 + g(y1)
        y = torch.cat([y1, y2], -1)
        ctx.f, ctx.g = f, g
        ctx.save_for_backward(y.detach())
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        (y1, y2), (dy1, dy2) = y.chunk(2, -1), dy.chunk(2, -1)
        with torch.enable_grad():
            y1 = y1.detach().requires_grad_(True)
            gy1 = ctx.g(y1)
            torch.autograd.backward(gy1, dy2)
        with torch.no_grad():
            x2, dx1 = y2 - gy1, dy1 + y1.grad
        with torch.enable_grad():
            x2 = x2.detach().requires_grad_(True)
            torch.autograd.backward(ctx.f(x2), dx1)
        return torch.cat([dx1, dy2 + x2.grad], -1), None, None


class Reversible(nn.Module):
    """A reversible block between two Linears; in eval mode the same block run plainly."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(3, 8), nn.Linear(8, 2)
        self.f = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.g = nn.Sequential(nn.Linear(4, 4), nn.Tanh())

    def forward(self, x):
        h = self.inp(x)
        if self.training:
            h = ReversibleFunction.apply(h, self.f, self.g)
        else:
            x1, x2 = h.chunk(2, -1)
            y1 = x1 + self.f(x2)
            h = torch.cat([y1, x2 + self.g(y1)], -1)
        return self.out(h)


def test_reversible_residual_blocks_rebuilt_in_the_backward():
    """Reformer's / RevViT's memory-saving reversible layers: grad1 of the blocks' Linears,
    called only inside the custom backward, and of the layers around them is the float64
    loop's (the plain block, eval mode) at each of three SGD steps; then the DP step's norms
    (ghost and book-keeping methods, which also see the inner backwards) are the loop's."""
    torch.manual_seed(0)
    model = Reversible().to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(8)

    def reference(x, y):
        model.eval()
        try:
            return loop_grad(model, F.cross_entropy, x, y)
        finally:
            model.train()

    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = torch.randn(4, 3, generator=g, dtype=D), torch.randint(2, (4,), generator=g)
            want = reference(x, y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()
    gradhooks.clear_grad1(model)
    x, y = torch.randn(4, 3, generator=g, dtype=D), torch.randint(2, (4,), generator=g)
    norms = torch.sqrt(sum(w.flatten(1).pow(2).sum(1) for w in reference(x, y).values()))
    for method in ("ghost", "bookkeeping"):
        with gradhooks.add_hooks(model, quantities=("norms",)) as hooks:
            losses = F.cross_entropy(model(x), y, reduction="none")
            got = gradhooks.dp_sgd_step(
                hooks, losses, max_norm=0.3, noise_multiplier=0.0, method=method
            )
        torch.testing.assert_close(got, norms, rtol=1e-9, atol=1e-12, msg=method)


class BiasGeLUFunction(torch.autograd.Function):
    """Megatron-LM's ``bias_gelu_impl``: ``gelu(x + bias)`` in one kernel, the bias's
    gradient summed over every row by the hand-written backward."""

    @staticmethod
    def forward(ctx, x, bias):
        ctx.save_for_backward(x, bias)
        return F.gelu(x + bias)

    @staticmethod
    def backward(ctx, g):
        x, bias = ctx.saved_tensors
        with torch.enable_grad():
            z = (x + bias).detach().requires_grad_()
            (gz,) = torch.autograd.grad(F.gelu(z), z, g)
        return gz, gz.reshape(-1, gz.shape[-1]).sum(0)


class SkipBiasLinear(nn.Linear):
    """Megatron-LM's ``ColumnParallelLinear(skip_bias_add=True)``: returns the product and
    its bias, for the caller to fuse the bias into what follows."""

    def forward(self, x):
        return F.linear(x, self.weight), self.bias


class MegatronMLP(nn.Module):
    def __init__(self, fused: bool):
        super().__init__()
        self.up, self.down, self.fused = SkipBiasLinear(4, 8), nn.Linear(8, 4), fused

    def forward(self, x):
        h, bias = self.up(x)
        h = BiasGeLUFunction.apply(h, bias) if self.fused else F.gelu(h + bias)
        return self.down(h)


@pytest.mark.parametrize("fused", [False, True], ids=["bias added", "bias_gelu fused"])
def test_megatron_skip_bias_add_then_the_bias_fused_into_the_gelu(fused):
    """Megatron-LM's MLP: the first Linear skips its bias and hands it back; the MLP adds it
    (grad1 of every parameter the float64 loop's, over three SGD steps), or fuses it into
    ``bias_gelu_impl``, a custom Function whose backward sums the bias's gradient over the
    batch: that use of the bias, outside its module and without a graph, cannot be split
    by example. Before, its grad1 was missing with a warning that no forward was captured;
    now it is refused at the backward, naming the bias and the operation and saying what to
    do, with the weights as they were and no grad1 written."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), MegatronMLP(fused), nn.Linear(4, 2)).to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(9)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = torch.randn(4, 3, generator=g, dtype=D), torch.randint(2, (4,), generator=g)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            if fused:
                before = snapshot(model)
                message = (
                    r"'1\.up\.bias' is used outside its module's call.*'add' combines it with "
                    r"the batch where autograd records no graph.*or freeze it"
                )
                with pytest.raises(gradhooks.UnsupportedError, match=message):
                    F.cross_entropy(model(x), y).backward()
                assert not any(hasattr(p, "grad1") for p in model.parameters())
                assert_unchanged(model, before, "the refused backward")
                return
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


class FusedBlock(nn.Module):
    """A pre-norm residual block of Liger's RMSNorm and apex's FusedDense."""

    def __init__(self, dim: int = 6):
        super().__init__()
        self.norm, self.up, self.down = (
            LigerRMSNorm(dim),
            FusedDense(dim, 2 * dim),
            nn.Linear(2 * dim, dim),
        )
        with torch.no_grad():
            self.norm.weight.add_(0.3 * torch.randn(dim))

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


def _save_matmuls(ctx, op, *args, **kwargs):
    """torchtitan's selective activation checkpointing policy: keep the matrix products,
    recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    keep = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


class CheckpointedBlocks(nn.Module):
    """Two fused blocks, each under ``torch.utils.checkpoint`` in training: reentrant,
    non-reentrant, or non-reentrant with torchtitan's selective policy (``context_fn``)."""

    def __init__(self, how: str):
        super().__init__()
        self.inp, self.out = nn.Linear(3, 6), nn.Linear(6, 2)
        self.blocks = nn.ModuleList([FusedBlock(), FusedBlock()])
        self.how = how

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        h = self.inp(x)
        for block in self.blocks:
            if not self.training:
                h = block(h)
            elif self.how == "reentrant":
                h = checkpoint(block, h, use_reentrant=True)
            elif self.how == "non-reentrant":
                h = checkpoint(block, h, use_reentrant=False)
            else:
                context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
                h = checkpoint(block, h, use_reentrant=False, context_fn=context)
        return self.out(h)


@pytest.mark.parametrize("how", ["reentrant", "non-reentrant", "selective"])
def test_checkpointed_blocks_of_fused_custom_function_layers(how):
    """Blocks of fused custom-Function layers under activation checkpointing, as torchtitan
    and litgpt train large models (``--activation-checkpoint.mode selective``): the blocks'
    Functions run in the forward and again in the backward's recomputation. grad1 is the
    float64 loop's (eval mode, nothing checkpointed) at each of three AdamW steps."""
    torch.manual_seed(0)
    model = CheckpointedBlocks(how).to(D)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(13)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gradhooks.GradhooksWarning)
        with gradhooks.add_hooks(model):
            for step in range(3):
                x, y = torch.randn(4, 3, generator=g, dtype=D), torch.randint(2, (4,), generator=g)
                model.eval()
                want = loop_grad(model, F.cross_entropy, x, y)
                model.train()
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                assert_grad1(model, want, f"step {step}")
                opt.step()


# -- StyleGAN2-ADA: lazy R1 regularization every few steps -------------------------------------


def test_stylegan2_lazy_r1_regularization_refused_then_run_paused_as_advised():
    """stylegan2-ada-pytorch's ``StyleGAN2Loss``: the ``Dmain`` phase (``softplus`` of the
    fake and real logits, a batch of each) at every step; every ``D_reg_interval`` steps the
    ``Dreg`` phase: the real batch ``detach().requires_grad_()``, its logits' input-gradient
    by ``autograd.grad(create_graph=True)``, the R1 penalty ``‖∇x D(x)‖² · γ/2`` times the
    interval, backwarded on its own. grad1 of ``Dmain`` is each real/fake pair's own
    gradient, by the float64 loop. The R1 backward differentiates through the double
    backward: refused, naming the layer, ``h.paused()`` and torch.func, with grad1 and the
    weights as they were; run under ``h.paused()`` as the error says, it adds the penalty's
    gradient to ``.grad`` (autograd's, without hooks) and leaves grad1 that of ``Dmain``."""
    torch.manual_seed(0)
    disc = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).to(D)
    gen = nn.Sequential(nn.Linear(2, 3)).to(D)
    plain = copy.deepcopy(disc)  # (autograd's R1 gradient, without hooks)
    opt = torch.optim.Adam(disc.parameters(), lr=1e-2, betas=(0.0, 0.99))
    reg_interval, gamma = 2, 10.0
    g = torch.Generator().manual_seed(3)

    def r1_loss(model, real):
        real = real.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(model(real).sum(), real, create_graph=True)
        return (grad.square().sum(1) * (gamma / 2)).mean() * reg_interval

    with gradhooks.add_hooks(disc) as h:
        for step in range(4):
            real = torch.randn(4, 3, generator=g, dtype=D)
            with torch.no_grad():
                fake = gen(torch.randn(4, 2, generator=g, dtype=D))
            pairs = torch.stack([fake, real], 1)  # (example i: the pair it is trained on)

            def dmain(out, _=None):
                return (F.softplus(out[:, 0]) + F.softplus(-out[:, 1])).mean()

            want = loop_grad(disc, dmain, pairs)
            opt.zero_grad(set_to_none=True)
            (F.softplus(disc(fake)) + F.softplus(-disc(real))).mean().backward()
            assert_grad1(disc, want, f"step {step}, Dmain")
            if step % reg_interval == 0:
                before = snapshot(disc)
                with pytest.raises(gradhooks.UnsupportedError, match=r"paused.*torch\.func"):
                    r1_loss(disc, real).backward()
                assert_grad1(disc, want, f"step {step}, after the refused Dreg")
                assert_unchanged(disc, before, "the refused Dreg")
                opt.zero_grad(set_to_none=True)
                (F.softplus(disc(fake)) + F.softplus(-disc(real))).mean().backward()
                dmain_grad = {n: p.grad.clone() for n, p in disc.named_parameters()}
                with h.paused():
                    r1_loss(disc, real).backward()
                assert_grad1(disc, want, f"step {step}, after the paused Dreg")
                plain.load_state_dict(disc.state_dict())
                plain.zero_grad(set_to_none=True)
                r1_loss(plain, real).backward()
                for (n, p), q in zip(disc.named_parameters(), plain.parameters(), strict=True):
                    r1 = torch.zeros_like(p) if q.grad is None else q.grad  # (the last bias)
                    torch.testing.assert_close(p.grad, dmain_grad[n] + r1, msg=n)
            opt.step()


# -- a forward replaced on the module itself: Liger-Kernel's patches, accelerate's hooks ---------


def _masked_forward(self, x):
    """A sparse-training (or DropConnect) forward put on one ``nn.Linear``: its weight times a
    fixed 0/1 mask, the output scaled by 2: not what ``nn.Linear`` computes."""
    return F.linear(x, self.weight * self.mask, self.bias) * 2.0


class LayerNormFunction(torch.autograd.Function):
    """Liger-Kernel's ``LigerLayerNormFunction``: the layer norm and its affine part in one
    kernel, the backward written by hand."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        centred = x - x.mean(-1, keepdim=True)
        rstd = torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
        normed = centred * rstd
        ctx.save_for_backward(normed, rstd, weight)
        return normed * weight + bias

    @staticmethod
    def backward(ctx, g):
        normed, rstd, weight = ctx.saved_tensors
        rows = g.reshape(-1, g.shape[-1])
        g_normed = g * weight
        g_x = rstd * (
            g_normed
            - g_normed.mean(-1, keepdim=True)
            - normed * (g_normed * normed).mean(-1, keepdim=True)
        )
        return g_x, (rows * normed.reshape(rows.shape)).sum(0), rows.sum(0), None


def _layer_norm_function_forward(self, x):
    """Liger-Kernel's ``_patch_layer_norm_module``: an ``nn.LayerNorm``'s forward replaced by
    one through its fused Function (the same computation)."""
    return LayerNormFunction.apply(x, self.weight, self.bias, self.eps)


class MaskedLinear(nn.Linear):
    """A class put on a built ``nn.Linear`` by ``layer.__class__ = MaskedLinear`` (as
    quantization-aware and sparse-training code does): the masked forward."""

    forward = _masked_forward


def _patch(model: nn.Sequential, how: str) -> None:
    import types

    if how == "masked linear":
        layer = model[0]
        layer.mask = (
            torch.rand(layer.weight.shape, generator=torch.Generator().manual_seed(5)) > 0.5
        ).to(D)
        layer.forward = types.MethodType(_masked_forward, layer)
    elif how == "class swapped":
        layer = model[0]
        layer.mask = torch.ones_like(layer.weight).tril()
        layer.__class__ = MaskedLinear
    elif how == "liger layer norm":
        model[2].forward = types.MethodType(_layer_norm_function_forward, model[2])
    else:  # accelerate's hooks wrap the forward (the same computation)
        from accelerate.hooks import ModelHook, add_hook_to_module

        add_hook_to_module(model[0], ModelHook())


@pytest.mark.parametrize("when", ["before add_hooks", "at the third step"])
@pytest.mark.parametrize(
    "how", ["masked linear", "class swapped", "liger layer norm", "accelerate hook"]
)
def test_a_forward_replaced_on_the_module_itself(how, when):
    """``module.forward = MethodType(f, module)`` on one layer: Liger-Kernel's
    ``apply_liger_kernel_to_*(model=...)`` patches the norms of a built model so,
    ``accelerate.hooks.add_hook_to_module`` wraps a forward so, and sparse-training and
    DropConnect code put a masked forward on a layer. The layer then computes what that
    function does, not what its class's rule assumes: before, a masked Linear kept the
    Linear rule, refused by the run-time check where it ran, and silently wrong at the third
    backward, which the check does not run (grad1 without the mask and the factor 2); so was
    a Linear whose class was swapped for a subclass after ``add_hooks``. Now a module whose
    forward was replaced on it has no rule of its class (the fallback recomputes it), and
    the hooks are planned again where a forward is replaced or a class swapped after
    ``add_hooks``: grad1 is the float64 loop's at each of five SGD steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.LayerNorm(6), nn.Linear(6, 2)).to(D)
    with torch.no_grad():
        model[2].weight.add_(0.3 * torch.randn(6, dtype=D))
    if when == "before add_hooks":
        _patch(model, how)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(4)
    with gradhooks.add_hooks(model):
        for step in range(5):
            if step == 2 and when != "before add_hooks":
                _patch(model, how)
            x, y = torch.randn(4, 3, generator=g, dtype=D), torch.randint(2, (4,), generator=g)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


def test_a_forward_replaced_on_a_module_is_named_where_fallback_is_off():
    """With ``unsupported="error"`` such a layer is refused before anything is hooked, the
    message saying its forward was replaced (an ``nn.Linear`` without a rule would puzzle)."""
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.LayerNorm(6), nn.Linear(6, 2)).to(D)
    _patch(model, "masked linear")
    with pytest.raises(
        gradhooks.UnsupportedModuleError,
        match=r"'0' \(Linear, its forward replaced on the module\)",
    ):
        gradhooks.add_hooks(model, unsupported="error")
    assert not any(hasattr(p, "grad1") for p in model.parameters())


# -- Hugging Face's flash_attention_2 path: unpad by the mask, varlen attention, pad back -------


class VarlenAttention(nn.Module):
    """transformers' ``_flash_attention_forward`` on a padded batch, with torch's ops in
    place of flash-attn's kernels: ``_upad_input`` gathers the real tokens of every sequence
    from ``[batch * seq, heads, dim]`` by the mask's ``nonzero`` indices, the varlen kernel
    attends within each sequence of ``cu_seqlens`` (a causal SDPA per ``split``), and
    ``pad_input`` scatters the tokens back into zeros and reshapes to ``[batch, seq, ...]``."""

    def __init__(self, dim: int = 8, heads: int = 2, off_by: int = 0):
        super().__init__()
        self.qkv, self.o, self.heads = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), heads
        self.off_by = off_by  # (tokens moved from the second sequence to the first: a wrong split)

    def forward(self, x, mask):
        batch, seq, dim = x.shape
        indices = torch.nonzero(mask.flatten()).flatten()
        lengths = mask.sum(1).tolist()
        if self.off_by:
            lengths[0], lengths[1] = lengths[0] + self.off_by, lengths[1] - self.off_by
        q, k, v = (
            t.reshape(batch * seq, self.heads, dim // self.heads)[indices]
            for t in self.qkv(x).chunk(3, -1)
        )
        attended = torch.cat([
            F.scaled_dot_product_attention(
                qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), is_causal=True
            ).transpose(0, 1)
            for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True)
        ])  # fmt: skip
        out = torch.zeros(batch * seq, self.heads, dim // self.heads, dtype=attended.dtype)
        out[indices] = attended
        return self.o(out.reshape(batch, seq, dim))


class VarlenLM(nn.Module):
    def __init__(self, off_by: int = 0):
        super().__init__()
        self.emb, self.head = nn.Embedding(11, 8), nn.Linear(8, 11)
        self.attn = VarlenAttention(off_by=off_by)

    def forward(self, idx, mask):
        h = self.emb(idx)
        return self.head(h + self.attn(h, mask))


def test_flash_attention_2_unpad_varlen_pad_over_a_padded_batch():
    """A padded batch through the flash_attention_2 path (sequences of 6, 4, 6 and 2 real
    tokens, the padding's targets -100): grad1 is each sequence's own gradient, by the
    per-example loop (each sequence alone, with its own mask)."""
    torch.manual_seed(0)
    model = VarlenLM().to(D)
    idx, y = tokens(torch.Generator().manual_seed(7), length=6)
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    y = y.masked_fill(mask == 0, -100)

    def summed(out, t):
        return F.cross_entropy(out.flatten(0, 1), t.flatten(), ignore_index=-100, reduction="sum")

    want = loop_grad(model, summed, (idx, mask), y)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        summed(model(idx, mask), y).backward()
        assert_grad1(model, want, "the padded batch")


@pytest.mark.parametrize("off_by", [1, -1])
def test_flash_attention_2_unpad_varlen_split_across_two_sequences_is_refused(off_by):
    """The varlen path with the unpadded rows split by wrong lengths: one part holds tokens of
    two sequences, and attention along it mixes them; refused, never misread."""
    torch.manual_seed(0)
    model = VarlenLM(off_by).to(D)
    idx, y = tokens(torch.Generator().manual_seed(7), length=6)
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[1, 4:] = 0
    with gradhooks.add_hooks(model), pytest.raises(gradhooks.MixedExamplesError):
        F.cross_entropy(model(idx, mask).flatten(0, 1), y.flatten()).backward()


# -- litgpt's pretraining loop on Lightning Fabric: 16-mixed, no_backward_sync, chunked loss ----


class TinyGPT(nn.Module):
    """A one-block language model with its output layer tied to the embedding (nanoGPT,
    litgpt); ``forward(idx, targets)`` returns the logits and nanoGPT's loss."""

    def __init__(self, vocab: int = 11, dim: int = 8):
        super().__init__()
        self.wte, self.fc, self.ln = (
            nn.Embedding(vocab, dim),
            nn.Linear(dim, dim),
            nn.LayerNorm(dim),
        )
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx, targets=None):
        h = self.wte(idx)
        logits = self.head(self.ln(h + torch.tanh(self.fc(h))))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def chunked_cross_entropy(logits, targets, chunk_size: int = 2):
    """litgpt's ``chunked_cross_entropy``: the logits split along the sequence, each chunk's
    unreduced token losses, their sum over the count of targets not ignored."""
    losses = [
        F.cross_entropy(
            lc.reshape(-1, lc.shape[-1]), tc.reshape(-1), ignore_index=-100, reduction="none"
        )
        for lc, tc in zip(logits.split(chunk_size, 1), targets.split(chunk_size, 1), strict=True)
    ]
    return torch.cat(losses).sum() / (targets != -100).sum().clamp(min=1)


def test_litgpt_fabric_loop_16_mixed_no_backward_sync_and_a_chunked_loss():
    """litgpt's ``pretrain.fit``: Fabric with ``precision="16-mixed"`` (on a GPU a
    ``MixedPrecision`` plugin whose ``GradScaler`` ``fabric.backward`` scales the loss by;
    on the CPU, given explicitly), two micro-batches per step under
    ``fabric.no_backward_sync(model, enabled=is_accumulating)``, ``fabric.backward(loss /
    accum)`` of ``chunked_cross_entropy`` (targets partly -100), ``fabric.clip_gradients``
    and the step. As for any ``GradScaler``, grad1 is the scale ``S`` (the plugin's
    ``scaler.get_scale()`` before the step) times the per-example gradients, summed over the
    micro-batches: ``grad1 / S`` is the float64 loop's within float16's rounding (1e-2 of
    the largest entry, docs/mixed-precision.md), at each micro-batch of three steps."""
    from lightning.fabric import Fabric
    from lightning.fabric.plugins.precision import MixedPrecision

    torch.manual_seed(0)
    model = TinyGPT()
    plugin = MixedPrecision(precision="16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu"))
    fabric = Fabric(accelerator="cpu", devices=1, plugins=plugin)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (Fabric's notes about the CPU)
        wrapped, opt = fabric.setup(model, opt)
    accum, want = 2, {}
    g = torch.Generator().manual_seed(10)
    with gradhooks.add_hooks(wrapped, loss_reduction="sum"):
        for it in range(3 * accum):
            x, y = tokens(g)
            y[it % 4, 3:] = -100
            is_accumulating = (it + 1) % accum != 0
            count = (y != -100).sum()

            def loss(out, t, count=count):
                ce = F.cross_entropy(
                    out.flatten(0, 1), t.flatten(), ignore_index=-100, reduction="sum"
                )
                return ce / count / accum

            mine = loop_grad(copy.deepcopy(model).double(), loss, x, y)
            if it % accum == 0:
                want = {}
            want = {n: want[n] + mine[n] if want else mine[n] for n in mine}
            scale = plugin.scaler.get_scale()
            with fabric.no_backward_sync(wrapped, enabled=is_accumulating):
                logits = wrapped(x)
                fabric.backward(chunked_cross_entropy(logits, y) / accum)
            err = relative_error(model, want, scale)
            assert err < 1e-2, f"micro-batch {it}: relative error {err:.3g}"
            if not is_accumulating:
                fabric.clip_gradients(wrapped, opt, max_norm=1.0)
                opt.step()
                opt.zero_grad()


# -- nanoGPT's train.py: compiled, float16 autocast, GradScaler, accumulation, clipping ---------


def test_nanogpt_compiled_float16_grad_scaler_with_accumulation_and_clipping():
    """nanoGPT's ``train.py`` with ``dtype='float16'``: ``model = torch.compile(model)``, the
    loss from the model under ``torch.autocast``, divided by the accumulation steps,
    ``scaler.scale(loss).backward()`` per micro-step (the next batch fetched in between),
    then ``scaler.unscale_``, ``clip_grad_norm_``, ``scaler.step``, ``scaler.update`` and
    ``zero_grad(set_to_none=True)``. ``grad1 / scaler.get_scale()`` is the float64 loop's
    (summed over the micro-steps) within float16's 1e-2, at every micro-step of three steps;
    ``clip_grad_norm_`` after ``unscale_`` leaves grad1 alone."""
    torch.manual_seed(0)
    raw = TinyGPT()
    opt = torch.optim.AdamW(raw.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu")
    accum, want = 2, {}
    g = torch.Generator().manual_seed(11)
    with gradhooks.add_hooks(raw):
        model = torch.compile(raw)
        x, y = tokens(g)
        for step in range(3):
            for micro in range(accum):
                with torch.autocast("cpu", dtype=torch.float16):
                    _, loss = model(x, y)
                    loss = loss / accum
                mine = loop_grad(
                    copy.deepcopy(raw).double(), lambda out, t: token_ce(out, t) / accum, x, y
                )
                x, y = tokens(g)  # (prefetched while the backward runs, on a GPU)
                if micro == 0:
                    want = {}
                want = {n: want[n] + mine[n] if want else mine[n] for n in mine}
                scale = scaler.get_scale()
                scaler.scale(loss).backward()
                err = relative_error(raw, want, scale)
                assert err < 1e-2, f"step {step}, micro-step {micro}: relative error {err:.3g}"
            kept = {n: p.grad1.clone() for n, p in raw.named_parameters()}
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(raw.parameters(), 0.01)
            for n, p in raw.named_parameters():
                assert torch.equal(p.grad1, kept[n]), f"{n}: clipping changed grad1"
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)


# -- CUDA graphs' static buffers: one input tensor, refilled in place at every step -----------


def test_static_input_buffers_refilled_in_place_at_every_step():
    """The "whole network capture" recipe of torch's CUDA graphs notes, without the graph:
    ``static_input.copy_(data)`` and ``static_target.copy_(target)`` before each step, the
    forward on the same tensors every time, ``zero_grad(set_to_none=True)``. grad1 is each
    step's own batch's, by the float64 loop, at each of four steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    static_x, static_y = torch.zeros(4, 3, dtype=D), torch.zeros(4, dtype=torch.long)
    g = torch.Generator().manual_seed(12)
    with gradhooks.add_hooks(model):
        for step in range(4):
            x, y = torch.randn(4, 3, generator=g, dtype=D), torch.randint(2, (4,), generator=g)
            static_x.copy_(x)
            static_y.copy_(y)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(static_x), static_y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


# -- PEFT's DoRA: a magnitude vector over the weight's column norms, detached ----------------


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(6, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(x)))


def test_peft_dora_adapter_trained_and_in_the_dp_step():
    """PEFT's DoRA (``LoraConfig(use_dora=True)``), the recipe for fine-tuning in little GPU
    memory: beside ``lora_A``/``lora_B``, a ``lora_magnitude_vector`` scales the output by
    ``magnitude / ‖W + s·B·A‖`` (the norm detached, as the paper says), which reads the
    adapter's weights outside their modules' calls. grad1 of the three trainable parameters
    is the float64 loop's at each of three AdamW steps, and the DP step's norms are."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(
        r=2, lora_alpha=4, target_modules=["fc"], use_dora=True, init_lora_weights=False
    )
    model = get_peft_model(TwoLayer(), config).to(D)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == 3
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    g = torch.Generator().manual_seed(14)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = torch.randn(4, 6, generator=g, dtype=D), torch.randint(2, (4,), generator=g)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}", frozen_clean=True)
            opt.step()
    gradhooks.clear_grad1(model)
    x, y = torch.randn(4, 6, generator=g, dtype=D), torch.randint(2, (4,), generator=g)
    want = loop_grad(model, F.cross_entropy, x, y)
    norms = torch.sqrt(sum(w.flatten(1).pow(2).sum(1) for w in want.values()))
    with gradhooks.add_hooks(model, quantities=("norms",)) as hooks:
        losses = F.cross_entropy(model(x), y, reduction="none")
        got = gradhooks.dp_sgd_step(hooks, losses, max_norm=0.1, noise_multiplier=0.0)
    torch.testing.assert_close(got, norms, rtol=1e-9, atol=1e-12)


# -- Liger-Kernel's apply_liger_kernel_to_llama(model=...) on a Hugging Face Llama ---------------


def _liger_rms_norm_forward(self, hidden_states):
    """Liger's ``LigerRMSNorm.forward`` as ``_patch_rms_norm_module`` puts it on each
    ``LlamaRMSNorm`` of a built model."""
    return RMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon)


def test_liger_kernel_patches_the_rms_norms_of_a_built_llama():
    """``apply_liger_kernel_to_llama(model=model)`` replaces the forward of every
    ``LlamaRMSNorm`` instance of a built tiny Llama (two layers, grouped-query attention)
    by Liger's fused Function. Before, the norms' weights, used inside that Function, had
    no grad1 and a warning said no forward was captured; grad1 of every parameter is now
    the float64 loop's at each of two AdamW steps."""
    import types

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=50, max_position_embeddings=32,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(D)
    norms = [m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert len(norms) == 5
    for norm in norms:
        norm.forward = types.MethodType(_liger_rms_norm_forward, norm)
        with torch.no_grad():
            norm.weight.add_(0.2 * torch.randn_like(norm.weight))

    def next_token(out, ids):
        return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(15)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gradhooks.GradhooksWarning)
        with gradhooks.add_hooks(model):
            for step in range(2):
                ids = torch.randint(50, (3, 7), generator=g)
                want = loop_grad(model, next_token, ids, ids)
                opt.zero_grad()
                next_token(model(ids), ids).backward()
                assert_grad1(model, want, f"step {step}", rtol=1e-9, atol=1e-12)
                opt.step()


# -- a running statistic kept in a buffer under no_grad, by a layer without a rule --------------


class MonitoredScale(nn.Module):
    """A learned per-feature scale that keeps, under ``no_grad``, a running mean of the
    square of what it outputs (as activation monitors and AutoClip-style statistics do),
    or of its input times the scale's magnitude."""

    def __init__(self, dim: int, statistic: str):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(dim))
        self.register_buffer("running", torch.zeros(dim))
        self.statistic = statistic

    def observed(self, x):
        scale = self.scale if self.statistic == "of its output" else self.scale.abs()
        return (x * scale).pow(2).mean(0)

    def forward(self, x):
        with torch.no_grad():
            self.running.mul_(0.9).add_(0.1 * self.observed(x))
        return x * self.scale


@pytest.mark.parametrize("statistic", ["of its output", "with the scale's magnitude"])
def test_a_running_statistic_updated_once_per_forward_by_a_layer_the_fallback_recomputes(
    statistic,
):
    """The parameter used under ``no_grad`` with the batch sends the layer to the
    ``torch.func`` fallback, which recomputes it one example at a time (``torch.func``
    cannot update one buffer from a batch of examples). That loop ran the layer's forward
    on its live buffers: the running statistic was updated once more per example, silently
    (five updates in place of one, with four examples). It now starts each recomputation from copies of the
    buffers as the call found them, as the vmapped path did: the buffer is updated once per
    forward, as without hooks, and grad1 is the float64 loop's, at each of three steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), MonitoredScale(5, statistic), nn.Tanh(), nn.Linear(5, 2))
    model = model.to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(16)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = torch.randn(4, 3, generator=g, dtype=D), torch.randint(2, (4,), generator=g)
            plain = copy.deepcopy(model)  # (the loop runs its forwards on a copy)
            want = loop_grad(plain, F.cross_entropy, x, y)
            with torch.no_grad():
                running = 0.9 * model[1].running + 0.1 * model[1].observed(model[0](x))
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            torch.testing.assert_close(model[1].running, running, msg=f"step {step}")
            opt.step()

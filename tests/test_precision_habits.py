"""How GPU users train, on the CPU: the precision and optimizer habits of mixed-precision loops.

Each test runs several steps of an ordinary loop (``zero_grad``, a forward, a backward or
gradhooks' DP step, an optimizer's step) with a habit the earlier sets do not run: a model cast
whole to float16 whose loss is scaled by hand, so that its examples' squared gradient norms pass
float16's range (65504), read as ``("norms",)``, ``sum_grad_sq`` and the noise scale; the DP step
(``grad1``, ghost and book-keeping) of a model cast to float16 or bfloat16 whose float32 master
weights are stepped and copied back; autocast entered only around a loss that has a matrix product
of its own; a float32 island (``autocast(enabled=False)`` and ``.float()``) around a softmax and a
norm inside a float16 forward, under a ``GradScaler`` whose scale grows every step and backs off
after the steps it skips, and the DP step through them with the scaler; ``scaler.unscale_`` then
``clip_grad_norm_``, with the per-example norms divided by the scale; the K-FAC factors of a scaled
float16 backward (``G`` divided by the square of the scale); the optimizers picked on GPUs over
bfloat16 parameters (``AdamW(fused=True)``, ``foreach=True``, ``Adafactor``, a Lion written in
plain torch, each behind a linear warm-up); ``zero_grad(set_to_none=False)`` keeping bfloat16 zeros
in ``.grad`` over micro-batches; the DP step of a bfloat16 model whose ``.grad`` are views of one
flat buffer stepped by a float32 master; :class:`gradhooks.KFAC` over bfloat16 parameters against
its float64 twin; ``torch.use_deterministic_algorithms(True)`` around a hooked DP step; the DP
step's noise, of its scale in every precision (parameters in float16 or bfloat16, autocast with or
without a scaler); and float8 training simulated in plain torch (torchao's ``Float8Linear``), its
inputs rounded by each example's scale, and refused, naming the layer and the ``amax``, where one
scale of the whole batch makes each example's output depend on the others'.

Every ``grad1`` (and norm, squared sum, K-FAC factor, clipped sum) is compared at every step
with each example's own gradient by the per-example loop in float64
(:func:`gradhooks.oracle.loop_grad`) at that step's weights, divided by the scale where the loss
was scaled (its square for the second-order quantities), within the rounding of the precision
the step ran in: ``5e-2`` of the largest entry for bfloat16 (8 significant bits), ``1e-2`` for
float16 (11), as ``docs/mixed-precision.md`` states.

Found and fixed: the DP step (``dp_sgd_step``, :class:`gradhooks.DPOptimizer`, and across ranks)
set each ``.grad`` to a new tensor, where autograd's backward adds into the ``.grad`` that is
there. A loop whose ``.grad`` are views of one flat buffer (Megatron's and DeepSpeed's contiguous
gradients, float32 master weights stepped from one flat tensor) then stepped on the buffer's zeros,
in silence; the step now writes into a ``.grad`` that is there. No other wrong number or false
refusal was found: the norms, squared sums, noise scale and K-FAC factors of float16 parameters are
formed in float32, and stay finite and right where their float16 squares would overflow.
``torch.optim.Adam(capturable=True)`` is refused by torch itself on the CPU (it wants an
accelerator), and is not run.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import one_thread  # noqa: F401 (autouse in this module)

D = torch.float64
BF16, FP16 = 5e-2, 1e-2  # the rounding allowed: of the largest entry
TOL = {torch.bfloat16: BF16, torch.float16: FP16}
STEPS = 3


def batch(step: int, n: int = 6, features: int = 4, classes: int = 3, spread: float = 1.0):
    """``n`` float32 examples and their labels, drawn from a generator seeded with ``step``."""
    g = torch.Generator().manual_seed(200 + step)
    x = spread * torch.randn(n, features, generator=g)
    return x, torch.randint(classes, (n,), generator=g)


def ce(out, y):
    return F.cross_entropy(out.float(), y)


def near(got: torch.Tensor, want: torch.Tensor, rel: float, what: str) -> None:
    """``got`` within ``rel`` of ``want``'s largest entry (and of the same shape)."""
    assert got.shape == want.shape, f"{what}: {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got).all(), f"{what}: not finite"
    scale = want.abs().max().item()
    err = (got.double() - want.double()).abs().max().item()
    assert err <= rel * max(scale, 1e-12), f"{what}: {err:.3e} off, largest {scale:.3e}"


def loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss=ce) -> dict:
    """Each example's own gradient at ``model``'s weights now, by the float64 loop, of the
    inputs as the model sees them (``x`` already in the model's dtype where it is cast)."""
    return loop_grad(copy.deepcopy(model).to(D), loss, (x.double(),), y)


def flat(grads: dict) -> torch.Tensor:
    """The per-example gradients of every parameter side by side, ``[batch, all]``."""
    return torch.cat([g.flatten(1) for g in grads.values()], 1)


def clipped_mean(grads: dict, max_norm: float) -> dict:
    """``Σ_i min(1, C / ‖g_i‖) g_i / B`` per parameter, from the loop's gradients."""
    factors = (max_norm / flat(grads).norm(dim=1)).clamp(max=1)
    return {n: torch.einsum("b,b...->...", factors, g) / len(factors) for n, g in grads.items()}


class Net(nn.Module):
    """Linear-Tanh-Linear-Tanh (4 -> 8 -> 8) and a head (8 -> 3)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.body(x))


class Masters:
    """float32 master copies of a half-precision model's parameters (apex's O2, fairseq's
    ``--fp16``, Megatron's ``fp32 master``): ``.grad`` copied up, stepped, copied back."""

    def __init__(self, model: nn.Module, make_optimizer) -> None:
        self.pairs = [
            (p, p.detach().float().clone().requires_grad_(True)) for p in model.parameters()
        ]
        self.optimizer = make_optimizer([m for _, m in self.pairs])

    def step(self, unscale: float = 1.0) -> None:
        for p, m in self.pairs:
            m.grad = None if p.grad is None else p.grad.float() / unscale
        self.optimizer.step()
        with torch.no_grad():
            for p, m in self.pairs:
                p.copy_(m)


# -- parameters in half precision ------------------------------------------------------------


def test_a_float16_model_whose_scaled_squared_norms_pass_float16s_range():
    """The model cast by ``.half()``, float32 master weights, the loss scaled by hand by
    ``2**12`` (apex's static scale): each example's scaled gradient norm is in the thousands,
    its square past 65504. ``grad1`` is in float16 (as ``.grad``); the per-example norms, the
    whole model's, ``sum_grad_sq`` and the noise scale are formed in float32, finite, and
    divided by the scale (its square) they are the loop's, at every step."""
    scale = 2.0**12
    model = Net().half()
    masters = Masters(model, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
    quantities = ("grad1", "norms", "sum_grad_sq")
    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=quantities) as h:
        for step in range(STEPS):
            x, y = batch(step, spread=3.0)
            x = x.half()
            want = loop(model, x, y)
            model.zero_grad()
            (F.cross_entropy(model(x).float(), y, reduction="sum") * scale).backward()
            norms = flat(want).norm(dim=1)
            assert (norms * scale).square().max() > 65504, "the squares must pass float16's range"
            for n, p in model.named_parameters():
                assert p.grad1.dtype == torch.float16
                near(p.grad1 / scale, want[n], FP16, f"step {step}: {n}")
                near(h.param_norms()[n] / scale, want[n].flatten(1).norm(dim=1), FP16, n)
                near(h.sum_grad_sq()[n] / scale**2, want[n].square().sum(0), FP16, n)
            assert h.norms().dtype == torch.float32
            near(h.norms() / scale, norms, FP16, f"step {step}: whole-model norms")
            noise = h.noise_scale()
            b, g = len(y), flat(want)
            trace = b / (b - 1) * (g.square().sum(1).mean() - g.mean(0).square().sum())
            near(noise.trace / scale**2, trace, FP16, f"step {step}: tr(Σ)")
            masters.step(unscale=scale)
    assert all(p.dtype == torch.float16 for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_the_dp_step_of_a_half_model_with_float32_master_weights(dtype, method):
    """The DP step of a model cast whole to float16 or bfloat16 (no autocast), by each method,
    without noise: ``.grad`` is written in the parameters' dtype, each example clipped to the
    median norm, and is the loop's clipped mean; the returned norms are the loop's. The
    float32 masters step by AdamW and are copied back into the half model."""
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.LayerNorm(16), nn.Linear(16, 3))
    model.to(dtype)
    masters = Masters(model, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        for step in range(STEPS):
            x, y = batch(step, spread=2.0)
            x = x.to(dtype)
            want = loop(model, x, y)
            max_norm = flat(want).norm(dim=1).median().item()
            model.zero_grad(set_to_none=False)  # half-precision zeros kept in .grad
            losses = F.cross_entropy(model(x).float(), y, reduction="none")
            norms = gradhooks.dp_sgd_step(
                h, losses, max_norm=max_norm, noise_multiplier=0.0, method=method
            )
            near(norms, flat(want).norm(dim=1), TOL[dtype], f"step {step}: norms")
            clipped = clipped_mean(want, max_norm)
            for n, p in model.named_parameters():
                assert p.grad.dtype == dtype, n
                near(p.grad, clipped[n], TOL[dtype], f"step {step}: {n}")
            masters.step()


SETTINGS = {  # the parameters' dtype, autocast's, and the scaler's first scale
    "fp16-params": (torch.float16, None, None),
    "bf16-params": (torch.bfloat16, None, None),
    "fp16-autocast-scaler": (torch.float32, torch.float16, 2.0**8),
    "bf16-autocast": (torch.float32, torch.bfloat16, None),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_the_dp_steps_noise_has_its_scale_in_every_precision(setting):
    """The noised DP step (``σ = 2``, ``C = 1``) of a model of 8,515 parameters in each
    precision, over two SGD steps: ``.grad`` times the batch (divided by the scale where a
    scaler scaled it) less the loop's clipped sum is the noise, whose standard deviation is
    ``σ·C`` within 5% and whose mean is within four of its standard errors of zero: the noise
    is neither rounded away, nor scaled twice, nor left scaled by the scaler."""
    dtype, autocast, init_scale = SETTINGS[setting]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
    model.append(nn.Linear(64, 3)).to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale) if init_scale else None
    generator = torch.Generator().manual_seed(1234)
    sigma, max_norm = 2.0, 1.0
    with gradhooks.add_hooks(model) as h:
        for step in range(2):
            x, y = batch(step, n=8, features=64)
            x = x.to(dtype)
            want = loop(model, x, y)
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=bool(autocast)):
                logits = model(x)
            losses = F.cross_entropy(logits.float(), y, reduction="none")
            scale = scaler.get_scale() if scaler else 1.0
            step_kwargs = {"noise_multiplier": sigma, "generator": generator, "scaler": scaler}
            gradhooks.dp_sgd_step(h, losses, max_norm=max_norm, **step_kwargs)
            clipped = clipped_mean(want, max_norm)
            grads = {n: p.grad.double() / scale for n, p in model.named_parameters()}
            noise = flat({n: (g - clipped[n])[None] for n, g in grads.items()})[0] * len(y)
            assert abs(noise.std() / (sigma * max_norm) - 1) < 0.05, (step, noise.std())
            assert abs(noise.mean()) < 4 * sigma * max_norm / len(noise) ** 0.5, step
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()


class FlatMaster(torch.optim.Optimizer):
    """Megatron's and DeepSpeed's contiguous gradients in one process: every parameter's
    ``.grad`` a view of one flat buffer in the parameters' dtype (kept by ``zero_grad``, which
    zeroes it), one flat float32 master stepped by AdamW from it, copied back into the
    parameters."""

    def __init__(self, params, lr: float) -> None:
        params = list(params)
        super().__init__(params, {"lr": lr})
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype)
        self.master = torch.cat([p.detach().float().flatten() for p in params])
        self.master.requires_grad_(True)
        self.inner = torch.optim.AdamW([self.master], lr=lr)
        for p, view in zip(params, self._views(self.buffer)):
            p.grad = view

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        params = self.param_groups[0]["params"]
        return [v.view_as(p) for p, v in zip(params, flat.split([p.numel() for p in params]))]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.buffer.zero_()

    @torch.no_grad()
    def step(self, closure=None):
        self.master.grad = self.buffer.float()
        self.inner.step()
        for p, view in zip(self.param_groups[0]["params"], self._views(self.master)):
            p.copy_(view)


@pytest.mark.parametrize("writer", ["grad1", "ghost", "dp-optimizer"])
def test_the_dp_step_into_a_flat_gradient_buffer_of_a_bfloat16_model(writer):
    """A bfloat16 model whose ``.grad`` are views of one flat buffer, stepped from it by a
    float32 master (:class:`FlatMaster`), trained by ``dp_sgd_step`` (``grad1``, ghost) or
    :class:`gradhooks.DPOptimizer` without noise: after each step the buffer holds the loop's
    clipped mean, and each ``.grad`` is still its view. The DP step used to set ``.grad`` to a
    new tensor, where autograd's backward adds into the one there: the buffer kept its zeros,
    and the master stepped on nothing, in silence."""
    model = Net().to(torch.bfloat16)
    optimizer = FlatMaster(model.parameters(), lr=1e-2)
    views = [p.grad for p in model.parameters()]
    quantities = ("norms",) if writer == "ghost" else ("grad1",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        if writer == "dp-optimizer":
            dp = gradhooks.DPOptimizer(
                optimizer, h, max_grad_norm=0.1, noise_multiplier=0.0, expected_batch_size=6
            )
        for step in range(STEPS):
            x, y = batch(step)
            x = x.bfloat16()
            want = loop(model, x, y)
            max_norm = flat(want).norm(dim=1).median().item()
            optimizer.zero_grad()
            losses = F.cross_entropy(model(x).float(), y, reduction="none")
            if writer == "dp-optimizer":
                dp.max_grad_norm = max_norm
                dp.backward(losses)
                dp.step()  # (the wrapped FlatMaster steps from the buffer)
            else:
                gradhooks.dp_sgd_step(h, losses, max_norm=max_norm, noise_multiplier=0.0)
            assert all(p.grad is v for p, v in zip(model.parameters(), views)), step
            clipped = clipped_mean(want, max_norm)
            near(
                optimizer.buffer, flat({n: c[None] for n, c in clipped.items()})[0], BF16, "buffer"
            )
            if writer != "dp-optimizer":
                optimizer.step()


# -- autocast where the loop puts it ----------------------------------------------------------


def test_autocast_entered_only_around_the_loss():
    """The forward in float32, autocast (bfloat16) around the loss alone, a loss with a matrix
    product of its own (logits against fixed class prototypes, then a temperature): the
    model's output-gradients come back through a bfloat16 product. ``grad1`` is in float32,
    within bfloat16's rounding of the loop's."""
    torch.manual_seed(1)
    prototypes = F.normalize(torch.randn(5, 3), dim=1)

    def loss_fn(out, y):
        return F.cross_entropy((out @ prototypes.to(out.dtype).t()).float() / 0.5, y)

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, _ = batch(step)
            y = torch.arange(len(x)) % 5
            want = loop(model, x, y, loss_fn)
            optimizer.zero_grad()
            out = model(x)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(out, y)
            loss.backward()
            for n, p in model.named_parameters():
                assert p.grad1.dtype == torch.float32
                near(p.grad1, want[n], BF16, f"step {step}: {n}")
                near(p.grad1.mean(0), p.grad, BF16, f"step {step}: {n} vs .grad")
            optimizer.step()


class Islands(nn.Module):
    """A float16 body with two float32 islands inside its forward: a LayerNorm and a softmax
    over the features, each under ``autocast(enabled=False)`` on inputs cast up to
    ``upcast`` (``.float()``; float64 in the loop's copy)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.upcast = torch.float32
        self.inp = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        with torch.autocast("cpu", enabled=False):
            h = self.norm(h.to(self.upcast))
        h = self.mid(h)
        with torch.autocast("cpu", enabled=False):
            h = torch.softmax(h.to(self.upcast), dim=-1) * 8
        return self.head(h)


def test_float32_islands_under_a_scaler_that_grows_and_backs_off():
    """float16 autocast with the two islands, ``GradScaler(init_scale=2**20,
    growth_interval=1)``: the scale doubles after each finite step and halves after each
    step it skips (its scaled gradients overflow float16). On the steps taken, ``grad1``
    divided by the scale the backward ran with is the loop's (the islands' LayerNorm in
    float32); on the skipped ones the weights do not move."""
    model = Islands()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=1)
    taken = skipped = 0
    with gradhooks.add_hooks(model):
        for step in range(6):
            x, y = batch(step)
            twin = copy.deepcopy(model).to(D)
            twin.upcast = D
            want = loop_grad(twin, ce, (x.double(),), y)
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = ce(model(x), y)
            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            finite = all(torch.isfinite(p.grad1).all() for p in model.parameters())
            if finite:
                for n, p in model.named_parameters():
                    assert p.grad1.dtype == torch.float32
                    near(p.grad1 / scale, want[n], FP16, f"step {step} (scale {scale:g}): {n}")
            scaler.step(optimizer)
            scaler.update()
            moved = any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
            if scaler.get_scale() < scale:
                skipped += 1
                assert not moved, f"step {step}: a skipped step moved the weights"
            else:
                taken += 1
                assert finite and moved and scaler.get_scale() == 2 * scale, step
    assert skipped and taken, (skipped, taken)


@pytest.mark.parametrize("method", ["grad1", "bookkeeping"])
def test_the_dp_step_through_float32_islands_and_a_growing_scale(method):
    """``dp_sgd_step(..., scaler=scaler)`` of the model with the two float32 islands under
    float16 autocast, the scale growing every step from ``2**14``: on each step, ``.grad``
    unscaled by the scaler's step is the loop's clipped mean (no noise), the returned norms
    the loop's norms, and the scale doubles."""
    model = Islands()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**14, growth_interval=1)
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        for step in range(STEPS):
            x, y = batch(step)
            twin = copy.deepcopy(model).to(D)
            twin.upcast = D
            want = loop_grad(twin, ce, (x.double(),), y)
            max_norm = 0.5 * flat(want).norm(dim=1).median().item()
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(x)
            losses = F.cross_entropy(logits.float(), y, reduction="none")
            scale = scaler.get_scale()
            norms = gradhooks.dp_sgd_step(
                h, losses, max_norm=max_norm, noise_multiplier=0.0, scaler=scaler, method=method
            )
            near(norms, flat(want).norm(dim=1), FP16, f"step {step}: norms")
            clipped = clipped_mean(want, max_norm)
            for n, p in model.named_parameters():
                near(p.grad / scale, clipped[n], FP16, f"step {step}: {n}")
            scaler.step(optimizer)
            scaler.update()
            assert scaler.get_scale() == 2 * scale, step


def test_unscale_then_clip_grad_norm_with_the_norms_divided_by_the_scale():
    """``scaler.unscale_(optimizer)`` then ``clip_grad_norm_``, with ``("grad1", "norms")``:
    ``unscale_`` divides ``.grad`` alone; the whole model's per-example norms of the handle,
    divided by the scale, are the loop's, and so is the norm ``clip_grad_norm_`` returns (of
    the batch's mean gradient) at every step."""
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for step in range(STEPS):
            x, y = batch(step)
            want = loop(model, x, y)
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = ce(model(x), y)
            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
            near(total, flat(want).mean(0).norm(), FP16, f"step {step}: clip_grad_norm_")
            near(h.norms() / scale, flat(want).norm(dim=1), FP16, f"step {step}: norms")
            for n, p in model.named_parameters():
                near(p.grad1 / scale, want[n], FP16, f"step {step}: {n}")
            scaler.step(optimizer)
            scaler.update()


def test_kfac_factors_of_a_scaled_float16_backward():
    """``add_hooks(quantities=("grad1", "kfac"))`` under float16 autocast and a
    ``GradScaler``, cleared each step: each Linear's ``A`` is its inputs' second moment (with
    the bias column), and ``G`` divided by the square of the scale is ``Σ_i δ_i δ_iᵀ`` of each
    example's own output-gradient, read off the loop's bias gradient."""
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    inputs_of = {"body.0.weight": lambda m, x: x, "body.2.weight": lambda m, x: m.body[:2](x)}
    inputs_of["head.weight"] = lambda m, x: m.body(x)
    with gradhooks.add_hooks(model, quantities=("grad1", "kfac")) as h:
        for step in range(STEPS):
            x, y = batch(step)
            want = loop(model, x, y)
            m64 = copy.deepcopy(model).to(D)
            h.clear()
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = ce(model(x), y)
            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            factors = h.kfac_factors("sum")
            assert set(factors) == set(inputs_of)
            for name, f in factors.items():
                a = inputs_of[name](m64, x.double())
                a = torch.cat([a, torch.ones(len(a), 1, dtype=D)], 1) if f.bias else a
                delta = want[name.replace("weight", "bias")]
                assert f.A.dtype == f.G.dtype == torch.float32
                near(f.A, a.t() @ a / len(a), FP16, f"step {step}: {name} A")
                near(f.G / scale**2, delta.t() @ delta, FP16, f"step {step}: {name} G")
            scaler.step(optimizer)
            scaler.update()


def test_noise_scale_and_gradient_variance_under_bfloat16_autocast():
    """``("sum_grad_sq",)`` under bfloat16 autocast over Adam steps: ``sum_grad_sq``, the
    per-example gradient variance and the noise scale's ``tr(Σ)`` and ``|G|²`` (float64) are
    the loop's, at the weights of each step."""
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with gradhooks.add_hooks(model, quantities=("grad1", "sum_grad_sq")) as h:
        for step in range(STEPS):
            x, y = batch(step, n=8)
            want = loop(model, x, y)
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = ce(model(x), y)
            loss.backward()
            for n, g in want.items():
                near(h.sum_grad_sq()[n], g.square().sum(0), BF16, f"step {step}: {n} Σg²")
                variance = g.square().mean(0) - g.mean(0).square()
                near(h.grad_variance()[n], variance, BF16, f"step {step}: {n} variance")
            g, b = flat(want), len(y)
            mean_sq, bar_sq = g.square().sum(1).mean(), g.mean(0).square().sum()
            trace = b / (b - 1) * (mean_sq - bar_sq)
            noise = h.noise_scale()
            assert noise.trace.dtype == torch.float64
            near(noise.trace, trace, BF16, f"step {step}: tr(Σ)")
            # |G|² is a difference of terms of mean_sq's size: held to their rounding
            assert abs(noise.grad_sq - (bar_sq - trace / b)) <= BF16 * mean_sq, step
            optimizer.step()


# -- optimizers picked on GPUs ----------------------------------------------------------------


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al., 2023) as repositories write it in plain torch: the sign of an
    interpolation of the momentum and the gradient, decoupled weight decay."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = exp_avg.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)


OPTIMIZERS = {
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
    "lion": lambda ps: Lion(ps, lr=1e-3, weight_decay=0.1),
    "sgd-nesterov-foreach": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, nesterov=True, foreach=True
    ),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("masters", [False, True], ids=["bf16-params", "fp32-masters"])
def test_gpu_optimizers_over_bfloat16_parameters_behind_a_warmup(name, masters):
    """A model cast to bfloat16, stepped by an optimizer picked on GPUs behind a linear
    warm-up (``LinearLR``), on its bfloat16 parameters or on float32 masters copied back:
    ``grad1`` (bfloat16) is the loop's at the weights of each step, its mean ``.grad``; the
    weights move at each step."""
    model = Net().to(torch.bfloat16)
    if masters:
        keeper = Masters(model, OPTIMIZERS[name])
        optimizer = keeper.optimizer
    else:
        optimizer = OPTIMIZERS[name](model.parameters())
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=3)
    with gradhooks.add_hooks(model):
        for step in range(4):
            x, y = batch(step)
            x = x.bfloat16()
            want = loop(model, x, y)
            before = [p.detach().clone() for p in model.parameters()]
            optimizer.zero_grad()
            model.zero_grad()
            ce(model(x), y).backward()
            for n, p in model.named_parameters():
                assert p.grad1.dtype == torch.bfloat16
                near(p.grad1, want[n], BF16, f"step {step}: {n}")
                near(p.grad1.float().mean(0), p.grad, BF16, f"step {step}: {n} vs .grad")
            keeper.step() if masters else optimizer.step()
            warmup.step()
            assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_zero_grad_keeping_bfloat16_zeros_over_micro_batches():
    """A bfloat16 model, ``zero_grad(set_to_none=False)`` (bfloat16 zeros kept in ``.grad``)
    and two accumulations of three micro-batches per step: ``grad1`` sums each micro-batch's
    rows (same batch size), the loop's sum over the micro-batches, and after the step's
    ``zero_grad`` starts afresh; ``.grad`` stays in bfloat16."""
    model = Net().to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer.zero_grad(set_to_none=False)  # .grad exists before the first backward
    with gradhooks.add_hooks(model):
        for step in range(2):
            optimizer.zero_grad(set_to_none=False)
            want: dict = {}
            for micro in range(3):
                x, y = batch(10 * step + micro)
                x = x.bfloat16()
                for n, g in loop(model, x, y).items():
                    want[n] = want.get(n, 0) + g / 3
                (ce(model(x), y) / 3).backward()
            for n, p in model.named_parameters():
                assert p.grad.dtype == p.grad1.dtype == torch.bfloat16
                near(p.grad1, want[n], BF16, f"step {step}: {n}")
                near(p.grad1.float().mean(0), p.grad, BF16, f"step {step}: {n} vs .grad")
            optimizer.step()


def test_kfac_optimizer_over_bfloat16_parameters_against_its_float64_twin():
    """:class:`gradhooks.KFAC` around SGD over a model cast to bfloat16 (the empirical
    Fisher, every step's factors): each step's update of the weights is, within bfloat16's
    rounding, that of a float64 twin started from the same weights and factors; the
    gradient preconditioned is the loop's mean."""
    model = Net().to(torch.bfloat16)
    opt = gradhooks.KFAC(
        model, torch.optim.SGD(model.parameters(), lr=0.1), damping=0.1, fisher="empirical"
    )
    twin = copy.deepcopy(model).to(D)
    twin_opt = gradhooks.KFAC(
        twin, torch.optim.SGD(twin.parameters(), lr=0.1), damping=0.1, fisher="empirical"
    )
    for step in range(STEPS):
        x, y = batch(step)
        x = x.bfloat16()
        want = loop(model, x, y)
        with torch.no_grad():
            for p, q in zip(twin.parameters(), model.parameters()):
                p.copy_(q)
        before = [p.detach().double().clone() for p in model.parameters()]
        for net, kfac, inputs in ((model, opt, x), (twin, twin_opt, x.double())):
            kfac.zero_grad()
            ce(net(inputs), y).backward()
            if net is model:
                for n, p in model.named_parameters():
                    near(p.grad, want[n].mean(0), BF16, f"step {step}: {n} .grad")
            kfac.step(inputs, y)
        for (n, p), q, b in zip(model.named_parameters(), twin.parameters(), before):
            near(p.double() - b, q - b, 2 * BF16, f"step {step}: {n} update")


# -- determinism ------------------------------------------------------------------------------


class Tokens(nn.Module):
    """An Embedding (vocabulary 11, width 8) summed over 5 tokens, a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens):
        return self.head(torch.tanh(self.emb(tokens).sum(1)))


@pytest.mark.parametrize("method", ["grad1", "ghost"])
def test_deterministic_algorithms_around_a_hooked_dp_step(method):
    """``torch.use_deterministic_algorithms(True)`` around a DP step under bfloat16 autocast
    (an Embedding, whose per-example gradients are scattered by token): no refusal, the
    clipped sum is the loop's, and the step run twice from the same weights and noise seed
    writes the same ``.grad`` bit for bit, over SGD steps."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        model = Tokens()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        quantities = ("grad1",) if method == "grad1" else ("norms",)
        with gradhooks.add_hooks(model, quantities=quantities) as h:
            for step in range(STEPS):
                g = torch.Generator().manual_seed(step)
                tokens, y = torch.randint(11, (6, 5), generator=g), torch.randint(3, (6,))
                want = loop_grad(copy.deepcopy(model).to(D), ce, (tokens,), y)
                grads = []
                for _ in range(2):
                    optimizer.zero_grad()
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        logits = model(tokens)
                    losses = F.cross_entropy(logits.float(), y, reduction="none")
                    gradhooks.dp_sgd_step(
                        h, losses, max_norm=0.5, noise_multiplier=0.0, method=method
                    )
                    grads.append([p.grad.clone() for p in model.parameters()])
                assert all(torch.equal(a, b) for a, b in zip(*grads)), step
                clipped = clipped_mean(want, 0.5)
                for n, p in model.named_parameters():
                    near(p.grad, clipped[n], BF16, f"step {step}: {n}")
                optimizer.step()
    finally:
        torch.use_deterministic_algorithms(was)


# -- float8 training, simulated ----------------------------------------------------------------


def fake_float8(t: torch.Tensor, rowwise: bool) -> torch.Tensor:
    """``t`` rounded to float8 (e4m3) by a scale from its largest entry, of each row
    (``rowwise``) or of the whole tensor, and passed straight through in the backward: what
    torchao's ``Float8Linear`` computes, written in plain torch."""
    big = t.detach().abs().amax(-1, keepdim=True) if rowwise else t.detach().abs().amax()
    scale = big.clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    rounded = (t / scale).to(torch.float8_e4m3fn).to(t.dtype) * scale
    return t + (rounded - t).detach()


class Float8Linear(nn.Linear):
    """A Linear whose weight is rounded to float8 by its own scale and its input by each
    example's (``rowwise``, the recipe of torchao's "rowwise" config) or by the batch's."""

    rowwise = True

    def forward(self, x):
        x = fake_float8(x, rowwise=self.rowwise)
        return F.linear(x, fake_float8(self.weight, rowwise=False), self.bias)


class Float8Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = Float8Linear(4, 8), Float8Linear(8, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def test_float8_linears_rowwise_then_tensorwise_under_bfloat16_autocast():
    """Float8 training simulated in plain torch under bfloat16 autocast: with each example's
    input rounded by its own scale (rowwise), ``grad1`` is the loop's (whose examples are
    rounded alike) at every AdamW step. With the input rounded by one scale of the whole batch
    (tensorwise), each example's output depends on the others' largest entry: the backward
    is refused at the forward, with a ``MixedExamplesError`` naming the layer and the
    ``amax``, and leaves the weights, ``.grad``, ``grad1`` and the hooks as they were: the
    rowwise recipe then trains on."""
    from harness import assert_untouched, model_state, raised

    model = Float8Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = batch(step)
            want = loop(model, x, y)
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = ce(model(x), y)
            loss.backward()
            for n, p in model.named_parameters():
                near(p.grad1, want[n], BF16, f"step {step}: {n}")
                near(p.grad1.mean(0), p.grad, BF16, f"step {step}: {n} vs .grad")
            optimizer.step()
        Float8Linear.rowwise = False
        try:
            before = model_state(model)

            def forward():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return model(x)

            raised(gradhooks.MixedExamplesError, ["'b'", "Float8Linear", "amax in 'a'"], forward)
            assert_untouched(model, before)
        finally:
            Float8Linear.rowwise = True
        want = loop(model, x, y)  # and the rowwise recipe trains on
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ce(model(x), y)
        loss.backward()
        for n, p in model.named_parameters():
            near(p.grad1, want[n], BF16, f"after the refusal: {n}")

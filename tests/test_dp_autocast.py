"""DP-SGD and the checks of a backward under mixed precision (CPU autocast to bfloat16 and
float16, bfloat16 parameters, float16 with ``torch.amp.GradScaler``), against a float64
per-example loop.

Tolerance: the hooked forward and backward round the activations and output-gradients of each
low-precision layer to the dtype's ``eps / 2`` (relative), and the norms, the clipping factors
and the clipped sums inherit it; against float64, within ``16 · eps`` of the largest entry
(bfloat16: 0.125, float16: 0.016) for these three-layer models (measured: up to 5.3 eps in
bfloat16, 1.3 in float16)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_robust_input import SEEN, UNSEEN_MIXING
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import Between, sq

METHODS = ["grad1", "ghost", "bookkeeping"]
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Pool(nn.Module):
    """Embedding, mean over the tokens, Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, t):
        return self.out(self.emb(t).mean(1))


MODELS = {
    "mlp": lambda: nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4)),
    "layernorm": lambda: nn.Sequential(
        nn.Linear(6, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4)
    ),
    "pool": Pool,
}


def problem(name: str, batch: int = 12):
    torch.manual_seed(0)
    model = MODELS[name]()
    x = torch.randint(30, (batch, 5)) if name == "pool" else torch.randn(batch, 6)
    return model, x, torch.randint(4, (batch,))


def reference(model, x, y) -> dict:
    """Each example's own gradient, float64, by a per-example loop."""
    m64 = copy.deepcopy(model).double()
    x64 = x.double() if x.is_floating_point() else x
    return loop_grad(m64, F.cross_entropy, x64, y)


def within(got, want, dtype, what: str, units: float = 16) -> None:
    """``got`` within ``units · eps(dtype)`` of ``want``'s largest entry (float64)."""
    want = want.double()
    diff = float((got.double() - want).abs().max())
    bound = units * torch.finfo(dtype).eps * max(float(want.abs().max()), 1e-12)
    assert diff <= bound, f"{what}: differs by {diff:.2e} > {bound:.2e}"


def autocast_losses(model, x, y, dtype):
    with torch.autocast("cpu", dtype=dtype):
        out = model(x)
    return F.cross_entropy(out.float(), y, reduction="none")


def precision_losses(model, x, y, precision: str, dtype):
    """The per-example losses of a forward in ``precision``: under autocast to ``dtype``, or
    of a bfloat16 model (``"bf16-params"``) given bfloat16 inputs."""
    if precision != "bf16-params":
        return autocast_losses(model, x, y, dtype)
    xb = x.bfloat16() if x.is_floating_point() else x
    return F.cross_entropy(model(xb).float(), y, reduction="none")


def clipped_reference(grads: dict, max_norm: float):
    norms = torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1)
    factors = torch.clamp(max_norm / norms, max=1.0)
    return norms, {n: torch.einsum("b,b...->...", factors, g) for n, g in grads.items()}


# -- every method of dp_sgd_step, its first step checked, against float64 -------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("precision", ["bf16", "fp16", "bf16-params"])
def test_step_under_mixed_precision_matches_the_float64_loop(precision, name, method):
    """The first step (checked: verify=True) gives no false refusal, and the clipped, noised
    mean is the float64 loop's within the precision's rounding."""
    model, x, y = problem(name)
    want = reference(model, x, y)
    dtype = torch.bfloat16 if precision == "bf16-params" else AUTOCAST[precision]
    max_norm = reference_median(want)
    norms, clipped = clipped_reference(want, max_norm)
    if precision == "bf16-params":
        model = model.bfloat16()
    quantity = "grad1" if method == "grad1" else "norms"
    sigma, seed, batch = 0.5, 3, x.shape[0]
    with gradhooks.add_hooks(model, quantities=(quantity,)) as h:
        losses = precision_losses(model, x, y, precision, dtype)
        got = gradhooks.dp_sgd_step(
            h, losses, max_norm=max_norm, noise_multiplier=sigma, method=method,
            generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
    within(got, norms, dtype, f"{precision} {name} {method}: norms")
    gen = torch.Generator().manual_seed(seed)
    for n, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=p.dtype).double() * sigma * max_norm
        assert p.grad.dtype == p.dtype
        # (the noise is exact: compared with the rounding of the clipped sum alone)
        within(p.grad.double() * batch - noise, clipped[n], dtype, f"{precision} {name} {n}")


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("precision", ["bf16", "fp16", "bf16-params"])
def test_book_keeping_steps_with_calls_run_detached_match_the_float64_loop(precision, name):
    """Three book-keeping steps with every Linear's batch gradient counted large
    (``unused_grad_macs``: from the second step on, the calls run detached and the backward
    forms none of the batch gradients autograd would throw away), SGD between them: each step
    within the precision's rounding of the float64 loop, as the first step above."""
    model, x, y = problem(name)
    dtype = torch.bfloat16 if precision == "bf16-params" else AUTOCAST[precision]
    if precision == "bf16-params":
        model = model.bfloat16()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sigma, batch = 0.5, x.shape[0]
    with (
        gradhooks.tuned(unused_grad_macs=1, unused_grad_macs_device=1),
        gradhooks.add_hooks(model, quantities=("norms",)) as h,
    ):
        for seed in range(3):
            want = reference(model, x, y)
            max_norm = reference_median(want)
            norms, clipped = clipped_reference(want, max_norm)
            opt.zero_grad(set_to_none=True)
            losses = precision_losses(model, x, y, precision, dtype)
            got = gradhooks.dp_sgd_step(
                h, losses, max_norm=max_norm, noise_multiplier=sigma, method="bookkeeping",
                generator=torch.Generator().manual_seed(seed),
            )  # fmt: skip
            within(got, norms, dtype, f"{precision} {name}, step {seed}: norms")
            gen = torch.Generator().manual_seed(seed)
            for n, p in model.named_parameters():
                noise = torch.randn(p.shape, generator=gen, dtype=p.dtype).double()
                noise = noise * sigma * max_norm
                within(p.grad.double() * batch - noise, clipped[n], dtype,
                       f"{precision} {name}, step {seed}: {n}")  # fmt: skip
            opt.step()


def reference_median(grads: dict) -> float:
    """A clipping norm that clips about half of the examples."""
    return float(torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1).median())


# -- the checks of a backward: no false refusal, and what mixes the examples still refused -------


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("precision", list(AUTOCAST))
def test_probe_and_check_under_autocast(precision, name):
    """A plain backward under autocast runs the probe (verify=True) without refusing;
    ``grad1`` and the norms are the float64 loop's within rounding, and ``Hooks.check`` (the
    sum against .grad, and a recomputation of the first examples) is ok."""
    dtype = AUTOCAST[precision]
    model, x, y = problem(name)
    want = reference(model, x, y)
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        autocast_losses(model, x, y, dtype).sum().backward()
        for n, p in model.named_parameters():
            within(p.grad1, want[n], dtype, f"{precision} {name} grad1 {n}")
        report = h.check(F.cross_entropy, x, y, examples=3, raise_on_error=False)
        assert report.ok, str(report)
        assert report.reduction == "sum"
    norms, _ = clipped_reference(want, 1.0)
    model.zero_grad()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        autocast_losses(model, x, y, dtype).mean().backward()
        within(h.norms(), norms, dtype, f"{precision} {name} norms")


MIXINGS = ["backward-only", "gradient-hook", "gradient-hook-first-two", "linalg-norm",
           "layer-norm-over-batch", "cdist"]  # fmt: skip


@pytest.mark.parametrize("quantity", ["grad1", "norms"])
@pytest.mark.parametrize("how", MIXINGS)
@pytest.mark.parametrize("precision", list(AUTOCAST))
def test_mixing_is_refused_under_autocast(precision, how, quantity):
    """What mixes the examples where the tracker cannot see it (the probe's own cases) is still
    refused at the first backward under autocast, naming the parameter, and nothing is kept."""
    torch.manual_seed(0)
    model = Between(UNSEEN_MIXING[how])
    x = torch.randn(4, 3)
    with gradhooks.add_hooks(model, quantities=(quantity,)):
        if how in SEEN:  # (the tracker sees it mix, at the forward)
            with pytest.raises(
                gradhooks.MixedExamplesError, match=r"'l2' \(Linear\): its input .* across the"
            ):
                with torch.autocast("cpu", dtype=AUTOCAST[precision]):
                    model(x)
            return
        with torch.autocast("cpu", dtype=AUTOCAST[precision]):
            out = model(x)
        with pytest.raises(
            gradhooks.CheckFailedError,
            match=r"(grad1 is not the examples' own|norms are not those of the examples').*"
            r"'l1\.weight'",
        ):
            sq(out.float()).backward()
    assert not any(hasattr(p, "grad1") for p in model.parameters())


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("precision", list(AUTOCAST))
def test_step_refuses_mixing_under_autocast(precision, method):
    """dp_sgd_step's check under autocast: a gradient hook between two Linears that centres
    the output-gradient over the batch (which the tracker, following the forward, cannot see)
    is refused, naming the parameter, and no gradient is written."""
    torch.manual_seed(0)
    model = Between(UNSEEN_MIXING["gradient-hook"])
    x = torch.randn(6, 3)
    quantity = "grad1" if method == "grad1" else "norms"
    with gradhooks.add_hooks(model, quantities=(quantity,)) as h:
        with torch.autocast("cpu", dtype=AUTOCAST[precision]):
            losses = model(x).float().pow(2).sum(1)
        with pytest.raises(
            gradhooks.CheckFailedError, match=r"dp_sgd_step: the per-example.*'l1\.weight'"
        ):
            gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=0.0, method=method)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("precision", list(AUTOCAST))
def test_batch_norm_in_training_mode_is_refused_under_autocast(precision):
    model = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.Linear(5, 2))
    with gradhooks.add_hooks(model, quantities=("norms",)):
        with pytest.raises(gradhooks.MixedExamplesError, match=r"'1' \(BatchNorm1d\)"):
            with torch.autocast("cpu", dtype=AUTOCAST[precision]):
                model(torch.randn(4, 3))


# -- float16 with a GradScaler ---------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_grad_scaler_loop_skips_an_overflow_and_then_steps_exactly(method):
    """The ordinary GradScaler loop around dp_sgd_step(..., scaler=scaler). The first step's
    scale (2³⁰) overflows float16: the step is skipped (the parameters, the generator and the
    accountant as they were), the scaler lowers its scale. The next step is the float64 loop's
    clipped, noised mean (clipped on the unscaled gradients), and the norms are unscaled."""
    model, x, y = problem("layernorm")
    want = reference(model, x, y)
    max_norm = reference_median(want)
    norms_want, clipped = clipped_reference(want, max_norm)
    sigma, batch = 0.5, x.shape[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**30, backoff_factor=2.0**-20)
    accountant = gradhooks.PrivacyAccountant()
    gen = torch.Generator().manual_seed(7)
    quantity = "grad1" if method == "grad1" else "norms"
    with gradhooks.add_hooks(model, quantities=(quantity,)) as h:
        for step in range(2):
            before = [p.detach().clone() for p in model.parameters()]
            state = gen.get_state()
            losses = autocast_losses(model, x, y, torch.float16)
            norms = gradhooks.dp_sgd_step(
                h, losses, max_norm=max_norm, noise_multiplier=sigma, method=method,
                generator=gen, scaler=scaler,
            )  # fmt: skip
            if torch.isfinite(norms).all():  # (a skipped step released nothing)
                accountant.step(noise_multiplier=sigma, sample_rate=0.01)
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            if step == 0:
                assert not torch.isfinite(norms).all()
                assert scaler.get_scale() == scale * 2.0**-20 == 2.0**10
                assert accountant.steps == 0
                assert torch.equal(gen.get_state(), state), "no noise drawn for a skipped step"
                for p, b in zip(model.parameters(), before, strict=True):
                    assert torch.equal(p.detach(), b), "a skipped step leaves the model"
            else:
                assert scale == 2.0**10 and accountant.steps == 1
                within(norms, norms_want, torch.float16, f"{method}: unscaled norms")
                noise = torch.Generator().manual_seed(0)
                noise.set_state(state)
                for (n, p), b in zip(model.named_parameters(), before, strict=True):
                    z = torch.randn(p.shape, generator=noise).double() * sigma * max_norm
                    # (scaler.step unscaled p.grad in place)
                    within(p.grad.double() * batch - z, clipped[n], torch.float16, f"{method} {n}")
                    assert torch.allclose(p.detach(), b - 0.1 * p.grad), "the step was taken"


def test_scaler_must_be_a_grad_scaler():
    model, x, y = problem("mlp")
    with gradhooks.add_hooks(model) as h:
        losses = F.cross_entropy(model(x), y, reduction="none")
        with pytest.raises(gradhooks.ConfigurationTypeError):
            gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=0.0, scaler=2.0)


@pytest.mark.parametrize("with_scaler", [False, True], ids=["no-scaler", "scaler-too"])
@pytest.mark.parametrize("entry", ["dp_sgd_step", "clipped_sum", "DPOptimizer"])
def test_losses_scaled_by_a_grad_scaler_are_refused(entry, with_scaler):
    """``scaler.scale(losses)`` given to the step (the float16 loop's habit) would be clipped
    at ``S`` times the gradients' norms, and ``scaler.step`` would divide the noise by ``S``:
    refused, with the parameters' ``.grad`` and the generator untouched, also where the
    scaler is passed as well (the backward would be scaled twice)."""
    model, x, y = problem("layernorm")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    gen = torch.Generator().manual_seed(1)
    state = gen.get_state()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        losses = scaler.scale(autocast_losses(model, x, y, torch.float16))
        more = {"scaler": scaler} if with_scaler else {}
        with pytest.raises(gradhooks.ConfigurationError, match=r"GradScaler's scale.*scaler="):
            if entry == "dp_sgd_step":
                gradhooks.dp_sgd_step(
                    h, losses, max_norm=1.0, noise_multiplier=1.0, generator=gen, **more
                )
            elif entry == "clipped_sum":
                gradhooks.clipped_sum(h, losses, max_norm=1.0, **more)
            else:
                opt = gradhooks.DPOptimizer(
                    torch.optim.SGD(model.parameters(), lr=0.1), h, noise_multiplier=1.0,
                    max_grad_norm=1.0, expected_batch_size=x.shape[0], generator=gen, **more,
                )  # fmt: skip
                opt.backward(losses)
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(gen.get_state(), state)


def test_losses_times_a_one_element_tensor_of_no_scaler_are_stepped():
    """A loss weighted by a one-element float32 tensor that no GradScaler holds is an ordinary
    loss: stepped, and its clipped sum is the float64 loop's of the weighted losses."""
    model, x, y = problem("mlp")
    weight = torch.tensor([2.0])
    want = {n: 2.0 * g for n, g in reference(model, x, y).items()}
    max_norm = reference_median(want)
    norms_want, clipped = clipped_reference(want, max_norm)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        losses = F.cross_entropy(model(x), y, reduction="none") * weight
        norms = gradhooks.dp_sgd_step(h, losses, max_norm=max_norm, noise_multiplier=0.0)
    assert torch.allclose(norms.double(), norms_want, rtol=1e-4)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad.double() * x.shape[0], clipped[n], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("method", METHODS)
def test_the_step_backpropagates_the_sum_whatever_the_handles_reduction(method):
    """The step's backward is of the losses' sum under a handle declared ``"mean"`` too: the
    mean's ``1 / batch`` would round every float16 output-gradient, and the small ones lose
    their bits (a tiny ConvNeXt's LayerNorm bias: 0.17 of its largest term off the loop's
    clipped sum, against 0.042 by the sum). Both handles give one ``.grad``, bit for bit, and
    the handle keeps its reduction."""
    grads = {}
    for reduction in ("mean", "sum"):
        model, x, y = problem("layernorm")
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        quantity = "grad1" if method == "grad1" else "norms"
        with gradhooks.add_hooks(model, quantities=(quantity,), loss_reduction=reduction) as h:
            losses = autocast_losses(model, x, y, torch.float16)
            gradhooks.dp_sgd_step(
                h, losses, max_norm=1.0, noise_multiplier=0.0, method=method, scaler=scaler
            )
            assert h.loss_reduction == reduction
        grads[reduction] = [p.grad.clone() for p in model.parameters()]
    for mean, total in zip(grads["mean"], grads["sum"], strict=True):
        assert torch.equal(mean, total)

"""What the architecture sweeps share: one model's ``grad1`` against each example's own gradient.

``bench.hf_sweep`` (Hugging Face) and ``bench.timm_sweep`` (timm, vit-pytorch, x-transformers)
build their models and inputs each in its own way; the rest is here. A model ends as one of
:data:`OUTCOMES`:

- **match**: every trainable parameter's ``grad1`` within ``rtol`` of the loop's gradient (and
  ``rtol`` of its largest entry, plus ten times the model's own rounding between its batched
  gradient and the loop's, where that is rounding);
- **refused**: gradhooks raised one of its own errors (its first line is kept);
- **mismatch**: a silently wrong ``grad1`` (the parameter, the largest absolute and relative
  error are kept), or none where the loop gives a gradient: the worst outcome;
- **crash**: another exception raised from inside gradhooks;
- **skipped**: the model or its inputs could not be made, it does not run, or it took too long.

Both sweeps also run a model in the settings users train in (:data:`SETTINGS`): a training
loop, bfloat16 autocast, float16 autocast with a ``GradScaler``, a DP step. Each sweep describes its model as a :class:`Subject`.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

import gradhooks

OUTCOMES = ("match", "refused", "mismatch", "crash", "skipped")
# The order of a report's rows: the worst first.
REPORT_ORDER = ("mismatch", "crash", "refused", "match", "skipped")
RTOL = 1e-7
# A model that computes in float32 inside gives a batch of one logits that differ from its row
# of the batch by float32 rounding, and so gradients that differ as much from the loop's,
# whoever computes them: such a model ("float32 inside", the logits' relative difference above
# ROUNDED) is compared at FLOAT32_RTOL, 1e3 float32 epsilons.
ROUNDED = 1e-12
FLOAT32_RTOL = 1e-4


@dataclass
class Result:
    family: str
    task: str = ""
    model: str = ""
    outcome: str = "skipped"
    detail: str = ""
    params: int = 0
    parameter: str = ""
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    batch_vs_one: float = 0.0
    loop_vs_batch: float = 0.0
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)


class Skip(Exception):
    """The model or its inputs could not be made, or it does not run without gradhooks."""


class TimeLimit(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    def stop(signum, frame):
        raise TimeLimit(f"took longer than {seconds:g} s")

    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return
    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def is_gradhooks_frame(tb) -> bool:
    root = str(Path(gradhooks.__file__).parent)
    return any(f.filename.startswith(root) for f in traceback.extract_tb(tb))


def hooked_backward(res: Result, model, loss: Callable[[], torch.Tensor], reduction: str) -> bool:
    """``loss().backward()`` under ``add_hooks(model)``; False, with ``res`` classified as
    refused, crash or skipped, where it raised."""
    try:
        with gradhooks.add_hooks(model, loss_reduction=reduction):
            loss().backward()
    except gradhooks.GradhooksError as e:
        res.outcome, res.detail = "refused", first_line(e)
        return False
    except TimeLimit:
        raise
    except Exception as e:
        inside = is_gradhooks_frame(e.__traceback__)
        res.outcome = "crash" if inside else "skipped"
        res.detail = (
            first_line(e) if inside else f"fails under hooks, outside gradhooks: {first_line(e)}"
        )
        return False
    return True


def compare(
    res: Result,
    params: list,
    want: dict[str, torch.Tensor],
    rtol: float,
    mean: bool = False,
    zero: float = 1e-12,
    keep: bool = False,
) -> None:
    """Classify ``res`` as match or mismatch: each of ``params``' ``grad1`` (then deleted,
    unless ``keep``) against ``want``, the loop's per-example gradients by name
    (``[batch, *shape]``). ``mean``: the loss averages the examples (``.grad`` is then the
    loop's mean, not its sum). ``zero``: below what fraction of the model's largest gradient
    entry an error is rounding."""
    worst = (0.0, 0.0, "")
    missing = []
    # A gradient that is zero in exact arithmetic (a key's bias, which softmax cancels) is
    # rounding noise on both sides: measured against the model's largest gradient entry.
    largest = max((float(w.abs().max()) for w in want.values() if w.numel()), default=0.0)
    floor = zero * largest
    for n, p in params:
        got = getattr(p, "grad1", None)
        if not want[n].numel() and (got is None or got.shape == want[n].shape):
            continue  # (an empty parameter: no entry to compare)
        if got is None:
            if want[n].abs().max() > 0:
                missing.append(n)
            continue
        if got.shape != want[n].shape:
            missing.append(f"{n} (grad1 {tuple(got.shape)}, want {tuple(want[n].shape)})")
            continue
        scale = float(want[n].abs().max())
        err = (got - want[n]).abs()
        # The model's own rounding between its batched backward and the loop (autograd's
        # .grad against the loop's sum or mean: nothing of gradhooks in it), ten times over;
        # only where it is rounding (within 1e-6 of the model's largest gradient entry), not a
        # loss that is no sum of per-example losses
        noise = 0.0
        if p.grad is not None:
            total = want[n].mean(0) if mean else want[n].sum(0)
            noise = float((p.grad - total).abs().max())
            if noise > 1e-6 * largest:
                noise = 0.0
            res.loop_vs_batch = max(res.loop_vs_batch, noise / max(scale, floor or 1e-300))
        bad = err > rtol * want[n].abs() + rtol * scale + floor + 10 * noise
        if bool(bad.any()):
            rel = float(err.max()) / (scale or 1.0)
            if rel > worst[1]:
                worst = (float(err.max()), rel, n)
    for _, p in params:
        if hasattr(p, "grad1") and not keep:
            del p.grad1
    if missing:
        res.outcome, res.parameter = "mismatch", missing[0]
        res.detail = f"no grad1 where the loop gives a gradient: {', '.join(missing[:3])}"
    elif worst[2]:
        res.outcome, res.parameter = "mismatch", worst[2]
        res.max_abs_error, res.max_rel_error = worst[0], worst[1]
        res.detail = (
            f"{worst[2]}: max abs error {worst[0]:.3g} ({worst[1]:.3g} of its largest entry)"
        ) + ("; " + res.detail if res.detail else "")
    else:
        res.outcome = "match"
    if res.batch_vs_one > ROUNDED:
        res.detail = (res.detail + "; " if res.detail else "") + (
            f"float32 inside (logits of a batch of one differ by {res.batch_vs_one:.1g} of the "
            f"largest)"
        )
    if rtol != RTOL:
        res.detail += f": compared at rtol={rtol:g}"
    if res.loop_vs_batch > rtol:
        res.detail = (res.detail + "; " if res.detail else "") + (
            f"its batched gradient differs from the loop's by {res.loop_vs_batch:.1g} of a "
            "parameter's largest entry without gradhooks: allowed ten times that"
        )


# -- the settings users train in ----------------------------------------------------------------

STEPS = 3
# bfloat16 keeps 8 significant bits (unit roundoff 2**-9, about 2e-3); a few layers' roundings
# of each output-gradient, summed over positions whose errors do not cancel: about 16 units
# (as tests/test_autocast.py allows). A wrong example, scale or product is of order 1.
BF16_TOL = 5e-2
# float16 keeps 11 significant bits (unit roundoff 2**-11, about 5e-4), three more than
# bfloat16: a fifth of BF16_TOL (a wrong example, scale or product is still of order 1)
FP16_TOL = 1e-2
# the GradScaler's scale: a power of two (the division back is exact), large enough that small
# gradients keep their bits in float16, small enough that tiny models do not overflow
FP16_SCALE = 2.0**10
_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass
class Subject:
    """A model, its batch and its loss, as the settings run it.

    ``loss()``: the batch's loss of ``model``, the examples' losses summed or averaged
    (``reduction``); ``losses()``: each example's, ``[batch]``; ``own_gradients()``: each
    example's gradient at ``model``'s current parameters by a float64 loop of batches of one,
    ``{name: [batch, *shape]}``; ``lowered()``: the same with a float32 copy of the model, its
    floating inputs in float32 and its output in float32 for the loss (whatever autocast gave).
    ``rtol``: the tolerance of a float64 comparison (:data:`FLOAT32_RTOL` for a model that
    computes in float32 inside).
    """

    model: nn.Module
    loss: Callable[[], Tensor]
    losses: Callable[[], Tensor]
    own_gradients: Callable[[], dict[str, Tensor]]
    lowered: Callable[[], Subject]
    reduction: str = "sum"
    rtol: float = RTOL


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def training(s: Subject, res: Result) -> None:
    """``STEPS`` SGD steps under one ``add_hooks``, ``zero_grad`` before each backward:
    ``grad1`` of every step (left where the backward wrote it, for ``zero_grad`` to reset)
    against the loop at that step's parameters."""
    opt = torch.optim.SGD(s.model.parameters(), lr=0.1)
    params = trainable(s.model)
    with gradhooks.add_hooks(s.model, loss_reduction=s.reduction):
        for step in range(STEPS):
            want = s.own_gradients()
            opt.zero_grad()
            s.loss().backward()
            res.detail = ""
            compare(res, params, want, s.rtol, mean=s.reduction == "mean", keep=True)
            if res.outcome != "match":
                res.detail = f"step {step + 1}: {res.detail}"
                return
            opt.step()
    res.detail = f"{STEPS} steps" + (f" at rtol={s.rtol:g}" if s.rtol != RTOL else "")


def bf16_autocast(s: Subject, res: Result) -> None:
    """The model in float32 under CPU bfloat16 autocast (the loss in float32): ``grad1``
    against the float64 loop, relative error per parameter at most :data:`BF16_TOL`, or, where
    the model's own bfloat16 loop (without gradhooks) is further off the float64 loop there,
    :data:`BF16_TOL` plus twice that (the model's sensitivity to bfloat16, not gradhooks').
    Where that fails and autograd's own per-example gradients of the batched bfloat16 forward
    (:func:`batched_per_example`, without gradhooks) are off the loop as far, the batched
    forward is not each example's alone (torch's CPU bfloat16 kernels can compute a batch
    otherwise than one example): ``grad1`` is then compared with those, at the same allowance,
    and the detail says so."""
    _autocast(s, res, torch.bfloat16, BF16_TOL)


def fp16_scaler(s: Subject, res: Result) -> None:
    """The model in float32 under CPU float16 autocast, trained as float16 is, with a
    ``torch.amp.GradScaler`` (:func:`_scaled_step`, from a scale of :data:`FP16_SCALE`): the
    backward is that of ``scaler.scale(loss)``, so ``grad1`` is the scale times each example's
    gradient (as ``.grad`` is before ``scaler.unscale_``); ``grad1`` divided by the scale
    against the float64 loop, as :func:`bf16_autocast` compares, at :data:`FP16_TOL`."""
    _autocast(s, res, torch.float16, FP16_TOL, FP16_SCALE)


def _autocast(s: Subject, res: Result, dtype: torch.dtype, tol: float, scale: float = 1.0) -> None:
    """:func:`bf16_autocast` and :func:`fp16_scaler`: under CPU autocast to ``dtype``, the loss
    multiplied by ``scale`` by a ``GradScaler`` where it is not 1."""
    name = _NAMES[dtype]
    want = s.own_gradients()
    low = s.lowered()
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
            low.loss()
    except Exception as e:
        raise Skip(f"does not run under {name} autocast: {first_line(e)}") from e
    if scale == 1.0:
        with gradhooks.add_hooks(low.model, loss_reduction=s.reduction):
            with torch.autocast("cpu", dtype=dtype):
                loss = low.loss()
            loss.backward()
    else:
        scale, skipped, finite_right = _scaled_step(low, res, dtype, scale, s.reduction, want, tol)
        if skipped is None:
            return
    largest = _largest(want)
    errors, grad1 = {}, {}
    for n, p in trainable(low.model):
        got = getattr(p, "grad1", None)
        if got is None:
            if want[n].abs().max() > 0:
                res.outcome, res.parameter, res.detail = "mismatch", n, f"no grad1: {n}"
                return
            continue
        grad1[n] = got.double() / scale
        errors[n] = relative(grad1[n], want[n], largest)
    own = dict.fromkeys(errors, 0.0)
    if any(e > tol for e in errors.values()):
        if scale == 1.0:
            with torch.autocast("cpu", dtype=dtype):
                rounded = low.own_gradients()
        else:  # (a loop of unscaled float16 losses underflows: the model's error, scaled too)
            rounded = batched_per_example(low, dtype, scale)
        own = {n: relative(rounded[n].double(), want[n], largest) for n in errors}
    # (an error that is no number, an overflow of the model's own, allows nothing more)
    allowed = {n: tol + 2 * own[n] if tol < own[n] < math.inf else tol for n in errors}
    n = max(errors, key=lambda n: errors[n] / allowed[n], default="")
    worst = (errors.get(n, 0.0), n)
    res.max_rel_error, res.parameter = worst
    res.outcome = "match" if not n or worst[0] <= allowed[n] else "mismatch"
    res.detail = f"largest relative error {worst[0]:.2g} ({n}), allowed {allowed.get(n, 0):.2g}"
    if scale != 1.0:
        res.detail += f"; grad1 divided by the scaler's scale {scale:g}"
        if skipped:
            res.detail += (
                f" (after {skipped} step(s) the scaler skipped for an overflow, with Inf or NaN "
                "in grad1 as in .grad"
                + (
                    f", or, for {', '.join(finite_right[:2])}, a grad1 finite and right where "
                    "autograd's batch sum overflowed"
                    if finite_right
                    else ""
                )
                + ")"
            )
    if res.outcome == "mismatch" and _batched_forward_explains(
        low, res, grad1, want, allowed, dtype, scale
    ):
        return
    if res.outcome == "mismatch" and own[n] <= tol:
        res.detail += f"; a {name} loop without gradhooks is off by {own[n]:.2g} there"
    elif any(e > tol for e in own.values()):
        top = max(own, key=own.get)
        res.detail += (
            f"; a {name} loop without gradhooks is off by {own[top]:.2g} ({top}), "
            f"{own[n]:.2g} at {n}"
        )


def _scaled_step(
    low: Subject, res: Result, dtype: torch.dtype, scale: float, reduction: str,
    want: dict[str, Tensor], tol: float,
) -> tuple[float, int | None, list[str]]:  # fmt: skip
    """The float16 training step of :func:`fp16_scaler` under ``add_hooks``: the backward of
    ``scaler.scale(loss)``, then ``scaler.step`` (an SGD of learning rate 0: the weights stay
    those of the loop) and ``scaler.update``, ``zero_grad`` before each. On a step the scaler
    skips (an overflow in ``.grad``), each parameter whose ``.grad`` overflowed has Inf or NaN in
    its ``grad1`` too, or a finite ``grad1`` that is right (divided by the scale, within ``tol``
    of ``want``: autograd added the batch in float16, where the examples' own gradients did not
    overflow); then the scaler lowers its scale for the next step, as in training. Returns the
    scale of the step taken, how many were skipped before it (``None`` where ``res`` is already
    a mismatch) and the parameters whose ``grad1`` was finite and right where ``.grad``
    overflowed."""
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    params = trainable(low.model)
    opt = torch.optim.SGD([p for _, p in params], lr=0.0)
    largest = _largest(want)
    skipped, finite_right = 0, []
    with gradhooks.add_hooks(low.model, loss_reduction=reduction):
        while True:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=dtype):
                loss = low.loss()
            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            overflowed = [
                (n, p) for n, p in params
                if p.grad is not None and not bool(torch.isfinite(p.grad).all())
            ]  # fmt: skip
            scaler.step(opt)
            scaler.update()
            if scaler.get_scale() >= scale:
                return scale, skipped, finite_right  # (taken)
            for n, p in overflowed:
                g1 = getattr(p, "grad1", None)
                if g1 is None or not bool(torch.isfinite(g1).all()):
                    continue
                err = relative(g1.double() / scale, want[n], largest)
                if not err <= tol:
                    res.outcome, res.parameter, res.max_rel_error = "mismatch", n, err
                    res.detail = (
                        f"the scaler skipped a step for an overflow in .grad ({n}), where grad1 "
                        f"is finite and off the loop by {err:.2g} (allowed {tol:g})"
                    )
                    return scale, None, finite_right
                if n not in finite_right:
                    finite_right.append(n)
            skipped += 1
            if skipped > 20:
                raise Skip(f"overflows in float16 at every scale down to {scale:g}")


def batched_per_example(
    s: Subject, dtype: torch.dtype = torch.bfloat16, scale: float = 1.0
) -> dict[str, Tensor]:
    """Each example's gradient through the batched forward under autocast to ``dtype``, by
    autograd without gradhooks: the gradient of ``s.losses()[b]`` for each example ``b``
    (of ``scale`` times it, divided back: a ``GradScaler``'s), ``{name: [batch, *shape]}`` in
    float64."""
    params = trainable(s.model)
    rows = []
    with gradhooks.paused():
        with torch.autocast("cpu", dtype=dtype):
            losses = s.losses()
        for b in range(losses.shape[0]):
            grads = torch.autograd.grad(
                losses[b] * scale, [p for _, p in params], retain_graph=True, allow_unused=True
            )
            rows.append(
                [torch.zeros_like(p) if g is None else g for g, (_, p) in zip(grads, params)]
            )
    return {
        n: torch.stack([r[i] for r in rows]).double() / scale for i, (n, _) in enumerate(params)
    }


def _batched_forward_explains(
    low: Subject,
    res: Result,
    grad1: dict[str, Tensor],
    want: dict[str, Tensor],
    allowed: dict[str, float],
    dtype: torch.dtype = torch.bfloat16,
    scale: float = 1.0,
) -> bool:
    """Whether ``grad1``, off the float64 loop ``want``, is within ``allowed`` of autograd's
    per-example gradients of the batched forward under autocast to ``dtype``, which are
    themselves off the loop beyond ``allowed``: the batch computed otherwise than each example
    alone, by the model or by torch, not by gradhooks. If so, ``res`` is a match that says so."""
    try:
        batched = batched_per_example(low, dtype, scale)
    except Skip:
        return False  # (a loss that is no sum of the examples' own)
    largest, own_largest = _largest(want), _largest(batched)
    apart = {n: relative(batched[n], want[n], largest) for n in grad1}
    off = {n: relative(grad1[n], batched[n], own_largest) for n in grad1}
    far = max(apart, key=lambda n: apart[n] / allowed[n])
    worst = max(off, key=lambda n: off[n] / allowed[n])
    if apart[far] <= allowed[far] or off[worst] > allowed[worst]:
        return False
    res.outcome, res.max_rel_error, res.parameter = "match", off[worst], worst
    res.detail += (
        f"; autograd's per-example gradients of the batched {_NAMES[dtype]} forward, without "
        f"gradhooks, are off the loop by {apart[far]:.2g} ({far}): the batch is computed "
        f"otherwise than each example alone; against them, largest relative error "
        f"{off[worst]:.2g} ({worst}), allowed {allowed[worst]:.2g}"
    )
    return True


def _clipped_error(
    want: dict[str, Tensor], factors: Tensor
) -> Callable[[str, Tensor | None], float]:
    """For the DP settings: ``error(n, got)``, ``got`` (``None``: zeros) against the loop's
    clipped sum of ``n``, ``Σ_i factors[i] · want[n][i]``, relative to its largest term (to the
    model's largest entry where the terms are zero in exact arithmetic: rounding on both
    sides)."""
    largest = _largest(want)
    terms = {n: torch.einsum("b,b...->b...", factors, w) for n, w in want.items()}

    def error(n: str, got: Tensor | None) -> float:
        if not terms[n].numel():
            return 0.0
        clipped = terms[n].sum(0)
        got = torch.zeros_like(clipped) if got is None else got
        top = float(terms[n].abs().max())
        if top < 1e-9 * largest:
            top = largest
        return float((got - clipped).abs().max()) / top

    return error


def dp_step(s: Subject, res: Result) -> None:
    """``gradhooks.dp_sgd_step`` by book-keeping, without noise, its clipping norm the median
    of the examples' gradient norms: ``p.grad`` against the loop's clipped sum
    ``Σ_i min(1, C / ‖g_i‖) g_i``, relative to the largest of its terms (a sum whose terms
    cancel keeps their rounding), within 1e-6 or ten times autograd's own error (the clipped
    sum's backward without gradhooks against the loop's), and the norms it returns against
    the loop's."""
    want = s.own_gradients()
    names = list(want)
    norms = torch.cat([want[n].flatten(1) for n in names], 1).norm(dim=1)
    clip = float(norms.median())
    factors = (clip / norms).clamp(max=1.0)
    s.model.zero_grad(set_to_none=True)
    with gradhooks.add_hooks(s.model, quantities=("norms",)) as hooks:
        got_norms = gradhooks.dp_sgd_step(
            hooks, s.losses(), max_norm=clip, noise_multiplier=0.0, reduction="sum",
            method="bookkeeping",
        )  # fmt: skip
    params = dict(s.model.named_parameters())
    error = _clipped_error(want, factors)

    errors = {n: error(n, params[n].grad) for n in names}
    # (a model that computes in float32 inside: its norms and sums carry float32 rounding)
    tol = 1e-6 if s.rtol == RTOL else 10 * s.rtol
    allowed = dict.fromkeys(names, tol)
    if any(e > tol for e in errors.values()):
        # the model's own rounding: autograd's clipped sum, without gradhooks, against the loop
        # (a batched backward that rounds otherwise than a batch of one), ten times over
        s.model.zero_grad(set_to_none=True)
        with gradhooks.paused():
            (s.losses() * factors).sum().backward()
        allowed = {n: tol + 10 * error(n, params[n].grad) for n in names}
    n = max(names, key=lambda n: errors[n] / allowed[n])
    worst = (errors[n], n, allowed[n])
    off = float((got_norms - norms).abs().max() / norms.max())
    if off > tol:
        worst = (off, "the norms", tol)
    res.max_rel_error, res.parameter = worst[:2]
    res.outcome = "match" if worst[0] <= worst[2] else "mismatch"
    res.detail = (
        f"largest relative error {worst[0]:.2g} ({worst[1]}), allowed {worst[2]:.2g}; clipped "
        "at the median norm"
    )
    if worst[2] > tol:
        res.detail += "; allowed ten times autograd's own error without gradhooks"


def dp_fp16_scaler(s: Subject, res: Result) -> None:
    """:func:`dp_step` as float16 trains: the model in float32 under CPU float16 autocast,
    ``dp_sgd_step(..., scaler=scaler)`` (its backward that of the scaled losses, its norms and
    clipping of the unscaled gradients), then ``scaler.step`` (an SGD of learning rate 0) and
    ``scaler.update``. A step the scaler skips (``p.grad`` NaN: an overflow) is taken again at
    the lower scale, as in training. ``p.grad`` divided by the scale against the float64 loop's
    clipped sum, relative to its largest term, within :data:`FP16_TOL`, or the float16 error
    of autograd's own clipped sum (its backward without gradhooks) plus that; the returned
    norms against the loop's within :data:`FP16_TOL`."""
    want = s.own_gradients()
    names = list(want)
    norms = torch.cat([want[n].flatten(1) for n in names], 1).norm(dim=1)
    clip = float(norms.median())
    factors = (clip / norms).clamp(max=1.0)
    low = s.lowered()
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
            low.loss()
    except Exception as e:
        raise Skip(f"does not run under float16 autocast: {first_line(e)}") from e
    params = dict(low.model.named_parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=FP16_SCALE)
    opt = torch.optim.SGD([p for p in params.values() if p.requires_grad], lr=0.0)
    skipped = 0
    with gradhooks.add_hooks(low.model, quantities=("norms",)) as hooks:
        while True:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                losses = low.losses()
            scale = scaler.get_scale()
            got_norms = gradhooks.dp_sgd_step(
                hooks, losses.float(), max_norm=clip, noise_multiplier=0.0, reduction="sum",
                method="bookkeeping", scaler=scaler,
            )  # fmt: skip
            got = {n: None if params[n].grad is None else params[n].grad.double() / scale
                   for n in names}  # fmt: skip
            scaler.step(opt)
            scaler.update()
            if scaler.get_scale() >= scale:
                break
            skipped += 1
            if skipped > 20:
                raise Skip(f"overflows in float16 at every scale down to {scale:g}")
    error = _clipped_error(want, factors)

    errors = {n: error(n, got[n]) for n in names}
    allowed = dict.fromkeys(names, FP16_TOL)
    if any(not e <= FP16_TOL for e in errors.values()):
        # the model's own float16 rounding: autograd's clipped sum, without gradhooks, against
        # the loop, twice over
        own = s.lowered()
        with gradhooks.paused(), torch.autocast("cpu", dtype=torch.float16):
            mine = own.losses()
        own_params = dict(own.model.named_parameters())
        ((mine.float() * factors.float()).sum() * scale).backward()  # (scaled, as the step)
        owned = {
            n: error(n, None if own_params[n].grad is None else own_params[n].grad.double() / scale)
            for n in names
        }  # fmt: skip
        # (an error that is no number, an overflow of autograd's own, allows nothing more)
        allowed = {n: FP16_TOL + 2 * e if math.isfinite(e) else FP16_TOL for n, e in owned.items()}
    n = max(names, key=lambda n: errors[n] / allowed[n])
    worst = (errors[n], n, allowed[n])
    off = float((got_norms.double() - norms).abs().max() / norms.max())
    if not off <= FP16_TOL:
        worst = (off, "the norms", FP16_TOL)
    res.max_rel_error, res.parameter = worst[:2]
    res.outcome = "match" if worst[0] <= worst[2] else "mismatch"
    res.detail = (
        f"largest relative error {worst[0]:.2g} ({worst[1]}), allowed {worst[2]:.2g}; clipped "
        f"at the median norm; p.grad divided by the scaler's scale {scale:g}"
    )
    if skipped:
        res.detail += f" (after {skipped} step(s) the scaler skipped for an overflow)"
    if worst[2] > FP16_TOL:
        res.detail += "; allowed twice autograd's own float16 error without gradhooks"


SETTINGS: dict[str, Callable[[Subject, Result], None]] = {
    "training": training,
    "bf16-autocast": bf16_autocast,
    "fp16-scaler": fp16_scaler,
    "dp-step": dp_step,
    "dp-fp16-scaler": dp_fp16_scaler,
}
SETTINGS_NOTE = (
    f"`training`: {STEPS} SGD steps under one `add_hooks`, `zero_grad` before each backward, "
    "`grad1` of each step against the loop at that step's parameters (at the model's `rtol`). "
    "`bf16-autocast`: the model in float32 under CPU bfloat16 autocast, `grad1` against the "
    f"float64 loop, largest relative error per parameter at most {BF16_TOL:g} (bfloat16's unit "
    "roundoff is 2e-3), or where the model's own bfloat16 loop without gradhooks is further off, "
    f"{BF16_TOL:g} plus twice its error; where the batched bfloat16 forward is itself not "
    "each example's alone (autograd's per-example gradients of it, without gradhooks, off the "
    "loop beyond that), against those gradients instead, as the row says. `fp16-scaler`: the "
    "same under float16 autocast, the backward that of a `GradScaler`'s scaled loss (scale "
    f"{FP16_SCALE:g}), `grad1` divided by the scale, at most {FP16_TOL:g} (float16's unit "
    "roundoff is 5e-4). `dp-step`: `dp_sgd_step` by book-keeping without "
    "noise, clipped at the median of the examples' norms, `p.grad` against the loop's clipped "
    "sum (relative to its largest term, at most 1e-6; ten times the model's `rtol` where it "
    "computes in float32 inside). `dp-fp16-scaler`: the same step under float16 autocast "
    "with a `GradScaler` passed to it, `p.grad` divided by the scale, within "
    f"{FP16_TOL:g} (or twice autograd's own float16 error plus that)."
)


def run_setting(res: Result, setting: str, subject: Callable[[], Subject]) -> None:
    """``res`` (its ``task`` the setting) classified by running ``subject()`` in ``setting``:
    refused, crash or skipped where it raised."""
    try:
        s = subject()
        res.model = type(s.model).__name__
        res.params = sum(p.numel() for p in s.model.parameters())
        SETTINGS[setting](s, res)
    except (Skip, TimeLimit):
        raise
    except gradhooks.GradhooksError as e:
        res.outcome, res.detail = "refused", first_line(e)
    except Exception as e:
        inside = is_gradhooks_frame(e.__traceback__)
        res.outcome = "crash" if inside else "skipped"
        res.detail = first_line(e) if inside else f"fails outside gradhooks: {first_line(e)}"
    finally:
        res.task = setting  # (whatever the subject's making noted)


def _largest(want: dict[str, Tensor]) -> float:
    return max((float(w.abs().max()) for w in want.values() if w.numel()), default=0.0)


def relative(got: Tensor, want: Tensor, largest: float) -> float:
    """``max|got - want| / max|want|``; for a gradient that is zero in exact arithmetic (below
    ``1e-9`` of the model's largest entry: a bias that a norm after it cancels), whose entries
    are rounding noise on both sides, relative to the model's largest gradient entry."""
    scale = float(want.abs().max())
    if scale < 1e-9 * largest:
        scale = largest
    return float((got - want).abs().max()) / (scale or 1.0)


def floated(out):
    """A model's output with its floating tensors in float32 (a diffusers output's sample)."""
    if isinstance(out, tuple | list):
        return type(out)(floated(t) for t in out)
    if hasattr(out, "sample") and isinstance(out.sample, Tensor):
        return out.sample.float()
    return out.float() if isinstance(out, Tensor) and out.is_floating_point() else out


def counts(results: list[Result]) -> dict[str, int]:
    return {o: sum(r.outcome == o for r in results) for o in OUTCOMES}


def cell(text: str) -> str:
    """``text`` as one cell of a Markdown table."""
    return text.replace("|", "\\|").replace("\n", " ")


def detail_cell(r: Result) -> str:
    detail = cell(r.detail)
    if r.warnings:
        detail += (" " if detail else "") + "warned: " + cell("; ".join(r.warnings))
    return detail


def progress(items):
    """A tqdm bar over ``items`` on stderr, or None where tqdm is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(items, unit="model", file=sys.stderr)

"""Fuzzing the training loop: the random models of tests/fuzz_models.py trained for several steps
with hooks added once, each step's ``grad1`` and norms compared with the float64 oracle at that
step's parameters.

:mod:`test_fuzz` checks one backward of fresh hooks: the first, which the run-time check
verifies and where the batch tracker follows every call afresh. A training loop's later steps
take other paths: the tracker reuses the layouts it kept from the step before while the calls
repeat, ``grad1`` is written into the memory of the step before, the run-time check verifies
only the 1st, 2nd, 4th, 8th... backward of each new set of calls and spot-checks the others.
Here each model trains for several SGD steps (``zero_grad`` and ``h.clear()`` between them, as
a loop does), and between steps the loop may

- take a batch of another size (fewer or more examples: the kept layouts no longer fit),
- freeze or unfreeze a parameter (a parameter a step does not reach),
- run the model under ``torch.no_grad()`` (a validation pass with the hooks left on),
- run some layers under activation checkpointing (non-reentrant: their forward runs again
  at the backward),
- take a second micro-batch of as many examples before the step (accumulation: ``grad1`` adds
  up row by row, as ``.grad`` does),
- leave out a layer for one step (LayerDrop; its parameters then reached through a reuse or a
  tie only, or not at all: no ``grad1`` where ``.grad`` is ``None``, zeros where it is zeros),

each step's ``grad1``, ``.grad``, ``h.norms()``, ``h.param_norms()``, ``h.sum_grad_sq()`` and
``h.grad_variance()`` compared with the per-example loop (the quantities other than ``grad1``
are each backward's own: after an accumulation, the second micro-batch's); or take the step by
:func:`gradhooks.dp_sgd_step` (clipping to the median norm, no noise), its ``.grad`` compared
with the loop's clipped sum. One model in two has hooks computing only the norms and squared
sums (no ``grad1`` is formed), its DP steps taken by ghost clipping or book-keeping. ``GRADHOOKS_FUZZ_LOOPS``
sets how many models (default 12); ``GRADHOOKS_FUZZ_RANDOM=1`` draws new ones on every run.

Under bfloat16 autocast (``GRADHOOKS_FUZZ_AUTOCAST`` models, default 4): the model in float32,
every forward under ``torch.autocast("cpu", torch.bfloat16)``, each step against the float64
loop at that step's parameters. The forward rounds each activation to bfloat16's unit,
``eps = 2⁻⁷``, and the error reaches every gradient relative to the gradients' scale, not to
each entry (an entry the rounding does not cancel where the float64 one does): every value
must lie within ``AUTOCAST_UNITS · eps`` of that step's scale (the largest entry of any
example's gradient, for the gradients; the largest example's norm, for the norms; their
squares for the squared sums and variances); or, where a gradient sums terms that cancel
(its rounding is of the terms, not of what is left), no further from float64 than 4 times
torch's own per-example loop under the same autocast; the same for the norms, squared sums
and variances, against those of that loop's gradients (an output that cancels in the forward,
the loss's gradient, is rounded relative to its terms, and every gradient, norm and square
formed from it with it). A draw whose float64 gradients are all
below ``eps`` times its largest output (a loss identically zero: a norm of one value, a
constant output) leaves only rounding in the bfloat16 ones: it is skipped, and counted. The
worst error seen, in units of ``eps · scale``, is printed.

Under float16 autocast with a ``torch.amp.GradScaler`` (``GRADHOOKS_FUZZ_FP16`` models, default
3), as float16 trains: every backward that of ``scaler.scale(loss)``, then ``scaler.unscale_``,
``grad1`` and the quantities read divided by the scale the backward ran with (by its square for
the squared sums and variances), ``scaler.step`` and ``scaler.update``; a DP step is
``dp_sgd_step(..., scaler=scaler)``, its ``.grad`` divided by that scale. The scaler's first
scale, growth interval and backoff are drawn, so that the scale grows and falls between steps,
and some steps overflow float16 and are skipped. The tolerance is the bfloat16 mode's, in units
of float16's ``eps = 2⁻¹⁰``, torch's own per-example loop run under the same autocast at the same
scale. A step the scaler takes must give the loop's numbers; on a step it skips (an Inf or NaN
in ``.grad``), every finite entry of ``grad1`` and of the quantities must still be the loop's
(an example whose own gradient overflowed holds Inf or NaN, the others are right), and a skipped
DP step must set every ``.grad`` to NaN, and only where an example's own gradient overflows at
that scale (torch's loop) or, under ghost clipping, autograd's batch gradient.
"""

from __future__ import annotations

import copy
import os
from collections import Counter
from contextlib import nullcontext

import torch
from fuzz_models import Apply, FuzzCase, FuzzModel, Shape, fuzz_cases, fuzz_settings
from hypothesis import example, given
from hypothesis import strategies as st

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_close, sum_of_squares

EXAMPLES = int(os.environ.get("GRADHOOKS_FUZZ_LOOPS", "12"))
AUTOCAST_EXAMPLES = int(os.environ.get("GRADHOOKS_FUZZ_AUTOCAST", "4"))
FP16_EXAMPLES = int(os.environ.get("GRADHOOKS_FUZZ_FP16", "3"))
TRIED: Counter = Counter()
# under autocast, per dtype: the worst error per kind, in units, and where
WORST: dict[torch.dtype, dict[str, tuple[float, str]]] = {torch.bfloat16: {}, torch.float16: {}}

BF16_EPS = torch.finfo(torch.bfloat16).eps
HALF = (torch.bfloat16, torch.float16)
# the error allowed under bfloat16 autocast, in units of its eps times the scale (see above)
AUTOCAST_UNITS = 16


class Close:
    """The comparison of a step's results with the float64 loop's ``want``: :func:`assert_close`
    in float64; under autocast to ``dtype`` (``units``: the allowed error), within
    ``units · eps`` of the step's scale: the largest entry of any example's gradient (``.grad``
    of a batch: times the examples it sums), the largest example's norm. ``finite_only``: on a
    step a GradScaler skips, only the finite entries are compared (an example whose own
    gradient overflowed holds Inf or NaN)."""

    def __init__(
        self, want: dict, units: float | None = None, n: int = 1, own: dict | None = None,
        dtype: torch.dtype = torch.bfloat16, finite_only: bool = False,
    ):  # fmt: skip
        self.units, self.dtype, self.eps = units, dtype, torch.finfo(dtype).eps
        self.finite_only = finite_only
        # torch's own per-example gradients under autocast (its per-example loop's), per
        # parameter; not where they overflowed (float16 at the scaler's scale)
        self.own = {k: g for k, g in (own or {}).items() if torch.isfinite(g).all()}
        self.overflowed = len(self.own) < len(own or {})
        entries = [g.abs().max() for g in want.values() if g.numel()]
        self.entry = float(max(entries)) if entries else 0.0
        norms = torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)
        self.norm = float(norms.max()) if norms.numel() else 0.0
        self.n = n

    def skipped(self, output: float) -> bool:
        """Under autocast, a step whose float64 gradients are all below what bfloat16's rounding
        of the forward puts into them (``eps`` times the largest output entry ``output``, the
        loss's gradient): only rounding is left (a loss identically zero, an output a norm
        makes independent of a parameter's scale)."""
        return self.units is not None and self.entry <= self.eps * output

    def __call__(self, got, want, what: str, kind: str = "entry", name: str = "", own=None) -> None:
        """``name``: the parameter whose per-example gradients ``want`` holds (torch's own are
        then ``self.own[name]``); ``own``: for another quantity, the same formed from torch's
        own gradients. 4 times their distance from float64 is allowed too."""
        if self.units is None:
            return assert_close(got, want, what)
        assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        # (where the gradient sums terms that cancel, the rounding is of the terms: as far from
        # float64 as torch's own loop under autocast, times 4, is rounding too)
        own = self.own.get(name) if own is None else own
        kept = torch.isfinite(got)
        if self.finite_only:  # (the others overflowed: the scaler skips the step)
            got, want = got[kept], want.to(got.device)[kept]
            own = None if own is None or own.shape != kept.shape else own[kept]
        else:
            assert kept.all(), f"{what}: not finite"
        scale = {
            "entry": self.entry, "sum": self.n * self.entry, "norm": self.norm,
            "square": 2 * self.n * self.entry**2, "variance": 4 * self.entry**2,
        }[kind]  # fmt: skip
        if not got.numel():
            return
        diff = float((got.double() - want.double()).abs().max())
        if own is not None and own.numel() and torch.isfinite(own).all():
            diff = max(0.0, diff - 4 * float((own.double() - want.double()).abs().max()))
        err = diff / (self.eps * scale)
        worst = WORST[self.dtype]
        if err > worst.get(kind, (0.0, ""))[0]:
            worst[kind] = (err, what)
        assert err <= self.units, f"{what}: {err:.1f} units of eps · scale > {self.units}"


# what the loop does before a step (besides zero_grad and h.clear())
HABITS = (
    "same",
    "fewer",
    "more",
    "freeze",
    "unfreeze",
    "no_grad",
    "skip",
    "checkpoint",
    "accumulate",
    "dp",
)


def _batch(x: torch.Tensor, size: int) -> torch.Tensor:
    """``size`` examples from ``x``'s rows, repeated in turn where ``x`` has fewer (each row its
    own example: the oracle takes them one at a time)."""
    rows = torch.arange(size) % x.shape[0]
    out = x[rows].clone()
    if out.is_floating_point():
        out = out + 0.01 * torch.arange(size, dtype=out.dtype).view(-1, *[1] * (out.dim() - 1))
    return out


def dp_step(
    h, model, batch, want: dict, reduction: str, what: str, method=None, close=None, ctx=None,
    scaler=None,
) -> bool:  # fmt: skip
    """One DP step without noise, clipping to the median of the examples' norms: ``.grad``
    must be the loop's clipped sum (divided by the batch size for a mean), the norms returned
    the loop's. ``method``: the handle's default, or ``"ghost"`` / ``"bookkeeping"`` (a
    norms-only handle). ``close``: the comparison (:class:`Close`); ``ctx``: what the forward
    runs under (a function giving the autocast); ``scaler``: a GradScaler, passed to the step
    (``.grad`` is then the sum times its scale). Returns whether the step is to be taken (False: the scaler's
    overflow, every ``.grad`` NaN)."""
    close, ctx = close or Close(want), ctx or nullcontext

    def losses():
        with ctx():
            out = model(batch)
        leaves = out if isinstance(out, tuple | list) else (out,)
        leaves = [t.float() if t.dtype in HALF else t for t in leaves]
        return sum(0.5 * (t**2).reshape(t.shape[0], -1).sum(1) for t in leaves)

    per_example = losses()
    norms = torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)
    bound = norms.median().item() or 1.0
    scale = 1.0 if scaler is None else float(scaler.get_scale())
    got = gradhooks.dp_sgd_step(
        h, per_example, max_norm=bound, noise_multiplier=0.0, reduction=reduction, method=method,
        scaler=scaler,
    )  # fmt: skip
    grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
    if scaler is not None and not all(torch.isfinite(g).all() for g in grads):
        assert all(g.isnan().all() for g in grads), f"{what}: a skipped step's .grad not all NaN"
        assert not torch.isfinite(got).all(), f"{what}: skipped, its norms all finite"
        if not close.overflowed:  # (torch's own per-example loop did not: its batch gradient?)
            params = [p for p in model.parameters() if p.requires_grad]
            with h.paused():
                batch_grads = torch.autograd.grad(losses().sum() * scale, params, allow_unused=True)
            assert not all(g is None or torch.isfinite(g).all() for g in batch_grads), (
                f"{what}: skipped, though at this scale neither autograd's batch gradient nor "
                "any example's own overflows"
            )
        return False
    own = close.own
    if own and own.keys() >= want.keys():
        mine = torch.cat([own[k].double().flatten(1) for k in want], 1).norm(dim=1)
    else:
        mine = None
    close(got, norms, f"{what}: norms returned", "norm", own=mine)
    factor = (bound / norms.clamp_min(1e-12)).clamp(max=1.0)
    n = batch.shape[0]
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        g = want[name]
        if p.grad is None:  # (not reached: a layer left out)
            assert not g.any(), f"{what}: {name} not reached, the loop's is not 0"
            continue
        f = factor.view(-1, *[1] * (g.dim() - 1))
        clipped = (f * g).sum(0)
        # (under autocast: torch's own per-example gradients, clipped alike)
        mine = (f * own[name].double()).sum(0) if name in own else None
        if mine is not None and reduction == "mean":
            mine = mine / n
        close(
            p.grad / scale, clipped / n if reduction == "mean" else clipped,
            f"{what}: .grad of {name}", "sum" if reduction == "sum" else "entry", own=mine,
        )  # fmt: skip
    return True


def check_quantities(h, want: dict, what: str, close=None, scale: float = 1.0) -> None:
    """The handle's norms, squared sums and variances: those of the loop's per-example
    gradients ``want`` (one backward's: after several, the last one's); ``scale``: the
    GradScaler's of the backward (the norms divided by it, the squares by its square)."""
    close = close or Close(want)
    norms, sums, variances = h.param_norms(), h.sum_grad_sq(), h.grad_variance()
    # each quantity of torch's own gradients under autocast, where the comparison has them
    own = {k: g.double() for k, g in close.own.items()}
    for name, g in want.items():
        if name not in norms and not g.any():
            continue  # (not reached)
        o = own.get(name)
        close(norms[name] / scale, g.flatten(1).norm(dim=1), f"{what}: norm of {name}", "norm",
              own=None if o is None else o.flatten(1).norm(dim=1))  # fmt: skip
        close(sums[name] / scale**2, (g**2).sum(0), f"{what}: sum_grad_sq of {name}", "square",
              own=None if o is None else (o**2).sum(0))  # fmt: skip
        close(variances[name] / scale**2, g.var(0, unbiased=False),
              f"{what}: grad_variance of {name}", "variance",
              own=None if o is None else o.var(0, unbiased=False))  # fmt: skip
    total = torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)
    mine = None
    if own and own.keys() >= want.keys():
        mine = torch.cat([own[k].flatten(1) for k in want], 1).norm(dim=1)
    close(h.norms() / scale, total, f"{what}: norms", "norm", own=mine)


def _loss(out) -> torch.Tensor:
    """The sum of squares, in float32 at least (a half-precision output rounded once more)."""
    leaves = out if isinstance(out, tuple | list) else (out,)
    return sum_of_squares([t.float() if t.dtype in HALF else t for t in leaves])


def _own(h, model, batch, ctx, factor: float) -> dict:
    """torch's own per-example gradients under autocast (its per-example loop's), of the loss
    times ``factor`` (a GradScaler's scale, over the batch size for a mean), divided back."""
    with h.paused(), ctx():
        own = loop_grad(model, lambda out: _loss(out) * factor, batch)
    return {k: g / factor for k, g in own.items()}


def _finite(params) -> bool:
    """Whether every ``.grad`` is finite (else a GradScaler skips the step)."""
    return all(torch.isfinite(p.grad).all() for p in params if p.grad is not None)


def _lstm_runs_under(dtype: torch.dtype) -> bool:
    """Whether torch's LSTM runs under CPU autocast to ``dtype``, recording for a backward
    (torch 2.13: oneDNN has no float16 LSTM for training, "could not create a primitive
    descriptor"; under ``no_grad`` it runs)."""
    lstm = torch.nn.LSTM(1, 1)
    try:
        with torch.autocast("cpu", dtype):
            lstm(torch.zeros(1, 1, 1))
    except RuntimeError:
        return False
    return True


def run_loop(
    case: FuzzCase, habits: list[str], sizes: list[int], dp_method=None,
    autocast: torch.dtype | None = None, scaler: tuple[float, int, float] | None = None,
) -> None:  # fmt: skip
    """``dp_method``: ``None`` (hooks computing ``grad1``), or ``"ghost"`` / ``"bookkeeping"``
    (hooks computing only the norms and squared sums: no ``grad1`` is formed, and the DP
    steps take that method). ``autocast``: ``torch.bfloat16`` or ``torch.float16``: the model
    in float32, its forwards under that autocast, against a float64 copy given its
    parameters at every step. ``scaler``: a GradScaler's ``(init_scale, growth_interval,
    backoff_factor)``, around every backward and step (float16)."""
    model, x, reduction = case.model, case.inputs, case.reduction
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return
    if autocast is not None and not _lstm_runs_under(autocast):
        if any(isinstance(m, torch.nn.LSTM) for m in model.modules()):
            TRIED[f"{autocast}: LSTM not run, torch's CPU LSTM has no such autocast"] += 1
            return
    ref, ctx, units, scaling = model, nullcontext, None, None
    if autocast is not None:
        ref, units = copy.deepcopy(model), AUTOCAST_UNITS
        model.float()
        x = x.float() if x.is_floating_point() else x
        ctx = lambda: torch.autocast("cpu", autocast)  # noqa: E731
    if scaler is not None:
        init, interval, backoff = scaler
        scaling = torch.amp.GradScaler(
            "cpu", init_scale=init, growth_interval=interval, backoff_factor=backoff
        )
    opt = torch.optim.SGD(params, lr=0.05)
    frozen: list[torch.nn.Parameter] = []
    quantities = ("norms", "sum_grad_sq") if dp_method else ("grad1", "norms", "sum_grad_sq")
    h = gradhooks.add_hooks(model, reduction, quantities=quantities)
    try:
        for step, (habit, size) in enumerate(zip(habits, sizes)):
            batch = _batch(x, size) if habit in ("fewer", "more") else x
            if habit == "freeze" and len(params) > len(frozen) + 1:
                p = next(p for p in params if p.requires_grad)
                p.requires_grad_(False)
                frozen.append(p)
            elif habit == "unfreeze" and frozen:
                frozen.pop().requires_grad_(True)
            model.skipped = model.recomputed = frozenset()
            if habit == "checkpoint":
                model.recomputed = frozenset(range(step % 2, len(model.steps), 2))
            elif habit == "skip" and model.skippable():
                model.skipped = frozenset({model.skippable()[step % len(model.skippable())]})
                with h.paused(), ctx():
                    if not _loss(model(batch)).requires_grad:
                        model.skipped = frozenset()  # (nothing trainable left to run)
            elif habit == "no_grad":
                with torch.no_grad(), ctx():
                    model(batch)
            opt.zero_grad(set_to_none=step % 2 == 0)
            h.clear()
            if autocast is not None:  # the float64 copy at this step's parameters
                with torch.no_grad():
                    for p64, p in zip(ref.parameters(), model.parameters(), strict=True):
                        p64.copy_(p)
                        p64.requires_grad_(p.requires_grad)
                ref.skipped, ref.recomputed = model.skipped, model.recomputed
            double = batch.double() if autocast and batch.is_floating_point() else batch
            want = loop_grad(ref, sum_of_squares, double)
            n = batch.shape[0]
            # the scale of this step's backwards (the DP step's backward is of the losses' sum)
            scale = 1.0 if scaling is None else float(scaling.get_scale())
            factor = scale / n if reduction == "mean" and habit != "dp" else scale
            own = None if autocast is None else _own(h, model, batch, ctx, factor)
            close = Close(want, units, n, own, autocast or torch.bfloat16)
            if autocast is not None:
                with torch.no_grad():
                    out64 = ref(double)
                leaves = out64 if isinstance(out64, tuple | list) else (out64,)
                if close.skipped(max(float(t.abs().max()) for t in leaves if t.numel())):
                    TRIED["autocast: float64 gradients only rounding, skipped"] += 1
                    break
            if habit == "dp":
                what = f"step {step} (dp, batch {n}, scale {scale:g})"
                taken = dp_step(
                    h, model, batch, want, reduction, what, dp_method, close, ctx, scaling
                )
                _step(opt, scaling, taken, habit)
                TRIED[habit] += 1
                continue
            with ctx():
                out = model(batch)
            loss = _loss(out)
            loss = loss / n if reduction == "mean" else loss
            (loss if scaling is None else scaling.scale(loss)).backward()
            last = want
            if habit == "accumulate":
                second = _batch(batch, n) + 0.5 if batch.is_floating_point() else batch.flip(0)
                double = second.double() if autocast and second.is_floating_point() else second
                last = loop_grad(ref, sum_of_squares, double)
                want = {k: g + last[k] for k, g in want.items()}
                if autocast is not None:  # (torch's own, of the second and of both)
                    first, own = own, _own(h, model, second, ctx, factor)
                    both = {k: g + first[k] for k, g in own.items()}
                else:
                    both = None
                close = Close(want, units, n, both, autocast or torch.bfloat16)
                with ctx():
                    out = model(second)
                loss = _loss(out)
                loss = loss / n if reduction == "mean" else loss
                (loss if scaling is None else scaling.scale(loss)).backward()
            taken = True
            if scaling is not None:
                scaling.unscale_(opt)
                taken = _finite(p for p in model.parameters() if p.requires_grad)
                if not taken:  # (only the finite entries are compared: the others overflowed)
                    close.finite_only = True
            what = f"step {step} ({habit}, batch {n}" + (f", scale {scale:g})" if scaling else ")")
            # the norms and squared sums are each backward's own: after an accumulation, the
            # second micro-batch's
            last_close = Close(last, units, n, own, autocast or torch.bfloat16, not taken)
            check_quantities(h, last, what, last_close, scale)
            for name, p in model.named_parameters():
                if dp_method:
                    assert getattr(p, "grad1", None) is None, f"{what}: {name} has a grad1"
                    continue
                if not p.requires_grad:
                    continue
                if p.grad is None:  # (not reached: a layer left out)
                    assert getattr(p, "grad1", None) is None, f"{what}: {name} has a grad1"
                    assert not want[name].any(), f"{what}: {name} not reached, the loop's is not 0"
                    continue
                assert hasattr(p, "grad1"), f"{what}: {name} has no grad1"
                close(p.grad1 / scale, want[name], f"{what}: grad1 of {name}", name=name)
                if taken:
                    reduced = p.grad1.mean(0) if reduction == "mean" else p.grad1.sum(0)
                    close(p.grad, reduced / scale, f"{what}: .grad of {name} vs grad1",
                          "sum" if reduction == "sum" else "entry")  # fmt: skip
            _step(opt, scaling, taken, habit)
            TRIED[habit] += 1
    finally:
        model.skipped = model.recomputed = frozenset()
        h.remove()
        for p in frozen:
            p.requires_grad_(True)


def _step(opt, scaler, taken: bool, habit: str) -> None:
    """The optimizer's step, through the scaler where there is one (which skips it where a
    gradient overflowed: ``taken`` False), then ``scaler.update()``."""
    if scaler is None:
        opt.step()
        return
    scaler.step(opt)
    scaler.update()
    kind = "dp steps" if habit == "dp" else "steps"
    TRIED[f"float16: {kind} taken" if taken else f"float16: {kind} skipped (overflow)"] += 1


HANDLES = st.sampled_from([None, None, "ghost", "bookkeeping"])


@fuzz_settings(EXAMPLES)
@given(
    fuzz_cases(),
    st.lists(st.sampled_from(HABITS), min_size=4, max_size=7),
    st.lists(st.integers(1, 5), min_size=7, max_size=7),
    HANDLES,
)
def fuzz(case: FuzzCase, habits: list[str], sizes: list[int], dp_method) -> None:
    run_loop(case, ["same", *habits], sizes, dp_method)
    TRIED["models"] += 1
    TRIED[f"handle {dp_method or 'grad1'}"] += 1


def test_random_models_train_as_the_oracle_says():
    before = TRIED["models"]
    fuzz()
    tried = TRIED["models"] - before
    mix = ", ".join(f"{k} {v}" for k, v in sorted(TRIED.items()) if k != "models")
    print(f"\nfuzz: {tried} random models trained against the oracle; steps: {mix}")
    assert tried >= min(EXAMPLES, 10), f"only {tried} models were tried"


def _worst(dtype: torch.dtype) -> str:
    return ", ".join(f"{k} {u:.1f} ({w})" for k, (u, w) in sorted(WORST[dtype].items()))


@fuzz_settings(AUTOCAST_EXAMPLES)
@given(
    fuzz_cases(),
    st.lists(st.sampled_from(HABITS), min_size=4, max_size=7),
    st.lists(st.integers(1, 5), min_size=7, max_size=7),
    HANDLES,
)
def fuzz_autocast(case: FuzzCase, habits: list[str], sizes: list[int], dp_method) -> None:
    run_loop(case, ["same", *habits], sizes, dp_method, autocast=torch.bfloat16)
    TRIED["autocast models"] += 1


def test_random_models_train_under_bfloat16_autocast():
    before = TRIED["autocast models"]
    fuzz_autocast()
    tried = TRIED["autocast models"] - before
    skipped = TRIED["autocast: float64 gradients only rounding, skipped"]
    print(
        f"\nfuzz: {tried} random models trained under bfloat16 autocast ({skipped} steps "
        f"skipped: float64 gradients only rounding); worst errors in units of eps · scale: "
        f"{_worst(torch.bfloat16)}"
    )
    assert tried >= min(AUTOCAST_EXAMPLES, 3), f"only {tried} models were tried"


# a GradScaler's first scale (2^0 to 2^24: the largest overflow float16 at once), growth
# interval (1 and 2: the scale doubles between steps) and backoff (after an overflow)
SCALERS = st.tuples(
    st.integers(0, 24).map(lambda k: 2.0**k), st.sampled_from([1, 2, 2000]),
    st.sampled_from([0.5, 2.0**-8]),
)  # fmt: skip


def _overflowing_case() -> FuzzCase:
    """Linear(3, 4) and LayerNorm(4) on ``seq [2, 3]``, three examples, a mean (values from
    ``sin``, not ``randn``): whose first scale, 2²⁴, overflows float16 at once."""
    model = FuzzModel()
    model.blocks.extend([Apply(torch.nn.Linear(3, 4)), Apply(torch.nn.LayerNorm(4))])
    model.steps = [0, 1]
    model.shapes = [Shape("seq", (2, 3)), Shape("seq", (2, 4)), Shape("seq", (2, 4))]
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(1.0, p.numel() + 1).mul(0.7 + i).sin().view(p.shape))
    x = torch.arange(18.0).mul(1.3).sin().reshape(3, 2, 3)
    return FuzzCase(model.double(), x.double(), "mean", True)


# the first step overflows and is skipped, the scale falls by 2⁸ and grows at every step taken
OVERFLOWING = (["same", "dp", "accumulate", "same", "dp"], [3] * 7)


@fuzz_settings(FP16_EXAMPLES)
@given(
    fuzz_cases(),
    st.lists(st.sampled_from(HABITS), min_size=3, max_size=6),
    st.lists(st.integers(1, 5), min_size=7, max_size=7),
    HANDLES,
    SCALERS,
)
@example(_overflowing_case(), *OVERFLOWING, None, (2.0**24, 1, 2.0**-8))
@example(_overflowing_case(), *OVERFLOWING, "ghost", (2.0**24, 1, 2.0**-8))
def fuzz_float16(case: FuzzCase, habits, sizes, dp_method, scaler) -> None:
    run_loop(case, ["same", *habits], sizes, dp_method, autocast=torch.float16, scaler=scaler)
    TRIED["float16 models"] += 1


def test_random_models_train_under_float16_autocast_with_a_grad_scaler():
    before = TRIED["float16 models"]
    fuzz_float16()
    tried = TRIED["float16 models"] - before
    steps = ", ".join(f"{k.split(': ')[1]} {v}" for k, v in TRIED.items() if "float16: " in k)
    print(
        f"\nfuzz: {tried} random models trained under float16 autocast with a GradScaler "
        f"({steps}); worst errors in units of eps · scale: {_worst(torch.float16)}"
    )
    assert tried >= min(FP16_EXAMPLES, 3), f"only {tried} models were tried"

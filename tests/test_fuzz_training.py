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
"""

from __future__ import annotations

import copy
import os
from collections import Counter
from contextlib import nullcontext

import torch
from fuzz_models import FuzzCase, fuzz_cases, fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_close, sum_of_squares

EXAMPLES = int(os.environ.get("GRADHOOKS_FUZZ_LOOPS", "12"))
AUTOCAST_EXAMPLES = int(os.environ.get("GRADHOOKS_FUZZ_AUTOCAST", "4"))
TRIED: Counter = Counter()
WORST: dict[str, tuple[float, str]] = {}  # under autocast: the worst error, in units, and where

BF16_EPS = torch.finfo(torch.bfloat16).eps
# the error allowed under bfloat16 autocast, in units of its eps times the scale (see above)
AUTOCAST_UNITS = 16


class Close:
    """The comparison of a step's results with the float64 loop's ``want``: :func:`assert_close`
    in float64; under autocast (``units``: the allowed error), within ``units · eps`` of the
    step's scale: the largest entry of any example's gradient (``.grad`` of a batch: times the
    examples it sums), the largest example's norm."""

    def __init__(self, want: dict, units: float | None = None, n: int = 1, own: dict | None = None):
        self.units = units
        # torch's own per-example gradients under autocast (its per-example loop's), per parameter
        self.own = own or {}
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
        return self.units is not None and self.entry <= BF16_EPS * output

    def __call__(self, got, want, what: str, kind: str = "entry", name: str = "", own=None) -> None:
        """``name``: the parameter whose per-example gradients ``want`` holds (torch's own are
        then ``self.own[name]``); ``own``: for another quantity, the same formed from torch's
        own gradients. 4 times their distance from float64 is allowed too."""
        if self.units is None:
            return assert_close(got, want, what)
        assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.isfinite(got).all(), f"{what}: not finite"
        scale = {
            "entry": self.entry, "sum": self.n * self.entry, "norm": self.norm,
            "square": 2 * self.n * self.entry**2, "variance": 4 * self.entry**2,
        }[kind]  # fmt: skip
        if not got.numel():
            return
        diff = float((got.double() - want.double()).abs().max())
        # (where the gradient sums terms that cancel, the rounding is of the terms: as far from
        # float64 as torch's own loop under autocast, times 4, is rounding too)
        own = self.own.get(name) if own is None else own
        if own is not None and own.numel():
            diff = max(0.0, diff - 4 * float((own.double() - want.double()).abs().max()))
        err = diff / (BF16_EPS * scale)
        if err > WORST.get(kind, (0.0, ""))[0]:
            WORST[kind] = (err, what)
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
    h, model, batch, want: dict, reduction: str, what: str, method=None, close=None, ctx=None
) -> None:
    """One DP step without noise, clipping to the median of the examples' norms: ``.grad``
    must be the loop's clipped sum (divided by the batch size for a mean). ``method``: the
    handle's default, or ``"ghost"`` / ``"bookkeeping"`` (a norms-only handle). ``close``:
    the comparison (:class:`Close`); ``ctx``: what the forward runs under (autocast)."""
    close = close or Close(want)
    with ctx or nullcontext():
        out = model(batch)
    leaves = out if isinstance(out, tuple | list) else (out,)
    leaves = [t.float() if t.dtype == torch.bfloat16 else t for t in leaves]
    per_example = sum(0.5 * (t**2).reshape(t.shape[0], -1).sum(1) for t in leaves)
    norms = torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)
    bound = norms.median().item() or 1.0
    gradhooks.dp_sgd_step(
        h, per_example, max_norm=bound, noise_multiplier=0.0, reduction=reduction, method=method
    )
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
        mine = (f * close.own[name].double()).sum(0) if name in close.own else None
        if mine is not None and reduction == "mean":
            mine = mine / n
        close(
            p.grad, clipped / n if reduction == "mean" else clipped, f"{what}: .grad of {name}",
            "sum" if reduction == "sum" else "entry", own=mine,
        )  # fmt: skip


def check_quantities(h, want: dict, what: str, close=None) -> None:
    """The handle's norms, squared sums and variances: those of the loop's per-example
    gradients ``want`` (one backward's: after several, the last one's)."""
    close = close or Close(want)
    norms, sums, variances = h.param_norms(), h.sum_grad_sq(), h.grad_variance()
    # each quantity of torch's own gradients under autocast, where the comparison has them
    own = {k: g.double() for k, g in close.own.items()}
    for name, g in want.items():
        if name not in norms and not g.any():
            continue  # (not reached)
        o = own.get(name)
        close(norms[name], g.flatten(1).norm(dim=1), f"{what}: norm of {name}", "norm",
              own=None if o is None else o.flatten(1).norm(dim=1))  # fmt: skip
        close(sums[name], (g**2).sum(0), f"{what}: sum_grad_sq of {name}", "square",
              own=None if o is None else (o**2).sum(0))  # fmt: skip
        close(variances[name], g.var(0, unbiased=False), f"{what}: grad_variance of {name}",
              "variance", own=None if o is None else o.var(0, unbiased=False))  # fmt: skip
    total = torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)
    mine = None
    if own and own.keys() >= want.keys():
        mine = torch.cat([own[k].flatten(1) for k in want], 1).norm(dim=1)
    close(h.norms(), total, f"{what}: norms", "norm", own=mine)


def _loss(out) -> torch.Tensor:
    """The sum of squares, in float32 at least (a bfloat16 output rounded once more)."""
    leaves = out if isinstance(out, tuple | list) else (out,)
    return sum_of_squares([t.float() if t.dtype == torch.bfloat16 else t for t in leaves])


def run_loop(
    case: FuzzCase, habits: list[str], sizes: list[int], dp_method=None, autocast=False
) -> None:
    """``dp_method``: ``None`` (hooks computing ``grad1``), or ``"ghost"`` / ``"bookkeeping"``
    (hooks computing only the norms and squared sums: no ``grad1`` is formed, and the DP
    steps take that method). ``autocast``: the model in float32, its forwards under bfloat16
    autocast, against a float64 copy given its parameters at every step."""
    model, x, reduction = case.model, case.inputs, case.reduction
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return
    ref, ctx, units = model, nullcontext, None
    if autocast:
        ref, units = copy.deepcopy(model), AUTOCAST_UNITS
        model.float()
        x = x.float() if x.is_floating_point() else x
        ctx = lambda: torch.autocast("cpu", torch.bfloat16)  # noqa: E731
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
            if autocast:  # the float64 copy at this step's parameters
                with torch.no_grad():
                    for p64, p in zip(ref.parameters(), model.parameters(), strict=True):
                        p64.copy_(p)
                        p64.requires_grad_(p.requires_grad)
                ref.skipped, ref.recomputed = model.skipped, model.recomputed
            double = batch.double() if autocast and batch.is_floating_point() else batch
            want = loop_grad(ref, sum_of_squares, double)
            n = batch.shape[0]
            own = None
            if autocast:  # torch's own per-example gradients under autocast
                with h.paused(), ctx():
                    own = loop_grad(model, _loss, batch)
            close = Close(want, units, n, own)
            if autocast:
                with torch.no_grad():
                    out64 = ref(double)
                leaves = out64 if isinstance(out64, tuple | list) else (out64,)
                if close.skipped(max(float(t.abs().max()) for t in leaves if t.numel())):
                    TRIED["autocast: float64 gradients only rounding, skipped"] += 1
                    break
            if habit == "dp":
                what = f"step {step} (dp, batch {n})"
                dp_step(h, model, batch, want, reduction, what, dp_method, close, ctx())
                opt.step()
                TRIED[habit] += 1
                continue
            with ctx():
                out = model(batch)
            loss = _loss(out)
            (loss / n if reduction == "mean" else loss).backward()
            last = want
            if habit == "accumulate":
                second = _batch(batch, n) + 0.5 if batch.is_floating_point() else batch.flip(0)
                double = second.double() if autocast and second.is_floating_point() else second
                last = loop_grad(ref, sum_of_squares, double)
                want = {k: g + last[k] for k, g in want.items()}
                close = Close(want, units, n)
                with ctx():
                    out = model(second)
                loss = _loss(out)
                (loss / n if reduction == "mean" else loss).backward()
            what = f"step {step} ({habit}, batch {n})"
            # the norms and squared sums are each backward's own: after an accumulation, the
            # second micro-batch's (torch's own loop ran on the first)
            mine = own if habit != "accumulate" else None
            check_quantities(h, last, what, Close(last, units, n, mine))
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
                close(p.grad1, want[name], f"{what}: grad1 of {name}", name=name)
                reduced = p.grad1.mean(0) if reduction == "mean" else p.grad1.sum(0)
                close(p.grad, reduced, f"{what}: .grad of {name} vs grad1",
                      "sum" if reduction == "sum" else "entry")  # fmt: skip
            opt.step()
            TRIED[habit] += 1
    finally:
        model.skipped = model.recomputed = frozenset()
        h.remove()
        for p in frozen:
            p.requires_grad_(True)


@fuzz_settings(EXAMPLES)
@given(
    fuzz_cases(),
    st.lists(st.sampled_from(HABITS), min_size=4, max_size=7),
    st.lists(st.integers(1, 5), min_size=7, max_size=7),
    st.sampled_from([None, None, "ghost", "bookkeeping"]),
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


@fuzz_settings(AUTOCAST_EXAMPLES)
@given(
    fuzz_cases(),
    st.lists(st.sampled_from(HABITS), min_size=4, max_size=7),
    st.lists(st.integers(1, 5), min_size=7, max_size=7),
    st.sampled_from([None, None, "ghost", "bookkeeping"]),
)
def fuzz_autocast(case: FuzzCase, habits: list[str], sizes: list[int], dp_method) -> None:
    run_loop(case, ["same", *habits], sizes, dp_method, autocast=True)
    TRIED["autocast models"] += 1


def test_random_models_train_under_bfloat16_autocast():
    before = TRIED["autocast models"]
    fuzz_autocast()
    tried = TRIED["autocast models"] - before
    worst = ", ".join(f"{k} {u:.1f} ({w})" for k, (u, w) in sorted(WORST.items()))
    skipped = TRIED["autocast: float64 gradients only rounding, skipped"]
    print(
        f"\nfuzz: {tried} random models trained under bfloat16 autocast ({skipped} steps "
        f"skipped: float64 gradients only rounding); worst errors in units of eps · scale: {worst}"
    )
    assert tried >= min(AUTOCAST_EXAMPLES, 3), f"only {tried} models were tried"

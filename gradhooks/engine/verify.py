"""The checks of a backward against autograd (``add_hooks(verify=True)``).

At the first backward of each new set of calls (and again at the 2nd, 4th, 8th..., and at
every backward after one it refused), autograd computes every parameter's gradient from the
model's output-gradients with each example's rows weighted differently, in a second backward
through the same graph (the probe); ``grad1`` weighted alike (or, without ``grad1``, the
pieces) must match, or the backward is undone and refused, naming the parameters.
:class:`Verifier` is the part of a :class:`gradhooks.Hooks` handle that does it.
On the CPU, where reading a value back costs nothing, each backward in between compares some
entries of one parameter's ``grad1`` with autograd's (:meth:`Verifier.spot_check`), a parameter
after another, so that a loss term on the parameters that starts later is refused where it starts.

:func:`check_hooks` (what :meth:`gradhooks.Hooks.check` calls) is the same kind of check on
demand, after a backward: ``grad1`` against autograd's ``.grad`` and, given the loss, against a
per-example recomputation; it returns a :class:`CheckReport` that names what is wrong and what to
do (as :func:`gradhooks.check_rule` does for a rule).
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from .. import _torch, devices
from .. import pieces as P
from ..errors import (
    BatchNotFoundError,
    CheckFailedError,
    ConfigurationError,
    ConfigurationTypeError,
    GradhooksError,
    MixedExamplesError,
    StateError,
    UnsupportedInputError,
)
from ..oracle import loop_grad
from ..quantities.collector import gram_rounding_bound
from ..rules.registry import Call, ModuleState
from ..tracking import MIXED, UNKNOWN, Layout, Tracker
from ..tracking.layout import owner_map
from .compare import add_held, hold, largest, largest_difference, norm_of
from .plan import Target, frozen_model, owner_name
from .records import (
    Backward,
    CallLayout,
    Frame,
    Probe,
    drop_box,
    graph_task,
    half_precision,
    is_compiling,
    lowest_precision,
    tree_leaves,
    with_fields,
)
from .state import CaptureState


def mismatch(
    got: Tensor | None,
    want: Tensor,
    rows: Tensor | None,
    overall: float,
    float32: float = 2e-2,
    float64: float = 1e-6,
    precision: torch.dtype | None = None,
    exact: bool = False,
    terms: int = 0,
    terms_scale: float = 0.0,
) -> str | None:
    """How ``got`` differs from ``want`` (``None``: within rounding; ``got`` ``None``: zeros;
    ``want`` dense or :func:`~.compare.hold`). ``rows``: the per-example
    gradients ``got`` was reduced from (examples' gradients that cancel in the sum set the
    scale too); ``overall``: the largest entry of the model's gradients; ``float32``: the
    relative tolerance in float32 (the default leaves room for TF32 matrix products on a GPU);
    ``precision``, ``exact``: the lowest precision the computations ran in, and whether they
    differ by the rounding of their last products alone; ``terms``: how many terms autograd's
    kernel added one by one in the half precision to form ``want`` (:func:`rounding_tolerance`),
    and ``terms_scale`` the largest entry of the sum of their magnitudes
    (:meth:`gradhooks.pieces.Piece.terms_scale`), which sets the scale too: a rounding of
    each term is of that term, also where the terms cancel in the sum."""
    if not want.numel():
        return None
    # (no tensor of their size on the way: ``want`` may be held sparse, see compare.hold)
    top_want, top_got = largest(want), 0.0 if got is None else largest(got)
    if not (math.isfinite(top_want) and math.isfinite(top_got)):
        return None
    tol = rounding_tolerance(
        want.dtype, precision, exact, float32=float32, float64=float64, terms=terms
    )
    scale = max(top_want, top_got if rows is None else 0.0, terms_scale)
    if rows is not None and rows.numel():
        scale = max(scale, largest(rows))
    diff = largest_difference(got, want)
    share = cancelled_tolerance(tol, want.dtype, precision)
    if beyond_rounding(diff, scale, overall, tol, want.dtype, share):
        return f"differs by {diff:.2e}, largest {scale:.2e}"
    return None


def beyond_rounding(
    diff: float,
    scale: float,
    overall: float,
    tol: float,
    dtype: torch.dtype,
    share: float | None = None,
) -> bool:
    """Whether two gradients of dtype ``dtype`` that differ by ``diff`` at most differ by more
    than rounding (:func:`mismatch`): ``tol`` relative to ``scale``, their largest entry, and
    ``share`` of ``overall``, the model's (a gradient whose terms cancel:
    :func:`cancelled_tolerance`; ``None``: ``1e-3 · tol``, as in float32)."""
    # float64: a gradient that is zero but for rounding (an InstanceNorm's scale under a
    # summed output) is not compared with its own rounding
    floor = 64 * torch.finfo(dtype).eps if dtype == torch.float64 else 0.0
    if share is None:
        share = 1e-3 * tol
    return diff > tol * scale + share * overall + floor and diff > 0


# A gradient whose terms cancel (zero by symmetry: an attention key's bias, which the softmax's
# shift ignores, a norm's scale ahead of another norm; or small beside its terms: a key's
# projection, through the softmax's Jacobian, whose rows sum to zero) keeps the rounding of
# its terms, not of what is left; its terms are products of the activations and
# output-gradients that also form the model's largest gradient entry, so its room is a share
# of that entry. 1e-3 of the relative tolerance is dozens of units of float32's eps and more
# of float64's; under a half precision, where the tolerance is 8 or 16 of its units, 1e-3 of
# it is a hundredth of a unit, less than such a gradient's rounding: there, CANCELLED_UNITS
# of its eps. Measured under bfloat16 autocast (an RMSNorm's scale ahead of a GroupNorm,
# MultiheadAttention's bias_k and k_proj_weight, on AVX-512, AVX2 and SSE4.1 kernels): up to
# 0.03 units; allowed: 1/8, four times that. The mixings the probe's tests refuse show as
# 0.3 units or more beyond the relative tolerance (tests/test_dp_autocast.py).
CANCELLED_UNITS = 1 / 8


def cancelled_tolerance(
    tol: float, dtype: torch.dtype, precision: torch.dtype | None = None
) -> float:
    """The room, as a share of the model's largest gradient entry, of a check that compares
    two gradients of dtype ``dtype`` whose terms may cancel, computed in ``precision`` with
    the relative tolerance ``tol`` (:func:`rounding_tolerance`): ``1e-3 · tol``, and under a
    half precision at least :data:`CANCELLED_UNITS` of its ``eps``."""
    share = 1e-3 * tol
    if dtype.is_complex:
        dtype = dtype.to_real()
    low = lowest_precision(dtype, precision)
    if half_precision(low):
        share = max(share, CANCELLED_UNITS * torch.finfo(low).eps)
    return share


# Two computations of one gradient (gradhooks' per-example gradients weighted over the
# examples, and autograd's gradient of the examples weighted alike) that each rounded in a half
# precision differ by some of its rounding units (eps) of the largest entry. With weights of
# any value, by a few per layer they went through: measured on Linear, LayerNorm, GELU and
# Embedding stacks of up to 24 residual blocks under CPU autocast, up to 6 units (bfloat16) and
# 8 (float16); allowed: twice that. With weights of powers of two (pieces.example_weights(...,
# exact=True)) or none, the layers carry the weighted rows without rounding and the two differ
# by the rounding of the last products: measured, up to 2.3 units (12 residual blocks);
# allowed: 8. The mixings the probe's tests use show there as 8% to 130% of the largest entry.
# Where autograd's own kernels round a gradient's n terms in the half precision one by one
# (pieces.Piece.rounded_terms: torch's CPU LayerNorm sums its rows so; an RNN or GRU under
# autocast rounds each time step's share, which its rule computes in float32), the rounding
# grows with n, past any fixed number of units (49 at 4096 rows in bfloat16, 609 at 65536
# in float16; 19 over 64 time steps): such a gradient is compared within n units, the
# bound of n roundings (n·eps/2 of the terms' magnitudes, twice that), of the largest sum of
# its terms' magnitudes (pieces.Piece.terms_scale: terms that cancel are rounded as they
# are, not as what is left), so not at all where n·eps reaches 1 (128 terms in bfloat16,
# 1024 in float16); the model's other parameters are still compared as above.
HALF_ROUNDING_UNITS = 16
EXACT_ROUNDING_UNITS = 8


def rounding_tolerance(
    dtype: torch.dtype,
    precision: torch.dtype | None = None,
    exact: bool = False,
    float32: float = 2e-2,
    float64: float = 1e-6,
    terms: int = 0,
) -> float:
    """The relative tolerance of a check that compares two gradients of dtype ``dtype``
    computed in ``precision`` (the lowest precision the hooked calls ran in: their tensors'
    dtypes and autocast's, :func:`records.call_precision`; ``None``: ``dtype``'s own):
    ``float64`` or ``float32`` for those dtypes, and, where either is a half precision
    (bfloat16, float16), :data:`EXACT_ROUNDING_UNITS` (``exact``: the two computations carried
    the same rows, or rows weighted by powers of two, through the layers) or
    :data:`HALF_ROUNDING_UNITS` of its ``eps``, if that is larger. A mixing of the examples
    smaller than that cannot be told from rounding: ``exact``, in bfloat16 ``8 · 2⁻⁷ ≈ 0.06``
    of the largest entry, in float16 ``8 · 2⁻¹⁰ ≈ 0.008``; else twice that. ``terms``: how
    many terms autograd's kernel added one by one in the half precision to form the gradient
    compared with (:attr:`gradhooks.pieces.Piece.rounded_terms`): at least ``terms`` units."""
    if dtype.is_complex:  # (as its real and imaginary parts)
        dtype = dtype.to_real()
    tol = {torch.float64: float64, torch.float32: float32}.get(dtype, 0.0)
    lowest = lowest_precision(dtype, precision)
    if lowest is not None and torch.finfo(lowest).eps > torch.finfo(torch.float32).eps:
        units = EXACT_ROUNDING_UNITS if exact else HALF_ROUNDING_UNITS
        tol = max(tol, max(units, terms) * torch.finfo(lowest).eps)
    return tol


# The probe compares two computations, not one reduced two ways: room for a model's own float32
# parts inside a float64 one (Hugging Face's norms and softmax), and, in float32, for TF32
# convolutions on a GPU; under autocast, rounding_tolerance's room for its precision.
PROBE_TOLERANCE = {"float64": 1e-5, "float32": 5e-3}

# how many entries of a parameter's gradient the spot check compares (Verifier.spot_check),
# spread evenly over it
SPOT_ENTRIES = 32


def _size(terms_scale: Tensor | None) -> float:
    """A parameter's :attr:`Backward.terms_scale` as a number (0: none)."""
    return 0.0 if terms_scale is None else float(terms_scale)


def _weighted_size(bw: Backward, pid: int, weighted: float) -> float:
    """The scale of the rounding of a parameter's gradient weighted over the examples (the
    probe's, or a workflow's check's): its terms' (:attr:`Backward.terms_scale`) times
    ``weighted``, the largest weight (times the mean's factor); and, where several calls'
    shares were each rounded in a half precision, the sum of their largest entries weighted
    alike (:attr:`Backward.shares`)."""
    size = weighted * _size(bw.terms_scale.get(pid))
    calls = bw.shares.get(pid)
    if calls is not None and len(calls) > 1 and all(found is not None for _, found in calls):
        size = max(size, float(sum(found for _, found in calls)))
    return size


def probe_precision(bw: Backward, probe: Probe, pid: int, dtype: torch.dtype) -> torch.dtype | None:
    """The precision the probe compares a parameter's gradient in (of dtype ``dtype``): the
    lowest its backward's calls and its forward ran in, but the parameter's own where that is
    a half precision and the parameter's gradient was computed in its own, on both sides: every
    call of it in the backward was owned (its rule computes in the parameters' dtype, and the
    probe's reference through the call is autograd's in that dtype too,
    :func:`~.capture._rerun_as_rule`), the only owned call of the backward (another's
    input-gradients, the rule's there and autograd's in the probe, each rounded to the half
    precision, may round apart by a unit), and no use of the parameter outside a call. The
    output-gradients the two sides start from are then the same rows, weighted by powers of
    two (:func:`pieces.example_weights`, ``exact``), which every operation between the call
    and the model's outputs carries without rounding: only a mixing of the examples there (or
    a wrong rule) makes them differ by more than that precision's rounding."""
    low = lowest_precision(bw.precision, probe.precision)
    if (
        half_precision(low)
        and probe.exact
        and bw.owned_calls == 1
        and bw.owned_only.get(pid, False)
        and pid not in bw.direct
        and not bw.rounded.get(pid)
        and dtype in (torch.float32, torch.float64)
    ):
        return dtype
    return low


def keep_check_shares(state: CaptureState, bw: Backward) -> None:
    """At the end of backward ``bw``, where a workflow checks it itself
    (:attr:`CaptureState.check_weights`): the room of that check, per parameter that several
    calls reached (:attr:`CaptureState.check_shares`)."""
    state.check_weights = None
    state.check_shares = {
        pid: _weighted_size(bw, pid, 0.0) for pid, calls in bw.shares.items() if len(calls) > 1
    }


def _fold_shares(bw: Backward) -> None:
    """Where several calls' shares of a parameter's gradient were each rounded in a half
    precision (:attr:`Backward.shares`), the sum of their largest entries is the scale of that
    rounding too: taken into :attr:`Backward.terms_scale`, which the checks of the gradient
    (this backward's, and :meth:`Hooks.check`'s after it) allow for."""
    for pid, calls in bw.shares.items():
        if len(calls) > 1:
            total = sum(own for own, _ in calls)
            found = bw.terms_scale.get(pid)
            bw.terms_scale[pid] = total if found is None else torch.maximum(found, total)


def _flat_entries(found: list, batch: int) -> Tensor:
    """The flat indices ``[batch, entries]`` of a spot check's entries in each example's row of
    a ``grad1`` of ``batch`` examples (``torch.take``), kept in ``found`` (the parameter's
    ``[numel, entries, {batch: indices}]``) for the next backward of that batch."""
    numel, entries, by_batch = found[:3]
    at = by_batch.get(batch)
    if at is None:
        at = by_batch[batch] = entries + numel * torch.arange(batch)[:, None]
    return at


def _ones_row(found: list, rows: Tensor) -> Tensor:
    """``[1, batch]`` ones in ``rows``' dtype: the spot check's sum over the ``batch`` rows, as a
    product, kept in ``found`` (the parameter's ``[numel, entries, {batch: indices}, {batch:
    ones}]``) for the next backward of that batch (never written)."""
    batch = rows.shape[0]
    ones = found[3].get(batch)
    if ones is None or ones.dtype is not rows.dtype:
        ones = found[3][batch] = torch.ones(1, batch, dtype=rows.dtype, device=rows.device)
    return ones


@functools.lru_cache(maxsize=64)
def _spot_tolerance(
    dtype: torch.dtype, precision: torch.dtype | None, since: torch.dtype | None
) -> float | None:
    """:func:`rounding_tolerance` of the spot check (``None``: no check, under a half precision
    in this backward, ``precision``, or since the last ``clear()``, ``since``)."""
    low = lowest_precision(lowest_precision(dtype, precision), since)
    if low is not None and torch.finfo(low).eps > torch.finfo(torch.float32).eps:
        return None
    return rounding_tolerance(dtype, precision, True)


@contextlib.contextmanager
def retained_grads(refs: list[weakref.ref]) -> Iterator[None]:
    """Puts back the ``.grad`` of each tensor of ``refs`` that retains its gradient
    (``retain_grad()``) as it was before: a backward of autograd's own (``autograd.grad``)
    adds to it as ``backward()`` does."""
    kept = [(t, t.grad) for ref in refs if (t := ref()) is not None and t.retains_grad]
    try:
        yield
    finally:
        for t, g in kept:
            t.grad = g


def _probe_from(verifier: weakref.ref, token: object, grads: tuple) -> None:
    """The probe's hook on the outputs of the forward whose box holds ``token``: where that box
    is still the verifier's (the last or the one before; two forwards since, or the handle's
    removal, dropped it), :meth:`Verifier._probe` with it."""
    v = verifier()
    if v is None:
        return
    for box in (v.probe_box, v.earlier_box):
        if box is not None and box.get("token") is token:
            v._probe(box, grads)
            return


def _dependent(edges: list) -> bool:
    """Whether one of the outputs (their gradient edges) is computed from another: the
    gradient reaching the other then holds what flowed in through the first."""
    if len(edges) < 2:
        return False
    nodes = {e.node for e in edges if e.node is not None}
    for e in edges:
        seen, todo = set(), [n for n, _ in e.node.next_functions if n is not None]
        while todo:
            n = todo.pop()
            if n in nodes:
                return True
            if n in seen:
                continue
            seen.add(n)
            todo.extend(m for m, _ in n.next_functions if m is not None)
    return False


_EXAMPLES_NOT_APART = (
    "Either the model mixes the examples of the batch between these parameters and its output "
    "(an operation, custom autograd.Function or kernel that computes across the rows of the "
    "batch, in its forward or its backward, or in the code between two calls of its modules "
    "made outside its forward; or a layer that computes a parameter's use once and keeps "
    "it): one example's loss then depends on the others' and per-example gradients "
    "do not exist; keep the examples apart (compute what needs the whole batch outside the "
    "model, or use running statistics) or freeze these parameters. Or a custom "
    "autograd.Function's backward is not linear in the gradient it is given (it clips or "
    "normalizes each row's gradient): an example's gradient then depends on the loss's scale "
    "(the batch's mean divides it) and has no per-example value: make that backward linear "
    "in its gradient. Or gradhooks read the examples from the wrong "
    "place{lost}: say "
    "where the model's batch is with add_hooks(..., batch_dim=k), or register a rule for the "
    "layer. This is checked on the first backward of each new set of layer calls, again at the "
    "2nd, 4th, 8th... backward, and at every backward after one it refused."
)


def _lost(probe: Probe) -> str:
    if not probe.lost:
        return ""
    return f" after {', '.join(probe.lost)}, whose effect on the batch it does not know"


def _listed(items: list[str], n: int = 5) -> str:
    more = f" and {len(items) - n} more" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def per_example_outputs(
    target: Target,
    layout: CallLayout,
    call: Call,
    create_graph: bool,
    precision: torch.dtype | None = None,
) -> Call:
    """A call that does not depend on the examples (or the outputs of a call with examples
    that do not depend on them, its others left as they are): its output-gradients per
    example, from where its outputs met the batch (the tracker's sources), checked against
    autograd's, to
    the rounding of ``precision``, the lowest the backward's calls ran in (where they meet the
    batch under autocast, the shares are products of bfloat16 or float16 operations)."""
    where = target.where
    task = graph_task()
    grads = []
    shared = layout.kind == "shared"
    for g, source in zip(call.grad_outputs, layout.sources):
        if g is None or (source is None and not shared):
            grads.append(g)  # (of a call with examples: an output that holds them, as it is)
            continue
        per = None if source is None else source.grads.pop(task, None)
        problem = None if source is None else source.problem
        shape = tuple(g.shape)
        if create_graph:
            problem = "a create_graph=True backward runs through it"
        if not shared and (problem is not None or per is None):
            # (beside outputs that hold the examples: a log-determinant of the parameters)
            raise UnsupportedInputError(
                f"{where}: its output {shape} does not depend on the examples while its inputs "
                "do, and "
                + (problem if problem is not None else "its gradient never met the batch in "
                   "the forward (the model returns it, or a loss term uses it alone)")
                + ", so gradhooks cannot tell each example's share of its gradient. Add it to "
                "each example's result inside the model's forward (as a flow adds a layer's "
                "log-determinant to the examples' own), register a rule for this module with "
                "@gradhooks.register (see docs/extending.md), or freeze its parameters."
            )  # fmt: skip
        if problem is not None:
            raise BatchNotFoundError(
                f"{where}: its inputs do not depend on the examples (its output {shape} is "
                f"broadcast into the batch later), and {problem}, so gradhooks cannot tell each "
                "example's share of its gradient. Compute its input per example (expand it to "
                "the batch before the layer), or freeze its parameters."
            )
        if per is None:
            raise BatchNotFoundError(
                f"{where}: its inputs do not depend on the examples, and its output {shape} "
                "received a gradient that never met the batch (the model returns it, or a loss "
                "term uses it alone): that gradient belongs to no example. Compute that term "
                "from per-example outputs, or freeze the layer's parameters. If its input does "
                "depend on the examples, gradhooks could not follow them to it: something it "
                "cannot see into computed it (a TorchScript function, made by torch.jit.script "
                "or torch.jit.trace, or an extension's operator called directly: run that "
                "function as Python instead), or it was given to the model with another number "
                "of rows than the batch taken from its first input."
            )
        total = per.sum(0)
        tol = rounding_tolerance(g.dtype, precision, float32=1e-4, float64=1e-7)
        # isclose(total, g, rtol=tol, atol=tol * scale, equal_nan=True), with the scale (the
        # largest finite entry of g; NaN and Inf are carried through, as autograd does) kept
        # on g's device: one value read back, not two
        size = g.abs()
        scale = (
            size.masked_fill(~torch.isfinite(g), 0).amax().clamp_min(1e-30) if g.numel() else 1.0
        )
        close = ((total - g).abs() <= tol * (size + scale)) | (total == g)
        close |= total.isnan() & g.isnan()
        if not bool(close.all()):
            scale = float(scale)
            diff = float((total - g).abs().nan_to_num(nan=float("inf")).max())
            raise BatchNotFoundError(
                f"{where}: its inputs do not depend on the examples; the per-example shares of "
                f"its output's gradient found where it meets the batch add up to within "
                f"{diff:.2e} of the gradient autograd gives it (largest {scale:.2e}): part of "
                "its gradient reached it another way (a term of the loss that uses it alone?). "
                "Its per-example gradients would be wrong: freeze its parameters, or compute "
                "its input per example."
            )
        grads.append(per)
    # (the module's state the call ran with holds in this layout too; what its nodes saved not)
    saved = call.saved if isinstance(call.saved, ModuleState) else None
    return with_fields(call, grad_outputs=tuple(grads), taps=None, saved=saved)


def example_scales(g: Tensor, layout: Layout, weights: Tensor) -> tuple[Tensor, Tensor]:
    """For an output-gradient ``g`` whose examples lie as ``layout`` says, and ``[batch]``
    ``weights``: the weight of each entry's example, and ``1`` where the entry is the last
    example's (else ``0``), both in ``g``'s dtype and of ``g.dim()`` dimensions of size 1 but
    the layout's (they broadcast against ``g``). An entry of no example weighs 0."""
    batch = weights.shape[0]
    owner = owner_map(g, layout, batch)
    inside = (owner >= 0) & (owner < batch)
    w = weights.to(device=g.device, dtype=g.dtype)[owner.clamp(0, batch - 1)]
    return w * inside, (owner == batch - 1).to(g.dtype)


def _add_weighted(sums: dict[int, Tensor | None], call: P.CallPieces, weights: Tensor) -> None:
    """Adds a call's pieces, weighted over the examples (:func:`pieces.weighted_sum`), to
    ``sums`` (per parameter id, as :func:`~.compare.hold` keeps them; ``None``: a layer that
    counts its examples otherwise)."""
    for name, p in call.params.items():
        pid = id(p)
        if pid in sums and sums[pid] is None:
            continue
        total = P.weighted_sum([P.PieceUse(call.pieces[name], p, call.scale)], weights)
        total = None if total is None else hold(total)
        sums[pid] = total if total is None or pid not in sums else add_held(sums[pid], total)


class Backwards(Protocol):
    """What :class:`Verifier` asks of the backward's part
    (:class:`~gradhooks.engine.backward.BackwardWriter`)."""

    def backward_state(self) -> Backward:
        """The bookkeeping of the backward running now."""
        ...

    def grad1_of_backward(self, bw: Backward, pid: int, p: nn.Parameter) -> Tensor | None:
        """What backward ``bw`` added to ``p.grad1``."""
        ...

    def rollback(self, bw: Backward) -> None:
        """Put back what backward ``bw`` wrote."""
        ...

    def refuse(self, bw: Backward) -> None:
        """Before a refusal of backward ``bw``: its ``grad1`` and its additions to ``.grad``
        undone, nothing of it left collected."""
        ...


class Verifier:
    """The probe and the checks of a backward (a part of :class:`gradhooks.Hooks`)."""

    # the other parts it calls, given by the handle that owns them all
    backwards: Backwards

    def __init__(self, state: CaptureState) -> None:
        self.state = state
        self.probe_box: dict | None = None  # the outputs of the forward the probe starts from
        # the box of the forward armed before probe_box's, not backpropagated yet: a forward
        # run in between and never backpropagated (a logging forward with grad on) does not
        # take the check from it
        self.earlier_box: dict | None = None
        # the largest entry of the model's gradients at the last full check (verify_backward):
        # the scale the spot check compares a gradient that is zero by symmetry against
        self.overall = 0.0

    def arm_probe(self, frame: Frame, tracker: Tracker, output: Any) -> None:
        """Get ready to check, at the next backward that verifies, one example's ``grad1``
        against autograd's gradient of that example's rows of the model's outputs alone
        (:meth:`_probe`): what mixes the examples where neither the tracker nor the sum over
        the batch can see it (a custom ``autograd.Function`` or kernel that computes across the
        batch) shows there."""
        if self.probe_box is not None:  # (an earlier forward not backpropagated yet: kept)
            if self.earlier_box is not None:
                drop_box(self.earlier_box)
            self.earlier_box = self.probe_box or None  # (a box that ran is empty)
            self.probe_box = None
        if (
            not (self.state.verify and self.state.checks_examples)
            or self.state.sharded
            or frame.unprobed
            or tracker.batch < 2
            or is_compiling()
            or self.user_backward_hooks()
        ):
            return
        outs, layouts = [], []
        for t in tree_leaves(output):
            if not (isinstance(t, Tensor) and t.requires_grad and t.grad_fn is not None):
                continue
            lay = tracker.layout(t)
            if lay is UNKNOWN:
                # the tracker lost the examples on the way: where it presumes them, or on the
                # model's batch dimension (a guess: wrong, the check can only refuse)
                dim = self.state.batch_dim if isinstance(self.state.batch_dim, int) else 0
                lay = tracker.presumed.get(t)
                if lay is None and t.dim() > dim and t.shape[dim] == tracker.batch:
                    lay = Layout(dim)
            outs.append(t)
            layouts.append(lay if lay is not None and lay.dim >= 0 else None)
        if not any(layouts):
            return
        box = {
            "edges": [torch.autograd.graph.get_gradient_edge(t) for t in outs],
            "layouts": layouts,
            "batch": tracker.batch,
            "frame": id(frame),
            "lost": tuple(tracker.unknown),
            # the tensors whose gradient the user keeps (h.retain_grad(), in the forward or
            # on an output after it), whose .grad the check's backwards must leave as it was
            "retained": [*tracker.retained, *(weakref.ref(t) for t in outs)],
        }
        # the precision its calls and the operations between them ran in (a float64 model that
        # takes its softmax in float32), and whether that rounds more than its outputs hold:
        # then the weights are powers of two, by which each example's rows are carried through
        # that rounding exactly, and the two sides of the check round alike
        low = lowest_precision(tracker.precision, *(state.precision for state in frame.states))
        box["precision"] = low
        box["exact"] = half_precision(low) or any(
            low is not None
            and t.is_floating_point()
            and torch.finfo(t.dtype).eps < torch.finfo(low).eps
            for t in outs
        )
        self.probe_box = box
        # (the hook, which torch keeps on the outputs' nodes, reaches the box through the
        # verifier, weakly: holding either, it would make a cycle through those nodes that the
        # garbage collector cannot see, keeping a model dropped with its hooks on alive with
        # this forward's graph)
        token = box["token"] = object()
        probe = functools.partial(_probe_from, weakref.ref(self), token)
        if len(outs) == 1:
            outs[0].register_hook(lambda g: probe((g,)))
        else:  # (its closure holds the outputs' nodes: removed once it ran, see drop_box)
            box["handle"] = _torch.all_grads_hook(outs, probe)
        # (a hook the user puts on an output after the forward: no probe then, see _probe)
        box["hooks"] = [(weakref.ref(t), _torch.tensor_hooks(t)) for t in outs]

    def drop_boxes(self) -> None:
        """Let go of the forwards' graphs the probe was armed on (the handle removed, or a
        check of the caller's own in its place)."""
        for box in (self.probe_box, self.earlier_box):
            if box is not None:
                drop_box(box)
        self.probe_box = self.earlier_box = None

    def keep(self, bw: Backward, pieces: dict, live: dict, scale: float) -> None:
        """A call's pieces, on a backward that verifies the norms (without ``grad1``), for
        :meth:`verify_norms`: weighted over the examples as the probe's output rows were
        (:func:`pieces.weighted_sum`) and added up per parameter as the calls come, held as
        :func:`~.compare.hold` keeps them (not every call's pieces until the end); before the
        probe ran, the pieces themselves."""
        # (fresh pieces: none of the columns the norms may cache)
        call = P.CallPieces({n: pieces[n].select(slice(None)) for n in live}, live, scale)
        if bw.probe is None:
            bw.kept.append(call)
        else:
            _add_weighted(bw.weighted, call, bw.probe.weights)

    def user_backward_hooks(self) -> bool:
        """Whether a backward through the model runs module or parameter hooks of the user's (a
        module's full backward hook or pre-hook, a global one, a hook on a parameter): then no
        backward of the checks' own runs, for those hooks to fire exactly as often as without
        gradhooks (the checks that need none still do). A gradient hook on an activation does
        not leave the checks out: it may compute across the batch, which only they see (it
        runs again in each of the probe's backwards, as :func:`gradhooks.add_hooks` says)."""
        model = self.state.model
        params = [p for _, p in self.state.params.values()]
        own = 1  # (gradhooks' own hook on each parameter)
        return model is not None and _torch.user_backward_hooks(model.modules(), params, own)

    def _probe(self, box: dict, grads: tuple) -> None:
        """At the start of a backward that verifies (the first of each new set of calls), with
        the model's output-gradients in hand: every parameter's gradient from them with each
        example's rows weighted (:func:`pieces.example_weights`), by a backward of autograd's own through the
        same graph (the hooks stand aside). :meth:`verify_backward` compares it with ``grad1`` (or, for
        norms, the pieces' batch sum) weighted alike. Only where every output that has a gradient holds the examples
        where the tracker followed them, and none is computed from another (whose gradient
        would then be counted twice); an output that lost them (a loss computed inside the
        model) leaves the check out."""
        if (
            "edges" not in box
            or self.state.removed
            or not self.state.mode.capture
            or self.state.rerunning
            or torch.is_grad_enabled()  # (a create_graph backward)
            or not self.state.capturing_backward()
            or any(g is not None and _torch.is_grads_batched(g) for g in grads)
        ):
            return  # (an is_grads_batched backward: the next one is checked)
        if any((t := ref()) is not None and _torch.tensor_hooks(t) > n for ref, n in box["hooks"]):
            return  # (hooks of the user's on an output, which a backward of its own would run)
        bw = self.backwards.backward_state()
        if not bw.verify or bw.probe is not None:
            return
        used = [(e, g, lay) for e, g, lay in zip(box["edges"], grads, box["layouts"])
                if g is not None]  # fmt: skip
        if (
            not used
            or any(lay is None for _, _, lay in used)
            or _dependent([e for e, _, _ in used])
        ):
            return
        batch, box_frame, lost = box["batch"], box["frame"], box["lost"]
        exact = box["exact"]
        weights = P.example_weights(batch, exact)
        if any(lay.size(batch) != g.shape[lay.dim] for _, g, lay in used):
            return
        # (each entry times its example's weight: a tensor the size of the layout's dimension
        # alone, broadcast, never one of the batch times the output's size)
        scales = [example_scales(g, lay, weights) for _, g, lay in used]
        pids = list(self.state.params)
        params = [self.state.params[pid][1] for pid in pids]
        edges = [e for e, _, _ in used]

        def grads_from(rows: Callable[[Tensor, tuple], Tensor]) -> list:
            # (the output-gradients it is given are freed once it returns, and what it gives
            # is held as compare.hold keeps it: one at a time, and no more than needed)
            found = list(torch.autograd.grad(
                edges, params, [rows(g, sc) for (_, g, _), sc in zip(used, scales)],
                retain_graph=True, allow_unused=True,
            ))  # fmt: skip
            return [hold(found.pop(0)) for _ in pids]

        kept = retained_grads(box["retained"])
        try:
            with self.standing_aside(), kept:
                # (without grad1, the norms themselves are checked too: the last example's, of
                # which the norm alone is kept; first, while nothing else is held)
                alone = None if self.state.grad1 else [
                    None if a is None else norm_of(a)
                    for a in grads_from(lambda g, sc: g * sc[1])
                ]  # fmt: skip
                found = grads_from(lambda g, sc: g * sc[0])
                plain = grads_from(lambda g, sc: g)
        except Exception:  # (reentrant checkpointing refuses it; the backward raises the rest)
            found = plain = alone = None
        # (the graph's edges and hooks: no cycle through the hook that holds them. The box
        # stays the handle's: a backward that fails never runs the callback, and the next
        # forward or remove() lets go of it instead)
        _torch.queue_backward_callback(lambda: drop_box(box))
        if box is self.probe_box and self.earlier_box is not None:
            drop_box(self.earlier_box)  # (the check has its forward: the one before is let go)
            self.earlier_box = None
        if found is not None:
            grads_of = {pid: g for pid, g in zip(pids, found) if g is not None}
            plain_of = {pid: g for pid, g in zip(pids, plain) if g is not None}
            alone_of = {pid: g for pid, g in zip(pids, alone or ()) if g is not None}
            bw.probe = Probe(box_frame, weights, grads_of, plain_of, alone_of, lost, exact,
                             box["precision"])  # fmt: skip

    @contextlib.contextmanager
    def standing_aside(self) -> Iterator[None]:
        """A backward of autograd's own through the model's graph, to check against (one
        example's gradient): the hooks capture nothing, and calls run detached or owned give
        autograd's gradients by running their forward again (no rule runs)."""
        mode, self.state.mode = self.state.mode, replace(self.state.mode, param_grads=True)
        self.state.probing = True
        self.state.rerunning += 1
        try:
            yield
        finally:
            self.state.rerunning -= 1
            self.state.probing = False
            self.state.mode = mode

    def check_listed(self, module: nn.Module, tracker: Tracker) -> None:
        """Refuses a forward that joined the tensors of a list as the examples, one each, where
        the batch was taken from a dimension of one of them (:attr:`Tracker.listed_joins`):
        every grad1 would have a row per entry of that dimension, summed over the list."""
        if not tracker.listed_joins:
            return
        join = tracker.listed_joins[0]
        where = f"'{type(module).__qualname__}' (the model)"
        if join.padded:
            raise UnsupportedInputError(
                f"{where}: its forward pads {join.count} sequences with pad_sequence, and "
                f"gradhooks took the examples from dimension 0 of one of them ({join.shape}), "
                "its length: the model was given a list of sequences, one per example, and "
                "gradhooks takes the examples from a dimension of a tensor, so every grad1 "
                "would have a row per time step. Pad the sequences before the call (a "
                "DataLoader's collate_fn: pad_sequence(batch, batch_first=True), with their "
                "lengths or a mask) and give the model the padded batch, or compute the "
                "gradients one sequence at a time (gradhooks.oracle.loop_grad)."
            )
        raise BatchNotFoundError(
            f"{where} was given its first input in a list (or tuple) with other tensors of "
            f"its size, and its forward joins {join.count} tensors of shape {join.shape} (the "
            f"list's, or computed from each alone) with torch.{join.op} along a dimension in "
            "front of the one gradhooks takes the examples from by default (dimension 0 of "
            f"the first input, {tracker.batch} entries). Were each tensor of the list one "
            "example, every grad1 "
            "would have a row per entry of that dimension, summed over the list; were each a "
            "batch of the same examples (two views of one batch), it would be right, and "
            "their shapes cannot tell which. If each is one example, stack them before the "
            "call (as a DataLoader's default collate_fn does) and give the model the batch; "
            "if each holds the same examples on its dimension 0, say so with "
            "add_hooks(model, batch_dim=0)."
        )

    def check_output(
        self, module: nn.Module, tracker: Tracker, output: Any, leaves: list | None = None
    ) -> None:
        """Refuses a forward whose outputs lost the examples by mixing them (a mean over what
        was taken as the batch: a sequence-first model read batch-first), where no output keeps
        them apart, and one where rows picked by their place in the batch reached a hooked
        module or the outputs for some examples and not for others (``lin(x[:2])``:
        :meth:`Tracker.uneven_placed`). ``leaves``: ``tree_leaves(output)``, where the caller
        has them."""
        if leaves is None:
            leaves = tree_leaves(output)
        outs = [t for t in leaves if isinstance(t, Tensor) and t.requires_grad]
        lays = [tracker.layout(t) for t in outs]
        self._check_order(module, outs, lays)
        if outs and (tracker.placed or tracker.decided or any(
            lay is not None and lay.owners is not None for lay in lays
        )):  # fmt: skip
            why = tracker.uneven_placed(outs, f"'{type(module).__qualname__}' (the model)")
            if why is not None:
                raise MixedExamplesError(why)
        mixed = [t for t, lay in zip(outs, lays) if lay is MIXED and t.dim() > 0]
        if not mixed or any(lay is not None and lay is not MIXED for lay in lays):
            return  # (an output that keeps the examples, or whose layout was lost)
        ops = tracker.mixing()
        first = "" if tracker.given_shape is None else f", of shape {tracker.given_shape}"
        where = (
            f"dimension 0 of its first tensor input{first}"
            if self.state.batch_dim == "auto"
            else (f"dimension {self.state.batch_dim}")
        )
        shapes = ", ".join(str(tuple(t.shape)) for t in mixed)
        raise MixedExamplesError(
            f"{type(module).__qualname__}: its output ({shapes}) mixes the {tracker.batch} examples that gradhooks took from {where} "
            f"({ops}), so per-example gradients do not exist. If the model's batch is another "
            "dimension (a sequence-first model), say which with add_hooks(model, batch_dim=k); "
            "if it is another input (a mask or a table passed before the batch), pass the batch "
            "first."
        )

    @staticmethod
    def _check_order(module: nn.Module, outs: list[Tensor], lays: list) -> None:
        """Refuses a forward whose output holds the examples in another order than its input
        (``h.roll(1, 0)``, ``h[perm]``, the rows sorted by a key and not put back): each row is
        one example's, but a loss that pairs the rows with targets in the input's order
        (``cross_entropy(out, y)``) would pair one example's output with another's target,
        which the per-example computation never does."""
        for t, lay in zip(outs, lays):
            rows = lay.owners.rows if lay is not None and lay.owners is not None else None
            if rows is None or rows.numel() < 2 or bool((rows[1:] >= rows[:-1]).all()):
                continue
            raise BatchNotFoundError(
                f"{type(module).__qualname__}: its output ({tuple(t.shape)}) holds the "
                "examples in another order than its input (rolled, permuted or sorted along "
                f"the batch's dimension {lay.dim}, and not put back), so a loss that pairs its "
                "rows with targets would pair one example's output with another's target. "
                "Put the rows back in order before returning them (h[perm.argsort()], "
                "h.roll(-shifts, dim)), or compute the loss inside the forward."
            )

    def coupled_reached(self, why: str, after: tuple) -> None:
        """A backward reaches a product that couples the examples' gradients (``why``; see
        :mod:`gradhooks.tracking.couplings`), whose autograd node passes to the nodes
        ``after``: a backward that writes ``grad1`` of a parameter before it is refused, and
        what it wrote so far is undone, naming the parameters nearest to the product."""
        self._refuse_reached(after, lambda names: (
            "passes through a term of the loss that couples the examples: "
            f"{why}. Such a loss is no sum of per-example losses (not even up to a factor "
            "common to every example), so these parameters have no per-example gradients; "
            "their grad1 would be each example's share of the batch's gradient. Nothing was "
            "written. Leave that term out of the loss whose per-example gradients you want (a "
            "mixture of experts' load-balancing loss: compute the loss from the logits, with "
            "output_router_logits=False, as DPTrainer does), compute it per example (its "
            "reductions over each example's own tokens), or freeze these parameters."
        ))  # fmt: skip

    def lost_reached(self, why: str, after: tuple) -> None:
        """A backward reaches the autograd node of an operation that lost the examples' rows
        (``why``; see :func:`gradhooks.tracking.alone.guard_rows`): its result holds them
        nowhere the tracker can say, so nothing after it, a rule's or the probe's, can tell
        one example's rows from another's. Refused as :meth:`coupled_reached` is."""
        self._refuse_reached(after, lambda names: (
            f"passes through {why}, so gradhooks cannot tell which example each of its "
            "entries belongs to: the operation may combine rows of different examples, or "
            "reorder them (each example's gradient would then be the share of others), or "
            "cut or repeat each example's rows (which would be right). Nothing was written. "
            "Compute it per example (torch.vmap over the batch, or an operation gradhooks "
            "follows: reshape, gather, index_select), keep its result out of the loss, "
            "register a rule for the module that computes it (@gradhooks.register), or freeze "
            "these parameters; gradhooks.oracle.loop_grad computes the per-example gradients "
            "one example at a time."
        ))  # fmt: skip

    def _refuse_reached(self, after: tuple, says: Callable[[list[str]], str]) -> None:
        """Refuse the capturing backward that reached a node whose next nodes are ``after``,
        undoing what it wrote, where a parameter of the hooks lies before it: the error
        names the nearest such parameter, then ``says(names)``."""
        state = self.state
        if state.probing or state.rerunning or state.removed or not state.mode.capture:
            return
        bw = self.backwards.backward_state()
        if not bw.capturing:
            return
        names = _nearest_params(after, state.params)
        if not names:
            return  # (no parameter of the hooks before it: no grad1 of it)
        state.tasks.pop(graph_task(), None)
        self.backwards.refuse(bw)
        prefix, _ = owner_name(names[0])
        model = state.model
        module = model.get_submodule(prefix) if model is not None else None
        where = f"'{prefix or '<model>'}'" + (
            f" ({type(module).__qualname__})" if module is not None else ""
        )
        raise MixedExamplesError(
            f"{where}: the gradient of its parameter '{names[0]}' "
            + (f"(and of {_listed([repr(n) for n in names[1:]])}) " if names[1:] else "")
            + says(names)
        )

    def verify_backward(self, bw: Backward) -> None:
        """The last line of defence, on the first backward of each new set of calls: every
        parameter's ``grad1`` of this backward reduces to the gradient autograd computed for it
        (a use of a parameter that the hooks did not see would show here), and one example's
        ``grad1`` is autograd's gradient from that example's rows of the model's
        output-gradients alone (:meth:`_probe`: what mixes the examples unseen would show
        there). A mismatch undoes the backward's ``grad1`` and raises, naming the
        parameters."""
        _fold_shares(bw)
        wrong = []
        # (a parameter whose gradient is zero by symmetry, a key's bias, is compared against
        # the model's scale, not its own rounding)
        overall = max((largest(g) for g in bw.grads.values() if g.numel()), default=0.0)
        self.overall = overall
        for pid, grad in bw.grads.items():
            name, p = self.state.params[pid]
            if pid in self.state.exempt:
                continue
            g1 = self.backwards.grad1_of_backward(bw, pid, p)
            if g1 is None:
                got = None  # (zeros)
            else:
                got = g1.mean(0) if self.state.loss_reduction == "mean" else g1.sum(0)
                grad = grad.to(got.dtype)
            diff = mismatch(
                got, grad, g1, overall, precision=bw.precision, exact=True,
                terms=bw.rounded.get(pid, 0), terms_scale=_size(bw.terms_scale.get(pid)),
            )  # fmt: skip
            del got
            if diff is not None:
                wrong.append(f"'{name}' ({diff})")
        if wrong:
            self._refuse_sums(
                bw,
                wrong,
                "This is checked on the first backward of each new set of layer calls, and at "
                "every backward after one it refused.",
            )
        probe = bw.probe
        if probe is not None and probe.frame in bw.frames:
            self._verify_probe(bw, probe)
        self.state.unverified -= bw.verify

    def _refuse_sums(self, bw: Backward, wrong: list[str], when: str) -> None:
        """Undo backward ``bw``'s ``grad1`` and refuse it: ``grad1`` of the parameters ``wrong``
        does not add up to autograd's gradient."""
        self.backwards.refuse(bw)
        self.state.recheck()
        raise CheckFailedError(
            f"gradhooks: grad1 does not add up ({self.state.loss_reduction} over the batch) to the "
            f"gradient autograd computed in the same backward, for {_listed(wrong)}. Its "
            "grad1 was not written. Either a use of the parameter that the hooks did not "
            "see (a custom operation or kernel: register a rule for the module), or a term "
            "of the loss that does not come from the examples (weight decay or a penalty "
            "added to the loss: add its gradient to .grad yourself, or pass add_hooks(..., "
            f"verify=False) to keep grad1 of the per-example terms alone). {when}"
        )

    def spot_of(self) -> int | None:
        """The parameter (id) whose ``grad1`` the spot check of the backward starting now
        compares (:meth:`spot_check`): the next of the handle's parameters in turn that is on
        the CPU, in single or double precision, and sums to its ``.grad`` (``None``: none is)."""
        ids = list(self.state.params)
        n = len(ids)
        for k in range(n):
            pid = ids[(self.state.spot_next + k) % n]
            p = self.state.params[pid][1]
            if (
                pid in self.state.exempt
                or pid in self.state.sharded
                or not devices.reads_are_free(p)
                or p.dtype not in (torch.float32, torch.float64)
                or not p.numel()
            ):
                continue
            self.state.spot_next = (self.state.spot_next + k + 1) % n
            found = self.state.spot_entries.get(pid)
            if found is None or found[0] != p.numel():
                step = max(1, p.numel() // SPOT_ENTRIES)
                # ([1, entries]: autograd's entries taken as a row, beside grad1's rows)
                entries = torch.arange(0, p.numel(), step)[:SPOT_ENTRIES].unsqueeze(0)
                self.state.spot_entries[pid] = [p.numel(), entries, {}, {}]
            return pid
        return None

    def spot_check(self, bw: Backward) -> None:
        """A backward that :meth:`verify_backward` leaves alone, on the CPU: some entries of one
        parameter's ``grad1`` of this backward (:meth:`spot_of`), reduced over the examples,
        against autograd's gradient (``bw.spot_grad``, kept by the parameter's hook), within
        :func:`beyond_rounding` as :func:`mismatch` (with the model's scale at the last full
        check), its reductions taken in one stack of kernels and one read. What
        starts between two full checks and is no example's (a penalty on the parameters whose
        weight is ramped up from 0) shows at the first backward it reaches, on every parameter
        it touches in turn. Not under a half precision, whose rounding the entries alone cannot
        bound. (A few kernels and one read: it runs at nearly every step.)"""
        pid = bw.spot
        if pid is None or pid in self.state.exempt:
            return
        tol = _spot_tolerance(bw.spot_grad.dtype, bw.precision, self.state.precision)
        if tol is None:
            return
        name, p = self.state.params[pid]
        found = self.state.spot_entries[pid]
        entries = found[1]
        want = bw.spot_grad
        if pid in self.state.written and pid in bw.before:
            g1 = p.grad1
            if g1.requires_grad:
                g1 = g1.detach()
            # (the entries of every example, one index into the flat grad1)
            at = _flat_entries(found, g1.shape[0])
            rows = torch.take(g1, at)
            before = bw.before[pid]
            if before is not None:
                rows = rows - torch.take(before, at)
            if want.dtype != rows.dtype:
                want = want.to(rows.dtype)
            # (the mean's difference as the sum's, over the batch: one kernel fewer)
            mean = self.state.loss_reduction == "mean" and rows.shape[0] > 0
            batch = rows.shape[0] if mean else 1
            # each row's largest entry: the difference's, autograd's, each example's (the
            # rows' sum less batch · autograd's in one product, a row of ones times the rows)
            off = torch.addmm(want, _ones_row(found, rows), rows, beta=-batch)
            largest_of = torch.linalg.vector_norm(
                torch.cat([off, want, rows]), float("inf"), dim=1
            ).tolist()
            diff, scale = largest_of[0] / batch, max(largest_of[1:])
        else:
            diff = scale = float(torch.linalg.vector_norm(want, float("inf")))
        if not (math.isfinite(diff) and math.isfinite(scale)):
            return  # (an overflow: the scaler's step, skipped)
        if beyond_rounding(diff, scale, max(self.overall, scale), tol, want.dtype):
            self._refuse_sums(
                bw, [f"'{name}' (differs by {diff:.2e}, largest {scale:.2e}, over "
                     f"{entries.numel()} of its entries)"],
                "On the CPU, each backward between the full checks compares some entries of "
                "one parameter's grad1, a parameter after another: this one's did not add up.",
            )  # fmt: skip

    def _through_outputs(self, bw: Backward, probe: Probe) -> set[int]:
        """The parameters whose gradient in this backward came through the model's outputs
        alone: the probe's gradient from the output-gradients as they are is autograd's."""
        overall = max((largest(g) for g in bw.grads.values() if g.numel()), default=0.0)
        found = set()
        for pid, grad in bw.grads.items():
            plain = probe.plain.get(pid)
            close = mismatch(
                None if plain is None else plain.to(grad.dtype), grad, None, overall,
                **PROBE_TOLERANCE, precision=lowest_precision(bw.precision, probe.precision),
                exact=True,
            )  # fmt: skip
            if close is None:
                found.add(pid)
        return found

    @staticmethod
    def _probe_tells(bw: Backward, probe: Probe, pid: int) -> bool:
        """In a backward that reached several forwards, whether the probe's forward tells a
        parameter whose gradient came through its outputs alone (:meth:`_through_outputs`)
        apart: one whose calls were all the probe's forward's (as in a backward of one), or
        all of others before it whose outputs reach its outputs (a submodule called by the
        training loop before the last one, ``head(mix(trunk(x)))``), with a gradient through
        them (an earlier forward's share that sums to zero over the batch, a bias under a
        loss of two forwards' difference, leaves the probe's share alone equal to the whole
        without being the whole: left out, as a parameter of both is)."""
        frames = bw.frames_of.get(pid)
        if not frames:
            return False
        if frames == {probe.frame}:
            return True
        plain = probe.plain.get(pid)
        return probe.frame not in frames and plain is not None and largest(plain) > 0

    def _verify_probe(self, bw: Backward, probe: Probe) -> None:
        """:meth:`verify_backward`'s second part: ``grad1`` of this backward, weighted over the examples
        as the probe's output rows were, against autograd's gradient from those rows."""
        scale = float(probe.batch) if self.state.loss_reduction == "mean" else 1.0
        through = self._through_outputs(bw, probe)
        if len(bw.frames) > 1:
            through = {pid for pid in through if self._probe_tells(bw, probe, pid)}
        compared = [pid for pid in probe.grads if pid in through]
        # (each parameter's gradients formed when compared, one at a time)
        overall = scale * max(
            (largest(probe.grads[pid]) for pid in compared if probe.grads[pid].numel()),
            default=0.0,
        )
        # (the terms' scale of the weighted sum: the weights are at most their largest)
        weighted = scale * float(probe.weights.abs().max()) if bw.terms_scale else 0.0
        wrong = []
        for pid in compared:
            name, p = self.state.params[pid]
            if pid in self.state.exempt:
                continue
            g1 = self.backwards.grad1_of_backward(bw, pid, p)
            if g1 is not None and g1.shape[0] != probe.batch:
                continue  # (a layer that counts its examples otherwise: bags)
            want = probe.grads[pid] * scale
            if g1 is None:
                got = None  # (zeros)
            else:
                w = probe.weights.to(device=g1.device, dtype=g1.dtype)
                got = torch.einsum("b,b...->...", w, g1)
                want = want.to(got.dtype)
            diff = mismatch(
                got, want, None, overall, **PROBE_TOLERANCE,
                precision=probe_precision(bw, probe, pid, want.dtype), exact=probe.exact,
                terms=bw.rounded.get(pid, 0), terms_scale=_weighted_size(bw, pid, weighted),
            )  # fmt: skip
            del got, want
            if diff is not None:
                wrong.append(f"'{name}' ({diff})")
        if not wrong:
            return
        self.backwards.refuse(bw)
        self.state.recheck()
        raise CheckFailedError(
            "gradhooks: grad1 is not the examples' own gradients: weighted over the examples, "
            "it is not the gradient autograd gives from the model's output-gradients with each "
            f"example's rows weighted alike, for {_listed(wrong)}. Its grad1 was not written. "
            + _EXAMPLES_NOT_APART.format(lost=_lost(probe))
        )

    def verify_norms(self, bw: Backward, probe: Probe, kept: tuple | None = None) -> None:
        """:meth:`_verify_probe` for a handle without ``grad1``: the per-example gradients the
        norms of this backward were formed from, weighted over the examples as the probe's
        output rows were (:func:`pieces.weighted_sum` of its calls' pieces, :meth:`keep`),
        against autograd's gradient from those rows."""
        collector = self.state.collector
        if collector is None or not collector.param_sq_norms:
            return
        scale = float(probe.batch) if self.state.loss_reduction == "mean" else 1.0
        through = self._through_outputs(bw, probe)
        compared = [pid for pid in probe.grads if pid not in self.state.exempt and pid in through]
        # (each parameter's gradients formed when compared, one at a time)
        overall = scale * max(
            (largest(probe.grads[pid]) for pid in compared if probe.grads[pid].numel()),
            default=0.0,
        )
        sums, bw.weighted = bw.weighted, {}
        while bw.kept:  # (calls whose backward ran before the probe)
            _add_weighted(sums, bw.kept.pop(0), probe.weights)
        alone = {pid: probe.last[pid] * scale for pid in compared if pid in probe.last}
        top = max(alone.values(), default=0.0)
        # (the terms' scale of the weighted sums: the weights are at most their largest)
        weighted = scale * float(probe.weights.abs().max()) if bw.terms_scale else 0.0
        wrong = []
        for pid in compared:
            name = collector.names.get(pid)
            if name not in collector.param_sq_norms:
                continue  # (reached otherwise than by a captured call: collector.missed)
            if pid in sums and sums[pid] is None:
                continue  # (a layer that counts its examples otherwise: bags)
            got = sums.pop(pid, None)  # (None: no call of it: zeros)
            want = probe.grads[pid] * scale
            low = probe_precision(bw, probe, pid, want.dtype)
            diff = mismatch(
                None if got is None else got.to(want.dtype), want, None, overall,
                **PROBE_TOLERANCE, precision=low, exact=probe.exact, terms=bw.rounded.get(pid, 0),
                terms_scale=_weighted_size(bw, pid, weighted),
            )  # fmt: skip
            dtype = want.dtype
            del got, want
            if diff is not None:
                wrong.append(f"'{name}' ({diff})")
                continue
            # the norms formed from those gradients: the last example's, against autograd's
            sq = collector.param_sq_norms[name]
            norm, norm_want = float(sq[-1].clamp_min(0).sqrt()), alone.get(pid, 0.0)
            # (by the parameter's dtype: a bfloat16 parameter's norms are float32 sums)
            tol = rounding_tolerance(
                dtype, low, probe.exact, **PROBE_TOLERANCE, terms=bw.rounded.get(pid, 0)
            )
            miss = abs(norm - norm_want)
            # (a Gram form's rounding kept: |norm - want| <= sqrt(|norm² - want²|))
            rounded = collector.gram_rounding.get(name)
            allowed = 0.0 if rounded is None else float(gram_rounding_bound(rounded[-1])) ** 0.5
            share = cancelled_tolerance(tol, dtype, low)
            if miss > tol * max(norm, norm_want) + share * top + allowed and miss > 0:
                wrong.append(f"'{name}' (the last example's norm {norm:.4g}, autograd's "
                             f"{norm_want:.4g})")  # fmt: skip
        if not wrong:
            return
        self.backwards.refuse(bw)
        self.state.recheck()
        if kept is not None:  # (the results of the backward before, published again)
            collector.restore(kept)
        else:
            collector.param_sq_norms, collector.norm_forms = {}, {}
            collector.sum_grad_sq, collector.grad_mean = {}, {}
        raise CheckFailedError(
            "gradhooks: the per-example norms are not those of the examples' own gradients: "
            "the gradients they were formed from, weighted over the examples, are not the "
            "gradient autograd gives from the model's output-gradients with each example's "
            f"rows weighted alike, for {_listed(wrong)}. The norms of this backward were not "
            "kept. " + _EXAMPLES_NOT_APART.format(lost=_lost(probe))
        )


# -- Hooks.check: grad1 after a backward, on demand ----------------------------------------------


@dataclass
class CheckReport:
    """What a check found, from :func:`check_rule` or :meth:`gradhooks.Hooks.check`.

    ``module``: the type of the layer or model checked; ``check``: which check made the report
    (``"check_rule"`` or ``"Hooks.check"``); ``ok``: nothing failed (no ``failures`` and no
    ``problems``) and nothing was left unchecked (no ``unchecked``). ``str(report)`` lists all
    of it, one line each; its first line says ``ok``, ``FAILED``, ``MISMATCH`` or, where
    nothing failed but something could not be checked, ``UNCHECKED``.

    From :func:`check_rule`: ``differences``: ``{"<parameter> (<reduction>)": max |hooks -
    vmap(grad)|}`` for every trainable parameter and both reductions (``inf`` where ``grad1``
    is missing or of another shape); ``failures``: the keys of those beyond the tolerance.

    From ``Hooks.check``: ``problems``: one sentence each, naming what is wrong and what to do;
    ``reduction``: the reduction the loss really used (``"mean"``/``"sum"``), when the loss was
    given and it could be told; ``nonfinite``: ``{param_name: [example indices]}`` whose
    ``grad1`` holds NaN or Inf; ``unchecked``: what could not be checked, one sentence each,
    with what to pass so that it is (the loss's reduction, without the loss).
    """

    module: str = ""
    differences: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    reduction: str | None = None
    nonfinite: dict[str, list[int]] = field(default_factory=dict)
    check: str = "check"
    unchecked: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures and not self.problems and not self.unchecked

    def __str__(self) -> str:
        status = (
            "ok" if self.ok else "MISMATCH" if self.failures else "FAILED" if self.problems
            else "UNCHECKED"
        )  # fmt: skip
        rows = [f"{self.check}({self.module}): {status}"]
        rows += [
            f"  {key:<40} max |hooks - vmap(grad)| = {d:.3e}"
            + ("   <-- differs" if key in self.failures else "")
            for key, d in self.differences.items()
        ]
        if self.reduction is not None:
            rows.append(f"  the loss's reduction: {self.reduction}")
        rows += [f"  - {problem}" for problem in self.problems]
        rows += [f"  not checked: {what}" for what in self.unchecked]
        return "\n".join(rows)


def _tol(
    dtype: torch.dtype,
    precision: torch.dtype | None,
    exact: bool,
    factor: float = 1.0,
    terms: int = 0,
) -> float:
    """The relative tolerance of :func:`check_hooks` for ``grad1`` of ``dtype`` from calls that
    ran in ``precision`` (autocast: :func:`rounding_tolerance`, with its ``terms``)."""
    return rounding_tolerance(
        dtype, precision, exact, float32=factor * 1e-3, float64=factor * 1e-6, terms=terms
    )


def check_hooks(
    state: CaptureState,
    loss_fn: Callable[..., Tensor] | None = None,
    inputs: Tensor | Sequence[Tensor] | None = None,
    target: Tensor | None = None,
    *,
    examples: int = 2,
    raise_on_error: bool = True,
) -> CheckReport:
    """See :meth:`gradhooks.Hooks.check`."""
    model = state.model
    if model is None:
        raise StateError("check(): the hooked model no longer exists")
    if isinstance(examples, bool) or not isinstance(examples, int) or examples < 1:
        raise ConfigurationError(
            f"check(): examples is how many of the batch's first examples are recomputed one "
            f"at a time, an int >= 1, got {examples!r}"
        )
    if not isinstance(raise_on_error, bool):
        raise ConfigurationTypeError(
            f"check(): raise_on_error takes True or False, got {type(raise_on_error).__qualname__} "
            f"{raise_on_error!r}"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigurationTypeError(
            f"check(): loss_fn must be a function loss_fn(output, target) (or "
            f"loss_fn(output)), got {type(loss_fn).__qualname__} {loss_fn!r}"
        )
    report = CheckReport(type(model).__qualname__, check="Hooks.check")
    names = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    written = {names.get(i, "?"): p for i, p in state.written.items()}
    # (.grad of each: a tensor computed in a slot by functional_call has none of its own,
    # and reading it would make torch warn of a non-leaf tensor's .grad)
    grads = {n: p.grad if p.is_leaf or p.retains_grad else None for n, p in written.items()}
    for name in state.missed:
        report.problems.append(
            f"'{name}': a backward computed its gradient but no forward call of its module was "
            "captured for it (the forward ran before add_hooks, or while capture was paused): "
            "its grad1 is missing or from another backward. Run the forward after add_hooks."
        )
    if not written and "grad1" not in state.quantities:
        report.problems.append(
            f"check() compares grad1 with a recomputation, and this handle computes "
            f"{state.quantities} without it, so there is nothing to check, the loss's "
            "reduction included: for the steps to check, hook with "
            f"add_hooks(model, quantities=('grad1', {', '.join(map(repr, state.quantities))}))"
        )
    elif not written:
        report.problems.append(
            "no backward has written grad1 since add_hooks or clear(): run the forward and the "
            "backward with the hooks on (add_hooks before the forward)" + frozen_model(model)
        )
    reduce = "mean" if state.loss_reduction == "mean" else "sum"
    reset = {id(p) for p in state.trail.reset_since()} if written else set()
    # (the model's largest gradient entry: the scale of a gradient whose terms cancel)
    overall = max(
        (largest(g) for g in grads.values() if g is not None and g.numel()),
        default=0.0,
    )
    for name, p in written.items():
        g1 = p.grad1.detach()
        bad = ~torch.isfinite(g1.flatten(1)).all(1) if g1.dim() > 1 else ~torch.isfinite(g1)
        if bad.any():
            report.nonfinite[name] = bad.nonzero().flatten().tolist()
        grad = grads[name]
        if id(p) in reset and not (grad is not None and not g1.any() and not grad.any()):
            # (zeros in both agree, whichever backward left them: the zeros a backward gives
            # a parameter it did not reach after zero_grad(set_to_none=False) look as a
            # .grad zeroed through .data after it does)
            report.problems.append(
                f"'{name}': grad1 is of an earlier backward: .grad was reset since (zero_grad) "
                "and no backward since reached the hooked model (a loss of other parameters "
                "only, or of its detached output: a GAN's discriminator step), so .grad and "
                "grad1 disagree. Read grad1 after the backward of a loss that reaches the model."
            )
            continue
        if grad is None or not g1.shape[0]:
            continue
        got = g1.mean(0) if reduce == "mean" else g1.sum(0)
        want = grad.detach().to(got.dtype)
        if not (torch.isfinite(got).all() and torch.isfinite(want).all()):
            continue  # reported as non-finite
        # (the same backward's, within the rounding the run-time check allows: relative to
        # this gradient, to its examples' and its terms', and, for one whose terms cancel, a
        # share of the model's largest gradient entry, overall)
        differs = mismatch(
            got, want, g1, overall, 1e-3, 1e-6, state.precision, exact=True,
            terms=state.rounded.get(id(p), 0),
            terms_scale=_size(state.terms_scale.get(id(p))),
        )  # fmt: skip
        if differs is not None:
            report.problems.append(
                f"'{name}': grad1.{reduce}(0) differs from .grad ({differs}): .grad holds more "
                "than the "
                "captured backwards grad1 holds: gradients from before h.clear() (clear() "
                "without optimizer.zero_grad(); zero_grad() alone is enough), of a backward "
                "that was not captured (paused, or of a forward run before add_hooks), a term "
                "of the loss that does not go through a hooked layer's output (weight decay "
                "or a penalty on the parameters added to the loss, which is no example's: leave "
                "it out of the loss and add its gradient to .grad yourself after the check, or "
                "use the optimizer's weight_decay), a loss built from derivatives of the model "
                "(gradient penalties), or .grad changed in place after the backward "
                "(clip_grad_norm_, "
                "a GradScaler's unscale_, DDP's all-reduce: check before those)"
            )
    for name, rows in report.nonfinite.items():
        report.problems.append(
            f"'{name}': grad1 holds NaN or Inf for examples {rows[:10]}"
            f"{' ...' if len(rows) > 10 else ''} (carried through from the backward, as autograd "
            "does): check those examples' losses and inputs, or lower the learning rate"
        )
    if loss_fn is not None:
        if inputs is None:
            raise ConfigurationError(
                "check(loss_fn, inputs, target): the inputs of the captured forward"
            )
        if not isinstance(inputs, (Tensor, tuple, list)):  # (a bare TypeError from tuple())
            raise ConfigurationTypeError(
                "check(loss_fn, inputs, target): inputs must be the captured forward's input "
                f"[batch, ...] or a tuple (list) of its positional inputs, got "
                f"{type(inputs).__qualname__}"
            )
        _check_reduction(state, model, written, loss_fn, inputs, target, examples, report)
    elif written:
        other = "sum" if reduce == "mean" else "mean"
        batch = next(iter(written.values())).grad1.shape[0]
        report.unchecked.append(
            f"the loss's reduction: grad1.{reduce}(0) equals .grad whatever the loss really "
            f"was, so a loss that is the {other} of the per-example losses, hooked with "
            f"loss_reduction={state.loss_reduction!r}, leaves grad1 {batch}× too "
            f"{'large' if reduce == 'mean' else 'small'} (the batch size) unseen. Pass the "
            "loss: h.check(loss_fn, inputs, target) recomputes the first examples one at a "
            "time and says which reduction the loss used"
        )
    if report.problems and raise_on_error:
        raise CheckFailedError("gradhooks check failed:\n  - " + "\n  - ".join(report.problems))
    return report


def _checked_loss(loss_fn: Callable[..., Tensor], target: Tensor | None) -> Callable[..., Tensor]:
    """``loss_fn``, refusing a call that does not fit it (a target left out, or given to a
    loss of the output alone) and a value that is not a tensor (``loss.item()``), naming
    what :meth:`Hooks.check` called it with."""
    called = "loss_fn(output)" if target is None else "loss_fn(output, target)"

    def loss(*args: Tensor) -> Tensor:
        try:
            value = loss_fn(*args)
        except TypeError as e:
            fix = (
                "a loss that takes a target needs it: h.check(loss_fn, inputs, target)"
                if target is None
                else "a loss of the output alone takes no target: h.check(loss_fn, inputs)"
            )
            raise ConfigurationTypeError(f"check(): {called} raised TypeError ({e}); {fix}") from e
        except GradhooksError:
            raise
        except Exception as e:  # (a loss of the whole batch: it splits it, or couples rows)
            raise ConfigurationError(
                f"check(): {called} raised {type(e).__name__} ({e}) on a batch of one example: "
                "check() recomputes the first examples one at a time, each alone, to compare "
                "their gradients with grad1, and this loss needs more of the batch (one that "
                "splits it, as timm's JsdCrossEntropy splits the augmented copies, or couples "
                "its rows). Call h.check() without the loss (grad1 against .grad), or pass a "
                "loss of one example. Nothing was changed."
            ) from e
        if not isinstance(value, Tensor):
            raise ConfigurationTypeError(
                f"check(): {called} returned {type(value).__qualname__} {value!r}, not a "
                "tensor: return the loss tensor itself (not loss.item()), as for backward()"
            )
        return value

    return loss


def _check_reduction(state, model, written, loss_fn, inputs, target, examples, report) -> None:
    """Recompute the first examples' own gradients (a batch of one each) and compare."""
    xs = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
    if not xs or not isinstance(xs[0], Tensor):
        raise ConfigurationTypeError(
            f"check(loss_fn, inputs, target): inputs must be the tensor the captured forward "
            f"took (or a tuple of inputs, the first a tensor), got {type(inputs).__qualname__}"
        )
    dim = state.batch_dim
    if isinstance(dim, int) and dim != 0:  # (the rows compared below are along dimension 0)
        report.unchecked.append(
            f"the loss's reduction: the examples are on dimension {dim} of the inputs "
            f"(batch_dim={dim}), and check() recomputes them one at a time along dimension 0, "
            "so it cannot tell: check the reduction of a batch-first call of the loss"
        )
        return
    batch = xs[0].shape[0]
    if not written:
        return
    g1_batch = next(iter(written.values())).grad1.shape[0]
    if g1_batch != batch:
        report.problems.append(
            f"check(): grad1 has {g1_batch} examples, the inputs given have {batch}: pass the "
            "inputs of the captured forward"
        )
        return
    if isinstance(target, Tensor) and (target.dim() == 0 or target.shape[0] != batch):
        rows = target.shape[0] if target.dim() else None
        elsewhere = [k for k in range(1, xs[0].dim()) if xs[0].shape[k] == rows]
        report.problems.append(
            f"check(): the target has shape {tuple(target.shape)}, the inputs a batch of "
            f"{batch}: pass the target of the captured forward, one row per example"
            + (
                f"; the inputs' dimension {elsewhere[0]} has {rows} entries, as many as the "
                "target: if the examples are there (a time-major [seq, batch, ...] input), "
                f"grad1 holds a row per entry of dimension 0 instead: add_hooks(model, "
                f"batch_dim={elsewhere[0]})"
                if elsewhere
                else ""
            )
        )
        return
    k = min(examples, batch)
    if k == 0:
        report.unchecked.append("the loss's reduction: the batch is empty")
        return
    want = loop_grad(
        model, _checked_loss(loss_fn, target), tuple(x[:k] for x in xs),
        None if target is None else target[:k],
    )  # fmt: skip
    got_parts, want_parts = [], []
    for name, p in written.items():
        if name in want:
            got_parts.append(p.grad1[:k].detach().reshape(k, -1).double())
            want_parts.append(want[name].detach().reshape(k, -1).double())
    if not got_parts:
        report.unchecked.append(
            "the loss's reduction: no parameter with grad1 got a gradient from the examples "
            "recomputed one at a time"
        )
        return
    got, ref = torch.cat(got_parts, 1), torch.cat(want_parts, 1)
    if not (torch.isfinite(got).all() and torch.isfinite(ref).all()):
        report.unchecked.append(
            f"the loss's reduction: the first {k} examples' gradients are not finite"
        )
        return
    # (against a recomputation in the model's own dtype: rounded otherwise at every layer)
    tol = _tol(next(iter(written.values())).grad1.dtype, state.precision, False, factor=10)
    norm = ref.norm().item()
    if norm == 0:
        if got.norm().item() > 0:
            report.problems.append(
                f"the first {k} examples' own losses, each computed on its own, have no "
                "gradient, but their rows of grad1 do: the loss couples the examples of the "
                "batch (a contrastive or InfoNCE loss, a loss over the batch's statistics), so "
                "no example has a loss of its own and grad1 holds each example's share of the "
                "batch loss's gradient, not a per-example gradient. For DP-SGD, clip a loss "
                "that is a sum over examples."
            )
        else:
            report.unchecked.append(
                f"the loss's reduction: the first {k} examples' gradients are zero; check "
                "with more examples (check(..., examples=k))"
            )
        return

    def close(factor: float) -> bool:
        return (got - factor * ref).norm().item() <= tol * factor * norm

    if close(1.0):
        report.reduction = state.loss_reduction if batch > 1 else None
        return
    other = "sum" if state.loss_reduction == "mean" else "mean"
    factor = float(batch) if state.loss_reduction == "mean" else 1.0 / batch
    if batch > 1 and close(factor):
        report.reduction = other
        report.problems.append(
            f"the loss is the {other} of the per-example losses, but the hooks were told "
            f"loss_reduction={state.loss_reduction!r}: grad1 is {factor:g}× each example's own "
            f"gradient. Pass add_hooks(model, loss_reduction={other!r}) (or call "
            f"h.rescale({other!r}) for the grad1 computed so far)"
        )
        return
    ratio = (got * ref).sum().item() / (ref * ref).sum().item()
    scale = 2.0 ** round(math.log2(ratio)) if ratio > 0 else 0.0
    scaled = (
        "the backward of a loss scaled by a torch.amp.GradScaler "
        "(scaler.scale(loss).backward()) gives grad1 (and the norms) times the scale. "
        "Divide grad1 by the scale the backward ran with, scaler.get_scale() read before "
        "scaler.update(), and the norms by it too (docs/mixed-precision.md); for DP-SGD, "
        "pass the losses unscaled and the scaler to dp_sgd_step(..., scaler=scaler)"
    )
    if scale >= 16 and close(scale):  # (a GradScaler's scale: a power of two, 65536 at first)
        # (with a batch of a power of two, a scale times the other reduction's factor is one
        # too: which it is, the scale the backward ran with tells)
        alt = scale / factor
        other_too = (
            f". If the scale it ran with was {alt:g}, not {scale:g}, the loss is also the "
            f"{other} of the per-example losses, where the hooks were told "
            f"loss_reduction={state.loss_reduction!r}: call h.rescale({other!r}) first"
            if batch > 1 and alt >= 1 and alt == 2.0 ** round(math.log2(alt))
            else ""
        )
        report.problems.append(
            f"grad1 of the first {k} examples is {scale:g}× their own gradient, a power of "
            f"two: {scaled}{other_too}"
        )
        return
    both = 2.0 ** round(math.log2(ratio / factor)) if ratio > 0 and batch > 1 else 0.0
    if both >= 16 and close(both * factor):  # (a GradScaler's scale, and the other reduction)
        report.reduction = other
        report.problems.append(
            f"grad1 of the first {k} examples is {both * factor:.4g}× their own gradient, "
            f"{both:g} (a power of two) times {factor:.4g}: the loss is the {other} of the "
            f"per-example losses, but the hooks were told "
            f"loss_reduction={state.loss_reduction!r}, and {scaled}. Call h.rescale({other!r}) "
            f"(or pass add_hooks(model, loss_reduction={other!r})), then divide by the scale"
        )
        return
    was = state.training_at_forward
    if was is not None and was != model.training:
        then, now = ("train", "eval") if was else ("eval", "train")
        report.problems.append(
            f"grad1 of the first {k} examples is not their own gradient (about {ratio:.3g}× "
            f"it, batch {batch}) as check() recomputes it, in the mode the model is in now: "
            f"the model was in {then} mode at the captured forward and is in {now} mode now "
            f"(model.{now}() was called after the forward), and a layer that differs between "
            "the modes (dropout, batch norm) gives the examples another gradient in each. "
            f"Call check with the model in the forward's mode (model.{then}() before "
            "h.check(...))"
            + (
                "; dropout in train mode draws masks no recomputation replays: check a step "
                "whose forward runs in eval mode"
                if was
                else ""
            )
        )
        return
    report.problems.append(
        f"grad1 of the first {k} examples is not their own gradient (about {ratio:.3g}× it, "
        f"loss_reduction={state.loss_reduction!r}, batch {batch}): the loss may be scaled "
        "(divided by the number of micro-batches, or a mean over more than the batch), or a "
        "weighted mean (F.cross_entropy with weight= or ignore_index: each example enters it "
        "with its weight over the batch's total; sum reduction='none' losses for each one's "
        "own), grad1 "
        "may hold several backwards (call h.clear() between steps), the examples may not be "
        "independent (batch statistics, or a loss that couples them: contrastive, InfoNCE), "
        "the model may be random (dropout: check in eval "
        "mode), or loss_fn / inputs differ from those of the captured backward"
    )


def _nearest_params(after: tuple, params: dict, most: int = 3, limit: int = 1 << 16) -> list[str]:
    """The names of the parameters of ``params`` (``{id: (name, p)}``) whose gradients the
    autograd nodes ``after`` lead to and the running backward computes, nearest first (breadth first, at most ``most``, through
    at most ``limit`` nodes)."""
    names: list[str] = []
    seen = {id(n) for n in after}
    queue = list(after)
    for node in queue:
        if len(names) >= most or len(seen) > limit:
            break
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) in params:
            # (where this backward computes its gradient: not an autograd.grad of the input)
            if _torch.adds_to_grad(variable) is not None or not _torch.available("engine_executes"):
                names.append(params[id(variable)][0])
            continue
        for nxt, _ in node.next_functions:
            if nxt is not None and id(nxt) not in seen:
                seen.add(id(nxt))
                queue.append(nxt)
    return names

"""DP-SGD: per-example clipping, summing and Gaussian noise, written into ``p.grad``.

:func:`dp_sgd_step` takes the per-example losses of a hooked forward and sets, for every
trainable parameter,

    p.grad = (Σ_i min(1, C / ‖g_i‖) · g_i  +  N(0, (σ·C)² I)) / D

where ``g_i`` is example ``i``'s own gradient of the whole model (all parameters together),
``C = max_norm``, ``σ = noise_multiplier`` and ``D`` the batch size for ``reduction="mean"``
(``1`` for ``"sum"``), or the *expected* batch size when ``expected_batch_size`` is given (for
Poisson-sampled batches, :class:`gradhooks.PoissonSampler`). Any torch optimizer then steps on
``p.grad``. An example whose gradient is zero is left as it is (factor 1). An empty batch gives
the noise alone.

Two paths, chosen by what the handle computes:

- ``"grad1"`` (the handle has ``"grad1"``): one backward, ``grad1`` of every parameter, norms
  and the clipped sum from it.
- ``"ghost"`` (the handle has ``"norms"`` and not ``"grad1"``): ghost clipping, never forming
  ``grad1``: a first backward computes the per-example norms from the pieces
  (:meth:`Hooks.norms`), a second backward of ``Σ_i min(1, C/‖g_i‖) · loss_i`` (the factors
  detached, capture off) gives the clipped sum directly in autograd's own gradient. Memory is
  that of two plain backwards (the graph is kept for the second); compute about twice one.
  Backward hooks registered on the model run in both backwards; the other paths run one
  backward, and no check of gradhooks' runs another through hooks of the model's.
- ``"bookkeeping"`` (a handle with ``"norms"``): ghost norms without the second backward
  (Bu et al., "Differentially private optimization on large model at small cost", 2023).
  The one backward keeps every call's pieces (the layer inputs and output-gradients); the
  clipped sum is then, per parameter, the batch gradient of the pieces with example ``i``
  weighted by ``min(1, C/‖g_i‖)`` (:meth:`gradhooks.pieces.Piece.add_batch_sum`): the cost
  of the weight gradients, not of a whole backward. Where a parameter's norms are formed from
  its per-example gradients (``Hooks.norm_forms()`` ``"materialized"``: more positions than
  features, as a tied output layer over a long sequence), those are kept and weighted instead
  (no second product), when they take no more memory than its pieces. Memory: the
  output-gradients of every hooked layer are held until the clipped sums are formed (about the
  size of the activations); they are used up, call by call, before any noise is drawn, so
  that the two are not held together.

The noise ``σ·C·N(0, I)`` is drawn (from ``generator``, parameter after parameter: the numbers
of ``torch.randn``, each times ``σ·C``) into the tensor that becomes ``p.grad``, and the
parameter's clipped sum is added to it in place (an embedding's looked-up rows by one
``index_add_``): one tensor of each parameter's size (with a GradScaler, the noise is drawn
once the sums are known to be finite).

Privacy accounting is :class:`gradhooks.PrivacyAccountant`'s: record each step's noise
multiplier and sampling rate there. Its analysis assumes Poisson-sampled batches
(:class:`gradhooks.PoissonSampler`), whose size varies: pass ``expected_batch_size=`` so that
the noisy sum is divided by the expected size, which is public, not by the batch's own size,
which is not (and is 0 for an empty batch).
"""

from __future__ import annotations

import gc
import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .. import _torch
from .. import pieces as P
from ..engine.api import engine_of
from ..engine.compare import hold, largest
from ..engine.handle import Hooks
from ..engine.records import half_precision, leaves_of
from ..engine.verify import PROBE_TOLERANCE, mismatch
from ..errors import (
    CheckFailedError,
    ConfigurationError,
    ConfigurationTypeError,
    GradhooksWarning,
    SharedInputWarning,
    StateError,
    UnsupportedError,
    require_number,
)
from . import clipping as _clip
from .clipping import ClippingGroups, GroupedBounds

__all__ = ["dp_sgd_step", "clip_factors", "clipped_sum", "ClippedSum"]


# Automatic clipping's stability constant γ (Bu et al., 2023; fastDP's ``clipping_fn="automatic"``)
AUTOMATIC_GAMMA = 0.01
CLIPPINGS = ("flat", "automatic")


def clip_factors(norms: Tensor, max_norm: float | Tensor, clipping: str = "flat") -> Tensor:
    """Each example's factor, shape of ``norms``: with ``clipping="flat"`` (Abadi et al.,
    Opacus' default) ``min(1, max_norm / norms)``, ``1`` where a norm is 0 (or NaN); with
    ``"automatic"`` (AUTO-S, Bu et al., *Automatic Clipping*, 2023; fastDP's default)
    ``max_norm / (norms + 0.01)``, every example's gradient normalized, so that the clipped
    norm ``max_norm · ‖g‖ / (‖g‖ + 0.01)`` stays below ``max_norm`` as flat clipping's does (the
    same noise gives the same privacy); the learning rate then needs no tuning against
    ``max_norm``. ``max_norm`` may be a tensor that broadcasts against ``norms`` (a bound per
    clipping group, ``[groups, 1]`` against norms ``[groups, batch]``)."""
    # (``x.reciprocal() * C`` is what ``C / x`` computes for a float C: written so, a tensor
    # of bounds, one per clipping group, gives the same numbers as each bound given alone)
    if clipping not in CLIPPINGS:  # (taken as "flat", silently)
        raise ConfigurationError(
            f"clip_factors: clipping must be one of {CLIPPINGS}, got {clipping!r}"
        )
    if not isinstance(norms, Tensor):
        raise ConfigurationTypeError(
            f"clip_factors: norms must be a tensor of per-example norms, got "
            f"{type(norms).__qualname__}"
        )
    if isinstance(max_norm, Tensor):
        # (a host sync, the caller's; the DP step's own bounds are checked where formed)
        bad = ~(max_norm > 0) | max_norm.isinf()
        if bool(bad.any()):
            raise ConfigurationError(
                f"clip_factors: max_norm must be > 0 and finite, got a tensor "
                f"{tuple(max_norm.shape)} holding {max_norm[bad].flatten()[0].item()!r} (0 "
                "would zero every gradient, a negative one flip it)"
            )
        try:
            fits = torch.broadcast_shapes(max_norm.shape, norms.shape) == norms.shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ConfigurationError(
                f"clip_factors: max_norm of shape {tuple(max_norm.shape)} does not broadcast "
                f"against norms of shape {tuple(norms.shape)} (one bound, or one per clipping "
                "group [groups, 1] against norms [groups, batch])"
            )
    else:
        require_number("max_norm", max_norm, "clip_factors")
        if not 0 < max_norm < float("inf"):
            raise ConfigurationError(
                f"clip_factors: max_norm must be > 0 and finite, got {max_norm!r} (0 would "
                "zero every gradient, a negative one flip it)"
            )
    return clipping_factors(norms, max_norm, clipping)


def clipping_factors(norms: Tensor, max_norm: float | Tensor, clipping: str) -> Tensor:
    """:func:`clip_factors` of bounds checked where they were formed (the DP step's), with no
    host sync."""
    if clipping == "automatic":
        return (norms + AUTOMATIC_GAMMA).reciprocal() * max_norm
    return torch.where(norms > max_norm, norms.reciprocal() * max_norm, 1.0)


def dp_sgd_step(
    hooks: Hooks,
    per_example_loss: Tensor,
    *,
    max_norm: float | Sequence[float],
    noise_multiplier: float,
    generator: torch.Generator | None = None,
    reduction: Literal["mean", "sum"] = "mean",
    method: Literal["grad1", "ghost", "bookkeeping"] | None = None,
    expected_batch_size: float | None = None,
    scaler: torch.amp.GradScaler | None = None,
    clipping: Literal["flat", "automatic"] = "flat",
    clipping_groups: ClippingGroups = None,
) -> Tensor:
    """Backward of ``per_example_loss`` (``[batch]``) with per-example clipping and noise into
    ``p.grad`` (replacing what was there; a ``.grad`` there is written into, as autograd's
    backward adds into it) for every trainable parameter of the hooked model.
    Each call is a whole step, with its own noise: replacing a ``.grad`` the last call wrote
    and no optimizer step used (micro-batches of one logical batch, each given to it) warns;
    a logical batch in several physical batches is :class:`gradhooks.DPOptimizer`'s. Losses
    that also reach trainable parameters the hooks are not on (a head left out of
    ``add_hooks(model.body)``) warn: those get no gradient from the step. A forward that took
    an input as long as the batch as shared by every example (in-batch negatives,
    ``q @ p.T``) warns too, once a step (:class:`gradhooks.SharedInputWarning`): its rows
    are in every example's gradient, and the step protects none of them.

    Args:
        hooks: the handle of ``add_hooks(model, quantities=("grad1",))`` (path ``"grad1"``)
            or ``quantities=("norms",)`` (book-keeping by default, or ghost clipping: never
            forms ``grad1``), added before the forward. Its ``loss_reduction`` does not matter here
            (the step backpropagates the losses' sum).
        per_example_loss: each example's own loss, ``[batch]`` (e.g. ``reduction="none"``).
        max_norm: ``C``, the clipping norm of each example's whole-model gradient; with
            ``clipping_groups``, a float ``C`` (each of ``K`` groups clipped to ``C/√K``) or
            one bound per group ``[C_1, ..., C_K]`` (total ``C = √(Σ_k C_k²)``).
        noise_multiplier: ``σ``; the noise std is ``σ·C`` (``C`` the total bound). ``0`` for
            clipping only.
        generator: a ``torch.Generator`` on the parameters' device, for reproducible noise,
            made once for the whole loop (a step whose generator starts where the last noised
            step's started, seeded anew, would draw its noise again: it warns).
        reduction: ``"mean"`` divides the noisy clipped sum by the batch size, ``"sum"`` not.
        method: ``"grad1"``, ``"ghost"`` or ``"bookkeeping"``; by default ``"grad1"`` for a
            handle with ``"grad1"``, ``"bookkeeping"`` for one with ``"norms"``.
        expected_batch_size: divide by this instead of the batch's own size (with
            ``reduction="mean"``): for Poisson sampling, ``sampler.expected_batch_size``.
        scaler: a ``torch.amp.GradScaler`` (float16 autocast): the backward runs on the losses
            multiplied by its scale ``S``, so that float16 output-gradients do not underflow;
            the norms and clipping factors are those of the unscaled gradients (the norms
            divided by ``S``), and ``p.grad`` is written *scaled* by ``S``, for
            ``scaler.step(optimizer)`` to unscale (exactly: ``S`` is a power of two) and step,
            then ``scaler.update()``. Where a gradient holds Inf or NaN (an overflow), no noise
            is drawn, every ``p.grad`` is set to NaN and the returned norms hold the non-finite
            ones: ``scaler.step`` skips the step and ``scaler.update`` lowers the scale, as
            without DP. A skipped step released nothing: do not record it in the
            :class:`~gradhooks.PrivacyAccountant` (see ``docs/mixed-precision.md``).
        clipping: ``"flat"`` (each gradient scaled by ``min(1, C/‖g_i‖)``) or ``"automatic"``
            (by ``C/(‖g_i‖ + 0.01)``: every gradient normalized, fastDP's default), both
            bounding each example's contribution by ``C``: :func:`clip_factors`.
        clipping_groups: ``None`` (one bound over the whole model), ``"parameter"`` (every
            trainable parameter clipped on its own: Opacus' ``clipping="per_layer"``),
            ``"layer"`` (each module's parameters together) or a list of groups (each a list
            of parameters or of their names; an optimizer's ``param_groups``): each example's
            gradient of each group clipped to that group's bound (:mod:`~gradhooks.workflows.
            clipping`); ``"flat"`` or ``"automatic"`` within each group. Methods ``"grad1"``
            and ``"bookkeeping"``; ``"ghost"`` with one group only.

    Returns:
        The per-example gradient norms before clipping (unscaled), ``[batch]`` (of the whole
        model's gradient, also with ``clipping_groups``).

    Example::

        >>> import torch, gradhooks
        >>> model = torch.nn.Linear(4, 3)
        >>> h = gradhooks.add_hooks(model, quantities=("norms",))
        >>> losses = torch.nn.functional.cross_entropy(
        ...     model(torch.randn(8, 4)), torch.randint(3, (8,)), reduction="none")
        >>> norms = gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=1.1,
        ...                               generator=torch.Generator().manual_seed(0))
        >>> norms.shape, model.weight.grad.shape
        (torch.Size([8]), torch.Size([3, 4]))
    """
    method = _checked(hooks, per_example_loss, method, reduction, expected_batch_size)
    _clip.check_bounds(max_norm, clipping_groups, "dp_sgd_step")
    _check_clipping(_clip.total_bound(max_norm), noise_multiplier, generator, clipping)
    outside = reached_outside(hooks, per_example_loss)
    check_batch_against_expected(per_example_loss.shape[0], expected_batch_size, "dp_sgd_step")
    params = _step_params(hooks, method, scaler)
    groups = grouped(hooks, method, params, max_norm, clipping_groups, "dp_sgd_step")
    std = noise_multiplier * noise_bound(max_norm, groups)
    # Without a scaler, the noise is drawn parameter after parameter (in their order) into the
    # tensor its gradient is built in, once its clipped sum is at hand, which is added to it
    # (the rows of an embedding an example looked up in place): one tensor of each parameter's
    # size, no second. A scaled step draws it only once the sums are known finite (a skipped
    # step draws none).
    noised = std > 0 and (scaler is None or not scaler.is_enabled())
    start = generator.get_state() if std > 0 and generator is not None else None
    into = (lambda p, s: noise(p, generator, std, s)) if noised else None
    norms, clipped, scale, sparse = _clipped_sums(
        hooks, per_example_loss, max_norm, method, params, scaler, into=into, clipping=clipping,
        groups=groups,
    )  # fmt: skip
    if scale is not None and not finite(norms, clipped):
        for p in params:  # (scaler.step sees them, and skips the step)
            write_grad(p, torch.full(p.shape, float("nan"), dtype=p.dtype, device=p.device))
        return norms.detach()
    std *= scale or 1.0  # (the clipped sums are scaled by it)
    _warn_if_sizes_vary(hooks, per_example_loss.shape[0], reduction, expected_batch_size)
    denom = _denominator(per_example_loss.shape[0], reduction, expected_batch_size)
    if std > 0 and not noised:  # (drawn now that the sums are known to be finite)
        clipped = _added(lambda p, s: noise(p, generator, std, s), params, _popped(clipped))
    if std > 0:  # (the noise's tensors, the step's own: divided in place)
        _foreach_div_(clipped, denom)
    else:  # (autograd's gradients may be expanded views: divided out of place)
        clipped = _torch.foreach_div(clipped, denom)
    _warn_if_unstepped(hooks, params)
    for p, c, layout in zip(params, clipped, sparse, strict=True):
        write_grad(p, as_grad(c, layout))
    _written(hooks, params)
    drop_stale_grads(hooks, params)
    _warn_if_noise_repeats(hooks, start)
    warn_if_outside(hooks, outside, "gradhooks.dp_sgd_step")
    warn_if_shared_inputs(hooks, "gradhooks.dp_sgd_step")
    return norms.detach()


class ClippedSum(NamedTuple):
    """What :func:`clipped_sum` gives: one physical batch's share of a DP-SGD step."""

    params: list[torch.nn.Parameter]
    """The trainable parameters of the hooked model, in the order the noise is drawn."""
    sums: list[Tensor]
    """Per parameter, ``Σ_i f_i · g_i`` over the batch, ``f_i`` the clipping factor
    (:func:`clip_factors`: ``min(1, C/‖g_i‖)``, flat; with ``clipping_groups``, that of the
    parameter's group) (no noise, not divided),
    in the parameter's dtype and shape; NaN or Inf where ``finite`` is False."""
    norms: Tensor
    """The per-example gradient norms before clipping (unscaled), ``[batch]``."""
    finite: bool
    """False where a GradScaler's scaled backward overflowed (the step must be skipped)."""
    sparse: list[bool] = []
    """Per parameter, whether autograd gives its gradient as a sparse tensor
    (``nn.Embedding(sparse=True)``): the noised sum is then written to ``.grad`` sparse, as
    :func:`dp_sgd_step` writes it, for ``SparseAdam``."""


def clipped_sum(
    hooks: Hooks,
    per_example_loss: Tensor,
    *,
    max_norm: float | Sequence[float],
    method: Literal["grad1", "ghost", "bookkeeping"] | None = None,
    scaler: torch.amp.GradScaler | None = None,
    clipping: Literal["flat", "automatic"] = "flat",
    clipping_groups: ClippingGroups = None,
) -> ClippedSum:
    """Backward of ``per_example_loss`` (``[batch]``) and the clipped sum of its examples'
    gradients, per parameter: :func:`dp_sgd_step` without the noise and the division, and
    without writing ``p.grad``. For a step whose batch is processed in several backwards
    (:class:`gradhooks.DPOptimizer` adds these sums over the physical batches of a logical
    batch, then adds the noise once).

    The arguments are :func:`dp_sgd_step`'s, with the same checks (with ``clipping_groups``,
    ``f_i`` is the factor of each parameter's group). With an enabled
    ``scaler`` the backward runs on the scaled losses (float16 autocast) and the sums are
    returned unscaled (divided by the scale, a power of two: exact).
    """
    return warned_clipped_sum(
        hooks, per_example_loss, max_norm, method, scaler, clipping, clipping_groups,
        "gradhooks.clipped_sum",
    )  # fmt: skip


def warned_clipped_sum(
    hooks: Hooks, per_example_loss: Tensor, max_norm: Any, method: str | None, scaler: Any,
    clipping: str, clipping_groups: ClippingGroups, where: str,
) -> ClippedSum:  # fmt: skip
    """:func:`clipped_sum`, warning as :func:`dp_sgd_step` does of what it does not protect
    (parameters outside the hooks, inputs taken as shared), as ``where``."""
    method = _checked(hooks, per_example_loss, method, "mean", None)
    _clip.check_bounds(max_norm, clipping_groups, "clipped_sum")
    _check_clipping(_clip.total_bound(max_norm), 0.0, clipping=clipping)
    outside = reached_outside(hooks, per_example_loss)
    params = _step_params(hooks, method, scaler)
    groups = grouped(hooks, method, params, max_norm, clipping_groups, "clipped_sum")
    norms, sums, scale, sparse = _clipped_sums(
        hooks, per_example_loss, max_norm, method, params, scaler, clipping=clipping,
        groups=groups,
    )  # fmt: skip
    ok = scale is None or finite(norms, sums)
    if scale is not None:
        sums = [s.detach() / scale for s in sums]
    warn_if_outside(hooks, outside, where)
    warn_if_shared_inputs(hooks, where)
    return ClippedSum(params, [s.detach() for s in sums], norms.detach(), ok, sparse)


def _step_params(hooks: Hooks, method: str, scaler: Any) -> list[torch.nn.Parameter]:
    """The parameters a step clips, after refusing what a step cannot be right with: a
    scaler that is not one, parameters sharded by FSDP2, and :func:`steppable_params`'."""
    check_scaler(scaler)
    if engine_of(hooks).sharded:
        raise ConfigurationError(
            "dp_sgd_step: the model's parameters are sharded by FSDP2; use "
            "gradhooks.distributed.dp_sgd_step (every rank calls it with its own examples)"
        )
    params = steppable_params(hooks, method, "dp_sgd_step")
    if scaler is not None and scaler.is_enabled():
        half = next((p for p in params if p.dtype == torch.float16), None)
        if half is not None:
            plan = _plan(hooks)
            name = dict(zip(map(id, plan.params), plan.names, strict=True))[id(half)]
            raise ConfigurationError(
                f"dp_sgd_step: '{name}' {tuple(half.shape)} is stored in float16, and a "
                "GradScaler unscales no float16 gradient (scaler.step refuses them; the scaled "
                "float16 gradients overflow first). Keep the parameters in float32 and run the "
                "forward under torch.autocast(device_type, dtype=torch.float16), or pass no "
                "scaler. No gradient was written."
            )
    return params


def steppable_params(hooks: Hooks, method: str, where: str) -> list[torch.nn.Parameter]:
    """The parameters a step clips (every one but the empty), after refusing an optimizer
    fused into the backward and, under ghost clipping, gradient hooks: by the step of one
    process and by that across ranks (``where``: which)."""
    plan = _checked_plan(hooks)
    params, names = list(plan.params), plan.names
    if not params:
        model = hooks.model
        raise ConfigurationError(
            f"{where}: {type(model).__qualname__} has no trainable parameter (every one has "
            "requires_grad=False): there is no gradient to clip or noise. Unfreeze the "
            "parameters to train (model.requires_grad_(True), or those of the layers to "
            "fine-tune) before the forward."
        )
    # (the usual: neither kind of hook on any parameter, told in one pass)
    if any(_torch.accumulate_hooks(p) or _torch.backward_optimizers(p) for p in params):
        _refuse_fused(names, params, where)
    own = 1  # (gradhooks' own hook on each parameter)
    if method == "ghost":
        hooked = [n for n, p in zip(names, params, strict=True) if _torch.tensor_hooks(p) > own]
        if hooked:
            raise ConfigurationError(
                f"{where}(method='ghost'): '{hooked[0]}' has a gradient hook "
                "(register_hook), and ghost clipping takes the clipped sum from autograd's "
                "gradient of the parameters, which such a hook may change after the clipping (a "
                "factor above 1 would break the clipping bound). Use method='bookkeeping' or "
                "'grad1' (they form the clipped sum from the per-example gradients themselves), "
                "or remove the hook."
            )
    return [p for p in params if p.numel()]  # (an empty parameter: nothing to clip or noise)


def _refuse_fused(names: list[str], params: list, where: str) -> None:
    """Refuse a step whose parameters an optimizer steps inside the backward (see
    :func:`steppable_params`)."""
    fused = [n for n, p in zip(names, params, strict=True) if _torch.accumulate_hooks(p)]
    if fused:
        raise ConfigurationError(
            f"{where}: '{fused[0]}' has a post-accumulate-grad hook (an optimizer step "
            "fused into the backward, register_post_accumulate_grad_hook): the step writes "
            ".grad after its backward, clipped and noised, so that hook would never see it (or "
            "would step on the unclipped gradient). Remove the hook and call optimizer.step() "
            "after dp_sgd_step."
        )
    fused = [n for n, p in zip(names, params, strict=True) if _torch.backward_optimizers(p)]
    if fused:
        raise ConfigurationError(
            f"{where}: '{fused[0]}' is stepped in the backward by an optimizer of "
            "torch.distributed.optim._apply_optimizer_in_backward, which steps from autograd's "
            "accumulation of .grad: the step writes .grad after its backward, clipped and "
            "noised, so that optimizer would never step on it. Build a plain optimizer over "
            "the parameters instead, and call its step() after dp_sgd_step."
        )


def grouped(
    hooks: Hooks, method: str, params: list, max_norm: Any, clipping_groups: ClippingGroups,
    where: str, arg: str = "max_norm",
) -> GroupedBounds | None:  # fmt: skip
    """The step's clipping groups and bounds (:func:`gradhooks.workflows.clipping.grouped`;
    ``None`` for one bound over the whole model), after refusing ghost clipping with more
    than one group."""
    if clipping_groups is None:
        return None
    groups = _clip.grouped(
        hooks.model, params, _plan(hooks).names, max_norm, clipping_groups, where, arg
    )
    if method == "ghost" and groups is not None and len(groups.bounds) > 1:
        raise ConfigurationError(
            f"{where}(method='ghost') with {len(groups.bounds)} clipping groups: ghost clipping "
            "takes the clipped sum from autograd's gradient of Σ_i f_i · loss_i, one factor "
            "per example for every parameter, and group-wise clipping needs a factor per "
            "example and group. Use method='bookkeeping' (one backward, the group norms from "
            "the per-parameter norms; the handle's quantities=('norms',) serves it) or "
            "'grad1' (a handle with 'grad1'). No gradient was written."
        )
    return groups


def noise_bound(max_norm: Any, groups: _clip.GroupedBounds | None) -> float:
    """The total bound the noise is scaled to: that of the groups clipped (a group of frozen
    parameters left out), else ``max_norm``'s."""
    return groups.total if groups is not None else _clip.total_bound(max_norm)


def check_scaler(scaler: Any) -> None:
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise ConfigurationTypeError(
            f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__qualname__}"
        )


def _check_scale(scale: float) -> None:
    """Refuses a GradScaler whose scale no step can use: with an infinite or NaN scale every
    scaled gradient overflows, every step is skipped and ``update()`` never brings the scale
    back (``inf · backoff_factor`` is inf); with 0 every unscaled gradient is NaN and the scale
    never grows from 0; a negative one flips the norms' sign, so that no example is clipped."""
    if not 0 < scale < math.inf:
        raise ConfigurationError(
            f"the GradScaler's scale is {scale!r} (scaler.get_scale()): an infinite or NaN "
            "scale overflows every scaled gradient (every step skipped, and scaler.update() "
            "never brings it back), 0 unscales every gradient to NaN, a negative one makes "
            "every norm negative (no example clipped). The scale must be a finite number > 0: "
            "make a new torch.amp.GradScaler(), or load a checkpoint whose scale is finite. "
            "Nothing was changed."
        )


def finite(norms: Tensor, clipped: list[Tensor]) -> bool:
    """Whether the norms and the clipped sums all hold finite numbers (one synchronisation)."""
    flags = [torch.isfinite(norms).all()] + [
        torch.isfinite(c).all().to(norms.device) for c in clipped if c.numel()
    ]
    return bool(torch.stack(flags).all())


# Losses a step has run its backward through (their graph freed), until they are freed
_STEPPED: WeakIdKeyDictionary = WeakIdKeyDictionary()
# Per handle, the batch size of its last step divided by its own size (reduction "mean"
# without expected_batch_size); -1 once it has warned that the sizes vary
_OWN_SIZES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _warn_if_sizes_vary(hooks: Hooks, batch: int, reduction: str, expected: float | None) -> None:
    """Batches whose size varies, each divided by its own size: Poisson-sampled batches
    without ``expected_batch_size``, whose normalisation is another mechanism than the one
    the accountant analyses (the batch's size is not public). Said once per handle."""
    if reduction != "mean" or expected is not None:
        return
    last = _OWN_SIZES.get(hooks)
    if last == -1:
        return
    _OWN_SIZES[hooks] = batch
    if last is not None and last != batch:
        _OWN_SIZES[hooks] = -1
        warnings.warn(
            f"gradhooks.dp_sgd_step: the batch size varies between steps ({last}, then "
            f"{batch}) and each step divides its noisy sum by its own batch's size. With "
            "Poisson-sampled batches (PoissonSampler, poisson_loader), pass "
            "expected_batch_size=sampler.expected_batch_size: the accountant's analysis "
            "assumes that public denominator, and an empty batch has no size of its own. "
            "(Fixed-size batches with a smaller last one: drop_last=True, or ignore this.)",
            GradhooksWarning,
            stacklevel=3,
        )


# Per handle, what its last step wrote: each parameter's version, and its .grad (a weak
# reference) with that tensor's version; None once it has warned that a step's .grad was
# replaced unused
_WRITTEN: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _written(hooks: Hooks, params: list[torch.nn.Parameter]) -> None:
    if _WRITTEN.get(hooks, False) is not None:
        _WRITTEN[hooks] = [
            (weakref.ref(p), _torch.version(p), weakref.ref(p.grad), _torch.version(p.grad))
            for p in params
            if p.grad is not None
        ]


# Per writer (a handle, for dp_sgd_step; a DPOptimizer), the .grad its last step wrote
_OWN_GRADS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def drop_stale_grads(writer: object, params: list[torch.nn.Parameter]) -> None:
    """Set to ``None`` the ``.grad`` that ``writer``'s last step wrote for a parameter that is
    not among this step's ``params`` (frozen since, or no longer the model's), where it is
    still that step's tensor, unchanged; then record the ``.grad`` of ``params``. A DP step
    needs no ``zero_grad()``: without this, the optimizer would step a parameter frozen
    between two steps again, on the last step's gradient, at every step after."""
    now = {id(p) for p in params}
    for p_ref, g_ref, version in _OWN_GRADS.get(writer, ()):
        p, g = p_ref(), g_ref()
        if p is None or g is None or id(p) in now or p.grad is not g:
            continue
        if _torch.version(g) == version:
            p.grad = None
    _OWN_GRADS[writer] = [
        (weakref.ref(p), weakref.ref(p.grad), _torch.version(p.grad))
        for p in params
        if p.grad is not None
    ]


def reached_outside(hooks: Hooks, per_example_loss: Tensor) -> list[torch.nn.Parameter]:
    """The trainable parameters of modules the hooks are not on that the losses reach (the
    hooks added to a part of the model, ``add_hooks(model.body)``, the head or a learned
    temperature left out), which the step writes no gradient: looked for where the step's own
    check runs (the first step of each new set of calls, then the 2nd, 4th, 8th..., and after
    a refusal), by a walk of the losses' graph before the step's backward frees it. (The
    step of one process and that across ranks.)"""
    engine = engine_of(hooks)
    if not engine.unverified or not per_example_loss.requires_grad:
        return []
    mine = [p for _, p in engine.named_parameters()]
    own = {id(p) for p in [*mine, *engine.in_use_of(mine)]}  # (FSDP2: and the unsharded)
    return [
        t for t in leaves_of(per_example_loss)
        if isinstance(t, torch.nn.Parameter) and id(t) not in own
    ]  # fmt: skip


def warn_if_outside(hooks: Hooks, outside: list[torch.nn.Parameter], where: str) -> None:
    """A step done (``where``: which) whose losses reached ``outside``
    (:func:`reached_outside`): an optimizer over them leaves them as they are, or steps them
    again on a ``.grad`` left from before, neither clipped nor noised. (Not said of a step
    refused: nothing was written.)"""
    if not outside:
        return
    model = hooks.model
    owner = type(model).__qualname__ if model is not None else "no longer alive"
    shapes = ", ".join(str(tuple(t.shape)) for t in outside[:5])
    more = f" and {len(outside) - 5} more" if len(outside) > 5 else ""
    warnings.warn(
        f"{where}: the losses reach {len(outside)} trainable parameter(s) that "
        f"are not the hooked model's ({owner}), of shape {shapes}{more}: the step clips and "
        "noises the hooked model's gradients alone and writes these no gradient (their .grad "
        "is left as it was), so an optimizer over them does not train them, or steps them on "
        "a .grad left from before, neither clipped nor noised. Hook the whole model the "
        "losses are computed through (add_hooks(model), not a part of it), or freeze them "
        "(requires_grad_(False)).",
        GradhooksWarning,
        stacklevel=3,
    )


def warn_if_shared_inputs(hooks: Hooks, where: str) -> None:
    """A step done (``where``: which) whose per-example gradients came from a forward that
    took an input of the model as long as the batch as shared by every example
    (:attr:`gradhooks.engine.api.EngineAPI.shared_inputs`: the passages of a retriever
    trained on in-batch negatives, ``q @ p.T``): every example's gradient holds what each of
    its rows adds, so the step protects none of them. One warning per step, naming every
    such input."""
    found = engine_of(hooks).shared_inputs
    if not found:
        return
    model = hooks.model
    owner = type(model).__qualname__ if model is not None else "the model"

    def one(s: Any) -> str:
        k = s.position + 1
        nth = f"{k}{'th' if 10 <= k % 100 < 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(k % 10, 'th')}"
        made = (
            f"; the hooked calls on it alone, {', '.join(map(repr, s.calls))}, made batch-free"
            if s.calls
            else ""
        )
        return f"its {nth} tensor input, of shape {s.shape} (at {s.operation}{made})"

    warnings.warn(
        f"{where}: the forward of {owner} took as shared by every example, not as rows of "
        f"examples of their own, {'; and '.join(map(one, found))}: an input as long as the "
        "batch that every example is compared with (in-batch negatives, q @ p.T, or a memory "
        "bank). "
        "Each example's clipped gradient then holds what every row of it adds, so those rows "
        "are not protected by the step (removing one changes every example's gradient). Give "
        "the model its shared rows from outside the private data, or compute each example's "
        "loss from its own rows alone. Where that input holds no example's data (a mask, a "
        "fixed table as long as the batch), filter this warning: warnings.filterwarnings("
        "'ignore', category=gradhooks.SharedInputWarning).",
        SharedInputWarning,
        stacklevel=3,
    )


def _warn_if_unstepped(hooks: Hooks, params: list[torch.nn.Parameter]) -> None:
    """A step about to replace the ``.grad`` the last step wrote, which no optimizer step
    used: the parameters and their ``.grad`` are as that step left them (micro-batches of one
    logical batch each given to ``dp_sgd_step``, with ``optimizer.step()`` every few: the
    step would be of the last micro-batch alone, every one's noise drawn and counted). Said
    once per handle; a step run again on purpose (two methods compared) may ignore it."""
    last = _WRITTEN.get(hooks)
    if not last or {id(p) for p in params} != {id(ref()) for ref, *_ in last}:
        return
    for p_ref, p_version, g_ref, g_version in last:
        p, g = p_ref(), g_ref()
        if p is None or g is None or p.grad is not g:
            return
        if _torch.version(p) != p_version or _torch.version(g) != g_version:
            return
    _WRITTEN[hooks] = None
    warnings.warn(
        "gradhooks.dp_sgd_step: this step replaces the .grad the last dp_sgd_step wrote, "
        "which no optimizer step used (the parameters and their .grad are as it left them). "
        "Each dp_sgd_step is a whole DP-SGD step, with its own noise, and writes .grad (it "
        "does not add to it): micro-batches of one logical batch given to dp_sgd_step one "
        "after the other, with optimizer.step() after the last, step on the last one alone. "
        "Call optimizer.step() after every dp_sgd_step; for a logical batch in several "
        "physical batches, use gradhooks.DPOptimizer (opt.backward(losses) for each, "
        "opt.step() once) or gradhooks.clipped_sum.",
        GradhooksWarning,
        stacklevel=3,
    )


# Per handle, the state the generator of its last noised step started from (None once it has
# warned that the noise repeats)
_NOISE_STARTS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _warn_if_noise_repeats(hooks: Hooks, start: Tensor | None) -> None:
    """A step whose generator starts where the last noised step's started (a
    ``torch.Generator().manual_seed(0)`` made anew at every step, inside the loop) draws the
    very noise of that step: the steps' noises are then one, which hides nothing that the
    difference of two steps shows. Said once per handle; a step run again on purpose (two
    methods compared on one seed) may ignore it. ``start``: the generator's state before the
    step's draw (``None``: no generator, or no noise)."""
    if start is None:
        return
    last = _NOISE_STARTS.get(hooks, False)
    if last is None:
        return
    _NOISE_STARTS[hooks] = start
    if last is not False and torch.equal(last, start):
        _NOISE_STARTS[hooks] = None
        warnings.warn(
            "gradhooks.dp_sgd_step: the generator starts this step in the state it started the "
            "last one in (a torch.Generator seeded anew at every step?), so this step's noise "
            "is the last step's again: noise repeated across steps hides nothing that the "
            "difference of two steps shows. Make the generator once, before the loop, and pass "
            "that one at every step.",
            GradhooksWarning,
            stacklevel=3,
        )


def _checked(
    hooks: Hooks, per_example_loss: Tensor, method: str | None, reduction: str,
    expected_batch_size: float | None,
) -> str:  # fmt: skip
    """The method to use, after checking the arguments of a DP-SGD step."""
    if not isinstance(hooks, Hooks):
        raise ConfigurationTypeError(
            f"hooks must be the handle of gradhooks.add_hooks(model, quantities=('norms',)) "
            f"(or ('grad1',)), got {type(hooks).__qualname__}"
        )
    if not isinstance(per_example_loss, Tensor):
        raise ConfigurationTypeError(
            f"per_example_loss must be a tensor [batch] (the loss with reduction='none'), got "
            f"{type(per_example_loss).__qualname__}"
        )
    if hooks.model is None and hooks.active:
        names = ", ".join(f"'{n}' ({type(m).__qualname__})" for n, m in hooks.modules())
        raise StateError(
            "dp_sgd_step: the model these hooks were added to is gone (garbage-collected: "
            "add_hooks(model[:-1]) or add_hooks(nn.Sequential(...)) on a module nothing else "
            f"holds), though its layers still run with its hooks ({names or 'none'}): keep a "
            "reference to the module you hook, body = model[:-1]; h = add_hooks(body), and "
            "call it. Remove these hooks with h.remove()"
        )
    method = _checked_method(hooks, method)
    if reduction not in ("mean", "sum"):
        raise ConfigurationError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    _check_expected_batch_size(expected_batch_size, reduction)
    if per_example_loss.dim() != 1:
        raise ConfigurationError(
            f"per_example_loss must be [batch], got {tuple(per_example_loss.shape)}: use the "
            "loss with reduction='none' (and sum any other dimension per example)"
        )
    if not (per_example_loss.is_floating_point() or per_example_loss.is_complex()):
        raise ConfigurationError(
            f"dp_sgd_step: per_example_loss holds {per_example_loss.dtype} values, which have "
            "no gradient (correct-or-not flags, predicted classes, counts?): pass each "
            "example's loss, F.cross_entropy(output, target, reduction='none')"
        )
    if not per_example_loss.requires_grad and per_example_loss.shape != (0,):
        raise ConfigurationError(
            "dp_sgd_step: per_example_loss has no autograd history (detached, or computed "
            "under torch.no_grad()); the step runs the backward itself: pass the losses as "
            "the hooked forward gave them"
        )
    if per_example_loss in _STEPPED:
        raise ConfigurationError(
            "dp_sgd_step: these losses were already stepped on (their graph is freed, the "
            "parameters' .grad holds that step); run a new forward for the next step"
        )
    _refuse_scaled_loss(per_example_loss)
    return method


def _refuse_scaled_loss(per_example_loss: Tensor) -> None:
    """Refuses losses already multiplied by a GradScaler's scale ``S``
    (``scaler.scale(losses)``, the habit of a float16 loop): their norms are ``S`` times the
    gradients' own, so that the examples would be clipped to ``C/S``, and ``scaler.step``'s
    unscaling would divide the noise by ``S`` as well: a far weaker privacy than asked for,
    with no error. Found as the losses' last operation, a product whose saved factor is the
    very tensor a GradScaler holds as its scale (nothing read from the device)."""
    node = per_example_loss.grad_fn
    if node is None or node.name() != "MulBackward0":
        return
    for name in ("other", "self"):
        factor = _torch.saved(node, name)
        if (
            isinstance(factor, Tensor)
            and factor.numel() == 1
            and factor.dtype == torch.float32
            and not factor.requires_grad
            and _scale_of_a_scaler(factor)
        ):
            raise ConfigurationError(
                "dp_sgd_step: per_example_loss is already multiplied by a GradScaler's scale "
                "(scaler.scale(losses)): clipped as they are, the examples would be bounded "
                "by max_norm / scale, and scaler.step() would divide the noise by the scale: "
                "far less privacy than asked for. Pass the unscaled losses and the scaler "
                "itself, dp_sgd_step(hooks, losses, ..., scaler=scaler), which scales the "
                "backward and clips the unscaled norms. Nothing was changed."
            )


def _scale_of_a_scaler(t: Tensor) -> bool:
    """Whether ``t`` is the scale tensor some GradScaler holds (``_scale`` in its
    ``__dict__``, next to its growth tracker): the objects referring to ``t`` are searched,
    done only for a loss whose last product has a one-element float32 factor."""
    for r in gc.get_referrers(t):  # (an object's own dict, or the object where it has none)
        d = r if type(r) is dict else getattr(r, "__dict__", None)
        if type(d) is dict and d.get("_scale") is t and "_growth_tracker" in d:
            return True
    return False


def _checked_method(hooks: Hooks, method: str | None) -> str:
    """``method``, or the handle's default, after checking that the handle computes it."""
    if method is None:
        method = "grad1" if "grad1" in hooks.quantities else "bookkeeping"
    if method not in ("grad1", "ghost", "bookkeeping"):
        raise ConfigurationError(
            f"method must be 'grad1', 'ghost' or 'bookkeeping', got {method!r}"
        )
    needed = "grad1" if method == "grad1" else "norms"
    if needed not in hooks.quantities:
        raise ConfigurationError(
            f"dp_sgd_step(method={method!r}) needs a handle with quantities containing "
            f"{needed!r}, this one has {hooks.quantities!r}"
        )
    return method


def _check_clipping(
    max_norm: float, noise_multiplier: float, generator: Any = None, clipping: str = "flat"
) -> None:
    if clipping not in CLIPPINGS:
        raise ConfigurationError(
            f"clipping must be one of {CLIPPINGS}, got {clipping!r}: 'flat' scales each "
            "example's gradient by min(1, C/norm), 'automatic' by C/(norm + 0.01)"
        )
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ConfigurationTypeError(
            f"generator must be a torch.Generator or None, got {type(generator).__qualname__} "
            "(torch.Generator().manual_seed(seed) for reproducible noise)"
        )
    if not 0 < max_norm < float("inf"):  # (also NaN)
        raise ConfigurationError(
            f"max_norm must be > 0 and finite, got {max_norm!r}: it bounds each example's "
            "gradient norm (0 would leave the noise alone, a negative one would flip every "
            "gradient, NaN or Inf would clip nothing)"
        )
    require_number("noise_multiplier", noise_multiplier)
    if not 0 <= noise_multiplier < float("inf"):
        raise ConfigurationError(
            f"noise_multiplier must be >= 0 and finite, got {noise_multiplier!r}"
        )


def _grads(hooks: Hooks, loss: Tensor, wrt: list, retain_graph: bool = False) -> tuple:
    """``torch.autograd.grad(loss, wrt)``; where the forward ran calls with grad mode off
    (reentrant activation checkpointing, whose nodes run again only in a backward without
    ``inputs``), by ``loss.backward()``, ``.grad`` left as it was."""
    if not engine_of(hooks).recomputes:
        return torch.autograd.grad(loss, wrt, retain_graph=retain_graph, allow_unused=True)
    kept = [p.grad for p in wrt]
    for p in wrt:
        p.grad = None
    try:
        loss.backward(retain_graph=retain_graph)
        return tuple(p.grad for p in wrt)
    finally:
        for p, g in zip(wrt, kept, strict=True):
            p.grad = g


def _truth(hooks: Hooks, per_example_loss: Tensor, wrt: list, method: str) -> tuple | None:
    """On the first step of each new set of calls, autograd's gradient of the examples' own
    losses, for :func:`_check_step`: of ``Σ_i w_i · loss_i`` (:func:`pieces.example_weights`,
    every example checked at once; divided by the batch size where the hooks' backward takes
    the mean, as it does), to compare with the per-example gradients weighted alike (``grad1``,
    or the pieces the norms are formed from). Where the forward ran in a half precision
    (autocast), the weights are powers of two, which the backward carries without rounding.
    ``(weights, gradients, exact)``; ``None`` where it is not checked."""
    batch = per_example_loss.shape[0]
    engine = engine_of(hooks)
    if not engine.unverified or engine.recomputes or engine.sharded or batch < 2:
        return None
    if engine.user_backward_hooks():
        return None  # (no backward of the check's own through hooks of the user's)
    exact = half_precision(engine.probe_precision())
    weights = P.example_weights(batch, exact)
    w = weights.to(device=per_example_loss.device, dtype=per_example_loss.dtype)
    weighted = w * per_example_loss
    with engine.standing_aside():
        grads = torch.autograd.grad(
            weighted.mean() if hooks.loss_reduction == "mean" else weighted.sum(),
            wrt, retain_graph=True, allow_unused=True,
        )  # fmt: skip
    # (held until the step's check as compare.hold keeps them: an embedding's, its rows alone;
    # each replaced in the list as it is held and scaled, never two copies of all of them)
    grads = list(grads)
    for i, g in enumerate(grads):
        g = grads[i] = hold(g)
        if g is not None and hooks.loss_reduction == "mean":
            grads[i] = g * batch
        del g
    grads = tuple(grads)
    engine.drop_probe(weights)  # (the hooks' own check of the examples: this one is it)
    if "grad1" not in hooks.quantities:
        engine.mark_verified()
    return weights, grads, exact


def _check_step(
    hooks: Hooks, params: list, truth: tuple | None, got: Iterable[Tensor | None]
) -> None:
    """The step's per-example gradients against autograd's of the examples' own losses
    (:func:`_truth`): per parameter, ``got`` is ``Σ_i w_i · g_i`` (``None``: zeros), formed as
    it is compared, one parameter at a time. A loss that depends on other examples (a
    contrastive loss, a penalty added to each example's loss), losses out of the examples'
    order, or a model that mixes them where gradhooks cannot see it shows here."""
    if truth is None:
        return
    _, grads, exact = truth
    names = {id(p): n for n, p in hooks.model.named_parameters()}
    overall = max((largest(w) for w in grads if w is not None and w.numel()), default=0.0)
    engine = engine_of(hooks)
    precision = engine.precision
    wrong = []
    for p, want, g in zip(params, grads, got, strict=True):
        if g is not None:  # (a sparse one: the rows of an embedding, of its shape)
            g = g if g.is_sparse else g.reshape(p.shape)
            g = g.to(p.dtype if want is None else want.dtype)
        if want is None:  # (zeros: the difference is the same either way round)
            want, g = g, None
        diff = None if want is None else mismatch(
            g, want, None, overall, **PROBE_TOLERANCE, precision=precision, exact=exact,
            terms=engine.rounded_terms(p), terms_scale=engine.shares_size(p),
        )  # fmt: skip
        del g, want
        if diff is not None:
            wrong.append(f"'{names.get(id(p), '?')}' ({diff})")
    if not wrong:
        return
    engine.mark_refused()
    what = (
        "the per-example gradients from the hooks, weighted over the examples, are not "
        "the gradient of the examples' own losses weighted alike"
    )
    more = f" and {len(wrong) - 5} more" if len(wrong) > 5 else ""
    raise CheckFailedError(
        f"dp_sgd_step: {what} (by autograd), for {', '.join(wrong[:5])}{more}. Either an "
        "example's loss depends on the other examples (a loss that couples the batch, such as "
        "a contrastive one) or on the parameters outside the model's per-example path (a "
        "penalty such as weight decay added to each example's loss: leave it out, and add its "
        "gradient to .grad after the step), or per_example_loss is not in the order of the "
        "forward's examples (sorted, flipped or shuffled after the forward: entry i must be the "
        "loss of example i), or the model mixes the examples where gradhooks cannot see it. "
        "Clipping would not bound each example's influence, so no gradient was "
        "written. This is checked on the first step of each new set of layer calls, and at "
        "every step after one it refused."
    )


class StepSums(NamedTuple):
    """What :func:`_step_sums` gives."""

    norms: Tensor
    """The per-example gradient norms before clipping (unscaled), ``[batch]``."""
    sums: list[Tensor]
    """Per parameter, ``Σ_i f_i · g_i`` (dense, of its full shape)."""
    scale: float | None
    """An enabled GradScaler's scale ``S`` (the sums are ``S ·`` the clipped ones), else
    ``None``."""
    sparse: list[bool]
    """Per parameter, whether autograd's gradient of it is a sparse tensor
    (``nn.Embedding(sparse=True)``'s): its ``.grad`` is written sparse too (:func:`as_grad`)."""


def _sparse(grads: Iterable[Tensor | None]) -> list[bool]:
    """Per gradient, whether autograd gave it as a sparse tensor."""
    return [g is not None and g.is_sparse for g in grads]


def as_grad(value: Tensor, sparse: bool) -> Tensor:
    """``value`` (a dense gradient) in the layout autograd gives the parameter: where that is
    sparse, a sparse tensor of the rows that hold a nonzero (every row, once noised; those of
    the examples' lookups without noise), so that the optimizer the model trains with without
    the DP step (``SparseAdam``) takes the DP step's gradient too."""
    value = value.detach() if value.requires_grad else value
    return value.to_sparse(sparse_dim=1) if sparse else value


def write_grad(p: Tensor, value: Tensor) -> None:
    """``p.grad = value``, written into the tensor ``p.grad`` holds where it is one like
    ``value`` (dense, of its shape, dtype and device, an entry per element), as autograd's
    backward adds into an existing ``.grad``: a ``.grad`` that is a view of a flat buffer (a
    contiguous gradient buffer stepped as one tensor, float32 master weights stepped from it,
    ``DistributedDataParallel(gradient_as_bucket_view=True)``) then holds the step's gradient,
    where a new tensor would leave the buffer with the old one."""
    g = p.grad
    if (
        g is not None
        and type(g) is torch.Tensor
        and type(value) is torch.Tensor
        and g.layout == value.layout == torch.strided
        and (g.shape, g.dtype, g.device) == (value.shape, value.dtype, value.device)
        and not g.requires_grad
        and (g.is_contiguous() or g.stride() == p.stride())
    ):
        with torch.no_grad():
            g.copy_(value)
    else:
        p.grad = value


def _clipped_sums(hooks: Hooks, *args, **kwargs) -> StepSums:
    """:func:`_step_sums`; refused (a check of the step's after its backward: the examples
    mixed, the batch not found), no ``grad1`` or quantity of the step is left to read, and
    ``.grad`` is as it was (the step's backward returns its gradients instead of adding them).
    The step's backwards are of the losses' sum, whatever the handle's ``loss_reduction``
    (set back after): the mean's ``1 / batch``, which each example's gradient is scaled back
    from, would cost float16's small output-gradients their bits."""
    reduction = hooks.loss_reduction
    hooks.loss_reduction = "sum"
    try:
        with torch.enable_grad():  # (a step called under torch.no_grad(), as backward() may be)
            return _step_sums(hooks, *args, **kwargs)
    except RuntimeError as e:
        engine_of(hooks).discard_written()
        if "backward through the graph a second time" not in str(e):
            raise
        raise StateError(
            "the step's backward found the losses' graph freed: a backward of your own ran on "
            "these losses (or a loss computed from them) before the step. The step runs the "
            "backward itself, the clipped one: pass the losses of a new forward without "
            "calling backward on them; no gradient of the step was written"
        ) from e
    except BaseException:
        engine_of(hooks).discard_written()
        raise
    finally:
        hooks.loss_reduction = reduction


def _step_sums(
    hooks: Hooks,
    per_example_loss: Tensor,
    max_norm: float,
    method: str,
    params: list,
    scaler: torch.amp.GradScaler | None = None,
    into: Callable[[Tensor, Tensor | None], Tensor] | None = None,
    clipping: str = "flat",
    groups: GroupedBounds | None = None,
) -> StepSums:
    """The per-example norms and, per parameter, ``Σ_i f_i · g_i`` (``f_i``: ``clipping``'s
    factor, :func:`clip_factors`; full-sized,
    as plain tensors of the step's own, also for a parameter sharded by FSDP2) of this
    process's examples. With an enabled GradScaler, its scale ``S`` (also returned, else
    ``None``): the backward is that of ``scaler.scale(losses)``, the norms returned and
    clipped are those divided by ``S``, the sums ``S ·`` the clipped ones. ``into``: called
    once the clipping factors are known, the tensors (one per parameter, contiguous, of its
    full shape and dtype) the sums are added to in place and returned as (else zeros).
    ``groups``: each parameter's ``f_i`` is that of its group, of the group's norms and bound
    (:mod:`gradhooks.workflows.clipping`); ``max_norm`` is then not used."""
    if groups is not None and method == "ghost":  # (one group: grouped refuses more)
        max_norm, groups = groups.bounds[0], None
    if not per_example_loss.requires_grad and per_example_loss.shape == (0,):
        return _no_example(hooks, per_example_loss, params, scaler, into)
    stepped, scaled_by, loss_scale = per_example_loss, 1.0, None
    if scaler is not None and scaler.is_enabled():
        scaled_by = loss_scale = float(scaler.get_scale())
        _check_scale(loss_scale)
        per_example_loss = scaler.scale(per_example_loss)
    batch = per_example_loss.shape[0]
    unscaled = (lambda t: t) if scaled_by == 1.0 else (lambda t: t / scaled_by)  # noqa: E731
    loss = per_example_loss.mean() if hooks.loss_reduction == "mean" else per_example_loss.sum()
    # (FSDP2: the backward is taken with respect to the unsharded parameters the forward used)
    engine = engine_of(hooks)
    wrt = engine.in_use_of(params)
    truth = _truth(hooks, per_example_loss, wrt, method)
    hooks.clear()
    if method == "grad1":
        grads = _grads(hooks, loss, wrt)
        sparse = _sparse(grads)
        grads1 = [getattr(p, "grad1", None) if engine.wrote(p) else None for p in params]
        _check_captured(hooks, params, grads, [g is not None for g in grads1])
        _refuse_coupled(hooks, params)
        del grads  # (autograd's unused gradients: an embedding's is a whole table)
        _check_batch(hooks, per_example_loss, [g.shape[0] for g in grads1 if g is not None])
        if groups is None:
            sq = per_example_loss.new_zeros(batch)
            for g in grads1:
                if g is not None:
                    sq = sq + _row_sq(g)
        else:  # (per group, the same sums in the same order)
            group_sq = groups.group_sq((
                (j, _row_sq(g)) for j, g in enumerate(grads1) if g is not None
            ), per_example_loss.new_zeros(batch), stacked=False)  # fmt: skip
            sq = group_sq.sum(0)
        norms = sq.sqrt()
        if truth is not None:
            w = truth[0]
            _check_step(hooks, params, truth, (
                None if g is None else torch.einsum("b,b...->...", w.to(g.device, g.dtype), g)
                for g in grads1
            ))  # fmt: skip
            truth = None  # (autograd's gradients of the check, freed)
        if groups is None:
            per_param = [clipping_factors(unscaled(norms), max_norm, clipping)] * len(params)
        else:
            group_norms = unscaled(group_sq.sqrt())
            factors = clipping_factors(group_norms, groups.column(group_norms), clipping)
            per_param = [factors[k] for k in groups.index]
        # (in the higher of the two precisions: bfloat16 parameters have float32 norms)
        clipped = _added(into, params, (
            None if g is None else torch.einsum("b,b...->...", *_widest(f, g)).to(p.dtype)
            for p, g, f in zip(params, grads1, per_param, strict=True)
        ))  # fmt: skip
    elif method == "bookkeeping":
        kept: list = []
        # (this backward's own parameter gradients are not used; where the norms form a
        # parameter's grad1, it is kept: its clipped sum is then a weighted sum of it, not the
        # product of its pieces again)
        with engine.backward_mode(param_grads=False, keep=kept):
            with engine.collector.keeping_grad1() as grad1s:
                grads = _grads(hooks, loss, wrt)
        sparse = _sparse(grads)
        _check_captured(hooks, params, grads, _have_norms(hooks, params))
        _refuse_coupled(hooks, params)
        del grads  # (autograd's unused gradients: an embedding's is a whole table)
        norms = _captured_norms(hooks, per_example_loss)
        if truth is not None:
            _check_step(hooks, params, truth, _weighted(kept, truth[0], params))
            truth = None  # (autograd's gradients of the check, freed)
        if groups is None:
            factors = clipping_factors(unscaled(norms), max_norm, clipping).detach()
            group_of: dict[int, int] = {}  # (every parameter: factors itself)
        else:
            group_norms = unscaled(_captured_group_norms(hooks, per_example_loss, params, groups))
            factors = clipping_factors(group_norms, groups.column(group_norms), clipping).detach()
            group_of = {id(p): k for p, k in zip(params, groups.index, strict=True)}
        clipped = _kept_sums(params, kept, grad1s, factors, group_of, into)
        del grad1s
    else:
        # (the step that is checked keeps the pieces the norms come from, to weigh them)
        kept = [] if truth is not None else None
        with engine.backward_mode(keep=kept):
            grads = _grads(hooks, loss, wrt, retain_graph=True)
        sparse = _sparse(grads)
        _check_captured(hooks, params, grads, _have_norms(hooks, params))
        _refuse_coupled(hooks, params)
        del grads  # (autograd's unused gradients: an embedding's is a whole table)
        norms = _captured_norms(hooks, per_example_loss)
        if truth is not None:
            _check_step(hooks, params, truth, _weighted(kept, truth[0], params))
            truth = kept = None  # (freed)
        factors = clipping_factors(unscaled(norms), max_norm, clipping).detach()
        with engine.backward_mode(capture=False):  # (a reweighted backward: .grad only)
            grads = list(_grads(hooks, (factors * per_example_loss).sum(), wrt))
        clipped = _added(into, params, _popped(grads))  # (each freed once added)
    _STEPPED[stepped] = True
    return StepSums(unscaled(norms), clipped, loss_scale, sparse)


def _no_example(
    hooks: Hooks, per_example_loss: Tensor, params: list, scaler: Any, into: Any
) -> StepSums:
    """:func:`_step_sums` of a batch of no example whose losses come from no forward (an empty
    Poisson draw for a model that cannot run 0 rows, ``torch.zeros(0)``): the sum over no
    example is zero for every parameter, as the per-example loop's is, so the step is the
    noise alone. Nothing runs backward; each parameter's gradient is sparse where its module
    makes it so (``nn.Embedding(sparse=True)``), as autograd's would be."""
    hooks.clear()
    scale = float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else None
    owner = {id(p): m for m in hooks.model.modules() for p in m.parameters(recurse=False)}
    sparse = [getattr(owner.get(id(p)), "sparse", False) is True for p in params]
    clipped = _added(into, params, (None for _ in params))
    return StepSums(per_example_loss.detach().new_zeros(0), clipped, scale, sparse)


def _of(factors: Tensor, group: int | None) -> Tensor:
    """A parameter's clipping factors, ``[batch]``: those of its group (``factors``
    ``[groups, batch]``), or ``factors`` itself (one bound, ``group`` ``None``)."""
    return factors if group is None else factors[group]


def _captured_group_norms(
    hooks: Hooks, per_example_loss: Tensor, params: list, groups: GroupedBounds
) -> Tensor:
    """Per group, the per-example norm of its parameters' gradient together, ``[groups,
    batch]``, from the per-parameter squared norms the last backward captured (summed as
    :meth:`Hooks.norms` sums them all); zeros where it reached no parameter of a group."""
    captured = engine_of(hooks).collector.param_sq_norms
    names = engine_of(hooks).collector.names
    position = {names.get(id(p)): j for j, p in enumerate(params)}
    stray = [n for n in captured if n not in position]
    if stray:
        raise StateError(
            f"dp_sgd_step: the backward captured the per-example norms of {stray[:5]}, which "
            "are not among the step's trainable parameters (frozen, or swapped, since the "
            "forward?), so they would be in no clipping group. Run the forward again after "
            "changing the model. No gradient was written."
        )
    like = next(iter(captured.values()), per_example_loss)
    zeros = like.new_zeros(per_example_loss.shape[0])
    return groups.group_sq(((position[n], sq) for n, sq in captured.items()), zeros, True).sqrt()


def _added(
    into: Callable[[Tensor, Tensor | None], Tensor] | None,
    params: list,
    sums: Iterator[Tensor | None],
) -> list[Tensor]:
    """Per parameter, its sum (formed when reached: one at a time) added to ``into(p, sum)``'s
    tensor (called in the order of ``params``: the noise is drawn parameter after parameter,
    each when its sum is at hand), or the sum itself (zeros for ``None``)."""
    if into is None:
        return [_zeros(p) if s is None else s for p, s in zip(params, sums, strict=True)]
    out = []
    for p, s in zip(params, sums, strict=True):
        out.append(into(p, None if s is None else s.detach()))
        del s  # (a sum is freed once added)
    return out


def _popped(items: list) -> Iterator:
    """The items of ``items``, each taken out of the list as it is given (so that the list
    does not keep it alive once used)."""
    items.reverse()
    while items:
        yield items.pop()


def _kept_sums(
    params: list,
    kept: list,
    grad1s: dict[int, list[Tensor]],
    factors: Tensor,
    group_of: dict[int, int],
    into: Callable[[Tensor, Tensor | None], Tensor] | None,
) -> list[Tensor]:
    """Per parameter, ``Σ_i f_i · g_i`` from what a book-keeping backward kept: ``grad1s``
    (a parameter's per-example gradients, by slices of the batch) and ``kept`` (every call's
    pieces), each freed once used; ``f_i`` the factors of the parameter's group
    (``group_of``; ``factors`` itself for one bound). With ``into`` (a parameter's noise,
    drawn when called, in the order of ``params``) the sums are added to its tensors.

    What was kept is used up before any noise is drawn, so that the two are never held
    together: the per-example gradients and the calls' pieces (in the backward's order, each
    call freed once added) are summed into a tensor per parameter, except the calls whose
    pieces add into a few rows of their parameters (:attr:`Piece.adds_rows`: an embedding's
    lookups, against its whole table), which wait. Then, parameter after parameter, its noise
    is drawn, its sum added to it and freed, and its waiting pieces added in place. The peak
    is about the larger of what was kept and the gradients, where it was their sum."""
    by_id = {id(p): p for p in params}
    sums: dict[int, Tensor] = {}
    for key in [key for key in grad1s if key in by_id]:
        out = sums[key] = _zeros(by_id[key])
        _add_weighted(out, grad1s.pop(key), _of(factors, group_of.get(key)))
    weights: dict[tuple, Tensor] = {}  # (per scale: one call's, mostly every call's)

    def weight(p: Tensor, scale: float) -> Tensor:
        k = group_of.get(id(p))
        w = weights.get((scale, k))
        if w is None:
            f = _of(factors, k)
            w = weights[(scale, k)] = f * scale if scale != 1.0 else f
        return w

    summed = set(sums)  # (a parameter whose grad1 was kept: its pieces are not used)
    waiting: dict[int, list[tuple[P.Piece, Tensor]]] = {}
    while kept:  # (each call's pieces freed once added)
        pieces, live, scale = kept.pop(0)
        # (a parameter frozen since the forward is not the step's: its pieces are not used)
        used = {n: p for n, p in live.items() if id(p) in by_id and id(p) not in summed}
        if all(pieces[n].adds_rows for n in used):
            for n, p in used.items():
                waiting.setdefault(id(p), []).append((pieces[n], weight(p, scale)))
        else:
            for n, p in used.items():
                out, w = sums.get(id(p)), weight(p, scale)
                if out is not None:
                    pieces[n].add_batch_sum(out, w)
                elif P.accumulation_dtype(p.dtype) is p.dtype:
                    # (the first piece of a parameter whose pieces are of its dtype: its sum,
                    # a tensor of its own, is where the others add)
                    first = pieces[n].batch_sum(p.shape, w)
                    if first.dtype != p.dtype or type(first) is not Tensor:
                        first = _zeros(p).add_(first)
                    sums[id(p)] = first
                else:
                    pieces[n].add_batch_sum(sums.setdefault(id(p), _zeros(p)), w)
        del pieces, live, used
    clipped = []
    for p in params:
        total = sums.pop(id(p), None)
        if into is not None:
            c = into(p, total)
        else:
            c = _zeros(p) if total is None else total
        del total
        for piece, w in waiting.pop(id(p), ()):
            piece.add_batch_sum(c, w)
        clipped.append(c)
    return clipped


def _add_weighted(out: Tensor, slices: list[Tensor], weights: Tensor) -> None:
    """``out += Σ_b weights[b] · grad1[b]``, ``grad1`` given as consecutive slices of the
    batch (``[rows, *out.shape]`` each), freed as they are added."""
    start, flat = 0, out.view(-1)
    while slices:
        g = slices.pop(0)
        rows = g.shape[0]
        w = weights[start : start + rows].to(device=g.device, dtype=g.dtype)
        start += rows
        if g.dtype == out.dtype:
            flat.addmv_(g.reshape(rows, -1).T, w)
        else:
            flat.add_((g.reshape(rows, -1).T @ w).to(out.dtype))
        del g


def _row_sq(g: Tensor) -> Tensor:
    """Each example's squared norm of ``g`` (``[batch, ...]``, a ``grad1``), ``[batch]``,
    formed in :func:`gradhooks.pieces.accumulation_dtype` (float32 for a float16 or bfloat16
    ``grad1``, as the norms quantity forms it: in float16 a square overflows above 256, and
    the example, its norm Inf, would be clipped to nothing)."""
    rows = P.flat_rows(g)
    dtype = P.accumulation_dtype(rows.dtype)
    return (rows if rows.dtype == dtype else rows.to(dtype)).pow(2).sum(1)


def _widest(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``a`` and ``b`` in the more precise of their dtypes."""
    dtype = torch.promote_types(a.dtype, b.dtype)
    return a.to(dtype), b.to(dtype)


def _weighted(kept: list, weights: Tensor, params: list) -> Iterator[Tensor | None]:
    """Per parameter, ``Σ_i weights[i] · g_i`` from the pieces a backward kept, each formed
    when asked for (``None``: none)."""
    uses = P.uses_by_parameter(kept)
    for p in params:
        # (an embedding's: its rows looked up alone, not a table, while every piece is kept)
        found = P.weighted_rows(uses[id(p)], weights) if id(p) in uses else None
        if found is None and id(p) in uses:
            found = P.weighted_sum(uses[id(p)], weights)
        yield None if found is None else found.to(p.dtype)


def _have_norms(hooks: Hooks, params: list) -> list[bool]:
    """Per parameter, whether the last backward captured its per-example norms."""
    collector = engine_of(hooks).collector
    names, captured = collector.names, collector.param_sq_norms
    return [names.get(id(p)) in captured for p in params]


def _refuse_coupled(hooks: Hooks, params: list) -> None:
    """Refuses, on every step, a step through a layer whose batch gradient is by design not
    the sum of its per-example gradients: there, autograd's gradient of the clipped losses
    (the ghost step) couples the examples, and no step can be checked against autograd."""
    engine = engine_of(hooks)
    if not engine.any_unsummed(params):
        return  # (named only where one is: naming walks the model)
    coupled = [n for n, p in names_of(hooks, params) if engine.by_design_unsummed(p)]
    if coupled:
        raise UnsupportedError(
            f"dp_sgd_step: the batch gradient of {', '.join(coupled[:5])} is by its layer's "
            "design not the sum of its per-example gradients (an Embedding with "
            "scale_grad_by_freq=True divides by each row's count over the whole batch, each "
            "example's gradient by its own count): through it an example's contribution to "
            "autograd's gradient depends on the other examples, and the step cannot be checked "
            "against autograd. Construct the layer without that option "
            "(scale_grad_by_freq=False) for DP-SGD. No gradient was written."
        )


def _check_captured(hooks: Hooks, params: list, grads: tuple, captured: list[bool]) -> None:
    """Refuses a step where the backward computed a parameter's gradient but captured no
    per-example gradient of it: it would be left out of the clipping (the step would give it
    zero, or noise alone), and the model would silently not train it. ``captured`` counts as
    reaching a parameter too: a book-keeping backward leaves autograd no gradient of the
    parameters of a layer whose batch gradient is the sum of its ``grad1`` (a Linear or
    convolution over many positions, an Embedding), only the norms its rule captured."""
    if params and all(g is None for g in grads) and not any(captured):
        raise StateError(
            f"dp_sgd_step: per_example_loss does not depend on any trainable parameter of the "
            f"hooked {type(hooks.model).__qualname__} (computed from another model, or from a "
            "detached output): the step would be noise alone. Pass the losses computed from "
            "the hooked model's output. No gradient was written."
        )
    lost = [p for p, g, ok in zip(params, grads, captured, strict=True) if g is not None and not ok]
    if lost:
        names = {id(p): n for n, p in hooks.model.named_parameters()}
        lost = [f"'{names.get(id(p), '?')}'" for p in lost]
        more = f" and {len(lost) - 5} more" if len(lost) > 5 else ""
        raise StateError(
            f"dp_sgd_step: the backward computed the gradient of {', '.join(lost[:5])}{more} "
            "but gradhooks captured no per-example gradient for them, so they cannot be "
            "clipped (the step would give them zero, or noise alone). Run the forward after "
            "add_hooks, with capture on; a warning of the backward says more."
        )


def names_of(hooks: Hooks, params: list) -> list[tuple[str, Tensor]]:
    """``params`` with their quoted names in the hooked model."""
    names = {id(p): n for n, p in hooks.model.named_parameters()}
    return [(f"'{names.get(id(p), '?')}'", p) for p in params]


def _zeros(p: Tensor) -> Tensor:
    """Zeros of ``p``'s full shape, as a plain tensor (also for a DTensor)."""
    return torch.zeros(p.shape, dtype=p.dtype, device=p.device)


def _check_expected_batch_size(expected_batch_size: float | None, reduction: str) -> None:
    if expected_batch_size is None:
        return
    if reduction != "mean":
        raise ConfigurationError(
            f"expected_batch_size={expected_batch_size!r} divides the sum by the expected batch "
            f"size, which contradicts reduction={reduction!r}: give one or the other"
        )
    require_number("expected_batch_size", expected_batch_size)
    if not 0 < expected_batch_size < float("inf"):
        raise ConfigurationError(
            f"expected_batch_size must be > 0 and finite, got {expected_batch_size!r}"
        )


def check_batch_against_expected(batch: int, expected: float | None, where: str) -> None:
    """Refuses a step whose batch is so far from ``expected`` (more than ``7·√expected + 7``
    examples away) that no Poisson sampler of that expected size drew it (probability below
    1e-11 per step): the expected batch size given is not the sampler's (the sampling rate,
    or the dataset's size, passed instead), or the batch is a piece of one (noise added per
    micro-batch). Dividing by it would scale the step by the wrong factor, silently."""
    if expected is None:
        return
    if abs(batch - expected) > 7 * math.sqrt(expected) + 7:
        raise ConfigurationError(
            f"{where}: a batch of {batch} examples with expected_batch_size={expected!r}: a "
            "Poisson-sampled batch is this far from its expected size with probability below "
            "1e-11, so expected_batch_size is not that of the sampler that drew it (it is "
            "sampler.expected_batch_size = sample_rate * len(dataset), not the sampling rate "
            "or the dataset's size), or the batch is a part of one (for a logical batch in "
            "several physical ones, use gradhooks.DPOptimizer: the noise is added once). "
            "No gradient was written."
        )


def _denominator(batch: int, reduction: str, expected_batch_size: float | None) -> float:
    """``D``: the expected batch size if given, else the batch size (mean) or 1 (sum)."""
    if expected_batch_size is not None:
        return expected_batch_size
    return max(batch, 1) if reduction == "mean" else 1


def _captured_norms(hooks: Hooks, per_example_loss: Tensor) -> Tensor:
    """The per-example norms the last backward captured (zeros where it reached no layer)."""
    if engine_of(hooks).collector.param_sq_norms:
        norms = hooks.norms()
        _check_batch(hooks, per_example_loss, [norms.shape[0]])
        return norms
    return per_example_loss.new_zeros(per_example_loss.shape[0])


def _check_batch(hooks: Hooks, per_example_loss: Tensor, sizes: list[int]) -> None:
    """The losses are one per example of the captured batch."""
    n = per_example_loss.shape[0]
    bad = [size for size in sizes if size != n]
    if bad:
        one = n == 1  # (the batch's loss kept as [1])
        views = bad[0] // n if n > 1 and bad[0] % n == 0 else 0
        raise ConfigurationError(
            f"dp_sgd_step: per_example_loss has {n} entries, but the "
            f"hooked forward had a batch of {bad[0]} examples: give one loss per example "
            + ("(the loss with reduction='none', not its mean or sum kept as [1]) " if one else "")
            + "(per-token losses [batch * seq] summed or averaged per example: "
            "losses.view(batch, -1).sum(1)); if the examples are not on dimension 0 of the "
            "model's input (a time-major [seq, batch, ...] batch), say where they are: "
            "add_hooks(model, batch_dim=1)"
            + (
                f"; if the forward's batch is {views} views (augmentations) of each example "
                "concatenated, torch.cat(views), the model sees them as that many examples: "
                "stack them on a dimension of their own, torch.stack(views, 1) "
                f"[{n}, {views}, ...], and average each example's losses over it, or run one "
                "forward per view and add their losses"
                if views > 1
                else ""
            )
            + (
                "; if some examples' losses were left out (losses[keep], the non-finite ones "
                "dropped), the forward's batch still holds those examples: take them out of the "
                "batch before the forward, model(x[keep])"
                if 1 < n < bad[0] and not views
                else ""
            )
            + ". No gradient was written."
        )


def gaussian(p: Tensor, generator: torch.Generator | None) -> Tensor:
    """Standard normal noise of ``p``'s full shape and dtype (also for a DTensor), drawn from
    ``generator`` (one parameter after the other, in the order of :func:`_covered_params`)."""
    device = p.device if generator is None else generator.device
    z = torch.randn(p.shape, generator=generator, dtype=p.dtype, device=device)
    return z if z.device == p.device else z.to(p.device)


def noise(
    p: Tensor, generator: torch.Generator | None, std: float, total: Tensor | None = None
) -> Tensor:
    """``std · gaussian(p, generator)``, plus ``total`` (``p``'s clipped sum, of its shape and
    dtype) where given: a new contiguous tensor of ``p``'s full shape and dtype, on ``p``'s
    device, for a gradient to be built in. Drawn scaled (``normal(0, std)``: the same standard
    normal numbers, each times ``std`` as it is drawn, rounded once), not scaled in a second
    pass over the tensor (for an embedding's table, a pass of its size). Where ``total`` is
    on the generator's device, drawn around it (``torch.normal(total, std)``, which draws
    ``normal(0, std)`` of its shape and adds it: the same numbers, one operation through
    torch's dispatcher instead of two)."""
    device = p.device if generator is None else generator.device
    if (
        total is not None
        and type(total) is Tensor
        and total.layout is torch.strided  # (a sparse embedding's sum: added below)
        and total.is_contiguous()
        and total.device == device
        and total.dtype == p.dtype
        and total.shape == p.shape
    ):
        return torch.normal(total, std, generator=generator)
    z = torch.normal(0.0, std, p.shape, generator=generator, dtype=p.dtype, device=device)
    z = z if z.device == p.device else z.to(p.device)
    return z if total is None else z.add_(total)


def _foreach_div_(xs: list[Tensor], denom: float) -> None:
    if denom != 1:  # (exact: nothing to do)
        _torch.foreach_div_(xs, denom)


class _Plan(NamedTuple):
    """A step's parameters for one structure of the hooked model."""

    key: tuple | None
    """The engine's structure it was made for (``None``: FSDP2, made again at every step)."""
    params: list[torch.nn.Parameter]
    """The trainable parameters of the hooked modules, in the order of
    ``named_parameters()`` (that of the noise)."""
    names: list[str]
    """Their qualified names."""
    missing: list[str]
    """Trainable parameters of no hooked module (``unsupported="skip"``)."""
    complex_: list[str]
    """Trainable complex parameters."""
    walked: list[torch.nn.Parameter]
    """Every parameter of the model, as ``named_parameters()`` gives them."""
    flags: list[tuple[bool, bool]]
    """Whether each of :attr:`walked` was trainable and complex."""


# Per handle, the plan of its last step
_PLANS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _flags(params: list[torch.nn.Parameter]) -> list[tuple[bool, bool]]:
    return [(p.requires_grad, p.is_complex()) for p in params]


def _plan(hooks: Hooks) -> _Plan:
    """The handle's step plan: made again where the model's structure changed since the last
    step. The engine walks the model at each forward (a module or a parameter added, removed,
    swapped, frozen or unfrozen before it gives another structure); what a step reads besides
    (a parameter frozen since the forward, made complex) is read from the parameters."""
    model = hooks.model
    if model is None or not hooks.active:
        what = "its model no longer exists" if model is None else (
            f"the hooks of {type(model).__qualname__} were removed (h.remove(), the end of its "
            "with block, or gradhooks.remove_hooks)"
        )  # fmt: skip
        raise StateError(
            f"a DP step (dp_sgd_step, clipped_sum, DPOptimizer.backward) needs an active "
            f"handle, and {what}: its clipping would have no per-example gradient. Add the "
            "hooks again, h = gradhooks.add_hooks(model, quantities=('norms',)), before the "
            "forward, and step with that handle (a DPOptimizer: build it again around the "
            "same optimizer with the new handle). Nothing was changed."
        )
    engine = engine_of(hooks)
    engine.follow_dropped()
    key = None if engine.sharded else engine.structure
    plan = _PLANS.get(hooks) if key is not None else None
    if plan is None or plan.key is not key or _flags(plan.walked) != plan.flags:
        plan = _planned(hooks, key)
        if key is not None:
            _PLANS[hooks] = plan
    return plan


def _planned(hooks: Hooks, key: tuple | None) -> _Plan:
    engine = engine_of(hooks)
    covered = engine.covered()
    params, names, missing, complex_, seen, walked = [], [], [], [], set(), []
    for name, p in engine.named_parameters():  # (FSDP2: the sharded parameters)
        walked.append(p)
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if p.is_complex():
            complex_.append(name)
        if id(p) in covered:
            params.append(p)
            names.append(name)
        else:
            missing.append(name)
    return _Plan(key, params, names, missing, complex_, walked, _flags(walked))


def _covered_params(hooks: Hooks) -> list[torch.nn.Parameter]:
    """The trainable parameters of the hooked modules, in the order the noise is drawn, after
    refusing a complex one and one of no hooked module."""
    return list(_checked_plan(hooks).params)


def _checked_plan(hooks: Hooks) -> _Plan:
    """The handle's step plan, refused where it has a complex trainable parameter or one of
    no hooked module."""
    plan = _plan(hooks)
    if plan.complex_:
        raise ConfigurationError(
            f"dp_sgd_step: '{plan.complex_[0]}' is complex: the clipping is defined here for "
            "real parameters only (freeze it, or clip its grad1 yourself)"
        )
    if plan.missing and hooks.unsupported != "skip":  # (every module with one is covered)
        raise UnsupportedError(
            f"dp_sgd_step: trainable parameters {plan.missing} are not among the tensors the "
            "hooked calls ran with at the last forward (torch.func.functional_call put others "
            "in their slots, such as p.to(torch.bfloat16) or p - lr * g; or they were frozen "
            "then): the step clips the per-example gradients of those tensors, and has none "
            "of these. Give the step the losses of a forward of the model with its own "
            "parameters, trainable (under torch.autocast for a lower precision). Nothing was "
            "changed."
        )
    if plan.missing:
        raise UnsupportedError(
            f"dp_sgd_step: trainable parameters {plan.missing} have no gradhooks rule (hooked "
            "with unsupported='skip'), so their per-example gradients cannot be clipped; "
            "freeze them or register a rule"
        )
    return plan

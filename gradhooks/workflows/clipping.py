"""Clipping bounds for DP-SGD: a bound per group of parameters, and a bound that adapts
(:class:`AdaptiveClipping`, at the end).

With ``clipping_groups=`` (on :func:`gradhooks.dp_sgd_step`, :func:`gradhooks.clipped_sum`,
:class:`gradhooks.DPOptimizer`, :func:`gradhooks.make_private` and
:func:`gradhooks.distributed.dp_sgd_step`) each example's gradient is split into groups of
parameters, and each group's part is clipped to its own bound ``C_k``: example ``i``'s gradient
of group ``k``, ``g_ik`` (its parameters' per-example gradients together), is scaled by
``min(1, C_k / ‖g_ik‖)`` (``clipping="flat"``) or ``C_k / (‖g_ik‖ + 0.01)``
(``"automatic"``), both at most ``C_k`` in norm. An example's clipped gradient then has norm at
most the *total bound*

    C = √(Σ_k C_k²),

the step's sensitivity: the noise is ``σ·C·N(0, I)``, so that ``σ`` (the noise multiplier the
accountant records) is relative to ``C`` as for one bound over the whole model, and the same
``σ`` gives the same ε.

The groups:

- ``"parameter"``: every trainable parameter alone (Opacus' ``clipping="per_layer"``, fastDP's
  ``clipping_style="param-wise"``);
- ``"layer"``: the trainable parameters of each module together, the module whose own
  parameter each is (fastDP's ``"layer-wise"``);
- a list of groups, each a list of parameters or of their qualified names in the hooked model
  (blocks of layers: fastDP's ``"block-wise"``), or an optimizer's ``param_groups`` (dicts with
  ``"params"``). Every trainable parameter of the hooked model is in exactly one group; a
  frozen parameter of the model in a group is left out (it has no gradient), and a group whose
  parameters are all frozen (a frozen block's param group) is left out with its bound: ``K``
  below counts the groups with a trainable parameter, and the total bound is theirs.

The bounds (``max_norm``, ``max_grad_norm``):

- one float ``C``: every group's bound is ``C / √K`` for ``K`` groups (fastDP's convention),
  and the total bound is ``C``;
- one float per group, ``[C_1, ..., C_K]`` (Opacus' list of ``max_grad_norm``), in the
  groups' order (for ``"parameter"`` and ``"layer"``, that of ``model.named_parameters()``);
  the total bound is ``√(Σ_k C_k²)``.

``clipping_groups=None`` (the default) is one bound over the whole model, ``max_norm`` a
float. One group holding every parameter with bound ``C`` is the same step as that, number for
number.

Ghost clipping (``method="ghost"``) takes the clipped sum from autograd's gradient of
``Σ_i f_i · loss_i``, one factor per example for every parameter; a factor per example *and*
group is no such sum, so it is refused with more than one group: use ``"bookkeeping"`` (the
per-group norms from the per-parameter norms the hooks compute anyway) or ``"grad1"``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

from ..errors import ConfigurationError, ConfigurationTypeError, require_number

__all__ = [
    "AdaptiveClipping",
    "GroupedBounds",
    "ClippingGroups",
    "grouped",
    "total_bound",
    "describe",
    "GROUPINGS",
]

GROUPINGS = ("parameter", "layer")

ClippingGroups = None | Literal["parameter", "layer"] | Sequence[Iterable[Any] | Mapping[str, Any]]
"""``None``, ``"parameter"``, ``"layer"``, or a list of groups (parameters or names)."""


class GroupedBounds(NamedTuple):
    """A step's clipping groups, resolved against the hooked model's trainable parameters."""

    index: list[int]
    """Per parameter of the step (in its order, that of the noise), the index of its group."""
    bounds: list[float]
    """Per group, its bound ``C_k``."""
    total: float
    """The total bound ``√(Σ_k C_k²)``: the step's sensitivity, which the noise is scaled to."""
    names: list[list[str]]
    """Per group, the qualified names of its trainable parameters (for messages)."""

    def group_sq(self, sq: Iterable[tuple[int, Tensor]], zeros: Tensor, stacked: bool) -> Tensor:
        """Per group, the per-example squared norm of its parameters' gradient together,
        ``[groups, batch]``, from ``(position, [batch])`` pairs, a parameter's position in the
        step and its per-example squared norms, in the order given: added one after the other
        onto ``zeros`` (``[batch]``), or (``stacked``) stacked and summed
        (:func:`gradhooks.quantities.collector.total_norms`'s arithmetic). A group without any
        has zeros."""
        members: list[list[Tensor]] = [[] for _ in self.bounds]
        for j, s in sq:
            members[self.index[j]].append(s)
        sums = []
        for ms in members:
            if stacked and len(ms) == 1:  # (a sum of one, exactly: a parameter on its own)
                sums.append(ms[0])
            elif stacked:
                sums.append(torch.stack(ms).sum(0) if ms else zeros)
            else:
                total = zeros
                for s in ms:
                    total = total + s
                sums.append(total)
        return torch.stack(sums)

    def column(self, norms: Tensor) -> Tensor:
        """The bounds as a ``[groups, 1]`` tensor of ``norms``' dtype and device, for
        :func:`gradhooks.clip_factors` of the group norms ``[groups, batch]``: made once per
        bounds, dtype and device (a copy to a GPU from the host waits for the device)."""
        key = (tuple(self.bounds), norms.dtype, norms.device)
        column = _COLUMNS.get(key)
        if column is None:
            if len(_COLUMNS) >= 64:
                _COLUMNS.clear()
            column = _COLUMNS[key] = torch.tensor(
                self.bounds, dtype=norms.dtype, device=norms.device
            )[:, None]
        return column


# The bounds of the steps so far as tensors, by (bounds, dtype, device): GroupedBounds.column
_COLUMNS: dict[tuple, Tensor] = {}


def check_bounds(
    max_norm: Any, clipping_groups: ClippingGroups, where: str, arg: str = "max_norm"
) -> None:
    """Refuses the bounds and groups that are wrong whatever the model: a bound that is not a
    number > 0 and finite, a list of bounds without groups, groups of the wrong type. ``arg``:
    the bounds' argument's name in ``where``."""
    if isinstance(clipping_groups, str):
        if clipping_groups not in GROUPINGS:
            raise ConfigurationError(
                f"{where}: clipping_groups must be None, 'parameter', 'layer' or a list of "
                f"groups of parameters, got {clipping_groups!r}"
            )
    elif clipping_groups is not None and not isinstance(clipping_groups, Sequence):
        raise ConfigurationTypeError(
            f"{where}: clipping_groups must be None, 'parameter', 'layer' or a list of groups "
            f"(each a list of parameters or of their names), got "
            f"{type(clipping_groups).__qualname__}"
        )
    if not _is_list(max_norm):
        require_number(arg, max_norm, where)
        return  # (one bound: its value checked with the other arguments)
    if clipping_groups is None:
        raise ConfigurationError(
            f"{where}: {arg} is a list of {len(max_norm)} bounds, one per clipping group, "
            "but no clipping_groups were given (the whole model is one group): give "
            "clipping_groups='parameter' (one bound per trainable parameter, in "
            "named_parameters() order, as Opacus' clipping='per_layer'), 'layer', or the "
            "groups themselves; or one float for the whole model"
        )
    for k, c in enumerate(max_norm):
        if not _is_number(c):
            raise ConfigurationTypeError(
                f"{where}: {arg}[{k}] is a {type(c).__qualname__}, not a number: give one "
                "float per clipping group"
            )
        if not 0 < c < math.inf:  # (also NaN)
            raise ConfigurationError(
                f"{where}: {arg}[{k}] = {c!r}, the bound of clipping group {k}: each bound "
                "must be > 0 and finite (0 would leave the group's gradient out, a negative "
                "one would flip it, NaN or Inf would clip nothing)"
            )


def total_bound(max_norm: float | Sequence[float]) -> float:
    """The total bound: ``max_norm`` itself, or ``√(Σ_k C_k²)`` for a list of bounds."""
    if not _is_list(max_norm):
        return float(max_norm)  # type: ignore[arg-type]
    return math.hypot(*(float(c) for c in max_norm))  # type: ignore[union-attr]


def grouped(
    model: torch.nn.Module,
    params: list[torch.nn.Parameter],
    names: list[str],
    max_norm: float | Sequence[float],
    clipping_groups: ClippingGroups,
    where: str,
    arg: str = "max_norm",
) -> GroupedBounds | None:
    """The groups of ``params`` (the step's trainable parameters, ``names`` theirs) and their
    bounds, after refusing a group list that misses a trainable parameter, names one twice or
    names what is no parameter of ``model``, and a count of bounds that is not that of the
    groups. ``None`` for ``clipping_groups=None`` (one bound over the whole model). ``arg``:
    the bounds' argument's name in ``where``."""
    check_bounds(max_norm, clipping_groups, where, arg)
    if clipping_groups is None:
        return None
    if clipping_groups == "parameter":
        groups = [[j] for j in range(len(params))]
    elif clipping_groups == "layer":
        by_owner: dict[str, list[int]] = {}
        for j, name in enumerate(names):
            by_owner.setdefault(name.rpartition(".")[0], []).append(j)
        groups = list(by_owner.values())
    else:
        groups = _given(model, params, names, clipping_groups, where)
    count = len(groups)
    # (a group whose parameters are all frozen has no gradient: left out with its bound, so
    # that the others' bounds and the total, the noise's, are those of the groups clipped)
    live = [k for k, g in enumerate(groups) if g]
    if not live:
        raise ConfigurationError(
            f"{where}: clipping_groups={_short(clipping_groups)} gives no group with a "
            "trainable parameter: the hooked model has no trainable parameter to clip"
        )
    if not _is_list(max_norm):
        bounds = [float(max_norm) / math.sqrt(len(live))] * len(live)  # type: ignore[arg-type]
        total = float(max_norm)  # type: ignore[arg-type]
    else:
        bounds = [float(c) for c in max_norm]  # type: ignore[union-attr]
        if len(bounds) != count:
            listed = "; ".join(
                f"{k}: {', '.join(names[j] for j in g[:3])}{', ...' if len(g) > 3 else ''}"
                for k, g in enumerate(groups[:6])
            )
            raise ConfigurationError(
                f"{where}: {arg} has {len(bounds)} bounds but clipping_groups="
                f"{_short(clipping_groups)} makes {count} groups of the hooked model's trainable "
                f"parameters ({listed}{'; ...' if count > 6 else ''}): give one bound per "
                "group, in that order, or one float C (each group then gets C / sqrt(groups))"
            )
        bounds = [bounds[k] for k in live]
        total = total_bound(bounds)
    groups = [groups[k] for k in live]
    index = [0] * len(params)
    for k, g in enumerate(groups):
        for j in g:
            index[j] = k
    return GroupedBounds(index, bounds, total, [[names[j] for j in g] for g in groups])


def describe(clipping_groups: ClippingGroups, model: torch.nn.Module) -> Any:
    """``clipping_groups`` as plain data for a checkpoint's plan: ``None``, the string, or
    each group's parameter names (parameters named by their first name in ``model``)."""
    if clipping_groups is None or isinstance(clipping_groups, str):
        return clipping_groups
    by_id = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), n)
    return [
        [m if isinstance(m, str) else by_id.get(id(m), "?") for m in _members(group)]
        for group in clipping_groups
    ]


def _given(
    model: torch.nn.Module,
    params: list[torch.nn.Parameter],
    names: list[str],
    groups: Sequence[Any],
    where: str,
) -> list[list[int]]:
    """Each given group as the indices of its trainable parameters in ``params``."""
    position = {id(p): j for j, p in enumerate(params)}
    by_name: dict[str, Tensor] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_name.setdefault(n, p)
    in_model = {id(p) for p in by_name.values()}
    seen: dict[int, tuple[int, str]] = {}
    out: list[list[int]] = []
    for k, group in enumerate(groups):
        members = _members(group, k, where)
        if not members:
            raise ConfigurationError(
                f"{where}: clipping group {k} is empty: every group needs at least one "
                "parameter (leave it out, with its bound)"
            )
        indices = []
        for m in members:
            if isinstance(m, str):
                p = by_name.get(m)
                if p is None:
                    raise ConfigurationError(
                        f"{where}: clipping group {k} names '{m}', which is no parameter of "
                        f"the hooked {type(model).__qualname__} (its names are those of "
                        "model.named_parameters())"
                    )
                label = f"'{m}'"
            elif isinstance(m, Tensor):
                p, label = m, None
            else:
                raise ConfigurationTypeError(
                    f"{where}: clipping group {k} holds a {type(m).__qualname__}: a group is "
                    "a list of parameters or of their qualified names"
                )
            j = position.get(id(p))
            if label is None:
                label = f"'{names[j]}'" if j is not None else f"of shape {tuple(p.shape)}"
            if id(p) in seen:
                first, first_label = seen[id(p)]
                raise ConfigurationError(
                    f"{where}: the parameter {label} is in clipping group {first} (as "
                    f"{first_label}) and again in group {k}: each parameter belongs to one "
                    "group only (its gradient would be clipped twice); remove it from one"
                )
            seen[id(p)] = (k, label)
            if j is not None:
                indices.append(j)
            elif id(p) not in in_model:
                raise ConfigurationError(
                    f"{where}: clipping group {k} holds a parameter {label} that is not the "
                    f"hooked {type(model).__qualname__}'s: give the groups of the hooked "
                    "model's parameters (an optimizer's param_groups over a whole model whose "
                    "hooks are on a part of it, add_hooks(model.body): hook the whole model, "
                    "add_hooks(model))"
                )
            # (else a frozen parameter of the model: no gradient, left out)
        out.append(indices)
    missing = [names[j] for j, p in enumerate(params) if id(p) not in seen]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ConfigurationError(
            f"{where}: the trainable parameter{'s' if len(missing) > 1 else ''} "
            f"{', '.join(repr(n) for n in missing[:5])}{more} of the hooked model "
            f"{'are' if len(missing) > 1 else 'is'} in no clipping group, so "
            f"{'their' if len(missing) > 1 else 'its'} gradient would not be clipped: add "
            "it to a group (or a group of its own, with its bound), or freeze it"
        )
    return out


def _members(group: Any, k: int = 0, where: str = "") -> list[Any]:
    """A group's parameters or names (an optimizer's param group: its ``"params"``)."""
    if isinstance(group, Mapping):
        group = group.get("params", ())
    if isinstance(group, (str, Tensor)) or not isinstance(group, Iterable):
        raise ConfigurationTypeError(
            f"{where}: clipping group {k} is a {type(group).__qualname__}, not a list: each "
            "group is a list of parameters or of their names (one parameter per group: "
            "clipping_groups='parameter')"
        )
    return list(group)


def _is_number(x: Any) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


def _is_list(x: Any) -> bool:
    """Whether ``max_norm`` is a list of bounds (not one number, tensor or string)."""
    return isinstance(x, Sequence) and not isinstance(x, str)


def _short(groups: ClippingGroups) -> str:
    return repr(groups) if groups is None or isinstance(groups, str) else "[...]"


@dataclass(frozen=True)
class AdaptiveClipping:
    """A clipping bound that follows a quantile of the per-example gradient norms, learnt
    privately as training goes (Andrew, Thakkar, McMahan and Ramaswamy, "Differentially
    Private Learning with Adaptive Clipping", NeurIPS 2021; Opacus' ``AdaClipDPOptimizer``).

    Given to :class:`gradhooks.DPOptimizer` or :func:`gradhooks.make_private`
    (``adaptive_clipping=``). At each step, besides the clipped sum, the optimizer counts the
    examples whose gradient norm was at most the bound ``C`` (not clipped), adds Gaussian noise
    of standard deviation ``σ_b`` (``count_noise``) to the count, and moves the bound
    geometrically towards the ``target_quantile`` of the norms:

        b = (count + σ_b · N(0, 1)) / expected_batch_size
        C ← clamp(C · exp(-learning_rate · (b - target_quantile)), min_bound, max_bound)

    The new bound clips the next step's examples. Releasing the count costs privacy too: the
    step with noise multiplier ``σ`` (the one the accountant records, and that
    ``target_epsilon`` is met with) draws the gradient's noise with the larger multiplier

        σ_g = (σ⁻² - (2 σ_b)⁻²)^(-1/2),

    which needs ``2 σ_b > σ`` (the paper's Theorem 1: the two Gaussian releases together are
    one Gaussian mechanism of multiplier ``σ``). The fraction is taken over the *expected*
    batch size, which is public, as the gradient's divisor is (Opacus divides by the batch's
    own size, which Poisson sampling makes private).

    Only with one bound over the whole model and flat clipping (``clipping="flat"``, no
    ``clipping_groups``), as in the paper and in Opacus.

    Args:
        target_quantile: ``γ`` in [0, 1], the fraction of examples the bound should leave
            unclipped (0.5: the median norm, the paper's default).
        learning_rate: ``η > 0``, the step of the geometric update (0.2 in the paper).
        count_noise: ``σ_b > 0``, the standard deviation of the noise on the count; ``None``:
            ``expected_batch_size / 20``, the paper's choice.
        min_bound, max_bound: the bound is kept in ``[min_bound, max_bound]``
            (``0 <= min_bound < max_bound``; the initial bound, ``max_grad_norm``, must lie
            there too).
    """

    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_noise: float | None = None
    min_bound: float = 0.0
    max_bound: float = math.inf

    def count_std(self, expected_batch_size: float) -> float:
        """``σ_b``: :attr:`count_noise`, or ``expected_batch_size / 20``."""
        if self.count_noise is None:
            return float(expected_batch_size) / 20.0
        return float(self.count_noise)

    def gradient_noise_multiplier(
        self, noise_multiplier: float, expected_batch_size: float
    ) -> float:
        """``σ_g = (σ⁻² - (2 σ_b)⁻²)^(-1/2)``, the gradient noise's multiplier for a step of
        multiplier ``σ`` (0 for ``σ = 0``)."""
        if noise_multiplier == 0:
            return 0.0
        sigma_b = self.count_std(expected_batch_size)
        return (noise_multiplier**-2 - (2.0 * sigma_b) ** -2) ** -0.5

    def updated(self, bound: float, count: float, expected_batch_size: float) -> float:
        """The bound after a step whose noised count of unclipped examples is ``count``."""
        fraction = count / float(expected_batch_size)
        new = bound * math.exp(-self.learning_rate * (fraction - self.target_quantile))
        return min(max(new, self.min_bound), self.max_bound)

    def check(
        self,
        max_grad_norm: Any,
        noise_multiplier: float,
        expected_batch_size: float,
        clipping: str,
        clipping_groups: ClippingGroups,
        where: str,
    ) -> None:
        """Refuses settings that adaptive clipping cannot follow, before anything changes."""
        numbers = {
            "target_quantile": self.target_quantile,
            "learning_rate": self.learning_rate,
            "min_bound": self.min_bound,
            "max_bound": self.max_bound,
        }
        if self.count_noise is not None:
            numbers["count_noise"] = self.count_noise
        for name, value in numbers.items():
            if not _is_number(value):
                raise ConfigurationTypeError(
                    f"{where}: AdaptiveClipping.{name} must be a number, got "
                    f"{type(value).__qualname__}"
                )
        if not 0 <= self.target_quantile <= 1:
            raise ConfigurationError(
                f"{where}: AdaptiveClipping.target_quantile = {self.target_quantile!r}: the "
                "fraction of examples left unclipped must be in [0, 1] (0.5: the median norm)"
            )
        if not 0 < self.learning_rate < math.inf:
            raise ConfigurationError(
                f"{where}: AdaptiveClipping.learning_rate = {self.learning_rate!r}: it must be "
                "> 0 and finite (0.2 in the paper)"
            )
        if self.count_noise is not None and not 0 < self.count_noise < math.inf:
            raise ConfigurationError(
                f"{where}: AdaptiveClipping.count_noise = {self.count_noise!r}: the noise on "
                "the count of unclipped examples must be > 0 and finite (None: "
                "expected_batch_size / 20); without it, the count would be released exactly"
            )
        if not 0 <= self.min_bound < self.max_bound:
            raise ConfigurationError(
                f"{where}: AdaptiveClipping's bounds [min_bound, max_bound] = "
                f"[{self.min_bound!r}, {self.max_bound!r}]: they need 0 <= min_bound < "
                "max_bound"
            )
        if clipping != "flat":
            raise ConfigurationError(
                f"{where}: adaptive clipping follows the fraction of examples the bound leaves "
                f"unclipped, which clipping={clipping!r} has none of (every gradient is "
                "scaled): use clipping='flat'"
            )
        if clipping_groups is not None or _is_list(max_grad_norm):
            raise ConfigurationError(
                f"{where}: adaptive clipping adapts one bound over the whole model; got "
                f"clipping_groups={_short(clipping_groups)} and max_grad_norm={max_grad_norm!r}. "
                "Give one float max_grad_norm (the initial bound) and no clipping_groups"
            )
        bound = float(max_grad_norm)
        if not self.min_bound <= bound <= self.max_bound:
            raise ConfigurationError(
                f"{where}: the initial bound max_grad_norm = {bound!r} is outside "
                f"AdaptiveClipping's [min_bound, max_bound] = [{self.min_bound!r}, "
                f"{self.max_bound!r}]"
            )
        sigma_b = self.count_std(expected_batch_size)
        if noise_multiplier > 0 and not 2 * sigma_b > noise_multiplier:
            raise ConfigurationError(
                f"{where}: noise_multiplier = {noise_multiplier!r} with adaptive clipping needs "
                f"2 · count_noise > noise_multiplier, but count_noise is {sigma_b!r} (the "
                "gradient's own noise multiplier, (σ⁻² - (2 σ_b)⁻²)^(-1/2), would not exist): "
                "give AdaptiveClipping(count_noise=...) larger than noise_multiplier / 2"
            )

    def describe(self) -> dict[str, Any]:
        """Its settings, as a checkpoint's plan keeps them."""
        return {
            "target_quantile": self.target_quantile,
            "learning_rate": self.learning_rate,
            "count_noise": self.count_noise,
            "min_bound": self.min_bound,
            "max_bound": self.max_bound,
        }

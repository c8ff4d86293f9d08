"""The engine: hooks, capture and accumulation. It never names a layer type.

A forward hook on every module that has a rule keeps that call's inputs (detached; autograd keeps
them alive anyway) and registers a gradient hook on the call's output tensors. When backward
reaches those outputs, the rule turns (inputs, output-gradients) into pieces and the per-example
gradient of each trainable parameter is added to ``param.grad1``.

Pairing the gradient hook with the call it came from (rather than with the module) is what makes
a module called twice in one forward correct; accumulating on the parameter object is what makes
tied weights correct.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map

from .fallback import FALLBACK, fallback_params
from .quantities import _INTERNAL, QUANTITIES, Collector, total_norms
from .registry import REGISTRY, Call, Registry, _Entry

__all__ = [
    "Hooks", "add_hooks", "remove_hooks", "hooks_of", "clear_grad1", "set_enabled", "paused"
]

LossReduction = Literal["mean", "sum"]
Unsupported = Literal["fallback", "error", "skip"]

# Models and modules currently hooked, so that hooks are never added twice (which would count
# every gradient twice). Weak: a model that is garbage collected leaves nothing behind here.
_ACTIVE: weakref.WeakKeyDictionary[nn.Module, Hooks] = weakref.WeakKeyDictionary()
_HOOKED_MODULES: weakref.WeakKeyDictionary[nn.Module, Hooks] = weakref.WeakKeyDictionary()
_GLOBALLY_ENABLED = [True]


@dataclass
class _Target:
    """One hooked module: its rule and the parameters the rule is responsible for."""

    name: str
    module: nn.Module
    entry: _Entry
    params: dict[str, nn.Parameter]


class Hooks:
    """Per-example gradient hooks on one model. Returned by :func:`add_hooks`.

    Use it as a context manager to remove the hooks on exit::

        with gradhooks.add_hooks(model) as h:
            F.cross_entropy(model(x), y).backward()
        model.fc.weight.grad1          # [batch, *model.fc.weight.shape]

    After each captured backward, every trainable parameter that received a gradient holds
    ``param.grad1``, of shape ``[batch, *param.shape]``: ``grad1[i]`` is the gradient of example
    ``i``'s own loss. For ``loss_reduction="mean"`` (loss = mean of per-example losses)
    ``grad1.mean(0)`` equals ``param.grad``; for ``"sum"``, ``grad1.sum(0)`` does.

    A second backward without :meth:`clear` adds to ``grad1``, as ``.grad`` accumulates;
    :meth:`clear` makes the next backward start afresh (call it between training steps).
    """

    def __init__(
        self,
        model: nn.Module,
        loss_reduction: LossReduction = "mean",
        unsupported: Unsupported = "fallback",
        registry: Registry = REGISTRY,
        quantities: tuple[str, ...] | str = ("grad1",),
    ) -> None:
        quantities = (quantities,) if isinstance(quantities, str) else tuple(quantities)
        unknown = [q for q in quantities if q not in QUANTITIES + _INTERNAL]
        if unknown or not quantities:
            raise ValueError(f"quantities must be some of {QUANTITIES}, got {quantities!r}")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if unsupported not in ("fallback", "error", "skip"):
            raise ValueError(
                f"unsupported must be 'fallback', 'error' or 'skip', got {unsupported!r}"
            )
        if not isinstance(model, nn.Module):
            raise TypeError(f"add_hooks expects an nn.Module, got {type(model).__qualname__}")
        self.loss_reduction: LossReduction = loss_reduction
        self.unsupported = unsupported
        self.registry = registry
        self._model_ref = weakref.ref(model)
        self._targets = _plan(model, registry, unsupported)
        self._check_not_hooked(model)
        self._written: dict[int, nn.Parameter] = {}
        self._removed = False
        self.quantities = quantities
        self._grad1 = "grad1" in quantities
        self._collector = Collector(model, quantities) if quantities != ("grad1",) else None
        self._ignore_backward = False  # set by dp_sgd_step for its second (reweighted) backward
        self._handles = []
        for target in self._targets:
            self._handles.append(
                target.module.register_forward_hook(
                    self._forward_hook(target), with_kwargs=True, always_call=False
                )
            )
        _ACTIVE[model] = self
        for target in self._targets:
            _HOOKED_MODULES[target.module] = self

    # -- public -------------------------------------------------------------------------------

    @property
    def model(self) -> nn.Module | None:
        return self._model_ref()

    @property
    def active(self) -> bool:
        return not self._removed

    def modules(self) -> Iterator[tuple[str, nn.Module]]:
        """The hooked modules, by qualified name."""
        for t in self._targets:
            yield t.name, t.module

    def fallback_modules(self) -> Iterator[tuple[str, nn.Module]]:
        """The modules without a rule whose ``grad1`` the ``torch.func`` fallback computes
        (``unsupported="fallback"``), by qualified name."""
        for t in self._targets:
            if t.entry is FALLBACK:
                yield t.name, t.module

    def clear(self) -> None:
        """Start a new accumulation: the next backward replaces ``grad1`` instead of adding to
        it. The current ``grad1`` tensors stay readable."""
        self._written.clear()
        if self._collector is not None:
            self._collector.clear()

    def rescale(self, loss_reduction: LossReduction) -> None:
        """Declare that the captured backward used ``loss_reduction`` after all, rescaling the
        ``grad1`` computed since the last :meth:`clear` (what autograd-hacks' ``compute_grad1``
        ``loss_type`` says), and use it for later backwards."""
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_type must be 'mean' or 'sum', got {loss_reduction!r}")
        if loss_reduction == self.loss_reduction:
            return
        for p in self._written.values():
            batch = p.grad1.shape[0]
            if loss_reduction == "sum":  # it was computed as mean (times batch): undo
                p.grad1.div_(max(batch, 1))
            else:
                p.grad1.mul_(batch)
        self.loss_reduction = loss_reduction

    @property
    def captured(self) -> bool:
        """Whether a backward has written ``grad1`` since the hooks were added or cleared."""
        return bool(self._written)

    # -- quantities other than grad1 (add_hooks(..., quantities=...)) -------------------------
    # Of the last backward (each backward replaces them), except kfac_factors, which accumulate
    # until clear(). All are of the per-example losses' own gradients (as grad1 is).

    def param_norms(self) -> dict[str, Tensor]:
        """Per-example gradient norms per parameter, ``{name: [batch]}`` (``"norms"``).
        ``norms[name][i] == p.grad1[i].norm()``, computed without forming ``grad1``; a reused
        module's calls and a tied weight's users are summed before the norm is taken."""
        return {n: v.sqrt() for n, v in self._results("norms").param_sq_norms.items()}

    def norms(self) -> Tensor:
        """Per-example norm of the whole model's gradient, ``[batch]`` (``"norms"``)."""
        c = self._results("norms")
        if not c.param_sq_norms:
            raise RuntimeError("no backward has been captured since the hooks were added or cleared")
        return total_norms(c.param_sq_norms)

    def sum_grad_sq(self) -> dict[str, Tensor]:
        """``Σ_i grad1[i]²`` per parameter, ``{name: [*p.shape]}`` (``"sum_grad_sq"``): the
        diagonal of the empirical Fisher, summed over examples (BackPACK's SumGradSquared for a
        sum-reduced loss)."""
        return dict(self._results("sum_grad_sq").sum_grad_sq)

    def grad_variance(self) -> dict[str, Tensor]:
        """Per-example gradient variance per parameter, ``{name: [*p.shape]}``
        (``"sum_grad_sq"``): ``mean_i grad1[i]² - (mean_i grad1[i])²`` (population variance,
        clamped at 0)."""
        c = self._results("sum_grad_sq")
        batch = max(c.batch or 0, 1)
        return {
            n: (sq / batch - c.grad_mean[n] ** 2).clamp_min(0) for n, sq in c.sum_grad_sq.items()
        }

    def kfac_factors(self, reduction: LossReduction = "mean") -> dict:
        """K-FAC factors ``{weight_name: KFactors(A, G, bias)}`` accumulated since the last
        :meth:`clear` (``"kfac"``); conventions in :mod:`gradhooks.kfac`."""
        return self._results("kfac").kfac.factors(reduction)

    def _results(self, quantity: str) -> Collector:
        if self._collector is None or quantity not in self.quantities:
            raise RuntimeError(
                f"this handle does not compute {quantity!r} (quantities={self.quantities!r}): "
                f"add_hooks(model, quantities=({quantity!r}, ...))"
            )
        return self._collector

    def remove(self) -> None:
        """Remove every hook. Idempotent. ``grad1`` stays on the parameters (like ``.grad``);
        :func:`clear_grad1` deletes it."""
        if self._removed:
            return
        self._removed = True
        for h in self._handles:
            h.remove()
        self._handles.clear()
        model = self.model
        if model is not None and _ACTIVE.get(model) is self:
            del _ACTIVE[model]
        for t in self._targets:
            if _HOOKED_MODULES.get(t.module) is self:
                del _HOOKED_MODULES[t.module]
        self._written.clear()

    def __enter__(self) -> Hooks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self._removed else f"{len(self._targets)} modules"
        return f"Hooks({state}, loss_reduction={self.loss_reduction!r})"

    # -- internals ----------------------------------------------------------------------------

    def _check_not_hooked(self, model: nn.Module) -> None:
        if model in _ACTIVE:
            raise RuntimeError(
                f"{type(model).__qualname__} already has gradhooks hooks ({_ACTIVE[model]!r}); "
                "adding them again would count every gradient twice. Call "
                "gradhooks.remove_hooks(model) first, or keep using the existing handle."
            )
        for t in self._targets:
            if t.module in _HOOKED_MODULES:
                raise RuntimeError(
                    f"module '{t.name}' ({type(t.module).__qualname__}) is already hooked by "
                    f"another gradhooks handle ({_HOOKED_MODULES[t.module]!r}), e.g. on a model "
                    "that contains this one; remove those hooks first."
                )

    def _forward_hook(self, target: _Target):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self._removed or not _GLOBALLY_ENABLED[0] or not torch.is_grad_enabled():
                return
            if module is not target.module:
                return  # a deep copy of a hooked module carries our hook: the copy is not hooked
            if torch._C._functorch.peek_interpreter_stack() is not None:
                return  # inside vmap/grad (an oracle, the fallback rule): not ours to capture
            if target.entry.on_forward is not None:
                target.entry.on_forward(module, target.name)  # raises where grad1 cannot exist
            live = {n: p for n, p in target.params.items() if p.requires_grad}
            if not live:
                return
            leaves, _ = tree_flatten(output)
            hooked = [
                i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.requires_grad
            ]
            if not hooked:
                return
            call = Call(
                module=module,
                inputs=_detach(args),
                kwargs=_detach(kwargs),
                output=_detach(output) if target.entry.needs_output else None,
                grad_outputs=(),
                name=target.name,
            )

            def on_grads(grads) -> None:
                if self._removed or self._ignore_backward:
                    return
                full: list[Tensor | None] = [None] * len(leaves)
                for i, g in zip(hooked, grads):
                    full[i] = g
                self._backward(target, live, replace(call, grad_outputs=tuple(full)))

            if self._collector is not None:
                self._collector.expect(live)
            if len(hooked) == 1:
                leaves[hooked[0]].register_hook(lambda g: on_grads((g,)))
            else:
                torch.autograd.graph.register_multi_grad_hook(
                    [leaves[i] for i in hooked], on_grads, mode="all"
                )

        return hook

    def _backward(self, target: _Target, params: dict[str, nn.Parameter], call: Call) -> None:
        rule = target.entry.rule
        pieces = rule(call)
        live: dict[str, nn.Parameter] = {}
        for pname, p in params.items():
            if pieces.get(pname) is not None:
                live[pname] = p
            elif pname not in pieces:
                raise RuntimeError(
                    f"rule {rule.__qualname__} for '{target.name}' ({type(target.module).__qualname__}) "
                    f"returned no piece for trainable parameter '{pname}' (got {sorted(pieces)})"
                )
            # else: None, the rule says this call's gradient for it is computed elsewhere
        if not live:
            return
        batch = pieces[next(iter(live))].batch_size
        scale = float(batch) if self.loss_reduction == "mean" else 1.0
        if self._collector is not None:
            self._collector.add(target.name, {n: pieces[n] for n in live}, live, scale)
        if not self._grad1:
            return
        for pname, p in live.items():
            piece = pieces[pname]
            qualname = f"{target.name}.{pname}" if target.name else pname
            accumulate = id(p) in self._written
            out = self._writable_grad1(qualname, p, piece.batch_size, accumulate)
            try:
                if out is not None:
                    piece.grad1_into(out, scale, accumulate)
                else:
                    g1 = piece.grad1(p.shape, scale)
            except RuntimeError as e:
                raise RuntimeError(
                    f"rule {rule.__qualname__} for '{target.name}' ({type(target.module).__qualname__}): "
                    f"its piece for '{pname}' does not give a [batch, *{tuple(p.shape)}] gradient: {e}"
                ) from e
            if out is None:
                self._accumulate(qualname, p, g1)
            self._written[id(p)] = p

    def _writable_grad1(
        self, qualname: str, p: nn.Parameter, batch: int, accumulate: bool
    ) -> Tensor | None:
        """``p.grad1``, if this call's gradient can be written into its memory: it has the
        right shape, dtype and device, and nothing but ``p`` refers to it or to its memory (the
        test autograd makes before reusing ``.grad``). Writing in place skips a fresh
        allocation, whose page faults cost more than the writing itself on CPU; a ``grad1``
        the caller kept (a reference, a view, a numpy array) is never changed."""
        old = _sole_grad1(p)
        if old is None:
            return None
        if accumulate and old.shape[0] != batch:
            return None  # _accumulate explains
        if tuple(old.shape) != (batch, *p.shape) or old.dtype != p.dtype or old.device != p.device:
            return None
        return old

    def _accumulate(self, qualname: str, p: nn.Parameter, g1: Tensor) -> None:
        if g1.dtype != p.dtype:
            g1 = g1.to(p.dtype)
        if id(p) in self._written:
            old = p.grad1
            if old.shape != g1.shape:
                raise RuntimeError(
                    f"grad1 of '{qualname}' holds {tuple(old.shape)} from an earlier call in this "
                    f"accumulation, this call gives {tuple(g1.shape)}: the batch size changed. "
                    "Call clear() (autograd-hacks: clear_backprops(model)) between steps, or "
                    "make every hooked layer see the same batch."
                )
            p.grad1 = old + g1
        else:
            p.grad1 = g1


def _grad1_refs(owner: Any) -> int:
    t = owner.__dict__.get("grad1")
    return sys.getrefcount(t)


def _sole_refs() -> int | None:
    """What :func:`_grad1_refs` counts for a ``grad1`` that nothing else refers to, or ``None``
    where one more reference would not show (then ``grad1`` is never written in place)."""
    try:
        owner = nn.Parameter(torch.zeros(2))
        owner.grad1 = torch.zeros(1, 2)
        alone = _grad1_refs(owner)
        kept = owner.grad1  # noqa: F841  (one more reference)
        return alone if _grad1_refs(owner) == alone + 1 else None
    except Exception:
        return None


_SOLE_REFS = _sole_refs()


def _sole_grad1(p: nn.Parameter) -> Tensor | None:
    """``p.grad1`` if it is a plain contiguous tensor that only ``p`` refers to: no other
    Python reference, no view or other tensor on its memory, not saved by autograd."""
    if _SOLE_REFS is None or type(p.__dict__.get("grad1")) is not Tensor:
        return None
    if _grad1_refs(p) != _SOLE_REFS:
        return None
    t = p.grad1
    try:
        storage_users = torch._C._storage_Use_Count(t.untyped_storage()._cdata)
        if t._use_count() != 1 or storage_users != _STORAGE_USERS_ALONE:
            return None
    except (AttributeError, RuntimeError):  # private counts unavailable: never reuse
        return None
    return t if t.is_contiguous() and t._base is None else None


def _storage_users_alone() -> int | None:
    try:
        t = torch.zeros(2)
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata)
    except (AttributeError, RuntimeError):
        return None


_STORAGE_USERS_ALONE = _storage_users_alone()


def _plan(model: nn.Module, registry: Registry, unsupported: Unsupported) -> list[_Target]:
    """Which modules to hook, checking that every trainable parameter is covered."""
    targets: list[_Target] = []
    owned: list[str] = []
    uncovered: list[tuple[str, nn.Module, dict[str, nn.Parameter]]] = []
    covered: set[int] = set()
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in owned):
            continue
        entry = registry.lookup(module)
        own = dict(module.named_parameters(recurse=entry is not None and entry.owns_children))
        if entry is None:
            trainable = {n: p for n, p in own.items() if p.requires_grad}
            if trainable and unsupported == "fallback":
                params = fallback_params(module)
                targets.append(_Target(name, module, FALLBACK, params))
                covered.update(id(p) for p in params.values())
            elif trainable:
                uncovered.append((name, module, trainable))
            continue
        if entry.owns_children:
            owned.append(f"{name}." if name else "")
        if own:
            targets.append(_Target(name, module, entry, own))
            covered.update(id(p) for p in own.values())
    if uncovered:
        lines = [
            f"'{name or '<model>'}' ({type(m).__qualname__}): {', '.join(ps)}"
            for name, m, ps in uncovered
        ]
        # Skipping a parameter that a covered module also uses (tied) would make its grad1 hold
        # only part of the gradient: never allowed.
        tied = [
            f"'{name}.{pn}'" for name, _, ps in uncovered for pn, p in ps.items() if id(p) in covered
        ]
        if unsupported == "error" or tied:
            why = (
                f"\nThese are tied to hooked modules, so skipping them would make grad1 wrong: "
                f"{', '.join(tied)}."
                if tied
                else ""
            )
            raise TypeError(
                "gradhooks has no rule for these modules with trainable parameters:\n  "
                + "\n  ".join(lines)
                + why
                + "\nRegister one with @gradhooks.register(ModuleType) (see the README), freeze "
                "those parameters, pass unsupported='fallback' (the default) to compute them with "
                "torch.func, or unsupported='skip' to leave them without grad1. Nothing was hooked."
            )
    return targets


def _detach(tree: Any) -> Any:
    return tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, tree)


def add_hooks(
    model: nn.Module,
    loss_reduction: LossReduction = "mean",
    unsupported: Unsupported = "fallback",
    registry: Registry = REGISTRY,
    quantities: tuple[str, ...] | str = ("grad1",),
) -> Hooks:
    """Hook ``model`` so that every ``backward()`` writes ``param.grad1``.

    Args:
        model: any ``nn.Module``.
        loss_reduction: ``"mean"`` when the loss is the mean of per-example losses (the default
            of torch losses), ``"sum"`` when it is their sum. ``grad1[i]`` is the gradient of
            example ``i``'s own loss in both cases.
        unsupported: what to do with a module that has trainable parameters and no rule.
            ``"fallback"`` (default): compute its per-example gradients with ``torch.func``
            from the captured call (:mod:`gradhooks.fallback`; slower than a rule, see
            :meth:`Hooks.fallback_modules`). ``"error"``: raise, before anything is hooked.
            ``"skip"``: leave its parameters without ``grad1``.
        registry: the rules to use (default: the built-in registry).
        quantities: what each backward computes, any of ``"grad1"`` (``param.grad1``),
            ``"norms"`` (:meth:`Hooks.norms`, :meth:`Hooks.param_norms`), ``"sum_grad_sq"``
            (:meth:`Hooks.sum_grad_sq`, :meth:`Hooks.grad_variance`) and ``"kfac"``
            (:meth:`Hooks.kfac_factors`). Without ``"grad1"`` no per-example gradient of the
            whole model is ever formed.

    Returns:
        A :class:`Hooks` handle; also a context manager that removes the hooks on exit.

    Example::

        >>> import torch, gradhooks
        >>> model = torch.nn.Linear(3, 2)
        >>> x, y = torch.randn(5, 3), torch.randn(5, 2)
        >>> with gradhooks.add_hooks(model):
        ...     torch.nn.functional.mse_loss(model(x), y).backward()
        >>> model.weight.grad1.shape
        torch.Size([5, 2, 3])
        >>> torch.allclose(model.weight.grad1.mean(0), model.weight.grad, atol=1e-6)
        True
    """
    return Hooks(
        model, loss_reduction=loss_reduction, unsupported=unsupported, registry=registry,
        quantities=quantities,
    )  # fmt: skip


def hooks_of(model: nn.Module) -> Hooks:
    """The active handle of a hooked model (raises if it has none)."""
    try:
        return _ACTIVE[model]
    except KeyError:
        raise ValueError(
            f"{type(model).__qualname__} has no gradhooks hooks: call gradhooks.add_hooks(model) "
            "first (or it was already removed)"
        ) from None


def remove_hooks(model: nn.Module) -> None:
    """Remove the hooks :func:`add_hooks` put on ``model``. ``grad1`` stays on the parameters."""
    hooks_of(model).remove()


def clear_grad1(model: nn.Module) -> None:
    """Delete ``grad1`` from every parameter of ``model``."""
    for p in model.parameters():
        if hasattr(p, "grad1"):
            del p.grad1


def set_enabled(enabled: bool) -> None:
    """Switch capture on or off for every hooked model (autograd-hacks' enable/disable)."""
    _GLOBALLY_ENABLED[0] = bool(enabled)


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Within the block, no hooked model captures anything (the oracles run under it)."""
    before = _GLOBALLY_ENABLED[0]
    _GLOBALLY_ENABLED[0] = False
    try:
        yield
    finally:
        _GLOBALLY_ENABLED[0] = before

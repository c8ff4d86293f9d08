"""The engine: hooks, capture and accumulation. It never names a layer type.

A forward hook on every module that has a rule keeps that call's inputs (detached; autograd keeps
them alive anyway) and registers a gradient hook on the call's output tensors. When backward
reaches those outputs, the rule turns (inputs, output-gradients) into pieces and the per-example
gradient of each trainable parameter is added to ``param.grad1``.

Pairing the gradient hook with the call it came from (rather than with the module) is what makes
a module called twice in one forward correct; accumulating on the parameter object is what makes
tied weights correct.

:class:`Hooks` is this module's; its parts live beside it: :mod:`.plan` (which modules are
hooked, with which rule), :mod:`.records` (what is kept per call, forward and backward),
:mod:`.calls` (where the examples are in each call, from the forward's tracker),
:mod:`.capture` (calls run detached, owned or carried, for the rules that ask) and
:mod:`.verify` (the checks of a backward against autograd).
"""

from __future__ import annotations

import contextlib
import copy
import sys
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, Literal

import torch
from torch import Tensor, nn

from . import _torch
from . import pieces as P
from ._torch import tree_flatten, tree_map
from .calls import (
    CallLayouts,
    aligned_call,
    carry_layouts,
    check_versions,
    describe_call,
    keeps_rows,
    own_node,
    root_batch,
    rule_pieces,
    unchanged_outputs,
    unview,
)
from .capture import DetachedCalls
from .errors import GradhooksWarning
from .fallback import FALLBACK
from .layout import PACKED, Tracker
from .memory import refuse_if_too_large
from .pause import PROCESS, Pause, set_enabled
from .plan import (
    Target,
    Unsupported,
    entry_modules,
    fsdp_shards,
    higher_order,
    owner_name,
    plan_targets,
    positional,
    refuse_complex,
    refuse_lazy,
    refuse_scripted,
    structure_of,
)
from .quantities import _INTERNAL, QUANTITIES, Collector, total_norms
from .records import (
    Backward,
    CallLayout,
    CallState,
    Frame,
    Hook,
    autocast_on,
    detach_tree,
    drop_box,
    graph_task,
    is_compiling,
    power_of_two,
    tree_leaves,
)
from .registry import REGISTRY, Call, Registry, _Entry
from .verify import CheckReport, Verification, check_hooks, per_example_outputs

__all__ = ["Hooks", "add_hooks", "remove_hooks", "hooks_of", "clear_grad1"]

LossReduction = Literal["mean", "sum"]
Capture = Literal["always", "marked"]

# Models and modules currently hooked, so that hooks are never added twice (which would count
# every gradient twice). Weak: a model that is garbage collected leaves nothing behind here.
_ACTIVE: weakref.WeakKeyDictionary[nn.Module, Hooks] = weakref.WeakKeyDictionary()
_HOOKED_MODULES: weakref.WeakKeyDictionary[nn.Module, Hooks] = weakref.WeakKeyDictionary()


class Hooks(CallLayouts, DetachedCalls, Verification):
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

    Which backwards write ``grad1``: those that compute the model's parameter gradients
    (``torch.autograd.grad`` with respect to the input only leaves it alone), not under
    :meth:`paused`, and with ``capture="marked"`` only under :meth:`capturing`. A backward
    through derivatives taken with ``create_graph=True`` is refused (hooks cannot see the
    double backward). :meth:`check` verifies ``grad1`` after a backward.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_reduction: LossReduction = "mean",
        unsupported: Unsupported = "fallback",
        registry: Registry = REGISTRY,
        quantities: tuple[str, ...] | str = ("grad1",),
        *,
        batch_dim: int | str | None = "auto",
        max_grad1_bytes: int | str | None = "auto",
        capture: Capture = "always",
        verify: bool = True,
    ) -> None:
        _torch.require()
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
        if capture not in ("always", "marked"):
            raise ValueError(f"capture must be 'always' or 'marked', got {capture!r}")
        if batch_dim not in (None, "auto") and (not isinstance(batch_dim, int) or batch_dim < 0):
            raise ValueError(f"batch_dim must be 'auto', an int >= 0 or None, got {batch_dim!r}")
        if not (max_grad1_bytes in (None, "auto") or isinstance(max_grad1_bytes, int)):
            raise ValueError(
                f"max_grad1_bytes must be bytes, 'auto' or None, got {max_grad1_bytes!r}"
            )
        self.batch_dim = batch_dim
        self.max_grad1_bytes = max_grad1_bytes
        self.capture: Capture = capture
        self.loss_reduction: LossReduction = loss_reduction
        self.unsupported = unsupported
        self.registry = registry
        self._model_ref = weakref.ref(model)
        # parameters sharded by FSDP2 (DTensors), by qualified name (every slot): the hooks are
        # planned with these, whatever stand-in FSDP2 has put in their slots at the time
        self._shards = fsdp_shards(model)
        self._sharded = {id(p) for p in self._shards.values()}  # per-example norms, no grad1
        self._targets = plan_targets(model, registry, unsupported, self._shards)
        self._check_not_hooked(model)
        self._written: dict[int, nn.Parameter] = {}
        self._removed = False
        self.quantities = quantities
        self._grad1 = "grad1" in quantities
        self._collector = Collector(model, quantities) if quantities != ("grad1",) else None
        self._ignore_backward = False  # set by dp_sgd_step for its second (reweighted) backward
        # set by dp_sgd_step's book-keeping backward, whose parameter gradients are not used:
        # calls run detached then give none (and the backward still counts as the model's)
        self._no_param_grads = False
        self._pause = Pause(PROCESS)  # `with h.paused():`, under gradhooks.paused()
        self._marked = 0  # depth of `with h.capturing()`
        self._frames: list[Frame] = []  # root forwards running
        self._tasks: dict[int, Backward] = {}  # backwards running, by graph task id
        self._missed: dict[str, None] = {}  # parameters a backward computed without capture
        # the bookkeeping of backwards (which parameters each computes) is off for the
        # Jacobians and kfac(), whose backwards run under vmap and write no grad1
        self._track = not {"_jacobian", "_vmapped"} & set(quantities)
        self._handles: list = []
        # calls run with their parameters detached, {id(module): [(module, {name: param},
        # (args, kwargs) where the call runs with grad mode off, else None, its _Carried where
        # its input carries them, else None, (its rule's record, what it gave) where one is
        # entered, else None)]}
        self._detached: dict[int, list[tuple[nn.Module, dict, Any, Any, Any, Any]]] = {}
        self._aliases_checked: set[int] = set()  # modules whose detached call was checked
        self._rerunning = 0  # inside _rerun_vjp, or a per-example backward of the tracker's
        self._probing = False  # inside _probe's backward
        self._backwards = 0  # backwards that captured a call, since the hooks were added
        # a call ran with grad mode off inside a forward (reentrant activation checkpointing:
        # run again by a backward, but not by torch.autograd.grad, which gradhooks.dp then
        # avoids)
        self._recomputes = False
        self._probe_box: dict | None = None  # the outputs of the forward _probe starts from
        # parameters used outside their modules' calls, by id: the sources of their uses
        self._direct: dict[int, weakref.WeakSet] = {}
        # sources with a problem that no autograd graph holds (found where the forward recorded
        # none): kept until a backward ends, so that the parameter's gradient reports it
        self._unheld: list = []
        # autograd-hacks' backprop_hess: per backward, {id(param): raw per-example gradients}
        self._hessian_backprops: list[dict[int, Tensor]] = []
        self._direct_targets: dict[int, Target] = {}
        self._functional_targets: dict[tuple, Target] = {}
        self._target_handles: list = []
        self._module_hooks: list[Hook] = []  # the hooks _install put on the planned modules
        self._current: dict[int, nn.Parameter] = {}  # sharded id -> its unsharded parameter
        if self._sharded and self._grad1:
            name = next(n for n, p in model.named_parameters() if id(p) in self._sharded)
            raise ValueError(
                f"'{name}' is sharded by FSDP2 (a DTensor): its grad1 would be [batch, *full "
                "shape] on every rank, which is what sharding avoids, so gradhooks does not form "
                "it. Use add_hooks(model, quantities=('norms',)) and "
                "gradhooks.distributed.dp_sgd_step (per-example norms, clipping and noise, the "
                "clipped sum sharded like the parameter)."
            )
        # the last line of defence (_verify): signatures of the calls of a forward
        self.verify = verify
        self._verified: set[tuple] = set()
        self._unverified: set[tuple] = set()
        self._exempt: set[int] = set()  # parameters whose grad1 does not sum to .grad by design
        # the quantities _probe checks one example of
        self._checks_examples = self._track and (self._grad1 or "norms" in quantities)
        refuse_scripted(model, self._targets)
        refuse_lazy(model)
        refuse_complex(model, quantities)
        try:
            self._handles.append(
                model.register_forward_pre_hook(Hook(self._on_root_pre), with_kwargs=True)
            )
            self._install(model)
            self._handles.append(
                model.register_forward_hook(
                    Hook(self._on_root_post), with_kwargs=True, always_call=True
                )
            )
        except BaseException:
            self.remove()  # (nothing left on the model)
            raise
        _ACTIVE[model] = self

    def _install(self, model: nn.Module) -> None:
        """Hook every planned module and every trainable parameter they cover."""
        self._params: dict[int, tuple[str, nn.Parameter]] = {}  # trainable, covered, unique
        covered = {id(q) for t in self._targets for q in t.params.values()}
        for name, p in self._named_parameters(model):
            if p.requires_grad and id(p) in covered and id(p) not in self._params:
                self._params[id(p)] = (name, p)
        self._numel = sum(p.numel() for _, p in self._params.values())
        handles = self._target_handles

        def hook(fn) -> Hook:
            made = Hook(fn)
            self._module_hooks.append(made)
            return made

        for target in self._targets:
            detaches = target.entry.grad_from_grad1 is not None
            handles.append(
                target.module.register_forward_pre_hook(
                    hook(self._enter_hook(target)), with_kwargs=True
                )
            )
            handle = target.module.register_forward_hook(
                hook(self._forward_hook(target)), with_kwargs=True, always_call=True
            )
            handles.append(handle)
            if detaches:
                handles.append(
                    target.module.register_forward_pre_hook(
                        hook(self._detach_hook(target, handle.id)), with_kwargs=True
                    )
                )
        for entry in entry_modules(model, self._targets):
            pre, post = self._entry_hooks(entry)
            handles.append(
                entry.register_forward_pre_hook(hook(pre), with_kwargs=True, prepend=True)
            )
            handles.append(
                entry.register_forward_hook(hook(post), with_kwargs=True, always_call=True)
            )
        if self._track:
            for pid, (name, p) in self._params.items():
                if pid not in self._sharded:  # (FSDP2 gives them no autograd gradient)
                    handles.append(p.register_hook(self._param_hook(pid, name)))
        for target in self._targets:
            _HOOKED_MODULES[target.module] = self
        self._hooked = {id(t.module): frozenset(t.params) for t in self._targets}
        self._structure = structure_of(model, bool(self._sharded))

    def _follow_changes(self, model: nn.Module) -> None:
        """At each forward: where modules were added, swapped or removed, or parameters frozen
        or unfrozen since the hooks were planned, plan them again (a new layer gets ``grad1``
        too); after :meth:`clear`, a parameter that is no longer trainable loses its
        ``grad1``."""
        if structure_of(model, bool(self._sharded)) == self._structure:
            return
        if not self._shards and any(
            isinstance(m, _torch.fsdp_module_class()) for m in model.modules()
        ):
            raise RuntimeError(
                "the model was sharded with FSDP2 (fully_shard) after add_hooks: the hooks were "
                "planned with its parameters before sharding. Remove them and add them to the "
                "sharded model (add_hooks(model, quantities=('norms',)) after fully_shard)."
            )
        before = dict(self._params)
        for made in self._module_hooks:
            made.dead = True
        self._module_hooks = []
        for h in self._target_handles:
            h.remove()
        self._target_handles = []
        for t in self._targets:
            if _HOOKED_MODULES.get(t.module) is self:
                del _HOOKED_MODULES[t.module]
        self._targets = plan_targets(model, self.registry, self.unsupported, self._shards)
        for t in self._targets:
            other = _HOOKED_MODULES.get(t.module)
            if other is not None and other is not self:
                raise RuntimeError(
                    f"module '{t.name}' ({type(t.module).__qualname__}), added after add_hooks, "
                    f"is already hooked by another gradhooks handle ({other!r}); remove those "
                    "hooks first."
                )
        self._install(model)
        if self._collector is not None:
            for name, p in self._named_parameters(model):
                self._collector.names.setdefault(id(p), name)
        if not self._written:  # (cleared since the last backward)
            for pid, (_, p) in before.items():
                if pid not in self._params and hasattr(p, "grad1"):
                    del p.grad1

    def _named_parameters(self, model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
        """``model.named_parameters()`` with the parameters the hooks were planned with: where
        FSDP2 holds a stand-in in a sharded parameter's slot (its unsharded parameter while a
        call runs, and at the root from the forward to the backward, or one resharded after
        the forward on a smaller mesh), the sharded parameter."""
        for name, p in model.named_parameters():
            yield name, self._shards.get(name, p)

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
        it. The current ``grad1`` tensors stay readable (those of a backward that failed half
        way are put back as they were before it)."""
        if graph_task() == -1:
            self._drop_stale()
        self._written.clear()
        self._missed.clear()
        self._hessian_backprops.clear()
        if self._collector is not None:
            self._collector.clear()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Within the block this handle captures nothing: forwards are not kept and backwards
        write no ``grad1`` (other handles are not affected). For backwards that are not the
        training loss: derivatives for a Laplacian or an input-gradient, or differentiating a
        function of ``grad1`` after a ``create_graph=True`` backward."""
        with self._pause():
            yield

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """With ``add_hooks(..., capture="marked")``, only backwards run inside this block write
        ``grad1`` (forwards are always kept)::

            h = gradhooks.add_hooks(model, capture="marked")
            out = model(x)
            dx, = torch.autograd.grad(out.sum(), x, retain_graph=True)   # not captured
            with h.capturing():
                loss_fn(out, y).backward()                                # captured
        """
        self._marked += 1
        try:
            yield
        finally:
            self._marked -= 1

    def check(
        self, loss_fn=None, inputs=None, target=None, *, examples: int = 2,
        raise_on_error: bool = True,
    ) -> CheckReport:  # fmt: skip
        """Check, after a backward, that ``grad1`` is what it claims to be; raise a
        ``RuntimeError`` naming every problem (or return them, ``raise_on_error=False``).

        Always: every parameter's ``grad1`` reduces (``mean``/``sum`` as declared) to its
        ``.grad`` (it does not when ``.grad`` accumulated over earlier steps, when the loss has a
        term that bypasses the hooked layers, such as weight decay added to the loss, or
        derivatives of the model); NaN/Inf in ``grad1`` (carried through as autograd does)
        with the examples they are in; backwards that computed gradients without a captured
        forward. ``.grad1`` reduces to ``.grad`` whatever the loss's real reduction, so the
        reduction itself needs the loss: with ``loss_fn(model(x[i:i+1]), target[i:i+1])``
        (and the ``inputs``/``target`` of the captured forward), the first ``examples``
        examples are recomputed one at a time and the report says which reduction the loss
        really used. Returns a :class:`gradhooks.CheckReport`.
        """
        return check_hooks(
            self, loss_fn, inputs, target, examples=examples, raise_on_error=raise_on_error
        )

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

    def norm_forms(self) -> dict[str, str]:
        """How the last backward formed each parameter's per-example norm (``"norms"``),
        ``{name: form}``, chosen per parameter by cost:

        - ``"outer"``: one position per example, ``‖g‖·‖a‖`` (Goodfellow);
        - ``"gram"``: several positions ``T``, from the two ``[T, T]`` Gram matrices of the
          layer's inputs and output-gradients, ``T²·(in + out)`` per example;
        - ``"materialized"``: ``grad1`` formed a slice of the batch at a time, ``T·in·out`` per
          example, where that is cheaper than the Gram form;
        - ``"direct"``: the rule gives ``grad1`` itself (a bias, a norm layer's scale);
        - ``"rows"``: an embedding's looked-up rows, never the whole table.
        """
        return dict(self._results("norms").norm_forms)

    def norms(self) -> Tensor:
        """Per-example norm of the whole model's gradient, ``[batch]`` (``"norms"``), of the
        last backward (each backward replaces them; they do not accumulate as ``grad1``)."""
        c = self._results("norms")
        if not c.param_sq_norms:
            raise RuntimeError(
                "no backward has been captured since the hooks were added or cleared"
            )
        if c.missed:
            names = ", ".join(f"'{n}'" for n in c.missed[:5])
            raise RuntimeError(
                f"the last backward computed the gradient of {names} but captured no "
                "per-example gradient for them (used outside the hooked model's modules: in "
                "the loss, or in a method of the model other than forward outside any "
                "submodule's call), so the whole-model norms would leave them out. Use them "
                "inside a module's forward, or freeze them; param_norms() has the others."
            )
        return total_norms(c.param_sq_norms)

    def sum_grad_sq(self) -> dict[str, Tensor]:
        """``Σ_i grad1[i]²`` per parameter, ``{name: [*p.shape]}`` (``"sum_grad_sq"``): the
        diagonal of the empirical Fisher, summed over examples (BackPACK's SumGradSquared for a
        sum-reduced loss)."""
        return dict(self._results("sum_grad_sq").sum_grad_sq)

    def grad_variance(self) -> dict[str, Tensor]:
        """Per-example gradient variance per parameter, ``{name: [*p.shape]}``
        (``"sum_grad_sq"``): ``mean_i grad1[i]² - (mean_i grad1[i])²`` (population variance,
        clamped at 0). The mean of a Linear on ``[batch, features]`` or of an Embedding, where
        its input and output-gradient (its lookups' gradients) take no more memory than the
        mean, is formed by the first call, from those kept until then; only
        :meth:`sum_grad_sq` asked for, it is never formed."""
        c = self._results("sum_grad_sq")
        batch = max(c.batch or 0, 1)
        means = {n: m() if callable(m) else m for n, m in c.grad_mean.items()}  # (formed now)
        return {n: (sq / batch - means[n] ** 2).clamp_min(0) for n, sq in c.sum_grad_sq.items()}

    def kfac_factors(self, reduction: LossReduction = "mean") -> dict:
        """K-FAC factors ``{weight_name: KFactors(A, G, bias)}`` accumulated since the last
        :meth:`clear` (``"kfac"``); conventions in :mod:`gradhooks.kfac`. Over several
        backwards of one forward (your own sampled labels, or the columns of a loss Hessian's
        square root), ``G`` sums them; ``"mean"`` then divides by the examples of every
        backward, which averages over the backwards (right for samples; for columns, multiply
        by their number, or use :func:`gradhooks.kfac`, which sums them)."""
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
        for h in (*self._handles, *self._target_handles):
            h.remove()
        self._handles.clear()
        self._target_handles.clear()
        model = self.model
        if model is not None and _ACTIVE.get(model) is self:
            del _ACTIVE[model]
        for t in self._targets:
            if _HOOKED_MODULES.get(t.module) is self:
                del _HOOKED_MODULES[t.module]
        self._written.clear()
        self._unheld.clear()
        if self._probe_box is not None:
            drop_box(self._probe_box)
            self._probe_box = None
        for frame in self._frames[::-1]:
            self._stop_tracker(frame)
        self._frames.clear()
        self._tasks.clear()
        for stack in self._detached.values():  # removed during a forward
            for _, _, owned, _, recording, undo in stack[::-1]:
                if undo is not None:
                    undo()
                if recording is not None:
                    recording[0].__exit__(None, None, None)
                if owned is not None:
                    torch.set_grad_enabled(True)
        self._detached.clear()
        self._aliases_checked.clear()
        if self._collector is not None:
            self._collector.discard_backward()
            self._collector._expected = {}

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

    def _capturing_backward(self) -> bool:
        return self._pause.on and (self.capture == "always" or self._marked > 0)

    def _enter_hook(self, target: Target):
        """The forward pre-hook of every hooked module: the tracker (if this forward has one)
        learns which parameters the call covers, so that an operation using a parameter
        outside its module's call is seen as a direct use."""
        own = list(target.params.values())

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if module is not target.module:
                return
            now = own
            if self._sharded:
                now = self._unsharded(target)
            tracker = self._tracker()
            if tracker is not None:
                self._reseed_before(target, module, args, kwargs, tracker)
                tracker.enter_call(now, module, soft=target.entry is FALLBACK)

        return hook

    def _tracker(self) -> Tracker | None:
        return self._frames[-1].tracker if self._frames else None

    def _unsharded(self, target: Target) -> list[nn.Parameter]:
        """A module sharded by FSDP2 holds, while it runs, unsharded parameters in place of
        the sharded ones the hooks were planned with: the parameters its call uses now, each
        known to the tracker under its sharded one's name (and kept for the DP step's
        backward, :func:`gradhooks.dp_sgd_step`)."""
        slots = dict(target.module.named_parameters(remove_duplicate=False))
        now = []
        for name, planned in target.params.items():
            current = slots.get(name, planned)
            now.append(current)
            if current is not planned:
                self._current[id(planned)] = current
                tracker = self._tracker()
                if tracker is not None and id(planned) in self._params:
                    tracker.params[id(current)] = (self._params[id(planned)][0], planned)
        return now

    def _forward_hook(self, target: Target):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            tracker = self._tracker()
            if tracker is None or module is not target.module or not tracker.covered:
                return body(module, args, kwargs, output, None, True)
            used = tracker.exit_call()
            with tracker.paused():
                return body(module, args, kwargs, output, tracker, used)

        def body(module, args, kwargs, output, tracker, used) -> Any:
            args, kwargs = positional(module, args, kwargs)
            detached, owned, carried, recorded = (
                self._reattach(module) if self._detached else ({}, None, None, None)
            )
            if output is None and sys.exc_info()[1] is not None:
                return  # the forward raised (an always_call hook, for _reattach)
            if detached and owned is None and id(module) not in self._aliases_checked:
                self._check_aliases(target, detached, args, kwargs, output)
            if owned is not None:
                new = self._capture_owned(target, detached, owned, args, kwargs, output, recorded)
                return carry_layouts(tracker, output, new)
            if detached and carried is None:
                new = self._capture_detached(target, detached, args, kwargs, output)
                return carry_layouts(tracker, output, new)
            # (a carried call goes on as any other: its rule gives the sums as well)
            sums = carried.sums if carried is not None else None
            if self._removed or not self._pause.on:
                return
            if not torch.is_grad_enabled():
                if self._frames and self._frames[-1].grad_enabled:
                    # no_grad inside a training forward: reentrant activation checkpointing,
                    # which reruns this call during the backward. The collector then waits for
                    # the end of the backward to reduce these parameters' pieces.
                    self._frames[-1].unprobed = True
                    self._recomputes = True
                    if self._collector is not None:
                        self._collector.defer.update(id(p) for p in target.params.values())
                return
            if module is not target.module:
                return  # a deep copy of a hooked module carries our hook: the copy is not hooked
            if _torch.in_transform(args, kwargs, output):
                return  # inside vmap/grad (an oracle, the fallback rule): not ours to capture
            if target.entry.on_forward is not None:
                target.entry.on_forward(module, target.name)  # raises where grad1 cannot exist
            live = {n: p for n, p in target.params.items() if p.requires_grad}
            if tracker is not None and target.entry is not FALLBACK:
                # a parameter its call never used, followed where it was used instead (the old
                # nn.utils.weight_norm makes `weight` from `weight_g` and `weight_v` in a
                # forward pre-hook, before the call): its grad1 comes from there
                live = {
                    n: p
                    for n, p in live.items()
                    if id(self._current.get(id(p), p)) in used.params
                    or id(p) not in tracker.param_sources
                }
            if not live:
                return
            leaves = tree_leaves(output)
            hooked = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.requires_grad]
            if not hooked:
                return
            if target.entry is FALLBACK and tracker is not None:
                if used.mixed:
                    ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
                    outs = [t for t in tree_leaves(output) if isinstance(t, Tensor)]
                    tracker.absorb(used, ins, outs)
                live = _used_by_fallback(target, live, used, tracker, output)
                if not live:
                    return  # the tracker follows every use (or there was none)
            replaced = None
            if len(hooked) > 1 or any(_torch.is_view(leaves[i]) for i in hooked):
                # an output that is a view (nn.Linear on [batch, seq, in]) loses its gradient
                # hooks to an in-place change (a ReLU(inplace=True) next): the same memory, as
                # an output of its own. Several outputs each get a node of their own: where one
                # is computed from another inside the call (LSTMCell's h' from c'), the gradient
                # reaching the other would include what flowed in through the first.
                old = output
                output = tree_map(unview if len(hooked) == 1 else own_node, output)
                replaced = carry_layouts(tracker, old, output)
                leaves = tree_leaves(output)
            layout = self._call_layout(target, args, kwargs, output, tracker)
            call, state = self._kept_call(target, live, args, kwargs, output, layout)

            n_leaves = len(leaves)
            # what the call's nodes hold is read only where they stand as the forward ran them
            # (not for the Jacobians: their backward stops at the hooked calls' outputs; not
            # under saved-tensor hooks: reading what a node saved would rerun the call)
            readable = (
                (target.entry.taps is not None or target.entry.saved is not None)
                and self._track
                and keeps_rows(layout)
                and not _torch.saved_tensor_hooks_active()
            )
            taps = None
            if target.entry.taps is not None and readable:
                taps = target.entry.taps(module, args, kwargs, output)
            nodes = list(taps.nodes) if taps is not None else []
            # the closures below count the nodes and never hold them (see _without_nodes)
            n_nodes = len(nodes)
            if taps is not None:
                call = replace(call, taps=_without_nodes(taps))
            if target.entry.saved is not None and readable:
                call = replace(call, saved=target.entry.saved(module, args, kwargs, output))

            def on_grads(grads) -> None:
                if self._rerunning and not (self._probing and carried is not None):
                    return  # a backward of the engine's own
                full: list[Tensor | None] = [None] * n_leaves
                for i, g in zip(hooked, grads):
                    full[i] = g
                if carried is not None:  # (sums a backward that never reached it left: gone)
                    carried.outputs = tuple(full)
                    carried.sums.clear()
                    if self._rerunning:
                        return  # the probe's: the carried parameters' gradients by a rerun
                capturing = not (self._removed or self._ignore_backward or state.cancelled)
                if n_nodes and capturing and self._capturing_backward():
                    # The rule runs when the backward reaches the tapped nodes too, or, if it
                    # never does (a backward for some parameters only), at its end without them
                    pending["outputs"] = tuple(full)
                    bw = self._backward_state()
                    bw.reached.update(id(p) for p in live.values())  # before their own grads
                    bw.pending[id(pending)] = lambda: self._on_grads(
                        target, state, replace(call, grad_outputs=pending.pop("outputs"),
                                               taps=None), args, kwargs, sums,
                    )  # fmt: skip
                    return
                filled = replace(call, grad_outputs=tuple(full))
                self._on_grads(target, state, filled, args, kwargs, sums)

            if nodes:
                pending: dict[Any, Any] = {}

                def on_node(i: int, grad_outputs: tuple) -> None:
                    if "outputs" not in pending or self._rerunning:
                        return  # a backward not captured
                    pending[i] = tuple(grad_outputs)
                    if len(pending) < n_nodes + 1:
                        return
                    tapped = tuple(pending[j] for j in range(n_nodes))
                    outputs = pending.pop("outputs")
                    pending.clear()
                    bw = self._tasks.get(graph_task())
                    if bw is not None:
                        bw.pending.pop(id(pending), None)
                    done = replace(call, grad_outputs=outputs, tap_grads=tapped)
                    self._on_grads(target, state, done, args, kwargs, sums)

                for i, node in enumerate(nodes):
                    node.register_prehook(lambda grad_outputs, i=i: on_node(i, grad_outputs))

            if self._collector is not None:
                self._collector.expect(live)
            if len(hooked) == 1:
                leaves[hooked[0]].register_hook(lambda g: on_grads((g,)))
            else:
                torch.autograd.graph.register_multi_grad_hook(
                    [leaves[i] for i in hooked], on_grads, mode="all"
                )
            return replaced

        return hook

    def _kept_call(
        self,
        target: Target,
        live: dict,
        args: tuple,
        kwargs: dict,
        output: Any,
        layout: CallLayout | None = None,
    ) -> tuple[Call, CallState]:
        """What a captured forward call keeps until its backward, registered with the root
        forward it runs in."""
        call = Call(
            module=target.module,
            inputs=detach_tree(args),
            kwargs=detach_tree(kwargs),
            output=detach_tree(output) if target.entry.needs_output else None,
            grad_outputs=(),
            name=target.name,
            registry=self.registry,
            hooked=self._hooked,
            memo=target.memo,
        )
        frame = self._frames[-1] if self._frames else None
        kept = [t for t in tree_leaves((call.inputs, call.kwargs)) if isinstance(t, Tensor)]
        if target.entry is not FALLBACK:
            kept = kept[:1]  # (a rule computes from its first input; the fallback from all)
        versions = tuple((t, _torch.version(t)) for t in kept)
        state = CallState(live, frame, layout=layout, versions=versions)
        if call.output is not None:
            state.out_versions = tuple(
                (i, _torch.version(t))
                for i, t in enumerate(tree_leaves(call.output))
                if isinstance(t, Tensor)
            )
        if frame is not None:
            frame.states.append(state)
            frame.signature.append((id(target), None if layout is None else layout.kind))
            if not frame.unprobed and (_torch.saved_tensor_hooks_active() or autocast_on()):
                frame.unprobed = True  # (run again at the backward, or in lower precision)
        return call, state

    def _keep_unhooked_call(self, target: Target, args: tuple, kwargs: dict, output: Any):
        """The start of capturing a call whose parameters autograd does not see (run detached,
        or with grad mode off): its forward check, its kept call and the collector's
        expectation of its live parameters. Returns ``(call, state)``."""
        if target.entry.on_forward is not None:
            target.entry.on_forward(target.module, target.name)
        live = {n: p for n, p in target.params.items() if p.requires_grad}
        layout = self._call_layout(target, args, kwargs, output, self._tracker())
        call, state = self._kept_call(target, live, args, kwargs, output, layout)
        if self._collector is not None:
            self._collector.expect(live)
        return call, state

    # -- where the examples are (the forward's Tracker) ----------------------------------------

    def _on_grads(
        self,
        target: Target,
        state: CallState,
        call: Call,
        args,
        kwargs,
        sums: dict[str, Tensor] | None = None,
    ) -> None:
        """The backward reached the outputs of one captured call. ``sums``: filled with the
        call's batch gradient of each parameter it writes ``grad1`` for."""
        if self._removed or self._ignore_backward or state.cancelled or self._probing:
            return
        # Inside a backward, grad mode is on exactly when it was asked for with create_graph.
        create_graph = torch.is_grad_enabled()
        if not self._capturing_backward():
            state.derived |= create_graph
            return
        bw = self._backward_state() if self._track else None
        if state.derived:
            # Wrong only if this backward computes parameter gradients (not for the next
            # derivative of a Laplacian, with respect to the input): decided at its end.
            where = f"'{target.name or '<model>'}' ({type(target.module).__qualname__})"
            if bw is None:
                raise RuntimeError(higher_order(where))
            bw.derived = bw.derived or where
            return
        state.derived = create_graph
        if create_graph:  # grad1 gets a graph: through the inputs too, so not detached
            call = replace(call, inputs=args, kwargs=kwargs)
        if bw is not None:
            bw.reached.update(id(p) for p in state.params.values())
            if state.frame is not None:
                bw.frames.add(id(state.frame))
        try:
            check_versions(target, state)
            if state.out_versions:
                call = unchanged_outputs(call, state.out_versions)
            layout = state.layout
            if layout is not None and layout.kind == "shared":
                aligned = aligned_call(target, layout, call)
                if aligned is not None:
                    layout = aligned
                else:
                    call = per_example_outputs(target, layout, call, create_graph)
            self._backward(target, state.params, call, state.frame, bw, sums, layout)
        except BaseException:
            self._abort_backward()
            raise

    def _backward(
        self,
        target: Target,
        params: dict[str, nn.Parameter],
        call: Call,
        frame: Frame | None = None,
        bw: Backward | None = None,
        sums: dict[str, Tensor] | None = None,
        layout: CallLayout | None = None,
    ) -> None:
        rule = target.entry.rule
        try:
            pieces = rule_pieces(target, params, call, layout)
        except Exception as e:
            msg = str(e)
            names = (f"'{target.name}'", f"'{target.name or '<model>'}'")
            if msg.startswith("fallback for") or any(n in msg for n in names):
                raise  # already names the module
            raise RuntimeError(
                f"rule {rule.__qualname__} for '{target.name or '<model>'}' "
                f"({type(target.module).__qualname__}) failed on {describe_call(call)}: {e}\n"
                "Rules take dimension 0 of the layer's input and output-gradient as the batch; "
                "an input without a batch dimension (x of shape [features] rather than "
                "[batch, features]) needs one: x.unsqueeze(0)."
            ) from e
        live: dict[str, nn.Parameter] = {}
        for pname, p in params.items():
            if pieces.get(pname) is not None:
                live[pname] = p
            elif pname not in pieces:
                raise RuntimeError(
                    f"rule {rule.__qualname__} for '{target.name}' ({type(target.module).__qualname__}) "
                    f"returned no piece for trainable parameter '{pname}' (got {sorted(pieces)}). "
                    "A parameter the rule does not know is used by something around the layer "
                    "(a forward pre-hook that makes its weight from it, as the old "
                    "torch.nn.utils.weight_norm does), which gradhooks follows only while it "
                    "tracks the batch (batch_dim not None): use "
                    "torch.nn.utils.parametrizations.weight_norm, or register a rule for "
                    "the layer."
                )
            # else: None, the rule says this call's gradient for it is computed elsewhere
        if not live:
            return
        first = next(iter(live))
        batch = pieces[first].batch_size
        if (
            layout is not None
            and batch != layout.batch
            and self.batch_dim == "auto"
            and (layout.root and frame is not None)
        ):
            # the model's first input was taken as the batch, and the layer that reads it
            # counts its examples otherwise (bags of a flat index list): its count is checked
            # as without the tracker
            self._check_batch(target, first, call, batch, frame)
        elif layout is not None:
            if batch != layout.batch:
                raise RuntimeError(
                    f"'{target.name or '<model>'}' ({type(target.module).__qualname__}): its "
                    f"rule gives '{first}' a per-example gradient for {batch} examples, but the "
                    f"model's forward has {layout.batch} ({describe_call(call)}). gradhooks could "
                    f"not follow the batch to this layer (through: "
                    f"{', '.join(layout.lost) or 'its own operations'}); say where the model's "
                    "batch is with add_hooks(..., batch_dim=k), or register a rule."
                )
        elif frame is not None and self.batch_dim is not None:
            self._check_batch(target, first, call, batch, frame)
        if self._grad1 and bw is not None and not bw.memory_checked:
            bw.memory_checked = True  # before the first grad1 of this backward is formed
            self._refuse_large(batch)
        scale = float(batch) if self.loss_reduction == "mean" else 1.0
        formed: dict[int, Tensor] | None = None
        if sums is not None and not self._grad1 and not self._no_param_grads:
            formed = {}
        for pname, p in live.items():
            if not pieces[pname].sums_to_grad:
                self._exempt.add(id(p))
        if not self._grad1 and bw is not None and bw.verify:
            # (fresh pieces: none of the columns the norms may cache)
            bw.kept.append(({n: pieces[n].select(slice(None)) for n in live}, live, scale))
        if self._collector is not None:
            self._collector.add(target.name, {n: pieces[n] for n in live}, live, scale, formed)
        wanted = getattr(sums, "names", None)  # (a _Sums: for these parameters only)
        if not self._grad1:
            if formed is not None:  # a call run detached without grad1 (norms): batch gradients
                for pname, p in live.items():  # as a by-product of the norms, else from the piece
                    if wanted is not None and pname not in wanted:
                        continue
                    total = formed.pop(id(p), None)
                    if total is not None:
                        total = total / scale if scale else total
                    else:
                        total = pieces[pname].batch_sum(p.shape)
                    sums[pname] = total.to(p.dtype)
            return
        for pname, p in live.items():
            piece = pieces[pname]
            qualname = f"{target.name}.{pname}" if target.name else pname
            if bw is not None and id(p) not in bw.before:
                # kept for a rollback; a kept grad1 is then never written in place
                bw.before[id(p)] = p.grad1 if id(p) in self._written else None
            accumulate = id(p) in self._written
            out = self._writable_grad1(qualname, p, piece.batch_size, accumulate)
            summed = sums is not None and (wanted is None or pname in wanted)
            if accumulate and summed:
                out = None  # this call's own grad1 is summed below: not added in place
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
            if summed:
                own = out if out is not None else g1
                total = own.sum(0, dtype=p.dtype)
                sums[pname] = total / scale if scale else total
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
        if torch.is_grad_enabled():
            return None  # a create_graph backward: grad1 gets a graph, never written in place
        old = _sole_grad1(p)
        if old is None:
            return None
        if accumulate and old.shape[0] != batch:
            return None  # _accumulate explains
        if tuple(old.shape) != (batch, *p.shape) or old.dtype != p.dtype or old.device != p.device:
            return None
        return old

    def _check_batch(self, target, pname, call, batch: int, frame: Frame) -> None:
        """Every hooked layer of one forward of the model must see its batch on dimension 0."""
        if len(frame.seen) == 1 and batch in frame.seen:
            return  # the usual case, checked once per forward: as the layers before it
        name = f"'{target.name or '<model>'}' ({type(target.module).__qualname__})"
        other = next((n for b, n in frame.seen.items() if b != batch), None)
        if frame.batch is not None and batch != frame.batch:
            why = (
                f"but the model's forward got a batch of {frame.batch} (dimension "
                f"{self.batch_dim} of its first tensor input)"
            )
        elif other is not None:
            seen = next(b for b, n in frame.seen.items() if n == other)
            why = f"but {other} in the same forward of the model saw a batch of {seen}"
        elif frame.batch is None and frame.sizes and batch not in frame.sizes:
            why = (
                f"but dimensions 0 and 1 of the model's tensor inputs and outputs have sizes "
                f"{sorted(frame.sizes)}, none {batch}"
            )
        else:
            frame.seen.setdefault(batch, name)
            return
        what = (
            f"{name} gives '{pname}' a per-example gradient for {batch} examples (dimension 0 of "
            f"what its rule sees: {describe_call(call)})"
        )
        raise RuntimeError(
            f"{what}, {why}. A layer that does not see the examples on dimension 0 (the model "
            "folds time or patches into the batch, x.view(B * T, ...), or runs a layer "
            "sequence-first, [seq, batch, ...]) would get grad1 rows that are not examples. Keep "
            "the batch on dimension 0 of every hooked layer's input (nn.Linear takes "
            "[batch, *, features]: no need to fold; batch_first=True, or x.transpose(0, 1)). "
            "add_hooks(..., batch_dim=k) says the model's batch is dimension k of its first "
            "input; batch_dim=None turns this check off (grad1 then has one row per entry of "
            "each layer's dimension 0)."
        )

    def _refuse_large(self, batch: int) -> None:
        if not self._params:
            return
        p = next(iter(self._params.values()))[1]
        model = self.model
        refuse_if_too_large(
            f"'{type(model).__qualname__}'" if model is not None else "the model",
            batch, self._numel, p.element_size(), p.device, self.max_grad1_bytes,
        )  # fmt: skip

    # -- the root forward and the backward's bookkeeping --------------------------------------

    def _on_root_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if module is not self.model:
            return  # a copy
        self._open_frame(module, args, kwargs)

    def _entry_hooks(self, module: nn.Module) -> tuple[Any, Any]:
        """The forward pre- and post-hook of a module of the model other than the root that
        holds a hooked module (or is one): where it is called outside the model's own forward
        (``model.encoder(x)``, a method such as ``get_image_features`` that calls submodules
        rather than ``forward``), its call is a forward of the model's, with the batch followed
        from its inputs, as the root's would be."""
        ref = weakref.ref(module)

        def pre(m: nn.Module, args: tuple, kwargs: dict) -> None:
            # (not during a backward: activation checkpointing running a block again)
            if not self._frames and m is ref() and graph_task() == -1:
                self._open_frame(m, args, kwargs)

        def post(m: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if m is ref():
                self._on_root_post(m, args, kwargs, output)

        return pre, post

    def _open_frame(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A forward of the model starts: ``module``'s call (the root's, or an entry's:
        :meth:`_entry_hooks`)."""
        frame = Frame(None, [], torch.is_grad_enabled(), owner=module)
        self._frames.append(frame)  # first: the post-hook pops it even if this raises
        if self._removed or not self._pause.on:
            return
        if not torch.is_grad_enabled() or _torch.in_transform(args, kwargs):
            return
        if graph_task() == -1:
            self._drop_stale()
        self._follow_changes(self.model)
        leaves = [t for t in [*tree_leaves(args), *tree_leaves(kwargs)] if isinstance(t, Tensor)]
        if not leaves or self.batch_dim is None:
            return
        if self.batch_dim == "auto":
            frame.sizes.update(n for t in leaves for n in t.shape[:2])
            if all(t.dim() == 0 for t in leaves):
                raise ValueError(
                    f"{type(module).__qualname__}'s tensor inputs have no dimensions "
                    f"({', '.join(str(tuple(t.shape)) for t in leaves)}): no batch of examples. "
                    "Add a batch dimension (x.unsqueeze(0) for one example)."
                )
            self._start_tracker(frame, args, kwargs)
            return
        first = leaves[0]
        if first.dim() <= self.batch_dim:
            raise ValueError(
                f"{type(module).__qualname__}'s first tensor input has shape "
                f"{tuple(first.shape)}: no batch dimension {self.batch_dim}. gradhooks needs a "
                "batch of examples; for one example add the batch dimension (x.unsqueeze(0))."
            )
        frame.batch = first.shape[self.batch_dim]
        if self._grad1:
            self._refuse_large(frame.batch)  # before the forward allocates anything
        self._start_tracker(frame, args, kwargs)

    def _start_tracker(self, frame: Frame, args: tuple, kwargs: dict) -> None:
        """Follow the batch through this forward (:mod:`gradhooks.layout`)."""
        if not self._track or is_compiling():
            return
        found = root_batch(args, kwargs, self.batch_dim)
        if found is None:
            return
        batch, layouts = found
        if batch == 0:
            return  # (no example: nothing to follow)
        tracker = Tracker(batch, self._params, self)
        for i, (t, lay) in enumerate(layouts):
            tracker.set_layout(t, lay)
            if i and lay is not PACKED:
                tracker.candidates[t] = True
        frame.roots = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        frame.tracker = tracker
        tracker.__enter__()

    def _stop_tracker(self, frame: Frame) -> None:
        tracker, frame.tracker = frame.tracker, None
        if tracker is not None:
            tracker.__exit__(None, None, None)
            tracker.finish()

    def _on_root_post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self._frames or self._frames[-1].owner is not module:
            return  # (a copy; an entry called inside the model's forward)
        frame = self._frames.pop()
        tracker = frame.tracker
        self._stop_tracker(frame)
        if tracker is not None and sys.exc_info()[1] is None:
            self._check_output(module, tracker, output)
        if frame.signature:
            sig = tuple(frame.signature)
            # (verified by the next backward that captures: the first of each new set of calls,
            # and again at the 2nd, 4th, 8th... backward of the handle, where what changed since
            # without changing the calls, a hook or a loss term added later, shows)
            if sig not in self._verified or (self.verify and power_of_two(self._backwards + 1)):
                self._verified.add(sig)
                self._unverified.add(sig)
                if tracker is not None and sys.exc_info()[1] is None:
                    self._arm_probe(frame, tracker, output)
        if self.batch_dim == "auto" and frame.sizes:
            frame.sizes.update(
                n for t in tree_leaves(output) if isinstance(t, Tensor) for n in t.shape[:2]
            )
        if output is None and sys.exc_info()[1] is not None:
            # the forward raised: what it captured will never be backpropagated
            for state in frame.states:
                state.cancelled = True
                if self._collector is not None:
                    self._collector.unexpect(state.params)

    def _backward_state(self) -> Backward:
        task = graph_task()
        bw = self._tasks.get(task)
        if bw is None:
            nested = bool(self._tasks)  # (a backward inside another: reentrant checkpointing)
            bw = self._tasks[task] = Backward(set(), set(), {}, [])
            if nested:  # their gradients are split between the two: not verified
                for other in self._tasks.values():
                    other.verify = frozenset()
            elif self.verify and self._checks_examples and self._unverified:
                bw.verify = frozenset(self._unverified)
            _torch.queue_backward_callback(lambda: self._end_backward(task))
        return bw

    def _param_hook(self, pid: int, name: str):
        def hook(grad: Tensor | None) -> None:
            if grad is None or self._removed or self._ignore_backward or self._rerunning:
                return  # (None: a node gave it no gradient, an empty batch's detached call)
            if pid in self._direct and self._capturing_backward():
                self._direct_uses(pid, name)
            bw = self._backward_state()
            bw.computed.add(pid)
            if bw.verify and self._capturing_backward():
                # (a copy: autograd may take this very tensor as .grad, which DDP then
                # all-reduces in place)
                bw.grads[pid] = grad.detach().clone()
            if pid not in bw.reached and self._capturing_backward():
                if pid in bw.direct:
                    self._lost(pid, name, *bw.direct[pid])
                bw.missed.append(name)

        return hook

    def _direct_reached(self, held: tuple, unknown: dict) -> None:
        """The backward passes through an operation of a followed forward that used these
        parameters directly (``held``: ``(id, source)`` pairs, see :meth:`Tracker._hold`)."""
        if self._rerunning or self._removed or self._ignore_backward or not self._track:
            return
        if not (self._capturing_backward()):
            return
        bw = self._backward_state()
        for pid, source in held:
            sources, _ = bw.direct.setdefault(pid, (set(), unknown))
            sources.add(source)

    def _lost(self, pid: int, name: str, sources: set, unknown: dict) -> None:
        """A parameter used directly in a followed forward whose gradient this backward computed
        with no per-example gradient at all: never left without one in silence."""
        uses = {kind for s in sources for kind, _ in s.uses}
        if "loss" in uses and not self.verify:
            return  # (a term of the loss alone: verify=False keeps the per-example terms)
        ops = ", ".join(unknown)
        self._abort_backward()
        raise RuntimeError(
            f"'{name}' is used outside its module's call, and this backward computed its "
            "gradient, but no per-example gradient reached it: "
            + (
                f"gradhooks lost the examples on the way (through {ops}, whose effect on the "
                "batch it does not know)"
                if ops
                else "its gradient never met the batch where gradhooks could follow it (a "
                "term of the loss computed from the parameter alone?)"
            )
            + ". Its grad1 was not written. Use the parameter through a module with a rule "
            "(or register one with @gradhooks.register), or freeze it."
        )

    def _direct_uses(self, pid: int, name: str) -> None:
        """A parameter's gradient is complete: its per-example gradients from its uses outside
        its module's call (the tracker's sources) go into ``grad1`` as one more piece."""
        task = graph_task()
        found = [
            s for s in list(self._direct[pid]) if not s.discarded and (task in s.grads or s.problem)
        ]
        if not found:
            return
        p = self._params[pid][1]
        target = self._direct_targets.get(pid)
        if target is None:
            prefix, leaf = owner_name(name)
            entry = _Entry(
                rule=lambda call, leaf=leaf: {leaf: P.Direct(call.grad_outputs[0])},
                owns_children=False, needs_output=False,
            )  # fmt: skip
            target = Target(prefix, self._owner(name), entry, {leaf: p})
            self._direct_targets[pid] = target
        problem = next((s.problem for s in found if s.problem), None)
        if problem is not None:
            self._abort_backward()
            raise RuntimeError(
                f"'{name}' is used outside its module's call, in operations that do not depend "
                f"on the examples until they meet the batch, and {problem}: gradhooks cannot "
                "tell each example's share of its gradient. Use it through its module, or "
                "freeze it."
            )
        per = None
        for s in found:
            g = s.grads.pop(task)
            per = g if per is None else per + g
        call = Call(
            target.module, (), {}, None, (per.to(p.dtype),), name=target.name,
            registry=self.registry,
        )  # fmt: skip
        state = CallState(dict(target.params), None)
        self._on_grads(target, state, call, (), {})

    def _owner(self, name: str) -> nn.Module:
        prefix, _ = owner_name(name)
        model = self.model
        return model.get_submodule(prefix) if model is not None else None

    def _end_backward(self, task: int) -> None:
        waiting = self._tasks.get(task)
        while waiting is not None and waiting.pending:  # taps the backward never reached
            waiting.pending.pop(next(iter(waiting.pending)))()
        bw = self._tasks.pop(task, None)
        if bw is None or self._removed:
            return
        self._unheld.clear()
        if bw.reached:
            self._backwards += 1
        if bw.derived is not None and bw.computed:
            self._rollback(bw)
            if self._collector is not None:
                self._collector.discard_backward()
            raise RuntimeError(higher_order(bw.derived))
        # A backward that computes the gradient of none of the model's parameters
        # (torch.autograd.grad with respect to the inputs: an input-gradient, a Laplacian)
        # leaves grad1 and the other quantities as they were.
        if bw.reached and not bw.computed and not self._no_param_grads and not self._sharded:
            self._rollback(bw)
            if self._collector is not None:
                self._collector.discard_backward()
        if bw.verify and bw.grads and bw.reached and self._grad1:
            self._verify(bw)
        elif bw.verify and not self._grad1:
            if bw.reached and bw.probe is not None and bw.frames == {bw.probe.frame}:
                # (after the collector's own callback, which forms the norms)
                _torch.queue_backward_callback(lambda: self._verify_norms(bw, bw.probe))
            self._unverified -= bw.verify
        if self._collector is not None:
            self._collector.missed = list(bw.missed)
        if bw.missed:
            missed = set(bw.missed)
            for name, p in self._params.values():
                if name in missed and id(p) not in self._written and hasattr(p, "grad1"):
                    del p.grad1  # (an earlier step's, never to be read for this one's)
            for name in bw.missed:
                self._missed[name] = None
            names = ", ".join(f"'{n}'" for n in bw.missed[:5])
            more = f" and {len(bw.missed) - 5} more" if len(bw.missed) > 5 else ""
            warnings.warn(
                f"gradhooks: a backward computed the gradient of {names}{more} but no forward "
                "call of their modules was captured for it: the forward ran before add_hooks, "
                "or while capture was paused, or outside the hooked model's modules (a "
                "parameter used in the loss, or in a method of the model other than forward "
                "outside any submodule's call). They have no grad1 from this backward. Run the "
                "forward after add_hooks, through the model's modules.",
                GradhooksWarning,
                stacklevel=2,
            )

    def _grad1_of_backward(self, bw: Backward, pid: int, p: nn.Parameter) -> Tensor | None:
        """What backward ``bw`` added to ``p.grad1`` (``None``: nothing)."""
        if pid not in self._written or pid not in bw.before:
            return None
        g1 = p.grad1.detach()
        before = bw.before[pid]
        return g1 if before is None else g1 - before

    def _rollback(self, bw: Backward) -> None:
        """Put back the grad1 a backward started from. ``bw.before`` holds a reference to it,
        so it was never written in place (``_writable_grad1`` refuses a referenced grad1)."""
        for pid, before in bw.before.items():
            p = self._written.get(pid)
            if p is None:
                continue
            if before is None:
                del self._written[pid]
                if hasattr(p, "grad1"):
                    del p.grad1
            else:
                p.grad1 = before

    def _abort_backward(self) -> None:
        """A hook of ours raised: the backward fails; leave nothing of it behind."""
        bw = self._tasks.pop(graph_task(), None)
        if bw is not None:
            self._rollback(bw)
        if self._collector is not None:
            self._collector.discard_backward()

    def _drop_stale(self) -> None:
        """At a forward outside any backward: a backward still recorded as running failed
        (an exception elsewhere in it); undo what it wrote."""
        for bw in self._tasks.values():
            self._rollback(bw)
        self._tasks.clear()
        if self._collector is not None and self._collector._queued:
            self._collector.discard_backward()

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


class _Edges(list):
    """:func:`_output_edges`' list of gradient edges; ``numel``: the elements of the outputs
    they lead to (what one backward through them writes at least)."""

    numel = 0


@contextlib.contextmanager
def _output_edges(hooks: Hooks) -> Iterator[_Edges]:
    """While a forward of the hooked model runs inside: the gradient edges of every hooked
    call's output tensors that require grad, in a list (the outputs themselves are not kept
    alive). A backward taken with respect to them, ``torch.autograd.grad(out, edges)``, reaches
    every hooked call, whose hooks then fire, without forming any parameter's batch gradient
    (for a convolution batched over several output-gradients, the largest part of the work)."""
    from torch.autograd.graph import get_gradient_edge

    targets = {id(t.module) for t in hooks._targets}
    edges = _Edges()

    def collect(module: nn.Module, args, output) -> None:
        if id(module) in targets:
            for t in tree_flatten(output)[0]:
                if isinstance(t, Tensor) and t.requires_grad:
                    edges.append(get_gradient_edge(t))
                    edges.numel += t.numel()

    handle = nn.modules.module.register_module_forward_hook(collect)
    try:
        yield edges
    finally:
        handle.remove()


def _without_nodes(taps: Any) -> Any:
    """``taps`` as the rule sees them (``call.taps``): without their ``nodes``, which the engine
    has hooked by then. Each node's hook refers to the kept call; a call referring back to the
    node would make a reference cycle through autograd's graph, which keeps the forward's
    tensors (and the graph's) alive after the backward until Python's garbage collector runs:
    several steps' activations at once, and fresh memory for every step."""
    if not getattr(taps, "nodes", None):
        return taps
    kept = copy.copy(taps)
    kept.nodes = ()
    return kept


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
    return t if t.is_contiguous() and _torch.unshared(t) else None


def _used_by_fallback(target: Target, live: dict, used, tracker: Tracker, output) -> dict:
    """The parameters a call of a module without a rule used in operations of its own (not
    inside its hooked submodules' calls) that the fallback differentiates: those the tracker
    could not follow to where they met the batch cheaply (its sources for them are then
    dropped). A submodule's parameter it uses directly while also calling that submodule
    cannot be told apart in the recomputation (both uses would be counted): an error."""
    escaped = set()
    for t in tree_flatten(output)[0]:
        escaped |= tracker.sources_of(t)
    kept = {}
    for n, p in live.items():
        if id(p) not in used.params:
            continue
        source = used.sources.get(id(p))
        if source is None and id(p) in used.functional:
            continue  # the tracker's: captured as F.linear's call
        if source is not None and not (
            source.needs_fallback or source.problem or source in escaped
        ):  # fmt: skip
            continue  # the tracker's
        if source is not None:
            source.discarded = True
        kept[n] = p
    for n in kept:
        prefix, _, _ = n.rpartition(".")
        if prefix and id(target.module.get_submodule(prefix)) in used.called:
            raise RuntimeError(
                f"'{target.name or '<model>'}' ({type(target.module).__qualname__}) calls its "
                f"submodule '{prefix}' and also uses its parameter '{n}' directly; its "
                "per-example gradients cannot tell the two uses apart. Register a rule for "
                f"{type(target.module).__qualname__} with @gradhooks.register, or use the "
                "parameter only through the submodule."
            )
    return kept


def add_hooks(
    model: nn.Module,
    loss_reduction: LossReduction = "mean",
    unsupported: Unsupported = "fallback",
    registry: Registry = REGISTRY,
    quantities: tuple[str, ...] | str = ("grad1",),
    *,
    batch_dim: int | str | None = "auto",
    max_grad1_bytes: int | str | None = "auto",
    capture: Capture = "always",
    verify: bool = True,
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
        batch_dim: the check that every hooked layer sees the examples on dimension 0 of
            its input (rules for sequence-first layers, such as ``nn.LSTM`` without
            ``batch_first``, handle their own layout). ``"auto"`` (default): all hooked
            layers of one forward of the model must agree on the batch size, and it must be
            the size of dimension 0 or 1 of some tensor input or output of the model (so a
            model that folds time into the batch, ``x.view(B * T, ...)``, is an error naming
            the layer and both sizes; a lone layer run sequence-first is not caught). An int
            ``k``: the batch is dimension ``k`` of the model's first
            tensor input, and every layer must see exactly that (stricter; also checks the
            memory limit at the forward). ``None``: no check.
        max_grad1_bytes: refuse a ``grad1`` (batch × trainable parameters × element size)
            larger than this many bytes (:class:`gradhooks.Grad1TooLarge`, raised at the
            first captured call of the backward, before any ``grad1`` is formed; at the
            forward with an int ``batch_dim``). ``"auto"``: :func:`gradhooks.set_memory_limit`'s
            value, by default half of the memory of the parameters' device. ``None``: no limit.
        capture: which backwards write ``grad1``. ``"always"`` (default): every backward
            that computes the parameters' gradients (``.backward()``, ``torch.autograd.grad``
            with respect to some of them), except under :meth:`Hooks.paused`; a backward
            that computes none of the model's parameter gradients (``torch.autograd.grad``
            with respect to the input only) leaves ``grad1`` as it was. ``"marked"``:
            only backwards run inside ``with h.capturing():``.
        verify: on the first backward of each new set of layer calls (the first step, a new
            sequence length), check that every parameter's ``grad1`` adds up to the gradient
            autograd computed, and raise, naming the parameters, where it does not (a use the
            hooks did not see; a loss term that is not per example, such as weight decay
            added to the loss: ``verify=False`` keeps ``grad1`` of the per-example terms).

    Returns:
        A :class:`Hooks` handle; also a context manager that removes the hooks on exit.

    Like autograd-hacks' ``add_hooks``, it turns capture back on where
    :func:`set_enabled` (``disable_hooks()``) turned it off.

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
    hooks = Hooks(
        model, loss_reduction=loss_reduction, unsupported=unsupported, registry=registry,
        quantities=quantities, batch_dim=batch_dim, max_grad1_bytes=max_grad1_bytes,
        capture=capture, verify=verify,
    )  # fmt: skip
    set_enabled(True)  # (as autograd-hacks' add_hooks undoes its disable_hooks)
    return hooks


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
    """Delete ``grad1`` from every parameter of ``model`` (a handle on it then starts afresh,
    as after :meth:`Hooks.clear`)."""
    hooks = _ACTIVE.get(model)
    if hooks is not None:
        hooks.clear()
    for p in model.parameters():
        if hasattr(p, "grad1"):
            del p.grad1

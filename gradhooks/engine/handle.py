"""The engine: hooks, capture and accumulation. It never names a layer type.

A forward hook on every module that has a rule keeps that call's inputs (detached; autograd keeps
them alive anyway) and registers a gradient hook on the call's output tensors. When backward
reaches those outputs, the rule turns (inputs, output-gradients) into pieces and the per-example
gradient of each trainable parameter is added to ``param.grad1``.

Pairing the gradient hook with the call it came from (rather than with the module) is what makes
a module called twice in one forward correct; accumulating on the parameter object is what makes
tied weights correct.

:class:`Hooks` is this module's: the handle, which plans what is hooked (installing, following
changes, removing), owns the engine's parts and gives a user what they read. Each part is an
object with its own methods, given the :class:`~.state.CaptureState` they share and the other
parts it calls (:meth:`Hooks._connect`): :class:`~.forward.ForwardCapture` (a forward of the
model: frames, the tracker, each hooked call kept), :class:`~.backward.BackwardWriter` (a
backward: each call's pieces into ``grad1`` and the quantities, and the backward's
bookkeeping), :class:`~.calls.CallLayouts` (where the examples are in each call, from the
forward's tracker), :class:`~.capture.DetachedCalls` (calls run detached, owned or carried, for
the rules that ask) and :class:`~.verify.Verifier` (the checks of a backward against autograd).
:mod:`.plan` says which modules are hooked, with which rule; :mod:`.records` what is kept per
call, forward and backward. The workflows reach the engine through :mod:`.api`, a forward's
tracker through :class:`~.link.TrackerLink`.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor, nn

from .. import _torch
from ..errors import ConfigurationError, ConfigurationTypeError, StateError, listed_names
from ..inert import InertHandle, InertHook, sweep_with
from ..loop import per_example
from ..quantities import _INTERNAL, QUANTITIES, Collector, total_norms
from ..quantities.noise import NoiseScale, noise_scale
from ..rules.fallback import FALLBACK
from ..rules.registry import REGISTRY, Registry
from .accumulation import all_zero, grad_of
from .backprops import KeptBackprops, kept_for
from .backward import BackwardWriter
from .calls import CallLayouts
from .capture import DetachedCalls, runs_call_last_only
from .forward import ForwardCapture
from .link import TrackerLink
from .module_hooks import BackwardHookGuards
from .outputs import LayerOutputs
from .pause import set_enabled
from .plan import (
    Unsupported,
    accumulator_of,
    entry_modules,
    frozen_model,
    fsdp_shards,
    plan_targets,
    refuse_complex,
    refuse_lazy,
    refuse_parameterless,
    refuse_scripted,
    scripted_modules,
    state_key,
    storages_of,
    structure_and_parameters,
)
from .records import Hook, graph_task, leaves_of
from .state import CaptureState
from .verify import CheckReport, Verifier, check_hooks

__all__ = ["Hooks", "add_hooks", "remove_hooks", "hooks_of", "clear_grad1"]

LossReduction = Literal["mean", "sum"]
Capture = Literal["always", "marked"]


class _HandlesOf:
    """``{module: handle}``, holding neither (a handle refers to the modules it hooks: held
    here, it would keep them alive, and they it). A handle lives as long as one of the modules
    it hooks does, whose hooks refer to it (:attr:`Hook.owner`)."""

    def __init__(self) -> None:
        self._refs: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()

    def get(self, module: nn.Module, default: Any = None) -> Any:
        ref = self._refs.get(module)
        found = None if ref is None else ref()
        return default if found is None else found

    def __contains__(self, module: nn.Module) -> bool:
        return self.get(module) is not None

    def __setitem__(self, module: nn.Module, handle: Hooks) -> None:
        self._refs[module] = weakref.ref(handle)

    def __delitem__(self, module: nn.Module) -> None:
        del self._refs[module]

    def values(self) -> list[Hooks]:
        return [h for ref in list(self._refs.values()) if (h := ref()) is not None]


# Models and modules currently hooked, so that hooks are never added twice (which would count
# every gradient twice). Weak both ways: a model dropped with its hooks on (no remove()) is
# garbage collected with its handle, its grad1 and what its calls kept.
_ACTIVE = _HandlesOf()
_HOOKED_MODULES = _HandlesOf()


class _Left(NamedTuple):
    """The ``grad1`` a removed handle left on a parameter whose ``.grad`` its last backward
    added to (:data:`_LEFT`)."""

    param: weakref.ref
    grad: weakref.ref  # that .grad
    rows: tuple  # the settings that give grad1's rows their meaning (batch_dim, loss_reduction)
    depth: int  # the captured backwards grad1 holds (Hooks.accumulated)
    rounded: int | None  # the terms rounded one by one in them, and their scale (the checks')
    terms_scale: Tensor | None


# The grad1 a removed handle left on a parameter whose .grad its last backward added to, so that
# hooks added again go on adding to the grad1 while .grad does (_adopt_grad1), counting the
# backwards it holds on. By id, the parameter and its .grad weak: a parameter that is garbage
# collected takes its entry with it. (Not a WeakKeyDictionary: tensors compare elementwise.)
_LEFT: dict[int, _Left] = {}


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

    ``grad1`` accumulates exactly when ``.grad`` does: a backward adds to it where ``.grad``
    still holds what the backwards before it left (micro-batches, ``retain_graph``), and starts
    it afresh where ``.grad`` was reset (``optimizer.zero_grad()`` / ``model.zero_grad()``,
    either ``set_to_none``); after a reset, a parameter the backward does not reach loses its
    ``grad1`` (zeros where ``.grad`` is zeros). :meth:`clear` starts afresh as a reset does.

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
        keep_backprops: bool = False,
    ) -> None:
        _torch.require()
        quantities = _quantities(quantities)
        unknown = [q for q in quantities if q not in QUANTITIES + _INTERNAL]
        if unknown or not quantities:
            raise ConfigurationError(f"quantities must be some of {QUANTITIES}, got {quantities!r}")
        _checked("loss_reduction", loss_reduction)
        _checked("unsupported", unsupported)
        _checked("registry", registry)
        _checked("verify", verify)
        _checked("keep_backprops", keep_backprops)
        if not isinstance(model, nn.Module):
            raise ConfigurationTypeError(
                f"add_hooks expects an nn.Module, got {type(model).__qualname__}"
            )
        _checked("capture", capture)
        _checked("batch_dim", batch_dim)
        _checked("max_grad1_bytes", max_grad1_bytes)
        shards = fsdp_shards(model)
        targets = plan_targets(model, registry, unsupported, shards)
        # what the parts share (gradhooks.engine.state)
        state = self._state = CaptureState(
            model, loss_reduction=loss_reduction, unsupported=unsupported, registry=registry,
            quantities=quantities, batch_dim=batch_dim, max_grad1_bytes=max_grad1_bytes,
            capture=capture, verify=verify,
        )  # fmt: skip
        state.shards, state.targets = shards, targets
        _note_rule_less(state)
        state.sharded = {id(p) for p in shards.values()}
        # autograd-hacks' layer.activations and layer.backprops_list (keep_backprops=True)
        state.kept_backprops = KeptBackprops() if keep_backprops else None
        self._handles: list = []
        self._target_handles: list = []
        self._module_hooks: list[Hook] = []  # the hooks _install put on the planned modules
        self._storages: list[int | None] = []
        self._key: tuple | None = None  # (the model's state_key when last followed)
        self._in_block = False  # (inside its with block: a second one would end it early)
        # autograd-hacks' backprop_hess: per backward, {id(param): raw per-example gradients}
        self._hessian_backprops: list[dict[int, Tensor]] = []
        # the parts, each with the state and the others it calls
        self._forwards = ForwardCapture(state)
        self._backwards = BackwardWriter(state)
        # (around the user's module backward hooks; a refusal there undoes the backward)
        self._guards = BackwardHookGuards(state, abort=self._backwards.abort)
        self._layouts = CallLayouts(state)
        self._detached_calls = DetachedCalls(state)
        self._verifier = Verifier(state)
        self._connect()
        self._check_not_hooked(model)
        if state.sharded and state.grad1:
            name = next(n for n, p in model.named_parameters() if id(p) in state.sharded)
            raise ConfigurationError(
                f"'{name}' is sharded by FSDP2 (a DTensor): its grad1 would be [batch, *full "
                "shape] on every rank, which is what sharding avoids, so gradhooks does not form "
                "it. Use add_hooks(model, quantities=('norms',)) and "
                "gradhooks.distributed.dp_sgd_step (per-example norms, clipping and noise, the "
                "clipped sum sharded like the parameter)."
            )
        refuse_scripted(model, targets)
        refuse_lazy(model)
        refuse_parameterless(model)
        refuse_complex(model, quantities)
        try:
            self._handles.append(
                model.register_forward_pre_hook(
                    Hook(self._forwards.on_root_pre, owner=self), with_kwargs=True
                )
            )
            self._install(model)
            self._guards.follow(model)
            self._handles.append(
                model.register_forward_hook(
                    Hook(self._forwards.on_root_post, owner=self),
                    with_kwargs=True,
                    always_call=True,
                )
            )
        except BaseException:
            self.remove()  # (nothing left on the model)
            raise
        self._adopt_grad1()
        _ACTIVE[model] = self

    def _rows(self) -> tuple:
        """What the rows of this handle's ``grad1`` mean: its ``batch_dim`` and
        ``loss_reduction``."""
        return (self._state.batch_dim, self._state.loss_reduction)

    def _adopt_grad1(self, pids: Iterable[int] | None = None) -> None:
        """A ``grad1`` already on a parameter (left by hooks removed since, or carried by a
        pickled copy) goes on as ``.grad`` does: where ``.grad`` holds a gradient (hooks added
        around each micro-batch's backward: ``with add_hooks(model): loss.backward()`` in the
        loop), the next captured backward adds to it unless ``.grad`` is reset before; where
        ``.grad`` is ``None`` or zeros (reset since, or a loaded copy), the first captured
        backward replaces it, or deletes it where it does not reach the parameter. So does a
        handle that does not compute ``grad1``, and one after hooks whose last backward did not
        add to ``.grad`` (``torch.autograd.grad``, also where the loop then assigned ``p.grad =
        g``) or after ``.grad`` was replaced by another tensor. ``pids``: only those of the
        covered parameters (the tensors a forward's planning found in the parameters' slots,
        ``torch.func.functional_call``'s), else all, and the frozen ones' too."""
        params = self._state.params
        chosen = params if pids is None else {pid: params[pid] for pid in pids}
        found = [p for _, p in chosen.values() if "grad1" in p.__dict__]
        held = [
            p for p in found
            if p.grad is not None and self._state.grad1 and _left_with(p, self._rows()) is p.grad
        ]  # fmt: skip
        zero = {id(p) for p, z in zip(held, all_zero([p.grad for p in held])) if z}
        kept = {id(p) for p in held} - zero
        adopted = []
        state = self._state
        for p in found:
            if id(p) not in kept:
                state.stale[id(p)] = p
                continue
            state.written[id(p)] = p
            adopted.append(p)
            left = _LEFT[id(p)]
            state.depth[id(p)] = left.depth
            if left.rounded is not None:
                state.rounded[id(p)] = left.rounded
            if left.terms_scale is not None:
                state.terms_scale[id(p)] = left.terms_scale
        if adopted:
            self._state.trail.record(adopted)
        if pids is not None:
            return
        # a frozen parameter's grad1, left from when it was trainable, goes as after a reset
        # (unless another handle keeps it up)
        covered = {pid for h in active_handles() for pid in h._state.params}
        model = self.model
        for p in [] if model is None else model.parameters():
            if not p.requires_grad and "grad1" in p.__dict__ and id(p) not in covered:
                self._state.stale[id(p)] = p

    def _connect(self) -> None:
        """Give each part the others it calls, and the tracker its link to the engine."""
        forwards, backwards, layouts = self._forwards, self._backwards, self._layouts
        detached, verifier = self._detached_calls, self._verifier
        forwards.follow_changes = self._follow_changes
        backwards.hook_dropped = self._hook_dropped
        me = weakref.ref(self)
        forwards.layer_outputs = LayerOutputs(
            lambda module: (h := me()) is not None and _HOOKED_MODULES.get(module) is h
        )
        forwards.layouts, forwards.backwards = layouts, backwards
        forwards.detached_calls, forwards.verifier = detached, verifier
        backwards.verifier = verifier
        layouts.forwards, layouts.backwards = forwards, backwards
        detached.forwards, detached.backwards, detached.layouts = forwards, backwards, layouts
        verifier.backwards = backwards
        state = self._state
        state.link = TrackerLink(
            is_probing=lambda: state.probing,
            nested=detached.nested,
            direct_source=layouts.direct_source,
            direct_reached=backwards.direct_reached,
            unheld=state.unheld.append,
            coupled_reached=verifier.coupled_reached,
            lost_reached=verifier.lost_reached,
            functional_use=forwards.functional_use,
        )

    # -- the settings of add_hooks (read by the parts from the state) --------------------------

    @property
    def loss_reduction(self) -> LossReduction:
        return self._state.loss_reduction  # type: ignore[return-value]

    @loss_reduction.setter
    def loss_reduction(self, value: LossReduction) -> None:
        self._state.loss_reduction = _checked("loss_reduction", value)

    @property
    def batch_dim(self) -> int | str | None:
        return self._state.batch_dim

    @batch_dim.setter
    def batch_dim(self, value: int | str | None) -> None:
        self._state.batch_dim = _checked("batch_dim", value)

    @property
    def max_grad1_bytes(self) -> int | str | None:
        return self._state.max_grad1_bytes

    @max_grad1_bytes.setter
    def max_grad1_bytes(self, value: int | str | None) -> None:
        self._state.max_grad1_bytes = _checked("max_grad1_bytes", value)

    @property
    def capture(self) -> Capture:
        return self._state.capture  # type: ignore[return-value]

    @capture.setter
    def capture(self, value: Capture) -> None:
        self._state.capture = _checked("capture", value)

    @property
    def verify(self) -> bool:
        return self._state.verify

    @verify.setter
    def verify(self, value: bool) -> None:
        self._state.verify = _checked("verify", value)

    @property
    def unsupported(self) -> Unsupported:
        return self._state.unsupported  # type: ignore[return-value]

    @unsupported.setter
    def unsupported(self, value: Unsupported) -> None:
        self._state.unsupported = _checked("unsupported", value)

    @property
    def registry(self) -> Registry:
        return self._state.registry

    @registry.setter
    def registry(self, value: Registry) -> None:
        self._state.registry = _checked("registry", value)

    @property
    def quantities(self) -> tuple[str, ...]:
        return self._state.quantities

    @quantities.setter
    def quantities(self, value: tuple[str, ...]) -> None:
        if _quantities(value) != self._state.quantities:
            raise ConfigurationError(
                f"quantities are chosen when the hooks are added (this handle computes "
                f"{self._state.quantities!r}, not {value!r}): remove the hooks and add them "
                "again with gradhooks.add_hooks(model, quantities=...)"
            )

    def _install(self, model: nn.Module) -> None:
        """Hook every planned module and every trainable parameter they cover."""
        self._state.params: dict[int, tuple[str, nn.Parameter]] = {}  # trainable, covered, unique
        covered = {id(q) for t in self._state.targets for q in t.params.values()}
        for name, p in self._named_parameters(model):
            if p.requires_grad and id(p) in covered and id(p) not in self._state.params:
                self._state.params[id(p)] = (name, p)
        # tensors computed from parameters in the parameters' slots (torch.func.functional_call
        # with fast weights, p - lr * g): grad1 goes on, through the computation, to the
        # tensors autograd gives the gradient (_derived_hook)
        derived = {pid: p for pid, (_, p) in self._state.params.items() if p.grad_fn is not None}
        if derived:
            self._refuse_derived(derived)
            for pid, p in derived.items():
                name = self._state.params[pid][0]
                for leaf in leaves_of(p):
                    if id(leaf) in self._state.params:
                        continue
                    known = name if leaf.shape == p.shape else f"{name} (a tensor it was made from)"
                    self._state.params[id(leaf)] = (known, leaf)
        self._state.numel = sum(p.numel() for _, p in self._state.params.values())
        self._state.scripted = scripted_modules(model)
        handles = self._target_handles
        # (module, our forward hook's id, our forward pre-hooks' ids, to run last)
        self._first_hooks: list[tuple[nn.Module, int, tuple[int, ...]]] = []

        def hook(fn) -> Hook:
            made = Hook(fn, owner=self)
            self._module_hooks.append(made)
            return made

        entries = entry_modules(model, self._state.targets)
        entry_ids = {id(m) for m in entries}
        joined: dict[int, tuple[bool, bool]] = {}  # (pre-hook, forward hook) joined with ours
        for target in self._state.targets:
            m = target.module
            detaches = target.entry.grad_from_grad1 is not None
            forward = self._forwards.forward_hook(target)
            first = None
            if id(m) in entry_ids:
                # A hooked module that may be called on its own: where no hook of its user's
                # runs between its entry's hooks and ours, one pre-hook and one forward hook
                # do the work of both, in the same order (a Python call fewer each)
                pre, post = self._forwards.entry_hooks(m)
                joined[id(m)] = (
                    not _torch.forward_pre_hooks(m),
                    _torch.first_forward_hook(m) is None,
                )
                if joined[id(m)][0]:
                    first = pre
                if joined[id(m)][1]:
                    forward = _forward_then(forward, post)
            # (first among the module's forward hooks: one registered before add_hooks that
            # returns a new output must not hide the output the rule's gradient is taken at)
            handle = m.register_forward_hook(
                hook(forward), with_kwargs=True, always_call=True, prepend=True
            )
            handles.append(handle)
            # (one pre-hook: the entry's, where joined, the call's start, and whether the call
            # runs detached)
            detach = self._detached_calls.detach_steps(target, handle.id) if detaches else None
            enter = self._forwards.enter_hook(target, first, detach)
            pre_handle = m.register_forward_pre_hook(hook(enter), with_kwargs=True)
            handles.append(pre_handle)
            # (our pre-hook last: one registered since, nn.utils.prune's applied again, makes
            # the weight from its parameters before the call, where the tracker sees it; not
            # where ours opens the forward of an entry module, nor where the call may be run by
            # the rule itself, which it is only where no pre-hook of the user's runs after ours:
            # moved after one, ours would run it on what that one changed, outside its graph)
            owned = detaches and runs_call_last_only(target.entry)
            last = () if first is not None or owned else (pre_handle.id,)
            self._first_hooks.append((m, handle.id, last))
        for entry in entries:
            pre_joined, post_joined = joined.get(id(entry), (False, False))
            pre, post = self._forwards.entry_hooks(entry)
            if not pre_joined:
                handles.append(
                    entry.register_forward_pre_hook(hook(pre), with_kwargs=True, prepend=True)
                )
            if not post_joined:
                handles.append(
                    entry.register_forward_hook(hook(post), with_kwargs=True, always_call=True)
                )
        # (held: a leaf's AccumulateGrad node lives while referred to)
        self._state.accumulators.clear()
        for pid, (name, p) in self._state.params.items():
            if pid not in self._state.sharded:  # (FSDP2 gives them no autograd gradient)
                handle = p.register_hook(self._backwards.param_hook(pid, name))
                # (before the user's hooks: it sees autograd's gradient, which they may scale)
                _torch.put_tensor_hook_first(p, handle.id)
                handles.append(handle)
                self._hook_accumulator(pid, name, p)
        for pid, p in derived.items():
            handles.append(p.register_hook(self._derived_hook(pid, weakref.ref(p))))
        for target in self._state.targets:
            _HOOKED_MODULES[target.module] = self
        self._state.hooked = {id(t.module): frozenset(t.params) for t in self._state.targets}
        self._structure, trainable = structure_and_parameters(model, bool(self._state.sharded))
        self._storages = storages_of(trainable)

    def _hook_dropped(self, pids: Iterable[int]) -> set[int]:
        """A backward reached calls of parameters the last planning dropped (a forward since
        theirs put other tensors in their slots: a teacher's ``torch.func.functional_call``
        between the student's forward and its backward), whose own hooks went with the plan
        before: hooked again now, before autograd reaches them, alongside the plan's (whose
        calls the same backward may reach too); the next forward plans for the model as it
        then is. Returns the ids of those frozen since, which are not hooked: autograd
        leaves their ``.grad`` as it was, and so the backward leaves their ``grad1``."""
        state, frozen = self._state, set()
        pending = list(pids)
        while pending:
            pid = pending.pop()
            found = state.dropped.pop(pid, None)
            if found is None or pid in state.params or pid in state.sharded:
                continue
            name, p = found[0], found[1]()
            if p is None:
                continue
            if not p.requires_grad:
                frozen.add(pid)
                continue
            state.params[pid] = (name, p)
            state.numel += p.numel()
            state.rehooked.add(pid)
            handle = p.register_hook(self._backwards.param_hook(pid, name))
            _torch.put_tensor_hook_first(p, handle.id)
            self._target_handles.append(handle)
            self._hook_accumulator(pid, name, p)
            if p.grad_fn is not None:
                # a tensor computed from others in the slot (an earlier functional_call's
                # p + noise, in the same loss as a later one's): its grad1 goes on to the
                # tensors it was made from, as where the plan had it (_install)
                pending.extend(id(q) for q in leaves_of(p))
                handle = p.register_hook(self._derived_hook(pid, weakref.ref(p)))
                self._target_handles.append(handle)
        return frozen

    def _hook_accumulator(self, pid: int, name: str, p: nn.Parameter) -> None:
        """The pre-hook on ``p``'s ``AccumulateGrad`` node (it tells a backward that adds
        into ``.grad`` from one that returns the gradient), in place of the one on its node
        before, if any."""
        node = accumulator_of(p)
        if node is None:
            raise ConfigurationError(
                f"parameter '{name}' ({type(p).__name__} {tuple(p.shape)}) requires grad, but "
                "autograd records nothing through it: it is a tensor left behind by a torch.func "
                "transform (torch.func.functional_call leaves one in place of the parameter of a "
                "module listed under several names, nn.Sequential(*[layer] * 2)), and a backward "
                "of the model fails without gradhooks too. Put the module's nn.Parameter back, "
                "or call functional_call on a copy of the model"
            )
        before = self._state.accumulators.get(pid)
        if before is not None:
            if before[0] is node and before[2] == p.shape:
                return
            before[1].remove()
            if before[0] is node:
                # (``p.data`` set to a tensor of another shape: Hugging Face's
                # resize_token_embeddings. The node, alive while held here, keeps the shape
                # autograd checks its gradient against; let go, torch makes p a new one)
                del self._state.accumulators[pid]
                before = node = None
                node = accumulator_of(p)
        handle = node.register_prehook(self._backwards.accumulate_hook(pid, name))
        self._target_handles.append(handle)
        self._state.accumulators[pid] = (node, handle, p.shape)

    def _follow_storages(self, params: list[nn.Parameter]) -> None:
        """Where a parameter's ``AccumulateGrad`` node may be new since the last forward, it is
        hooked again: its data moved (``p.data`` set: a dtype or device conversion,
        :func:`~gradhooks.engine.plan.storages_of`), or the first parameter's node is not the
        one hooked (a conversion there and back, ``model.half()`` then ``.float()``, whose
        data may land where it was)."""
        now = storages_of(params)
        if now == self._storages:
            self._follow_accumulator()
            return
        self._hook_accumulators()
        self._storages = now

    def _follow_accumulator(self) -> None:
        """The parameters' data where it was (:meth:`_follow_storages`): hooked again where the
        first parameter's ``AccumulateGrad`` node is not the one hooked."""
        first = next(iter(self._state.accumulators.items()), None)
        if first is not None and accumulator_of(self._state.params[first[0]][1]) is not first[1][0]:
            self._hook_accumulators()

    def _hook_accumulators(self) -> None:
        for pid in list(self._state.accumulators):
            name, p = self._state.params[pid]
            self._hook_accumulator(pid, name, p)

    def _follow_changes(self, model: nn.Module | None) -> None:
        """At each forward: where modules were added, swapped or removed, or parameters frozen
        or unfrozen since the hooks were planned, plan them again (a new layer gets ``grad1``
        too); after :meth:`clear`, a parameter that is no longer trainable loses its
        ``grad1``. A forward hook registered since with ``prepend=True`` runs after ours: it
        may return a new output, and the rule's output-gradient is the layer's own; a forward
        pre-hook registered since runs before ours: it may make the weight the call uses from
        the module's parameters (``nn.utils.prune`` applied again), which the tracker follows
        only outside the call."""
        for m, hook_id, pre_ids in self._first_hooks:
            _torch.put_forward_hook_first(m, hook_id)
            _torch.put_forward_pre_hooks_last(m, pre_ids)
        if model is None:
            # the root is gone (a container made in the call, add_hooks(nn.ModuleList([net,
            # head])), held by nothing else), its modules still hooked and called: they keep
            # their plan, which no root is left to change
            return
        key = None if self._state.sharded else state_key(model)
        if key is not None and key == self._key:
            self._follow_accumulator()
            return
        self._guards.follow(model)  # (a module's backward hooks registered since: guarded)
        now, trainable = structure_and_parameters(model, bool(self._state.sharded))
        if now == self._structure:
            if not self._state.sharded:
                self._follow_storages(trainable)
            self._key = key
            return
        if not self._state.sharded:  # parameters swapped (torch.utils.swap_tensors): hooks dropped
            impls = {pid: impl for _, pid, impl in self._structure[1]}
            for p in model.parameters():
                if impls.get(id(p), _torch.tensor_impl(p)) != _torch.tensor_impl(p):
                    _torch.drop_stale_hooks(p)
        if not self._state.shards and any(
            isinstance(m, _torch.fsdp_module_class()) for m in model.modules()
        ):
            raise StateError(
                "the model was sharded with FSDP2 (fully_shard) after add_hooks: the hooks were "
                "planned with its parameters before sharding. Remove them and add them to the "
                "sharded model (add_hooks(model, quantities=('norms',)) after fully_shard)."
            )
        # planned and checked before this plan's hooks come off: a refusal leaves them on
        targets = plan_targets(
            model, self.registry, self.unsupported, self._state.shards, again=True
        )
        for t in targets:
            other = _HOOKED_MODULES.get(t.module)
            if other is not None and other is not self:
                raise StateError(
                    f"module '{t.name}' ({type(t.module).__qualname__}), added after add_hooks, "
                    f"is already hooked by another gradhooks handle ({other!r}); remove those "
                    "hooks first."
                )
        self._refuse_shared(model, targets)
        before = dict(self._state.params)
        for made in self._module_hooks:
            made.dead = True
        self._module_hooks = []
        for h in self._target_handles:
            h.remove()
        self._target_handles = []
        for t in self._state.targets:
            if _HOOKED_MODULES.get(t.module) is self:
                del _HOOKED_MODULES[t.module]
        self._state.targets = targets
        _note_rule_less(self._state)
        self._install(model)
        params = self._state.params
        # (weakly: a layer swapped out goes with its parameters); those an earlier planning
        # dropped stay while alive: a third functional_call in one loss replans again before
        # the backward reaches the first's calls
        self._state.dropped = {
            pid: found
            for pid, found in self._state.dropped.items()
            if pid not in params and found[1]() is not None
        }
        self._state.dropped.update(
            (pid, (name, weakref.ref(p))) for pid, (name, p) in before.items() if pid not in params
        )
        # tensors new in the slots (functional_call's, with hooks added around each
        # micro-batch) go on from the grad1 earlier hooks left them, as the parameters do
        state = self._state
        self._adopt_grad1(
            pid for pid in params
            if pid not in before and pid not in state.written and pid not in state.stale
        )  # fmt: skip
        self._state.rehooked = set()
        if self._state.collector is not None:
            for name, p in self._named_parameters(model):
                self._state.collector.names.setdefault(id(p), name)
        if not self._state.written:  # (cleared since the last backward)
            for pid, (_, p) in before.items():
                if pid not in self._state.params and hasattr(p, "grad1"):
                    del p.grad1
        self._key = key

    def _refuse_derived(self, derived: dict[int, Tensor]) -> None:
        """Per-example gradients pass through a computation in a parameter's slot as
        ``grad1`` only: the other quantities are formed from the slot's pieces, which are
        not the gradients of the tensors it was computed from."""
        if self.quantities != ("grad1",) or self._state.sharded:
            name = self._state.params[next(iter(derived))][0]
            raise ConfigurationError(
                f"'{name}' holds a tensor computed from other tensors (torch.func.functional_call "
                f"with weights such as p - lr * g), not a parameter: quantities "
                f"{self.quantities!r} of its pieces are not those of the tensors autograd gives "
                "its gradient. Use add_hooks(model, quantities=('grad1',)) and form them from "
                "grad1, or pass leaf tensors (p.detach().requires_grad_()) to functional_call."
            )

    def _derived_hook(self, pid: int, ref: weakref.ref):
        """When the backward has the whole gradient of a tensor computed from parameters that
        stands in a parameter's slot (:meth:`_install`), each example's share of it, its
        ``grad1`` of this backward, is taken back through the computation to the tensors it
        was computed from (one batched backward, ``is_grads_batched``): their ``grad1``.
        Fast weights ``p - lr * g`` with ``g`` detached give ``p`` the slot's own."""
        me = weakref.ref(self)  # (torch holds the hook, where the garbage collector cannot
        # see it: a strong reference would keep the model alive with its hooks)

        def hook(grad: Tensor | None) -> None:
            handle = me()
            if handle is not None:
                handle._derived_grad(pid, ref, grad)

        return hook

    def _derived_grad(self, pid: int, ref: weakref.ref, grad: Tensor | None) -> None:
        """:meth:`_derived_hook`'s work, for the handle whose hook it is."""
        if (
            grad is None
            or self._state.removed
            or not self._state.mode.capture
            or self._state.rerunning
        ):
            return
        t = ref()
        bw = self._state.tasks.get(graph_task())
        if t is None or bw is None or not self._state.capturing_backward():
            return
        g1 = self._backwards.grad1_of_backward(bw, pid, t)
        if g1 is None:
            return
        leaves = [q for q in leaves_of(t) if id(q) in self._state.params]
        edge = torch.autograd.graph.get_gradient_edge(t)
        create_graph = torch.is_grad_enabled()
        with self._detached_calls.nested():
            try:
                grads = torch.autograd.grad(
                    [edge], leaves, g1, retain_graph=True, allow_unused=True,
                    is_grads_batched=True, create_graph=create_graph,
                )  # fmt: skip
            except RuntimeError as e:  # (an operation vmap cannot batch): one at a time
                if isinstance(e, (ValueError, TypeError)):
                    raise  # a refusal of gradhooks' own (UnsupportedInputError, ...)

                def one(b: int) -> tuple:
                    return torch.autograd.grad(
                        [edge], leaves, g1[b], retain_graph=True, allow_unused=True,
                        create_graph=create_graph,
                    )  # fmt: skip

                grads = tuple(per_example(g1.shape[0], one, like=leaves))
        for q, g in zip(leaves, grads):
            if g is None:
                continue
            qid = id(q)
            bw.reached.add(qid)
            self._backwards.restart_for_forward(bw, q, self._state.forward_of.get(pid))
            if qid not in bw.before:
                bw.before[qid] = q.grad1 if qid in self._state.written else None
            self._backwards.accumulate(self._state.params[qid][0], q, g)
            self._state.written[qid] = q

    def _named_parameters(self, model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
        """``model.named_parameters()`` with the parameters the hooks were planned with: where
        FSDP2 holds a stand-in in a sharded parameter's slot (its unsharded parameter while a
        call runs, and at the root from the forward to the backward, or one resharded after
        the forward on a smaller mesh), the sharded parameter."""
        for name, p in model.named_parameters():
            yield name, self._state.shards.get(name, p)

    # -- public -------------------------------------------------------------------------------

    @property
    def model(self) -> nn.Module | None:
        return self._state.model_ref()

    @property
    def active(self) -> bool:
        return not self._state.removed

    def modules(self) -> Iterator[tuple[str, nn.Module]]:
        """The hooked modules, by qualified name."""
        for t in self._state.targets:
            yield t.name, t.module

    def fallback_modules(self) -> Iterator[tuple[str, nn.Module]]:
        """The modules without a rule whose ``grad1`` the ``torch.func`` fallback computes
        (``unsupported="fallback"``), by qualified name."""
        for t in self._state.targets:
            if t.entry is FALLBACK:
                yield t.name, t.module

    def clear(self) -> None:
        """Start a new accumulation: the next backward replaces ``grad1`` instead of adding to
        it, and a parameter it does not reach loses its ``grad1``, as after
        ``optimizer.zero_grad()`` (which is all an ordinary training loop needs). The current
        ``grad1`` tensors stay readable until then (those of a backward that failed half way
        are put back as they were before it)."""
        if graph_task() == -1:
            self._backwards.drop_stale()
        self._state.stale.update(self._state.written)
        self._state.written.clear()
        self._state.trail.clear()
        self._state.depth.clear()
        self._state.aside.clear()
        self._state.missed.clear()
        self._state.precision = None
        self._state.shared_inputs.clear()
        self._state.rounded.clear()
        self._state.terms_scale.clear()
        self._hessian_backprops.clear()
        if self._state.kept_backprops is not None:
            self._state.kept_backprops.clear()
        if self._state.collector is not None:
            self._state.collector.clear()

    def activations(self, module: nn.Module) -> Tensor | None:
        """autograd-hacks' ``module.activations``: the first positional input of the last call
        of ``module`` in the forward that the last captured backward reaching it went through,
        detached (``None`` where that input is not a tensor). Needs ``add_hooks(..., keep_backprops=True)``; see
        :mod:`gradhooks.engine.backprops`."""
        return kept_for(
            self._state.kept_backprops, self._state.targets, module, "activations"
        ).activations(module)

    def backprops(self, module: nn.Module) -> list[Tensor | None]:
        """autograd-hacks' ``module.backprops_list``: the gradient of the loss with respect to
        ``module``'s (first) output, one per call of it that a captured backward reached since
        :meth:`clear`, in that order, detached (``None`` where none flowed). For a
        mean-reduced loss each holds the ``1/batch`` of the mean. Needs
        ``add_hooks(..., keep_backprops=True)``."""
        return kept_for(
            self._state.kept_backprops, self._state.targets, module, "backprops"
        ).backprops(module)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Within the block this handle captures nothing: forwards are not kept and backwards
        write no ``grad1`` (other handles are not affected). For backwards that are not the
        training loss: derivatives for a Laplacian or an input-gradient, or differentiating a
        function of ``grad1`` after a ``create_graph=True`` backward."""
        with self._state.pause():
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
        self._state.marked += 1
        try:
            yield
        finally:
            self._state.marked -= 1

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
        really used. Returns a :class:`gradhooks.CheckReport`. After :meth:`remove`, a
        ``StateError``: what the hooks captured went with them.
        """
        if self._state.removed:
            raise StateError(
                "check: the hooks are removed, and with them what their last backward captured "
                "(a backward since, if any, wrote no grad1: the grad1 on the parameters is "
                "still that of the last backward before remove()): call check before remove(), "
                "or add the hooks again before the next forward"
            )
        return check_hooks(
            self._state, loss_fn, inputs, target, examples=examples, raise_on_error=raise_on_error
        )

    def rescale(self, loss_reduction: LossReduction) -> None:
        """Declare that the captured backward used ``loss_reduction`` after all, rescaling the
        ``grad1`` of the current accumulation (since the last ``zero_grad`` or :meth:`clear`;
        what autograd-hacks' ``compute_grad1`` ``loss_type`` says), the last backward's norms,
        squared sums and gradient variance, and the K-FAC factors, and use it for later
        backwards."""
        if loss_reduction not in ("mean", "sum"):
            raise ConfigurationError(
                f"rescale: loss_reduction (compute_grad1's loss_type) must be 'mean' or 'sum', "
                f"got {loss_reduction!r}"
            )
        if self._state.removed:
            raise StateError(
                "rescale: the hooks are removed, and with them what the last backward wrote, so "
                "the grad1 left on the parameters would stay as it is: call rescale (or "
                "compute_grad1) before remove()"
            )
        if loss_reduction == self.loss_reduction:
            return
        collector = self._state.collector
        kfac = None if collector is None else collector.kfac
        mixed = [] if kfac is None else kfac.mixed_batches()
        if mixed:
            raise StateError(
                f"rescale: the K-FAC factors of {', '.join(map(repr, mixed))} sum backwards of "
                "batches of different sizes, each scaled by its own batch, so no one factor "
                f"rescales them: call h.clear(), set h.loss_reduction = {loss_reduction!r} and "
                "run the backwards again"
            )
        for p in self._state.written.values():
            batch = p.grad1.shape[0]
            if loss_reduction == "sum":  # it was computed as mean (times batch): undo
                p.grad1.div_(max(batch, 1))
            else:
                p.grad1.mul_(batch)
        if collector is not None:  # (the norms, squared sums and K-FAC factors alike)
            collector.rescale(_rescaling(loss_reduction))
        self.loss_reduction = loss_reduction

    @property
    def captured(self) -> bool:
        """Whether a backward has written ``grad1`` since the hooks were added or cleared."""
        return bool(self._state.written)

    @property
    def accumulated(self) -> int:
        """How many captured backwards ``grad1`` holds the sum of (the most over parameters;
        0 before any): 1 after each ``zero_grad()``, forward and backward, ``k`` after ``k``
        micro-batches without ``zero_grad`` (or a ``retain_graph`` backward run ``k`` times)."""
        return max((self._state.depth.get(pid, 1) for pid in self._state.written), default=0)

    # -- quantities other than grad1 (add_hooks(..., quantities=...)) -------------------------
    # Of the last backward (each backward replaces them), except kfac_factors, which accumulate
    # until clear(). All are of the per-example losses' own gradients (as grad1 is).

    def param_norms(self) -> dict[str, Tensor]:
        """Per-example gradient norms per parameter, ``{name: [batch]}`` (``"norms"``).
        ``norms[name][i] == p.grad1[i].norm()``, computed without forming ``grad1``; a reused
        module's calls and a tied weight's users are summed before the norm is taken."""
        return {
            n: v.sqrt() for n, v in self._results("norms", published=True).param_sq_norms.items()
        }

    def norm_forms(self) -> dict[str, str]:
        """How the last backward formed each parameter's per-example norm (``"norms"``),
        ``{name: form}``, chosen per parameter by cost:

        - ``"outer"``: one position per example, ``‖g‖·‖a‖`` (Goodfellow);
        - ``"gram"``: several positions ``T``, from the two ``[T, T]`` Gram matrices of the
          layer's inputs and output-gradients, ``T²·(in + out)`` per example (it rounds
          relative to the positions' own gradients: on the CPU, an example whose gradient
          they cancel to below that rounding is formed from ``grad1`` again);
        - ``"materialized"``: ``grad1`` formed a slice of the batch at a time, ``T·in·out`` per
          example, where that is cheaper than the Gram form;
        - ``"direct"``: the rule gives ``grad1`` itself (a bias, a norm layer's scale);
        - ``"rows"``: an embedding's looked-up rows, never the whole table.
        """
        return dict(self._results("norms", published=True).norm_forms)

    def norms(self) -> Tensor:
        """Per-example norm of the whole model's gradient, ``[batch]`` (``"norms"``), of the
        last backward (each backward replaces them; they do not accumulate as ``grad1``)."""
        c = self._results("norms", published=True)
        if not c.param_sq_norms:
            raise StateError(
                "no backward has been captured since the hooks were added or cleared"
                + frozen_model(self.model)
            )
        if c.missed:
            names = ", ".join(f"'{n}'" for n in c.missed[:5])
            raise StateError(
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
        return dict(self._results("sum_grad_sq", published=True).sum_grad_sq)

    def grad_variance(self) -> dict[str, Tensor]:
        """Per-example gradient variance per parameter, ``{name: [*p.shape]}``
        (``"sum_grad_sq"``): ``mean_i grad1[i]² - (mean_i grad1[i])²`` (population variance,
        clamped at 0). The mean of a Linear on ``[batch, features]`` or of an Embedding, where
        its input and output-gradient (its lookups' gradients) take no more memory than the
        mean, is formed by the first call, from those kept until then; only
        :meth:`sum_grad_sq` asked for, it is never formed."""
        c = self._results("sum_grad_sq", published=True)
        batch = max(c.batch or 0, 1)
        means = {n: m() if callable(m) else m for n, m in c.grad_mean.items()}  # (formed now)
        return {n: (sq / batch - means[n] ** 2).clamp_min(0) for n, sq in c.sum_grad_sq.items()}

    def noise_scale(self) -> NoiseScale:
        """The gradient noise scale of the last backward's batch (``"sum_grad_sq"``):
        unbiased estimates of the trace of the per-example gradients' covariance ``tr(Σ)``,
        of the true gradient's squared norm ``|G|²`` and their ratio ``B_simple`` (McCandlish
        et al., 2018), over every parameter; see :mod:`gradhooks.quantities.noise`. Average
        ``trace`` and ``grad_sq`` over steps before dividing."""
        c = self._results("sum_grad_sq", published=True)
        if not c.sum_grad_sq:
            raise StateError(
                "no backward has been captured since the hooks were added or cleared"
                + frozen_model(self.model)
            )
        means = {n: m() if callable(m) else m for n, m in c.grad_mean.items()}
        return noise_scale(c.sum_grad_sq, means, c.batch or 0)

    def kfac_factors(self, reduction: LossReduction = "mean") -> dict:
        """K-FAC factors ``{weight_name: KFactors(A, G, bias)}`` accumulated since the last
        :meth:`clear` (``"kfac"``); conventions in :mod:`gradhooks.workflows.kfac`. Over several
        backwards of one forward (your own sampled labels, or the columns of a loss Hessian's
        square root), ``G`` sums them; ``"mean"`` then divides by the examples of every
        backward, which averages over the backwards (right for samples; for columns, multiply
        by their number, or use :func:`gradhooks.kfac`, which sums them)."""
        return self._results("kfac", published=True).kfac.factors(reduction)

    def _results(self, quantity: str, published: bool = False) -> Collector:
        """The collector of ``quantity``; with ``published`` (what the public readers ask),
        refused where it holds no backward's results (read before the backward, or after
        :meth:`clear`: an empty dict read as "nothing to report")."""
        if self._state.collector is None or quantity not in self.quantities:
            raise StateError(
                f"this handle does not compute {quantity!r} (quantities={self.quantities!r}): "
                f"add_hooks(model, quantities=({quantity!r}, ...))"
            )
        unreached = self._state.collector.unreached
        if published and unreached and quantity != "kfac":  # (kfac sums until clear())
            raise StateError(
                f"the last backward computed the gradient of {listed_names(unreached)} but "
                "reached none of the model's captured calls (its loss used the outputs "
                "detached, or only the parameters themselves: a weight penalty), so it has "
                f"no {quantity!r}; the last captured backward's were not kept for it. Run the "
                "forward and the backward through the model's modules" + frozen_model(self.model)
            )
        if published and not self._state.collector.published:
            raise StateError(
                f"no backward has been captured since the hooks were added or cleared, so there "
                f"is no {quantity!r} to read: run the forward and the backward with the hooks on "
                "first" + frozen_model(self.model)
            )
        return self._state.collector

    def remove(self) -> None:
        """Remove every hook. Idempotent. ``grad1`` stays on the parameters (like ``.grad``);
        :func:`clear_grad1` deletes it."""
        if self._state.removed:
            return
        self._state.removed = True
        for p in self._state.written.values():
            if grad_of(p) is not None and self._state.trail.added_last(p):
                _leave(p, self._rows(), self._state)
        for h in (*self._handles, *self._target_handles):
            h.remove()
        self._handles.clear()
        self._target_handles.clear()
        self._guards.remove()
        self._forwards.layer_outputs.remove()
        self._state.accumulators.clear()
        model = self.model
        if model is not None and _ACTIVE.get(model) is self:
            del _ACTIVE[model]
        for t in self._state.targets:
            if _HOOKED_MODULES.get(t.module) is self:
                del _HOOKED_MODULES[t.module]
        self._state.written.clear()
        self._state.stale.clear()
        self._state.trail.clear()
        self._state.depth.clear()
        self._state.forward_of.clear()
        self._state.unheld.clear()
        self._verifier.drop_boxes()
        for frame in self._state.frames[::-1]:
            self._forwards.stop_tracker(frame)
        self._state.frames.clear()
        self._state.tasks.clear()
        for stack in self._state.detached.values():  # removed during a forward
            for call in stack[::-1]:
                call.close()
        self._state.detached.clear()
        self._state.aliases_checked.clear()
        if self._state.collector is not None:
            self._state.collector.discard_backward()
            self._state.collector._expected = {}

    def __reduce__(self):
        """A model that holds its handle as an attribute deep-copies and pickles: in the copy,
        the handle is an :class:`~gradhooks.inert.InertHandle` (the copy is not hooked)."""
        model = self.model
        return (InertHandle, (type(model).__qualname__ if model is not None else "a model",))

    def __enter__(self) -> Hooks:
        if self._state.removed:  # (its block would capture nothing, and say nothing)
            raise StateError(
                "this handle's hooks were removed (at the end of its with block, or by "
                "remove()), so a with block on it would capture nothing and leave the grad1 "
                "of before: add them again, with gradhooks.add_hooks(model) as h: ..."
            )
        if self._in_block:  # (the inner block's end would remove the hooks of the outer's)
            raise StateError(
                f"this handle ({self!r}) is already inside its with block: a second with block "
                "on it would remove the hooks at its end, and the rest of the outer block "
                "would capture nothing; drop the inner with (use h.paused() or h.capturing() "
                "for a part of the block)"
            )
        self._in_block = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._in_block = False
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self._state.removed else f"{len(self._state.targets)} modules"
        return f"Hooks({state}, loss_reduction={self.loss_reduction!r})"

    # -- internals ----------------------------------------------------------------------------

    def _check_not_hooked(self, model: nn.Module) -> None:
        if model in _ACTIVE:
            raise StateError(
                f"{type(model).__qualname__} already has gradhooks hooks ({_ACTIVE.get(model)!r}); "
                "adding them again would count every gradient twice. Call "
                "gradhooks.remove_hooks(model) first, or keep using the existing handle."
            )
        for t in self._state.targets:
            if t.module in _HOOKED_MODULES:
                raise StateError(
                    f"module '{t.name}' ({type(t.module).__qualname__}) is already hooked by "
                    f"another gradhooks handle ({_HOOKED_MODULES.get(t.module)!r}), on a model "
                    "that contains this one or on one of its submodules; remove those hooks "
                    "first (that handle's remove()), or keep using that handle."
                )
        self._refuse_shared(model, self._state.targets)

    def _refuse_shared(self, model: nn.Module, targets: list) -> None:
        """A trainable parameter of ``targets`` that another live handle covers (a layer's
        weight assigned to a layer of a second hooked model): each handle sees only its own
        model's calls, so neither could give the parameter's per-example gradient (each
        dropped it with a warning, or stopped the backward at its check, blaming a use it
        did not see)."""
        others = {id(h): h for h in _HOOKED_MODULES.values() if h is not self}
        theirs = {
            pid: (name, h) for h in others.values() for pid, (name, _) in h._state.params.items()
        }
        if not theirs:
            return
        for t in targets:
            for local, p in t.params.items():
                if not p.requires_grad or id(p) not in theirs:
                    continue
                name = next((n for n, q in self._named_parameters(model) if q is p), local)
                other_name, other = theirs[id(p)]
                raise StateError(
                    f"parameter '{name}' {tuple(p.shape)} of module {t.where} is also "
                    f"'{other_name}' of a model hooked by another gradhooks handle ({other!r}): "
                    "each handle sees only its own model's calls, so neither could give its "
                    "per-example gradient. Hook one module that holds both models, "
                    "gradhooks.add_hooks(nn.ModuleList([model_a, model_b])) (their backwards "
                    "then write one grad1), or remove the other handle's hooks first, or freeze "
                    "the parameter (requires_grad_(False))."
                )


def _leave(p: Tensor, rows: tuple, state: CaptureState) -> None:
    def forget(ref: weakref.ref, key: int = id(p)) -> None:
        found = _LEFT.get(key)
        if found is not None and found.param is ref:
            del _LEFT[key]

    pid = id(p)
    _LEFT[pid] = _Left(
        weakref.ref(p, forget), weakref.ref(p.grad), rows, state.depth.get(pid, 1),
        state.rounded.get(pid), state.terms_scale.get(pid),
    )  # fmt: skip


def _left_with(p: Tensor, rows: tuple) -> Tensor | None:
    """The ``.grad`` a removed handle left ``p`` with, after a backward that added to it, where
    its ``grad1``'s rows mean what they mean to a handle of settings ``rows`` (another
    ``batch_dim`` reads other rows, another ``loss_reduction`` scales them otherwise: such a
    ``grad1`` is never added to)."""
    found = _LEFT.get(id(p))
    if found is None or found.param() is not p or found.rows != rows:
        return None
    return found.grad()


def _checked(name: str, value: Any) -> Any:
    """``value`` for setting ``name`` of :func:`add_hooks` (or of a handle, later), refused where
    it is not one the setting takes: a setting taken as another (``loss_reduction="avg"`` as
    "sum", ``batch_dim=True`` as 1) would give grad1 silently wrong."""
    if name == "loss_reduction" and value not in ("mean", "sum"):
        raise ConfigurationError(f"loss_reduction must be 'mean' or 'sum', got {value!r}")
    if name == "unsupported" and value not in ("fallback", "error", "skip"):
        raise ConfigurationError(
            f"unsupported must be 'fallback', 'error' or 'skip', got {value!r}"
        )
    if name == "capture" and value not in ("always", "marked"):
        raise ConfigurationError(f"capture must be 'always' or 'marked', got {value!r}")
    if name == "batch_dim" and value not in (None, "auto") and not _whole(value):
        raise ConfigurationError(f"batch_dim must be 'auto', an int >= 0 or None, got {value!r}")
    if name in ("verify", "keep_backprops") and not isinstance(value, bool):
        raise ConfigurationTypeError(
            f"{name} takes True or False, got {type(value).__qualname__} {value!r}"
        )
    if name == "registry" and not isinstance(value, Registry):
        raise ConfigurationTypeError(
            f"registry must be a gradhooks.Registry (gradhooks.REGISTRY, or one of your own), "
            f"got {type(value).__qualname__}"
        )
    if name == "max_grad1_bytes" and not (value in (None, "auto") or _whole(value)):
        raise ConfigurationError(
            f"max_grad1_bytes must be bytes (an int >= 0), 'auto' or None, got {value!r}"
        )
    return value


def _quantities(value: Any) -> tuple[str, ...]:
    """``add_hooks``' ``quantities`` as a tuple: one name, or an iterable of names, each
    once (a name given twice, ``("grad1", "grad1")``, is the handle of ``("grad1",)``)."""
    if isinstance(value, str):
        return (value,)
    try:
        return tuple(dict.fromkeys(value))
    except TypeError:
        raise ConfigurationTypeError(
            f"quantities takes a name or a tuple of names of {QUANTITIES}, got "
            f"{type(value).__qualname__} {value!r}"
        ) from None


def _whole(value: object) -> bool:
    """An int >= 0 that is not a bool (``True`` is an int to Python, not a dimension)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


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
    keep_backprops: bool = False,
) -> Hooks:
    """Hook ``model`` so that every ``backward()`` writes ``param.grad1``.

    Args:
        model: any ``nn.Module``.
        loss_reduction: ``"mean"`` when the loss is the mean of per-example losses (the default
            of torch losses), ``"sum"`` when it is their sum. ``grad1[i]`` is the gradient of
            example ``i``'s own loss in both cases.
        unsupported: what to do with a module that has trainable parameters and no rule.
            ``"fallback"`` (default): compute its per-example gradients with ``torch.func``
            from the captured call (:mod:`gradhooks.rules.fallback`; slower than a rule, see
            :meth:`Hooks.fallback_modules`). ``"error"``: raise, before anything is hooked.
            ``"skip"``: leave its parameters without ``grad1``.
        registry: the rules to use (default: the built-in registry).
        quantities: what each backward computes, any of ``"grad1"`` (``param.grad1``),
            ``"norms"`` (:meth:`Hooks.norms`, :meth:`Hooks.param_norms`), ``"sum_grad_sq"``
            (:meth:`Hooks.sum_grad_sq`, :meth:`Hooks.grad_variance`) and ``"kfac"``
            (:meth:`Hooks.kfac_factors`). Without ``"grad1"`` no per-example gradient of the
            whole model is ever formed.
        batch_dim: where the examples are. ``"auto"`` (default): dimension 0 of the model's
            first tensor input (a ``PackedSequence``: its first batch size), and of every
            other tensor input of that size unless only that would make it mix the examples
            (a mask as long as the batch); a 1-D first input that the first hooked layer
            cuts into examples itself (``nn.EmbeddingBag``'s tokens and ``offsets``): the rows
            of that layer's output; an int ``k``: dimension ``k`` of the first tensor
            input (a sequence-first model: ``batch_dim=1``; also checks the memory limit at
            the forward). From there the batch is followed through the forward: a layer that
            sees the examples folded into its batch (``x.view(B * T, ...)``: each example's
            rows are summed) or on another dimension (moved) is right; a layer whose input
            was computed across the batch is an error naming the layer and the shapes.
            Sequences packed along one dimension without padding (a ``cu_seqlens``,
            ``cu_seq_lens_q/k`` or ``seq_idx`` input; ``position_ids`` that start again within
            a row, with no ``attention_mask``: ``DataCollatorWithFlattening``) are refused
            before the forward runs: give a padded batch. ``None``: nothing is followed, and ``grad1`` has a row per entry of each layer's
            dimension 0.
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
            The check runs backwards of autograd's own through the model's graph (two; three
            without ``"grad1"``), from its output-gradients weighted per example, in which a
            gradient hook put on an activation during the forward (``h.register_hook``) runs
            again, so that what it does to the examples' gradients is checked too (a hook that
            mixes them is refused): on a backward that verifies, such a hook runs three times
            (four without ``"grad1"``), on every other backward once; the ``.grad`` of a tensor
            whose gradient is retained (``retain_grad()`` in the forward, or on an output) is
            put back as autograd alone leaves it. Backward hooks of the user's on modules (also
            global ones) and on parameters run once on every backward: where there are any,
            that part of the check is left out. ``verify=False``: every hook runs once per
            backward.
        keep_backprops: keep, per hooked module, the input of its last captured call and
            the output-gradient of each captured call, for :meth:`Hooks.activations` and
            :meth:`Hooks.backprops` (autograd-hacks' ``layer.activations`` and
            ``layer.backprops_list``), until :meth:`Hooks.clear`: the memory of those tensors.

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
        capture=capture, verify=verify, keep_backprops=keep_backprops,
    )  # fmt: skip
    set_enabled(True)  # (as autograd-hacks' add_hooks undoes its disable_hooks)
    return hooks


def active_handles() -> list[Hooks]:
    """Every handle whose hooks are on a model now."""
    return [h for h in list(_ACTIVE.values()) if h.active]


def hooks_of(model: nn.Module) -> Hooks:
    """The active handle of a hooked model (raises if it has none)."""
    require_module(model, "hooks_of")
    found = _ACTIVE.get(model)
    if found is None and _is_copy_of_hooked(model):
        raise ConfigurationError(
            f"{type(model).__qualname__} has no gradhooks hooks: it is a copy of a hooked model "
            "(copy.deepcopy, pickle, or torch.save(model) then torch.load), and a copy is not "
            "hooked (autograd-hacks' hooks travel with a saved model, gradhooks' do not), or the "
            "hooks it was given since were removed. Hook it: gradhooks.add_hooks(model)"
        )
    if found is None:
        raise ConfigurationError(
            f"{type(model).__qualname__} has no gradhooks hooks: call gradhooks.add_hooks(model) "
            "first (or it was already removed)"
        )
    return found


def _is_copy_of_hooked(model: nn.Module) -> bool:
    """Whether ``model`` carries the inert hooks a hooked model's copy is left with."""
    return any(
        isinstance(hook, InertHook) for m in model.modules() for hook in _torch.forward_pre_hooks(m)
    )


def require_module(model: Any, where: str) -> None:
    """Refuse what is not a model (a parameter list, a name, a handle) given to ``where``."""
    if not isinstance(model, nn.Module):
        raise ConfigurationTypeError(
            f"{where} takes the model (an nn.Module), got {type(model).__qualname__}"
        )


def remove_hooks(model: nn.Module) -> None:
    """Remove the hooks :func:`add_hooks` put on ``model``. ``grad1`` stays on the parameters."""
    require_module(model, "remove_hooks")
    hooks_of(model).remove()


def drop_uncovered_grad1(module: nn.Module) -> None:
    """Delete ``grad1`` from every parameter of ``module`` that no active handle covers (what
    :class:`gradhooks.inert.InertHook` does in a copy of a hooked model)."""
    covered = {pid for h in active_handles() for pid in h._state.params}
    for p in module.parameters():
        if id(p) not in covered:
            p.__dict__.pop("grad1", None)


sweep_with(drop_uncovered_grad1)


def _rescaling(loss_reduction: LossReduction) -> Callable[[int], float]:
    """What ``Hooks.rescale(loss_reduction)`` multiplies a backward's per-example gradients by,
    given its batch size: ``1/batch`` for ``"sum"`` (the engine scaled them by the batch, for
    a mean), the batch for ``"mean"``."""
    if loss_reduction == "sum":
        return lambda batch: 1.0 / max(batch, 1)
    return float


def clear_grad1(model: nn.Module) -> None:
    """Delete ``grad1`` from every parameter of ``model`` (a handle on it then starts afresh,
    as after :meth:`Hooks.clear`)."""
    require_module(model, "clear_grad1")
    hooks = _ACTIVE.get(model)
    if hooks is not None:
        hooks.clear()
    for p in model.parameters():
        if hasattr(p, "grad1"):
            del p.grad1


def _note_rule_less(state: CaptureState) -> None:
    """Tell K-FAC which hooked modules have no rule (the fallback's; the model itself, whose
    own parameters it covers, aside): their weights get no factors, which it lists."""
    kfac = None if state.collector is None else state.collector.kfac
    if kfac is not None:
        kfac.without_rule = frozenset(
            t.name for t in state.targets if t.entry is FALLBACK and t.name
        )


def _forward_then(first, then):
    """One forward hook (run always) that runs ``first``, then ``then`` on the output
    ``first`` gives, as two such hooks would run: ``then`` also where ``first`` raises (torch
    runs the remaining hooks that are run always, and turns their errors into warnings)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        try:
            found = first(module, args, kwargs, output)
        except BaseException:
            try:
                then(module, args, kwargs, output)
            except Exception as e:
                warnings.warn(f"forward hook failed after another hook raised: {e}", stacklevel=2)
            raise
        then(module, args, kwargs, output if found is None else found)
        return found

    return hook

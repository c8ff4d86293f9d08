"""Calls whose parameters autograd does not see: run detached (the batch gradient taken from
``grad1``, a rule's ``grad_from_grad1``; the forward's tracker hands each torch function of the
call detached aliases of the parameters, :attr:`gradhooks.tracking.Tracker.aliases`, or a mode of
the call's own where no tracker follows it: :func:`hand_over`), run with
grad mode off (a rule with ``owns_backward``,
which gives the inputs' gradients itself), or with the parameters carried by the first input
(a rule with ``taps``, which reads nodes inside the call). :class:`DetachedCalls` is the part of a
:class:`gradhooks.Hooks` that runs them; autograd reaches the parameters again through the
``autograd.Function`` nodes below.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor, nn

from .. import _torch
from .._torch import tree_flatten, tree_map
from ..autocast import autocast_as
from ..errors import UnsupportedError
from ..rules.registry import Call
from ..tracking import Aliases, Tracker
from .backward import BackwardWriter
from .calls import CallLayouts, Held, check_parameter_versions
from .plan import Target
from .records import (
    CallState,
    Hook,
    autocast_off,
    detach_tree,
    is_compiling,
    tree_leaves,
    with_fields,
)
from .state import CaptureState


class _Sums(dict):
    """The batch gradients a call's rule gives (:meth:`BackwardWriter._backward` fills it), for the
    parameters in ``names`` only."""

    def __init__(self, names) -> None:
        super().__init__()
        self.names = frozenset(names)


@dataclass
class _Carried:
    """A call run with its parameters detached whose rule has ``taps`` (see
    :meth:`DetachedCalls.detach_steps`): the parameters are attached to its first input through a
    :class:`_Join` node, whose backward runs after every node of the call, so after the rule.
    Never holds a tensor of the call's own graph (a cycle through autograd's graph)."""

    target: Target
    detached: dict[str, nn.Parameter]
    input: Tensor  # the carried input, as the caller passed it
    args: tuple  # as the caller passed them (the input not yet carried)
    kwargs: dict
    sums: _Sums
    outputs: tuple | None = None  # the call's output-gradients, once the backward has them


@dataclass
class DetachedCall:
    """A call running now with its parameters detached: pushed by
    :meth:`DetachedCalls.detach_steps` before the call, popped by :meth:`DetachedCalls.reattach`
    at its end (or by :meth:`gradhooks.Hooks.remove` during it)."""

    module: nn.Module
    detached: dict[str, nn.Parameter]  # the parameters detached, by name in the module
    owned: tuple[tuple, dict] | None  # (args, kwargs) where it runs with grad mode off
    carried: _Carried | None  # where its first input carries the parameters
    recording: tuple[Any, Any] | None  # its rule's owns_backward manager and what it gave
    undo: Callable[[], None] | None  # puts back what hand_over did

    def close(self, exc: tuple = (None, None, None)) -> Any:
        """End what the call's start opened (the aliases handed over, grad mode, the rule's
        recording); returns what the recording gave, or ``None``."""
        if self.undo is not None:
            self.undo()
        if self.owned is not None:
            torch.set_grad_enabled(True)  # (it was on: detach_steps)
        if self.recording is None:
            return None
        manager, recorded = self.recording
        manager.__exit__(*exc)
        return recorded


class Reattached(NamedTuple):
    """What :meth:`DetachedCalls.reattach` gives back at the end of a call."""

    detached: dict[str, nn.Parameter]
    owned: tuple[tuple, dict] | None
    carried: _Carried | None
    recorded: Any  # what the rule's owns_backward recording gave


class _Join(torch.autograd.Function):
    """``_Join.apply(backward, n, *tensors)``: the first ``n`` of ``tensors`` (the same memory,
    not views for autograd: an in-place ReLU may follow), joined in autograd's graph to every
    one of ``tensors``. Its backward asks ``backward(grads)`` (one per returned tensor, ``None``
    where none flowed) for the gradients of all of ``tensors``, in order.

    The one node by which a call whose parameters autograd does not see reaches them again:
    after the output of a call run detached (:meth:`DetachedCalls.capture_detached`) or with
    grad mode off (:meth:`DetachedCalls.capture_owned`), or before the first input of a
    carried call (:class:`_Carried`).

    It saves an empty tensor, read at its backward, so that a second backward through it
    without ``retain_graph=True`` stops with torch's own error, as the call's nodes would:
    for a call run with grad mode off it is the only node (a hidden state carried into the next
    batch without ``detach`` went through it again, in silence, as if the graph were kept)."""

    @staticmethod
    def forward(ctx, backward, n: int, *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.backward = backward
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(torch.empty(0))
        return tuple(t.detach() for t in tensors[:n])

    @staticmethod
    def backward(ctx, *grads):
        _ = ctx.saved_tensors  # (torch's error where an earlier backward freed the graph)
        return (None, None, *ctx.backward(grads))


def hand_over(tracker: Tracker | None, params: Iterable[Tensor]) -> Callable[[], None]:
    """Hand every torch function of the call now starting a detached alias of each of
    ``params``: through ``tracker``'s aliases where a tracker follows the forward, else
    through an :class:`~gradhooks.tracking.Aliases` mode of the call's own (a call run again at
    the backward by activation checkpointing, which must save what its forward saved).
    Returns what puts things back, at the call's end."""
    aliases = {id(p): p.detach() for p in params}
    if tracker is None:
        mode = Aliases(aliases)
        mode.__enter__()
        return lambda: mode.__exit__(None, None, None)
    previous = {pid: tracker.aliases.get(pid) for pid in aliases}
    tracker.aliases.update(aliases)

    def undo() -> None:
        for pid, alias in previous.items():
            if alias is None:
                tracker.aliases.pop(pid, None)
            else:
                tracker.aliases[pid] = alias

    return undo


def _first_pre_hooks_ours(module: nn.Module, fn: Any) -> bool:
    """Whether every forward pre-hook ``module`` runs before ``fn`` is gradhooks' own (and
    none global): another's (the old ``nn.utils.weight_norm``, ``nn.utils.prune``) may make
    the weight the call uses from its parameters before the call, where no alias reaches
    them (the engine then follows their use there instead)."""
    if _torch.global_forward_pre_hooks():
        return False
    for h in _torch.forward_pre_hooks(module):
        if getattr(h, "fn", None) is fn:
            return True
        if not isinstance(h, Hook):
            return False
    return False


def _last_pre_hook(module: nn.Module, fn: Any) -> bool:
    """Whether ``fn`` is the forward pre-hook ``module`` runs last (none global)."""
    last = _torch.last_forward_pre_hook(module)
    return getattr(last, "fn", None) is fn and not _torch.global_forward_pre_hooks()


def _rerun_alone(
    module: nn.Module,
    owned: tuple[tuple, dict],
    grads: list,
    params: list[Tensor],
    inputs: list[Tensor],
    autocast: tuple = (),
) -> list[Tensor | None]:
    """:func:`_rerun` for the gradients of ``params`` and ``inputs`` through this call alone:
    the inputs replaced by fresh leaves, so that autograd does not go on through them to an
    earlier call that used the same parameters under autograd (an LSTM decoder's first step,
    its input from a batch-free call, run so; the next steps owned): that call's share would be
    counted in this one's, and the forward's graph through it freed. Not for a
    ``create_graph`` backward, whose input-gradients keep their graph."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    swap = dict(zip(map(id, inputs), leaves))
    call = tree_map(lambda t: swap.get(id(t), t) if isinstance(t, Tensor) else t, owned)
    return _rerun(module, call, grads, [*params, *leaves], False, autocast)


def _rerun_as_rule(
    module: nn.Module,
    owned: tuple[tuple, dict],
    grads: list,
    params: list[Tensor],
    inputs: list[Tensor],
) -> list[Tensor | None]:
    """:func:`_rerun_alone` in the precision an owned call's rule computes in (``owns_backward``:
    the parameters' dtype, from the call's inputs, whatever autocast the forward ran under),
    for the probe's reference (:meth:`DetachedCalls.capture_owned`): autocast off, the call's
    floating-point inputs and output-gradients cast to the parameters' dtype. Under a half
    precision, autograd's backward of the call run again as it ran rounds in that precision
    what the rule sums in its own (each time step's share of a recurrent layer's gradients,
    one by one): the two would differ by that rounding, which a mixing of the examples may hide
    in; in one precision, by its rounding alone. The gradients are given back in the dtypes of
    ``inputs``."""
    dtype = params[0].dtype if params else None
    if dtype is None or not dtype.is_floating_point:
        return _rerun_alone(module, owned, grads, params, inputs)
    leaves = [t.detach().requires_grad_() for t in inputs]
    swap = dict(zip(map(id, inputs), leaves))

    def cast(t: Any) -> Any:
        if not isinstance(t, Tensor):
            return t
        t = swap.get(id(t), t)
        return t.to(dtype) if t.is_floating_point() else t

    call = tree_map(cast, owned)
    grads = [g.to(dtype) if isinstance(g, Tensor) and g.is_floating_point() else g for g in grads]
    with autocast_off():  # (also where the backward runs inside an autocast block)
        found = _rerun(module, call, grads, [*params, *leaves], False)
    return [
        g if g is None or i < len(params) else g.to(inputs[i - len(params)].dtype)
        for i, g in enumerate(found)
    ]


def _rerun(
    module: nn.Module,
    owned: tuple[tuple, dict],
    grads: list,
    wanted: list[Tensor],
    create_graph: bool,
    autocast: tuple = (),
) -> list[Tensor | None]:
    """The gradients of ``wanted`` (parameters, inputs) through ``module``'s forward run again
    on the ``(args, kwargs)`` of a call (``owned``, as called: inputs attached), hooks
    bypassed, against ``grads`` (one per leaf of the output, ``None`` where none flowed).
    The one rerun of a call, wherever what autograd would give is wanted and the rule did not
    give it (a ``create_graph`` backward): for a call run detached or carried
    (:func:`_autograd_of`) or owned (:meth:`DetachedCalls.capture_owned`). ``autocast``: the
    call's (:attr:`Call.autocast`), under which it runs again: its gradients are then those
    autograd gives through the call as it ran (run in float32, a bfloat16 output's gradient
    meets a float32 product no kernel takes)."""
    with torch.enable_grad(), autocast_as(autocast):
        args, kwargs = owned
        leaves = tree_leaves(module.forward(*args, **kwargs))
    pairs = [
        (t, g) for t, g in zip(leaves, grads)
        if g is not None and isinstance(t, Tensor) and t.requires_grad
    ]  # fmt: skip
    if not pairs or not wanted:
        return [None] * len(wanted)
    outs, gs = zip(*pairs)
    return list(torch.autograd.grad(outs, wanted, gs, create_graph=create_graph, allow_unused=True))


def _autograd_of(
    target: Target,
    args: tuple,
    kwargs: dict,
    detached: dict[str, nn.Parameter],
    missing: list[str],
    outputs: list,
    inputs: list[Tensor],
    create_graph: bool,
    autocast: tuple = (),
) -> tuple[dict[str, Tensor | None], list[Tensor | None]]:
    """What a :class:`_Join` node needs of autograd through the forward, run again (hooks
    bypassed), of a call that ran with ``detached`` detached, against the call's
    output-gradients ``outputs``: the batch gradients of the ``missing`` parameters (those no
    rule gave) and, in a ``create_graph`` backward, a correction of value zero for each of
    ``inputs``. Their gradients as the call's own nodes computed them have no graph through
    the detached parameters; the corrections carry exactly that part: the forward runs on
    fresh leaves for the inputs, against detached output-gradients, with every other tensor and
    parameter of the call detached. ``autocast``: the call's, under which it runs again."""
    module = target.module
    found: dict[str, Tensor | None] = {}
    if missing:
        call = (args, kwargs) if create_graph else detach_tree((args, kwargs))
        got = _rerun(module, call, outputs, [detached[n] for n in missing], create_graph, autocast)
        found = dict(zip(missing, got))
    corrections: list[Tensor | None] = [None] * len(inputs)
    if create_graph and inputs:
        leaves = [t.detach().requires_grad_() for t in inputs]
        swap = dict(zip(map(id, inputs), leaves))
        call = tree_map(
            lambda t: swap.get(id(t), t.detach()) if isinstance(t, Tensor) else t, (args, kwargs)
        )
        attached = {id(p) for p in detached.values()}
        others = {id(p): p.detach() for p in target.params.values() if id(p) not in attached}
        with Aliases(others):
            got = _rerun(module, call, [None if g is None else g.detach() for g in outputs],
                         leaves, True, autocast)  # fmt: skip
        corrections = [None if c is None else c - c.detach() for c in got]
    return found, corrections


def _sums_of_rule(target: Target, call: Call, detached: dict, sums: dict[str, Tensor]) -> None:
    """Into ``sums``, the batch gradients of the rule's pieces for ``call``, for the detached
    parameters it has none of yet: a backward in which the rule did not run through the engine
    (paused, not captured, the second backward of a ghost DP step)."""
    pieces = target.entry.rule(call)
    for n, p in detached.items():
        if n not in sums and pieces.get(n) is not None:
            sums[n] = pieces[n].in_dtype(p.dtype).batch_sum(p.shape)


class KeepsCalls(Protocol):
    """What :class:`DetachedCalls` asks of the forward's part
    (:class:`~gradhooks.engine.forward.ForwardCapture`)."""

    def keep_unhooked_call(
        self, target: Target, args: tuple, kwargs: dict, output: Any
    ) -> tuple[Call, CallState]:
        """Start capturing a call whose parameters autograd does not see; ``(call, state)``."""
        ...


def _reads_others(module: nn.Module, detached: dict[str, Tensor]) -> bool:
    """Whether a call may reach trainable parameters other than the module's own ``detached``
    ones (a weight made by a parametrization from its ``original``, a submodule's): run with
    grad mode off, autograd would record nothing of their use, and they would get neither
    ``.grad`` nor ``grad1``."""
    own = {id(p) for p in detached.values()}
    return any(p.requires_grad and id(p) not in own for p in module.parameters())


class DetachSteps(NamedTuple):
    """A hooked call's decision to run detached and its start
    (:meth:`DetachedCalls.detach_steps`), run by the module's forward pre-hook."""

    # (module, args, kwargs, the pre-hook) -> what runs detached, or None: asked in OwnWork
    decide: Callable[[nn.Module, tuple, dict, Callable], tuple | None]
    # (module, args, kwargs, what decide gave) -> the call's new (args, kwargs), or None
    start: Callable[[nn.Module, tuple, dict, tuple], tuple[tuple, dict] | None]


def runs_call_last_only(entry: Any) -> bool:
    """Whether a rule's entry may run its layer's call itself (``owns_backward``) or carry
    its parameters on an input (``taps``), which :meth:`DetachedCalls.detach_steps` does only
    where its pre-hook is the module's last: a pre-hook of the user's after it could change
    what the forward gets."""
    return entry.owns_backward is not False or entry.taps is not None


class DetachedCalls:
    """Calls run detached, owned or carried (a part of :class:`gradhooks.Hooks`)."""

    # the other parts it calls, given by the handle that owns them all
    forwards: KeepsCalls
    backwards: BackwardWriter
    layouts: CallLayouts

    def __init__(self, state: CaptureState) -> None:
        self.state = state

    def _worth_detaching(self, target: Target, module: nn.Module, args: tuple) -> bool:
        """Whether the rule says the call is worth running detached: where the backward to
        come is expected to want no parameter gradient (the last one wanted none), by its
        ``detach_without_grads``, else by its ``grad_from_grad1``."""
        entry = target.entry
        if self.state.grads_unused and entry.detach_without_grads is not None:
            return entry.detach_without_grads(module, args)
        return entry.grad_from_grad1(module, args)

    def detach_steps(self, target: Target, forward_hook: int) -> DetachSteps:
        """The part of a hooked module's forward pre-hook
        (:meth:`ForwardCapture.enter_hook`) for a rule with ``grad_from_grad1``: where it says
        so, the call runs with the module's own parameters detached (the tracker hands its
        torch functions detached aliases: autograd then computes no batch gradient for them),
        and :meth:`ForwardCapture.forward_hook` (handle id ``forward_hook``)
        replaces the output by one attached to them again through a :class:`_Join` node, whose
        backward gives ``.grad`` the sum of the call's ``grad1``. Not where another forward hook
        would see the output before it is attached: a loss built on that output would give
        the parameters no gradient. Where the rule's entry has ``owns_backward``, the call runs
        with grad mode off: autograd records nothing of it (:meth:`capture_owned`). Where it
        has ``taps`` (and ``grad1`` is computed), the rule runs only once the backward has
        reached nodes inside the call, after its output: the parameters are attached to the
        call's first floating-point input instead, through a :class:`_Join` node that takes
        its place (every occurrence: ``query is key is value`` stays true), and whose backward
        runs after the call's (:meth:`_carried_backward`)."""

        owns = target.entry.owns_backward is not False
        carries = target.entry.taps is not None and not owns
        last_only = runs_call_last_only(target.entry)  # (owns or carries)

        def runs_detached(
            module: nn.Module, args: tuple, kwargs: dict, hook: Callable
        ) -> tuple | None:
            """The parameters the call runs detached, and the input that carries them
            (``None``: not carried); ``None`` where it runs as autograd runs it. ``hook``: the
            module's forward pre-hook that asks (the engine's own work, which the forward's
            tracker does not see: asked inside
            :class:`~gradhooks.engine.records.OwnWork`)."""
            if (
                module is not target.module
                or self.state.removed
                or not (self.state.grad1 or {"norms", "sum_grad_sq"} & set(self.state.quantities))
                or not self.state.capturing_backward()
                or not torch.is_grad_enabled()
                or is_compiling()
                or _torch.in_transform(args, kwargs)
                # (before the hooks' order: at most calls it says no, an MLP's every Linear)
                or not self._worth_detaching(target, module, args)
                or _torch.first_forward_hook(module) != forward_hook
                or _torch.global_forward_hooks()
                # (non-reentrant activation checkpointing runs the call again at the backward,
                # where no tracker tells its layout as the forward's did: it must save what the
                # forward saved, so neither runs detached)
                or _torch.saved_tensor_hooks_active()
                or not self.layouts.plain_call(target, module, args, kwargs)
                or (owns and self._from_sources(args, kwargs))
                or (carries and not self.state.grad1)
                or (last_only and not _last_pre_hook(module, hook))
                or not (owns or _first_pre_hooks_ours(module, hook))
            ):
                return None  # (a later pre-hook could change what the forward gets)
            detached = {
                n: p
                for n, p in target.params.items()
                if p.requires_grad and "." not in n and getattr(module, n, None) is p
            }
            carried = None
            if carries:
                carried = next(
                    (t for t in [*tree_leaves(args), *tree_leaves(kwargs)]
                     if isinstance(t, Tensor) and t.is_floating_point()),
                    None,
                )  # fmt: skip
            if not detached or (carries and carried is None):
                return None
            if owns and _reads_others(module, detached):
                return None
            return detached, carried

        def start(
            module: nn.Module, args: tuple, kwargs: dict, found: tuple
        ) -> tuple[tuple, dict] | None:
            # (what the call then runs on, the forward's tracker sees)
            detached, carried = found
            owned = (args, kwargs) if owns else None
            recording = None  # (context manager, what it gave), left in _reattach
            if owned is not None and callable(target.entry.owns_backward):
                manager = target.entry.owns_backward(module)
                recording = (manager, manager.__enter__())
            undo = None  # (puts back what hand_over did, in _reattach)
            if owned is None:  # (a call run with grad mode off needs no aliases)
                undo = hand_over(self.state.tracker(), detached.values())
            box = None
            if carries:
                box = _Carried(target, detached, carried, args, kwargs, _Sums(detached))
                (attached,) = _Join.apply(
                    lambda gs: self._carried_backward(box, gs[0]), 1, carried,
                    *detached.values(),
                )  # fmt: skip
                swap = lambda t: attached if t is carried else t  # noqa: E731
                args, kwargs = tuple(map(swap, args)), {k: swap(v) for k, v in kwargs.items()}
            self.state.detached.setdefault(id(module), []).append(
                DetachedCall(module, detached, owned, box, recording, undo)
            )
            if owned is not None:
                torch.set_grad_enabled(False)  # back on in _reattach, at the forward's end
            if box is not None:
                return args, kwargs
            return None

        return DetachSteps(runs_detached, start)

    def _from_sources(self, args: tuple, kwargs: dict) -> bool:
        """Whether an input of a call that requires grad was computed from tensors that do not
        depend on the examples and that the tracker follows to where they meet the batch (a
        learned initial state ``h0.expand(-1, batch, -1)``): a call run with grad mode off gives
        such an input only its batch gradient, so it runs under autograd instead, where the
        tracker splits that gradient by example."""
        tracker = self.state.tracker()
        return tracker is not None and any(
            isinstance(t, Tensor) and t.requires_grad and tracker.sources_of(t)
            for t in [*tree_leaves(args), *tree_leaves(kwargs)]
        )

    def reattach(self, module: nn.Module) -> Reattached:
        """Put back the parameters :meth:`detach_steps` detached for the call now ending;
        returns them, the call's ``(args, kwargs)`` where it ran with grad mode off (else
        ``None``), its :class:`_Carried` where its first input carries them (else ``None``)
        and what its rule's ``owns_backward`` recording gave (else ``None``), the recording now left."""
        stack = self.state.detached.get(id(module))
        if not stack:
            return Reattached({}, None, None, None)
        call = stack.pop()
        if not stack:
            del self.state.detached[id(module)]
        recorded = call.close(sys.exc_info())
        return Reattached(call.detached, call.owned, call.carried, recorded)

    def check_aliases(
        self,
        target: Target,
        detached: dict[str, nn.Parameter],
        args: tuple,
        kwargs: dict,
        output: Any,
    ) -> None:
        """The first call of a module run with ``detached`` detached: refuse it where its
        output's autograd history reaches one of them inside the call (a use that no torch
        function received, so no alias replaced it: an ``autograd.Function``, a TorchScript
        function), which would add autograd's batch gradient to the one taken from
        ``grad1``. The walk stops at the call's inputs (at most 64 nodes)."""
        self.state.aliases_checked.add(id(target.module))
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        # (the nodes held while their ids are compared: a node's Python object may be made anew)
        held = [t.grad_fn for t in inputs if t.grad_fn is not None]
        stop = {id(node) for node in held}
        wanted = {id(p): n for n, p in detached.items()}
        nodes = [t.grad_fn for t in tree_leaves(output)
                 if isinstance(t, Tensor) and t.grad_fn is not None]  # fmt: skip
        seen: set[int] = set()
        while nodes and len(seen) < 64:
            node = nodes.pop()
            if id(node) in seen or id(node) in stop:
                continue
            held.append(node)
            seen.add(id(node))
            variable = getattr(node, "variable", None)
            if variable is None:
                nodes.extend(f for f, _ in node.next_functions if f is not None)
            elif id(variable) in wanted:
                module = target.module
                raise UnsupportedError(
                    f"gradhooks: {target.quoted} ({type(module).__qualname__}) "
                    f"hands its parameter '{wanted[id(variable)]}' (shape "
                    f"{tuple(variable.shape)}) to an operation no torch function call "
                    "shows (an autograd.Function, a TorchScript function), so the call "
                    "cannot run with it detached: autograd would add its batch gradient to "
                    "the one its rule takes from grad1. Raise the rule's threshold "
                    "(gradhooks.tuned(sum_grad1_positions=...) for Linear and the "
                    "convolutions) or register its rule without grad_from_grad1."
                )

    def capture_detached(
        self,
        target: Target,
        detached: dict[str, nn.Parameter],
        args: tuple,
        kwargs: dict,
        output: Any,
    ) -> Tensor:
        """Capture a call that ran with ``detached`` detached (:meth:`detach_steps`); return
        its output attached to them again (the forward hook's replacement output)."""
        module = target.module
        if not isinstance(output, Tensor):
            raise UnsupportedError(
                f"{target.quoted} ({type(module).__qualname__}) returned "
                f"{type(output).__qualname__}, but its rule's grad_from_grad1 is only for "
                "modules that return one tensor"
            )
        call, state = self.forwards.keep_unhooked_call(target, args, kwargs, output)
        leaves = [*tree_leaves(args), *tree_leaves(kwargs)]
        inputs = [t for t in leaves if isinstance(t, Tensor) and t.requires_grad]
        n_inputs = len(inputs)
        # (what the backward needs of the forward, let go of once a backward that does not
        # keep its graph ran the rule: BackwardWriter.spend)
        held = Held(call, args, kwargs, inputs, state)
        del call, args, kwargs, inputs

        def backward(g: Tensor) -> tuple[Tensor | None, ...]:
            if held.released:  # (its parameters' gradients are this node's to give: none left)
                self.backwards.refuse_released(target)
            call, args, kwargs, inputs = held.call, held.args, held.kwargs, held.inputs
            sums: dict[str, Tensor] = {}
            filled = with_fields(call, grad_outputs=(g,))
            if not self.state.probing:  # (the probe's: autograd's own, by a rerun; no rule runs)
                if self.backwards.on_grads(target, state, filled, args, kwargs, sums):
                    self.backwards.spend(held)
                if not self.state.mode.param_grads:
                    return (None,) * (len(detached) + len(inputs))
                if len(sums) < len(detached) and not torch.is_grad_enabled():
                    # this backward writes nothing (paused, the second backward of a ghost DP
                    # step): the batch gradients of the rule's pieces
                    _sums_of_rule(target, filled, detached, sums)
            create_graph = torch.is_grad_enabled()
            missing = [n for n in detached if n not in sums]
            self.state.rerunning += 1  # its backwards are not the model's: not tracked
            try:
                found, corrections = _autograd_of(
                    target, args, kwargs, detached, missing, [g], inputs, create_graph,
                    call.autocast,
                )  # fmt: skip
            finally:
                self.state.rerunning -= 1
            grads = {**sums, **found}
            return (*(grads[n] for n in detached), *corrections)

        def joined(grads: tuple[Tensor | None]) -> tuple[Tensor | None, ...]:
            (g,) = grads
            if g is None:
                return (None,) * (1 + len(detached) + n_inputs)
            return (g, *backward(g))  # (the output's gradient on, through the call's own nodes)

        (attached,) = _Join.apply(joined, 1, output, *detached.values(), *held.inputs)
        return attached

    def capture_owned(
        self,
        target: Target,
        detached: dict[str, nn.Parameter],
        owned: tuple[tuple, dict],
        args: tuple,
        kwargs: dict,
        output: Any,
        recorded: Any = None,
    ) -> Any:
        """Capture a call that ran with grad mode off (its rule's entry has ``owns_backward``):
        autograd recorded nothing of it. Return its output with every tensor leaf attached to
        the parameters and to the inputs that require grad (``owned``: ``(args, kwargs)``)
        through one :class:`_Join` node. Its backward runs the rule, whose pieces give
        the parameters' batch gradients and which gives the inputs' gradients
        (``call.input_grads``); where the rule gives none, or in a ``create_graph`` backward,
        autograd through the call's forward run again (:func:`_rerun`). ``recorded``:
        what the rule's ``owns_backward`` recording gave at the forward (``call.recorded``)."""
        module = target.module
        call, state = self.forwards.keep_unhooked_call(target, args, kwargs, output)
        if recorded is not None:
            call = with_fields(call, recorded=recorded)
        in_leaves = tree_leaves(owned)
        in_idx = [i for i, t in enumerate(in_leaves) if isinstance(t, Tensor) and t.requires_grad]
        out_leaves, spec = tree_flatten(output)
        out_idx = [i for i, t in enumerate(out_leaves) if isinstance(t, Tensor)]
        n_out = len(out_leaves)  # (the closure must not hold the attached outputs: see below)
        versions = {n: _torch.version(p) for n, p in detached.items()}

        def backward(grads: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
            check_parameter_versions(target, detached, versions)  # (autograd saved none)
            full: list[Tensor | None] = [None] * n_out
            for i, g in zip(out_idx, grads):
                full[i] = g
            if self.state.probing:  # (autograd's own gradients, by a rerun: no rule runs)
                inputs = [in_leaves[i] for i in in_idx]
                with self.nested():
                    return tuple(_rerun_as_rule(module, owned, full, [*detached.values()], inputs))
            create_graph = torch.is_grad_enabled()
            sums: dict[str, Tensor] = {}
            filled = with_fields(call, grad_outputs=tuple(full), input_grads=[])
            self.backwards.on_grads(target, state, filled, args, kwargs, sums)
            found = filled.input_grads
            incomplete = len(sums) < len(detached) and self.state.mode.param_grads
            if not create_graph and (incomplete or not found):
                # the rule did not run (paused, not capturing): run it for both
                again = with_fields(filled, input_grads=[])
                _sums_of_rule(target, again, detached, sums)
                found = again.input_grads
            param_grads = {} if create_graph else dict(sums)
            input_grads = [None if create_graph or not found else found[i] for i in in_idx]
            # (a backward whose parameter gradients are not used, the book-keeping DP step's,
            # needs none: no rerun, whose nested backward would reach earlier calls' hooks)
            missing = (
                [n for n in detached if n not in param_grads] if self.state.mode.param_grads else []
            )
            if missing or (in_idx and not found) or create_graph:
                self.state.rerunning += 1  # its backwards are not the model's: not tracked
                try:
                    params = [detached[n] for n in missing]
                    inputs = [in_leaves[i] for i in in_idx]
                    if create_graph:
                        got = _rerun(module, owned, full, params + inputs, True, call.autocast)
                    else:
                        got = _rerun_alone(module, owned, full, params, inputs, call.autocast)
                finally:
                    self.state.rerunning -= 1
                param_grads.update(zip(missing, got))
                if create_graph or not found:
                    input_grads = got[len(missing) :]
            if not self.state.mode.param_grads:
                return (*(None for _ in detached), *input_grads)
            return (*(param_grads[n] for n in detached), *input_grads)

        n = len(out_idx)
        outs = _Join.apply(
            lambda grads: ((None,) * n + backward(grads)), n,
            *(out_leaves[i] for i in out_idx), *detached.values(),
            *(in_leaves[i] for i in in_idx),
        )  # fmt: skip
        # A new list: the attached outputs hold the node, whose backward must not hold them (a
        # cycle through autograd's graph, which Python's garbage collector cannot see: every
        # call's graph and tensors would stay alive for good)
        attached = list(out_leaves)
        for i, t in zip(out_idx, outs):
            attached[i] = t
        return spec.unflatten(attached)

    def _carried_backward(self, carried: _Carried, g: Tensor | None) -> tuple:
        """The backward of a carried call's :class:`_Join` node: the carried input's gradient ``g`` on, and
        the batch gradients of the call's detached parameters. They are the sums the rule gave
        (it ran when the backward reached the call's taps, before this node); where it gave
        none (a paused backward, one not captured) or in a ``create_graph`` backward,
        autograd through the call's forward run again (:func:`_autograd_of`)."""
        detached = carried.detached
        outputs, carried.outputs = carried.outputs, None
        create_graph = torch.is_grad_enabled()
        if not self.state.mode.param_grads and not create_graph:
            return (g, *(None for _ in detached))
        grads: dict[str, Tensor | None] = {} if create_graph else dict(carried.sums)
        carried.sums.clear()
        missing = [n for n in detached if n not in grads]
        if (missing or create_graph) and outputs is not None:
            self.state.rerunning += 1  # its backwards are not the model's: not tracked
            try:
                found, (correction,) = _autograd_of(
                    carried.target, carried.args, carried.kwargs, detached, missing,
                    list(outputs), [carried.input], create_graph,
                )  # fmt: skip
            finally:
                self.state.rerunning -= 1
            grads.update(found)
            if correction is not None:
                g = correction if g is None else g + correction
        return (g, *(grads.get(n) for n in detached))

    @contextlib.contextmanager
    def nested(self) -> Iterator[None]:
        """A backward the engine runs inside one of the model's (per-example gradients through
        batch-free operations): the hooks it reaches are not the model's."""
        self.state.rerunning += 1
        try:
            yield
        finally:
            self.state.rerunning -= 1

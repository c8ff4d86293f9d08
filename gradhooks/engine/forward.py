"""A forward of the hooked model: its frame and the tracker that follows the batch through it,
and, at each hooked call, what the call keeps until the backward reaches its outputs.

:class:`ForwardCapture` is this part of a :class:`gradhooks.Hooks` handle: the forward pre- and post-hooks of
the model (and of the modules through which it may be entered, :meth:`ForwardCapture.entry_hooks`)
open and close a :class:`~gradhooks.engine.records.Frame`; every hooked module's forward hook keeps its
call (a :class:`~gradhooks.rules.registry.Call` and its :class:`~gradhooks.engine.records.CallState`) and puts
a gradient hook on its outputs, which hands the call, with its output-gradients, to the backward
(:mod:`gradhooks.engine.backward`). A call whose rule runs it detached, owned or carried goes through
:mod:`gradhooks.engine.capture` first.
"""

from __future__ import annotations

import collections.abc
import contextlib
import copy
import functools
import inspect
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from .. import _torch
from .._torch import tree_map
from ..autocast import autocast_state, cast_versions
from ..errors import (
    BatchNotFoundError,
    GradhooksWarning,
    StateError,
    UnbatchedInputError,
    UnsupportedError,
    UnsupportedInputError,
    describe_module,
)
from ..rules.fallback import FALLBACK
from ..rules.registry import Call, ModuleState
from ..tracking import PACKED, UNKNOWN, Source, Tracker
from .aside import follow_aside
from .backward import BackwardWriter
from .calls import (
    CallLayouts,
    Held,
    KeptCall,
    _kind_of,
    _shapes,
    carry_layouts,
    input_tensors,
    keeps_rows,
    listed_with,
    own_node,
    release_spent,
    root_batch,
    rows_in_memory,
    unview,
)
from .capture import DetachedCalls, DetachSteps
from .opaque import follow_scripted
from .outputs import LayerOutputs
from .plan import Target, accumulator_of, positional
from .records import (
    BufferStates,
    CallLayout,
    CallState,
    Frame,
    Hook,
    OwnWork,
    autocast_on,
    call_precision,
    detach_tree,
    float32_products,
    graph_task,
    is_compiling,
    leaves_of,
    power_of_two,
    tree_leaves,
    with_fields,
)
from .state import CaptureState
from .verify import Verifier


class ForwardCapture:
    """The forward side of :class:`gradhooks.Hooks`: frames, the tracker, kept calls."""

    # the other parts it calls, given by the handle that owns them all
    layouts: CallLayouts
    backwards: BackwardWriter
    detached_calls: DetachedCalls
    verifier: Verifier

    def __init__(self, state: CaptureState) -> None:
        self.state = state
        # the handle's: plan the hooks again where the model changed since (at each forward)
        self.follow_changes: Callable[[nn.Module | None], None] = lambda model: None
        # a Target per torch function and parameters captured as a call (F.linear of a tied weight)
        self.functional_targets: dict[tuple, Target] = {}
        # the output_edges() lists open now: each such call's output is added to them
        self.edge_sinks: list[_Edges] = []
        # the outputs hooked calls returned, where a global forward hook of others returns another
        self.layer_outputs = LayerOutputs(lambda module: False)

    def enter_hook(
        self, target: Target, first: Callable | None = None, detach: DetachSteps | None = None
    ):
        """The forward pre-hook of every hooked module: the tracker (if this forward has one)
        learns which parameters the call covers, so that an operation using a parameter
        outside its module's call is seen as a direct use. ``first``: the pre-hook of an entry
        module (:meth:`entry_hooks`) that runs before, where no hook of the user's runs between
        them; ``detach``: where the rule may run the call detached, whether it does, decided
        in the same :class:`OwnWork`, and the call's start (one hook does the work of all)."""
        own = list(target.params.values())
        # (what each call covers, its name and softness: the same at every call, made once)
        covers = frozenset(id(p) for p in own)
        soft, quoted = target.entry is FALLBACK, target.quoted

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
            if first is not None:
                given = first(module, args, kwargs)
                if given is not None:
                    # (the hooks were planned again in it: this one is dead, and its successor
                    # ran, which gave the call's arguments)
                    return given
            if module is not target.module:
                return None
            tracker = self.state.tracker()
            found = None
            with OwnWork(tracker):
                capturing = (
                    self.state.pause.on and torch.is_grad_enabled() and not self.state.removed
                )
                if capturing:
                    if kwargs or not _plain_tensors(args):  # (else none is nested)
                        refuse_nested(
                            lambda: f"{target.quoted} ({type(module).__qualname__})",
                            args, kwargs,
                        )  # fmt: skip
                    if target.entry is FALLBACK and module.training and self.state.frames:
                        self._keep_buffers(module)
                    if target.entry is FALLBACK and self.state.frames:
                        kept = self.state.frames[-1].kept.setdefault(id(module), [])
                        kept.append(_kept_on(module))
                now = covers
                if self.state.sharded:
                    now = frozenset(id(p) for p in self._unsharded(target))
                if tracker is not None:
                    self.layouts.reseed_before(target, module, args, kwargs, tracker)
                    tracker.enter_call(now, module, soft=soft, where=quoted)
                if capturing and target.entry.on_forward is not None:
                    if not _torch.in_transform(args, kwargs):
                        # (before the call: a refused BatchNorm leaves its running statistics)
                        target.entry.on_forward(module, target.name)
                if detach is not None:
                    found = detach.decide(module, args, kwargs, hook)
            if found is None:
                return None
            return detach.start(module, args, kwargs, found)

        return hook

    def _keep_buffers(self, module: nn.Module) -> None:
        """Before a call of a module without a rule in training mode: copies of its buffers,
        in case its forward changes them in place (spectral_norm's power iteration), for the
        fallback to recompute the call from where it started (:meth:`_buffers_of`)."""
        found = list(module.named_buffers(remove_duplicate=False))
        if found:
            kept = [(n, b, _torch.version(b), b.detach().clone()) for n, b in found]
            self.state.frames[-1].buffers.setdefault(id(module), []).append(kept)

    def _buffers_of(self, module: nn.Module) -> BufferStates | None:
        """After its call: the buffers as the call found them (:meth:`_keep_buffers`) and as
        it left them, where its forward changed them, else ``None``."""
        if not self.state.frames:
            return None
        stack = self.state.frames[-1].buffers.get(id(module))
        if not stack:
            return None
        kept = stack.pop()
        if all(_torch.version(b) == v for _, b, v, _ in kept):
            return None
        return BufferStates(
            found={n: copy for n, _, _, copy in kept},
            left={n: b.detach().clone() for n, b, _, _ in kept},
        )

    def _kept_before(self, module: nn.Module) -> list[Tensor]:
        """After its call: the tensors the module kept in its attributes as the call found
        them (a list its earlier calls appended their outputs to), which the call did not let
        out (:func:`_escaping`)."""
        if not self.state.frames:
            return []
        stack = self.state.frames[-1].kept.get(id(module))
        return stack.pop() if stack else []

    def tracker(self) -> Tracker | None:
        return self.state.tracker()

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
                self.state.current[id(planned)] = current
                tracker = self.tracker()
                if tracker is not None and id(planned) in self.state.params:
                    tracker.params[id(current)] = (self.state.params[id(planned)][0], planned)
        return now

    def forward_hook(self, target: Target):
        # what the module's last usual call decided, replayed by the next (replay_usual)
        usual = UsualCall()

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            output = self.layer_outputs.take(module, output)
            found = self._buffers_of(module) if target.entry is FALLBACK else None
            before = self._kept_before(module) if target.entry is FALLBACK else []
            tracker = self.state.tracker()
            if tracker is None or module is not target.module or not tracker.covered:
                return body(module, args, kwargs, output, None, True, found, before=before)
            used = tracker.exit_call()
            reattached = None
            if self.state.detached:
                # (first: a call run detached takes its aliases back, so that the work below
                # can run with the tracker off the mode stack, OwnWork)
                with tracker.paused():
                    reattached = self.detached_calls.reattach(module)
            with OwnWork(tracker):
                if reattached is None and type(output) is Tensor and not kwargs:
                    done = self.replay_usual(target, usual, module, args, kwargs, output, tracker)
                    if done is not FULL:
                        return done
                return body(module, args, kwargs, output, tracker, used, found, reattached,
                            before)  # fmt: skip

        def body(
            module, args, kwargs, output, tracker, used, found, reattached=None, before=()
        ) -> Any:
            args, kwargs = positional(module, args, kwargs)
            if reattached is None and self.state.detached:
                reattached = self.detached_calls.reattach(module)
            detached, owned, carried, recorded = reattached or ({}, None, None, None)
            if output is None and sys.exc_info()[1] is not None:
                return  # the forward raised (an always_call hook, for _reattach)
            if tracker is None and self.state.reruns and graph_task() != -1:
                if self.state.pause.on and torch.is_grad_enabled() and not self.state.removed:
                    self._check_rerun(target, args, kwargs)  # (a call run again, before capture)
            if detached and owned is None and id(module) not in self.state.aliases_checked:
                self.detached_calls.check_aliases(target, detached, args, kwargs, output)
            if owned is not None:
                new = self.detached_calls.capture_owned(
                    target, detached, owned, args, kwargs, output, recorded
                )
                return carry_layouts(tracker, output, new)
            if detached and carried is None:
                new = self.detached_calls.capture_detached(target, detached, args, kwargs, output)
                return carry_layouts(tracker, output, new)
            # (a carried call goes on as any other: its rule gives the sums as well)
            if self.state.removed or not self.state.pause.on:
                return
            if not torch.is_grad_enabled():
                if self.state.frames and (
                    self.state.frames[-1].grad_enabled or _requires_grad_input(args, kwargs)
                ):
                    # no_grad inside a training forward, or given an input that requires grad
                    # (the model or its layers called inside the checkpoint, as
                    # checkpoint_sequential calls them): reentrant activation checkpointing,
                    # which reruns this call during the backward. The collector then waits for
                    # the end of the backward to reduce these parameters' pieces.
                    self.state.frames[-1].unprobed = True
                    self.state.recomputes = True
                    if self.state.collector is not None:
                        self.state.collector.defer.update(id(p) for p in target.params.values())
                    self._note_rerun(target, args, kwargs, tracker)
                return
            if module is not target.module:
                # a shallow copy, which shares the module's hooks (a deep copy's are inert)
                _refuse_shallow_copy(target, module, self.state.params)
                return
            if _torch.in_transform(args, kwargs, output):
                return  # inside vmap/grad (an oracle, the fallback rule): not ours to capture
            if target.entry.on_forward is not None:
                target.entry.on_forward(module, target.name)  # raises where grad1 cannot exist
            if tracker is not None and target.entry is not FALLBACK:
                # a parameter its call never used, followed where it was used instead (the old
                # nn.utils.weight_norm makes `weight` from `weight_g` and `weight_v` in a
                # forward pre-hook, before the call): its grad1 comes from there
                current, direct = self.state.current, tracker.param_sources
                live = {
                    n: p
                    for n, p in target.params.items()
                    if p.requires_grad
                    and (id(current.get(id(p), p)) in used.params or id(p) not in direct)
                }
            else:
                live = {n: p for n, p in target.params.items() if p.requires_grad}
            if not live:
                return
            leaves = tree_leaves(output)
            ins = None  # tree_leaves((args, kwargs)), where needed
            hooked = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.requires_grad]
            if not hooked:
                return
            if target.entry is FALLBACK and tracker is not None:
                if used.mixed:
                    ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
                    outs = [t for t in tree_leaves(output) if isinstance(t, Tensor)]
                    tracker.absorb(used, ins, outs)
                live = _used_by_fallback(target, live, used, tracker, output)
                if not live:
                    return  # the tracker follows every use (or there was none)
            rehooked = len(hooked) > 1 or _torch.is_view(leaves[hooked[0]])
            aside = []
            if target.entry is FALLBACK:
                for e in _escaping(target, live, args, kwargs, output, before, rehooked):
                    if e.on_the_way:
                        aside.append(e)  # (followed once the returned tensors are final)
                        continue
                    e.tensor.register_hook(
                        functools.partial(self.backwards.escaped, target, e.names)
                    )
            replaced = None
            if rehooked:
                # an output that is a view (nn.Linear on [batch, seq, in]) loses its gradient
                # hooks to an in-place change (a ReLU(inplace=True) next): the same memory, as
                # an output of its own. Several outputs each get a node of their own: where one
                # is computed from another inside the call (LSTMCell's h' from c'), the gradient
                # reaching the other would include what flowed in through the first.
                old = output
                if type(output) is Tensor:  # (the usual one tensor: no tree to walk)
                    output = unview(output)
                    if tracker is not None:
                        tracker.carry(old, output)
                    replaced, leaves = output, [output]
                else:
                    output = tree_map(unview if len(hooked) == 1 else own_node, output)
                    replaced = carry_layouts(tracker, old, output)
                    leaves = tree_leaves(output)
            if aside:
                inputs = {t.grad_fn for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
                inside = _nodes_from([t.grad_fn for t in leaves if isinstance(t, Tensor)], inputs)
                for e in aside:
                    refuse = functools.partial(self.backwards.reached_aside, target, e.names)
                    follow_aside(e.tensor, inside, refuse)
            if tracker is not None:
                # (the usual call, tensors given by position: its leaves without a tree walk)
                ins = (
                    list(args)
                    if not kwargs and _plain_tensors(args)
                    else tree_leaves((args, kwargs))
                )
            layout = self.layouts.call_layout(target, args, kwargs, output, tracker, ins, leaves)
            call, state = self.kept_call(target, live, args, kwargs, output, layout, ins, leaves)
            if found is not None:
                call = with_fields(call, buffers=found.found, buffers_left=found.left)

            # what the call's nodes hold is read only where they stand as the forward ran them
            # (taps not under saved-tensor hooks: reading what a node saved would rerun the
            # call; a rule's ``saved`` function, which may read the module's state instead,
            # looks for them itself)
            rows_kept = (
                target.entry.taps is not None or target.entry.saved is not None
            ) and keeps_rows(layout)
            taps = None
            if (
                target.entry.taps is not None
                and rows_kept
                and not _torch.saved_tensor_hooks_active()
            ):
                taps = target.entry.taps(module, args, kwargs, output)
            nodes = list(taps.nodes) if taps is not None else []
            if taps is not None:
                call = with_fields(call, taps=_without_nodes(taps))
            if target.entry.saved is not None:
                saved = target.entry.saved(module, args, kwargs, output)
                if rows_kept or isinstance(saved, ModuleState):  # (the latter in any layout)
                    call = with_fields(call, saved=saved)

            # (counts the nodes and never holds them: see _without_nodes)
            kept = KeptCall(target, state, call, args, kwargs, live, tuple(hooked), len(leaves),
                            carried, len(nodes))  # fmt: skip
            writer = self.backwards
            for i, node in enumerate(nodes):
                node.register_prehook(functools.partial(writer.node_grads, kept, i))
            if self.state.collector is not None:
                self.state.collector.expect(live)
            # (after every gradient hook on the outputs, also those put on them after the call:
            # a mask of the user's is in the output-gradient autograd gives the call's nodes)
            if len(hooked) == 1:
                _torch.late_hook(leaves[hooked[0]], lambda g: writer.output_grads(kept, (g,)))
            else:
                _torch.all_grads_hook(  # (torch's misses a backward rooted at one of them)
                    [leaves[i] for i in hooked],
                    functools.partial(writer.output_grads, kept),
                    late=True,
                )
            return replaced

        return hook

    def replay_usual(
        self, target: Target, usual: UsualCall, module: nn.Module, args: tuple, kwargs: dict,
        output: Tensor, tracker: Tracker,
    ) -> Any:  # fmt: skip
        """The forward hook's work (``body`` in :meth:`forward_hook`) for the usual call: one
        tensor in, one tensor out and no keyword, of a module whose rule keeps no taps, its
        examples where the tracker finds them on its input and output, on the dimension the
        rule reads (:meth:`CallLayouts._usual_layout`), outside autocast, a call run detached,
        a transform and FSDP. The full path's steps, less the questions whose answers the
        usual call fixes; what the module's last such call decided (its layout, its
        precision, its record less its tensors) is replayed where what it was decided from is
        the same, by identity, and decided again where not. :data:`FULL` (before anything is
        changed: the full path then runs from the start) wherever the full path would take
        another way, or might."""
        state, entry = self.state, target.entry
        x = args[0] if len(args) == 1 else None
        if (
            type(x) is not Tensor
            or entry is FALLBACK
            or entry.on_forward is not None
            or entry.taps is not None
            or module is not target.module
            or state.removed
            or state.sharded
        ):
            return FULL
        # its layout: CallLayouts.call_layout's for one input with examples where the rule
        # reads them and one output with them, taken before the output is unviewed (which
        # carries its layout over unchanged). Its input may be the forward's own (the batch
        # is reseeded from it only where the examples are elsewhere, or the output's lost).
        layouts = tracker.layouts
        lx = layouts.get(x)
        if lx is None or lx.dim < 0 or lx.owners is not None or tracker.reordered.entries:
            return FULL
        ly = layouts.get(output)
        frame = state.frames[-1] if state.frames else None
        if ly is None or ly is UNKNOWN or frame is None or frame.tracker is not tracker:
            return FULL
        if (
            not output.requires_grad
            or not state.pause.on
            or not torch.is_grad_enabled()
            or autocast_on()
            or _torch.mutation_on_saved_allowed()
            or _torch.in_transform(args, kwargs, output)
        ):
            return FULL
        # the parameters it writes grad1 for: with none used outside a call, those that
        # require grad (body's `live`)
        params, direct = target.params, tracker.param_sources
        if direct:
            for p in params.values():
                if id(p) in direct:
                    return FULL
        live = {n: p for n, p in params.items() if p.requires_grad}
        if not live:
            return FULL
        root = False
        for r in frame.roots:
            if r is x:
                root = True
                break
        dim = entry.batch_dim
        if callable(dim):
            dim = dim(module)
        batch = tracker.batch
        layout = usual.layout
        if (
            layout is None
            or lx is not layout.first
            or ly is not layout.outputs[0]
            or batch != layout.batch
            or root is not layout.root
            or dim != usual.dim
            or type(dim) is not type(usual.dim)
        ):
            kind = _kind_of(dim, lx)
            if kind is None:
                return FULL
            layout = usual.layout = CallLayout(kind, batch, lx, (lx,), (ly,), root=root)
            usual.dim, usual.rows = dim, keeps_rows(layout)
        kind = layout.kind
        # from here on, as the full path does
        replaced = None
        if _torch.is_view(output):
            old, output = output, unview(output)
            tracker.carry(old, output)
            replaced = output
        slots = _in_slots(target)
        template = usual.call
        if (
            template is None
            or template.module is not module
            or template.name is not target.name
            or template.registry is not state.registry
            or template.hooked is not state.hooked
            or template.memo is not target.memo
        ):
            template = usual.call = Call(
                module=module, inputs=(), kwargs={}, output=None, grad_outputs=(),
                name=target.name, registry=state.registry, hooked=state.hooked,
                memo=target.memo, autocast=(),
            )  # fmt: skip
        xd = x.detach()
        call = object.__new__(Call)
        fields = call.__dict__
        fields.update(template.__dict__)
        fields["inputs"] = (xd,)
        fields["kwargs"] = {}
        fields["output"] = output.detach() if entry.needs_output else None
        fields["params"] = slots
        fields["versions"] = {n: _torch.version(t) for n, t in slots.items()}
        fields["modes"] = tuple([m.training for m in target.modules])
        call_state = CallState(live, frame, layout=layout, versions=((xd, _torch.version(xd)),))
        call_state.in_backward = graph_task() != -1
        if call.output is not None:
            call_state.out_versions = ((0, _torch.version(call.output)),)
        tracker.note_call([x], [output], lambda outputs: self._made_shared(
            target, call_state, 1, outputs, tracker))  # fmt: skip
        frame.states.append(call_state)
        frame.signature.append((id(target), kind))
        if not frame.unprobed and _torch.saved_tensor_hooks_active():
            frame.unprobed = True
        dtypes = (x.dtype, output.dtype)
        if dtypes != usual.dtypes:
            usual.dtypes, usual.precision = dtypes, call_precision(args, output, False, [x, output])
        precision = usual.precision
        if frame.products is not None and precision is torch.float32:
            precision = frame.products  # (its products rounded in bfloat16)
        call_state.precision = precision
        if entry.saved is not None:
            saved = entry.saved(module, args, kwargs, output)
            if usual.rows or isinstance(saved, ModuleState):  # (the latter in any layout)
                fields["saved"] = saved
        kept = KeptCall(target, call_state, call, args, kwargs, live, (0,), 1, None, 0)
        if state.collector is not None:
            state.collector.expect(live)
        writer = self.backwards
        _torch.late_hook(output, lambda g: writer.output_grads(kept, (g,)))
        return replaced

    def _rule_dim(self, target: Target) -> int:
        if target.entry is FALLBACK:
            return 0
        dim = target.entry.batch_dim_of(target.module)
        return 0 if dim == "positions" else dim

    def _note_rerun(self, target: Target, args: tuple, kwargs: dict, tracker) -> None:
        """A call run with grad mode off inside a training forward (reentrant activation
        checkpointing; a reversible layer's own autograd.Function, which recomputes its blocks
        from their outputs) runs again during the backward, where no tracker follows the batch
        and the rule reads the examples from its dimension as given: noted here, where the
        tracker sees what that dimension holds, for :meth:`_check_rerun`."""
        if tracker is None:
            return
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        lay = next((tracker.layout(t) for t in ins if tracker.layout(t) is not None), None)
        dim = self._rule_dim(target)
        if lay is None:
            found = _NO_EXAMPLES
        elif lay is PACKED or (lay.dim == dim and lay.plain):
            found = None
        else:
            found = lay.describe(tracker.batch)
        noted = self.state.reruns.get(id(target.module))
        # (the examples elsewhere than the rule reads them, at any call, are kept; a call
        # without them, as a fixed-point iteration's first from zeros, gives way to one with
        # them)
        if (
            noted is None
            or noted[0] is None
            or (noted[0] is _NO_EXAMPLES and found is not _NO_EXAMPLES)
        ):
            self.state.reruns[id(target.module)] = (found, tracker.batch)

    def _refuse_derived_rerun(self, target: Target) -> None:
        """:meth:`_check_rerun`'s refusal of a call run again whose parameter slot holds a
        tensor computed from others before it (``functional_call`` given ``p * s`` inside the
        checkpointed function): its rule's per-example gradient of that tensor would be
        written as the parameter's own, the computation between them left out."""
        for name, now in _in_slots(target).items():
            planned = target.params[name]
            if now is planned or not isinstance(now, Tensor) or now.grad_fn is None:
                continue
            param = self.state.params.get(id(planned), (f"{target.name}.{name}",))[0]
            self.backwards.abort()  # (what the backward wrote before it reached this call)
            raise UnsupportedError(
                f"{target.where}: its '{name}' holds a tensor computed from others "
                f"({type(now.grad_fn).__name__}: torch.func.functional_call given weights such "
                "as p * s, made before the call) as the call runs again during the backward "
                "(reentrant activation checkpointing), where gradhooks cannot follow that "
                f"tensor back to '{param}': its per-example gradient would be written as the "
                "parameter's own. Use torch.utils.checkpoint.checkpoint(..., "
                "use_reentrant=False), or call functional_call on the model around the "
                "checkpointed part."
            )

    def _check_rerun(self, target: Target, args: tuple, kwargs: dict) -> None:
        """Refuses a call run again during the backward (:meth:`_note_rerun`) whose rule would
        read the examples from a dimension that does not hold them, one each, or whose
        parameter slot holds a tensor computed from others (:meth:`_refuse_derived_rerun`)."""
        if not self.state.sharded:
            self._refuse_derived_rerun(target)
        noted = self.state.reruns.get(id(target.module))
        if noted is None:
            return
        found, batch = noted
        dim = self._rule_dim(target)
        first = next((t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)), None)
        rows = first.shape[dim] if first is not None and first.dim() > dim else None
        if found is None and rows in (None, batch):
            return
        held = (
            f"its input held the examples of the batch of {batch} on {found}"
            if found is not None
            else f"its input has {rows} rows on dimension {dim}"
        )
        self.backwards.abort()  # (what the backward wrote before it reached this call)
        raise BatchNotFoundError(
            f"{target.where}: it ran under "
            "torch.no_grad() in the forward and runs again during the backward (reentrant "
            "activation checkpointing, or a reversible layer's own autograd.Function, which "
            "recomputes its blocks), where gradhooks cannot follow the batch; in the forward, "
            f"{held}, but its rule reads one example per row of dimension {dim} of its "
            f"input ({_shapes(args, kwargs)}): each example's gradient would be split among rows "
            "or mixed with others'. Use torch.utils.checkpoint.checkpoint(..., "
            "use_reentrant=False), run the layers without the recomputation (reversible=False), "
            "or freeze this layer's parameters."
        )

    def kept_call(
        self,
        target: Target,
        live: dict,
        args: tuple,
        kwargs: dict,
        output: Any,
        layout: CallLayout | None = None,
        ins: list | None = None,
        outs: list | None = None,
    ) -> tuple[Call, CallState]:
        """What a captured forward call keeps until its backward, registered with the root
        forward it runs in. ``ins``, ``outs``: ``tree_leaves((args, kwargs))`` and
        ``tree_leaves(output)``, where the caller has them."""
        autocast = autocast_on()
        # (FSDP2's sharded ones are not what the call ran with: the rule reads the module's)
        slots = None if self.state.sharded else _in_slots(target)
        state_now = autocast_state() if autocast else ()
        if slots is None:
            versions = None
        elif autocast and torch.is_autocast_cache_enabled():
            # (the casts autocast's cache holds may be of versions before a step in its block)
            versions = cast_versions(slots, state_now)
        else:
            versions = {n: _torch.version(t) for n, t in slots.items()}
        call = Call(
            module=target.module,
            inputs=detach_tree(args),
            kwargs=detach_tree(kwargs),
            output=detach_tree(output) if target.entry.needs_output else None,
            grad_outputs=(),
            name=target.name,
            registry=self.state.registry,
            hooked=self.state.hooked,
            memo=target.memo,
            autocast=state_now,
            params=slots,
            versions=versions,
            modes=tuple([m.training for m in target.modules]),
        )
        if _torch.mutation_on_saved_allowed():
            call = _copied(call)
        frame = self.state.frames[-1] if self.state.frames else None
        inputs = call.inputs
        if target.entry is not FALLBACK and inputs and type(inputs[0]) is Tensor:
            kept = [inputs[0]]  # (a rule computes from its first input; the fallback from all)
        else:
            kept = [t for t in tree_leaves((inputs, call.kwargs)) if isinstance(t, Tensor)]
            if target.entry is not FALLBACK:
                kept = kept[:1]
        if len(kept) == 1:  # (the usual: a rule's first input; no generator to run)
            versions: tuple = ((kept[0], _torch.version(kept[0])),)
        else:
            versions = tuple((t, _torch.version(t)) for t in kept)
        state = CallState(live, frame, layout=layout, versions=versions)
        state.in_backward = graph_task() != -1
        if call.output is not None:
            state.out_versions = tuple(
                (i, _torch.version(t))
                for i, t in enumerate(tree_leaves(call.output))
                if isinstance(t, Tensor)
            )
        tracker = frame.tracker if frame is not None else None
        if tracker is not None and layout is not None and layout.kind in ("plain", "fold", "moved"):
            if ins is None:
                ins = tree_leaves((args, kwargs))
            if outs is None:
                outs = tree_leaves(output)
            if target.entry is FALLBACK:  # (recomputed per example as split: never made shared)
                tracker.joined |= frozenset().union(
                    *(tracker.lineage.get(t, frozenset()) for t in ins if isinstance(t, Tensor))
                )
            else:
                tracker.note_call(ins, outs, lambda outputs: self._made_shared(
                    target, state, len(ins), outputs, tracker))  # fmt: skip
        if frame is not None:
            frame.states.append(state)
            frame.signature.append((id(target), None if layout is None else layout.kind))
            if not frame.unprobed and _torch.saved_tensor_hooks_active():
                frame.unprobed = True  # (run again at the backward)
        # (the leaves of (args, output): those of (args, kwargs) where there is no keyword)
        leaves = [*ins, *outs] if ins is not None and outs is not None and not kwargs else None
        state.precision = call_precision(args, output, autocast, leaves)
        if frame is not None and frame.products is not None and state.precision is torch.float32:
            state.precision = frame.products  # (its products rounded in bfloat16)
        return call, state

    def functional_use(self, func, name: str, args: tuple, kwargs: dict, direct: list, tracker):
        """A parameter used directly in a torch function the registry has a rule for
        (``F.linear``: a tied output layer): the function's call is captured as a hooked
        module's would be. ``NotImplemented`` where that does not apply."""
        spec = self.state.registry.function(name)
        if spec is None:
            return NotImplemented
        entry, roles, (in_pos, in_key), applies = spec
        if not applies(args, kwargs):
            return NotImplemented
        x = args[in_pos] if len(args) > in_pos else kwargs.get(in_key)
        lay = tracker.layout(x)
        if lay is None or lay is UNKNOWN or lay is PACKED:
            return NotImplemented
        named = {}
        for role, (pos, key) in roles.items():
            t = args[pos] if len(args) > pos else kwargs.get(key)
            if isinstance(t, Tensor) and any(t is d for d in direct):
                named[role] = t
        if len(named) != len(direct):
            return NotImplemented
        out = func(*args, **kwargs)
        tracker.propagate(name, args, kwargs, out)
        if not isinstance(out, Tensor) or not out.requires_grad:
            return out
        if _torch.is_view(out):
            # F.linear on [batch, seq, in] returns a view, whose gradient hook an in-place
            # change (`out += lora(x)`) would drop: the same memory, as an output of its own
            old, out = out, unview(out)
            tracker.carry(old, out)
        key = (name, *(id(p) for p in named.values()))
        target = self.functional_targets.get(key)
        if target is None:
            names = [self.state.params[id(p)][0] for p in named.values()]
            owner = self.backwards.owner(names[0])
            label = ", ".join(f"'{n}'" for n in names)
            target = Target(f"{label} used in {name}", owner, entry, named)
            self.functional_targets[key] = target
        call, state = self.kept_call(target, named, (x,), {}, out, self.layouts.call_layout(
            target, (x,), {}, out, tracker))  # fmt: skip
        if self.state.collector is not None:
            self.state.collector.expect(named)
        held = Held(call, (x,), {}, [], state)

        def hook(g: Tensor) -> None:
            if self.state.rerunning:
                return
            if held.released:
                return self.backwards.released(target, state)
            filled = with_fields(held.call, grad_outputs=(g,))
            if self.backwards.on_grads(target, state, filled, held.args, {}):
                self.backwards.spend(held)

        out.register_hook(hook)
        for sink in self.edge_sinks:
            sink.add(out)
        return out

    def _made_shared(
        self, target: Target, state: CallState, n_inputs: int, outputs: list, tracker: Tracker
    ) -> list:
        """A call kept as batched, on model inputs taken as batched by their size alone, that
        the tracker found shared by every example after all (:meth:`Tracker.note_call`): a
        batch-free call, its outputs that require grad sources. Returns their sources."""
        sources = []
        for t in outputs:
            s = None
            if t.requires_grad:
                s = Source(target.name, t.shape)
                tracker.add_source(t, s)
            sources.append(s)
        layout = CallLayout("shared", tracker.batch, None, (None,) * n_inputs,
                            (None,) * len(outputs))  # fmt: skip
        layout.sources = tuple(sources)
        state.layout = layout
        return sources

    def keep_unhooked_call(self, target: Target, args: tuple, kwargs: dict, output: Any):
        """The start of capturing a call whose parameters autograd does not see (run detached,
        or with grad mode off): its forward check, its kept call and the collector's
        expectation of its live parameters. Returns ``(call, state)``."""
        if target.entry.on_forward is not None:
            target.entry.on_forward(target.module, target.name)
        live = {n: p for n, p in target.params.items() if p.requires_grad}
        layout = self.layouts.call_layout(target, args, kwargs, output, self.tracker())
        call, state = self.kept_call(target, live, args, kwargs, output, layout)
        if self.state.collector is not None:
            self.state.collector.expect(live)
        return call, state

    def on_root_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        if module is not self.state.model:
            return None  # a copy
        self.refuse_concurrent(module)
        return self._open_planned(module, args, kwargs)[1]

    def refuse_concurrent(self, module: nn.Module) -> None:
        """A forward of the model (or of a module of it called on its own) started in one
        thread while another thread's runs: both would be followed in the one stack of
        forwards (a layer's call taken for the other's, the batch's tracker entered in one
        thread and left in the other), and the first thread's backward refused or its
        ``grad1`` mixed. Refused in the thread that starts second, before anything of it is
        captured; the first runs on. (Not within a backward: activation checkpointing runs a
        forward again in autograd's thread.)"""
        frames = self.state.frames
        if not frames or frames[-1].thread == threading.get_ident() or graph_task() != -1:
            return
        model = self.state.model
        name = next((n for n, m in model.named_modules() if m is module), None) if model else None
        owner = frames[-1].owner
        raise StateError(
            f"{describe_module(name or None, module)}: called in one thread while a forward "
            f"of the hooked model ({type(owner).__qualname__}) runs in another: gradhooks follows one forward of a hooked model at a time. Run the "
            "forwards (and their backwards) one after the other, a threading.Lock held "
            "across each, or give the other thread a copy of the model (copy.deepcopy, not "
            "hooked). Nothing of this call was captured; the other thread's forward runs on."
        )

    def _open_planned(
        self, module: nn.Module, args: tuple, kwargs: dict
    ) -> tuple[bool, tuple | None]:
        """:meth:`_open_frame` for ``module``'s call, and the hooks planned again there run
        in the place of the dead ones. Returns whether they were planned again, and the
        ``(args, kwargs)`` a new hook gave (``None`` where none did)."""
        made = Hook.made
        self._open_frame(module, args, kwargs)
        if Hook.made == made:
            return False, None  # (no hook made since: none planned again)
        # Where the hooks were planned again here (torch.func.functional_call put other tensors
        # in the parameter slots of the module it calls: the root, or a submodule called on its
        # own), torch runs the module's pre-hooks from its copy taken before: the module's new
        # ones would miss this call (its tracker would take the call's own uses of the
        # parameters for uses outside it, and count them twice). They run here, in the place of
        # the old ones, which are dead.
        new = [
            h for h in _torch.forward_pre_hooks(module) if isinstance(h, Hook) and h.serial >= made
        ]  # fmt: skip
        given = None
        for h in new:
            out = h(module, args, kwargs)
            if out is not None:
                args, kwargs = given = out
        return bool(new), given

    def entry_hooks(self, module: nn.Module) -> tuple[Any, Any]:
        """The forward pre- and post-hook of a module of the model other than the root that
        holds a hooked module (or is one): where it is called outside the model's own forward
        (``model.encoder(x)``, a method such as ``get_image_features`` that calls submodules
        rather than ``forward``), its call is a forward of the model's, with the batch followed
        from its inputs, as the root's would be."""
        ref = weakref.ref(module)

        def pre(m: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
            if m is ref():
                self.refuse_concurrent(m)
            # (not during a backward: activation checkpointing running a block again)
            if not self.state.frames and m is ref() and graph_task() == -1:
                replanned, given = self._open_planned(m, args, kwargs)
                if replanned:  # (the module's other hooks of ours are dead: enter_hook)
                    return (args, kwargs) if given is None else given
            return None

        def post(m: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if m is ref():
                self.on_root_post(m, args, kwargs, output)

        return pre, post

    def _open_frame(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A forward of the model starts: ``module``'s call (the root's, or an entry's:
        :meth:`entry_hooks`)."""
        if self.state.spent and graph_task() == -1:
            release_spent(self.state)  # (what a backward that failed on the way left)
        frame = Frame(None, [], torch.is_grad_enabled(), owner=module)
        frame.products = float32_products()
        self.state.frames.append(frame)  # first: the post-hook pops it even if this raises
        if len(self.state.frames) == 1 and graph_task() == -1:
            self.state.reruns.clear()  # (noted again by this forward's calls)
        self.layer_outputs.follow()
        if self.state.removed or not self.state.pause.on:
            return
        if not torch.is_grad_enabled() or _torch.in_transform(args, kwargs):
            return
        refuse_nested(lambda: f"'{type(module).__qualname__}' (the model)", args, kwargs)
        model = self.state.model
        self.state.training_at_forward = (model if model is not None else module).training
        if self.state.batch_dim is not None:
            refuse_packed(module, args, kwargs)
        if graph_task() == -1:
            self.backwards.drop_stale()
        self.follow_changes(self.state.model)
        leaves = input_tensors(args, kwargs)
        if not leaves or self.state.batch_dim is None:
            return
        if self.state.batch_dim == "auto":
            # (one pass: the sizes of each input's first two dimensions, and its first input
            # with a dimension)
            sizes, first = frame.sizes, None
            for t in leaves:
                shape = t.shape
                sizes.update(shape[:2])
                if first is None and shape:
                    first = t
            if first is not None and first.numel() == 0 and first.shape[0] > 0:
                frame.empty = tuple(first.shape)
            if first is None:  # (every tensor input without dimensions)
                raise UnbatchedInputError(
                    f"{type(module).__qualname__}'s tensor inputs have no dimensions "
                    f"({', '.join(str(tuple(t.shape)) for t in leaves)}): no batch of examples. "
                    "Add a batch dimension (x.unsqueeze(0) for one example)."
                )
            if first is not None and len(leaves) > 2:
                _warn_batch_taken_alone(module, args, kwargs, first, leaves)
            self._start_tracker(frame, args, kwargs, leaves)
            return
        # (the first with that dimension: a time-major batch's lengths, [batch], may come first)
        first = next((t for t in leaves if t.dim() > self.state.batch_dim), None)
        if first is None:
            raise UnbatchedInputError(
                f"{type(module).__qualname__}'s tensor inputs have shapes "
                f"{', '.join(str(tuple(t.shape)) for t in leaves)}: none has a dimension "
                f"{self.state.batch_dim}, where add_hooks(model, batch_dim="
                f"{self.state.batch_dim}) says the examples are. Give batch_dim the dimension "
                "that holds the examples (0 for [batch, ...], 1 for a time-major [seq, batch, "
                "...]), or 'auto'; for one example, add the batch dimension (x.unsqueeze(0))."
            )
        frame.batch = first.shape[self.state.batch_dim]
        if self.state.grad1:
            self.backwards.refuse_large(frame.batch)  # before the forward allocates anything
        self._start_tracker(frame, args, kwargs, leaves)

    def _start_tracker(self, frame: Frame, args: tuple, kwargs: dict, leaves: list) -> None:
        """Follow the batch through this forward (:mod:`gradhooks.tracking.layout`); ``leaves``:
        its tensor inputs (:func:`input_tensors`)."""
        if is_compiling():
            return
        found = root_batch(args, kwargs, self.state.batch_dim, leaves)
        if found is None:
            return
        batch, layouts = found
        if batch == 0:
            frame.batch = 0  # (no example: nothing to follow, and every grad1 has no row)
            return
        tracker = Tracker(batch, self.state.params, self.state.link)
        for packed in (*args, *kwargs.values()):
            if isinstance(packed, PackedSequence):
                # (packed in another order than the batch's)
                if packed.sorted_indices is not None:
                    tracker.packed_orders[packed.batch_sizes] = packed.sorted_indices
                tracker.note_packed(packed.data, packed.batch_sizes, packed.sorted_indices)
        for i, (t, lay) in enumerate(layouts):
            if i and lay is not PACKED:
                tracker.add_candidate(t, lay, next(k for k, x in enumerate(leaves) if x is t))
            elif lay is PACKED:
                tracker.set_layout(t, lay)
            else:
                tracker.give(t, lay)
        if self.state.batch_dim == "auto" and layouts[0][1] is not PACKED:
            tracker.note_listed(listed_with(layouts[0][0], args, kwargs))
        frame.roots = leaves
        if layouts[0][1] is not PACKED:
            frame.rows = rows_in_memory(layouts[0][0], layouts[0][1].dim)
        frame.tracker = tracker
        tracker.__enter__()
        frame.scripted = follow_scripted(tracker, self.state.scripted)

    def stop_tracker(self, frame: Frame) -> None:
        tracker, frame.tracker = frame.tracker, None
        if tracker is not None and tracker.shared_inputs:
            frame.shared = tuple(tracker.shared_inputs)
        if frame.scripted is not None:
            frame.scripted.remove()
            frame.scripted = None
        if tracker is not None:
            tracker.__exit__(None, None, None)
            tracker.finish()

    def on_root_post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        frames = self.state.frames
        if not frames or frames[-1].owner is not module:
            return  # (a copy; an entry called inside the model's forward)
        if frames[-1].thread != threading.get_ident():
            return  # (a call refused as another thread's forward ran: refuse_concurrent)
        frame = self.state.frames.pop()
        tracker = frame.tracker
        self.stop_tracker(frame)
        frame.roots = []  # (read while the forward runs; kept, they would hold its inputs' graph)
        raised = sys.exc_info()[1] is not None
        leaves = None if tracker is None and not frame.sizes else tree_leaves(output)
        if tracker is not None and not raised:
            self.verifier.check_listed(module, tracker)
            self.verifier.check_output(module, tracker, output, leaves)
        # (a forward that captured no call but used parameters directly, all of whose
        # per-example gradients the tracker forms, a module without a rule computing op(x * w):
        # checked as a set of calls is, where an operation gradhooks cannot see into mixes the
        # examples' rows unseen)
        sig = frame.signature or [(pid, "direct") for pid in dict.fromkeys(frame.direct)]
        if sig:
            sig = tuple(sig)
            # (verified by the next backward that captures: the first of each new set of calls,
            # and again at the 2nd, 4th, 8th... backward of the handle, where what changed since
            # without changing the calls, a hook or a loss term added later, shows)
            if sig not in self.state.verified or (
                self.state.verify and power_of_two(self.state.backwards + 1)
            ):
                self.state.verified.add(sig)
                self.state.unverified.add(sig)
            # (every forward of calls awaiting their check is armed: the backward that checks
            # them may be of this one, or of the one before, where a forward in between is never
            # backpropagated, a batch's outputs logged with grad on)
            if sig in self.state.unverified and tracker is not None and not raised:
                self.verifier.arm_probe(frame, tracker, output)
        if self.state.batch_dim == "auto" and frame.sizes:
            sizes = frame.sizes
            for t in leaves:
                if isinstance(t, Tensor):
                    sizes.update(t.shape[:2])
        if output is None and raised:
            # the forward raised: what it captured will never be backpropagated
            for state in frame.states:
                state.cancelled = True
                if self.state.collector is not None:
                    self.state.collector.unexpect(state.params)
        # (read while the forward ends; kept, each call's state and the frame would refer to
        # each other, held until Python's cyclic garbage collector runs)
        frame.states = []


class UsualCall:
    """What a hooked module's last usual call decided (:meth:`ForwardCapture.replay_usual`),
    each replayed while what it was decided from is the same: its layout (from its input's and
    output's layouts, the batch, whether its input is the forward's own and the dimension its
    rule reads; a :class:`CallLayout` is never changed once made, and the calls that replay it
    share it), whether its rule sees the rows as the forward ran them (from that layout), its
    precision (from its input's and output's dtypes) and its record less its tensors (from
    the module, its handle's registry and hooked modules, and its rule's memo)."""

    __slots__ = ("layout", "dim", "rows", "dtypes", "precision", "call")

    def __init__(self) -> None:
        self.layout: CallLayout | None = None
        self.dim: Any = None
        self.rows = False  # keeps_rows(layout)
        self.dtypes: tuple = ()
        self.precision: torch.dtype | None = None
        self.call: Call | None = None


# what replay_usual gives where the full path must run
FULL = object()


# what _note_rerun notes of a call whose inputs do not depend on the examples
_NO_EXAMPLES = "no dimension (its inputs do not depend on them)"


def refuse_nested(where: str | Callable[[], str], *trees: Any) -> None:
    """A nested tensor (``torch.nested``, jagged or strided) holds its examples as rows of
    different lengths: no rule reads a per-example gradient from it, and following its batch
    would fail deep inside torch. Refused where it enters the model or a hooked call
    (``where``: the name of that, or what makes it, called only to say so)."""
    if all(_plain_tensors(tree) for tree in trees):
        return  # (the usual call: dense tensors in a tuple, no keyword; no tree to walk)
    for t in tree_leaves(trees):
        if isinstance(t, Tensor) and t.is_nested:
            if callable(where):
                where = where()
            raise UnsupportedInputError(
                f"{where} got a nested tensor (torch.nested, layout {t.layout}, {t.dim()} "
                "dimensions, the examples of different lengths): gradhooks computes per-example "
                "gradients of dense tensors only. Pad the examples into one tensor "
                "(nt.to_padded_tensor(0.0)) and mask what is padding (an attention mask, or "
                "zeros in the loss), or compute them one example at a time "
                "(gradhooks.oracle.loop_grad); under `with h.paused():` the model runs on "
                "nested tensors without per-example gradients."
            )


def _plain_tensors(tree: Any) -> bool:
    """``tree`` is an empty dict, or a tuple of dense tensors (none nested)."""
    if type(tree) is dict:
        return not tree
    if type(tree) is not tuple:
        return False
    for t in tree:  # (a loop, not a generator: asked at every hooked call)
        if type(t) is not Tensor or t.is_nested:
            return False
    return True


# the names under which a model takes the boundaries of the sequences packed along one
# dimension: flash-attention's varlen API, Hugging Face's padding-free path
# (DataCollatorWithFlattening(return_flash_attn_kwargs=True) / return_seq_idx=True)
_PACKING_NAMES = ("cu_seqlens", "cu_seqlens_q", "cu_seqlens_k", "cu_seq_lens_q",
                  "cu_seq_lens_k", "seq_idx")  # fmt: skip


def _warn_batch_taken_alone(
    module: nn.Module, args: tuple, kwargs: dict, first: Tensor, leaves: list[Tensor]
) -> None:
    """The batch is dimension 0 of the model's first tensor input. Where that tensor is held
    in a container (not an argument itself), at least two others agree on another count on
    dimension 0, and none has its count on another dimension (a batch-first LSTM's state
    ``[layers, batch, hidden]`` has) or, for a count of 1 (which broadcast dimensions have),
    it holds one number (a batch whose first tensor is metadata: ``{"meta": {"temperature":
    t}, "x": x, "y": y}``), the layers will find their inputs without the examples: say where
    the batch was taken from, before the error that follows does not."""
    if any(a is first for a in (*args, *kwargs.values())):
        return
    count = first.shape[0]
    others = [t for t in leaves if t is not first and t.dim() > 0]
    rows = {t.shape[0] for t in others}
    if len(others) < 2 or len(rows) != 1 or count in rows:
        return
    if first.numel() != 1 if count == 1 else any(count in t.shape[1:] for t in others):
        return
    paths = _paths_of(_named_inputs(module, args, kwargs))

    def named(t: Tensor) -> str:
        return f"{paths.get(id(t), 'a tensor')} {tuple(t.shape)}"

    shown = ", ".join(named(t) for t in others[:3]) + (", ..." if len(others) > 3 else "")
    warnings.warn(
        f"{type(module).__qualname__}: the batch was taken from dimension 0 of its first tensor "
        f"input, {named(first)}: {count} example{'s' if count != 1 else ''}; its other tensor "
        f"inputs ({shown}) all have {rows.pop()} rows there. If those rows are the examples, "
        "put a tensor that holds them first among the model's inputs.",
        GradhooksWarning,
        stacklevel=2,
    )


def _paths_of(named: dict[str, Any]) -> dict[int, str]:
    """Where each tensor among a call's named inputs is, as Python would index it
    (``batch['meta']['temperature']``), by id."""
    found: dict[int, str] = {}
    todo: list[tuple[str, Any]] = list(named.items())
    while todo:
        path, tree = todo.pop()
        if isinstance(tree, Tensor):
            found.setdefault(id(tree), path)
        elif isinstance(tree, collections.abc.Mapping):
            todo.extend((f"{path}[{k!r}]", v) for k, v in tree.items())
        elif type(tree) in (list, tuple):
            todo.extend((f"{path}[{i}]", v) for i, v in enumerate(tree))
    return found


def _named_inputs(module: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's inputs by the names of ``module.forward``'s parameters (keyword arguments
    by their own; positional ones where the signature binds them)."""
    if not args:
        return dict(kwargs)
    try:
        bound = _signature(module.forward).bind_partial(*args)
    except (TypeError, ValueError):  # (a signature torch cannot read: keywords only)
        return dict(kwargs)
    return {**bound.arguments, **kwargs}


# the signatures of the forward methods of modules' classes, the module not among the parameters
# (inspect.signature reads a function anew at every call, and a forward is entered at every step)
_SIGNATURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _signature(forward: Callable) -> inspect.Signature:
    """``inspect.signature(forward)``, for a bound method from its function's, read once."""
    func = getattr(forward, "__func__", None)
    if func is None or getattr(forward, "__self__", None) is None:
        return inspect.signature(forward)
    sig = _SIGNATURES.get(func)
    if sig is None:
        sig = inspect.signature(forward)
        try:
            _SIGNATURES[func] = sig
        except TypeError:  # (not weakly referable)
            pass
    return sig


# the inputs refuse_packed reads
_WATCHED = frozenset((*_PACKING_NAMES, "position_ids"))
# by forward function: the position of its first positional parameter named in _WATCHED
# (the number of its parameters where none is)
_FIRST_WATCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _may_take_watched(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether a call may pass one of the inputs :func:`refuse_packed` reads: by keyword, or
    by position where ``module.forward``'s signature binds one there (``True`` where the
    signature is not known)."""
    if any(k in _WATCHED for k in kwargs):
        return True
    if not args:
        return False
    forward = module.forward
    func = getattr(forward, "__func__", None)
    if func is None or getattr(forward, "__self__", None) is None:
        return True
    first = _FIRST_WATCHED.get(func)
    if first is None:
        try:
            params = list(_signature(forward).parameters.values())
        except (TypeError, ValueError):
            return True
        first = next(
            (i for i, p in enumerate(params) if p.name in _WATCHED and p.kind in _POSITIONAL),
            len(params),
        )
        try:
            _FIRST_WATCHED[func] = first
        except TypeError:  # (not weakly referable)
            pass
    return len(args) > first


def refuse_packed(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Sequences packed along one dimension, without padding: flash-attention's varlen inputs
    (``x [total_tokens, ...]`` with ``cu_seqlens``) and Hugging Face's padding-free batches
    (``DataCollatorWithFlattening``: ``input_ids [1, total_tokens]`` with ``position_ids``
    starting again at each sequence, and no ``attention_mask``). Each sequence is an example,
    but the batch is taken from a dimension of the input, whose entries are then tokens or a
    whole pack of sequences: every ``grad1`` would be silently another quantity. Refused where
    the model is entered, before its forward runs."""
    if not _may_take_watched(module, args, kwargs):
        return  # (the usual forward: none of the inputs read below)
    named = _named_inputs(module, args, kwargs)
    where = f"'{type(module).__qualname__}' (the model)"
    remedy = (
        "gradhooks takes the examples from a dimension of the input (each entry of it one "
        "example), so it cannot tell the sequences apart and every grad1 would be silently "
        "another quantity. Give the model a padded batch instead, one sequence per row "
        "([sequences, longest, ...]) with an attention_mask (transformers: "
        "DataCollatorWithPadding, or DataCollatorForLanguageModeling, rather than "
        "DataCollatorWithFlattening), and mask the padding out of the loss (labels -100); or "
        "compute the gradients one sequence at a time (gradhooks.oracle.loop_grad)."
    )
    for name in _PACKING_NAMES:
        t = named.get(name)
        if isinstance(t, Tensor):
            raise UnsupportedInputError(
                f"{where} got {name} (shape {tuple(t.shape)}): several sequences packed "
                f"along one dimension of its input ({_shapes_of(named)}), each sequence an "
                f"example. {remedy}"
            )
    pos = named.get("position_ids")
    if (
        isinstance(pos, Tensor)
        and pos.dim() >= 1
        and pos.shape[-1] > 1
        and not pos.is_floating_point()
        and named.get("attention_mask") is None
        and not is_compiling()
    ):
        with torch.no_grad():
            rows = pos.reshape(-1, pos.shape[-1])
            packs = (rows.diff(dim=-1) != 1).any(-1).nonzero()
        if packs.numel():
            row = rows[int(packs[0, 0])]
            shown = row[:12].tolist()
            raise UnsupportedInputError(
                f"{where} got position_ids (shape {tuple(pos.shape)}) that start again within "
                f"a row ({shown}{' ...' if row.numel() > 12 else ''}) and no attention_mask: "
                f"several sequences packed into one row of its input ({_shapes_of(named)}), "
                "as DataCollatorWithFlattening gives them (a Hugging Face model then keeps "
                "them apart only where it builds its attention mask from position_ids, and "
                "otherwise attends across them). Each sequence is an example, but the row "
                f"holds them all. {remedy} (position_ids of a padded batch come with its "
                "attention_mask, and are then accepted.)"
            )


def _shapes_of(named: dict[str, Any]) -> str:
    return ", ".join(f"{k} {tuple(v.shape)}" for k, v in named.items() if isinstance(v, Tensor))


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


def _requires_grad_input(args: tuple, kwargs: dict) -> bool:
    """Whether a call run with grad mode off was given a tensor that requires grad: made
    before grad mode went off, as the inputs of a reentrant checkpoint's function are."""
    return any(isinstance(t, Tensor) and t.requires_grad for t in tree_leaves((args, kwargs)))


def _refuse_shallow_copy(target: Target, copied: nn.Module, hooked: dict) -> None:
    """A shallow copy of a hooked module (learn2learn's ``clone_module``, ``copy.copy``)
    shares the module's hooks, which were planned for the module, not for the copy: its calls
    are not captured. Where its parameter slots hold hooked parameters, or tensors computed
    from them (``p.clone()``, then ``p - lr * g``), a backward through its call would give
    them a gradient without ``grad1``: refused at the call, before a backward can reach it.
    (A copy whose slots hold tensors of its own is not the hooked model: left alone.)"""
    for slot, t in _torch.own_parameters(copied).items():
        if t is None or not t.requires_grad:
            continue
        found = [t] if id(t) in hooked else []
        if not found and t.grad_fn is not None:
            found = [q for q in leaves_of(t) if id(q) in hooked]
        if found:
            name = hooked[id(found[0])][0]
            held = (
                f"the hooked parameter '{name}'"
                if found[0] is t
                else f"a tensor computed from the hooked parameter '{name}'"
            )
            raise UnsupportedError(
                f"'{target.name}' ({type(copied).__qualname__}) was called through a shallow "
                "copy of it (learn2learn's clone_module, copy.copy), which shares its hooks "
                f"but not its identity: the copy's calls are not captured, and its '{slot}' "
                f"holds {held} {tuple(t.shape)}, which a backward through this call would "
                "give a gradient without grad1. Call the hooked model itself with other "
                "weights, torch.func.functional_call(model, {name: tensor}, x) (fast weights "
                "such as p - lr * g get grad1 through them), or run the copy under `with "
                "h.paused():`."
            )


def _copied(call: Call) -> Call:
    """``call`` with copies of its input and output tensors, under
    ``torch.autograd.graph.allow_mutation_on_saved_tensors()``: there autograd keeps a copy of
    a saved tensor that is changed in place after the forward (the batch normalized for a
    log, a weight decayed in place before the backward), and its backward computes from the
    values of the forward; so must the rules, those that read the parameters too (the
    fallback, the Transformer layers', the recurrent layers'): each call keeps a copy of its
    parameters' values (a leaf of its own that requires grad where the parameter does) as the
    forward ran with them (memory: one copy of the hooked
    parameters per forward, under the context only)."""

    def own(t):
        return t.clone() if isinstance(t, Tensor) else t

    params = call.params
    if params is not None:
        params = {n: t.detach().clone().requires_grad_(t.requires_grad) for n, t in params.items()}
    return with_fields(
        call, inputs=tree_map(own, call.inputs), kwargs=tree_map(own, call.kwargs),
        output=tree_map(own, call.output), params=params,
        versions=None if params is None else {n: _torch.version(t) for n, t in params.items()},
    )  # fmt: skip


def _in_slots(target: Target) -> dict[str, Tensor]:
    """The tensors in the slots of ``target``'s parameters as its call runs: its planned
    parameters, or what ``torch.func.functional_call`` put in their place for the call (the
    engine plans again where a trainable one was replaced, not where only a frozen one was)."""
    module = target.module
    found = {}
    own = None  # (the module's own parameters, read once for all its own slots)
    for name, planned in target.params.items():
        if "." in name:
            owner, _, leaf = name.rpartition(".")
            of = module.get_submodule(owner)
            slots = _torch.own_parameters(of)
        else:
            of, leaf = module, name
            if own is None:
                own = _torch.own_parameters(module)
            slots = own
        # (read from the module's parameters, where ``getattr`` looks last, after a Python
        # ``__getattr__``: 8x faster; an attribute of the instance shadows them, as for getattr)
        now = slots.get(leaf, _ABSENT)
        if now is _ABSENT or leaf in of.__dict__:
            now = getattr(of, leaf, planned)
        found[name] = now
    return found


_ABSENT = object()


def _used_by_fallback(target: Target, live: dict, used, tracker: Tracker, output) -> dict:
    """The parameters a call of a module without a rule used in operations of its own (not
    inside its hooked submodules' calls) that the fallback differentiates: those the tracker
    could not follow to where they met the batch cheaply (its sources for them are then
    dropped). A submodule's parameter it uses directly while also calling that submodule (or
    one that holds it) cannot be told apart in the recomputation (both uses would be counted)
    where that submodule's call gives a gradient for it too: an error. (Where it does not, as
    where the parameter is used in a method of the submodule the module calls besides its
    forward, the recomputation's gradient is that of the direct uses alone.)"""
    escaped = set()
    for t in tree_leaves(output):
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
    for n, p in kept.items():
        if id(p) not in used.claimed:
            continue
        parts = n.split(".")
        holders = (".".join(parts[:k]) for k in range(len(parts) - 1, 0, -1))
        prefix = next(
            (m for m in holders if id(target.module.get_submodule(m)) in used.called), None
        )
        if prefix is not None:
            raise UnsupportedError(
                f"{target.where} calls its "
                f"submodule '{prefix}' and also uses its parameter '{n}' directly; its "
                "per-example gradients cannot tell the two uses apart. Register a rule for "
                f"{type(target.module).__qualname__} with @gradhooks.register, or use the "
                "parameter only through the submodule."
            )
    return kept


_MODULE_KEYS = frozenset(nn.Module().__dict__)


def _escaping(
    target: Target, live: dict, args, kwargs, output, before=(), rehooked: bool = False
) -> list[Escaping]:
    """The tensors a call of a module without a rule computed from the parameters its
    fallback differentiates (``live``) that leave the call other than as its returned tensors:
    held by a function it returns (hyper-connections' ``branch_input, add_residual = hc(x)``,
    whose ``add_residual`` closes over the streams' mixing weights), or set on the module (an
    auxiliary loss kept as ``self.aux_loss``, a list of them, a buffer, an attribute of a
    plain object it holds: :func:`_kept_on`), other than those it kept ``before`` the call (an
    earlier call's outputs in a list of the module's). The fallback's recomputation
    differentiates through the returned tensors only, so a gradient that reaches the
    parameters through one of these would be left out of their ``grad1``: each is returned
    with the names of the parameters it depends on, for a hook that refuses the backward where
    a gradient flows through it (:meth:`BackwardWriter.escaped`), or, for one on the way to
    the returned tensors, where it gets one besides theirs (:mod:`.aside`).
    ``rehooked``: the call's returned tensors are each given a node of their own, which the
    engine hooks, so that a returned tensor kept as it was is on the way to them too."""
    held = [t for leaf in tree_leaves(output) for t in _held_tensors(leaf)]
    found_kept = {id(t) for t in before}  # (kept before the call: not its own)
    held.extend(t for t in _kept_on(target.module) if id(t) not in found_kept)
    held = [t for t in held if t.requires_grad and t.grad_fn is not None]
    if not held:
        return []
    targets = {}
    for n, p in live.items():
        node = accumulator_of(p)
        if node is not None:
            targets[node] = n
    inputs = {t.grad_fn for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
    returned = {t.grad_fn for t in tree_leaves(output) if isinstance(t, Tensor)}
    on_the_way = inputs | _nodes_from(list(returned), inputs)
    hooked = set() if rehooked else returned
    found, seen_tensors = [], set()
    for t in held:
        if id(t) in seen_tensors or t.grad_fn in inputs or t.grad_fn in hooked:
            continue  # (a returned tensor's whole gradient reaches the call's hooks)
        seen_tensors.add(id(t))
        reached = {targets[node] for node in _nodes_from([t.grad_fn], inputs) if node in targets}
        if reached:
            names = ", ".join(f"'{n}'" for n in sorted(reached))
            found.append(Escaping(t, names, t.grad_fn in on_the_way))
    return found


@dataclass(frozen=True)
class Escaping:
    """A tensor a call of a module without a rule keeps other than as a returned tensor
    (:func:`_escaping`), computed from its parameters ``names``. ``on_the_way``: the returned
    tensors are computed from it, so the gradient it gets includes theirs, through the call;
    a hook on it cannot tell that share from one that reaches it from outside (an auxiliary
    loss read from where it is kept), which the fallback would leave out, but by an account
    of who sent it (:func:`.aside.follow_aside`)."""

    tensor: Tensor
    names: str
    on_the_way: bool


def _kept_on(module: nn.Module) -> list[Tensor]:
    """The tensors ``module`` keeps in its own attributes: a tensor, or one in a list, tuple
    or dict (``self.aux_loss``, ``self.losses.append(...)``); a buffer (``self.aux_loss = ...``
    where ``aux_loss`` was registered as one); and those in the attributes of a plain object
    it holds (a ``SimpleNamespace``, a dataclass of statistics: ``self.stats.aux_loss``)."""
    found = [b for b in module.buffers(recurse=False) if b is not None]
    for key, value in module.__dict__.items():
        if key in _MODULE_KEYS:
            continue  # (torch's own: parameters, buffers, submodules, hooks)
        found.extend(_tensors_in(value))
        if not isinstance(value, _NOT_HOLDERS) and hasattr(value, "__dict__"):
            for item in vars(value).values():
                found.extend(_tensors_in(item))
    return found


# (attributes whose ``__dict__`` holds no tensor of a call: functions, classes, imported modules)
_NOT_HOLDERS = (Tensor, nn.Module, type, types.ModuleType, types.FunctionType, types.MethodType,
                functools.partial)  # fmt: skip


def _tensors_in(value: Any) -> list[Tensor]:
    """``value`` if it is a tensor, or the tensors in it if it is a list, tuple or dict."""
    if isinstance(value, (Tensor, list, tuple, dict)):
        return [t for t in tree_leaves(value) if isinstance(t, Tensor)]
    return []


def _nodes_from(roots: list, stop: set, limit: int = 100_000) -> set:
    """The autograd nodes reachable from ``roots`` without passing ``stop``."""
    seen: set = set()
    todo = list(roots)
    while todo and len(seen) < limit:
        node = todo.pop()
        if node is None or node in seen or node in stop:
            continue
        seen.add(node)
        todo.extend(f for f, _ in node.next_functions)
    return seen


def _held_tensors(leaf: Any, depth: int = 0) -> list[Tensor]:
    """The tensors a function among a call's outputs holds: its closure's cells, a
    ``functools.partial``'s arguments, and the containers and functions in them (two deep)."""
    if isinstance(leaf, Tensor) or isinstance(leaf, nn.Module) or depth > 2:
        return []
    found: list = []
    if isinstance(leaf, functools.partial):
        found = [leaf.func, *leaf.args, *leaf.keywords.values()]
    elif callable(leaf) and getattr(leaf, "__closure__", None):
        for cell in leaf.__closure__:
            try:
                found.append(cell.cell_contents)
            except ValueError:  # (a cell not filled yet)
                continue
    else:
        return []
    out = []
    for item in tree_leaves(found):
        if isinstance(item, Tensor):
            out.append(item)
        elif callable(item):
            out.extend(_held_tensors(item, depth + 1))
    return out


class _Edges(list):
    """:func:`output_edges`' list of gradient edges; ``numel``: the elements of the outputs
    they lead to (what one backward through them writes at least)."""

    numel = 0

    def add(self, t: Tensor) -> None:
        """The gradient edge of ``t``, an output of a hooked call."""
        self.append(torch.autograd.graph.get_gradient_edge(t))
        self.numel += t.numel()


@contextlib.contextmanager
def output_edges(
    modules: Iterable[nn.Module], forwards: ForwardCapture | None = None
) -> Iterator[_Edges]:
    """While a forward of the hooked model runs inside: the gradient edges of every hooked
    call's output tensors that require grad, in a list (the outputs themselves are not kept
    alive): the calls of ``modules``, and with ``forwards``, those of the torch functions it
    captures as calls (a module's own weight given to ``F.linear``, then an activation inside
    the same module: the module's output alone would stop the backward before it). A backward
    taken with respect to them, ``torch.autograd.grad(out, edges)``, reaches every hooked call,
    whose hooks then fire, without forming any parameter's batch gradient (for a convolution
    batched over several output-gradients, the largest part of the work)."""
    targets = {id(module) for module in modules}
    edges = _Edges()

    def collect(module: nn.Module, args, output) -> None:
        if id(module) in targets:
            for t in tree_leaves(output):
                if isinstance(t, Tensor) and t.requires_grad:
                    edges.add(t)

    handle = nn.modules.module.register_module_forward_hook(collect)
    if forwards is not None:
        forwards.edge_sinks.append(edges)
    try:
        yield edges
    finally:
        handle.remove()
        if forwards is not None:
            forwards.edge_sinks.remove(edges)

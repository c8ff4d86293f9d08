"""A backward of the hooked model: each captured call's pieces, from its rule, added to
``grad1`` and handed to the quantities; and the backward's bookkeeping (which parameters it
reached and computed, the parameters used outside their modules' calls, what a failed backward
leaves to undo).

:class:`BackwardWriter` is this part of a :class:`gradhooks.Hooks` handle. :meth:`BackwardWriter.on_grads` is where
the backward reaches a kept call (from its output's gradient hook, :mod:`gradhooks.engine.forward`, or
from a :class:`~gradhooks.engine.capture._Join` node); a parameter's own gradient hook
(:meth:`BackwardWriter.param_hook`) records what autograd computed; a callback at the backward's end
(:meth:`BackwardWriter._end_backward`) verifies, warns and rolls back.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor, nn

from .. import _torch
from .. import pieces as P
from ..errors import (
    BatchNotFoundError,
    ConfigurationTypeError,
    GradhooksWarning,
    MixedExamplesError,
    RuleError,
    StateError,
    UnbatchedInputError,
    UnsupportedError,
    listed_names,
)
from ..rules.registry import Call, _Entry
from .accumulation import all_zero, grad_of, sole_grad1
from .calls import (
    Held,
    KeptCall,
    aligned_call,
    blank_call,
    check_versions,
    describe_call,
    examples_of_empty_call,
    may_lack_batch,
    other_rows,
    release_spent,
    released_call,
    rule_pieces,
    unchanged_outputs,
)
from .compare import hold
from .memory import refuse_if_too_large
from .plan import Target, higher_order, owner_name
from .records import (
    Backward,
    CallLayout,
    CallState,
    Frame,
    HeldCall,
    autocast_devices,
    autocast_off,
    graph_task,
    half_precision,
    lowest_precision,
    with_fields,
)
from .state import CaptureState
from .verify import Verifier, keep_check_shares, per_example_outputs, rounding_tolerance


class BackwardWriter:
    """The backward side of :class:`gradhooks.Hooks`: pieces into ``grad1``, and bookkeeping."""

    # the other parts it calls, given by the handle that owns them all
    verifier: Verifier

    def __init__(self, state: CaptureState) -> None:
        self.state = state
        # the handle's hooking again of parameters its last planning dropped (Hooks._hook_dropped)
        self.hook_dropped: Callable[[Iterable[int]], set[int]] = lambda pids: set()
        # a Target per parameter used outside its modules' calls, for the fallback of its uses
        self.direct_targets: dict[int, Target] = {}

    def output_grads(self, kept: KeptCall, grads: Sequence[Tensor | None]) -> None:
        """The backward's entry point: it has the gradients of a kept call's outputs (those of
        ``kept.hooked``, in order). Hands the call to :meth:`on_grads`, or, for a rule with taps,
        waits for the tapped nodes (:meth:`node_grads`) or for the backward's end."""
        s = self.state
        carried = kept.carried
        if s.rerunning and not (s.probing and carried is not None):
            return  # a backward of the engine's own
        if s.dropped and any(id(p) in s.dropped for p in kept.live.values()):
            frozen = self.hook_dropped([id(p) for p in kept.live.values()])
            if frozen:
                self.backward_state().frozen.update(frozen)
        full: list[Tensor | None] = [None] * kept.n_leaves
        for i, g in zip(kept.hooked, grads):
            full[i] = g
        if carried is not None:  # (sums a backward that never reached it left: gone)
            carried.outputs = tuple(full)
            carried.sums.clear()
            if s.rerunning:
                return  # the probe's: the carried parameters' gradients by a rerun
        if kept.released:
            self.released(kept.target, kept.state)
            return
        capturing = s.mode.capture and not (s.removed or kept.state.cancelled)
        if kept.n_nodes and capturing and s.capturing_backward():
            # The rule runs when the backward reaches the tapped nodes too, or, if it
            # never does (a backward for some parameters only), at its end without them
            pending = kept.pending
            pending["outputs"] = tuple(full)
            bw = self.backward_state()
            bw.reached.update(id(p) for p in kept.live.values())  # before their own grads
            bw.pending[id(pending)] = lambda: self.on_grads(
                kept.target, kept.state, with_fields(kept.call, grad_outputs=pending.pop("outputs"),
                                                 taps=None), kept.args, kept.kwargs, kept.sums,
            )  # fmt: skip
            self.spend(kept)
            return
        filled = with_fields(kept.call, grad_outputs=tuple(full))
        if self.on_grads(kept.target, kept.state, filled, kept.args, kept.kwargs, kept.sums):
            self.spend(kept)

    def spend(self, held: KeptCall | Held) -> None:
        """A backward that does not keep its graph ran a call's rule: autograd frees what the
        graph saved, and what the call kept goes when that backward ends
        (:func:`~gradhooks.engine.calls.release_spent`); kept while the graph is
        (``retain_graph``: another backward may go through it)."""
        if _torch.backward_keeps_graph():
            return
        s = self.state
        if not s.spent:  # (the first since the last release: at this backward's end)
            _torch.queue_backward_callback(lambda: release_spent(s))
        s.spent.append(weakref.ref(held))

    def released(self, target: Target, state: CallState) -> None:
        """A backward reached a call whose inputs were let go of (:meth:`KeptCall.release`):
        refused where it would have captured the call (a backward it does not capture needs
        nothing of it)."""
        s = self.state
        if s.removed or not s.mode.capture or state.cancelled or s.probing:
            return
        if not s.capturing_backward():
            state.derived |= torch.is_grad_enabled()
            return
        self.refuse_released(target)

    def refuse_released(self, target: Target) -> None:
        """Refuse the backward (leaving nothing of it behind): it reached a released call."""
        self._abort_backward()
        raise StateError(released_call(target.name, target.module))

    def node_grads(self, kept: KeptCall, i: int, grad_outputs: tuple) -> None:
        """The backward reached node ``i`` of those a kept call's rule taps: once it has every
        node's gradients and the outputs', the call goes to :meth:`on_grads`."""
        pending = kept.pending
        if "outputs" not in pending or self.state.rerunning:
            return  # a backward not captured
        pending[i] = tuple(grad_outputs)
        if len(pending) < kept.n_nodes + 1:
            return
        tapped = tuple(pending[j] for j in range(kept.n_nodes))
        outputs = pending.pop("outputs")
        pending.clear()
        bw = self.state.tasks.get(graph_task())
        if bw is not None:
            bw.pending.pop(id(pending), None)
        done = with_fields(kept.call, grad_outputs=outputs, tap_grads=tapped)
        self.on_grads(kept.target, kept.state, done, kept.args, kept.kwargs, kept.sums)

    def on_grads(
        self,
        target: Target,
        state: CallState,
        call: Call,
        args,
        kwargs,
        sums: dict[str, Tensor] | None = None,
    ) -> bool:
        """The backward reached the outputs of one captured call. ``sums``: filled with the
        call's batch gradient of each parameter it writes ``grad1`` for. Returns whether the
        call's rule ran (what the call keeps may then go: :meth:`spend`)."""
        s = self.state
        if s.removed or not s.mode.capture or state.cancelled or s.probing:
            return False
        # Inside a backward, grad mode is on exactly when it was asked for with create_graph.
        create_graph = torch.is_grad_enabled()
        if not s.capturing_backward():
            state.derived |= create_graph
            return False
        if not s.vmapped and _batched(call.grad_outputs):
            # an is_grads_batched backward (torch.autograd.functional.jacobian(vectorize=True)):
            # a batch of output-gradients per example, no grad1 of its own (see _end_backward)
            bw = self.backward_state()
            bw.batched = bw.batched or target.quoted
            return False
        if s.kept_backprops is not None:
            s.kept_backprops.record(target.module, call, graph_task())
        bw = s.tasks.get(graph_task())
        if bw is None:  # (the backward's first: its record, begun)
            bw = self.backward_state()
        # (lowest_precision of them all, one at a time: most often each is the one before)
        precision = state.precision
        for g in call.grad_outputs:
            if isinstance(g, Tensor) and g.dtype is not precision:
                precision = lowest_precision(precision, g.dtype)
        if precision is not s.precision:
            s.precision = lowest_precision(s.precision, precision)
        if bw is not None and precision is not bw.precision:
            bw.precision = lowest_precision(bw.precision, precision)
        if state.derived:
            # Wrong only if this backward computes parameter gradients (not for the next
            # derivative of a Laplacian, with respect to the input): decided at its end.
            where = target.where
            if bw is None:
                raise UnsupportedError(higher_order(where))
            bw.derived = bw.derived or where
            return False
        state.derived = create_graph
        if create_graph:  # grad1 gets a graph: through the inputs too, so not detached
            call = with_fields(call, inputs=args, kwargs=kwargs)
        if bw is not None:
            ids = [id(p) for p in state.params.values()]
            bw.reached.update(ids)
            owned = call.input_grads is not None  # (run with grad mode off: owns_backward)
            bw.owned_calls += owned
            for pid in ids:
                bw.owned_only[pid] = owned and bw.owned_only.get(pid, True)
            if sums is None:  # (a call run detached gives its parameters no gradient of autograd's)
                bw.attached.update(ids)
            bw.inside = bw.inside or state.in_backward
        frame = state.frame
        new_rows = (
            bw is not None
            and frame is not None
            # (the usual: a forward it reached already, nothing kept for the probe)
            and (bw.verify or id(frame) not in bw.frames)
            and _note_frame(bw, frame, ids, target, self.state.shared_inputs)
        )
        try:
            if new_rows:
                self._check_rows(bw)
            check_versions(target, state)
            if state.out_versions:
                call = unchanged_outputs(call, state.out_versions)
            layout = state.layout
            if layout is not None and layout.kind == "shared":
                aligned = aligned_call(target, layout, call)
                if aligned is not None:
                    layout = aligned
                else:
                    call = per_example_outputs(
                        target, layout, call, create_graph, self.state.precision
                    )
            elif layout is not None and layout.sources:
                # (outputs of a call with examples that do not depend on them: their shares)
                call = per_example_outputs(target, layout, call, create_graph, self.state.precision)
            params, frame = state.params, state.frame
            if not bw.autocast:  # (the usual: no block to enter and leave per call)
                self._backward(target, params, call, frame, bw, sums, layout, create_graph)
            else:
                with autocast_off(bw.autocast):
                    self._backward(target, params, call, frame, bw, sums, layout, create_graph)
        except BaseException:
            self._abort_backward()
            raise
        return True

    def _backward(
        self,
        target: Target,
        params: dict[str, nn.Parameter],
        call: Call,
        frame: Frame | None = None,
        bw: Backward | None = None,
        sums: dict[str, Tensor] | None = None,
        layout: CallLayout | None = None,
        create_graph: bool | None = None,
    ) -> None:
        """``create_graph``: whether grad mode is on in this backward (``torch.is_grad_enabled()``,
        where the caller read it already)."""
        rule = target.entry.rule
        empty = examples_of_empty_call(self.state.batch_dim, call, frame, layout)
        try:
            if empty is not None:  # (no entry: a gradient of zeros for each example)
                pieces = {n: P.Direct(p.new_zeros((empty, *p.shape))) for n, p in params.items()}
            else:
                pieces = rule_pieces(target, params, call, layout)
        except Exception as e:
            msg = str(e)
            if msg.startswith("fallback for") or target.quoted in msg:
                raise  # already names the module
            if may_lack_batch(call):
                advice = (
                    "Rules take dimension 0 of the layer's input and output-gradient as the "
                    "batch; an input without a batch dimension (x of shape [features] rather "
                    "than [batch, features]) needs one: x.unsqueeze(0)."
                )
            else:
                advice = (
                    "The call's tensors agree on dimension 0, the batch, where rules read it, "
                    f"so the failure is the rule's own: fix {rule.__module__}."
                    f"{rule.__qualname__}, and compare it with torch.func on a batch of "
                    "inputs: gradhooks.check_rule(layer, x, registry=...)."
                )
            raise RuleError(
                f"rule {rule.__qualname__} for {target.where} failed on {describe_call(call)}: "
                f"{e}\n{advice}"
            ) from e
        live: dict[str, nn.Parameter] = {}
        for pname, p in params.items():
            if pieces.get(pname) is not None:
                live[pname] = p
            elif pname not in pieces:
                raise RuleError(
                    f"rule {rule.__qualname__} for {target.where} "
                    f"returned no piece for trainable parameter '{pname}' (got {sorted(pieces)}): "
                    "the rule does not know it. Either it was added to the layer and its forward "
                    "does not use it (freeze it, requires_grad_(False), or delete it), or "
                    "something around the layer uses it (a forward pre-hook that makes the "
                    "weight from it, as the old torch.nn.utils.weight_norm does), which "
                    "gradhooks follows only while it tracks the batch (batch_dim not None): use "
                    "torch.nn.utils.parametrizations.weight_norm, or register a rule for "
                    "the layer that covers it."
                )
            # else: None, the rule says this call's gradient for it is computed elsewhere
        if not live:
            return
        first = next(iter(live))
        batch = pieces[first].batch_size
        if frame is not None and frame.empty is not None and batch and blank_call(call):
            raise UnbatchedInputError(
                f"{target.where}: the model's "
                f"first tensor input has shape {frame.empty}, with no entries. With "
                f"batch_dim='auto' its batch is dimension 0: {frame.empty[0]} examples without "
                f"entries, and '{first}' would get a per-example gradient for each; if the batch "
                "is another dimension, of size 0 (a sequence-first input [time, 0, ...]), there "
                "is no example. Say which with add_hooks(..., batch_dim=k): grad1 then has as "
                "many rows as that dimension."
            )
        if (
            layout is not None
            and batch != layout.batch
            and self.state.batch_dim == "auto"
            and (layout.root and frame is not None)
        ):
            # the model's first input was taken as the batch, and the layer that reads it
            # counts its examples otherwise (bags of a flat index list): its count is checked
            # as without the tracker
            self._check_batch(target, first, call, batch, frame)
        elif layout is not None:
            if batch != layout.batch:
                raise BatchNotFoundError(
                    f"{target.where}: its "
                    f"rule gives '{first}' a per-example gradient for {batch} examples, but the "
                    f"model's forward has {layout.batch} ({describe_call(call)}). gradhooks could "
                    f"not follow the batch to this layer (through: "
                    f"{', '.join(layout.lost) or 'its own operations'}). If the model's batch "
                    "is dimension k of its first input, say so with add_hooks(..., "
                    "batch_dim=k). If this layer's rows are not the model's examples (bags "
                    "cut from a flat tensor, rows the forward builds otherwise), "
                    "add_hooks(..., batch_dim=None) follows nothing: grad1 then has one row per "
                    "entry of each layer's dimension 0. Or register a rule."
                )
        elif frame is not None and self.state.batch_dim is not None:
            self._check_batch(target, first, call, batch, frame)
        if bw is not None and batch not in bw.rows and (frame is not None or bw.nested):
            # (a call without a frame in a nested backward: run again by a reentrant
            # checkpoint's backward, as a submodule called on its own unless its rerun was
            # noted inside a forward of the model)
            entry = (
                frame.owner is not self.state.model
                if frame is not None
                else id(target.module) not in self.state.reruns
            )
            bw.rows[batch] = (f"{target.where}, for '{first}',", entry)
            if bw.nested:
                self._count_rows_outside(bw, batch)
        if self.state.grad1 and bw is not None and not bw.memory_checked:
            bw.memory_checked = True  # before the first grad1 of this backward is formed
            self.refuse_large(batch)
        scale = float(batch) if self.state.loss_reduction == "mean" else 1.0
        formed: dict[int, Tensor] | None = None
        nested = bw is not None and bw.nested
        if sums is not None and not self.state.grad1 and self.state.mode.param_grads and not nested:
            formed = {}
        shares = (
            bw is not None
            and (bool(bw.verify) or self.state.check_weights is not None)
            and half_precision(bw.precision)
        )
        for pname, p in live.items():
            piece = pieces[pname]
            if not piece.sums_to_grad:
                self.state.exempt.add(id(p))
            # (the room of the checks: see Backward.shares; not of an embedding's rows, whose
            # share would be a whole table, nor of a sharded parameter's)
            if shares and p.numel() and not piece.adds_rows and id(p) not in self.state.sharded:
                self._note_share(bw, piece, p, scale)
            if piece.rounded_terms and bw is not None:  # (the room: see _settle)
                bw.rounded[id(p)] = bw.rounded.get(id(p), 0) + piece.rounded_terms
                size = piece.terms_scale(p.shape)
                found = bw.terms_scale.get(id(p))
                bw.terms_scale[id(p)] = size if found is None else found + size
        # (an empty parameter's gradients are empty: the quantities have nothing of it to
        # add, and a rule's reshape of its pieces cannot infer the batch)
        keep = not self.state.grad1 and bw is not None and bw.verify
        if keep or self.state.collector is not None:
            full = {n: p for n, p in live.items() if p.numel()}
        if keep:
            self.verifier.keep(bw, pieces, full, scale)
        if self.state.collector is not None:
            if nested:  # (handed over at its end, if it computed parameter gradients)
                bw.held.append(HeldCall(target.name, {n: pieces[n] for n in full}, full, scale))
            else:
                self.state.collector.add(
                    target.name, {n: pieces[n] for n in full}, full, scale, formed
                )
        wanted = getattr(sums, "names", None)  # (a _Sums: for these parameters only)
        if not self.state.grad1:
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
        s = self.state
        written, frame_ref = s.written, None if frame is None else frame.ref()
        # (a create_graph backward: grad1 gets a graph, never written in place)
        in_place = not (torch.is_grad_enabled() if create_graph is None else create_graph)
        for pname, p in live.items():
            piece, pid = pieces[pname], id(p)
            if bw is not None and pid not in bw.before:
                if not bw.adds or pid in s.aside:  # (else set_aside does nothing)
                    self.set_aside(p, bw)
                if pid in written and self._new_forward(p, frame):
                    del written[pid]  # (torch.autograd.grad of another forward)
                if pid in written and p.__dict__.get("grad1") is None:
                    del written[pid]  # (grad1 set to None: begun anew, as .grad)
                if pid in written:
                    _refuse_foreign_grad1(target, pname, p)
                # kept for a rollback; a kept grad1 is then never written in place
                bw.before[pid] = p.grad1 if pid in written else None
                if bw.batch is None:
                    bw.batch = piece.batch_size
            if s.stale:
                s.stale.pop(pid, None)
            if frame_ref is not None:
                s.forward_of[pid] = frame_ref
            accumulate = pid in written
            if bw is not None and bw.hidden:
                self._unhide(bw, p)
            out = self._writable_grad1(p, piece.batch_size, accumulate) if in_place else None
            summed = sums is not None and (wanted is None or pname in wanted)
            factor = bw.factors.get(pid) if bw is not None and bw.factors else None
            if (accumulate and summed) or factor is not None:
                out = None  # this call's own grad1 is summed or multiplied below: not in place
            try:
                if p.numel() == 0:  # (an empty parameter: a rule's reshape cannot infer it)
                    out, g1 = None, p.new_zeros((piece.batch_size, *p.shape))
                elif out is not None:
                    piece.grad1_into(out, scale, accumulate)
                else:
                    g1 = piece.grad1(p.shape, scale)
            except RuntimeError as e:
                raise RuleError(
                    f"rule {rule.__qualname__} for {target.where}: "
                    f"its piece for '{pname}' does not give a [batch, *{tuple(p.shape)}] gradient: {e}"
                ) from e
            if summed:
                own = out if out is not None else g1
                total = own.sum(0, dtype=p.dtype)
                sums[pname] = total / scale if scale else total
            if factor is not None:  # (after the sum: autograd's gradient meets the hook itself)
                g1 = g1 * factor
            if out is None:
                self.accumulate(f"{target.name}.{pname}" if target.name else pname, p, g1, bw)
            written[pid] = p

    def _note_share(self, bw: Backward, piece: P.Piece, p: nn.Parameter, scale: float) -> None:
        """The largest entry of this call's share of ``p``'s gradient, and of that share weighted
        over the examples as the check of this backward weighs them (the probe's weights, or a
        workflow's own, :attr:`CaptureState.check_weights`; ``None``: neither), for the room
        of the checks (:attr:`Backward.shares`)."""
        probe = bw.probe
        weights = self.state.check_weights if probe is None else probe.weights
        with torch.no_grad():
            own = piece.in_dtype(p.dtype).batch_sum(p.shape).abs().max()
            weighted = None if weights is None else P.weighted_sum(
                [P.PieceUse(piece, p, scale)], weights
            )  # fmt: skip
            found = None if weighted is None else weighted.abs().max()
        bw.shares.setdefault(id(p), []).append((own, found))

    def _writable_grad1(self, p: nn.Parameter, batch: int, accumulate: bool) -> Tensor | None:
        """``p.grad1``, if this call's gradient can be written into its memory: it has the
        right shape, dtype and device, and nothing but ``p`` refers to it or to its memory (the
        test autograd makes before reusing ``.grad``). Writing in place skips a fresh
        allocation, whose page faults cost more than the writing itself on CPU; a ``grad1``
        the caller kept (a reference, a view, a numpy array) is never changed. (Not asked in a
        create_graph backward, whose grad1 gets a graph.)"""
        old = sole_grad1(p)
        if old is None:
            return None
        if accumulate and old.shape[0] != batch:
            return None  # _accumulate explains
        if tuple(old.shape) != (batch, *p.shape) or old.dtype != p.dtype or old.device != p.device:
            return None
        return old

    def _check_rows(self, bw: Backward) -> None:
        """Refuse a backward that reached forwards on other examples of one tensor (the batch
        split into chunks, run through the model one chunk at a time and the outputs put
        together: ``torch.cat([model(c) for c in x.chunk(2)])``): each forward's rows count from
        0, so ``grad1`` would add the examples of one chunk to those of the other."""
        b, second = bw.rows_of[-1]
        a, first = next(((a, n) for a, n in bw.rows_of[:-1] if other_rows(a, b)), (None, ""))
        if a is None:
            return
        of = "" if a.shape is None else f" of one tensor of shape {a.shape}"

        def rows(r) -> str:
            every = f" every {r.every}" if r.every != 1 else ""
            return f"rows {r.first} to {r.first + (r.count - 1) * r.every}{every}"

        raise MixedExamplesError(
            "gradhooks: one backward reached two forwards of the model on other examples of "
            f"one batch: the call of {first} in the one on {rows(a)}, of {second} in the one "
            f"on {rows(b)}{of} (x.chunk(2), x[:n] and x[n:], x[0::2] and x[1::2]). Row i of "
            "each forward is taken for the same example, so grad1 would add the chunks' examples together; "
            "no grad1 was written. Run the model on the whole batch, or take one backward per "
            "chunk and read grad1 after each (h.clear() then, and torch.cat the grad1s: "
            "grad1 adds up over backwards as .grad does). Where the rows do hold the same "
            "examples (each example's pair stored in the other half), give the model copies "
            "(x[n:].clone()): row i of each call is then example i."
        )

    def _check_batch(self, target, pname, call, batch: int, frame: Frame) -> None:
        """Every hooked layer of one forward of the model must see its batch on dimension 0."""
        if len(frame.seen) == 1 and batch in frame.seen:
            return  # the usual case, checked once per forward: as the layers before it
        name = target.where
        other = next((n for b, n in frame.seen.items() if b != batch), None)
        if frame.batch is not None and batch != frame.batch:
            why = (
                f"but the model's forward got a batch of {frame.batch} (dimension "
                f"{self.state.batch_dim} of its first tensor input)"
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
        raise BatchNotFoundError(
            f"{what}, {why}. A layer that does not see the examples on dimension 0 (the model "
            "folds time or patches into the batch, x.view(B * T, ...), or runs a layer "
            "sequence-first, [seq, batch, ...]) would get grad1 rows that are not examples. Keep "
            "the batch on dimension 0 of every hooked layer's input (nn.Linear takes "
            "[batch, *, features]: no need to fold; batch_first=True, or x.transpose(0, 1)). "
            "add_hooks(..., batch_dim=k) says the model's batch is dimension k of its first "
            "input; batch_dim=None turns this check off (grad1 then has one row per entry of "
            "each layer's dimension 0)."
        )

    def refuse_large(self, batch: int) -> None:
        if not self.state.params:
            return
        p = next(iter(self.state.params.values()))[1]
        refuse_if_too_large(
            self._model_name, batch, self.state.numel, p.element_size(), p.device,
            self.state.max_grad1_bytes,
        )  # fmt: skip

    def _model_name(self) -> str:
        model = self.state.model
        return f"'{type(model).__qualname__}'" if model is not None else "the model"

    def backward_state(self) -> Backward:
        task = graph_task()
        bw = self.state.tasks.get(task)
        if bw is None:
            nested = bool(self.state.tasks)  # (a backward inside another: reentrant checkpointing)
            bw = self.state.tasks[task] = Backward(set(), set(), {}, [], nested=nested)
            # (autograd runs each of its nodes in the thread-local state it started in:
            # autocast's among them, read once)
            bw.autocast = autocast_devices()
            if nested:  # their gradients are split between the two: not verified
                for other in self.state.tasks.values():
                    other.verify = frozenset()
                    other.spot, other.spot_grad = None, None
            else:
                bw.capturing = self.state.capturing_backward()
                if bw.capturing:
                    self._restart(bw)
                else:
                    self.state.trail.observe()
                if self.state.verify and self.state.checks_examples and self.state.unverified:
                    bw.verify = frozenset(self.state.unverified)
                elif self.state.verify and self.state.grad1 and bw.capturing:
                    bw.spot = self.verifier.spot_of()
            _torch.queue_backward_callback(
                lambda: self._end_backward(task), failed=lambda: self._failed_backward(task)
            )
        return bw

    def _failed_backward(self, task: int) -> None:
        """Backward ``task`` failed on the way (an error of torch's or of the user's code
        raised in it, caught by the loop: ``torch.autograd.detect_anomaly`` at a NaN): the
        ``grad1`` it wrote for the calls it reached, part of a backward, is taken back as a
        refused backward's is (an accumulation's sum before it put back, one it started or
        was replacing deleted), at once rather than at the next forward; ``.grad`` holds what
        autograd added before the error."""
        bw = self.state.tasks.pop(task, None)
        if bw is None:  # (ended by a refusal of ours: undone then)
            return
        self.rollback(bw)
        self._put_back(bw)
        if self.state.collector is not None:
            self.state.collector.discard_backward()

    def _restart(self, bw: Backward) -> None:
        """At the start of a backward, before autograd adds anything to ``.grad``: where
        ``.grad`` was reset since the last backward (``zero_grad``: see
        :mod:`gradhooks.engine.accumulation`), ``grad1`` starts afresh (and so do the quantities that
        accumulate); a ``grad1`` deleted by the user starts afresh too. A ``grad1`` left from
        before the reset is taken off its parameter while the backward runs (:meth:`_hide`)."""
        for pid, p in list(self.state.written.items()):
            if p.__dict__.get("grad1") is None:
                del self.state.written[pid]
                self.state.depth.pop(pid, None)
                self.state.aside.pop(pid, None)
        if not len(self.state.trail):
            return
        reset = self.state.trail.restarted()
        bw.emptied = {id(p): p for p in self.state.trail.emptied()}
        for p in reset:
            self.state.aside.pop(id(p), None)
            if self.state.written.pop(id(p), None) is not None:
                self.state.stale[id(p)] = p
            self.state.depth.pop(id(p), None)
        if reset and self.state.collector is not None:
            self.state.collector.restart(reset)
        self._hide(bw)

    def _hide(self, bw: Backward) -> None:
        """Take each stale ``grad1`` (left from before a reset, which this backward replaces,
        deletes or zeroes) off its parameter until the backward is through: a hook that runs
        during it (``register_post_accumulate_grad_hook`` of another parameter) finds no
        ``grad1`` where this backward has not written one yet, rather than an earlier step's.
        The tensor is kept: written into where its memory can be reused (:meth:`_unhide`),
        put back where the backward leaves ``grad1`` as it was (:meth:`_put_back`)."""
        for pid, p in self.state.stale.items():
            found = p.__dict__.pop("grad1", None)
            if found is not None:
                bw.hidden[pid] = (p, found)

    def _unhide(self, bw: Backward | None, p: nn.Parameter) -> None:
        """Before ``p.grad1`` is first written by ``bw``: the stale ``grad1`` hidden from it
        back on ``p``, so that its memory is reused (``sole_grad1``) and then written over."""
        if bw is None or not bw.hidden:
            return
        found = bw.hidden.pop(id(p), None)
        if found is not None and "grad1" not in p.__dict__:
            p.__dict__["grad1"] = found[1]

    def _count_rows_outside(self, bw: Backward, batch: int) -> None:
        """A backward inside another (reentrant activation checkpointing: the checkpointed
        calls' pieces come in a backward of their own, inside the loss's) counts its calls'
        examples with the outermost backward's, so that calls that count other examples
        are refused as in one backward (layers called one by one, as ``checkpoint_sequential``
        calls them, each taking its batch from its own input: :func:`different_batches`),
        before this one writes anything; the outermost's writes are undone too."""
        task, outer = next(iter(self.state.tasks.items()))
        if outer is bw or batch in outer.rows:
            return
        outer.rows[batch] = bw.rows[batch]
        if self.state.batch_dim is not None and any(entry for _, entry in outer.rows.values()):
            del self.state.tasks[task]  # (it fails with this one: _abort_backward's work)
            self.refuse(outer)
            self._put_back(outer)
            raise BatchNotFoundError(different_batches(outer.rows))

    def _put_back(self, bw: Backward) -> None:
        """Where ``bw`` ends without having replaced them (a backward not captured after all,
        a refusal): each hidden ``grad1`` back on its parameter, as the backward found it."""
        hidden, bw.hidden = bw.hidden, {}
        for p, found in hidden.values():
            if "grad1" not in p.__dict__:
                p.__dict__["grad1"] = found

    def _settle(self, bw: Backward, captured: bool) -> None:
        """At the end of a backward: count it in each ``grad1`` it wrote; where it was a
        captured backward of the model, a ``grad1`` left from before a reset that it did not
        reach goes as ``.grad`` went: deleted where ``.grad`` is ``None`` (or holds a gradient
        this backward computed without capture), zeros where ``.grad`` is zeros; then record
        the ``.grad`` every parameter was left with, for the next backward's start."""
        rounded, sizes = self.state.rounded, self.state.terms_scale
        if captured:  # (not one rolled back, or one that was not captured)
            written, depth = self.state.written, self.state.depth
            # (the usual: no half-precision terms in this backward, nor left by an earlier one)
            plain = not (bw.rounded or bw.terms_scale or rounded or sizes)
            for pid, before in bw.before.items():
                if pid not in written:
                    continue
                depth[pid] = depth.get(pid, 1) + 1 if before is not None else 1
                if plain:
                    continue  # (no terms to count, none to forget)
                # the terms rounded one by one in what grad1 holds: those of every
                # backward accumulated into it since it last started afresh
                terms = bw.rounded.get(pid, 0)
                terms += rounded.get(pid, 0) if before is not None else 0
                size = bw.terms_scale.get(pid)
                if size is not None and before is not None and pid in sizes:
                    size = size + sizes[pid]
                if terms:
                    rounded[pid] = terms
                else:
                    rounded.pop(pid, None)
                if size is not None:
                    sizes[pid] = size
                elif before is None:
                    sizes.pop(pid, None)
            if not self.state.grad1:  # (no accumulation: the most in one backward)
                for pid, terms in bw.rounded.items():
                    rounded[pid] = max(rounded.get(pid, 0), terms)
                for pid, size in bw.terms_scale.items():
                    sizes[pid] = size if pid not in sizes else torch.maximum(sizes[pid], size)
        if captured and self.state.stale:
            stale, self.state.stale = self.state.stale, {}
            zero = [p for p in stale.values() if grad_of(p) is not None and bw.batch is not None]
            zero = [p for p, z in zip(zero, all_zero([p.grad for p in zero])) if z]
            for p in zero:
                self._unhide(bw, p)
                self._zero_grad1(p, bw.batch)
            for pid, p in stale.items():
                bw.hidden.pop(pid, None)
                if pid not in self.state.written and "grad1" in p.__dict__:
                    del p.grad1
        if captured and bw.emptied:
            self._drop_emptied(bw)
        self._put_back(bw)
        if not bw.capturing:
            return  # (its additions to .grad continue the accumulation, see GradTrail)
        params = dict(self.state.written)
        known = self.state.params
        for pid in bw.reached:
            if pid not in params and pid in known:
                params[pid] = known[pid][1]
        trail = self.state.trail
        if len(trail):
            for p in trail.params():
                params.setdefault(id(p), p)
        trail.record(params, bw.computed, bw.accumulated)

    def _drop_emptied(self, bw: Backward) -> None:
        """At the end of a captured backward: the ``grad1`` of a parameter whose ``.grad`` an
        earlier backward's fused optimizer step left ``None`` (``bw.emptied``), and that this
        backward did not compute, goes as ``.grad`` went, as after a ``zero_grad``."""
        state, dropped = self.state, []
        for pid, p in bw.emptied.items():
            if pid in bw.computed or pid in state.sharded or grad_of(p) is not None:
                continue
            state.written.pop(pid, None)
            state.depth.pop(pid, None)
            state.aside.pop(pid, None)
            if "grad1" in p.__dict__:
                del p.grad1
            dropped.append(p)
        if dropped and state.collector is not None:
            state.collector.restart(dropped)

    def set_aside(self, p: nn.Parameter, bw: Backward) -> None:
        """Before this backward first writes ``p.grad1``: a ``torch.autograd.grad`` that
        returns ``p``'s gradient, where ``grad1`` is ``.grad``'s rows (a backward added into
        ``.grad`` last, or it was reset), sets that ``grad1`` aside, and adds to ``grad1`` as
        it does (see :mod:`gradhooks.engine.accumulation`); the next backward that adds into
        ``.grad`` puts it back before adding, so that ``grad1`` is ``.grad``'s rows again (the
        loss's ``backward()`` after a ``torch.autograd.grad`` of it for a gradient's norm).
        A backward seen to add into ``.grad`` at one parameter returns none (only a
        ``torch.autograd.grad`` does): then only a ``grad1`` set aside is looked at."""
        pid, state = id(p), self.state
        if bw.adds and pid not in state.aside:
            return  # (a backward(), and nothing of p set aside: the usual step)
        held = state.accumulators.get(pid)
        adds = _torch.adds_to_grad(p, None if held is None else held[0])
        if adds:
            bw.adds = True
        if adds is False:
            if pid not in state.aside and (pid not in state.written or state.trail.added_last(p)):
                kept = p.__dict__.get("grad1") if pid in state.written else None
                state.aside[pid] = (
                    kept, state.depth.get(pid), state.rounded.get(pid), state.terms_scale.get(pid)
                )  # fmt: skip
            return
        if adds is None or pid not in state.aside:
            return
        kept, depth, rounded, size = state.aside.pop(pid)
        for found, value in (
            (state.depth, depth), (state.rounded, rounded), (state.terms_scale, size)
        ):  # fmt: skip
            if value is None:
                found.pop(pid, None)
            else:
                found[pid] = value
        if kept is None:
            state.written.pop(pid, None)  # (the grad1 written now replaces the passes')
        else:
            p.grad1 = kept
            state.written[pid] = p

    def _new_forward(self, p: nn.Parameter, frame: Frame | None) -> bool:
        """Whether this backward, of ``frame``, starts ``p.grad1`` afresh where ``.grad`` gives
        no sign (see :mod:`gradhooks.engine.accumulation`): the last backward was of another
        forward, and it left ``.grad`` alone or this one does (``torch.autograd.grad``)."""
        if frame is None:
            return False
        last = self.state.forward_of.get(id(p))
        if last is None or last() is frame:
            return False
        return self.state.trail.left_alone(p) or _torch.adds_to_grad(p) is False

    def restart_for_forward(self, bw: Backward, p: nn.Parameter, ref: weakref.ref | None) -> None:
        """Before ``bw`` first gives ``p`` a ``grad1`` from a call of the forward ``ref`` refers
        to, written other than by :meth:`_backward` (a use the tracker followed, a tensor
        computed from ``p`` in a slot): ``p.grad1`` starts afresh as there (:meth:`_new_forward`)."""
        frame = None if ref is None else ref()
        if frame is None or id(p) in bw.before:
            return
        self.set_aside(p, bw)
        if id(p) in self.state.written and self._new_forward(p, frame):
            del self.state.written[id(p)]
        self.state.forward_of[id(p)] = ref

    def _zero_grad1(self, p: nn.Parameter, batch: int) -> None:
        """``p.grad1`` of zeros, ``[batch, *p.shape]`` (its memory reused where it can be)."""
        old = sole_grad1(p)
        if old is not None and tuple(old.shape) == (batch, *p.shape) and old.dtype == p.dtype:
            old.zero_()
        else:
            p.grad1 = torch.zeros((batch, *p.shape), dtype=p.dtype, device=p.device)
        self.state.written[id(p)] = p
        self.state.depth[id(p)] = 1
        self.state.rounded.pop(id(p), None)

    def param_hook(self, pid: int, name: str):
        me = weakref.ref(self)  # (torch holds the hook, where the garbage collector cannot
        # see it: a strong reference would keep the model alive with its hooks)

        def hook(grad: Tensor | None) -> None:
            writer = me()
            if writer is not None:
                writer._param_grad(pid, name, grad)

        return hook

    def _param_grad(self, pid: int, name: str, grad: Tensor | None) -> None:
        if (
            grad is None
            or self.state.removed
            or not self.state.mode.capture
            or self.state.rerunning
        ):
            return  # (None: a node gave it no gradient, an empty batch's detached call)
        if not self.state.vmapped and _torch.is_grads_batched(grad):
            bw = self.backward_state()
            bw.batched = bw.batched or f"'{name}'"
            bw.computed.add(pid)
            return
        if pid in self.state.direct and self.state.capturing_backward():
            self._direct_uses(pid, name)
        bw = self.state.tasks.get(graph_task())
        if bw is None:
            bw = self.backward_state()
        bw.computed.add(pid)
        # (capturing_backward() asked last: in the usual backward, no condition before it
        # holds)
        reached = pid in bw.reached
        if (
            reached
            and _torch.tensor_hooks(self.state.params[pid][1]) > 1
            and self.state.capturing_backward()
        ):
            # (hooks of the user's run after this one: compared at the accumulation)
            bw.raw[pid] = (grad, _torch.version(grad))
        if bw.verify and self.state.capturing_backward():
            # (a copy: autograd may take this very tensor as .grad, which DDP then
            # all-reduces in place)
            bw.grads[pid] = hold(grad, copy=True)
        elif bw.spot == pid and not grad.is_sparse:
            bw.spot_grad = torch.take(grad, self.state.spot_entries[pid][1])
        if not reached and self.state.capturing_backward():
            if pid in bw.direct:
                self._lost(pid, name, *bw.direct[pid])
            bw.missed.append(name)
            bw.grads.pop(pid, None)  # (no grad1 to check: it warns at the end instead)

    def accumulate_hook(self, pid: int, name: str):
        """A pre-hook of the parameter's ``AccumulateGrad`` node: it runs where autograd adds
        the gradient into ``.grad`` (a ``backward()``, not a ``torch.autograd.grad``), after
        every hook registered on the parameter, so with the gradient ``.grad`` really gets."""

        me = weakref.ref(self)  # (torch holds the hook, where the garbage collector cannot
        # see it: a strong reference would keep the model alive with its hooks)

        def hook(grad_inputs: tuple) -> None:
            writer = me()
            if writer is not None:
                writer._accumulated(pid, name, grad_inputs)

        return hook

    def _accumulated(self, pid: int, name: str, grad_inputs: tuple) -> None:
        if self.state.removed or not self.state.mode.capture or self.state.rerunning:
            return
        bw = self.state.tasks.get(graph_task())
        if bw is None:
            return
        bw.accumulated.add(pid)
        raw = bw.raw.pop(pid, None)
        final = grad_inputs[0] if grad_inputs else None
        if final is None:
            return
        if raw is not None and not _same(final, *raw):
            # (raw: autograd's own gradient, gradhooks' hook runs before the user's,
            # _torch.put_tensor_hook_first: the factor of a hook that scales it is exact,
            # whatever rounding autograd's kernel left in it)
            self._changed_by_hook(bw, pid, name, raw[0], final)
        if pid not in bw.added:
            # what autograd adds to .grad now (not refused), for a later refusal to undo:
            # no reference to the gradient where .grad is None (autograd takes it as is)
            old = grad_of(self.state.params[pid][1])
            bw.added[pid] = (None, None) if old is None else (old, final)

    def _changed_by_hook(
        self, bw: Backward, pid: int, name: str, raw: Tensor, final: Tensor
    ) -> None:
        """A hook the user registered on the parameter changed its gradient: ``grad1`` follows
        where the change is a multiple of it (``g * c``, a clipping of its norm), so that it
        still reduces to ``.grad``; any other change is refused."""
        # (two sums of the same terms, rounded in the precision the backward's calls ran in)
        tol = rounding_tolerance(
            raw.dtype, bw.precision, float32=_ROUNDING[torch.float32],
            float64=_ROUNDING[torch.float64],
        )  # fmt: skip
        factor = _multiple(raw, final, tol)
        if factor is not None and abs(factor - 1.0) <= tol:
            return  # (a new tensor, the same gradient: a norm clip that did not clip)
        # (the other quantities, the norms among them, are formed from the pieces, which do
        # not know the factor: only a handle that computes grad1 alone follows it)
        if factor is not None and self.state.collector is None:
            bw.factors[pid] = factor  # (for a call of p whose grad1 is written after this)
            p = self.state.params[pid][1]
            if pid in self.state.written and pid in bw.before:
                before = bw.before[pid]
                g1 = p.grad1.detach()
                p.grad1 = g1 * factor if before is None else before + (g1 - before) * factor
            if pid in bw.grads:  # (verify: grad1 against the gradient .grad gets)
                bw.grads[pid] = hold(final, copy=True)
            elif bw.spot == pid and bw.spot_grad is not None and not final.is_sparse:
                bw.spot_grad = torch.take(final, self.state.spot_entries[pid][1])
            return
        what = (
            "by a factor, which the per-example norms cannot follow"
            if factor is not None
            else "otherwise than by a factor (each entry clamped, noise or another tensor added)"
        )
        self._undo_running(bw)
        raise UnsupportedError(
            f"gradhooks: a hook registered on '{name}' (with register_hook) "
            f"changed its gradient {what}: no per-example gradient gives the .grad it makes. "
            "Its grad1 was not written. Change grad1 (or the per-example gradients) yourself "
            "after the backward, or remove the hook while the hooks are on; a hook that "
            "multiplies the gradient by a number is followed where grad1 is the only quantity "
            "(quantities=('grad1',))."
        )

    def _refuse_captured(self, message: str) -> None:
        """Stop a captured backward (not one the engine runs itself, nor one after the hooks
        were removed) with ``message``, undoing what it wrote."""
        if self.state.removed or self.state.rerunning or not self.state.mode.capture:
            return
        if not self.state.capturing_backward():
            return
        self._abort_backward()
        raise UnsupportedError(message)

    def escaped(self, target: Target, names: str, grad: Tensor) -> None:
        """A gradient hook on a tensor that a call of a module without a rule computed from
        its parameters ``names`` and that left the call other than as a returned tensor
        (:func:`gradhooks.engine.forward._escaping`): a captured backward through it is
        refused, as the fallback's recomputation would leave that share of their gradient
        out of ``grad1``."""
        self._refuse_captured(
            f"gradhooks: {target.where} (a module without a rule, whose per-example gradients "
            "the torch.func fallback recomputes from the tensors its call returns) kept a "
            f"tensor computed from its parameters {names} other than as a returned tensor (a "
            "function it returns holds it, or it was set on the module), and this backward "
            "reached it: that share of their gradient would be left out of their grad1, "
            "which was not written. Return the tensor from the call (or call the branch "
            f"inside it), register a rule for {type(target.module).__qualname__} with "
            "@gradhooks.register, or freeze those parameters."
        )

    def reached_aside(self, target: Target, names: str) -> None:
        """A backward gave a tensor that a call of a module without a rule computed from its
        parameters ``names``, kept other than as a returned tensor and computed its returned
        tensors from, a gradient besides what the call's own operations sent it
        (:mod:`gradhooks.engine.aside`): a captured backward is refused, as the fallback's
        recomputation would leave that share of their gradient out of ``grad1``."""
        self._refuse_captured(
            f"gradhooks: {target.where} (a module without a rule, whose per-example gradients "
            "the torch.func fallback recomputes from the tensors its call returns) kept a "
            f"tensor computed from its parameters {names} that its returned tensors are "
            "computed from (set on the module, or held by a function it returns), and this "
            "backward gave it a gradient besides the one that flowed back through the call (an "
            "auxiliary loss read from where it is kept): that share of their gradient would "
            "be left out of their grad1, which was not written. Return the tensor from the "
            "call where a loss uses it, register a rule for "
            f"{type(target.module).__qualname__} with @gradhooks.register, or freeze those "
            "parameters."
        )

    def direct_reached(self, held: tuple, unknown: dict) -> None:
        """The backward passes through an operation of a followed forward that used these
        parameters directly (``held``: ``(id, source)`` pairs, see :meth:`Tracker._hold`)."""
        if self.state.rerunning or self.state.removed or not self.state.mode.capture:
            return
        if not (self.state.capturing_backward()):
            return
        bw = self.backward_state()
        for pid, source in held:
            sources, _ = bw.direct.setdefault(pid, (set(), unknown))
            sources.add(source)

    def _lost(self, pid: int, name: str, sources: set, unknown: dict) -> None:
        """A parameter used directly in a followed forward whose gradient this backward computed
        with no per-example gradient at all: never left without one in silence."""
        uses = {kind for s in sources for kind, _ in s.uses}
        if "loss" in uses and not self.state.verify:
            return  # (a term of the loss alone: verify=False keeps the per-example terms)
        ops = ", ".join(unknown)
        self._abort_backward()
        raise UnsupportedError(
            f"'{name}' is used outside its module's call, and this backward computed its "
            "gradient, but no per-example gradient reached it: "
            + (
                f"gradhooks lost the examples on the way (through {ops}, whose effect on the "
                "batch it does not know)"
                if ops
                else "its gradient never met the batch where gradhooks could follow it (a "
                "term of the loss computed from the parameter alone? or the batch met it inside "
                "something gradhooks cannot see into: a TorchScript function, made by "
                "torch.jit.script, a function of the examples mapped by torch.vmap (or "
                "another torch.func transform) in the forward, or an extension's operator "
                "called directly; where the map runs over the batch, a loop over its examples "
                "or a layer that takes the batch whole lets gradhooks follow it)"
            )
            + ". Its grad1 was not written. Use the parameter through a module with a rule "
            "(or register one with @gradhooks.register), or freeze it."
        )

    def _direct_uses(self, pid: int, name: str) -> None:
        """A parameter's gradient is complete: its per-example gradients from its uses outside
        its module's call (the tracker's sources) go into ``grad1`` as one more piece."""
        task = graph_task()
        found = [
            s
            for s in list(self.state.direct[pid])
            if not s.discarded and (task in s.grads or s.problem)
        ]
        if not found:
            return
        p = self.state.params[pid][1]
        target = self.direct_targets.get(pid)
        if target is None:
            prefix, leaf = owner_name(name)
            entry = _Entry(
                rule=lambda call, leaf=leaf: {leaf: P.Direct(call.grad_outputs[0])},
                owns_children=False, needs_output=False,
            )  # fmt: skip
            target = Target(prefix, self.owner(name), entry, {leaf: p})
            self.direct_targets[pid] = target
        problem = next((s.problem for s in found if s.problem), None)
        if problem is not None:
            self._abort_backward()
            raise UnsupportedError(
                f"'{name}' is used outside its module's call, in operations that do not depend "
                f"on the examples until they meet the batch, and {problem}: gradhooks cannot "
                "tell each example's share of its gradient. Compute it with modules that have "
                "rules (the parameter's own module's call), or freeze it."
            )
        if torch.is_grad_enabled() and p.requires_grad:
            missing = [s for s in found if task in s.grads and not s.grads[task].requires_grad]
            if missing:  # (a create_graph backward: grad1 must keep the graph of every piece)
                self._abort_backward()
                raise UnsupportedError(
                    f"'{name}' is used outside its module's call, and this backward keeps its "
                    "graph (create_graph=True), but gradhooks forms the per-example gradient "
                    "of those uses without one: a derivative of grad1 would miss their terms. "
                    "Use the parameter through a module with a rule (its own module's call), "
                    "or take the derivative by a per-example loop "
                    "(gradhooks.oracle.loop_grad)."
                )
        bw = self.backward_state()
        frames = {id(f): f for f in map(self.state.source_frames.get, found) if f is not None}
        for frame in frames.values():  # (the forwards of its uses, as a call's: for the checks)
            if _note_frame(bw, frame, (pid,), target, self.state.shared_inputs):
                try:
                    self._check_rows(bw)
                except BaseException:
                    self._abort_backward()
                    raise
        sizes = sorted({s.grads[task].shape[0] for s in found})
        if len(sizes) > 1:
            self._abort_backward()
            raise BatchNotFoundError(
                f"'{name}' is used outside its module's call in forwards of the model on "
                f"batches of {' and '.join(map(str, sizes))} examples, all reached by one "
                "backward: row i of each would be taken for the same example. Backpropagate "
                "each forward's loss on its own (h.clear() between them), or give the model "
                "one batch."
            )
        per = None
        for s in found:
            g = s.grads.pop(task)
            per = g if per is None else per + g
        call = Call(
            target.module, (), {}, None, (per.to(p.dtype),), name=target.name,
            registry=self.state.registry,
        )  # fmt: skip
        ref = next((f.ref() for f in frames.values()), None)
        self.restart_for_forward(bw, p, ref)
        state = CallState(dict(target.params), None)
        self.on_grads(target, state, call, (), {})

    def owner(self, name: str) -> nn.Module:
        prefix, _ = owner_name(name)
        model = self.state.model
        return model.get_submodule(prefix) if model is not None else None

    def _end_backward(self, task: int) -> None:
        waiting = self.state.tasks.get(task)
        while waiting is not None and waiting.pending:  # taps the backward never reached
            waiting.pending.pop(next(iter(waiting.pending)))()
        bw = self.state.tasks.pop(task, None)
        if bw is None:
            return
        try:
            self._finish_backward(bw)
        finally:
            self._put_back(bw)  # (nothing hidden is left after _settle)

    def _finish_backward(self, bw: Backward) -> None:
        if self.state.removed:
            return
        bw.raw.clear()
        if bw.batched is not None:
            self._end_batched(bw)
            return
        inside = _torch.enclosing_backward()
        if inside is None:  # (without the internal: as far as the handle's backwards tell)
            inside = bw.nested or bw.inside
        returned = (bw.reached & bw.computed) - bw.accumulated if inside else set()
        if returned:
            self._refuse_returned(bw, returned)
        self.state.unheld.clear()
        if bw.reached:
            self.state.backwards += 1
        if bw.derived is not None and bw.computed:
            self.refuse(bw)
            raise UnsupportedError(higher_order(bw.derived))
        if len(bw.rows) > 1 and self.state.batch_dim is not None:
            if any(entry for _, entry in bw.rows.values()):
                self.refuse(bw)
                raise BatchNotFoundError(different_batches(bw.rows))
        # A backward that computes the gradient of none of the model's parameters
        # (torch.autograd.grad with respect to the inputs: an input-gradient, a Laplacian)
        # leaves grad1 and the other quantities as they were.
        kept = True
        # (a call run detached gives its parameters no gradient where the book-keeping step
        # asks for none: a backward that reached only such calls computed theirs all the same)
        detached_only = not self.state.mode.param_grads and not bw.attached
        if bw.reached and not bw.computed and not detached_only and not self.state.sharded:
            self.rollback(bw)
            if self.state.collector is not None and not bw.nested:
                self.state.collector.discard_backward()
            kept = False
            bw.held.clear()  # (a nested one's: the outer backward's pieces stay)
        if bw.computed and self.state.mode.param_grads and not self.state.probing:
            self.state.grads_unused = False  # (the parameters' gradients are wanted again)
        left_out: set[int] = set()
        if kept and bw.computed and self.state.mode.param_grads:
            # (backward(inputs=[a layer's weight]): its other parameters get no gradient, so
            # no norms, and a grad1 as their .grad, none or zeros; not where calls run
            # detached by design, the book-keeping step)
            params, sharded = self.state.params, self.state.sharded
            left_out = {
                q for q in (bw.reached | bw.before.keys()) - bw.computed
                if q in params and q not in sharded
            }  # fmt: skip
            left_out |= bw.frozen  # (frozen since a planning dropped them: never computed)
            # (frozen between the forward and the backward: autograd computes its gradient,
            # then leaves .grad as it was)
            for q in [q for q in bw.computed if not self.state.params[q][1].requires_grad]:
                left_out.add(q)
                bw.grads.pop(q, None)
        elif kept and bw.reached and not self.state.mode.param_grads:
            # (the book-keeping step asks for no parameter gradient, and clips those of the
            # parameters trainable when it runs: one frozen since the forward is left out)
            params = self.state.params
            left_out = {q for q in bw.reached if q in params and not params[q][1].requires_grad}
        if self.state.grad1 and left_out:
            self.rollback(bw, left_out)
        for held in bw.held:
            self.state.collector.add(*held)
        bw.held.clear()
        if left_out and self.state.collector is not None:
            self.state.collector.drop(left_out)
        if bw.verify and bw.grads and bw.reached and self.state.grad1:
            # (its sums in the precision the engine chose, also where the backward runs inside
            # the autocast block, which would round grad1 weighted over the examples in bfloat16)
            with autocast_off(bw.autocast):
                self.verifier.verify_backward(bw)
        elif (
            bw.spot_grad is not None and kept and bw.spot in bw.reached and bw.spot not in left_out
        ):
            self.verifier.spot_check(bw)
        elif bw.verify and not self.state.grad1:
            if bw.reached and bw.probe is not None and bw.frames == {bw.probe.frame}:
                # (after the collector's own callback, which forms the norms)
                kept = self.state.collector.results() if self.state.collector else None

                def verify_norms() -> None:
                    with autocast_off(bw.autocast):
                        self.verifier.verify_norms(bw, bw.probe, kept)

                _torch.queue_backward_callback(verify_norms)
            self.state.unverified -= bw.verify
        if self.state.check_weights is not None and bw.reached:
            keep_check_shares(self.state, bw)
        self._settle(bw, kept and bool(bw.reached))
        if self.state.collector is not None:
            self.state.collector.missed = list(bw.missed)
            if bw.missed and not bw.reached and not bw.nested:
                self.state.collector.forget_results(bw.missed)
        if bw.missed:
            missed = set(bw.missed)
            for name, p in self.state.params.values():
                if name in missed and id(p) not in self.state.written and hasattr(p, "grad1"):
                    del p.grad1  # (an earlier step's, never to be read for this one's)
            for name in bw.missed:
                self.state.missed[name] = None
            names = ", ".join(f"'{n}'" for n in bw.missed[:5])
            more = f" and {len(bw.missed) - 5} more" if len(bw.missed) > 5 else ""
            warnings.warn(
                f"gradhooks: a backward computed the gradient of {names}{more} but no forward "
                "call of their modules was captured for it: the forward ran before add_hooks, "
                "or while capture was paused, or outside the hooked model's modules (a "
                "parameter used in the loss, or in a method of the model other than forward "
                "outside any submodule's call), or a torch.compile'd forward compiled before "
                "add_hooks (its code does not call hooks added later: torch._dynamo.reset(), or "
                "compile after add_hooks), or under torch.func.vmap, which the hooks do not "
                "capture. They have no grad1 from this backward. Run the "
                "forward after add_hooks, through the model's modules.",
                GradhooksWarning,
                stacklevel=2,
            )

    def _end_batched(self, bw: Backward) -> None:
        """The end of an ``is_grads_batched`` backward: one with respect to the inputs only
        leaves ``grad1`` and the quantities as they were; one that computes parameter
        gradients is refused (each of its rows would need a ``grad1`` of its own)."""
        if not bw.computed:
            return
        names = [name for pid, (name, _) in self.state.params.items() if pid in bw.computed]
        for other in list(self.state.tasks.values())[::-1]:
            self.rollback(other)
            self.undo_grads(other)
        raise UnsupportedError(
            f"gradhooks: a backward with is_grads_batched=True (a batch of output-gradients, "
            f"as torch.autograd.functional.jacobian(vectorize=True) runs) computed the "
            f"gradient of {listed_names(names)}, which reached {bw.batched}; grad1 holds one "
            "gradient per example, not one per output-gradient, so it was left as it was. Take "
            "such backwards with respect to the inputs only, run them under h.paused(), or use "
            "gradhooks.jacobians for per-example Jacobians."
        )

    def _undo_running(self, bw: Backward) -> None:
        """Before a refusal inside backward ``bw``: its ``grad1`` and ``.grad`` and those of
        every backward of the handle still running (an outer one) back as they were, nothing
        left collected (the latest first: an outer backward's ``.grad`` is put back last)."""
        outer = [t for t in self.state.tasks.values() if t is not bw]
        for other in (bw, *outer[::-1]):
            self.rollback(other)
            self.undo_grads(other)
        self.state.tasks.clear()
        if self.state.collector is not None:
            self.state.collector.discard_backward()

    def _refuse_returned(self, bw: Backward, returned: set[int]) -> None:
        """A backward inside another (taken in a custom ``autograd.Function``'s backward or a
        gradient hook) computed parameter gradients and gave them back to the code that asked,
        instead of adding them into ``.grad``: what that code does with them (an adjoint ODE
        solver sums them over its time steps, scaled by the step) is not seen per example."""
        names = [name for pid, (name, _) in self.state.params.items() if pid in returned]
        self._undo_running(bw)
        raise UnsupportedError(
            f"gradhooks: {listed_names(names)}: their gradients were computed by a backward "
            "run inside another backward (torch.autograd.grad with respect to them, in a custom "
            "autograd.Function's backward or a gradient hook: an adjoint ODE solver, implicit "
            "differentiation) and handed back to the code that called it, which may scale, sum "
            "or transform them before they reach the parameters; gradhooks cannot follow that "
            "per example, so no grad1 or norms were written for this backward. Backpropagate "
            "through the computation itself (through the solver's steps), or take the inner "
            "torch.autograd.grad with respect to the state only and let the parameters' "
            "gradients come from an ordinary call of the module (as implicit differentiation "
            "of a fixed point can: one call f(z*, x) with autograd on, its gradient hook "
            "solving for the adjoint), or freeze these parameters."
        )

    def grad1_of_backward(self, bw: Backward, pid: int, p: nn.Parameter) -> Tensor | None:
        """What backward ``bw`` added to ``p.grad1`` (``None``: nothing)."""
        if pid not in self.state.written or pid not in bw.before:
            return None
        g1 = p.grad1.detach()
        before = bw.before[pid]
        return g1 if before is None else g1 - before

    def rollback(self, bw: Backward, only: set[int] | None = None) -> None:
        """Put back the grad1 a backward started from (of the parameters ``only``, or all).
        ``bw.before`` holds a reference to it, so it was never written in place
        (``_writable_grad1`` refuses a referenced grad1)."""
        for pid, before in bw.before.items():
            p = self.state.written.get(pid)
            if p is None or (only is not None and pid not in only):
                continue
            if before is None:
                del self.state.written[pid]
                if only is not None and grad_of(p) is not None:
                    # (left out of a backward that reached its call: its grad1 goes as its
                    # .grad went since the reset, zeros after zero_grad(set_to_none=False),
                    # at the backward's end: _settle)
                    self.state.stale[pid] = p
                elif hasattr(p, "grad1"):
                    del p.grad1
            else:
                p.grad1 = before

    def undo_grads(self, bw: Backward) -> None:
        """Before a refusal of backward ``bw``: each ``.grad`` it added to back as it was.
        ``None`` where it was ``None``; a ``.grad`` autograd replaced (a ``create_graph``
        backward adds out of place) is the tensor kept, unchanged; one it added into in place
        (an earlier micro-batch's sum, or zeros after ``zero_grad(set_to_none=False)``) gets
        the gradient it was given subtracted: zeros exactly, a sum to the rounding of that one
        addition. Nothing is copied in a backward that is not refused."""
        added, bw.added = bw.added, {}
        with torch.no_grad():
            for pid, (old, new) in added.items():
                found = self.state.params.get(pid)
                if found is None:
                    continue
                p = found[1]
                if old is None:
                    p.grad = None
                elif grad_of(p) is old and new is not None:
                    old.sub_(new.to(old.dtype) if new.dtype != old.dtype else new)
                else:
                    p.grad = old

    def refuse(self, bw: Backward) -> None:
        """Before a refusal of backward ``bw``: its ``grad1`` and its additions to ``.grad``
        undone, nothing of it left collected."""
        self.rollback(bw)
        self.undo_grads(bw)
        if self.state.collector is not None:
            self.state.collector.discard_backward()

    def abort(self) -> None:
        """A refusal raised by a hook of gradhooks' outside this writer (around a module's
        backward hook of the user's): the backward fails; leave nothing of it behind."""
        self._abort_backward()

    def _abort_backward(self) -> None:
        """A hook of ours raised: the backward fails; leave nothing of it behind."""
        bw = self.state.tasks.pop(graph_task(), None)
        if bw is not None:
            self.rollback(bw)
            self.undo_grads(bw)
            self._put_back(bw)
        if self.state.collector is not None:
            self.state.collector.discard_backward()

    def drop_stale(self) -> None:
        """At a forward outside any backward: a backward still recorded as running failed
        (an exception elsewhere in it); undo what it wrote."""
        for bw in self.state.tasks.values():
            self.rollback(bw)
            self._put_back(bw)
        self.state.tasks.clear()
        if self.state.collector is not None and self.state.collector._queued:
            self.state.collector.discard_backward()

    def accumulate(
        self, qualname: str, p: nn.Parameter, g1: Tensor, bw: Backward | None = None
    ) -> None:
        """Add ``g1``, one call's per-example gradient of ``p``, to ``p.grad1``; ``bw``: the
        backward that formed it, where there is one."""
        if g1.dtype != p.dtype:
            g1 = g1.to(p.dtype)
        if id(p) in self.state.written:
            old = p.grad1
            if old.shape[1:] == g1.shape[1:] and 0 in (old.shape[0], g1.shape[0]):
                # (a micro-batch without examples: it adds nothing to any example's gradient,
                # as its .grad of zeros adds nothing to .grad)
                p.grad1 = g1 if old.shape[0] == 0 else old.to(g1.dtype)
                return
            if old.shape != g1.shape:
                double = bw.derived if bw is not None else None
                if double is not None or old.requires_grad or g1.requires_grad:
                    raise StateError(_through_double_backward(qualname, old, g1, double))
                raise StateError(
                    f"grad1 of '{qualname}' holds {tuple(old.shape)} from an earlier call in this "
                    f"accumulation (or set by hand since), this call gives {tuple(g1.shape)}: the "
                    "batch size changed. "
                    "Call clear() (autograd-hacks: clear_backprops(model)) between steps, or "
                    "make every hooked layer see the same batch; one loss over batches of "
                    "different sizes (two datasets in one step) has no per-example rows: "
                    "concatenate them into one forward, or backpropagate each batch's loss "
                    "alone and read grad1 after each; a step that needs no grad1 (a training "
                    "step on examples scored before) runs its forward and backward under "
                    "gradhooks.paused() (autograd-hacks: disable_hooks(), then enable_hooks()). "
                    "Micro-batches accumulated into one step "
                    "must have the same size: a data loader's shorter last batch breaks that "
                    "(DataLoader(..., drop_last=True); Hugging Face's Trainer: "
                    "dataloader_drop_last=True). Not accumulating? Then its .grad was not reset "
                    "since the last step either: an optimizer's zero_grad() resets only the "
                    "parameters it holds (model.zero_grad() resets them all; "
                    "requires_grad_(False) on those you do not train)."
                )
            if old.dtype != g1.dtype:  # (converted since: model.half(), as .grad was)
                old = old.to(g1.dtype)
            p.grad1 = old + g1
        else:
            p.grad1 = g1


def _refuse_foreign_grad1(target: Target, pname: str, p: nn.Parameter) -> None:
    """A ``grad1`` this backward would add to that is no tensor (set by hand since the last
    backward): refused before anything is written, naming it."""
    kept = p.__dict__.get("grad1")
    if not isinstance(kept, Tensor):
        raise ConfigurationTypeError(
            f"'{pname}' of {target.where} has a grad1 of type {type(kept).__qualname__}, set "
            f"since the last backward: gradhooks adds each backward's per-example gradients "
            f"[batch, *{tuple(p.shape)}] to grad1, as autograd adds to .grad. Delete it (del "
            "p.grad1, or h.clear() for every parameter) before the backward, or keep your own "
            "values under another name."
        )


def _through_double_backward(qualname: str, old: Tensor, g1: Tensor, where: str | None) -> str:
    """The refusal of rows of another batch added to ``grad1`` where a ``create_graph=True``
    backward is involved: a second-order step whose inner step was captured (MAML, ANIL, with
    a support batch of another size than the query's), not batches to concatenate."""
    through = f", reached at {where}" if where is not None else ""
    return (
        f"grad1 of '{qualname}' holds {tuple(old.shape)} from an earlier call, this call gives "
        f"{tuple(g1.shape)}: a double backward is involved (this backward goes through the "
        f"graph of an earlier torch.autograd.grad(..., create_graph=True){through}, or one "
        "of them ran with create_graph=True: the inner step of a second-order meta-learning step, MAML "
        "or ANIL, on a support batch of another size than the query's). Per-example gradients "
        "through a double backward are not formed by hooks, and the support's rows are not "
        "the query's examples. Run the inner step (its forward and its torch.autograd.grad) "
        "under `with h.paused():`: grad1 is then each query example's gradient through the "
        "adaptation. For per-example gradients of the inner step itself, use torch.func "
        "(gradhooks.oracle.vmap_grad)."
    )


def different_batches(rows: dict[int, tuple[str, bool]]) -> str:
    """The refusal of a backward whose calls gave different numbers of examples, one of them
    in a forward of a submodule called on its own."""
    (n, (a, _)), (m, (b, _)) = list(rows.items())[:2]
    return (
        f"gradhooks: in one backward, {a} gave a per-example gradient for {n} examples and "
        f"{b} for {m}: their rows are not the same examples, and no grad1 was written. Where "
        "the model's submodules are called outside its forward (a method such as CLIP's "
        "encode_text, model.forward(x) called directly, or checkpoint_sequential(model, ...), "
        "which calls the layers one by one), each call takes its batch from its "
        "own input, and what the code does between them (x.permute(1, 0, 2), x.view(B * T, "
        "...)) is not followed: call the model itself, model(x), or move that code into a "
        "submodule's forward. One loss over batches of different sizes (two datasets in one "
        "step) has no per-example rows: backpropagate each alone."
    )


def _batched(grads) -> bool:
    """Whether a backward's gradients are batched by ``vmap`` (``is_grads_batched``)."""
    for g in grads:  # (a loop: this runs for every call and every parameter gradient)
        if g is not None and _torch.is_grads_batched(g):
            return True
    return False


def _same(final: Tensor, raw: Tensor, version: int) -> bool:
    """The gradient a parameter's hooks ended with is the one autograd gave, unchanged."""
    return final is raw and _torch.version(raw) == version


# (the gradient a hook got against grad1's batch sum: two sums of the same terms)
_ROUNDING = {torch.float64: 1e-9, torch.float32: 1e-4}


def _multiple(raw: Tensor, final: Tensor, tol: float) -> float | None:
    """``c`` where ``final == c * raw`` (to rounding), else ``None``."""
    if final.shape != raw.shape or final.is_sparse or raw.is_sparse:
        return None
    r, f = raw.detach().double().flatten(), final.detach().double().flatten()
    rr = float(r @ r)
    if rr == 0.0:
        return 1.0 if not bool(f.any()) else None
    c = float(r @ f) / rr
    scale = max(float(f.abs().max()), abs(c) * float(r.abs().max()))
    return c if float((f - c * r).abs().max()) <= tol * scale else None


def _note_frame(
    bw: Backward, frame: Frame, pids: Iterable[int], target: Target, shared: dict
) -> bool:
    """Backward ``bw`` reached parameters ``pids`` (by id) from the forward ``frame``, through a
    call of ``target`` or a use the tracker followed: which forwards it reached, for the
    probe's check, and where their examples lie (``shared``: given the inputs of the forward
    taken as shared by every example, :attr:`CaptureState.shared_inputs`). Returns whether
    that adds a forward whose rows are to be checked against the others'
    (:meth:`BackwardWriter._check_rows`)."""
    if bw.verify:  # (for the probe's check)
        for pid in pids:
            bw.frames_of.setdefault(pid, set()).add(id(frame))
    if id(frame) in bw.frames:
        return False
    bw.frames.add(id(frame))
    if frame.shared:
        shared.update(dict.fromkeys(frame.shared))
    if frame.rows is None:
        return False
    bw.rows_of.append((frame.rows, target.where))
    return len(bw.rows_of) > 1

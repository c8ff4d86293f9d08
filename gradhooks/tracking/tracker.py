"""Where the examples are: the batch followed through a forward, one torch function at a time.

A rule reads the batch from one dimension of its layer's input. In the models people train that
is not always so: a learned position embedding is looked up with ``arange(T)`` and broadcast into
the batch afterwards; Swin folds the windows of every image into dimension 0 (``[B * windows,
...]``); a sequence-first model keeps the batch on dimension 1. Sizes cannot tell these apart (a
sequence as long as the batch is large looks like a batch), so the engine follows the batch
itself: while a hooked model's forward runs, a :class:`Tracker` (a ``TorchFunctionMode``) sees
every torch function call and records, for each tensor that depends on the examples, a
:class:`Layout`: the dimension that holds them and how they are laid out in it. Tensors that do
not depend on the examples (parameters, buffers, positions from ``arange``, masks) carry none.

A layout ``Layout(dim, outer, inner)`` says that dimension ``dim`` has ``outer · batch · inner``
entries and that entry ``(a · batch + b) · inner + c`` belongs to example ``b``: ``[B, T, C]`` is
``Layout(0)``, Swin's windows ``[B * W, N, C]`` are ``Layout(0, inner=W)``, a sequence-first
``[T, B, C]`` is ``Layout(1)``. :data:`UNKNOWN` marks a tensor that depends on the examples
through an operation whose effect on the layout is not known here.

Batch-free inputs that meet the batch. A hooked call (or a parameter used outside its module's
call) whose inputs carry no layout is *batch-free*: its output is the same for every example and
is broadcast into the batch later (the position embedding). Its per-example gradient is defined,
but autograd sums it over the batch where the broadcast happens, so the output's gradient the
hooks see is already summed. The tracker therefore marks such outputs as *sources* and, where a
tensor derived from them meets a tensor with a layout (the *meeting* operation), recovers each
example's share of the gradient:

- an elementwise operation that broadcasts the batch-free operand along the batch (``x + pos``,
  ``scores + bias``) runs with that operand expanded along the batch dimension; the gradient of the
  expanded operand is then per example, at no extra cost;
- any other operation (``torch.bmm`` of a repeated table, ``torch.cat``) is differentiated again at
  the backward, one example's part of the output-gradient at a time (batched with
  ``is_grads_batched``).

The per-example gradient of the meeting operand is taken back to the sources through the
batch-free operations between them (``torch.autograd.grad`` with ``is_grads_batched``). A source's
per-example output-gradients, summed over the examples, must equal the gradient autograd gives
its output; where they do not (a gradient reached it without passing the batch), the engine
raises rather than give a wrong number.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from .. import _torch
from .aliases import aliased
from .layout import MIXED, PACKED, UNKNOWN, Layout, Owners
from .link import EngineLink
from .meeting import guard_vmapped, meet, note_transformed, vmapped_rows
from .ops import data_args, facts, facts_named, quick_table
from .ops.common import op_name, out_tensors, tensor_args
from .ops.names import PICKS
from .ops.views import DECOMPOSED
from .propagate import ListedJoin, SharedInput, propagate_op
from .quick import NO_TENSOR, UNLAID, follow, quick_follow, quick_key, untainted
from .read import READS_ROWS, note_read
from .rows import READS_VALUE, Placed, note_decided, note_placed, uneven_placed
from .sources import COPIES, SPREADS, Meeting, Source
from .tensormap import TensorMap

# the maps of a Tracker made at their first use (see Tracker.__getattr__)
_LAZY_MAPS = frozenset(
    {
        "spread",
        "alone",
        "orders",
        "ranked",
        "single",
        "presumed",
        "candidates",
        "would",
        "wide",
    }  # fmt: skip
)


@dataclass
class _Use:
    """What one hooked call's operations did: the ids of the parameters it covers that they
    used, the ids of the hooked modules called inside it, and the ids of the parameters those
    calls give gradients for (``claimed``: all a call with a rule covers; those a call without
    one used in operations of its own)."""

    params: set[int] = field(default_factory=set)
    called: set[int] = field(default_factory=set)
    claimed: set[int] = field(default_factory=set)
    soft: bool = False
    sources: dict[int, Source] = field(default_factory=dict)  # soft: per parameter id
    functional: set[int] = field(default_factory=set)  # soft: captured as a function's call
    # soft: the operations of its own that mixed rows of the batch (see Tracker.absorb)
    mixing: set[str] = field(default_factory=set)
    mixed: bool = False  # soft: an operation of its own gave a tensor with mixed rows
    graph: bool = True  # autograd recorded a graph where the call started
    where: str | None = None  # the module as the errors quote it ('bn1'), for messages


class Tracker(TorchFunctionMode):
    """Follows the batch through one forward of a hooked model (see the module docstring).

    ``batch``: the number of examples. ``params``: ``{id(p): (name, p)}`` of the parameters the
    hooks cover. ``engine``: the engine, told about what the forward does that it acts on
    (:class:`gradhooks.tracking.link.EngineLink`); ``None`` in tests of the layouts alone.
    """

    # The maps a forward rarely needs: each is made at its first use (:meth:`__getattr__`), so
    # that the forwards that never touch them (most) do not build them. Each maps a tensor to
    # what the tracker knows of it:
    # tensors expanded from another: expanded -> (from, how)
    spread: TensorMap
    # tensors (mixed) that are one example taken out of the batch alone, x[i] or x.unbind(0), with
    # the operation and the batch dimension it dropped, for messages
    alone: TensorMap
    # the tensors of ``reordered`` with the dimension and permutation each was reordered by, and
    # the layout of the batch before (x[perm]: put back in order by x[perm][perm.argsort()])
    orders: TensorMap
    # tensors whose rows hold the examples in an order computed across the batch (sorted by a key
    # of each example's data, x[x.norm(dim=1).argsort()]), with the operation that ordered them,
    # until put back (see rows.follow_ranked)
    ranked: TensorMap
    # tensors that are one example taken out of the batch alone, or computed from one alone
    # (x.unbind(0), x[i], f(x[i])): the example and the layout of the batch it came from (see
    # rows.singles), and how many joins of them gave the batch back (never kept by memo)
    single: TensorMap
    # tensors of unknown layout whose examples are presumed where they were (propagate.presume)
    presumed: TensorMap
    # the model's inputs taken as holding the examples by their size alone (not its first input),
    # with the place of each among its tensor inputs: an operation that would mix the examples
    # only because of one of them, or of what was computed from them alone, takes them as
    # shared by every example instead (:func:`~.propagate.without_candidates`)
    candidates: TensorMap
    # tensor -> the indices in ``pending`` of the calls it was computed from
    would: TensorMap
    # one-hot encodings of indices of each example alone whose number of classes was computed
    # across the examples: only their width is (see rows.follow_coupled)
    wide: TensorMap

    def __init__(
        self,
        batch: int,
        params: dict[int, tuple[str, Tensor]],
        engine: EngineLink | None = None,
    ):
        super().__init__()
        self.batch = batch
        self.params = params
        self.engine = engine
        self.layouts: TensorMap = TensorMap()
        self.taints: TensorMap = TensorMap()  # tensor -> frozenset[Source]
        self.covered: list[
            frozenset[int]
        ] = []  # parameter ids of the calls running, innermost last
        self.used: list[_Use] = []  # per running call
        self.graph = torch.is_grad_enabled()  # (where the model's forward started)
        self.param_sources: dict[int, Source] = {}
        self.edges: dict[Source, Any] = {}  # each source's tensor's gradient edge
        self.meetings: list[Meeting] = []
        self.unmet: set[Source] = set()  # sources used in place, as they are, with the batch
        self.unknown: dict[str, None] = {}  # operations that lost the layout, for messages
        self.mixed: dict[str, None] = {}  # operations that mixed the examples, for messages
        # tensors whose rows along the batch are the examples in another order (x[perm]), with
        # the operation that reordered them
        self.reordered: TensorMap = TensorMap()
        # the batch sizes of the model's input PackedSequences whose examples are packed in
        # another order than the batch's (pack_sequence(..., enforce_sorted=False)), with that
        # order, their sorted_indices: padded again, the rows are in that order (see
        # propagate.unpacked_in_order)
        self.packed_orders: TensorMap = TensorMap()
        # the data of the PackedSequences of the forward, whole (the model's inputs', what
        # pack_padded_sequence and the recurrent layers gave, and what keeps each of their rows
        # apart and in place), with their batch sizes and the order the examples were packed in
        # (sorted_indices; None: the batch's): which example each row is (see packed_owners)
        self.packed_data: TensorMap = TensorMap()
        self.rejoined = 0
        # the model's first input as the engine took it (:meth:`give`), and its shape
        self.given: TensorMap = TensorMap()
        self.given_shape: tuple[int, ...] | None = None
        # tensors every torch function gets in place of others, by the others' ids: the
        # detached parameters of a call whose rule gives their batch gradients itself
        self.aliases: dict[int, Tensor] = {}
        # tensor -> the ids of the candidates its layout comes from, where it comes from them
        # alone (a candidate itself, a hooked call on one, what was computed from those)
        self.lineage: TensorMap = TensorMap()
        # the hooked calls on such tensors alone, which become batch-free calls (their outputs
        # sources) where their candidates are taken as shared (:meth:`note_call`)
        self.pending: list[_Pending] = []
        # the ids of candidates already combined with the examples row by row, or met by a
        # parameter as batched: never taken as shared afterwards (the forward so far assumed
        # they held the examples)
        self.joined: set[int] = set()
        self.func: Any = None  # the torch function being followed (a meeting formed later)
        # tensors computed across the examples that carry no gradient and no values computed
        # with (indices, masks), with the operation that did (see rows.follow_coupled)
        self.coupled: TensorMap = TensorMap()
        # positions of rows that nonzero found in a tensor with examples (rows.follow_row_indices)
        self.row_index: TensorMap = TensorMap()
        # indices whose every entry is a position along the examples' dimension that each
        # example's own mask found, with that dimension's layout (see rows.follow_positions)
        self.positions: TensorMap = TensorMap()
        # what rows picked by their place in the batch reached, per hooked module (see
        # note_placed)
        self.placed: dict[Any, Placed] = {}
        # the examples whose own values, alone, the forward read into Python (an ``if`` on
        # each one's rows), with the first such read, for messages (see rows.note_decided)
        self.decided: dict[int, str] = {}
        # the floating-point dtype that rounds the most among the tensors computed from the
        # examples (a float64 model that takes its softmax in float32, as T5 does): the checks
        # of the backward judge by it (see gradhooks.engine.verify)
        self.precision: torch.dtype | None = None
        # the floating-point numbers read into Python from tensors computed across the
        # examples (float(h.abs().max()), .item()), with the operation that read each: an
        # operation given one back as an argument mixes the examples (see read_back)
        self.read: dict[float, str] = {}
        # the lists and arrays read into Python from tensors computed across the examples
        # (indices of the batch's top-k, .numpy() or .tolist()), by id, each kept with the
        # operation that read it: an operation given one back as an argument, an index of the
        # examples' entries chosen by all of them, mixes the examples (see rows_back)
        self.read_rows: dict[int, tuple[Any, str]] = {}
        # the ids of the candidates held with the model's first input in one list or tuple,
        # where the engine takes the batch from dimension 0 of the first by its guess (see
        # note_listed), and the joins of the forward that treated them as the examples
        self.listed: set[int] = set()
        self.listed_joins: list[ListedJoin] = []
        # the candidates the forward took as shared by every example after all, as it did
        # (see propagate.take_as_shared): their rows are no example's own
        self.shared_inputs: list[SharedInput] = []
        # the tensors the forward kept the gradient of (``h.retain_grad()``), weakly: a
        # backward of autograd's own through the graph (the checks of the engine's) adds to
        # their ``.grad`` too, which the engine puts back as it was (see
        # gradhooks.engine.verify)
        self.retained: list[weakref.ref] = []
        self.off = 0
        # the functions that may take the short way of __torch_function__, and what makes
        # every call take the long way while any of it is not empty (the same objects for
        # the tracker's life: the maps are emptied, never replaced). None where torch.compile
        # cannot be left at a hook (the eval_frame internal missing): dynamo then traces the
        # forward with the tracker in it, which it follows by the long way's graph breaks but
        # fails to guard on the short way's
        self.quick = quick_table() if _torch.available("eval_frame") else {}
        self.blocking = (
            self.aliases, self.coupled.entries, self.read, self.read_rows, self.row_index.entries,
            self.positions.entries, self.reordered.entries, self.lineage.entries,
            self.packed_orders.entries, self.packed_data.entries,
        )  # fmt: skip

    def __getattr__(self, name: str) -> Any:
        # (only where the attribute is not set: a map of _LAZY_MAPS at its first use)
        if name in _LAZY_MAPS:
            made = self.__dict__[name] = TensorMap()
            return made
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    # -- what the engine asks ---------------------------------------------------------------------

    def layout(self, t: Any) -> Layout | None:
        """``t``'s layout, or ``None`` where it does not depend on the examples."""
        if not isinstance(t, Tensor):
            return None
        return self.layouts.get(t)

    def sources_of(self, t: Any) -> frozenset[Source]:
        return self.taints.get(t, frozenset()) if isinstance(t, Tensor) else frozenset()

    def set_layout(self, t: Tensor, layout: Layout | None) -> None:
        if layout is None:
            self.layouts.pop(t, None)
        else:
            self.layouts[t] = layout

    def in_call(self, name: str) -> str:
        """``name``, an operation that mixed the examples, with the innermost hooked call it ran
        in (``"batch_norm in 'layer1.0.bn1'"``), for messages."""
        where = next((u.where for u in reversed(self.used) if u.where is not None), None)
        return name if where is None else f"{name} in {where}"

    def mixing(self, default: str = "an operation across the batch") -> str:
        """The operations that mixed the examples, for messages: the first three (each with
        the call it ran in), and how many more."""
        ops = list(self.mixed)
        if not ops:
            return default
        more = f", and {len(ops) - 3} more" if len(ops) > 3 else ""
        return ", ".join(ops[:3]) + more

    def give(self, t: Tensor, layout: Layout) -> None:
        """``t``, the model's first input, holds the examples on ``layout`` as the engine took
        them (dimension 0, or ``batch_dim``): an operation that contracts that dimension of
        ``t`` itself tells more likely that they are not there than that the model mixes them
        (:data:`~gradhooks.tracking.layout.CONTRACTED`)."""
        self.set_layout(t, layout)
        self.given[t] = True
        self.given_shape = tuple(t.shape)

    def mark_mixed(self, outs: Sequence[Tensor], why: str) -> None:
        """``outs`` mix the examples, for ``why`` (named where a layer reading them is
        refused): what the engine found of a call the mode does not see into."""
        self.mixed.setdefault(why, None)
        for o in outs:
            self.layouts[o] = MIXED

    def add_candidate(self, t: Tensor, layout: Layout, position: int) -> None:
        """``t``, an input of the model other than its first (``position``: its place among
        the model's tensor inputs), is taken as holding the examples on ``layout`` by its size
        alone (:attr:`candidates`)."""
        self.set_layout(t, layout)
        self.candidates[t] = position
        self.lineage[t] = frozenset({id(t)})

    def note_packed(self, data: Tensor, sizes: Tensor, order: Tensor | None) -> None:
        """``data``: the whole data of a PackedSequence of batch sizes ``sizes``, its examples
        packed in the order ``order`` (its ``sorted_indices``; ``None``: the batch's)."""
        self.packed_data[data] = (sizes, order)

    def packed_owners(self, tensors: Sequence[Any]) -> Layout | None:
        """Where every one of ``tensors`` that is a PackedSequence's data (:data:`PACKED`) is
        the whole data of one and the same (:meth:`note_packed`): the example of each of its
        rows, as rows picked from the batch (:class:`Owners` on dimension 0; row ``r`` of time
        step ``k``'s block is the ``r``-th example in the order they were packed in). Else
        ``None``."""
        found, rows = None, None
        for t in tensors:
            if self.layout(t) is not PACKED:
                continue
            entry = self.packed_data.get(t)
            if entry is None or (rows is not None and t.shape[0] != rows):
                return None
            if found is not None and entry is not found:
                same = torch.equal(entry[0], found[0]) and (
                    (entry[1] is None and found[1] is None)
                    or (entry[1] is not None and found[1] is not None
                        and torch.equal(entry[1], found[1]))
                )  # fmt: skip
                if not same:
                    return None
            found, rows = entry, t.shape[0]
        if found is None:
            return None
        sizes, order = found
        sizes = sizes.to("cpu", torch.int64)
        if int(sizes.sum()) != rows:
            return None
        first = next(t for t in tensors if self.layout(t) is PACKED)
        steps = torch.arange(int(sizes[0]))
        picked = steps.expand(len(sizes), -1)[steps[None, :] < sizes[:, None]]
        if order is not None:
            picked = order.to("cpu", torch.int64)[picked]
        return Layout(0, owners=Owners(picked.to(first.device)))

    def note_listed(self, tensors: Sequence[Tensor]) -> None:
        """``tensors``: the model's inputs held with its first in one list or tuple, the batch
        taken from dimension 0 of the first by the default guess. Where the list's index is
        put beside that dimension by a join (:func:`~.propagate.listed_join`), its tensors may
        each be one example as well as each a batch of the same examples (two views of one batch):
        the join is kept in :attr:`listed_joins` for the engine to refuse."""
        self.listed = {id(t) for t in tensors if t in self.candidates}

    def note_call(self, inputs: list, outputs: list, shared: Callable[[list], list]) -> None:
        """A hooked call whose examples are where its rule reads them: where its inputs with
        examples come from candidates alone, it is kept, and ``shared(outputs)`` (which makes
        the call batch-free and returns its outputs' sources) is called where those candidates
        are taken as shared after all."""
        if not self.lineage:
            return
        found = [self.lineage.get(t) for t in inputs
                 if isinstance(t, Tensor) and self.layout(t) is not None]  # fmt: skip
        every = frozenset().union(*(f for f in found if f))
        if not every:
            return
        if None in found:  # (also the examples of the first input: batched for good)
            self.joined |= every
            return
        key = len(self.pending)
        outs = [o for o in outputs if isinstance(o, Tensor)]
        self.pending.append(_Pending(every, outs, shared, [_edge(o) for o in outs]))
        # (and the calls its inputs were computed from: an encoder of two layers, whose first's
        # source the second's outputs carry to where they meet the batch)
        before = frozenset().union(
            *(self.would.get(t, frozenset()) for t in inputs if isinstance(t, Tensor))
        )
        for o in outs:
            if self.layout(o) is not None:
                self.lineage[o] = every
            self.would[o] = before | {key}

    def note_placed(self, module: Any, where: str, shapes: str, layouts: Sequence) -> None:
        """A hooked call of ``module`` (``where`` and ``shapes``: as a refusal quotes them) on
        tensors laid out as ``layouts``: where some hold rows picked by their place in the
        batch (``x[:2]``, ``x[i : i + 1]``), which examples they hold is counted, for
        :meth:`uneven_placed`."""
        note_placed(self, id(module), where, shapes, layouts)

    def uneven_placed(self, outputs: list, where: str) -> str | None:
        """At the end of the forward, given the model's outputs with a gradient (``where``: the
        model, as a refusal quotes it): why it cannot be split into examples where rows
        picked by their place in the batch reached a hooked module, or the outputs, for some
        examples and not for others (:func:`~.rows.uneven_placed`), else ``None``."""
        return uneven_placed(self, outputs, where)

    def carry(self, old: Tensor, new: Tensor) -> None:
        """``new`` replaces ``old``, a hooked call's output: its layout (or where its examples
        are presumed), sources and lineage."""
        self.set_layout(new, self.layout(old))
        # (each map looked into only where it holds any tensor: most forwards fill none)
        if self.presumed.entries and old in self.presumed:
            self.presumed[new] = self.presumed[old]
        if self.taints.entries:
            self.taint(new, self.sources_of(old))
        if self.lineage.entries and old in self.lineage:
            self.lineage[new] = self.lineage[old]
        if self.packed_data.entries and old in self.packed_data:
            self.packed_data[new] = self.packed_data[old]
        if self.would.entries and old in self.would:
            self.would[new] = self.would[old]
            for k in self.would[old]:
                p = self.pending[k]
                if any(o is old for o in p.outputs):
                    p.edges = [_edge(new) if o is old else e for o, e in zip(p.outputs, p.edges)]
                p.outputs = [new if o is old else o for o in p.outputs]

    def add_source(self, t: Tensor, source: Source) -> None:
        """``t`` (the output of a batch-free hooked call) is a source from now on."""
        self.edges[source] = torch.autograd.graph.get_gradient_edge(t)
        self.taint(t, frozenset({source}))

    def taint(self, t: Tensor, sources: frozenset[Source]) -> None:
        if sources:
            self.taints[t] = sources | self.taints.get(t, frozenset())

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The engine's own operations inside a forward are not the model's."""
        self.off += 1
        try:
            yield
        finally:
            self.off -= 1

    def enter_call(
        self, params: Sequence[Tensor] | frozenset[int], module: Any = None, soft: bool = False,
        where: str | None = None,
    ) -> None:  # fmt: skip
        """A hooked call starts; it covers ``params`` (the parameters, or the frozenset of their
        ids): an operation inside it (and not inside
        an inner call that covers them) uses them as that call's own. ``soft`` (a module
        without a rule): its parameters' uses are still followed as direct uses, and its call
        takes over (the ``torch.func`` fallback) only those the tracker cannot handle.
        ``where``: the module as the errors quote it, to say in which call an operation mixed
        the examples."""
        covers = params if type(params) is frozenset else frozenset(id(p) for p in params)
        for record in self.used:
            record.called.add(id(module))
            if not soft:
                record.claimed |= covers
        self.covered.append(covers)
        self.used.append(_Use(soft=soft, graph=torch.is_grad_enabled(), where=where))

    def absorb(self, used: _Use, inputs: list, outputs: list) -> bool:
        """A call of a module without a rule (``used``, just left) whose own operations mixed
        rows of the batch: rows picked by a data-dependent index and put back (a
        mixture-of-experts layer routing each token), which the tracker cannot follow. Its
        ``torch.func`` fallback recomputes it one example at a time (checking that this
        reproduces its output, so a module that truly mixes the examples is an error there):
        its outputs are taken to hold the examples as its first input with examples does,
        where their shapes agree, and its parameters' uses go to the fallback. Returns whether
        it did."""
        if not used.mixing or not used.mixing <= PICKS:
            return False  # (a reduction or product across the batch: truly mixed)
        if any(self.layout(t) is MIXED for t in inputs):
            return False  # (mixed before the call)
        first = next((lay for t in inputs if (lay := self.presumed_of(t)) is not None), None)
        if first is None or first.dim < 0:
            return False
        size = first.size(self.batch)
        lays = [self.layout(o) for o in outputs]
        if not any(lay is MIXED for lay in lays) or any(
            lay is MIXED and (o.dim() <= first.dim or o.shape[first.dim] != size)
            for o, lay in zip(outputs, lays)
        ):
            return False
        for o, lay in zip(outputs, lays):
            if lay is MIXED:
                self.layouts[o] = first
        for s in used.sources.values():
            s.needs_fallback = True
        return True

    def exit_call(self) -> _Use:
        """Leave the innermost call: which of its parameters its operations used, and which
        hooked modules it called."""
        self.covered.pop()
        used = self.used.pop()
        if used.soft:
            for record in self.used:
                record.claimed |= used.params
        return used

    # -- the mode ---------------------------------------------------------------------------------

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        if _ACTIVE and _ACTIVE[-1] is self:
            _ACTIVE.pop()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if (self.taints.entries or self.param_sources) and _torch.in_transform(args, kwargs):
            note_transformed(self, func, args, kwargs)
        if not self.off and _torch.in_transform(args, kwargs) and not _torch.in_own_transform():
            why = vmapped_rows(self, func, args, kwargs)
            if why is not None:
                return guard_vmapped(self, func, args, kwargs, why)
        # The short way: a function whose layouts are kept for any call (quick_kind), where
        # nothing the tracker knows of the forward beyond layouts stands in the way, its
        # tensors carry no source and its parameters are used inside the hooked calls that
        # cover them. The key of what is kept (memo.key, the very tuple) is built in the pass
        # that finds the tensors with layouts; the call is followed as by quick.follow, and where
        # it cannot be (another argument, a new key), by the long way below, from the start.
        try:
            op = self.quick.get(func)
        except TypeError:  # (a function that cannot be hashed: asked by name below)
            op = None
        if op is not None and not self.off and not any(self.blocking):
            if op.metadata or op.free:
                # (x.shape, x.dim(), torch.arange(n): what the long way does with them where
                # none of their tensors has sources, or, made afresh, where they have none;
                # a question where no tensor has any, without a call to ask it)
                if (op.metadata and not op.free and not self.taints.entries) or untainted(
                    self, op, args, kwargs
                ):
                    return func(*args, **kwargs)
            else:
                parts = quick_key(self, op, args, kwargs)
                if parts is UNLAID:
                    return func(*args, **kwargs)  # (no tensor with a layout: nothing to follow)
                if parts is not None:
                    return quick_follow(self, op, func, args, kwargs, parts)
        if self.aliases:
            args, kwargs = aliased(self.aliases, args, kwargs)
        if func is _RETAIN_GRAD and args and isinstance(args[0], Tensor):
            self.retained.append(weakref.ref(args[0]))
        if self.off:
            return func(*args, **kwargs)
        tensors = tensor_args(args, kwargs)
        if not tensors:
            return func(*args, **kwargs)
        op = facts(func)
        if op.like and len(tensors) > 1:
            tensors = tensor_args(*data_args(op.name, args, kwargs))
        laid, sources, direct = False, _NO_SOURCES, []
        taints, params = self.taints, self.params
        found = self.layouts.entries  # (TensorMap.get, inlined: once per tensor of every call)
        tainted = taints.entries
        for t in tensors:
            if not laid:
                e = found.get(id(t))
                if e is not None and e[0]() is t:
                    laid = True
            if tainted:  # (empty until a batch-free call or a direct use of a parameter)
                s = taints.get(t)
                if s:
                    sources = sources | s
            if id(t) in params:
                if op.metadata:
                    continue  # (reading p.dtype or p.requires_grad is no use of its values)
                where = self.covering(id(t))
                if where is None:
                    direct.append(t)
                else:
                    self.used[where].params.add(id(t))
                    if self.used[where].soft:
                        direct.append(t)
        if not laid and not sources and not direct:
            return func(*args, **kwargs)
        if direct and op.inplace and args[0] is direct[0] and not torch.is_grad_enabled():
            # (a parameter written in place without grad, before its module's call: by a
            # pre-hook that renormalizes or re-initializes it, from whatever values; it stays a
            # leaf without history, which its call then uses, as the next forward would)
            return func(*args, **kwargs)
        name = op.name
        split = DECOMPOSED.get(name) if sources or direct else None
        if split is not None and self._outside(sources, direct):
            # (a tensor derived from a parameter used outside its module's call goes through
            # each part alone, to meet the batch where it is combined with it)
            return tuple(self.__torch_function__(f, types, a, k) for f, a, k in split(args, kwargs))
        if direct and op.maybe_same and isinstance(args[0], Tensor):
            out = func(*args, **kwargs)
            if out is args[0]:
                return out  # (a parameter converted to what it is: no use of it, as module.to())
        self.off += 1
        try:
            if not sources and not direct:
                out = func(*args, **kwargs)
                if out.__class__ in NO_TENSOR and not op.inplace:
                    if out.__class__ is float and self.layouts.get(tensors[0]) is MIXED:
                        note_read(self.read, out, name)  # (a statistic of the batch)
                    # (if x[i : i + 1].sum() > 0: per example; not inside a module without
                    # a rule, whose call the fallback recomputes one example at a time, each
                    # reading its own, and checks against the call's output)
                    if name in READS_VALUE and not (self.used and self.used[-1].soft):
                        note_decided(self, name, tensors[0])
                    return out  # (a size, a dtype, a flag: nothing to follow, see propagate)
                if name in READS_ROWS and self.layouts.get(tensors[0]) is MIXED:
                    self.read_rows[id(out)] = (out, name)  # (held: its id stays its own)
                if isinstance(out, Tensor) and out.dtype is not self.precision:
                    self.note_precision(out)
                self.func = func
                try:
                    # (``tensors`` are the tensors whose values it computes with, as there)
                    if op.kept:
                        follow(self, op, args, kwargs, out, tensors)
                    else:
                        propagate_op(self, op, args, kwargs, out, tensors)
                finally:
                    self.func = None
                return out
            if laid:
                out = meet(self, func, name, args, kwargs, tensors, direct)
                self.note_precision(out)
                self._hold(direct, args, out)
                return out
            sources = set(sources)
            for p in direct:
                sources.add(self.param_source(p))
            if True:  # batch-free: the sources flow on
                out = func(*args, **kwargs)
                self._hold(direct, args, out)
                frozen = frozenset(sources)
                outs = out_tensors(out)
                if not outs and op.inplace and isinstance(args[0], Tensor):
                    outs = [args[0]]  # (M[rows, cols] = weight: M derives from the weight now)
                for o in outs:
                    self.taint(o, frozen)
                if name in SPREADS and isinstance(out, Tensor) and isinstance(args[0], Tensor):
                    self.spread[out] = (args[0], name)
                elif name in COPIES and isinstance(out, Tensor) and args[0] in self.spread:
                    self.spread[out] = self.spread[args[0]]  # (MPNet: expand(...).contiguous())
                for s in sources:
                    s.uses.append(("free", name))
                return out
        finally:
            self.off -= 1

    def _outside(self, sources: frozenset, direct: list) -> bool:
        """Whether ``sources`` or the parameters ``direct`` hold one used outside its
        module's call (not one that a module without a rule, whose fallback takes it over,
        uses)."""
        return any(not getattr(s, "soft", False) for s in sources) or any(
            self.covering(id(p)) is None for p in direct
        )

    def note_precision(self, out: Any) -> None:
        """Keep :attr:`precision` (an operation on the examples' tensors gave ``out``)."""
        d = out.dtype if isinstance(out, Tensor) else None
        if d is not None and d.is_complex:
            d = d.to_real()  # (complex32 rounds as float16)
        if d is None or d is self.precision or not d.is_floating_point:
            return
        if self.precision is None or torch.finfo(d).eps > torch.finfo(self.precision).eps:
            self.precision = d

    def graph_where_called(self) -> bool:
        """Whether autograd recorded a graph where the innermost running call (or the
        model's forward) started. Turned off inside it since (a custom ``autograd.Function``'s
        forward, a ``no_grad`` block of the forward), a parameter's gradient from there comes
        from a backward written by hand, which the tracker cannot split by example; off
        already (reentrant checkpointing's first forward), the call is run again, with a
        graph, in the backward, and followed there."""
        return self.used[-1].graph if self.used else self.graph

    def covering(self, pid: int) -> int | None:
        for i in range(len(self.covered) - 1, -1, -1):
            if pid in self.covered[i]:
                return i
        return None

    def _hold(self, direct: list[Tensor], args: tuple, out: Any) -> None:
        """An operation used parameters directly (``direct``): their sources are tied to the
        autograd node of its output, so that they live as long as the graph through it (a
        problem found on the way is reported at the backward, never dropped with the tracker),
        and a backward that passes through it tells the engine that these parameters'
        gradients come from a forward the tracker followed (:meth:`EngineLink.direct_reached`)."""
        if not direct or self.engine is None:
            return
        outs = out_tensors(out) or [a for a in args[:1] if isinstance(a, Tensor)]
        node = next((o.grad_fn for o in outs if o.grad_fn is not None), None)
        if node is None:
            return
        held = []
        for p in direct:
            s = self._found_source(p)
            if s is not None:
                held.append((id(p), s))
        if held:
            engine, unknown = self.engine, self.unknown
            node.register_prehook(
                lambda grad_outputs, held=tuple(held): engine.direct_reached(held, unknown)
            )

    def _found_source(self, p: Tensor) -> Source | None:
        """The source of ``p``'s direct uses made so far, if any (:meth:`param_source`)."""
        where = self.covering(id(p))
        table = self.used[where].sources if where is not None else self.param_sources
        return table.get(id(p))

    def param_source(self, p: Tensor) -> Source:
        """The source of ``p``'s direct uses: one per forward, or, inside a module without a
        rule that covers it (soft), one per call of that module."""
        where = self.covering(id(p))
        record = self.used[where] if where is not None else None
        table = record.sources if record is not None else self.param_sources
        s = table.get(id(p))
        if s is None:
            name, _ = self.params[id(p)]
            s = Source(name, p.shape)
            s.param = True  # type: ignore[attr-defined]
            # (a parameter of a submodule with a rule that the call has called, used directly
            # too: Whisper's logits by its token embedding's weight. Its fallback's
            # recomputation would count the submodule's use again: followed as a use outside
            # any call)
            s.soft = record is not None and id(p) not in record.claimed  # type: ignore[attr-defined]
            self.edges[s] = torch.autograd.graph.get_gradient_edge(p)
            table[id(p)] = s
            if self.engine is not None:
                self.engine.direct_source(s, p)
        return s

    def presumed_of(self, t: Any) -> Layout | None:
        """``t``'s layout, or, where it is unknown, where its examples are presumed."""
        lay = self.layout(t)
        return self.presumed.get(t, lay) if lay is UNKNOWN else lay

    def propagate(self, name: str, args, kwargs, out) -> None:
        """Record the layouts of ``out``, what the torch function ``name`` gave on ``args``
        and ``kwargs``."""
        propagate_op(self, facts_named(name), args, kwargs, out)

    # -- meetings ---------------------------------------------------------------------------------

    def all_sources(self, t: Tensor) -> frozenset[Source]:
        s = self.taints.get(t, frozenset())
        if id(t) in self.params:
            where = self.covering(id(t))
            if where is None:
                s = s | {self.param_sources[id(t)]}
            elif self.used[where].soft:
                s = s | {self.used[where].sources[id(t)]}
        return s

    def finish(self) -> None:
        """At the end of the forward: a source whose every use took it row by row with the
        batch is *aligned* (its call's rows are examples after all: ``Source.aligned``); the
        meetings of the others hook the backward."""
        seen = {s for m in self.meetings for srcs in m.sources for s in srcs} | self.unmet
        if self.taints.entries:  # (none in most forwards: no walk of an empty map)
            seen |= {s for ss in self.taints.values() for s in ss}
        self.unmet = set()
        for s in seen:
            kinds = {u for u in s.uses}
            if kinds and all(k == "aligned" for k, _ in kinds) and len(kinds) == 1:
                s.aligned = next(iter(kinds))[1]
        for m in self.meetings:
            if not all(s.aligned is not None for srcs in m.sources for s in srcs):
                m.arm()
        self.meetings = []
        self.pending = []


@dataclass
class _Pending:
    """A hooked call on tensors computed from candidates alone (:meth:`Tracker.note_call`)."""

    lineage: frozenset[int]  # the candidates' ids
    outputs: list[Tensor]
    shared: Callable[[list], list]  # makes the call batch-free: its outputs' sources
    # the outputs' gradient edges as the call made them (an in-place operation after it, h.relu_(),
    # gives the tensor another)
    edges: list = field(default_factory=list)
    done: bool = False


def _edge(t: Tensor) -> Any:
    """``t``'s gradient edge now, or ``None`` where no gradient reaches it."""
    return torch.autograd.graph.get_gradient_edge(t) if t.requires_grad else None


_ACTIVE: list[Tracker] = []
_RETAIN_GRAD = Tensor.retain_grad

_NO_SOURCES: frozenset = frozenset()


def note(func: Any, args: tuple, kwargs: dict, out: Any) -> None:
    """Tell the running forward's tracker that ``func(*args, **kwargs)`` gave ``out``: for a
    ``TorchFunctionMode`` of a rule's own that computes a torch function another way (the
    tracker then never sees that function, only the operations it was computed with)."""
    if _ACTIVE and not _ACTIVE[-1].off:
        tracker = _ACTIVE[-1]
        layouts = [tracker.layouts.get(t) for t in tensor_args(args, kwargs or {})]
        if any(lay is not None for lay in layouts):
            tracker.propagate(op_name(func), args, kwargs or {}, out)

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
from . import memo
from .aliases import aliased
from .alone import differs_alone
from .couplings import POWERS, arm, coupling, nonlinear, whole_matrix
from .couplings import PRODUCTS as PRODUCTS_OF
from .layout import (
    CONTRACTED,
    MIXED,
    PACKED,
    REORDER,
    UNKNOWN,
    Layout,
    is_followed,
    owned,
    owner_vector,
    sole_owner,
)
from .link import EngineLink
from .ops import (
    INDEX,
    OpFacts,
    data_args,
    facts,
    facts_named,
    handler_for,
    output_layout,
    quick_table,
)
from .ops.common import arg, carries, is_inplace, norm_dim, op_name, out_tensors, tensor_args
from .ops.indexing import (
    by_positions,
    examples_taken,
    one_example,
    puts_back,
    regrown_dim,
    reorder_of,
)
from .ops.names import KEEPS_ROWS_INDEX, PART_OF, PICKS, PRODUCTS, UNFUSED
from .ops.nn import MIXES_AS
from .ops.pointwise import is_pointwise, where_unselected
from .ops.views import DECOMPOSED
from .sources import (
    COPIES,
    SPREADS,
    Meeting,
    Source,
    aligned_sources,
    expanded_meeting,
    into_meeting,
    spread_meeting,
)
from .tensormap import TensorMap

# operations that take a reordered batch with the order it was put in (a PackedSequence keeps
# its sorted_indices, and the RNN rules read them)
TAKES_ORDER = {"_pack_padded_sequence"}

# the maps of a Tracker made at their first use (see Tracker.__getattr__)
_LAZY_MAPS = frozenset(
    {"spread", "alone", "orders", "ranked", "single", "presumed", "candidates", "would", "wide"}
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
    # until put back (see _ranked)
    ranked: TensorMap
    # tensors that are one example taken out of the batch alone, or computed from one alone
    # (x.unbind(0), x[i], f(x[i])): the example and the layout of the batch it came from (see
    # _singles), and how many joins of them gave the batch back (never kept by memo)
    single: TensorMap
    # tensors of unknown layout whose examples are presumed where they were (:meth:`_presume`)
    presumed: TensorMap
    # the model's inputs taken as holding the examples by their size alone (not its first input):
    # an operation that would mix the examples only because of one of them, or of what was
    # computed from them alone, takes them as shared by every example instead
    # (:meth:`_without_candidates`)
    candidates: TensorMap
    # tensor -> the indices in ``pending`` of the calls it was computed from
    would: TensorMap
    # one-hot encodings of indices of each example alone whose number of classes was computed
    # across the examples: only their width is (see _coupling)
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
        # with (indices, masks), with the operation that did (see _coupling)
        self.coupled: TensorMap = TensorMap()
        # positions of rows that nonzero found in a tensor with examples (see _row_indices)
        self.row_index: TensorMap = TensorMap()
        # indices whose every entry is a position along the examples' dimension that each
        # example's own mask found, with that dimension's layout (see _positions)
        self.positions: TensorMap = TensorMap()
        # the floating-point dtype that rounds the most among the tensors computed from the
        # examples (a float64 model that takes its softmax in float32, as T5 does): the checks
        # of the backward judge by it (see gradhooks.engine.verify)
        self.precision: torch.dtype | None = None
        # the floating-point numbers read into Python from tensors computed across the
        # examples (float(h.abs().max()), .item()), with the operation that read each: an
        # operation given one back as an argument mixes the examples (see _read_back)
        self.read: dict[float, str] = {}
        # the lists and arrays read into Python from tensors computed across the examples
        # (indices of the batch's top-k, .numpy() or .tolist()), by id, each kept with the
        # operation that read it: an operation given one back as an argument, an index of the
        # examples' entries chosen by all of them, mixes the examples (see _rows_back)
        self.read_rows: dict[int, tuple[Any, str]] = {}
        # the ids of the candidates held with the model's first input in one list or tuple,
        # where the engine takes the batch from dimension 0 of the first by its guess (see
        # note_listed), and the joins of the forward that treated them as the examples
        self.listed: set[int] = set()
        self.listed_joins: list[ListedJoin] = []
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

    def _in_call(self, name: str) -> str:
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

    def add_candidate(self, t: Tensor, layout: Layout) -> None:
        """``t``, an input of the model other than its first, is taken as holding the examples
        on ``layout`` by its size alone (:attr:`candidates`)."""
        self.set_layout(t, layout)
        self.candidates[t] = True
        self.lineage[t] = frozenset({id(t)})

    def note_listed(self, tensors: Sequence[Tensor]) -> None:
        """``tensors``: the model's inputs held with its first in one list or tuple, the batch
        taken from dimension 0 of the first by the default guess. Where the list's index is
        put beside that dimension by a join (:meth:`_listed_join`), its tensors may each be
        one example as well as each a batch of the same examples (two views of one batch):
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
                 if isinstance(t, Tensor) and self._layout_of(t) is not None]  # fmt: skip
        every = frozenset().union(*(f for f in found if f))
        if not every:
            return
        if None in found:  # (also the examples of the first input: batched for good)
            self.joined |= every
            return
        key = len(self.pending)
        outs = [o for o in outputs if isinstance(o, Tensor)]
        self.pending.append(_Pending(every, outs, shared))
        for o in outs:
            if self._layout_of(o) is not None:
                self.lineage[o] = every
            self.would[o] = frozenset({key})

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
        if self.would.entries and old in self.would:
            self.would[new] = self.would[old]
            for k in self.would[old]:
                outs = self.pending[k].outputs
                self.pending[k].outputs = [new if o is old else o for o in outs]

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
        if any(self._layout_of(t) is MIXED for t in inputs):
            return False  # (mixed before the call)
        first = next((lay for t in inputs if (lay := self.presumed_of(t)) is not None), None)
        if first is None or first.dim < 0:
            return False
        size = first.size(self.batch)
        lays = [self._layout_of(o) for o in outputs]
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
            self._note_transformed(func, args, kwargs)
        # The short way: a function whose layouts are kept for any call (quick_kind), where
        # nothing the tracker knows of the forward beyond layouts stands in the way, its
        # tensors carry no source and its parameters are used inside the hooked calls that
        # cover them. The key of what is kept (memo.key, the very tuple) is built in the pass
        # that finds the tensors with layouts; the call is followed as by _follow, and where
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
                if (op.metadata and not op.free and not self.taints.entries) or self._untainted(
                    op, args, kwargs
                ):
                    return func(*args, **kwargs)
            else:
                parts = self._quick_key(op, args, kwargs)
                if parts is _UNLAID:
                    return func(*args, **kwargs)  # (no tensor with a layout: nothing to follow)
                if parts is not None:
                    return self._quick_follow(op, func, args, kwargs, parts)
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
                where = self._covering(id(t))
                if where is None:
                    direct.append(t)
                else:
                    self.used[where].params.add(id(t))
                    if self.used[where].soft:
                        direct.append(t)
        if not laid and not sources and not direct:
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
                if out.__class__ in _NO_TENSOR and not op.inplace:
                    if out.__class__ is float and self.layouts.get(tensors[0]) is MIXED:
                        _note_read(self.read, out, name)  # (a statistic of the batch)
                    return out  # (a size, a dtype, a flag: nothing to follow, see propagate)
                if name in _READS_ROWS and self.layouts.get(tensors[0]) is MIXED:
                    self.read_rows[id(out)] = (out, name)  # (held: its id stays its own)
                if isinstance(out, Tensor) and out.dtype is not self.precision:
                    self._note_precision(out)
                self.func = func
                try:
                    # (``tensors`` are the tensors whose values it computes with, as there)
                    if op.kept:
                        self._follow(op, args, kwargs, out, tensors)
                    else:
                        self._propagate(op, args, kwargs, out, tensors)
                finally:
                    self.func = None
                return out
            if laid:
                out = self._meeting(func, name, args, kwargs, tensors, direct)
                self._note_precision(out)
                self._hold(direct, args, out)
                return out
            sources = set(sources)
            for p in direct:
                sources.add(self._param_source(p))
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
            self._covering(id(p)) is None for p in direct
        )

    def _untainted(self, op: OpFacts, args: tuple, kwargs: dict) -> bool:
        """Whether a call of :data:`~.ops.METADATA` or :data:`~.ops.FREE` function ``op`` is
        only run by the long way: a question about tensors of which none has sources (whose
        answer, no tensor, is not followed), a new tensor made from no tensor."""
        if op.free:
            return not tensor_args(args, kwargs)
        tainted = self.taints.entries
        if not tainted:
            return True
        for t in tensor_args(args, kwargs):
            e = tainted.get(id(t))
            if e is not None and e[0]() is t and e[1]:
                return False
        return True

    def _quick_key(self, op: OpFacts, args: tuple, kwargs: dict) -> Any:
        """The parts of :func:`.memo.key` for a call on the short way, where the tensors among
        ``args`` and ``kwargs`` (as :func:`tensor_args` finds them) include one with a layout;
        :data:`_UNLAID` where none has one; ``None`` where the call takes the long way (a
        tensor with sources, rows picked by an index, a parameter used directly, a list of
        tensors, an ``out=``, a second tensor given to a :data:`~.ops.LIKE` function). Notes
        the parameters used inside the hooked calls covering them, as the long way does."""
        entries, params, tainted = self.layouts.entries, self.params, self.taints.entries
        parts = [id(op), self.batch]
        laid = False
        n = 0
        for a in args:
            cls = a.__class__
            if cls in _PLAIN:
                parts.append(a)
                continue
            if not isinstance(a, Tensor):
                p = _other_part(a, entries)
                if p is None:
                    return None
                parts.append(p)
                continue
            # (as _quick_tensor, inlined: the usual argument)
            n += 1
            if n > 1 and op.like:
                return None
            k = id(a)
            e = entries.get(k)
            if e is not None and e[0]() is a:
                lay = e[1]
                if lay.owners is not None:
                    return None
                laid = True
                parts.append((cls, lay.dim, lay.outer, lay.inner, a.shape, a.dtype))
            else:
                parts.append((cls, None, a.shape, a.dtype))
            if tainted:
                e = tainted.get(k)
                if e is not None and e[0]() is a and e[1]:
                    return None
            if k in params and not self._quick_param(k):
                return None
        if kwargs:
            if "out" in kwargs:
                return None
            for name, a in kwargs.items():
                parts.append(name)
                cls = a.__class__
                if cls in _PLAIN:
                    parts.append(a)
                    continue
                if not isinstance(a, Tensor):
                    p = _other_part(a, entries)
                    if p is None:
                        return None
                    parts.append(p)
                    continue
                n += 1
                if n > 1 and op.like:
                    return None
                p = self._quick_tensor(a)
                if p is None:
                    return None
                laid = laid or p[1] is not None
                parts.append(p)
        return parts if laid else _UNLAID

    def _quick_tensor(self, a: Tensor) -> tuple | None:
        """:meth:`_quick_key`'s part for tensor ``a`` (``None``: the long way)."""
        k = id(a)
        e = self.layouts.entries.get(k)
        if e is not None and e[0]() is a:
            lay = e[1]
            if lay.owners is not None:
                return None
            p = (a.__class__, lay.dim, lay.outer, lay.inner, a.shape, a.dtype)
        else:
            p = (a.__class__, None, a.shape, a.dtype)
        e = self.taints.entries.get(k)
        if e is not None and e[0]() is a and e[1]:
            return None
        if k in self.params and not self._quick_param(k):
            return None
        return p

    def _quick_param(self, pid: int) -> bool:
        """Note the use of parameter ``pid`` by the hooked call covering it, as the long way
        does; ``False`` where none does, or one without a rule (a direct use: the long way)."""
        where = self._covering(pid)
        if where is None or self.used[where].soft:
            return False
        self.used[where].params.add(pid)
        return True

    def _quick_follow(self, op: OpFacts, func, args: tuple, kwargs: dict, parts: list) -> Any:
        """Run a call on the short way (:meth:`_quick_key` gave ``parts``) and follow it: the
        layouts kept for its key, or, where none are, as :meth:`_follow` does."""
        self.off += 1
        try:
            out = func(*args, **kwargs)
            if out.__class__ in _NO_TENSOR:
                if out.__class__ is float:
                    first = tensor_args(args, kwargs)[0]
                    if self.layouts.get(first) is MIXED:
                        _note_read(self.read, out, op.name)  # (a statistic of the batch)
                return out
            if isinstance(out, Tensor):
                if out.dtype is not self.precision:
                    self._note_precision(out)
                if not _COMPILING():
                    hit = memo.KEPT.get(tuple(parts))
                    if hit is not None and len(hit[0]) == 1 and out.shape == hit[0][0]:
                        lay = hit[1][0]
                        if lay is not None:
                            # (self.layouts[out] = lay, inlined)
                            layouts = self.layouts
                            entries = layouts.entries
                            entries[id(out)] = (_ref(out), lay)
                            if len(entries) >= layouts.sweep_at:
                                layouts.sweep()
                        return out
            self.func = func
            try:
                ins = tensor_args(args, kwargs)
                if _COMPILING():
                    self._propagate(op, args, kwargs, out, ins)
                else:
                    self._replay(op, args, kwargs, out, ins, tuple(parts))
            finally:
                self.func = None
            return out
        finally:
            self.off -= 1

    def _note_precision(self, out: Any) -> None:
        """Keep :attr:`precision` (an operation on the examples' tensors gave ``out``)."""
        d = out.dtype if isinstance(out, Tensor) else None
        if d is not None and d.is_complex:
            d = d.to_real()  # (complex32 rounds as float16)
        if d is None or d is self.precision or not d.is_floating_point:
            return
        if self.precision is None or torch.finfo(d).eps > torch.finfo(self.precision).eps:
            self.precision = d

    def _graph_where_called(self) -> bool:
        """Whether autograd recorded a graph where the innermost running call (or the
        model's forward) started. Turned off inside it since (a custom ``autograd.Function``'s
        forward, a ``no_grad`` block of the forward), a parameter's gradient from there comes
        from a backward written by hand, which the tracker cannot split by example; off
        already (reentrant checkpointing's first forward), the call is run again, with a
        graph, in the backward, and followed there."""
        return self.used[-1].graph if self.used else self.graph

    def _covering(self, pid: int) -> int | None:
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
        """The source of ``p``'s direct uses made so far, if any (:meth:`_param_source`)."""
        where = self._covering(id(p))
        table = self.used[where].sources if where is not None else self.param_sources
        return table.get(id(p))

    def _param_source(self, p: Tensor) -> Source:
        """The source of ``p``'s direct uses: one per forward, or, inside a module without a
        rule that covers it (soft), one per call of that module."""
        where = self._covering(id(p))
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

    def _layout_of(self, t: Any) -> Layout | None:
        return self.layouts.get(t) if isinstance(t, Tensor) else None

    def presumed_of(self, t: Any) -> Layout | None:
        """``t``'s layout, or, where it is unknown, where its examples are presumed."""
        lay = self._layout_of(t)
        return self.presumed.get(t, lay) if lay is UNKNOWN else lay

    def _follow(self, op: OpFacts, args, kwargs, out, ins: list) -> None:
        """:meth:`_propagate` for a call on tensors with layouts and no sources, or, where a
        call with the same key was followed before, the layouts it gave (:mod:`.memo`)."""
        if (
            self.coupled.entries
            or self.read
            or self.row_index.entries
            or self.positions.entries
            or self.reordered.entries
            # (traced by torch.compile, where the hooks cannot leave compiled code: dynamo
            # would guard on the kept table, as large as every model's calls so far)
            or _COMPILING()
            or (op.kept == INDEX and len(args) > 1 and memo.holds_tensor(args[1]))
            or (self.lineage.entries and any([t in self.lineage for t in ins]))
        ):
            return self._propagate(op, args, kwargs, out, ins)
        found = memo.key(op, self.batch, args, kwargs, self.layouts.entries)
        if found is memo.NO_KEY:
            return self._propagate(op, args, kwargs, out, ins)
        return self._replay(op, args, kwargs, out, ins, found)

    def _replay(self, op: OpFacts, args, kwargs, out, ins: list, found: tuple) -> None:
        """:meth:`_follow` for a call of key ``found``: the layouts kept for it, or, where
        none are (or not for outputs of these shapes), :meth:`_propagate`, kept if it could
        be."""
        layouts = self.layouts
        hit = memo.KEPT.get(found)
        if isinstance(out, Tensor):
            if hit is not None and len(hit[0]) == 1 and out.shape == hit[0][0]:
                lay = hit[1][0]
                if lay is not None:
                    layouts[out] = lay
                return None
            outs = [out]
        else:
            outs = out_tensors(out)
            if not outs and op.inplace and args and isinstance(args[0], Tensor):
                outs = [args[0]]
            if hit is not None and len(hit[0]) == len(outs):
                shapes, lays = hit
                same = True
                for o, shape in zip(outs, shapes):
                    if o.shape != shape:
                        same = False
                        break
                if same:
                    for o, lay in zip(outs, lays):
                        if lay is not None:
                            layouts[o] = lay
                    return None
        notes = len(self.unknown), len(self.mixed), len(self.presumed.entries), self.rejoined
        self._propagate(op, args, kwargs, out, ins)
        if notes == (len(self.unknown), len(self.mixed), len(self.presumed.entries), self.rejoined):
            memo.keep(found, outs, layouts)
        return None

    def propagate(self, name: str, args, kwargs, out) -> None:
        """Record the layouts of ``out``, what the torch function ``name`` gave on ``args``
        and ``kwargs``."""
        self._propagate(facts_named(name), args, kwargs, out)

    def _propagate(self, op: OpFacts, args, kwargs, out, ins: list | None = None) -> None:
        """:meth:`propagate`; ``ins``: the tensors among the arguments whose values it
        computes with (:func:`data_args`), where the caller has them."""
        name = op.name
        if op.like:
            args, kwargs = data_args(name, args, kwargs)
        outs = out_tensors(out)
        if not outs and op.inplace and args and isinstance(args[0], Tensor):
            outs = [args[0]]  # (x[i] = v, x.add_(y): the first argument is the result)
        if not outs or op.free:
            return  # (a new tensor: its values do not depend on the examples)
        if ins is None:
            ins = tensor_args(args, kwargs)
        if name in _LIST_JOINS and (self.listed or name == "pad_sequence"):
            self._listed_join(name, args, kwargs, outs[0], ins)
        unselected = where_unselected(name, args, self.layouts) if name == "where" else _NONE
        if self.coupled.entries and name in PRODUCTS:
            unselected = unselected | self._all_ones(name, ins)
        layout_of = self.layouts.get  # (as _layout_of: no tensor has no entry)
        if unselected:  # (a branch of torch.where that no entry takes: as if a constant)
            ins = [t for t in ins if id(t) not in unselected]

            def layout_of(t: Any) -> Layout | None:
                return None if id(t) in unselected else self._layout_of(t)

        layouts = self.layouts
        inherited = False
        for t in ins:
            if layouts.get(t) is MIXED:
                inherited = True
                break
        joined = None
        if inherited and self.single.entries:
            joined = self._singles(name, args, kwargs, ins, outs)
            inherited = not is_followed(joined)
        if inherited:
            result = MIXED
            if (
                joined is None
                and self.engine is not None
                and not any(u.soft for u in self.used)
                and not self._alone(ins)
            ):  # (a product after a reduction over the batch, or a function not linear in
                # it: refused if a backward reaches it; inside a module without a rule, its
                # fallback recomputes it per example)
                if name in PRODUCTS_OF or name in POWERS:
                    why = coupling(name, args, ins, layout_of, self.mixed)
                else:
                    why = nonlinear(name, ins, layout_of, self.mixed)
                if why is not None:
                    arm(self.engine, outs, why)
        elif joined is not None:
            result = joined
        else:
            result = None
            if self.positions.entries:
                try:
                    result = by_positions(
                        name, args, kwargs, out, layout_of, self.batch, self._positions_base
                    )
                except Exception:  # (an argument form it does not know: the handlers decide)
                    result = None
            if result is None:
                result = output_layout(name, args, kwargs, out, layout_of, self.batch, ins)
            if result is CONTRACTED:  # (the examples' dimension contracted)
                if any([t in self.given for t in ins]):
                    self.unknown[name] = None  # (the examples perhaps not where presumed)
                    result = UNKNOWN
                else:
                    result = MIXED
            if (
                result is MIXED
                and self.engine is not None
                and not any(u.soft for u in self.used)
                and (why := whole_matrix(name, args, kwargs, ins, layout_of)) is not None
            ):  # (the examples as rows of one matrix: refused if a backward reaches it)
                arm(self.engine, outs, why)
            if result is UNKNOWN:
                result = self._presume(name, args, kwargs, out, ins, outs)
        if self.read and result is not MIXED and (got := _read_back(self.read, args, kwargs)):
            result = MIXED  # (h / float(h.abs().max()): every example's rows scaled by all)
            self.mixed.setdefault(f"{got} of a reduction over the batch, read into Python", None)
        if (
            self.read_rows
            and result is not MIXED
            and (got := _rows_back(self.read_rows, args, kwargs))
        ):
            result = MIXED  # (h[:, idx], idx = h.mean(0).topk(k).indices.numpy(): TimesNet's)
            self.mixed.setdefault(
                f"{got} of a tensor computed across the batch, read into Python", None
            )
        if self.coupled.entries:
            result = self._coupling(name, args, ins, outs, result)
        if self.ranked.entries or self.coupled.entries:
            result = self._ranked(name, args, ins, outs, result)
        if self.row_index.entries or name in _FINDS_ROWS:
            self._row_indices(name, args, ins, outs)
        if self.positions.entries or name in _FINDS_ROWS:
            self._positions(name, args, kwargs, outs, op.inplace or "out" in kwargs)
        reordered = (
            next((self.reordered[t] for t in ins if t in self.reordered), None)
            if self.reordered.entries
            else None
        )
        if result is REORDER:  # (of data too: a layer on x[order] is refused, not misread)
            if reordered is None:
                order = reorder_of(name, args, kwargs)
                before = self._layout_of(args[0]) if args else None
                for o in outs:
                    self.reordered[o] = name
                    if order is not None:
                        self.orders[o] = (*order, before)
            result = UNKNOWN  # (reordered again: taken as put back in order)
            # (the examples presumed where they were, so that a reduction over them after, even
            # of a detached copy, which no backward would show, counts as mixing them)
            self._presume(name, args, kwargs, out, ins, outs)
        elif reordered is not None and name not in TAKES_ORDER:
            ordered = [t for t in ins if t not in self.reordered and self._layout_of(t) is not
                       None and self._layout_of(t).dim >= 0]  # fmt: skip
            if ordered and any(o.requires_grad for o in outs):
                result = MIXED  # (rows of different examples combined: x[perm] + x)
                self.mixed.setdefault(reordered, None)
                inherited = True
            elif not ordered:  # (with ordered rows and no gradient: mixed before the model)
                # (x[order] * 2: still in that order, with a gradient or not, until put back)
                order = self.orders.get(args[0]) if args and isinstance(args[0], Tensor) else None
                if order is None or not puts_back(order, name, args, kwargs):
                    order = order or next((self.orders[t] for t in ins if t in self.orders), None)
                    for o in outs:
                        self.reordered[o] = reordered
                        if order is not None:
                            self.orders[o] = order
                elif is_followed(order[2]):
                    # put back in order (x[perm][perm.argsort()]): the batch's layout again, on
                    # which an operation across the examples (a mean over them, even detached)
                    # is mixing, as on the batch itself
                    result = order[2]
        resolved = False
        if result is MIXED and not inherited and self.lineage:
            before = result
            result = self._without_candidates(name, args, kwargs, out, ins, result)
            resolved = result is not before
        if result is MIXED and self.batch == 1 and not inherited:
            # one example cannot mix with another: where two reshapes put its only entry on
            # different dimensions (heads folded in, sequence-first), take the first input's
            # dimension, every entry of which is the one example's (rows that are no example's
            # joined to it along that dimension: torch.cat([k, zeros]))
            result = next((lay for t in ins if is_followed(lay := self._layout_of(t))), UNKNOWN)
            if result is not UNKNOWN and result.owners is None:
                o = outs[0]
                if result.dim < o.dim() and o.shape[result.dim] != result.size(1):
                    result = Layout(result.dim, o.shape[result.dim], 1)
        if (
            result is MIXED
            and not inherited
            and is_pointwise(name)
            and not any(o.requires_grad for o in outs)
            and (before := self._mixed_up(ins)) is not None
        ):  # (the examples mixed with a permutation of them where no gradient flows, MixUp of
            # the inputs, x = lam * x + (1 - lam) * x[perm]: mixed before the model, each row
            # one example to the layers after; docs/guarantees.md)
            result = UNKNOWN
            for o in outs:
                if o.dim() > before.dim and o.shape[before.dim] == before.size(self.batch):
                    self.presumed[o] = before
        if result is MIXED and not any(carries(o) for o in outs) and not inherited:
            for o in outs:  # (an index or mask computed across the examples: see _coupling)
                self.coupled[o] = name
        if result is MIXED:
            if any(carries(o) for o in outs):
                if not inherited and not any(k.startswith(f"{name} picking") for k in self.mixed):
                    self.mixed.setdefault(self._in_call(name) + MIXES_AS.get(name, ""), None)
                if (
                    not inherited
                    and args
                    and one_example(name, args, kwargs, lay := self._layout_of(args[0]))
                ):
                    taken = examples_taken(name, args, kwargs, lay, len(outs))
                    for k, o in enumerate(outs):
                        self.alone[o] = (name, lay.dim)
                        if taken is not None:
                            self.single[o] = (taken[k], lay)
                elif not inherited and (one := self._one_examples(ins)) is not None:
                    # (computed from one example's rows alone, their dimension dropped:
                    # h[0], h.squeeze(0) or h.mean(0) of x[i : i + 1]'s: that example alone)
                    for o in outs:
                        self.alone[o] = (name, one[1].dim)
                        self.single[o] = one
                for o in outs:
                    self.layouts[o] = MIXED
                if self.used and self.used[-1].soft:
                    self.used[-1].mixed = True
                    if not inherited:
                        picked = any(
                            lay is not None and lay.owners is not None
                            for t in ins
                            if (lay := self._layout_of(t)) is not None
                        )
                        self.used[-1].mixing.add("__getitem__" if picked else name)
                return
            if inherited:
                # (a mask of values against a statistic of the batch, x > x.mean(): which
                # entries it keeps depends on the other examples' values; and what is made of
                # one, an index of the batch's top-k detached, copied or moved, idx.detach())
                for o in outs:
                    self.layouts[o] = MIXED
                return
            # an index or mask computed across the examples (which experts any token picked,
            # the longest sequence): it selects, and each row is still a constant of its
            # example's computation, where the rule's dimension reads it
            result = UNKNOWN
        if result is UNKNOWN or result is None:
            if op.handler is None:
                self.unknown[name] = None
                if self.engine is not None:
                    rerun = not (op.inplace or op.like or "out" in kwargs) and self.func
                    self.guard_rows(name, ins, outs, (self.func, args, kwargs) if rerun else None)
            for o in outs:
                self.layouts[o] = UNKNOWN
            return
        if not isinstance(result, list):
            result = [result] * len(outs)
        for o, lay in zip(outs, result):
            if lay is None:
                continue
            if lay is MIXED:  # (one of several outputs: a chunk with some of the examples)
                if not carries(o):
                    lay = UNKNOWN
                else:
                    self.mixed.setdefault(self._in_call(name), None)
            if lay.dim >= 0 and (o.dim() <= lay.dim or o.shape[lay.dim] != lay.size(self.batch)):
                lay = UNKNOWN  # (a handler's guess that the shapes contradict)
            self.layouts[o] = lay
        if resolved:
            self._meet_after(name, args, kwargs, out)
        elif self.lineage.entries:
            self._inherit(ins, outs)

    def _inherit(self, ins: list, outs: list) -> None:
        """The lineage of an operation's outputs (:attr:`lineage`): its inputs' where every input
        with examples has one; an operation that combines such an input with other examples
        joins its candidates to the batch for good."""
        every, would, firm = frozenset(), frozenset(), False
        for t in ins:
            if self._layout_of(t) is None:
                continue
            found = self.lineage.get(t)
            if found is None:
                firm = True
                continue
            every |= found
            would |= self.would.get(t, frozenset())
        if not every:
            return
        if firm:
            self.joined |= every
            return
        for o in outs:
            if self._layout_of(o) is not None:
                self.lineage[o] = every
                if would:
                    self.would[o] = would

    def _listed_join(self, name: str, args, kwargs, out: Tensor, ins: list) -> None:
        """Keep in :attr:`listed_joins` a join that takes its tensors as the examples, one
        each, where the batch was taken from a dimension of one of them: ``pad_sequence`` of
        sequences whose dimension 0, their length, holds it (each sequence is an example:
        the batch is their list); ``stack`` (or ``cat``) of the model's inputs held with its
        first in one list, or of what was computed from each of them alone, along a dimension
        in front of the batch's (``torch.stack(examples)``, ``torch.cat([e[None] for e in
        examples])``). A stack behind it (``torch.stack(views, 1)``) or a cat along it
        (``torch.cat(views)``: the views of one batch) is taken as a list of batches."""
        laid = [
            (t, lay) for t in ins
            if is_followed(lay := self._layout_of(t)) and lay.owners is None
        ]  # fmt: skip
        if not laid:
            return
        if name == "pad_sequence":
            t = next((u for u, lay in laid if lay.dim == 0), None)
            if t is not None:
                self.listed_joins.append(ListedJoin(name, len(ins), tuple(t.shape), True))
            return
        t, lay = laid[0]
        listed = [
            u for u, _ in laid if (lin := self.lineage.get(u)) is not None and lin <= self.listed
        ]
        if len(ins) < 2 or not listed:
            return
        d = norm_dim(int(arg(args, kwargs, 1, "dim", kwargs.get("axis", 0))), out.dim())
        in_front = d <= lay.dim if name == "stack" else d < lay.dim  # (of the batch's, in out)
        if in_front:
            self.listed_joins.append(ListedJoin(name, len(ins), tuple(t.shape), False))

    def _all_ones(self, name: str, ins: list) -> set[int]:
        """The ids of the operands of a product that are a mask computed across the examples
        (:meth:`_coupling`) from a running count along them (``cumsum``: NLLB-MoE's expert
        capacity) or from ``all`` (every entry finite) whose every entry is one: no token
        overflows the capacity, so none would for an example alone, whose counts are no
        larger, and what holds for the whole batch holds for each example; multiplying by it
        keeps every entry, as a constant would. Not a mask from another statistic of the batch
        (a count over it against a threshold, ``(x > 0).sum() > 5``), which an example alone
        may not pass."""
        if name not in PRODUCTS:
            return set()
        return {
            id(t) for t in ins
            if t in self.coupled and self.coupled[t] in _RUNNING_COUNTS and not carries(t)
            and bool((t == 1).all())
        }  # fmt: skip

    def _coupling(self, name: str, args, ins: list, outs: list, result: Any) -> Any:
        """Indices and masks computed across the examples (which tokens an expert keeps under
        a capacity counted over the whole batch, ``cumsum`` along it) are followed as
        *coupled*: what they select for one example depends on the others. Rows picked from
        the batch by one are refused (mixed: the per-example computation would pick other
        rows); one that picks along another dimension (which expert, from the experts any
        token chose) only selects, and its result is not coupled."""
        found = [self.coupled[t] for t in ins if t in self.coupled] if self.coupled else []
        if not found:
            return result
        if self._width_only(name, args, ins, outs):
            return result
        lays = result if isinstance(result, list) else [result]
        picks = name in PICKS and args and isinstance(args[0], Tensor)
        if picks:
            x_lay = self._layout_of(args[0])
            fresh = [
                lay for lay in lays
                if isinstance(lay, Layout) and lay.owners is not None
                and (x_lay is None or x_lay.owners is None or lay.owners != x_lay.owners)
            ]  # fmt: skip
            index_only = args[0] not in self.coupled
            if (
                fresh
                and index_only
                and not (self.used and self.used[-1].soft)
                and all(self._permutes(x_lay, lay) for lay in fresh)
            ):  # (inside a module without a rule, its fallback recomputes it per example)
                return result  # (the examples sorted by their data: see _ranked)
            if fresh and index_only:
                self.mixed.setdefault(
                    f"{name} picking rows by an index computed across the batch "
                    f"({', '.join(dict.fromkeys(found))}: an expert capacity counted over the "
                    "batch?)",
                    None,
                )
                return MIXED
            if index_only and all(isinstance(lay, Layout) and lay.dim >= 0 for lay in lays):
                return result  # (a coupled index along another dimension: selects only)
        elif is_pointwise(name) and any(carries(o) for o in outs) and self._masks_rows(ins, outs):
            self.mixed.setdefault(
                f"{name} picking rows by a mask computed across the batch ({found[0]})", None
            )
            return MIXED
        for o in outs:
            self.coupled[o] = found[0]
        return result

    def _width_only(self, name: str, args, ins: list, outs: list) -> bool:
        """A one-hot encoding (``F.one_hot(index, n)``) of an index computed from each example
        alone, whose number of classes ``n`` alone was computed across the batch (``max(index.
        max() + 2, capacity)``: the "safe one-hot" of mixture-of-experts gates), then cut to a
        constant width along its classes (``[..., :capacity]``): each entry is ``index == j``,
        whatever ``n`` (no smaller than the cut), as it is for an example alone. Uncut, its
        width is the batch's: coupled (:attr:`wide`), as it was."""
        if name == "one_hot":
            if len(outs) != 1 or not isinstance(args[0], Tensor) or args[0] in self.coupled:
                return False
            self.wide[outs[0]] = True
            return False
        if name != "__getitem__" or len(args) < 2 or len(outs) != 1 or args[0] not in self.wide:
            return False
        x, index, out = args[0], args[1], outs[0]
        if any(t is not x and t in self.coupled for t in ins):
            return False
        index = index if isinstance(index, tuple) else (index,)
        if len(index) == 2 and index[0] is Ellipsis:
            index = (slice(None),) * (x.dim() - 1) + index[1:]
        whole = slice(None)
        if len(index) != x.dim() or any(not (type(i) is slice and i == whole) for i in index[:-1]):
            return False
        cut = index[-1]
        return (
            type(cut) is slice
            and (cut.start is None or (type(cut.start) is int and cut.start == 0))
            and (cut.step is None or (type(cut.step) is int and cut.step == 1))
            and type(cut.stop) is int
            and 0 <= cut.stop <= x.shape[-1]
            and out.shape == (*x.shape[:-1], cut.stop)
        )

    def _mixed_up(self, ins: list) -> Layout | None:
        """The layout of the batch where every tensor with examples among ``ins`` holds its
        rows in order or in another order by an index (:class:`Owners`, shuffled, of each of
        them once: ``x`` and ``x[perm]``), and some in another; else ``None``."""
        base, moved = None, False
        for t in ins:
            lay = self._layout_of(t)
            if lay is None:
                continue
            plain = lay if lay.owners is None else lay.owners.base
            if not is_followed(plain) or plain.owners is not None or base not in (None, plain):
                return None
            if lay.owners is not None:
                if (
                    not lay.owners.shuffled
                    or lay.dim != plain.dim
                    or not self._permutes(plain, lay)
                ):
                    return None  # (rolled, as the data rolled: refused, as it was)
                moved = True
            base = plain
        return base if moved else None

    def _singles(self, name: str, args, kwargs, ins: list, outs: list) -> Layout | None:
        """An operation on examples taken out of the batch alone (:attr:`single`): where every
        tensor with examples among its inputs is one, of the same example (``f(x[i])``, the
        rows of ``x.unbind(0)`` each through ``f``), its outputs are that example's alone
        (mixed, for what reads them as a batch; returned ``MIXED``); where it stacks them
        (``torch.stack(rows)``, ``torch.cat`` of each with a dimension of one), the result holds
        each along the stacked dimension, as rows of those examples (the batch itself, in
        order, where it is every one of them in turn). ``None``: neither (mixed, as it was)."""
        laid = [t for t in ins if self._layout_of(t) is not None]
        if not laid or any(t not in self.single for t in laid):
            return None
        found = [self.single[t] for t in laid]
        base = found[0][1]
        if any(lay != base for _, lay in found):
            return None
        if name == "pad_sequence":  # (as stack: each sequence a row, padded to the longest)
            tensors = arg(args, kwargs, 0, "sequences")
            o = outs[0] if len(outs) == 1 else None
            if o is None or not isinstance(tensors, list | tuple) or len(tensors) != len(laid):
                return None
            d = 0 if arg(args, kwargs, 1, "batch_first", False) else 1
            rows = torch.tensor([self.single[t][0] for t in tensors], device=o.device)
            self.rejoined += 1
            return owned(d, rows, base.at(d), self.batch)
        if name in ("stack", "cat", "concat", "concatenate"):
            tensors = arg(args, kwargs, 0, "tensors")
            o = outs[0] if len(outs) == 1 else None
            if o is None or not isinstance(tensors, list | tuple) or len(tensors) != len(laid):
                return None  # (a tensor without examples among them: a row of no example)
            d = norm_dim(int(arg(args, kwargs, 1, "dim", 0)), o.dim())
            if name != "stack" and any(t.shape[d] != 1 for t in tensors):
                if len({b for b, _ in found}) != 1:
                    return None
                # (parts of one example joined along its own dimension, NaViT's patches of
                # each of its images: that example's alone, as each part)
                for o in outs:
                    self.single[o] = found[0]
                return MIXED
            rows = torch.tensor([self.single[t][0] for t in tensors], device=o.device)
            self.rejoined += 1
            return owned(d, rows, base.at(d), self.batch)
        if len({b for b, _ in found}) != 1:
            return None  # (two examples combined)
        if len(laid) == 1 and len(outs) == 1:
            d = regrown_dim(name, args, kwargs, laid[0], outs[0])
            if d is not None:  # (x[i].unsqueeze(0): that example as a batch of one)
                rows = torch.tensor(found[0][:1], device=outs[0].device)
                self.rejoined += 1
                return owned(d, rows, base.at(d), self.batch)
        for o in outs:
            self.single[o] = found[0]
            if laid[0] in self.alone:
                self.alone[o] = self.alone[laid[0]]
        return MIXED

    def _one_examples(self, ins: list) -> tuple[int, Layout] | None:
        """``(example, layout it was picked from)`` where every tensor among ``ins`` that holds
        examples holds rows picked from the batch of that one example alone
        (:func:`~.layout.sole_owner`); ``None`` otherwise."""
        lays = [self._layout_of(t) for t in ins]
        example = sole_owner(lays)
        if example is None:
            return None
        lay = next(lay for lay in lays if lay is not None)
        base = lay.owners.base
        return example, (base if base is not None and base.owners is None else Layout(lay.dim))

    def _permutes(self, before: Layout | None, after: Any) -> bool:
        """Whether ``after`` (a layout) holds the rows of ``before`` in any order: each
        example as many times as there, or, where a reshape merged or split them, in the same
        proportion (not a part of them: a cut, a row dropped or repeated)."""
        if not is_followed(before) or not is_followed(after):
            return False
        a = torch.bincount(owner_vector(before, self.batch, "cpu"), minlength=self.batch)
        b = torch.bincount(owner_vector(after, self.batch, "cpu"), minlength=self.batch)
        if a.shape != b.shape:
            return False
        return torch.equal(a * int(b.sum()), b * int(a.sum()))

    def _ranked(self, name: str, args, ins: list, outs: list, result: Any) -> Any:
        """Rows of the examples in an order computed across the batch (``x[idx]`` with ``idx =
        x.norm(dim=1).argsort()``, the sorted-by-length trick of packed recurrent code; an
        index computed across the batch, :meth:`_coupling`, that permutes the rows): each row
        is still one example's, and a layer on them gives each its own gradient (the rows'
        owners are followed), but where an example's row lands depends on the others. So
        anything that reads the rows by their place is mixing there, unlike on the batch in
        its own order: a part of them (``s[:k]``, a split), rows added or dropped, a tensor
        without examples laid along them (``s * weights[:, None]``, a weight per rank). What
        keeps every row (elementwise, a layer, another permutation) keeps them ranked, until
        an index computed across the batch puts them back in the batch's order (``s[idx.
        argsort()]``)."""
        x = args[0] if args and isinstance(args[0], Tensor) else None
        lays = result if isinstance(result, list) else [result] * len(outs)
        found = [lay for lay in lays if is_followed(lay)]
        src = next((t for t in ins if t in self.ranked), None)
        index = ref = None
        if x is not None and name in PICKS and x not in self.coupled:
            index = next((t for t in ins if t is not x and t in self.coupled), None)
            # (the rows picked from x, or, written into a tensor without examples, out[idx] =
            # s, the rows written)
            ref = self._layout_of(x) if self._layout_of(x) is not None else self._layout_of(src)
        if (
            index is not None
            and found
            and not (self.used and self.used[-1].soft)
            and all(self._permutes(ref, lay) for lay in found)
        ):
            if all(lay.owners is None for lay in found):
                # (put back in the batch's order; or an index computed across the batch that
                # keeps every row in place, as a capacity that drops nothing does: the batch)
                return result
            why = self.ranked.get(x) or (
                f"an index computed across the batch ({self.coupled[index]})"
            )
            for o, lay in zip(outs, lays):
                if is_followed(lay):
                    self.ranked[o] = why
            return result
        if src is None:
            return result
        why, before = self.ranked[src], self._layout_of(src)
        mixing = None
        for o, lay in zip(outs, lays):
            if lay is MIXED and carries(o):
                mixing = f"{name} of the rows ordered by {why}"
                break
            if not is_followed(lay):
                continue
            if not self._permutes(before, lay):
                mixing = f"{name} of part of the rows ordered by {why}"
                break
            d = lay.dim
            for t in ins:  # (a tensor without examples laid along the rows: one per place)
                k = d - o.dim() + t.dim()
                if (
                    self._layout_of(t) is None
                    and not (t is x and name in PICKS)  # (what an index reads or writes into)
                    and 0 <= k < t.dim()
                    and t.shape[k] == o.shape[d] > 1
                    and id(t) not in self.params
                    and not isinstance(t, torch.nn.Parameter)
                    and not bool((t == t.narrow(k, 0, 1)).all())  # (zeros: a start state)
                ):
                    mixing = f"{name} of a tensor along the rows ordered by {why}"
                    break
            if mixing:
                break
        if mixing is not None:
            self.mixed.setdefault(self._in_call(mixing), None)
            return MIXED
        for o, lay in zip(outs, lays):
            if is_followed(lay):
                self.ranked[o] = why
        return result

    def _masks_rows(self, ins: list, outs: list) -> bool:
        """Whether an elementwise operation applies a coupled mask (:meth:`_coupling`, without
        a gradient) along the examples of an operand: one entry per example, which of them it
        keeps decided across the batch (the tokens an expert keeps under a capacity counted
        over it, the example with the largest score), or one for the whole batch (a count over
        it against a threshold). An operand with a gradient is no mask:
        the rows an expert computed from the tokens routed to it, weighted by their router
        scores."""
        o = outs[0]
        for x in ins:
            lay = self._layout_of(x)
            if not is_followed(lay) or x in self.coupled or lay.size(self.batch) < 2:
                continue
            d = lay.dim + o.dim() - x.dim()  # (the examples' dimension in the output)
            for t in ins:
                k = d - o.dim() + t.dim()
                if (
                    t in self.coupled
                    and not t.requires_grad  # (a mask: the rows an expert computed are not)
                    and not is_followed(self._layout_of(t))
                ):
                    if k >= 0 and t.shape[k] == o.shape[d]:
                        return True
                    if t.numel() == 1 and not t.is_floating_point():
                        # (one switch for the whole batch, decided across it: it keeps every
                        # example or none, where an example alone would decide for itself)
                        return True
        return False

    def _positions(self, name: str, args, kwargs, outs: list, writes: bool) -> None:
        """Follow indices of positions along the examples' dimension that each example's own
        mask found: ``nonzero`` (``argwhere``, ``torch.where(mask)``) of a 1-D mask laid out
        as the batch (a flag per example; a ``[batch * seq]`` mask flattened), kept through
        operations that only reshape it (``squeeze``, ``view(-1)``, ``flatten``, ``[:, 0]``,
        ``unsqueeze``, ``expand``) or convert it to another integer type. An example alone
        finds the same positions of its own, so rows picked by such an index are its rows
        (:func:`.ops.indexing.by_positions`). Not a mask computed across the batch (coupled,
        mixed, reordered), and not an index that any other operation made (``idx[:k]``,
        ``idx.flip(0)``, ``argsort`` of scores): rows picked by those stay refused.
        ``writes``: whether the operation writes into a tensor it is given (in place, ``out=``),
        which then, with every view of it, holds positions no more."""
        if name in _FINDS_ROWS:
            mask = args[0] if args else kwargs.get("input")
            lay = self._layout_of(mask)
            if (
                (name != "where" or len(args) == 1)
                and isinstance(mask, Tensor)
                and mask.dim() == 1
                and lay is not None
                and lay.dim == 0
                and lay.owners is None
                and mask not in self.coupled
                and mask not in self.reordered
            ):
                found = _Positions(lay, self.lineage.get(mask, frozenset()))
                for o in outs:
                    if o.dtype in _INDEX_DTYPES:
                        self.positions[o] = found
            return
        x = args[0] if args and isinstance(args[0], Tensor) else None
        found = self.positions.get(x) if x is not None and name in _RESHAPES_POSITIONS else None
        if found is not None and name == "__getitem__":
            items = args[1] if len(args) > 1 and isinstance(args[1], tuple) else args[1:]
            if not all(i is None or i is Ellipsis or isinstance(i, int | slice) for i in items):
                found = None
        if found is not None:
            for o in outs:
                if o.dtype in _INDEX_DTYPES and (
                    o.numel() == x.numel() or name in ("expand", "expand_as")
                ):
                    self.positions[o] = found
            return
        written = [o for o in outs if o.dtype in _INDEX_DTYPES and o.numel()] if writes else ()
        if written:  # (idx.add_(1), idx[0] = 3: it and every view of it hold other values)
            ptrs = {o.untyped_storage().data_ptr() for o in written}
            for t, _ in self.positions.items():
                if t.numel() and t.untyped_storage().data_ptr() in ptrs:
                    del self.positions[t]

    def _positions_base(self, t: Any) -> Layout | None:
        """The layout of the dimension whose positions the index ``t`` holds (:meth:`_positions`),
        or ``None``. Where its mask came from inputs taken as holding the examples by their
        size alone (:attr:`candidates`), those are held so from now on (:attr:`joined`)."""
        found = self.positions.get(t) if isinstance(t, Tensor) else None
        if found is None or any(c not in self.candidates.entries for c in found.lineage):
            return None  # (none, or a mask of inputs taken as shared since: fixed positions)
        self.joined |= found.lineage
        return found.base

    def _row_indices(self, name: str, args, ins: list, outs: list) -> None:
        """Follow the positions of rows that ``nonzero`` (``torch.where(mask)``) finds in a
        tensor with examples (the tokens routed to an expert): kept through reshapes,
        concatenation and arithmetic; a part of them taken by position (``tokens[:capacity]``,
        ``narrow``, ``split``) is decided across the batch (the first tokens of the batch, not
        of each example), so it is coupled (see :meth:`_coupling`)."""
        if name in ("nonzero", "argwhere") or name == "where" and len(args) == 1:
            if any(is_followed(self._layout_of(t)) for t in ins):
                for o in outs:
                    if not o.is_floating_point():
                        self.row_index[o] = True
            return
        if not self.row_index or not any(t in self.row_index for t in ins):
            return
        x = args[0] if args and isinstance(args[0], Tensor) else None
        if x is not None and x in self.row_index and name in PART_OF:
            index = args[1] if name == "__getitem__" and len(args) > 1 else None
            items = index if isinstance(index, tuple) else (index,)
            # (a mask or index of the rows' own, weights[tokens] > 0.1, picks per row; one
            # that does not depend on them, arange(n) < capacity, by position)
            if name != "__getitem__" or not all(
                is_followed(self._layout_of(i)) or i in self.row_index
                for i in items if isinstance(i, Tensor)
            ) or not any(isinstance(i, Tensor) for i in items):  # fmt: skip
                if any(o.numel() < x.numel() for o in outs):
                    for o in outs:
                        self.coupled[o] = f"{name} of the rows an index picked"
                    return
        if name in KEEPS_ROWS_INDEX or is_pointwise(name) or name == "__getitem__":
            for o in outs:
                if not o.is_floating_point():
                    self.row_index[o] = True

    def _without_candidates(self, name: str, args, kwargs, out, ins: list, result):
        """``result`` (mixed) of an operation on some of the model's inputs taken as batched
        by their size alone, or on what was computed from them alone (a mask ``[T, T]``, a
        memory bank ``[K, D]`` or the prototypes a hooked layer computed from it, as long as
        the batch is large): where taking those inputs as shared by every example instead
        gives a layout that keeps the examples apart, they are, from now on (the hooked calls
        on them become batch-free, their outputs sources: :meth:`_take_as_shared`), and that
        layout is the result. Not where the forward already combined them with the examples
        row by row (:attr:`joined`)."""
        found = [t for t in ins if t in self.lineage]
        if not found:
            return result
        cands = frozenset().union(*(self.lineage[t] for t in found))
        if cands & self.joined:
            return result
        calls = any(not p.done and p.lineage & cands for p in self.pending)
        if calls and (self.func is None or op_name(self.func) != name):
            return result  # (hooked calls to make batch-free, and no meeting to form here)

        def layout_of(t: Any) -> Layout | None:
            if isinstance(t, Tensor) and self.lineage.get(t, frozenset()) & cands:
                return None
            return self._layout_of(t)

        alt = output_layout(name, args, kwargs, out, layout_of, self.batch)
        alts = alt if isinstance(alt, list) else [alt]
        if not alts or any(
            a is None or a is MIXED or a is UNKNOWN or a is CONTRACTED for a in alts
        ):
            return result
        self._take_as_shared(cands)
        return alt

    def _take_as_shared(self, cands: frozenset[int]) -> None:
        """The candidates ``cands`` (ids) are shared by every example: what was computed from
        them alone has no layout, and the hooked calls on them are batch-free, their outputs
        sources that taint what was computed from them."""
        for t, found in list(self.lineage.items()):
            if found & cands:
                self.layouts.pop(t, None)
                del self.lineage[t]
        for t in list(self.candidates.keys()):
            if id(t) in cands:
                del self.candidates[t]
        made: dict[int, frozenset[Source]] = {}
        for k, p in enumerate(self.pending):
            if p.done or not p.lineage & cands:
                continue
            p.done = True
            made[k] = frozenset(s for s in p.shared(p.outputs) if s is not None)
        for t, keys in list(self.would.items()):
            srcs = frozenset().union(*(made.get(k, frozenset()) for k in keys))
            if srcs:
                self.taint(t, srcs)

    def _meet_after(self, name: str, args, kwargs, out) -> None:
        """The operation that took candidates as shared (:meth:`_without_candidates`) after it
        ran: where its inputs now carry sources, it is their meeting with the batch."""
        func = self.func
        tainted = [t for t in tensor_args(args, kwargs) if self.taints.get(t) and t.requires_grad]
        if func is None or op_name(func) != name or not tainted:
            return
        outs = out_tensors(out)
        lays = [self.layouts.get(o) for o in outs]
        srcs = {t: self.all_sources(t) for t in tainted}
        if is_inplace(name):  # (no meeting can run an in-place operation again)
            for s in set().union(*srcs.values()):
                s.problem = s.problem or f"the in-place '{name}' writes the batch into it"
            return
        self.meetings.append(Meeting(self, func, name, args, kwargs, tainted, srcs, outs, lays))
        for s in set().union(*srcs.values()):
            s.uses.append(("meet", name))

    def _presume(self, name: str, args, kwargs, out, ins: list, outs: list) -> Layout:
        """Where the batch is not followed through an operation (one without a handler, or one
        taking a tensor of unknown layout), a hooked layer after it reads the examples from its
        rule's dimension, checking only the batch size. So that nothing after such an operation
        mixes the examples unseen, they are presumed where they were (an output as long as the
        batch on the input's batch dimension), and an operation that would mix them there (a
        reduction, shift or product along it) counts as mixing. This only ever adds refusals:
        a presumed layout is never handed to a rule."""

        def presumed_of(t: Any) -> Layout | None:
            lay = self._layout_of(t)
            return self.presumed.get(t, lay) if lay is UNKNOWN else lay

        # (an operation without a handler along the examples' dimension: across the batch)
        dims = _torch.dim_arguments(name, args, kwargs) if handler_for(name) is None else []
        for t in ins if dims else ():
            lay, n = presumed_of(t), t.dim()
            if (
                lay is not None
                and lay.dim >= 0
                and any(-n <= d < n and norm_dim(d, n) == lay.dim for d in dims)
            ):
                return MIXED
        guess = None
        if any(self._layout_of(t) is UNKNOWN for t in ins):
            again = output_layout(name, args, kwargs, out, presumed_of, self.batch)
            if again is MIXED:
                return MIXED
            if isinstance(again, Layout) and again.dim >= 0:
                guess = again
        if guess is None:
            firm = {lay for t in ins if (lay := presumed_of(t)) is not None and lay.dim >= 0}
            guess = next(iter(firm)) if len(firm) == 1 else None
        if guess is not None:
            for o in outs:
                if o.dim() > guess.dim and o.shape[guess.dim] == guess.size(self.batch):
                    self.presumed[o] = guess
        return UNKNOWN

    def _alone(self, ins: list) -> bool:
        """Whether one of ``ins`` is one example taken out of the batch alone, or computed
        from one alone (``f(x[i])``, joined back later: :attr:`single`)."""
        if not (self.alone.entries or self.single.entries):
            return False
        return any(t in self.alone or t in self.single for t in ins)

    def guard_rows(self, name: str, ins: list, outs: list, call: tuple | None = None) -> None:
        """An operation without a handler, ``name``, gave ``outs`` from tensors that hold the
        examples. Where an output keeps their rows where its input had them, they are
        presumed there (:meth:`_presume`), and the engine's check of one example (the
        probe) reads them so; where ``call`` (its function, arguments and keyword arguments)
        is given and the outputs have a gradient, that is checked first: run again on its
        first and on its last example alone (:func:`~.alone.differs_alone`), it must give
        their rows (a result of no dimension, a loss: run at all). An output with a gradient
        that holds them nowhere the tracker can say (``torch.kron``, ``torch.combinations``:
        other rows than the batch's, which a loss, a rule or the probe would take as the
        examples, or whose rows no check can split; an operation that combined the rows of
        the batch as one matrix, ``torch.linalg.eigh`` of ``[batch, batch]``, or read it as
        something else) is armed: a backward that writes ``grad1`` and reaches its autograd
        node is refused (:meth:`EngineLink.lost_reached`). (Otherwise a result of no
        dimension is a loss, taken as a sum of per-example losses, as one computed by an
        operation followed.)"""
        lost = [o for o in outs if o.requires_grad and o.dim() and o not in self.presumed]
        held = next(
            ((t, lay) for t in ins if (lay := self.presumed_of(t)) is not None and lay.dim >= 0),
            None,
        )
        if held is None:
            return  # (lost before: armed there, where it had a gradient)
        t, lay = held
        alone = None
        if not lost and call is not None and any(o.requires_grad for o in outs):
            alone = self._rows_alone(call, ins, outs, lay)
            if alone is not None:
                lost = [o for o in outs if o.requires_grad]
                for o in lost:
                    self.presumed.pop(o, None)
        if not lost:
            return
        node = next((o.grad_fn for o in lost if o.grad_fn is not None), None)
        if node is None:
            return
        why = (
            f"{self._in_call(name)}, which gradhooks does not follow: from a tensor of shape "
            f"{tuple(t.shape)} holding the {self.batch} examples on {lay.describe(self.batch)}, it "
            f"gave one of shape {tuple(lost[0].shape)}" + (f", {alone}" if alone else "")
        )
        # (the hook holds the nodes after this one, not this one: no cycle through the graph)
        after = tuple(n for n, _ in node.next_functions if n is not None)
        engine = self.engine
        node.register_prehook(lambda grad_outputs: engine.lost_reached(why, after))

    def _rows_alone(self, call: tuple, ins: list, outs: list, lay: Layout) -> str | None:
        """:meth:`guard_rows`' check of an operation ``call`` whose inputs hold the examples on
        ``lay``: why its first and its last example alone do not give their rows of ``outs``
        (``None``: they do, or the inputs do not hold them on one plain dimension, which this
        cannot narrow; a tensor without them as many rows, :meth:`_rows_of_batch`, is narrowed
        with them). The random generator is put back as it was after; an operation that
        drew from it is not judged."""
        firm = {got for t in ins if (got := self.presumed_of(t)) is not None}
        if self.batch < 2 or firm != {lay} or not lay.plain:
            return None
        if any(t.layout is not torch.strided for t in (*ins, *outs)):
            return None  # (sparse: no rows to narrow or compare)
        dims: list[int | None] = []  # (where each output's rows are; None: not compared)
        for o in outs:
            kept = self.presumed.get(o) if o.dim() else Layout(0)
            dims.append(kept.dim if kept is not None and kept.plain else None)
        func, args, kwargs = call
        # (a size given as the shape of a tensor with the examples, x.as_strided(x.shape, ...),
        # is given for one example as its shape)
        shapes = {tuple(t.shape) for t in (*ins, *outs) if self._rows_of_batch(t, lay)}

        def one(a: Any) -> Any:
            if isinstance(a, tuple | list) and tuple(a) in shapes:
                return type(a)([1 if i == lay.dim else n for i, n in enumerate(a)])
            return a

        args, kwargs = tuple(one(a) for a in args), {k: one(a) for k, a in kwargs.items()}
        devices = sorted({t.device.index or 0 for t in ins if t.is_cuda})
        with torch.random.fork_rng(devices=devices):
            state = torch.random.get_rng_state()
            why = differs_alone(
                lambda a, k: func(*a, **k), args, kwargs,
                lambda t: self._rows_of_batch(t, lay), lay.dim, self.batch, outs, dims,
            )  # fmt: skip
            if why is not None and not torch.equal(state, torch.random.get_rng_state()):
                return None  # (it draws random numbers: one example's are not its rows')
        return why

    def _rows_of_batch(self, t: Tensor, lay: Layout) -> bool:
        """Whether ``t`` has a row per example on ``lay``'s dimension: it holds the examples
        there, or, not depending on them, as many rows (``axis.expand_as(h)``: taken row by
        row with them by an operation on each example's rows)."""
        got = self.presumed_of(t)
        if got is None:
            return t.dim() > lay.dim and t.shape[lay.dim] == self.batch
        return got == lay

    # -- meetings ---------------------------------------------------------------------------------

    def _meeting(self, func, name, args, kwargs, tensors, direct) -> Any:
        """An operation where tensors derived from sources meet tensors with a layout."""
        ids = {id(d) for d in direct}
        tainted = list({id(t): t for t in tensors if self.taints.get(t) or id(t) in ids}.values())
        for t in tensors if self.lineage else ():
            self.joined |= self.lineage.get(t, frozenset())  # (met as batched)
        # (the graph turned off inside the call: its parameters' gradients from here come
        # from a backward written by hand)
        lost = not torch.is_grad_enabled() and self._graph_where_called()
        if (
            self.engine is not None
            and direct
            and not lost
            and not any(self.taints.get(t) for t in tensors)
        ):
            out = self.engine.functional_use(func, name, args, kwargs, direct, self)
            if out is not NotImplemented:
                for p in direct:  # (a module without a rule that covers it leaves it to this)
                    where = self._covering(id(p))
                    if where is not None:
                        self.used[where].functional.add(id(p))
                return out
        for p in direct:
            self._param_source(p)
        if lost or any(not t.requires_grad for t in tainted):
            if not torch.is_grad_enabled():
                # (inside a custom autograd.Function's forward, whose own backward gives the
                # sources a gradient gradhooks cannot split by example, or under no_grad)
                out = func(*args, **kwargs)
                self.propagate(name, args, kwargs, out)
                why = (
                    f"'{name}' combines it with the batch where autograd records no graph "
                    "(inside a custom autograd.Function's forward, or under torch.no_grad), "
                    "so gradhooks cannot follow its gradient from there"
                )
                for t in tainted:
                    for s in self.all_sources(t):
                        s.problem = s.problem or why
                        if self.engine is not None:  # (no graph holds it: kept to be told)
                            self.engine.unheld(s)
                return out
            tainted = [t for t in tainted if t.requires_grad]  # (detached: no gradient back)
            if not tainted:
                out = func(*args, **kwargs)
                self.propagate(name, args, kwargs, out)
                return out
        fast = expanded_meeting(self, func, name, args, kwargs, tainted)
        if fast is None:
            fast = into_meeting(self, func, name, args, kwargs, tainted)
        if fast is None:
            fast = spread_meeting(self, func, name, args, kwargs, tainted)
        if fast is not None:
            return fast
        out = func(*args, **kwargs)
        self.propagate(name, args, kwargs, out)
        outs = [o for o in out_tensors(out)]
        lays = [self.layouts.get(o) for o in outs]
        srcs = {t: self.all_sources(t) for t in tainted}
        soft = {s for ss in srcs.values() for s in ss if getattr(s, "soft", False)}
        for s in soft:  # (its module's fallback takes it over: cheaper than a masked backward)
            s.needs_fallback = True
        srcs = {t: ss - soft for t, ss in srcs.items()}
        tainted = [t for t in tainted if srcs[t]]
        if not tainted:
            return out
        if is_pointwise(name) and all(o.dim() == 0 for o in outs):
            for s in set().union(*srcs.values()):  # a term added to the loss itself (weight
                s.uses.append(("loss", name))  # decay): no example's; not delivered
            return out
        followed = not any(lay is None or lay.dim < 0 for lay in lays)
        if followed and is_inplace(name) and not any(args and t is args[0] for t in tainted):
            # added in place into the batch (TAPAS: embeddings += token_type_embeddings(ids)):
            # as the operation out of place where each source's output is used as it is, row
            # by row with the batch; else (no meeting can run an in-place operation again)
            # refused below
            aligned = aligned_sources(self, name, args, kwargs, tainted, outs, lays)
            every = set().union(*(srcs[t] for t in tainted))
            if every <= set(aligned):
                for s in every:
                    s.uses.append(("aligned", aligned[s]))
                self.unmet |= every  # (no meeting holds them: finish still sees them)
                return out
        if not followed or is_inplace(name):
            met = {*lays, *(self.layouts.get(t) for t in tensors)}
            if is_inplace(name):
                why = f"the in-place '{name}' writes the batch into a tensor derived from it"
            elif PACKED in met:
                why = (
                    f"'{name}' combines it with the data of a PackedSequence (the examples' "
                    "time steps packed together), whose rows gradhooks follows only into the "
                    "recurrent layers it has rules for"
                )
            elif MIXED in met:
                why = (
                    f"'{name}' combines it with a tensor whose entries depend on several "
                    f"examples at once ({self.mixing(name)}), so the examples' shares "
                    "of its gradient do not exist"
                )
            elif name in UNFUSED:
                why = f"'{name}' is a fused operation no rule covers yet: {UNFUSED[name]}"
            else:
                lost = ", ".join(self.unknown)
                why = f"'{name}' combines it with the batch in a way gradhooks cannot follow" + (
                    f" (the batch was lost before it, through {lost})" if lost else ""
                )
            for s in set().union(*srcs.values()):
                s.problem = s.problem or why
            return out
        srcs = {t: srcs[t] for t in tainted}
        meeting = Meeting(self, func, name, args, kwargs, tainted, srcs, outs, lays)
        self.meetings.append(meeting)
        aligned = aligned_sources(self, name, args, kwargs, tainted, outs, lays)
        for s in set().union(*srcs.values()):
            s.uses.append(("aligned", aligned[s]) if s in aligned else ("meet", name))
        return out

    def _note_transformed(self, func, args: tuple, kwargs: dict) -> None:
        """A call inside a ``torch.func`` transform (``vmap``, ``grad``) run in the forward:
        the transform's tensors wrap the forward's, which the tracker cannot follow through it.
        A parameter used outside its module's call, or a tensor made from one, that enters it
        may meet the batch there unseen, so its per-example gradient would miss that use:
        marked, so that a backward that reaches it refuses rather than leaves it out."""
        why = (
            f"'{op_name(func)}' runs it inside a torch.func transform (vmap, grad) in the "
            "forward, where gradhooks cannot follow the examples"
        )
        for t in tensor_args(args, kwargs):
            base = _torch.functorch_base(t)
            if base is t:
                continue
            for s in self.all_sources(base):
                s.problem = s.problem or why

    def all_sources(self, t: Tensor) -> frozenset[Source]:
        s = self.taints.get(t, frozenset())
        if id(t) in self.params:
            where = self._covering(id(t))
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


@dataclass(frozen=True)
class _Positions:
    """An index of positions along the examples' dimension that each example's own mask
    found (:meth:`Tracker._positions`): ``base``, the layout of the dimension it indexes;
    ``lineage``, the ids of the inputs taken as holding the examples by their size alone that
    the mask came from (:attr:`Tracker.lineage`)."""

    base: Layout
    lineage: frozenset[int]


@dataclass(frozen=True)
class ListedJoin:
    """A join of the forward that took its tensors as the examples, one each, where the batch
    was taken from a dimension of one of them (:meth:`Tracker._listed_join`)."""

    op: str  # the torch function: stack, cat, pad_sequence
    count: int  # the tensors it joined
    shape: tuple[int, ...]  # the shape of the first of them with the examples
    padded: bool  # pad_sequence: its tensors are sequences along the batch's dimension


@dataclass
class _Pending:
    """A hooked call on tensors computed from candidates alone (:meth:`Tracker.note_call`)."""

    lineage: frozenset[int]  # the candidates' ids
    outputs: list[Tensor]
    shared: Callable[[list], list]  # makes the call batch-free: its outputs' sources
    done: bool = False


_ACTIVE: list[Tracker] = []
_RETAIN_GRAD = Tensor.retain_grad

# what a torch function returns that holds no tensor (``x.shape``, ``x.dtype``, ``x.dim()``)
_NO_TENSOR = frozenset({bool, int, float, str, type(None), torch.Size, torch.dtype, torch.device})
_NO_SOURCES: frozenset = frozenset()
_PLAIN = memo.PLAIN
_UNLAID: Any = object()  # (Tracker._quick_key: no tensor of the call has a layout)
_ref = weakref.ref


def _other_part(a: Any, entries: dict) -> Any:
    """:func:`.memo.part` of argument ``a``, neither a tensor nor of :data:`.memo.PLAIN`, on
    the short way of :meth:`Tracker.__torch_function__`; ``None`` where the call takes the
    long way (a list or tuple holding a tensor, whose tensors the long way looks at)."""
    cls = a.__class__
    if cls is tuple or cls is list or cls is torch.Size:
        plain = True
        for x in a:
            if x.__class__ not in _PLAIN:
                if isinstance(x, Tensor):
                    return None
                plain = False
        if plain:
            return (cls, *a)  # (memo.part's, without a call per entry: view(shape))
    p = memo.part(a, entries)
    return None if p is memo.NO_KEY else p


_COMPILING = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)
_NONE: frozenset[int] = frozenset()
_FINDS_ROWS = frozenset({"nonzero", "argwhere", "where"})
# the joins that may take their tensors as the examples, one each (see Tracker._listed_join)
_LIST_JOINS = frozenset({"stack", "cat", "concat", "concatenate", "pad_sequence"})
# what keeps every entry of an index of positions, and only those (see Tracker._positions)
_RESHAPES_POSITIONS = frozenset(
    """view reshape flatten ravel squeeze unsqueeze contiguous clone detach expand expand_as
    __getitem__ to long int""".split()
)
_INDEX_DTYPES = frozenset({torch.int64, torch.int32})

# the operations whose masks computed across the examples keep, where all ones, every entry for
# an example alone too (see Tracker._all_ones)
_RUNNING_COUNTS = frozenset({"cumsum", "all"})  # (see Tracker._row_indices)


def _note_read(read: dict[float, str], value: float, name: str) -> None:
    """Keep ``value``, read into Python by ``name`` from a tensor computed across the examples,
    unless it is a whole number (a count of the batch's tokens, a mask's largest entry, 0: what
    is read to trim padding or to divide a loss by, and what literals in the model's code
    hold)."""
    if not value.is_integer():
        read[value] = name


def _read_back(read: dict[float, str], args: tuple, kwargs: dict) -> str | None:
    """The operation that read a number of ``read`` into Python where one is an argument
    (``h / s``, ``clamp(h, max=s)``): the same double, so the same value, not a coincidence."""
    for a in (*args, *kwargs.values()):
        if a.__class__ is float and a in read:
            return read[a]
    return None


# the operations that read a tensor into a Python list or a NumPy array
_READS_ROWS = frozenset({"numpy", "tolist"})


def _rows_back(read: dict[int, tuple[Any, str]], args: tuple, kwargs: dict) -> str | None:
    """The operation that read a list or array of ``read`` into Python where that same object
    is an argument, or a part of an index (``h[:, idx]``), of another."""
    for a in (*args, *kwargs.values()):
        for b in a if a.__class__ is tuple else (a,):
            found = read.get(id(b))
            if found is not None and found[0] is b:
                return found[1]
    return None


def note(func: Any, args: tuple, kwargs: dict, out: Any) -> None:
    """Tell the running forward's tracker that ``func(*args, **kwargs)`` gave ``out``: for a
    ``TorchFunctionMode`` of a rule's own that computes a torch function another way (the
    tracker then never sees that function, only the operations it was computed with)."""
    if _ACTIVE and not _ACTIVE[-1].off:
        tracker = _ACTIVE[-1]
        layouts = [tracker.layouts.get(t) for t in tensor_args(args, kwargs or {})]
        if any(lay is not None for lay in layouts):
            tracker.propagate(op_name(func), args, kwargs or {}, out)

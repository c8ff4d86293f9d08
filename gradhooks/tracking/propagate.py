"""One torch function's effect on the layouts: the long way of :class:`~.tracker.Tracker`.

:func:`propagate_op` reads a layout for each output from the operation's handler
(:mod:`.ops`), and refines it by what the tracker knows of the forward so far: tensors mixed
across the examples, rows reordered or picked by an index computed across the batch
(:mod:`.rows`), operations without a handler (presumed, :func:`presume`, and checked,
:func:`~.alone.guard_rows`), and the model's inputs taken as holding the examples by their size
alone (candidates: :func:`without_candidates`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from torch import Tensor

from .. import _torch
from .alone import guard_rows
from .couplings import POWERS, arm, coupling, nonlinear, whole_matrix
from .couplings import PRODUCTS as PRODUCTS_OF
from .layout import (
    CONTRACTED,
    FREE,
    MIXED,
    PACKED,
    REORDER,
    UNKNOWN,
    Layout,
    is_followed,
    sole_owner,
)
from .ops import OpFacts, data_args, handler_for, output_layout
from .ops.common import arg, carries, is_inplace, norm_dim, op_name, out_tensors, tensor_args
from .ops.indexing import by_positions, examples_taken, one_example, puts_back, reorder_of
from .ops.names import PRODUCTS
from .ops.nn import MIXES_AS
from .ops.pointwise import is_pointwise, where_unselected
from .read import read_back, rows_back
from .rows import (
    FINDS_ROWS,
    all_ones,
    follow_coupled,
    follow_positions,
    follow_ranked,
    follow_row_indices,
    one_examples,
    permutes,
    positions_base,
    singles,
)
from .sources import Meeting, Source

if TYPE_CHECKING:
    from .tracker import Tracker

# operations that take a reordered batch with the order it was put in (a PackedSequence keeps
# its sorted_indices, and the RNN rules read them)
TAKES_ORDER = {"_pack_padded_sequence"}


@dataclass(frozen=True)
class ListedJoin:
    """A join of the forward that took its tensors as the examples, one each, where the batch
    was taken from a dimension of one of them (:func:`listed_join`)."""

    op: str  # the torch function: stack, cat, pad_sequence
    count: int  # the tensors it joined
    shape: tuple[int, ...]  # the shape of the first of them with the examples
    padded: bool  # pad_sequence: its tensors are sequences along the batch's dimension


_NONE: frozenset[int] = frozenset()


# the joins that may take their tensors as the examples, one each (see listed_join)
_LIST_JOINS = frozenset({"stack", "cat", "concat", "concatenate", "pad_sequence"})


def propagate_op(tr: Tracker, op: OpFacts, args, kwargs, out, ins: list | None = None) -> None:
    """:meth:`.Tracker.propagate`, given the facts ``op`` of its function; ``ins``: the tensors
    among the arguments whose values it computes with (:func:`data_args`), where the caller has
    them."""
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
    if name in _LIST_JOINS and (tr.listed or name == "pad_sequence"):
        listed_join(tr, name, args, kwargs, outs[0], ins)
    unselected = where_unselected(name, args, tr.layouts) if name == "where" else _NONE
    if tr.coupled.entries and name in PRODUCTS:
        unselected = unselected | all_ones(tr, name, ins)
    layout_of = tr.layouts.get  # (as tr.layout: no tensor has no entry)
    if unselected:  # (a branch of torch.where that no entry takes: as if a constant)
        ins = [t for t in ins if id(t) not in unselected]

        def layout_of(t: Any) -> Layout | None:
            return None if id(t) in unselected else tr.layout(t)

    layouts = tr.layouts
    inherited = False
    for t in ins:
        if layouts.get(t) is MIXED:
            inherited = True
            break
    joined = None
    if inherited and tr.single.entries:
        joined = singles(tr, name, args, kwargs, ins, outs)
        inherited = not is_followed(joined)
    if inherited:
        result = MIXED
        if (
            joined is None
            and tr.engine is not None
            and not any(u.soft for u in tr.used)
            and not any_alone(tr, ins)
        ):  # (a product after a reduction over the batch, or a function not linear in
            # it: refused if a backward reaches it; inside a module without a rule, its
            # fallback recomputes it per example)
            if name in PRODUCTS_OF or name in POWERS:
                why = coupling(name, args, ins, layout_of, tr.mixed)
            else:
                why = nonlinear(name, ins, layout_of, tr.mixed)
            if why is not None:
                arm(tr.engine, outs, why)
    elif joined is not None:
        result = joined
    else:
        result = None
        if tr.positions.entries:
            try:
                result = by_positions(
                    name, args, kwargs, out, layout_of, tr.batch, lambda t: positions_base(tr, t)
                )
            except Exception:  # (an argument form it does not know: the handlers decide)
                result = None
        if result is None:
            result = output_layout(name, args, kwargs, out, layout_of, tr.batch, ins)
        if result is FREE:  # (values of no example, though picked by an index that has some)
            return
        if result is CONTRACTED:  # (the examples' dimension contracted)
            if any([t in tr.given for t in ins]):
                tr.unknown[name] = None  # (the examples perhaps not where presumed)
                result = UNKNOWN
            else:
                result = MIXED
        if (
            result is MIXED
            and tr.engine is not None
            and not any(u.soft for u in tr.used)
            and (why := whole_matrix(name, args, kwargs, ins, layout_of)) is not None
        ):  # (the examples as rows of one matrix: refused if a backward reaches it)
            arm(tr.engine, outs, why)
        if result is UNKNOWN:
            result = presume(tr, name, args, kwargs, out, ins, outs)
    # (a PackedSequence of examples packed in another order: see packed_in_order; of one
    # example, in its only order)
    if name == "_pack_padded_sequence" and tr.reordered.entries and tr.batch > 1:
        result = packed_in_order(tr, args, kwargs, outs, result)
    if name == "_pad_packed_sequence" and tr.packed_orders.entries and tr.batch > 1:
        result = unpacked_in_order(tr, args, outs, result)
    if tr.read and result is not MIXED and (got := read_back(tr.read, args, kwargs)):
        result = MIXED  # (h / float(h.abs().max()): every example's rows scaled by all)
        tr.mixed.setdefault(f"{got} of a reduction over the batch, read into Python", None)
    if tr.read_rows and result is not MIXED and (got := rows_back(tr.read_rows, args, kwargs)):
        result = MIXED  # (h[:, idx], idx = h.mean(0).topk(k).indices.numpy(): TimesNet's)
        tr.mixed.setdefault(f"{got} of a tensor computed across the batch, read into Python", None)
    if tr.coupled.entries:
        result = follow_coupled(tr, name, args, ins, outs, result)
    if tr.ranked.entries or tr.coupled.entries:
        result = follow_ranked(tr, name, args, ins, outs, result)
    if tr.row_index.entries or name in FINDS_ROWS:
        follow_row_indices(tr, name, args, ins, outs)
    if tr.positions.entries or name in FINDS_ROWS:
        follow_positions(tr, name, args, kwargs, outs, op.inplace or "out" in kwargs)
    reordered = (
        next((tr.reordered[t] for t in ins if t in tr.reordered), None)
        if tr.reordered.entries
        else None
    )
    if result is REORDER:  # (of data too: a layer on x[order] is refused, not misread)
        if reordered is None:
            order = reorder_of(name, args, kwargs)
            before = tr.layout(args[0]) if args else None
            for o in outs:
                tr.reordered[o] = name
                if order is not None:
                    tr.orders[o] = (*order, before)
        result = UNKNOWN  # (reordered again: taken as put back in order)
        # (the examples presumed where they were, so that a reduction over them after, even
        # of a detached copy, which no backward would show, counts as mixing them)
        presume(tr, name, args, kwargs, out, ins, outs)
    elif reordered is not None and name not in TAKES_ORDER:
        ordered = [t for t in ins if t not in tr.reordered and tr.layout(t) is not
                   None and tr.layout(t).dim >= 0]  # fmt: skip
        if ordered and any(o.requires_grad for o in outs):
            result = MIXED  # (rows of different examples combined: x[perm] + x)
            tr.mixed.setdefault(reordered, None)
            inherited = True
        elif not ordered:  # (with ordered rows and no gradient: mixed before the model)
            # (x[order] * 2: still in that order, with a gradient or not, until put back)
            order = tr.orders.get(args[0]) if args and isinstance(args[0], Tensor) else None
            if order is None or not puts_back(order, name, args, kwargs):
                order = order or next((tr.orders[t] for t in ins if t in tr.orders), None)
                for o in outs:
                    tr.reordered[o] = reordered
                    if order is not None:
                        tr.orders[o] = order
            elif is_followed(order[2]):
                # put back in order (x[perm][perm.argsort()]): the batch's layout again, on
                # which an operation across the examples (a mean over them, even detached)
                # is mixing, as on the batch itself
                result = order[2]
    resolved = False
    if result is MIXED and not inherited and tr.lineage:
        before = result
        result = without_candidates(tr, name, args, kwargs, out, ins, result)
        resolved = result is not before
    if result is MIXED and tr.batch == 1 and not inherited:
        # one example cannot mix with another: where two reshapes put its only entry on
        # different dimensions (heads folded in, sequence-first), take the first input's
        # dimension, every entry of which is the one example's (rows that are no example's
        # joined to it along that dimension: torch.cat([k, zeros]))
        result = next((lay for t in ins if is_followed(lay := tr.layout(t))), UNKNOWN)
        if result is not UNKNOWN and result.owners is None:
            o = outs[0]
            if result.dim < o.dim() and o.shape[result.dim] != result.size(1):
                result = Layout(result.dim, o.shape[result.dim], 1)
    if (
        result is MIXED
        and not inherited
        and is_pointwise(name)
        and not any(o.requires_grad for o in outs)
        and (before := mixed_up(tr, ins)) is not None
    ):  # (the examples mixed with a permutation of them where no gradient flows, MixUp of
        # the inputs, x = lam * x + (1 - lam) * x[perm]: mixed before the model, each row
        # one example to the layers after; docs/guarantees.md)
        result = UNKNOWN
        for o in outs:
            if o.dim() > before.dim and o.shape[before.dim] == before.size(tr.batch):
                tr.presumed[o] = before
    taken_alone = (
        result is MIXED
        and not inherited
        and args
        and one_example(name, args, kwargs, lay := tr.layout(args[0]))
    )
    if result is MIXED and not any(carries(o) for o in outs) and not inherited and not taken_alone:
        for o in outs:  # (an index or mask computed across the examples: see rows.follow_coupled)
            tr.coupled[o] = name
    if result is MIXED:
        # (one example's rows taken out alone, x[i] or x.unbind(0), indices and masks too:
        # that example's own, followed as such, not an index computed across the batch)
        if any(carries(o) for o in outs) or taken_alone:
            if not inherited and not any(k.startswith(f"{name} picking") for k in tr.mixed):
                tr.mixed.setdefault(tr.in_call(name) + MIXES_AS.get(name, ""), None)
            if taken_alone:
                taken = examples_taken(name, args, kwargs, lay, len(outs))
                for k, o in enumerate(outs):
                    tr.alone[o] = (name, lay.dim)
                    if taken is not None:
                        tr.single[o] = (taken[k], lay)
            elif not inherited and (one := one_examples(tr, ins)) is not None:
                # (computed from one example's rows alone, their dimension dropped:
                # h[0], h.squeeze(0) or h.mean(0) of x[i : i + 1]'s: that example alone)
                for o in outs:
                    tr.alone[o] = (name, one[1].dim)
                    tr.single[o] = one
            for o in outs:
                tr.layouts[o] = MIXED
            if tr.used and tr.used[-1].soft:
                tr.used[-1].mixed = True
                if not inherited:
                    picked = any(
                        lay is not None and lay.owners is not None
                        for t in ins
                        if (lay := tr.layout(t)) is not None
                    )
                    tr.used[-1].mixing.add("__getitem__" if picked else name)
            return
        if inherited:
            # (a mask of values against a statistic of the batch, x > x.mean(): which
            # entries it keeps depends on the other examples' values; and what is made of
            # one, an index of the batch's top-k detached, copied or moved, idx.detach())
            for o in outs:
                tr.layouts[o] = MIXED
            return
        # an index or mask computed across the examples (which experts any token picked,
        # the longest sequence): it selects, and each row is still a constant of its
        # example's computation, where the rule's dimension reads it
        result = UNKNOWN
    if result is UNKNOWN or result is None:
        if op.handler is None:
            tr.unknown[name] = None
            if tr.engine is not None:
                rerun = not (op.inplace or op.like or "out" in kwargs) and tr.func
                guard_rows(tr, name, ins, outs, (tr.func, args, kwargs) if rerun else None)
        for o in outs:
            tr.layouts[o] = UNKNOWN
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
                tr.mixed.setdefault(tr.in_call(name), None)
        if lay.dim >= 0 and (o.dim() <= lay.dim or o.shape[lay.dim] != lay.size(tr.batch)):
            lay = UNKNOWN  # (a handler's guess that the shapes contradict)
        tr.layouts[o] = lay
    if any(lay is PACKED for lay in result):
        note_packed_data(tr, name, args, ins, outs)
    if resolved:
        meet_after(tr, name, args, kwargs, out)
    elif tr.lineage.entries:
        inherit(tr, ins, outs)


def note_packed_data(tr: Tracker, name: str, args, ins: list, outs: list) -> None:
    """The whole data of a PackedSequence among ``outs`` (:meth:`.Tracker.note_packed`): what
    ``_pack_padded_sequence`` gives (its batch sizes beside it; the examples in the order
    :func:`packed_in_order` noted), and what a recurrent layer or an operation that keeps each
    row apart and in place makes of such data, all of its rows, of one PackedSequence."""
    if name == "_pack_padded_sequence":
        if len(outs) > 1 and tr.layout(outs[0]) is PACKED:
            tr.note_packed(outs[0], outs[1], tr.packed_orders.get(outs[1]))
        return
    if not tr.packed_data.entries:
        return
    found = None
    for t in ins:
        if tr.layout(t) is not PACKED:
            continue
        entry = tr.packed_data.get(t)
        if entry is None or (found is not None and entry is not found):
            return  # (not the whole data, or of two PackedSequences)
        found = entry
    if found is None:
        return
    rows = int(found[0].sum())
    for o in outs:
        if tr.layout(o) is PACKED and o.dim() and o.shape[0] == rows:
            tr.packed_data[o] = found


def packed_in_order(tr: Tracker, args, kwargs, outs: list, result):
    """``_pack_padded_sequence`` of the batch put in another order along its dimension
    (``pack_padded_sequence(..., enforce_sorted=False)`` sorts it by length first, by
    ``index_select``): the data of a PackedSequence whose examples are packed in that order
    (its ``sorted_indices``), noted by its batch sizes (:attr:`.Tracker.packed_orders`), as
    for one the model is given. ``result``: the handler's layouts, given back as that of a
    PackedSequence's data and batch sizes where so."""
    order = tr.orders.get(args[0]) if args and isinstance(args[0], Tensor) else None
    if order is None or len(outs) < 2:
        return result
    dim, perm, before = order
    batch_first = bool(arg(args, kwargs, 2, "batch_first"))
    if not (
        is_followed(before) and before.plain and before.dim == dim == (0 if batch_first else 1)
    ):
        return result
    tr.packed_orders[outs[1]] = perm
    return [PACKED, None]


def unpacked_in_order(tr: Tracker, args, outs: list, result):
    """``_pad_packed_sequence`` of the data of a PackedSequence the model was given with its
    examples packed in another order than the batch's (:attr:`.Tracker.packed_orders`): the
    padded rows are in that order, which ``pad_packed_sequence`` then puts back
    (``index_select`` by its ``unsorted_indices``). ``result``: its handler's layouts of the
    outputs, the padded rows' first; given back with the padded rows reordered by the
    ``sorted_indices``, as ``x[perm]`` is (unknown, the examples presumed on that dimension),
    so that putting them back gives the batch in order again."""
    sizes = args[1] if len(args) > 1 else None
    order = tr.packed_orders.get(sizes) if isinstance(sizes, Tensor) else None
    padded = result[0] if isinstance(result, list) and result else None
    if order is None or not isinstance(padded, Layout) or not is_followed(padded):
        return result
    tr.reordered[outs[0]] = "pad_packed_sequence, in the order the examples were packed in,"
    tr.orders[outs[0]] = (padded.dim, order, padded)
    tr.presumed[outs[0]] = padded
    return [UNKNOWN, *result[1:]]


def inherit(tr: Tracker, ins: list, outs: list) -> None:
    """The lineage of an operation's outputs (:attr:`.Tracker.lineage`): its inputs' where
    every input with examples has one; an operation that combines such an input with other examples
    joins its candidates to the batch for good."""
    every, would, firm = frozenset(), frozenset(), False
    for t in ins:
        if tr.layout(t) is None:
            continue
        found = tr.lineage.get(t)
        if found is None:
            firm = True
            continue
        every |= found
        would |= tr.would.get(t, frozenset())
    if not every:
        return
    if firm:
        tr.joined |= every
        return
    for o in outs:
        if tr.layout(o) is not None:
            tr.lineage[o] = every
            if would:
                tr.would[o] = would


def listed_join(tr: Tracker, name: str, args, kwargs, out: Tensor, ins: list) -> None:
    """Keep in :attr:`.Tracker.listed_joins` a join that takes its tensors as the examples, one
    each, where the batch was taken from a dimension of one of them: ``pad_sequence`` of
    sequences whose dimension 0, their length, holds it (each sequence is an example:
    the batch is their list); ``stack`` (or ``cat``) of the model's inputs held with its
    first in one list, or of what was computed from each of them alone, along a dimension
    in front of the batch's (``torch.stack(examples)``, ``torch.cat([e[None] for e in
    examples])``). A stack behind it (``torch.stack(views, 1)``) or a cat along it
    (``torch.cat(views)``: the views of one batch) is taken as a list of batches."""
    laid = [
        (t, lay) for t in ins
        if is_followed(lay := tr.layout(t)) and lay.owners is None
    ]  # fmt: skip
    if not laid:
        return
    if name == "pad_sequence":
        t = next((u for u, lay in laid if lay.dim == 0), None)
        if t is not None:
            tr.listed_joins.append(ListedJoin(name, len(ins), tuple(t.shape), True))
        return
    t, lay = laid[0]
    listed = [u for u, _ in laid if (lin := tr.lineage.get(u)) is not None and lin <= tr.listed]
    if len(ins) < 2 or not listed:
        return
    d = norm_dim(int(arg(args, kwargs, 1, "dim", kwargs.get("axis", 0))), out.dim())
    in_front = d <= lay.dim if name == "stack" else d < lay.dim  # (of the batch's, in out)
    if in_front:
        tr.listed_joins.append(ListedJoin(name, len(ins), tuple(t.shape), False))


def mixed_up(tr: Tracker, ins: list) -> Layout | None:
    """The layout of the batch where every tensor with examples among ``ins`` holds its
    rows in order or in another order by an index (:class:`Owners`, shuffled, of each of
    them once: ``x`` and ``x[perm]``), and some in another; else ``None``."""
    base, moved = None, False
    for t in ins:
        lay = tr.layout(t)
        if lay is None:
            continue
        plain = lay if lay.owners is None else lay.owners.base
        if not is_followed(plain) or plain.owners is not None or base not in (None, plain):
            return None
        if lay.owners is not None:
            if not lay.owners.shuffled or lay.dim != plain.dim or not permutes(tr, plain, lay):
                return None  # (rolled, as the data rolled: refused, as it was)
            moved = True
        base = plain
    return base if moved else None


def presume(tr: Tracker, name: str, args, kwargs, out, ins: list, outs: list) -> Layout:
    """Where the batch is not followed through an operation (one without a handler, or one
    taking a tensor of unknown layout), a hooked layer after it reads the examples from its
    rule's dimension, checking only the batch size. So that nothing after such an operation
    mixes the examples unseen, they are presumed where they were (an output as long as the
    batch on the input's batch dimension), and an operation that would mix them there (a
    reduction, shift or product along it) counts as mixing. This only ever adds refusals:
    a presumed layout is never handed to a rule."""

    def presumed_of(t: Any) -> Layout | None:
        lay = tr.layout(t)
        return tr.presumed.get(t, lay) if lay is UNKNOWN else lay

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
    if any(tr.layout(t) is UNKNOWN for t in ins):
        again = output_layout(name, args, kwargs, out, presumed_of, tr.batch)
        if again is MIXED:
            return MIXED
        if isinstance(again, Layout) and again.dim >= 0:
            guess = again
    if guess is None:
        firm = {lay for t in ins if (lay := presumed_of(t)) is not None and lay.dim >= 0}
        guess = next(iter(firm)) if len(firm) == 1 else None
    if guess is not None:
        for o in outs:
            if o.dim() > guess.dim and o.shape[guess.dim] == guess.size(tr.batch):
                tr.presumed[o] = guess
    return UNKNOWN


def any_alone(tr: Tracker, ins: list) -> bool:
    """Whether one of ``ins`` is one example taken out of the batch alone, or computed
    from one alone (``f(x[i])``, joined back later: :attr:`.Tracker.single`)."""
    if not (tr.alone.entries or tr.single.entries):
        return False
    return any(t in tr.alone or t in tr.single for t in ins)


def without_candidates(tr: Tracker, name: str, args, kwargs, out, ins: list, result):
    """``result`` (mixed) of an operation on some of the model's inputs taken as batched
    by their size alone, or on what was computed from them alone (a mask ``[T, T]``, a
    memory bank ``[K, D]`` or the prototypes a hooked layer computed from it, as long as
    the batch is large): where taking those inputs as shared by every example instead
    gives a layout that keeps the examples apart, they are, from now on (the hooked calls
    on them become batch-free, their outputs sources: :func:`take_as_shared`), and that
    layout is the result. Not where the forward already combined them with the examples
    row by row (:attr:`.Tracker.joined`), nor where one of them is one example's rows picked
    by their place in the batch (``ids[0:1]``, expanded or not: that example's own, as
    ``ids[0]`` is, never a row shared by every example)."""
    found = [t for t in ins if t in tr.lineage]
    if not found:
        return result
    for t in found:
        lay = tr.layout(t)
        if lay is not None and lay.owners is not None and lay.owners.placed:
            if sole_owner((lay,)) is not None:
                return result
    cands = frozenset().union(*(tr.lineage[t] for t in found))
    if cands & tr.joined:
        return result
    calls = any(not p.done and p.lineage & cands for p in tr.pending)
    if calls and (tr.func is None or op_name(tr.func) != name):
        return result  # (hooked calls to make batch-free, and no meeting to form here)

    def layout_of(t: Any) -> Layout | None:
        if isinstance(t, Tensor) and tr.lineage.get(t, frozenset()) & cands:
            return None
        return tr.layout(t)

    alt = output_layout(name, args, kwargs, out, layout_of, tr.batch)
    alts = alt if isinstance(alt, list) else [alt]
    if not alts or any(a is None or a in (MIXED, UNKNOWN, CONTRACTED, FREE) for a in alts):
        return result
    take_as_shared(tr, cands, name)
    return alt


class SharedInput(NamedTuple):
    """A model input as long as the batch, taken as holding the examples by its size alone,
    that the forward took as shared by every example after all (:func:`take_as_shared`):
    every example's gradient then holds what each of its rows adds, so that its rows are no
    example's own (under DP, they are not protected)."""

    position: int  # its place among the model's tensor inputs (0: the first)
    shape: tuple[int, ...]
    operation: str  # the operation that took it as shared, with the call it ran in
    calls: tuple[str, ...]  # the hooked calls on it alone, made batch-free by that


def take_as_shared(tr: Tracker, cands: frozenset[int], name: str) -> None:
    """The candidates ``cands`` (ids) are shared by every example, as operation ``name``
    takes them: what was computed from them alone has no layout, and the hooked calls on them
    are batch-free, their outputs sources that taint what was computed from them. Each is
    noted in :attr:`.Tracker.shared_inputs`."""
    for t, found in list(tr.lineage.items()):
        if found & cands:
            tr.layouts.pop(t, None)
            del tr.lineage[t]
    taken = []
    for t, position in tr.candidates.items():
        if id(t) in cands:
            del tr.candidates[t]
            taken.append((position, tuple(t.shape)))
    made: dict[int, frozenset[Source]] = {}
    for k, p in enumerate(tr.pending):
        if p.done or not p.lineage & cands:
            continue
        p.done = True
        found = p.shared(p.outputs)
        for s, edge in zip(found, p.edges):
            if s is not None and edge is not None:
                tr.edges[s] = edge  # (the call's own output, whatever was done in place since)
        made[k] = frozenset(s for s in found if s is not None)
    for t, keys in list(tr.would.items()):
        srcs = frozenset().union(*(made.get(k, frozenset()) for k in keys))
        if srcs:
            tr.taint(t, srcs)
    calls = tuple(dict.fromkeys(s.name for ss in made.values() for s in ss))
    operation = tr.in_call(name)
    tr.shared_inputs.extend(SharedInput(k, shape, operation, calls) for k, shape in taken)


def meet_after(tr: Tracker, name: str, args, kwargs, out) -> None:
    """The operation that took candidates as shared (:func:`without_candidates`) after it
    ran: where its inputs now carry sources, it is their meeting with the batch."""
    func = tr.func
    tainted = [t for t in tensor_args(args, kwargs) if tr.taints.get(t) and t.requires_grad]
    if func is None or op_name(func) != name or not tainted:
        return
    outs = out_tensors(out)
    lays = [tr.layouts.get(o) for o in outs]
    srcs = {t: tr.all_sources(t) for t in tainted}
    if is_inplace(name):  # (no meeting can run an in-place operation again)
        for s in set().union(*srcs.values()):
            s.problem = s.problem or f"the in-place '{name}' writes the batch into it"
        return
    tr.meetings.append(Meeting(tr, func, name, args, kwargs, tainted, srcs, outs, lays))
    for s in set().union(*srcs.values()):
        s.uses.append(("meet", name))

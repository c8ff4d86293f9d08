"""Rows of the examples picked, ranked, or taken alone, as the long way follows them.

- *coupled*: indices and masks computed across the examples (an expert's capacity counted over
  the batch), and what they select (:func:`follow_coupled`);
- *ranked*: the examples' rows in an order computed across the batch (:func:`follow_ranked`);
- *single*: one example taken out of the batch alone, and what is computed from it, joined
  back later (:func:`singles`);
- *positions*: indices of rows that each example's own mask found (:func:`follow_positions`,
  :func:`follow_row_indices`);
- *placed*: rows picked by their place in the batch (``x[:2]``, ``x[i : i + 1]``), and where
  they reached a hooked call or the model's outputs for some examples and not for others
  (:func:`note_placed`, :func:`uneven_placed`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .layout import MIXED, Layout, is_followed, owned, owner_vector, sole_owner
from .ops import output_layout
from .ops.common import arg, carries, norm_dim
from .ops.indexing import regrown_dim
from .ops.names import KEEPS_ROWS_INDEX, PART_OF, PICKS, PRODUCTS
from .ops.pointwise import is_pointwise

if TYPE_CHECKING:
    from .tracker import Tracker

# the functions that find positions of rows where a mask holds
FINDS_ROWS = frozenset({"nonzero", "argwhere", "where"})


@dataclass(frozen=True)
class _Positions:
    """An index of positions along the examples' dimension that each example's own mask
    found (:func:`follow_positions`): ``base``, the layout of the dimension it indexes;
    ``lineage``, the ids of the inputs taken as holding the examples by their size alone that
    the mask came from (:attr:`Tracker.lineage`)."""

    base: Layout
    lineage: frozenset[int]


# what keeps every entry of an index of positions, and only those (see follow_positions)
_RESHAPES_POSITIONS = frozenset(
    """view reshape flatten ravel squeeze unsqueeze contiguous clone detach expand expand_as
    __getitem__ to long int""".split()
)


_INDEX_DTYPES = frozenset({torch.int64, torch.int32})


# the operations whose masks computed across the examples keep, where all ones, every entry for
# an example alone too (see all_ones)
_RUNNING_COUNTS = frozenset({"cumsum", "all"})  # (see follow_row_indices)


def all_ones(tr: Tracker, name: str, ins: list) -> set[int]:
    """The ids of the operands of a product that are a mask computed across the examples
    (:func:`follow_coupled`) from a running count along them (``cumsum``: NLLB-MoE's expert
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
        if t in tr.coupled and tr.coupled[t] in _RUNNING_COUNTS and not carries(t)
        and bool((t == 1).all())
    }  # fmt: skip


def follow_coupled(tr: Tracker, name: str, args, ins: list, outs: list, result: Any) -> Any:
    """Indices and masks computed across the examples (which tokens an expert keeps under
    a capacity counted over the whole batch, ``cumsum`` along it) are followed as
    *coupled*: what they select for one example depends on the others. Rows picked from
    the batch by one are refused (mixed: the per-example computation would pick other
    rows); one that picks along another dimension (which expert, from the experts any
    token chose) only selects, and its result is not coupled."""
    found = [tr.coupled[t] for t in ins if t in tr.coupled] if tr.coupled else []
    if not found:
        return result
    if width_only(tr, name, args, ins, outs):
        return result
    lays = result if isinstance(result, list) else [result]
    picks = name in PICKS and args and isinstance(args[0], Tensor)
    if picks:
        x_lay = tr.layout(args[0])
        fresh = [
            lay for lay in lays
            if isinstance(lay, Layout) and lay.owners is not None
            and (x_lay is None or x_lay.owners is None or lay.owners != x_lay.owners)
        ]  # fmt: skip
        index_only = args[0] not in tr.coupled
        if (
            fresh
            and index_only
            and not (tr.used and tr.used[-1].soft)
            and all(permutes(tr, x_lay, lay) for lay in fresh)
        ):  # (inside a module without a rule, its fallback recomputes it per example)
            return result  # (the examples sorted by their data: see follow_ranked)
        if fresh and index_only:
            tr.mixed.setdefault(
                f"{name} picking rows by an index computed across the batch "
                f"({', '.join(dict.fromkeys(found))}: an expert capacity counted over the "
                "batch?)",
                None,
            )
            return MIXED
        if index_only and all(isinstance(lay, Layout) and lay.dim >= 0 for lay in lays):
            return result  # (a coupled index along another dimension: selects only)
    elif is_pointwise(name) and any(carries(o) for o in outs) and masks_rows(tr, ins, outs):
        tr.mixed.setdefault(
            f"{name} picking rows by a mask computed across the batch ({found[0]})", None
        )
        return MIXED
    for o in outs:
        tr.coupled[o] = found[0]
    return result


def width_only(tr: Tracker, name: str, args, ins: list, outs: list) -> bool:
    """A one-hot encoding (``F.one_hot(index, n)``) of an index computed from each example
    alone, whose number of classes ``n`` alone was computed across the batch (``max(index.
    max() + 2, capacity)``: the "safe one-hot" of mixture-of-experts gates), then cut to a
    constant width along its classes (``[..., :capacity]``): each entry is ``index == j``,
    whatever ``n`` (no smaller than the cut), as it is for an example alone. Uncut, its
    width is the batch's: coupled (:attr:`.Tracker.wide`), as it was."""
    if name == "one_hot":
        if len(outs) != 1 or not isinstance(args[0], Tensor) or args[0] in tr.coupled:
            return False
        tr.wide[outs[0]] = True
        return False
    if name != "__getitem__" or len(args) < 2 or len(outs) != 1 or args[0] not in tr.wide:
        return False
    x, index, out = args[0], args[1], outs[0]
    if any(t is not x and t in tr.coupled for t in ins):
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


def singles(tr: Tracker, name: str, args, kwargs, ins: list, outs: list) -> Layout | None:
    """An operation on examples taken out of the batch alone (:attr:`.Tracker.single`): where every
    tensor with examples among its inputs is one, of the same example (``f(x[i])``, the
    rows of ``x.unbind(0)`` each through ``f``), its outputs are that example's alone
    (mixed, for what reads them as a batch; returned ``MIXED``); where it stacks them
    (``torch.stack(rows)``, ``torch.cat`` of each with a dimension of one), the result holds
    each along the stacked dimension, as rows of those examples (the batch itself, in
    order, where it is every one of them in turn). ``None``: neither (mixed, as it was)."""
    laid = [t for t in ins if tr.layout(t) is not None]
    if not laid:
        return None
    if any(t not in tr.single for t in laid):
        return _with_own_rows(tr, name, args, kwargs, laid, outs)
    found = [tr.single[t] for t in laid]
    base = found[0][1]
    if any(lay != base for _, lay in found):
        return None
    if name == "pad_sequence":  # (as stack: each sequence a row, padded to the longest)
        tensors = arg(args, kwargs, 0, "sequences")
        o = outs[0] if len(outs) == 1 else None
        if o is None or not isinstance(tensors, list | tuple) or len(tensors) != len(laid):
            return None
        d = 0 if arg(args, kwargs, 1, "batch_first", False) else 1
        rows = torch.tensor([tr.single[t][0] for t in tensors], device=o.device)
        tr.rejoined += 1
        return owned(d, rows, base.at(d), tr.batch, placed=True)
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
                tr.single[o] = found[0]
            return MIXED
        rows = torch.tensor([tr.single[t][0] for t in tensors], device=o.device)
        tr.rejoined += 1
        return owned(d, rows, base.at(d), tr.batch, placed=True)
    if len({b for b, _ in found}) != 1:
        return None  # (two examples combined)
    if len(laid) == 1 and len(outs) == 1:
        d = regrown_dim(name, args, kwargs, laid[0], outs[0])
        if d is not None:  # (x[i].unsqueeze(0): that example as a batch of one)
            rows = torch.tensor(found[0][:1], device=outs[0].device)
            tr.rejoined += 1
            return owned(d, rows, base.at(d), tr.batch, placed=True)
    for o in outs:
        tr.single[o] = found[0]
        if laid[0] in tr.alone:
            tr.alone[o] = tr.alone[laid[0]]
    return MIXED


def _with_own_rows(tr: Tracker, name: str, args, kwargs, laid: list, outs: list) -> Any:
    """:func:`singles` of an elementwise operation on one example's tensors taken out alone
    and on rows of that same example alone picked from the batch (``x[i : i + 1] * mask[i]``:
    the example's own mask on its own rows): the layout of those rows, as where the taken-out
    tensors were constants of that example's computation; ``None`` otherwise."""
    alone = {tr.single[t][0] for t in laid if t in tr.single}
    rows = [tr.layout(t) for t in laid if t not in tr.single]
    if len(alone) != 1 or len(outs) != 1 or not is_pointwise(name):
        return None
    if sole_owner(rows) != next(iter(alone)):
        return None
    found = output_layout(
        name, args, kwargs, outs[0],
        lambda t: None if isinstance(t, Tensor) and t in tr.single else tr.layout(t),
        tr.batch,
    )  # fmt: skip
    if not isinstance(found, Layout) or not is_followed(found) or found.owners is None:
        return None
    return found if sole_owner([found]) == next(iter(alone)) else None


def one_examples(tr: Tracker, ins: list) -> tuple[int, Layout] | None:
    """``(example, layout it was picked from)`` where every tensor among ``ins`` that holds
    examples holds rows picked from the batch of that one example alone
    (:func:`~.layout.sole_owner`); ``None`` otherwise."""
    lays = [tr.layout(t) for t in ins]
    example = sole_owner(lays)
    if example is None:
        return None
    lay = next(lay for lay in lays if lay is not None)
    base = lay.owners.base
    return example, (base if base is not None and base.owners is None else Layout(lay.dim))


def permutes(tr: Tracker, before: Layout | None, after: Any) -> bool:
    """Whether ``after`` (a layout) holds the rows of ``before`` in any order: each
    example as many times as there, or, where a reshape merged or split them, in the same
    proportion (not a part of them: a cut, a row dropped or repeated)."""
    if not is_followed(before) or not is_followed(after):
        return False
    a = torch.bincount(owner_vector(before, tr.batch, "cpu"), minlength=tr.batch)
    b = torch.bincount(owner_vector(after, tr.batch, "cpu"), minlength=tr.batch)
    if a.shape != b.shape:
        return False
    return torch.equal(a * int(b.sum()), b * int(a.sum()))


def follow_ranked(tr: Tracker, name: str, args, ins: list, outs: list, result: Any) -> Any:
    """Rows of the examples in an order computed across the batch (``x[idx]`` with ``idx =
    x.norm(dim=1).argsort()``, the sorted-by-length trick of packed recurrent code; an
    index computed across the batch, :func:`follow_coupled`, that permutes the rows): each row
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
    src = next((t for t in ins if t in tr.ranked), None)
    index = ref = None
    if x is not None and name in PICKS and x not in tr.coupled:
        index = next((t for t in ins if t is not x and t in tr.coupled), None)
        # (the rows picked from x, or, written into a tensor without examples, out[idx] =
        # s, the rows written)
        ref = tr.layout(x) if tr.layout(x) is not None else tr.layout(src)
    if (
        index is not None
        and found
        and not (tr.used and tr.used[-1].soft)
        and all(permutes(tr, ref, lay) for lay in found)
    ):
        if all(lay.owners is None for lay in found):
            # (put back in the batch's order; or an index computed across the batch that
            # keeps every row in place, as a capacity that drops nothing does: the batch)
            return result
        why = tr.ranked.get(x) or (f"an index computed across the batch ({tr.coupled[index]})")
        for o, lay in zip(outs, lays):
            if is_followed(lay):
                tr.ranked[o] = why
        return result
    if src is None:
        return result
    why, before = tr.ranked[src], tr.layout(src)
    mixing = None
    for o, lay in zip(outs, lays):
        if lay is MIXED and carries(o):
            mixing = f"{name} of the rows ordered by {why}"
            break
        if not is_followed(lay):
            continue
        if not permutes(tr, before, lay):
            mixing = f"{name} of part of the rows ordered by {why}"
            break
        d = lay.dim
        for t in ins:  # (a tensor without examples laid along the rows: one per place)
            k = d - o.dim() + t.dim()
            if (
                tr.layout(t) is None
                and not (t is x and name in PICKS)  # (what an index reads or writes into)
                and 0 <= k < t.dim()
                and t.shape[k] == o.shape[d] > 1
                and id(t) not in tr.params
                and not isinstance(t, torch.nn.Parameter)
                and not bool((t == t.narrow(k, 0, 1)).all())  # (zeros: a start state)
            ):
                mixing = f"{name} of a tensor along the rows ordered by {why}"
                break
        if mixing:
            break
    if mixing is not None:
        tr.mixed.setdefault(tr.in_call(mixing), None)
        return MIXED
    for o, lay in zip(outs, lays):
        if is_followed(lay):
            tr.ranked[o] = why
    return result


def masks_rows(tr: Tracker, ins: list, outs: list) -> bool:
    """Whether an elementwise operation applies a coupled mask (:func:`follow_coupled`, without
    a gradient) along the examples of an operand: one entry per example, which of them it
    keeps decided across the batch (the tokens an expert keeps under a capacity counted
    over it, the example with the largest score), or one for the whole batch (a count over
    it against a threshold). An operand with a gradient is no mask:
    the rows an expert computed from the tokens routed to it, weighted by their router
    scores."""
    o = outs[0]
    for x in ins:
        lay = tr.layout(x)
        if not is_followed(lay) or x in tr.coupled or lay.size(tr.batch) < 2:
            continue
        d = lay.dim + o.dim() - x.dim()  # (the examples' dimension in the output)
        for t in ins:
            k = d - o.dim() + t.dim()
            if (
                t in tr.coupled
                and not t.requires_grad  # (a mask: the rows an expert computed are not)
                and not is_followed(tr.layout(t))
            ):
                if k >= 0 and t.shape[k] == o.shape[d]:
                    return True
                if t.numel() == 1 and not t.is_floating_point():
                    # (one switch for the whole batch, decided across it: it keeps every
                    # example or none, where an example alone would decide for itself)
                    return True
    return False


def follow_positions(tr: Tracker, name: str, args, kwargs, outs: list, writes: bool) -> None:
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
    if name in FINDS_ROWS:
        mask = args[0] if args else kwargs.get("input")
        lay = tr.layout(mask)
        if (
            (name != "where" or len(args) == 1)
            and isinstance(mask, Tensor)
            and mask.dim() == 1
            and lay is not None
            and lay.dim == 0
            and lay.owners is None
            and mask not in tr.coupled
            and mask not in tr.reordered
        ):
            found = _Positions(lay, tr.lineage.get(mask, frozenset()))
            for o in outs:
                if o.dtype in _INDEX_DTYPES:
                    tr.positions[o] = found
        return
    x = args[0] if args and isinstance(args[0], Tensor) else None
    found = tr.positions.get(x) if x is not None and name in _RESHAPES_POSITIONS else None
    if found is not None and name == "__getitem__":
        items = args[1] if len(args) > 1 and isinstance(args[1], tuple) else args[1:]
        if not all(i is None or i is Ellipsis or isinstance(i, int | slice) for i in items):
            found = None
    if found is not None:
        for o in outs:
            if o.dtype in _INDEX_DTYPES and (
                o.numel() == x.numel() or name in ("expand", "expand_as")
            ):
                tr.positions[o] = found
        return
    written = [o for o in outs if o.dtype in _INDEX_DTYPES and o.numel()] if writes else ()
    if written:  # (idx.add_(1), idx[0] = 3: it and every view of it hold other values)
        ptrs = {o.untyped_storage().data_ptr() for o in written}
        for t, _ in tr.positions.items():
            if t.numel() and t.untyped_storage().data_ptr() in ptrs:
                del tr.positions[t]


def positions_base(tr: Tracker, t: Any) -> Layout | None:
    """The layout of the dimension whose positions the index ``t`` holds (:func:`follow_positions`),
    or ``None``. Where its mask came from inputs taken as holding the examples by their
    size alone (:attr:`.Tracker.candidates`), those are held so from now on
    (:attr:`.Tracker.joined`)."""
    found = tr.positions.get(t) if isinstance(t, Tensor) else None
    if found is None or any(c not in tr.candidates.entries for c in found.lineage):
        return None  # (none, or a mask of inputs taken as shared since: fixed positions)
    tr.joined |= found.lineage
    return found.base


def follow_row_indices(tr: Tracker, name: str, args, ins: list, outs: list) -> None:
    """Follow the positions of rows that ``nonzero`` (``torch.where(mask)``) finds in a
    tensor with examples (the tokens routed to an expert): kept through reshapes,
    concatenation and arithmetic; a part of them taken by position (``tokens[:capacity]``,
    ``narrow``, ``split``) is decided across the batch (the first tokens of the batch, not
    of each example), so it is coupled (see :func:`follow_coupled`)."""
    if name in ("nonzero", "argwhere") or name == "where" and len(args) == 1:
        if any(is_followed(tr.layout(t)) for t in ins):
            for o in outs:
                if not o.is_floating_point():
                    tr.row_index[o] = True
        return
    if not tr.row_index or not any(t in tr.row_index for t in ins):
        return
    x = args[0] if args and isinstance(args[0], Tensor) else None
    if x is not None and x in tr.row_index and name in PART_OF:
        index = args[1] if name == "__getitem__" and len(args) > 1 else None
        items = index if isinstance(index, tuple) else (index,)
        # (a mask or index of the rows' own, weights[tokens] > 0.1, picks per row; one
        # that does not depend on them, arange(n) < capacity, by position)
        if name != "__getitem__" or not all(
            is_followed(tr.layout(i)) or i in tr.row_index
            for i in items if isinstance(i, Tensor)
        ) or not any(isinstance(i, Tensor) for i in items):  # fmt: skip
            if any(o.numel() < x.numel() for o in outs):
                for o in outs:
                    tr.coupled[o] = f"{name} of the rows an index picked"
                return
    if name in KEEPS_ROWS_INDEX or is_pointwise(name) or name == "__getitem__":
        for o in outs:
            if not o.is_floating_point():
                tr.row_index[o] = True


@dataclass
class Placed:
    """What rows picked by their place in the batch (:attr:`.layout.Owners.placed`) reached
    at one hooked module, or at the model's outputs: ``where`` and ``shapes``, as a refusal
    quotes them (those of its first such call); ``counts[b]``, in how many of its calls (or
    of the outputs) example ``b``'s rows were."""

    where: str
    shapes: str
    counts: list[int]


def note_placed(tr: Tracker, key: Any, where: str, shapes: str, layouts) -> None:
    """A hooked call (``key``: its module; ``where``, ``shapes``: as a refusal quotes them)
    on tensors laid out as ``layouts``: count the examples whose rows picked by their place
    in the batch it was given (see :func:`uneven_placed`)."""
    found: set[int] = set()
    for lay in layouts:
        if lay is not None and lay.owners is not None and lay.owners.placed:
            found.update(lay.owners.rows.unique().tolist())
    if not found:
        return
    record = tr.placed.get(key)
    if record is None:
        record = tr.placed[key] = Placed(where, shapes, [0] * tr.batch)
    for b in found:
        record.counts[b] += 1


# what reads a tensor's value into Python, where the forward's own code may branch on it
READS_VALUE = frozenset({"__bool__", "item", "__int__", "__float__", "__index__", "tolist"})


def note_decided(tr: Tracker, name: str, t: Tensor) -> None:
    """A value read into Python from ``t`` by ``name`` (:data:`READS_VALUE`): where ``t`` holds one
    example's values alone (its rows picked by their place in the batch, ``x[i : i + 1]``,
    or taken out alone, ``x[i]``, and what was computed from those alone), that example is
    one whose own values the forward may have decided on (:attr:`.Tracker.decided`; see
    :func:`uneven_placed`)."""
    lay = tr.layouts.get(t)
    if lay is MIXED:
        found = tr.single.get(t) if tr.single.entries else None
        example = None if found is None else found[0]
    else:
        example = sole_owner((lay,)) if lay is not None and lay.owners is not None else None
    if example is not None:
        how = _READ_AS.get(name, name)
        tr.decided.setdefault(int(example), f"{how} of a tensor of shape {tuple(t.shape)}")


_READ_AS = {"__bool__": "bool() (an if)", "__int__": "int()", "__float__": "float()",
            "__index__": "an index", "item": ".item()", "tolist": ".tolist()"}  # fmt: skip


def uneven_placed(tr: Tracker, outputs: list, where: str) -> str | None:
    """Why the forward cannot be split into examples, where rows picked by their place in the
    batch reached a hooked module (:func:`note_placed`), or the model's outputs (``outputs``:
    those with a gradient; ``where``: the model, as a refusal quotes it), for some examples
    and not for others: ``lin(x[:2])``, ``lin(x[0:1].expand(B, -1))``, ``[head(x[i : i + 1])
    for i in range(2)]``, ``lin(x)[:2]`` returned. A per-example loop runs the model on each
    example alone, a batch of one, in which every example stands where the first does; in
    the batch, what each example gets would depend on where it stands. A loop over every
    example alike (``for i in range(len(x))``), splits or chunks each given the same layers,
    reach every example, and are the loop's, also where a chunk cuts across an example's rows
    (NeRF's ``batchify`` of every ray's points: that example in two calls, the others in one)
    or an example's rows are repeated as many times as its own data says (Segment Anything's
    decoder, once per prompt); so does a loop whose code
    decides from each example's own values what to run on it (``a(xi) if xi.sum() > 0 else
    b(xi)``), which the per-example loop decides alike: where the forward read into Python
    values of every example alone (:attr:`.Tracker.decided`), what is uneven is taken as so
    decided. Values of some examples alone read, and not of the others
    (``h[:, : int(ids[0, 0])]``, ``torch.narrow(h, 1, 0, n)`` with ``n = ids[0].sum().item()``:
    a bound, a size or a branch that one example's values decide for the whole batch, where
    the per-example loop lets each decide its own), is refused too. ``None`` where nothing is
    uneven."""
    if len(tr.decided) == tr.batch:
        return None
    if tr.decided:
        said = "; ".join(f"example {b}: {how}" for b, how in sorted(tr.decided.items())[:4])
        return (
            f"{where}: its forward read into Python values of some examples alone, and of no "
            f"other ({said}), so a slice bound, a size or a branch taken from them decides "
            "for the whole batch, where a per-example loop lets each example decide its own "
            "(per-example gradients of this forward do not exist). Keep such a value a tensor "
            "that each example's rows use (a mask of each example's own length, "
            "torch.arange(T) < lengths[:, None]), read it from every example alike (a loop "
            "over the whole batch), or read it outside the model."
        )
    if outputs:
        note_placed(tr, None, where, ", ".join(str(tuple(t.shape)) for t in outputs),
                    [tr.layout(t) for t in outputs])  # fmt: skip
    for key, record in tr.placed.items():
        if min(record.counts) > 0 or max(record.counts) == 0:
            continue
        by_count: dict[int, list[int]] = {}
        for b, n in enumerate(record.counts):
            by_count.setdefault(n, []).append(b)
        said = "; ".join(
            f"{_examples(bs)}: {n if n else 'no'} {'call' if n == 1 else 'calls'}"
            if key is not None
            else f"{_examples(bs)}: in {n if n else 'no'} {'output' if n == 1 else 'outputs'}"
            for n, bs in sorted(by_count.items(), reverse=True)
        )
        what = "its input" if key is not None else "its output"
        return (
            f"{record.where}: {what} ({record.shapes}) holds rows picked from the batch by their "
            "place in it (a slice or split of the batch, one example's rows expanded or given "
            "their batch dimension back), and the forward gives such rows there for some "
            f"examples and not for others ({said}). Per example, what the model "
            "computes then depends on where the example stands in the batch: a per-example "
            "loop runs the model on each example alone, where every example stands first, so "
            "per-example gradients of this forward do not exist. Give every example the same "
            "computation (a layer on the whole batch, or a loop over every example: for i in "
            "range(len(x)): f(x[i : i + 1])), or compute what needs fixed positions outside "
            "the model."
        )
    return None


def _examples(bs: list[int]) -> str:
    """``bs`` (example indices) as a refusal says them: ``example 0``, ``examples 1, 2, 3``,
    the first eight and how many more."""
    more = f" and {len(bs) - 8} more" if len(bs) > 8 else ""
    return ("example " if len(bs) == 1 else "examples ") + ", ".join(map(str, bs[:8])) + more

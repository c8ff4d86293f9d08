"""Indexing: ``x[index]``, ``x[index] = v``, gather, scatter, index_select and the like."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..layout import (
    FREE,
    MIXED,
    REORDER,
    UNKNOWN,
    Layout,
    owned,
    owner_dim,
    owner_map,
    owner_vector,
    slice_layout,
    slice_rows,
)
from .common import HANDLERS, NeedsBatch, arg, first_tensor, handles, norm_dim, tensor_args
from .pointwise import pointwise


@handles("gather", "take_along_dim", "index_select", "scatter", "scatter_add", "scatter_reduce",
          "index_add", "index_copy", "index_fill", "index_put", "gather_", "scatter_",
          "scatter_add_", "scatter_reduce_", "index_add_", "index_copy_", "index_fill_",
          "index_put_", "masked_select")  # fmt: skip
def indexed(args, kwargs, out, layout_of):
    """Indexing along one dimension: a layout of the indexed tensor stays if the indexing is
    along another dimension (and any index or source tensor shares it)."""
    x = args[0]
    o = first_tensor(out)
    if o is None or not isinstance(x, Tensor):
        return UNKNOWN
    n = x.dim()
    dim = arg(args, kwargs, 1, "dim")
    if not isinstance(dim, int):  # take_along_dim(x, idx, dim), index_put(x, indices, v)
        dim = arg(args, kwargs, 2, "dim")
    found = None
    for t in tensor_args(args, kwargs):
        lay = layout_of(t)
        if lay is None:
            continue
        if lay is UNKNOWN or t.dim() != n:
            return UNKNOWN
        if isinstance(dim, int) and lay.dim == norm_dim(dim, n):
            if _permutes(args, kwargs, x.shape[lay.dim]) and t is x:
                return REORDER  # (the examples reordered, as sorting for packing does)
            return MIXED  # gathered or scattered along the examples
        if found not in (None, lay):
            return UNKNOWN
        found = lay
    if found is None or o.dim() != n:
        return UNKNOWN
    return found


def is_permutation(index: Any, size: int) -> bool:
    """Whether ``index`` is a 1-D integer tensor holding ``0, ..., size - 1`` in some order."""
    if not isinstance(index, Tensor) or index.dim() != 1 or index.numel() != size:
        return False
    if index.dtype in (torch.bool, torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return False
    return torch.equal(index.sort().values, torch.arange(size, device=index.device))


def reorder_of(name: str, args: tuple, kwargs: dict) -> tuple[int, Tensor] | None:
    """The dimension and the index of ``x[index]`` (dimension 0) or ``index_select(x, dim,
    index)``, the operations that reorder the examples by a permutation; ``None`` for
    another."""
    if name == "__getitem__" and len(args) > 1:
        index = args[1][0] if isinstance(args[1], tuple) and args[1] else args[1]
        return (0, index) if isinstance(index, Tensor) else None
    if name == "index_select" and args and isinstance(args[0], Tensor):
        dim, index = arg(args, kwargs, 1, "dim"), arg(args, kwargs, 2, "index")
        if isinstance(dim, int) and isinstance(index, Tensor):
            return norm_dim(dim, args[0].dim()), index
    return None


def puts_back(order: tuple[int, Tensor], name: str, args: tuple, kwargs: dict) -> bool:
    """Whether ``name`` on ``args`` puts the rows of ``args[0]``, reordered along dimension
    ``order[0]`` by the permutation ``order[1]`` (``x[perm]``), back in their order:
    ``x[perm][perm.argsort()]``, the composition of the two the identity."""
    found = reorder_of(name, args, kwargs)
    if found is None or found[0] != order[0]:
        return False
    (dim, index), perm, x = found, order[1], args[0]
    if x.dim() <= dim or x.shape[dim] != perm.numel() or not is_permutation(index, perm.numel()):
        return False
    arange = torch.arange(perm.numel(), device=index.device)
    return torch.equal(perm.to(index.device)[index], arange)


def _permutes(args, kwargs, size: int) -> bool:
    """``index_select(x, dim, index)`` (three arguments: nothing written) with ``index`` a
    permutation of the batch."""
    if len(args) + len(kwargs) != 3:
        return False
    return is_permutation(arg(args, kwargs, 2, "index"), size)


def ranges_as_lists(index: Any) -> Any:
    """``index`` with each ``range`` among its items made a list: torch indexes by a range as
    by the list of its values (``q[range(len(q)), actions]``, each row's own entry, is
    ``q[list(range(len(q))), actions]``)."""
    if isinstance(index, range):
        return list(index)
    if isinstance(index, tuple):
        return tuple(list(i) if isinstance(i, range) else i for i in index)
    return index


def _getitem(args, kwargs, out, layout_of, batch):
    x, index = args[0], ranges_as_lists(args[1])
    lay = layout_of(x)
    o = first_tensor(out)
    if o is None:
        return UNKNOWN
    if lay is None:  # a batch-free tensor indexed by one with a layout (a lookup)
        items = index if isinstance(index, tuple) else (index,)
        found = [layout_of(i) for i in items if isinstance(i, Tensor) and layout_of(i)]
        if len(found) == 1 and len(items) == 1 and found[0].dim >= 0:
            mask = items[0]
            if mask.dtype == torch.bool:  # (the rows a mask with examples picks: theirs)
                with torch.no_grad():
                    rows = owner_map(mask, found[0], batch).expand(mask.shape)[mask]
                return owned(0, rows, found[0], batch) if o.dim() >= 1 else UNKNOWN
            return found[0]
        if found and _one_value(x):
            return FREE  # (entries of zeros_like(h), whichever an index picks: zeros)
        return UNKNOWN
    if lay.dim < 0:
        return lay
    where = index_map(x, lay, index, o)
    if where is None and lay.dim == 0 and lay.plain:
        where = _masked_rows(x, index, o)
    if (
        where is None
        and lay.dim == 0
        and lay.plain
        and is_permutation(index[0] if isinstance(index, tuple) and index else index, x.shape[0])
    ):
        # (the examples reordered, x[perm]: each row still one example's, followed as the
        # rows an index picks, and put back in order by x[perm][perm.argsort()])
        found = _picked(x, lay, index, o, batch, whole=True) or MIXED
        if found.owners is not None:
            found.owners.shuffled = True
        return found
    if where is None:
        where = _picked(x, lay, index, o, batch, _example_masks(index, layout_of))
    return where if where is not None else MIXED


HANDLERS["__getitem__"] = NeedsBatch(_getitem)


def _one_value(x: Tensor) -> bool:
    """Whether ``x``, a tensor that does not depend on the examples, takes no gradient and holds
    one value in every entry (``results = torch.zeros_like(h)``): whichever entries an index
    picks from it (``results[batch_idx] += ...``, Mixtral's reference mixture of experts), even
    one that depends on the examples, hold that value, for the batch as for each example
    alone."""
    if x.requires_grad or x.numel() == 0:
        return False
    with torch.no_grad():
        return bool((x == x.reshape(-1)[0]).all())


def _index_items(index: Any) -> list | None:
    """The items of an index of integer or boolean tensors, ints, slices, ``None`` and
    ``...`` (``None``: another kind of index)."""
    items = list(index) if isinstance(index, tuple) else [index]
    for i in items:
        if isinstance(i, Tensor):
            if i.is_floating_point() or i.is_complex() or i.requires_grad:
                return None
        elif not (i is None or i is Ellipsis or isinstance(i, int | slice)):
            return None
    return items


def _tensor_dims(items: list, n: int) -> set[int]:
    """The dimensions of a tensor of ``n`` dimensions that the index tensors among ``items``
    index."""
    widths = [i.dim() if isinstance(i, Tensor) and i.dtype == torch.bool else
              0 if i is None or i is Ellipsis else 1 for i in items]  # fmt: skip
    found, src = set(), 0
    for i, w in zip(items, widths):
        if i is Ellipsis:
            src += n - sum(widths)
        elif isinstance(i, Tensor):
            found |= set(range(src, src + w))
        src += w
    return found


def _example_masks(index: Any, layout_of) -> bool:
    """Whether ``index`` is, or holds, boolean masks only, each computed from the examples
    themselves (its entries on dimension 0 the batch's: ``task == 0`` of a task-id input),
    not fixed positions in the batch."""
    items = index if isinstance(index, tuple) else (index,)
    masks = [i for i in items if isinstance(i, Tensor)]
    return bool(masks) and all(
        m.dtype == torch.bool and (lay := layout_of(m)) is not None and lay.dim == 0 and lay.plain
        for m in masks
    )


def _picked(
    x: Tensor, lay: Layout, index: Any, o: Tensor, batch: int, example_masks: bool = False,
    whole: bool = False,
) -> Layout | None:  # fmt: skip
    """``x[index]`` where the index picks entries along the examples' dimension (rows routed to
    an expert, ``h[top_x]``, ``h[None, top_x]``, ``h[mask]``): where every row of the result
    belongs to one example, an :class:`Owners` layout saying which (``None`` otherwise).
    Whole examples are picked only by ``example_masks`` (rows routed to a task's head by a
    mask of the task ids), or by a permutation of them (``whole``, ``x[perm]``): a batch cut
    to fixed positions or an index is another batch."""
    items = _index_items(index)
    if items is None or not any(isinstance(i, Tensor) for i in items):
        return None
    if lay.plain and _tensor_dims(items, x.dim()) == {lay.dim} and not example_masks and not whole:
        return None  # (whole examples picked: the batch itself changed, x[[1, 0, 0]])
    while items and (
        items[-1] is Ellipsis or isinstance(items[-1], slice) and items[-1] == slice(None)
    ):
        items.pop()  # (trailing dimensions taken whole: their owners are not formed)
    shape = list(x.shape)
    if Ellipsis not in items:
        covered = sum(i.dim() if isinstance(i, Tensor) and i.dtype == torch.bool else
                      0 if i is None else 1 for i in items)  # fmt: skip
        shape[covered:] = [1 if j != lay.dim else n for j, n in
                           enumerate(x.shape[covered:], covered)]  # fmt: skip
    with torch.no_grad():
        owners = owner_map(x, lay, batch).expand(shape)[tuple(items)]
    return owner_dim(owners, o, lay, batch)


def _masked_rows(x: Tensor, index: Any, o: Tensor) -> Layout | None:
    """``x[mask]`` with a boolean ``mask`` over the leading dimensions of ``x``, the batch first
    (the end-of-sequence tokens of each example, the patches not masked out): the rows it picks
    come example by example; where every example has as many, they are ``Layout(0, inner=k)``
    (``None`` otherwise: some examples have more rows than others)."""
    if (
        isinstance(index, tuple)
        and index
        and all(i is Ellipsis or i == slice(None) for i in index[1:])
    ):  # (x[mask, :], x[mask, ...])
        index = index[0]
    if not (isinstance(index, Tensor) and index.dtype == torch.bool and index.dim() >= 1):
        return None
    if tuple(index.shape) != tuple(x.shape[: index.dim()]) or o.dim() < 1:
        return None
    counts = index.reshape(index.shape[0], -1).sum(1)
    batch = index.shape[0]
    if batch == 0 or o.shape[0] != int(counts.sum()) or not bool((counts == counts[0]).all()):
        return None
    k = int(counts[0])
    return Layout(0, inner=k) if k else None


def _setitem(args, kwargs, out, layout_of, batch):
    """``x[index] = value``: ``x`` (the output) keeps its layout where it has one; a batch-free
    ``x`` that takes the examples (a buffer filled with shifted tokens, ``new_zeros`` then
    ``x[:, 1:] = ids[:, :-1]``) takes the layout that ``x[index]`` would give ``value``'s."""
    x, index, value = args[0], args[1], args[2]
    lay, vlay = layout_of(x), layout_of(value) if isinstance(value, Tensor) else None
    if vlay is None:
        return lay  # (batch-free values written: x keeps its layout, or has none)
    if MIXED in (lay, vlay):
        return MIXED
    if lay is not None and lay.dim < 0 or vlay.dim < 0:
        return UNKNOWN
    if vlay.owners is not None or lay is not None and lay.owners is not None:
        return set_rows(x, lay, index, value, vlay, batch)
    with torch.no_grad():
        view = x.detach()[index]  # (the shape x[index] has: a view, or a small copy)
    want = vlay.at(vlay.dim + view.dim() - value.dim())
    if lay is not None:  # each example's values written into its own rows, or not
        if index_map(x, lay, index, view) == want:
            return lay
        # (a mask over the batch and more, y[mask] = f(x[mask]): which example each entry
        # written belongs to, against which owns its place)
        return set_rows(x, lay, index, value, vlay, batch)
    for d in range(x.dim()):
        cand = Layout(d, vlay.outer, vlay.inner)
        if x.shape[d] == cand.size(batch) and index_map(x, cand, index, view) == want:
            return cand
    found = set_rows(x, lay, index, value, vlay, batch)
    return UNKNOWN if found is MIXED else found


HANDLERS["__setitem__"] = NeedsBatch(_setitem)


def _row_candidates(x: Tensor, lay: Layout | None, vlay: Layout, batch: int) -> list[Layout]:
    """Where the examples may be in ``x`` after rows laid out as ``vlay`` are written into it:
    its own layout, or, for a tensor that did not depend on them (``zeros``), the layout the
    rows were picked from, or the plain batch, on any dimension of the right size."""
    if lay is not None:
        return [lay]
    base = vlay.owners.base if vlay.owners is not None else vlay
    found = []
    for d in range(x.dim()):
        for c in (base, Layout(0)):
            if c is None or c.owners is not None or c.dim < 0:
                continue
            cand = Layout(d, c.outer, c.inner)
            if x.shape[d] == cand.size(batch) and cand not in found:
                found.append(cand)
    return found


def set_rows(x: Tensor, lay: Layout | None, index: Any, value: Tensor, vlay: Layout,
              batch: int) -> Layout:  # fmt: skip
    """``x[index] = value`` (or ``index_put_``) where ``value`` or ``x`` holds rows picked by an
    index (tokens put back after their expert): the layout of ``x`` if every entry written
    belongs to the example that owns its place there, else mixed."""
    items = _index_items(index)
    if items is None:
        return MIXED
    with torch.no_grad():
        view = x.detach()[tuple(items)]
        vo = owner_map(value, vlay, batch)
        if vo.dim() > view.dim():
            return MIXED
        vo = vo.reshape((1,) * (view.dim() - vo.dim()) + tuple(vo.shape))
        for cand in _row_candidates(x, lay, vlay, batch):
            got = owner_map(x, cand, batch).expand(x.shape)[tuple(items)]
            if got.dim() == vo.dim() and bool((got == vo).all()):
                return cand
    return MIXED


def _indexed_rows(kind: str, args, kwargs, out, layout_of, batch) -> Layout | None:
    """Indexing along the dimension of rows that are parts of examples (tokens): picked
    (``index_select``, ``gather``: an :class:`Owners` layout), or written back (``index_add_``,
    ``index_copy_``, ``scatter_add_``, ``index_put_``: the layout of the tensor written into,
    where each row lands in its own example's place, else mixed). ``None``: not such an
    operation (the other handlers decide)."""
    x = args[0]
    o = first_tensor(out)
    if not isinstance(x, Tensor) or o is None:
        return None
    xlay = layout_of(x)
    if kind == "put":
        indices = arg(args, kwargs, 1, "indices")
        values = arg(args, kwargs, 2, "values")
        vlay = layout_of(values) if isinstance(values, Tensor) else None
        if vlay is None or vlay.dim < 0 or xlay is not None and xlay.dim < 0:
            return None
        found = set_rows(x, xlay, tuple(indices), values, vlay, batch)
        if found is MIXED and vlay.owners is None and (xlay is None or xlay.owners is None):
            return None  # (the other handlers decide)
        return found
    dim = arg(args, kwargs, 1, "dim")
    index = arg(args, kwargs, 2, "index")
    if not isinstance(dim, int) or not isinstance(index, Tensor) or index.is_floating_point():
        return None
    dim = norm_dim(dim, x.dim())
    if kind == "select" and xlay is None:
        # a table that does not depend on the examples looked up by an index that does (NLLB's
        # sinusoidal positions, weights.index_select(0, position_ids.view(-1))): its rows
        ilay = layout_of(index)
        if ilay is None or ilay.dim != 0 or index.dim() != 1:
            return None
        return ilay.at(dim)
    if kind in ("select", "gather"):
        if xlay is None or xlay.dim != dim:
            return None
        if xlay.owners is None and xlay.inner == 1:
            return None  # (whole examples picked: the batch itself changed)
        with torch.no_grad():
            if kind == "select":
                rows = owner_vector(xlay, batch, x.device)[index.reshape(-1)]
                return owned(dim, rows, xlay, batch)
            owners = owner_map(x, xlay, batch).expand(x.shape).gather(dim, index)
            return owner_dim(owners, o, xlay, batch) or MIXED
    src = arg(args, kwargs, 3, "source" if kind == "add" else "src")
    if src is None and kind == "scatter":
        src = kwargs.get("value")
    slay = layout_of(src) if isinstance(src, Tensor) else None
    if slay is None or slay.dim < 0 or xlay is not None and xlay.dim < 0:
        return None
    if slay.dim != dim and slay.owners is None and (xlay is None or xlay.owners is None):
        return None
    if slay.dim != dim or src.dim() != x.dim():
        return MIXED
    with torch.no_grad():
        if kind == "add":
            vo = owner_vector(slay, batch, x.device)
            for cand in _row_candidates(x, xlay, slay, batch):
                if cand.dim != dim:
                    continue
                got = owner_vector(cand, batch, x.device)[index.reshape(-1)]
                if got.shape == vo.shape and torch.equal(got, vo):
                    return cand
            return MIXED
        part = tuple(slice(0, k) for k in index.shape)
        vo = owner_map(src, slay, batch).expand(src.shape)[part]
        for cand in _row_candidates(x, xlay, slay, batch):
            got = owner_map(x, cand, batch).expand(x.shape).gather(dim, index)
            if torch.equal(got, vo):
                return cand
    return MIXED


def _rows_then(kind: str) -> NeedsBatch:
    def handler(args, kwargs, out, layout_of, batch):
        found = _indexed_rows(kind, args, kwargs, out, layout_of, batch)
        return indexed(args, kwargs, out, layout_of) if found is None else found

    return NeedsBatch(handler)


for _n, _kind in (("index_select", "select"), ("gather", "gather"), ("index_add", "add"),
                  ("index_add_", "add"), ("index_copy", "add"), ("index_copy_", "add"),
                  ("scatter", "scatter"), ("scatter_", "scatter"), ("scatter_add", "scatter"),
                  ("scatter_add_", "scatter"), ("index_put", "put"),
                  ("index_put_", "put")):  # fmt: skip
    HANDLERS[_n] = _rows_then(_kind)


def by_positions(name: str, args, kwargs, out, layout_of, batch: int, base_of) -> Layout | None:
    """Rows picked along the examples' dimension by an index of positions that each example's
    own mask found (``idx = mask.nonzero().squeeze()``, then ``h.index_select(0, idx)``,
    ``h[idx]``, ``h.gather(0, ...)``, ``h.index_fill_(0, idx, v)``: the targets of one cluster
    of an adaptive softmax, the real tokens of a padded batch): each row is its example's, and
    an example alone would pick the same rows, so they are followed as an :class:`Owners`
    layout (the tensor itself, for ``index_fill``). ``base_of(t)``: the layout of the dimension
    whose positions the index ``t`` holds, or ``None`` for another index. ``None``: not such an
    operation (the other handlers decide, and whole examples picked by another index are
    refused there)."""
    if name not in _PICKS_AT_POSITIONS:
        return None
    x = args[0] if args else None
    o = first_tensor(out)
    if not isinstance(x, Tensor) or o is None:
        return None
    lay = layout_of(x)
    if lay is None or lay.dim < 0 or lay.owners is not None:
        return None
    if name == "__getitem__":
        items = _index_items(args[1]) if len(args) > 1 else None
        if items is None:
            return None
        tensors = [i for i in items if isinstance(i, Tensor)]
        if (
            len(tensors) != 1
            or tensors[0].dtype == torch.bool
            or _tensor_dims(items, x.dim()) != {lay.dim}
            or not _same_rows(base_of(tensors[0]), lay)
        ):
            return None
        return _picked(x, lay, args[1], o, batch, example_masks=True) or MIXED
    dim, index = arg(args, kwargs, 1, "dim"), arg(args, kwargs, 2, "index")
    if not isinstance(dim, int) or not isinstance(index, Tensor):
        return None
    if norm_dim(dim, x.dim()) != lay.dim or not _same_rows(base_of(index), lay):
        return None
    with torch.no_grad():
        if name == "index_select":
            rows = owner_vector(lay, batch, x.device)[index.reshape(-1)]
            return owned(lay.dim, rows, lay, batch)
        if name == "gather":  # (the rows along the layout's dimension, even where one)
            owners = owner_map(x, lay, batch).expand(x.shape).gather(lay.dim, index)
            rest = math.prod(n for j, n in enumerate(owners.shape) if j != lay.dim)
            flat = owners.movedim(lay.dim, 0).reshape(owners.shape[lay.dim], rest)
            if o.shape != index.shape or rest == 0:
                return None
            if not bool((flat == flat[:, :1]).all()):
                return MIXED  # (entries of a row from several examples)
            return owned(lay.dim, flat[:, 0], lay, batch)
    value = arg(args, kwargs, 3, "value")
    if isinstance(value, Tensor) and layout_of(value) is not None:
        return None  # (values of the examples written: the other handlers decide)
    return lay  # (a constant written at positions of each example's own)


_PICKS_AT_POSITIONS = frozenset(
    {"__getitem__", "index_select", "gather", "index_fill", "index_fill_"}
)


def _same_rows(base: Layout | None, lay: Layout) -> bool:
    """Whether positions along a dimension laid out as ``base`` are positions of the same
    examples along one laid out as ``lay``."""
    return (
        base is not None
        and base.owners is None
        and (base.outer, base.inner) == (lay.outer, lay.inner)
    )


def _arange_dim(t: Tensor, size: int) -> int | None:
    """The dimension of index tensor ``t`` along which it is ``0, 1, ..., size - 1`` (every
    other dimension of size 1): an index that keeps each example in its place."""
    if t.dtype in (torch.bool, torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return None
    dims = [d for d, n in enumerate(t.shape) if n != 1]
    if len(dims) != 1 or t.shape[dims[0]] != size:
        return (
            None
            if not (size == 1 and t.numel() == 1 and int(t.reshape(())) == 0)
            else (t.dim() - 1 if t.dim() else None)
        )
    flat = t.reshape(-1)
    if not torch.equal(flat, torch.arange(size, device=t.device, dtype=flat.dtype)):
        return None
    return dims[0]


def one_example(name: str, args: tuple, kwargs: dict, lay: Layout | None) -> bool:
    """Whether ``name`` on ``args`` takes one example out of the batch alone, the batch
    dimension ``lay`` (plain) dropped: ``x[i]``, ``x.select(dim, i)``, ``x.unbind(dim)``
    (iteration, ``for xi in x``). Not a slice of the batch (``x[i : i + 1]``, ``split``),
    which keeps the dimension."""
    if lay is None or lay.dim < 0 or not lay.plain or not args or not isinstance(args[0], Tensor):
        return False
    n = args[0].dim()
    if name == "unbind":
        return norm_dim(int(arg(args, kwargs, 1, "dim", 0)), n) == lay.dim
    if name in ("select", "select_copy"):
        return norm_dim(int(arg(args, kwargs, 1, "dim")), n) == lay.dim
    if name != "__getitem__" or len(args) < 2:
        return False
    items = args[1] if isinstance(args[1], tuple) else (args[1],)
    if len(items) <= lay.dim or not all(isinstance(i, slice) for i in items[: lay.dim]):
        return False  # (an index before it moves the dimension: not told apart here)
    i = items[lay.dim]
    if isinstance(i, Tensor):
        return i.dim() == 0 and not i.is_floating_point() and i.dtype is not torch.bool
    return isinstance(i, int | torch.SymInt) and not isinstance(i, bool)


def examples_taken(name: str, args: tuple, kwargs: dict, lay: Layout, outs: int) -> list | None:
    """The example each of the ``outs`` results of ``name`` on ``args`` is, where it takes
    examples out of the batch alone (:func:`one_example`, on the plain layout ``lay``):
    ``x.unbind(dim)``'s in turn, ``x[i]``'s and ``x.select(dim, i)``'s ``i``."""
    n = args[0].shape[lay.dim]
    if name == "unbind":
        return list(range(n)) if outs == n else None
    i = arg(args, kwargs, 2, "index") if name != "__getitem__" else None
    if name == "__getitem__":
        items = args[1] if isinstance(args[1], tuple) else (args[1],)
        i = items[lay.dim]
    if isinstance(i, Tensor):
        i = int(i)
    if not isinstance(i, int) or not -n <= i < n or outs != 1:
        return None
    return [i % n]


# the operations that may give an example taken out of the batch alone its dimension of one
# back (x[i].unsqueeze(0), x[i][None], x[i].view(1, -1)), as x[i : i + 1] keeps it
_REGROWS = frozenset(
    {"unsqueeze", "__getitem__", "view", "reshape", "expand", "unflatten", "view_as",
     "reshape_as", "expand_as", "atleast_2d", "atleast_3d"}
)  # fmt: skip


def regrown_dim(name: str, args: tuple, kwargs: dict, t: Tensor, o: Tensor) -> int | None:
    """The dimension of one that ``name`` adds to ``t`` (an example taken out of the batch
    alone, or computed from one alone) to give ``o``: ``o``'s shape is ``t``'s with a ``1``
    inserted there (``x[i].unsqueeze(0)``: ``0``); ``None`` for any other operation or shape.
    Every entry of ``o`` is that one example's, so the inserted dimension holds it as a batch
    of one (``unsqueeze``'s own ``dim``; the first such position for the others)."""
    if name not in _REGROWS or o.dim() != t.dim() + 1:
        return None
    before, after = tuple(t.shape), tuple(o.shape)
    if name == "unsqueeze":
        d = norm_dim(int(arg(args, kwargs, 1, "dim", 0)), o.dim())
        return d if after[:d] + after[d + 1 :] == before and after[d] == 1 else None
    for d in range(o.dim()):
        if after[d] == 1 and after[:d] + after[d + 1 :] == before:
            return d
    return None


def index_map(x: Tensor, lay: Layout, index: Any, o: Tensor) -> Layout | None:
    """Where ``x[index]`` puts the batch dimension of ``x`` (``None``: the index picks or
    reorders examples)."""
    index = ranges_as_lists(index)
    items = list(index) if isinstance(index, tuple) else [index]
    n = x.dim()

    def width(i) -> int:
        if i is None or i is Ellipsis or isinstance(i, bool):
            return 0
        if isinstance(i, Tensor) and i.dtype == torch.bool:
            return i.dim()
        return 1

    rest = n - sum(width(i) for i in items)
    if any(i is Ellipsis for i in items):
        k = next(j for j, i in enumerate(items) if i is Ellipsis)
        items[k : k + 1] = [slice(None)] * rest
    else:
        items += [slice(None)] * rest
    is_adv = [isinstance(i, Tensor | list) and not isinstance(i, bool) for i in items]
    adv = [j for j, a in enumerate(is_adv) if a]
    tensors = [torch.as_tensor(items[j]) for j in adv]
    if adv:
        if any(t.dtype == torch.bool for t in tensors):
            # a mask: keeps a layout before it (as one dimension of the masked entries)
            first = adv[0]
            src = sum(width(items[j]) for j in range(first))
            if lay.dim < src and all(
                not isinstance(items[j], int) and items[j] is not None for j in range(first)
            ):  # fmt: skip
                return index_map(x, lay, tuple(items[:first]), o)
            return None
        try:
            bshape = torch.broadcast_shapes(*(t.shape for t in tensors))
        except RuntimeError:
            return None
        adjacent = adv == list(range(adv[0], adv[-1] + 1))
    src = dst = 0
    block_done = False
    for j, i in enumerate(items):
        if is_adv[j]:
            t = tensors[adv.index(j)]
            start = dst if adjacent else 0
            if src == lay.dim:  # (an arange over the whole dimension: every entry in place,
                k = _arange_dim(t, x.shape[src])  # also where heads are folded in: Informer)
                if k is None:
                    return None
                return lay.at(start + k + len(bshape) - t.dim())
            src += 1
            if not block_done:
                block_done = True
                if adjacent:
                    dst += len(bshape)
            continue
        if i is None or isinstance(i, bool):
            dst += 1
        elif isinstance(i, int):
            if src == lay.dim:
                return None
            src += 1
        elif isinstance(i, slice):
            if src == lay.dim:
                shift = len(bshape) if adv and not adjacent else 0
                span = i.indices(x.shape[src])
                blocks = slice_layout(lay, x.shape[src], *span)
                if blocks is None:  # (some of the examples: the rows it picks, x[1:3])
                    blocks = slice_rows(lay, x.shape[src], *span, x.device)
                return None if blocks is MIXED else blocks.at(dst + shift)
            src += 1
            dst += 1
        else:
            return None
    return None


@handles("masked_scatter", "masked_scatter_")
def _masked_scatter(args, kwargs, out, layout_of):
    """``x.masked_scatter(mask, source)``: the entries of ``source`` taken in turn, in the order
    of the true entries of the mask over the whole tensor. Where ``source`` holds examples,
    which of them lands where depends on every example's mask: not followed. Else each entry
    is ``x``'s or one of the batch-free ``source``'s: elementwise in ``x`` and ``mask``."""
    source = arg(args, kwargs, 2, "source")
    if isinstance(source, Tensor) and layout_of(source) is not None:
        return UNKNOWN
    return pointwise(args, kwargs, out, layout_of)

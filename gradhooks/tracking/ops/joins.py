"""Concatenation, stacking and splitting."""

from __future__ import annotations

import torch
from torch import Tensor

from ..layout import MIXED, UNKNOWN, Layout, owned, slice_layout, slice_rows, split_rows
from .common import (
    HANDLERS,
    NeedsBatch,
    arg,
    first_tensor,
    handles,
    norm_dim,
    out_tensors,
    single_input,
)


@handles("split", "chunk", "tensor_split", "split_with_sizes", "unsafe_split", "hsplit",
          "vsplit", "unsafe_chunk")  # fmt: skip
def _split(args, kwargs, out, layout_of):
    t, lay = single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN:
        return UNKNOWN
    dim = norm_dim(int(arg(args, kwargs, 2, "dim", 0)), t.dim())
    if dim != lay.dim:
        return lay
    sizes = [o.shape[dim] for o in out_tensors(out)]
    if lay.owners is not None and len(sizes) > 1:
        return split_rows(lay, sizes)
    found, start = [], 0
    for o in out_tensors(out):
        n = o.shape[dim]
        size, stop = t.shape[dim], start + n
        found.append(
            slice_layout(lay, size, start, stop, 1)
            or slice_rows(lay, size, start, stop, 1, t.device)
        )
        start += n
    return found


@handles("unbind")
def _unbind(args, kwargs, out, layout_of):
    t, lay = single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN:
        return UNKNOWN
    dim = norm_dim(int(arg(args, kwargs, 1, "dim", 0)), t.dim())
    return MIXED if dim == lay.dim else lay.at(lay.dim - (dim < lay.dim))


def cat(args, kwargs, out, layout_of, batch):
    tensors = list(arg(args, kwargs, 0, "tensors"))
    o = first_tensor(out)
    if o is None:
        return UNKNOWN
    dim = norm_dim(int(arg(args, kwargs, 1, "dim", 0)), o.dim())
    parts = [t for t in tensors if isinstance(t, Tensor) and t.numel() > 0]  # (empty: no rows)
    lays = [layout_of(t) for t in parts]
    known = [x for x in lays if x is not None]
    firm = [x for x in known if x is not UNKNOWN]
    if not firm or (UNKNOWN in known and dim != firm[0].dim):
        return UNKNOWN
    if dim != known[0].dim:
        return known[0] if all(x == known[0] for x in known) else UNKNOWN
    if any(x.owners is not None for x in firm):
        if len(firm) != len(lays) or any(x.dim != dim for x in firm):
            return MIXED
        return _cat_rows(dim, parts, firm, batch)
    if len(firm) != len(lays) or any(x.inner != known[0].inner for x in known):
        # rows that are not the examples put among them along their dimension: which row is
        # whose is lost, and what is computed across the rows next (a shift, a sum, attention
        # over them) could not be told from what keeps the examples apart
        return MIXED
    return Layout(dim, sum(x.outer for x in known), known[0].inner)


def _cat_rows(dim: int, parts: list[Tensor], lays: list[Layout], batch: int) -> Layout:
    """Rows picked by an index concatenated along their dimension (each expert's outputs in
    turn): their owners in turn, the batch's own layout where they are its rows in order
    (``torch.cat([f(x[:k]), g(x[k:])])``). Another layout among them (the whole batch) is
    mixed: its number of examples is not known here."""
    if any(x.owners is None for x in lays):
        return MIXED
    rows = torch.cat([x.owners.rows for x in lays])
    bases = {x.owners.base for x in lays}
    placed = any(x.owners.placed for x in lays)
    return owned(dim, rows, bases.pop() if len(bases) == 1 else None, batch, placed)


for _n in ("cat", "concat", "concatenate"):
    HANDLERS[_n] = NeedsBatch(cat)


@handles("stack", "hstack", "vstack", "dstack", "column_stack")
def _stack(args, kwargs, out, layout_of):
    tensors = list(arg(args, kwargs, 0, "tensors"))
    o = first_tensor(out)
    lays = [layout_of(t) for t in tensors if isinstance(t, Tensor)]
    known = [x for x in lays if x is not None]
    if o is None or not known or UNKNOWN in known or any(x != known[0] for x in known):
        return UNKNOWN
    first = next(t for t in tensors if isinstance(t, Tensor))
    if o.dim() == first.dim():  # hstack / vstack of >= 2-d: a cat
        return cat((tensors, 0 if o.shape[0] != first.shape[0] else 1), {}, out, layout_of)
    dim = norm_dim(int(arg(args, kwargs, 1, "dim", 0)), o.dim())
    lay = known[0]
    return lay.at(lay.dim + (dim <= lay.dim))

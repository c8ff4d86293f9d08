"""Views and reshapes: where a layout goes when the dimensions move, merge or split."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..layout import MIXED, UNKNOWN, Layout, owned, slice_rows
from .common import HANDLERS, NeedsBatch, arg, first_tensor, handles, norm_dim, single_input


def _reshaped(lay: Layout, before: Sequence[int], after: Sequence[int], batch: int) -> Layout:
    """The layout of a tensor of shape ``before`` viewed as ``after`` (row-major)."""
    inner = lay.inner * math.prod(before[lay.dim + 1 :])
    block = inner * batch
    for e in range(len(after)):  # the outermost dimension that holds the batch whole
        post = math.prod(after[e + 1 :])
        if post > inner:
            continue
        if inner % post == 0 and (after[e] * post) % block == 0:
            return Layout(e, after[e] * post // block, inner // post)
    return UNKNOWN


def _reshaped_rows(lay: Layout, before: Sequence[int], after: Sequence[int], batch: int) -> Layout:
    """:func:`_reshaped` for rows picked by an index (:class:`Owners`): the dimension that
    holds them kept whole (``[1, n, F]`` to ``[n, F]``, ``[n, H * D]`` to ``[n, H, D]``),
    merged with what follows it (``[n, F]`` to ``[n * F]``), or split where each run of rows
    that becomes one entry has one owner (``[n * T, F]`` back to ``[n, T, F]``, after a layer
    ran on the rows and their positions merged); else mixed."""
    d, rows = lay.dim, lay.owners.rows
    outer, inner = math.prod(before[:d]), math.prod(before[d + 1 :])
    for e in range(len(after)):
        post = math.prod(after[e + 1 :])
        if math.prod(after[:e]) != outer or after[e] * post != rows.numel() * inner:
            continue
        if post == 0:
            continue
        if inner % post == 0:
            times = inner // post
            if times > 1 and rows.numel() == 1 and post == 1:
                # (one example's only row made the last dimension, each entry a row: h.squeeze(0)
                # or h.flatten() of x[i : i + 1]'s, that example alone, as h[0] is, which the
                # tracker follows as such; [1, T, F] to [T, F] keeps its rows, each one a step)
                return MIXED
            return owned(e, rows.repeat_interleave(times) if times > 1 else rows,
                          lay.owners.base, batch, lay.owners.placed)  # fmt: skip
        if post % inner == 0:
            runs = rows.view(after[e], post // inner)
            if bool((runs == runs[:, :1]).all()):  # (a value read: picked rows are data)
                return owned(e, runs[:, 0], lay.owners.base, batch, lay.owners.placed)
    return MIXED


def _reshape_like(args, kwargs, out, layout_of, batch):
    t, lay = single_input(args, kwargs, layout_of)
    o = first_tensor(out)
    if t is None or lay is UNKNOWN or o is None:
        return UNKNOWN
    if o.shape == t.shape:
        return lay
    if lay.owners is not None:
        return _reshaped_rows(lay, t.shape, o.shape, batch)
    found = _reshaped(lay, t.shape, o.shape, batch)
    # (no dimension holds each example's entries together: a row of the result has entries of
    # several examples, as h.t().reshape(B, F) or rows regrouped by view(2, B, F) give)
    return MIXED if found is UNKNOWN and lay.dim >= 0 else found


for _n in ("view", "reshape", "view_as", "reshape_as", "flatten", "unflatten", "ravel",
           "squeeze", "unsqueeze", "atleast_1d", "atleast_2d", "atleast_3d", "view_copy",
           "reshape_copy"):  # fmt: skip
    HANDLERS[_n] = NeedsBatch(_reshape_like)


# (in place, the shape before is gone by the time a handler runs: the layout of the tensor is
# that of its shape before; resize_, which reads the storage in another shape, is not followed)


@handles("unsqueeze_")
def _unsqueeze_in_place(args, kwargs, out, layout_of):
    """``x.unsqueeze_(dim)``: a dimension inserted at ``dim`` (counted in the new shape)."""
    t, lay = single_input(args, kwargs, layout_of)
    dim = arg(args, kwargs, 1, "dim")
    if t is None or lay is UNKNOWN or t is not args[0] or not isinstance(dim, int):
        return UNKNOWN
    return lay.at(lay.dim + (norm_dim(dim, t.dim()) <= lay.dim))


@handles("squeeze_")
def _squeeze_in_place(args, kwargs, out, layout_of):
    """``x.squeeze_(dim)``: a layout before ``dim`` stays, whether ``dim`` was removed or not;
    one after it, or ``squeeze_()`` of every dimension of size 1, is not followed."""
    t, lay = single_input(args, kwargs, layout_of)
    dim = arg(args, kwargs, 1, "dim")
    if t is None or lay is UNKNOWN or t is not args[0] or not isinstance(dim, int):
        return UNKNOWN
    # (dim counted in the shape before, of t.dim() or t.dim() + 1 dimensions)
    return lay if (dim if dim >= 0 else dim + t.dim()) > lay.dim else UNKNOWN


def _repeat_interleave(args, kwargs, out, layout_of, batch):
    """``x.repeat_interleave(k, dim)``: along the layout's dimension each entry is repeated
    ``k`` times in place, so every example's entries stay together (``inner`` times ``k``;
    rows picked by an index, each row's owner ``k`` times); along another dimension the
    layout stays. Per-entry counts (a tensor), or no ``dim`` (the input flattened): not
    followed."""
    t, lay = single_input(args, kwargs, layout_of)
    repeats, dim = arg(args, kwargs, 1, "repeats"), arg(args, kwargs, 2, "dim")
    if t is None or lay is UNKNOWN or dim is None or not isinstance(repeats, int):
        return UNKNOWN
    if norm_dim(int(dim), t.dim()) != lay.dim:
        return lay
    if lay.owners is not None:
        rows = lay.owners.rows.repeat_interleave(repeats)
        return owned(lay.dim, rows, lay.owners.base, batch, lay.owners.placed)
    return Layout(lay.dim, lay.outer, lay.inner * repeats)


HANDLERS["repeat_interleave"] = NeedsBatch(_repeat_interleave)


def _expand(args, kwargs, out, layout_of, batch):
    """``x.expand(*sizes)``: the layout's dimension kept (moved by the dimensions put in
    front); one row picked by an index and expanded along it (``x[i : i + 1].expand(k, -1)``),
    that row's owner ``k`` times; any other expansion of it not followed."""
    t, lay = single_input(args, kwargs, layout_of)
    o = first_tensor(out)
    if t is None or lay is UNKNOWN or o is None:
        return UNKNOWN
    d = lay.dim + o.dim() - t.dim()
    if o.shape[d] == t.shape[lay.dim]:
        return lay.at(d)
    if lay.owners is not None and t.shape[lay.dim] == 1:
        rows = lay.owners.rows.expand(o.shape[d])
        return owned(d, rows, lay.owners.base, batch, lay.owners.placed)
    return UNKNOWN


for _n in ("expand", "expand_as", "broadcast_to", "expand_copy"):
    HANDLERS[_n] = NeedsBatch(_expand)


def broadcast_apart(args: tuple, kwargs: dict) -> list[tuple]:
    """``torch.broadcast_tensors(*tensors)`` (``torch.distributions``' ``broadcast_all``) as
    what it is, each tensor expanded to the common shape: ``(func, args, kwargs)`` of each
    output's call. Each output holds its own input's values alone, so a tensor derived from a
    parameter stays apart from the batch it is broadcast with (a policy's ``log_std`` beside
    the batch of means: they meet in the log-probability, not here)."""
    tensors = args[0] if len(args) == 1 and isinstance(args[0], list | tuple) else args
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    return [(Tensor.expand, (t, shape), {}) for t in tensors]


# operations followed as the calls they decompose into (see broadcast_apart)
DECOMPOSED = {"broadcast_tensors": broadcast_apart}


@handles("repeat", "tile")
def _repeat(args, kwargs, out, layout_of):
    t, lay = single_input(args, kwargs, layout_of)
    o = first_tensor(out)
    if t is None or lay is UNKNOWN or o is None:
        return UNKNOWN
    d = lay.dim + o.dim() - t.dim()
    times = o.shape[d] // max(t.shape[lay.dim], 1)
    return Layout(d, lay.outer * times, lay.inner)


@handles("permute")
def _permute(args, kwargs, out, layout_of):
    t, lay = single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN:
        return UNKNOWN
    dims = args[1:] if len(args) > 1 else kwargs.get("dims")
    if len(dims) == 1 and isinstance(dims[0], list | tuple):
        dims = dims[0]
    order = [norm_dim(int(d), t.dim()) for d in dims]
    return lay.at(order.index(lay.dim))


@handles("transpose", "swapaxes", "swapdims", "transpose_", "swapaxes_", "swapdims_")
def _transpose(args, kwargs, out, layout_of):
    t, lay = single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN:
        return UNKNOWN
    n = t.dim()
    d0 = norm_dim(int(arg(args, kwargs, 1, "dim0")), n)
    d1 = norm_dim(int(arg(args, kwargs, 2, "dim1")), n)
    return lay.at({d0: d1, d1: d0}.get(lay.dim, lay.dim))


@handles("t", "t_", ".T", ".H")
def _t(args, kwargs, out, layout_of):
    """``t()`` of a 2-d tensor swaps its dimensions; ``.T`` of an n-d one reverses them."""
    t, lay = single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN:
        return UNKNOWN
    return lay.at(t.dim() - 1 - lay.dim) if t.dim() >= 2 else lay


@handles(".mT", ".mH", "adjoint")
def _mt(args, kwargs, out, layout_of):
    t, lay = single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN:
        return UNKNOWN
    n = t.dim()
    return lay.at({n - 1: n - 2, n - 2: n - 1}.get(lay.dim, lay.dim))


@handles("movedim", "moveaxis")
def _movedim(args, kwargs, out, layout_of):
    t, lay = single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN:
        return UNKNOWN
    n = t.dim()
    src = arg(args, kwargs, 1, "source")
    dst = arg(args, kwargs, 2, "destination")
    src = [src] if isinstance(src, int) else list(src)
    dst = [dst] if isinstance(dst, int) else list(dst)
    src = [norm_dim(s, n) for s in src]
    dst = [norm_dim(d, n) for d in dst]
    order = [None] * n
    for s, d in zip(src, dst):
        order[d] = s
    rest = iter(d for d in range(n) if d not in src)
    order = [next(rest) if o is None else o for o in order]
    return lay.at(order.index(lay.dim))


@handles("diagonal", "diagonal_copy")
def _diagonal(args, kwargs, out, layout_of):
    """``x.diagonal(offset, dim1, dim2)``: the two dimensions go, the diagonal comes last."""
    t, lay = single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN:
        return UNKNOWN
    n = t.dim()
    d1 = norm_dim(int(arg(args, kwargs, 2, "dim1", 0)), n)
    d2 = norm_dim(int(arg(args, kwargs, 3, "dim2", 1)), n)
    if lay.dim in (d1, d2):
        return MIXED  # (the examples' entries paired with another dimension's)
    return lay.at(lay.dim - (d1 < lay.dim) - (d2 < lay.dim))


@handles("narrow", "select", "unfold", "narrow_copy", "select_copy")
def _select(args, kwargs, out, layout_of):
    t, lay = single_input(args, kwargs, layout_of)
    o = first_tensor(out)
    if t is None or lay is UNKNOWN or o is None:
        return UNKNOWN
    n = t.dim()
    dim = arg(args, kwargs, 1, "dim", None)
    if dim is None:  # (Tensor.unfold's keyword)
        dim = kwargs.get("dimension", 0)
    dim = norm_dim(int(dim), n)
    if dim == lay.dim:
        if o.dim() != n:  # (one example taken out of the batch alone, x.select(0, i): no
            return MIXED  # dimension holds it; unfold's windows: several examples each)
        start = int(arg(args, kwargs, 2, "start")) % max(t.shape[dim], 1)  # narrow: its rows
        return slice_rows(lay, t.shape[dim], start, start + o.shape[dim], 1, t.device)
    if o.dim() == n - 1:  # select removes the dimension
        return lay.at(lay.dim - (dim < lay.dim))
    return lay


@handles("view_as_complex", "view_as_real")
def _complex_view(args, kwargs, out, layout_of):
    """``view_as_complex`` drops a last dimension of 2, ``view_as_real`` adds one (rotary
    embeddings as complex products): a layout before it stays."""
    t, lay = single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN or lay.dim >= t.dim() - 1:
        return UNKNOWN
    return lay

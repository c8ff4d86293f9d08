"""Reductions along dimensions, and operations along one dimension (softmax, scans, sorts)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..layout import MIXED, UNKNOWN, Layout, Owners, owned, owner_vector, sole_owner
from .common import (
    HANDLERS,
    Handler,
    NeedsBatch,
    arg,
    handles,
    norm_dim,
    normalized_dims,
    single_input,
    tensor_args,
)
from .pointwise import broadcast, pointwise


def _one_examples_rows(lay: Layout) -> bool:
    """Whether ``lay``'s dimension holds rows picked from the batch, all of one example
    (:func:`~..layout.sole_owner`): an operation along it combines that example's rows alone."""
    return lay.owners is not None and sole_owner((lay,)) is not None


def _dim_op(default_dim: Any, pos: int = 1, name: str = "dim") -> Handler:
    """A shape-keeping operation along ``dim`` (softmax, cumsum, flip): the layout stays, unless
    it works along the batch dimension (it mixes the examples; not rows of one example alone)."""

    def handler(args, kwargs, out, layout_of):
        t, lay = single_input(args, kwargs, layout_of)
        if t is None or lay is UNKNOWN:
            return UNKNOWN
        dims = normalized_dims(arg(args, kwargs, pos, name, default_dim), t.dim())
        if dims is None or lay.dim in dims:
            return lay if _one_examples_rows(lay) else MIXED
        return lay

    return handler


for _n in ("softmax", "log_softmax", "softmin", "cumsum", "cumprod", "logcumsumexp",
           "cummax", "cummin", "sort", "argsort", "glu", "topk", "kthvalue", "msort",
           "special_softmax", "special_log_softmax"):  # fmt: skip
    HANDLERS[_n] = _dim_op(-1 if _n in ("sort", "argsort", "glu", "topk", "kthvalue") else None)
HANDLERS["topk"] = _dim_op(-1, pos=2)
HANDLERS["kthvalue"] = _dim_op(-1, pos=2)
HANDLERS["normalize"] = _dim_op(1, pos=2)
HANDLERS["flip"] = _dim_op(None, name="dims")


def _roll(args, kwargs, out, layout_of, batch):
    """``torch.roll(x, shifts, dims)``: along other dimensions than the examples', the layout
    stays; along theirs, each example's rows move whole to another place, so the rows hold the
    examples in another order (their owners rolled, an :class:`Owners` layout; rolled back,
    ``roll(-shifts)``, the layout they had), whatever the other dimensions rolled with it.
    Flattened first (no ``dims``, of more than one dimension): mixed."""
    t, lay = single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN:
        return UNKNOWN
    shifts, dims = arg(args, kwargs, 1, "shifts"), arg(args, kwargs, 2, "dims")
    if dims is None or (isinstance(dims, list | tuple) and not dims):
        return MIXED if t.dim() != 1 or lay.dim != 0 else _rolled(t, lay, shifts, batch)
    dims = dims if isinstance(dims, list | tuple) else [dims]
    found = [norm_dim(int(d), t.dim()) for d in dims]
    if lay.dim not in found:
        return lay
    moves = list(shifts) if isinstance(shifts, list | tuple) else [shifts]
    if len(moves) != len(found) or found.count(lay.dim) != 1:
        return MIXED
    return _rolled(t, lay, moves[found.index(lay.dim)], batch)


def _rolled(t: Tensor, lay: Layout, shift: Any, batch: int) -> Layout:
    """The layout of ``t`` rolled by ``shift`` along its layout's dimension: each entry still
    one example's (its rows folded with its time steps too, ``[batch * time]``: where a
    reshape then needs them whole, they are not, and it is mixed there)."""
    with torch.no_grad():
        rows = owner_vector(lay, batch, t.device).roll(int(shift))
    return owned(lay.dim, rows, lay, batch)


HANDLERS["roll"] = NeedsBatch(_roll)


@handles("diff")
def _diff(args, kwargs, out, layout_of):
    """``torch.diff(x, n, dim, prepend, append)``: ``x`` with ``prepend`` and ``append``
    joined to it along ``dim`` (their shapes ``x``'s but there), then differenced along it.
    Along another dimension than the examples', each entry is one example's where every
    joined tensor holds the examples where ``x`` does, or none (``x[:, :1]`` prepended: the
    same example's first step). Along theirs, or with another layout: as a join would be,
    mixed or not followed."""
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, Tensor):
        return UNKNOWN
    lay = layout_of(x)
    joined = [arg(args, kwargs, 3, "prepend"), arg(args, kwargs, 4, "append")]
    joined = [layout_of(t) for t in joined if isinstance(t, Tensor)]
    if lay is None or lay is UNKNOWN or any(j is not None and j != lay for j in joined):
        return UNKNOWN if lay is not None or any(j is not None for j in joined) else None
    if lay.dim in normalized_dims(arg(args, kwargs, 2, "dim", -1), x.dim()):
        return MIXED
    return lay


REDUCTIONS = """sum mean nansum nanmean prod amax amin max min std var std_mean var_mean
    logsumexp all any argmax argmin median nanmedian mode count_nonzero norm vector_norm
    aminmax special_logsumexp""".split()


@handles(*REDUCTIONS)
def reduction(args, kwargs, out, layout_of):
    t, lay = single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN:
        return UNKNOWN
    n = t.dim()
    dim = kwargs.get("dim", kwargs.get("axis"))
    if dim is None:
        # positional: norm(input, p, dim), vector_norm(x, ord, dim); else (input, dim)
        for a in args[1:]:
            if (
                isinstance(a, int)
                and not isinstance(a, bool)
                or (isinstance(a, list | tuple) and a and all(isinstance(x, int) for x in a))
            ):
                dim = a
                break
    dims = normalized_dims(dim, n)
    keepdim = kwargs.get("keepdim", False) or any(a is True for a in args[2:])
    if dims is None or lay.dim in dims:
        if dims is not None and keepdim and _one_examples_rows(lay):
            # (rows of one example alone reduced to one row: still that example's)
            rows = lay.owners.rows[:1]
            return Layout(lay.dim, owners=Owners(rows, lay.owners.base, lay.owners.placed))
        return MIXED  # a reduction over the examples
    if keepdim:
        return lay
    return lay.at(lay.dim - sum(1 for d in dims if d < lay.dim))


@handles("max", "min")
def _max_min(args, kwargs, out, layout_of):
    """``max(a, b)`` and ``min(a, b)`` of two tensors are elementwise (``torch.maximum``, as
    XGLM clamps its attention scores with a 0-d tensor); with a ``dim``, or none, a reduction."""
    if isinstance(arg(args, kwargs, 1, "other"), Tensor):
        return pointwise(args, kwargs, out, layout_of)
    return reduction(args, kwargs, out, layout_of)


@handles("quantile", "nanquantile")
def _quantile(args, kwargs, out, layout_of):
    """``quantile(x, q, dim)``: a reduction along ``dim`` (of every entry without one, a
    threshold from the whole batch); a ``q`` of several values puts them on a new first
    dimension."""
    lay = reduction(args, kwargs, out, layout_of)
    q = arg(args, kwargs, 1, "q")
    if lay is MIXED or lay is UNKNOWN or not (isinstance(q, Tensor) and q.dim() > 0):
        return lay
    return lay.at(lay.dim + 1)


def _broadcast_reduced(x1: Any, x2: Any, dim: int, keepdim: bool, layout_of) -> Any:
    """The layout of an elementwise operation of ``x1`` and ``x2`` (broadcast: a batch against
    a table) followed by a reduction along ``dim`` of the broadcast shape."""
    if not (isinstance(x1, Tensor) and isinstance(x2, Tensor)):
        return UNKNOWN
    try:
        shape = torch.broadcast_shapes(x1.shape, x2.shape)
    except RuntimeError:
        return UNKNOWN
    found = broadcast((x1, x2), shape, layout_of)
    if found is None or found is UNKNOWN or found is MIXED:
        return found
    dim = norm_dim(dim, len(shape))
    if found.dim == dim:
        return MIXED  # a reduction over the examples
    return found if keepdim or dim > found.dim else found.at(found.dim - 1)


@handles("cosine_similarity")
def _cosine_similarity(args, kwargs, out, layout_of):
    """``F.cosine_similarity(x1, x2, dim=1)``: along ``dim`` of ``x1`` and ``x2`` broadcast
    (each example's features against a table of prototypes or class vectors)."""
    x1, x2 = arg(args, kwargs, 0, "x1"), arg(args, kwargs, 1, "x2")
    return _broadcast_reduced(x1, x2, arg(args, kwargs, 2, "dim", 1), False, layout_of)


@handles("pairwise_distance")
def _pairwise_distance(args, kwargs, out, layout_of):
    """``F.pairwise_distance(x1, x2, p, eps, keepdim)``: along the last dimension of ``x1``
    and ``x2`` broadcast."""
    x1, x2 = arg(args, kwargs, 0, "x1"), arg(args, kwargs, 1, "x2")
    return _broadcast_reduced(x1, x2, -1, bool(arg(args, kwargs, 4, "keepdim", False)), layout_of)


@handles("histc", "histogram", "histogramdd", "bincount")
def _counts(args, kwargs, out, layout_of):
    """``histc``, ``histogram``, ``histogramdd``, ``bincount``: counts over every entry of
    their input (and of its weights), whatever its shape: across the examples, where any of
    them holds them."""
    for t in tensor_args(args, kwargs):
        lay = layout_of(t)
        if lay is not None and lay is not UNKNOWN:
            return MIXED
    return UNKNOWN


@handles("bucketize")
def _bucketize(args, kwargs, out, layout_of):
    """``bucketize(x, boundaries)``: each entry of ``x`` against every boundary, in ``x``'s
    shape: ``x``'s layout, unless the boundaries hold examples (then every entry is placed
    among the whole batch's)."""
    x, bounds = arg(args, kwargs, 0, "input"), arg(args, kwargs, 1, "boundaries")
    if isinstance(bounds, Tensor) and layout_of(bounds) is not None:
        return MIXED
    lay = layout_of(x) if isinstance(x, Tensor) else None
    return UNKNOWN if lay is None else lay


@handles("searchsorted")
def _searchsorted(args, kwargs, out, layout_of):
    """``searchsorted(seq, values)``: each value's place along the last dimension of ``seq``
    (of the matching row of ``seq`` where it has more than one dimension), in ``values``'
    shape. ``values``' layout where the search stays within each example's rows; across the
    batch (a sequence of one dimension, or whose last is the examples', that holds them)
    mixed."""
    seq, values = arg(args, kwargs, 0, "sorted_sequence"), arg(args, kwargs, 1, "input")
    if not isinstance(values, Tensor):
        return UNKNOWN  # (a scalar searched: a 0-d result)
    lay = layout_of(values)
    held = layout_of(seq) if isinstance(seq, Tensor) else None
    if held is None:
        return UNKNOWN if lay is None else lay
    if held is UNKNOWN or lay is UNKNOWN:
        return UNKNOWN
    if seq.dim() > 1 and held.dim < seq.dim() - 1 and held == lay:
        return lay
    return MIXED

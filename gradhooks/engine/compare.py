"""Gradients held and compared in little memory, for the checks of a backward (:mod:`.verify`,
and the DP step's own check).

A check holds autograd's gradients of every parameter across a backward and compares them with
those the hooks computed. Held as autograd gives them, an embedding's is a whole table of which
the batch touched a few rows; compared as ``(got - want).abs().max()``, each comparison makes two
more tensors of the parameter's size (``torch.isfinite(t).all()`` another). Here:

- :func:`hold`: a gradient as a check keeps it, its rows that hold a nonzero alone (a sparse
  tensor) where they are at most half of them; lossless;
- :func:`largest`: ``max |t|`` (NaN where ``t`` holds one), without a copy of ``t``;
- :func:`largest_difference`: ``max |got - want|``, a slice of rows at a time, ``want`` dense or
  held sparse;
- :func:`norm_of`: ``‖t‖`` of a held gradient; :func:`add_held`: the sum of two;
- :func:`dense`: a held gradient as a plain tensor again.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..errors import UnsupportedInputError

# the entries one step of largest_difference subtracts at a time (4 MiB of float32)
CHUNK = 1 << 20


def hold(g: Tensor | None, copy: bool = False) -> Tensor | None:
    """``g`` as a check holds it until the backward's end: where at most half of its rows
    (along dimension 0) hold a nonzero (an embedding's gradient: the rows of the tokens the
    batch used), a sparse COO tensor of those rows alone (one sparse dimension, coalesced), else
    ``g`` itself (``copy``: a copy of it, for a tensor autograd may go on to change). Exact:
    :func:`dense` gives ``g`` back (but for the sign of its zeros). A sparse ``g`` (an
    ``Embedding(sparse=True)``'s) is coalesced to one sparse dimension."""
    if g is None:
        return None
    g = g.detach()
    if g.is_meta:  # (else torch's "Tensor.item() cannot be called on meta tensors", below)
        raise UnsupportedInputError(
            f"gradhooks cannot verify a backward on the meta device: its gradients (here one "
            f"of shape {tuple(g.shape)}) hold no values to compare. For a forward and backward "
            "of shapes only, add the hooks with add_hooks(model, verify=False) (grad1 is then "
            "on the meta device too, of the right shape); to train, materialize the model first "
            "(model.to_empty(device=...), then load or initialize its weights)"
        )
    if g.is_sparse:
        g = g.coalesce()
        if g.sparse_dim() == 1:
            return g
        return hold(g.to_dense())
    if (
        g.dim() == 0
        or not g.numel()
        or g.shape[0] < 2
        or g.layout != torch.strided
        or not _plain(g)
    ):
        return g.clone() if copy else g
    nonzero = _row_maxima(g) != 0  # (a row that holds a NaN is kept: NaN != 0)
    if 2 * int(nonzero.sum()) > g.shape[0]:
        return g.clone() if copy else g
    rows = nonzero.nonzero().flatten()
    # (rows sorted and apart: coalesced as built, nothing to check)
    return torch.sparse_coo_tensor(
        rows[None], g.index_select(0, rows), g.shape, is_coalesced=True, check_invariants=False
    )


def add_held(a: Tensor, b: Tensor) -> Tensor:
    """``a + b`` of two gradients of one shape, each dense or :func:`hold`: sparse where both
    are (coalesced), else dense."""
    if a.is_sparse and b.is_sparse:
        return (a + b).coalesce()
    if a.is_sparse:
        a, b = b, a
    return a + b


def dense(g: Tensor) -> Tensor:
    """A gradient :func:`hold` as a plain tensor."""
    return g.to_dense() if g.is_sparse else g


def largest(t: Tensor) -> float:
    """``max |t|`` (``t`` dense or :func:`hold`), ``0`` for an empty one; NaN where ``t`` holds
    a NaN, ``inf`` where an infinity: ``math.isfinite(largest(t))`` says whether every entry
    is finite."""
    if t.is_sparse:
        t = t.coalesce().values()
    if not t.numel():
        return 0.0
    return float(torch.linalg.vector_norm(t, float("inf")))


def norm_of(t: Tensor) -> float:
    """``‖t‖`` (``t`` dense or :func:`hold`)."""
    if t.is_sparse:
        t = t.coalesce().values()
    return float(torch.linalg.vector_norm(t))


def largest_difference(got: Tensor | None, want: Tensor) -> float:
    """``max |got - want|`` of two tensors of one shape (``None``: zeros), with no tensor of
    their size on the way: each dense or :func:`hold` (one sparse: its rows against those of
    the dense one, the others against zero; both: the rows of either)."""
    if got is None:
        return largest(want)
    if got.is_sparse and not want.is_sparse:
        got, want = want, got  # (the same difference)
    if got.is_sparse:  # (both: their difference is as sparse)
        return largest((got.coalesce() - want.coalesce()).coalesce())
    if want.is_sparse:
        want = want.coalesce()
        if want.sparse_dim() != 1:
            return largest_difference(got, want.to_dense())
        rows, values = want.indices()[0], want.values()
        inside = largest_difference(got.index_select(0, rows), values) if rows.numel() else 0.0
        if not got.numel():
            return inside
        others = _row_maxima(got).index_fill_(0, rows, 0)
        rest = float(others.max())
        return rest if math.isnan(rest) or rest > inside else inside  # (NaN carried)
    if not want.numel():
        return 0.0
    if want.dim() == 0 or got.dim() == 0 or not (_plain(got) and _plain(want)):
        return float(torch.linalg.vector_norm(got - want, float("inf")))
    step = max(1, CHUNK // max(1, want[0].numel()))
    top = None
    for start in range(0, want.shape[0], step):
        part = torch.linalg.vector_norm(
            got[start : start + step] - want[start : start + step], float("inf")
        )
        top = part if top is None else torch.maximum(top, part)  # (NaN carried)
    return float(top)


def _plain(t: Tensor) -> bool:
    """Whether ``t`` is a plain tensor (not a subclass: an FSDP2 parameter's ``DTensor``
    gradient is compared as it is, whole)."""
    return type(t) is Tensor or type(t) is torch.nn.Parameter


def _row_maxima(t: Tensor) -> Tensor:
    """``max |t[i]|`` for each ``i`` along dimension 0, ``[rows]``, without a copy of ``t``."""
    if t.dim() == 1:
        return t.abs()
    return torch.linalg.vector_norm(t, float("inf"), dim=tuple(range(1, t.dim())))

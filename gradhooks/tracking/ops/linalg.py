"""Matrix products, einsum and operations on matrices."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..layout import MIXED, UNKNOWN, Layout
from .common import arg, first_tensor, handles, norm_dim, normalized_dims, single_input
from .pointwise import pointwise


@handles("tril", "triu", "tril_", "triu_", "diag_embed")
def _matrices(args, kwargs, out, layout_of):
    """Operations on the last two dimensions: a layout among the leading ones stays."""
    t, lay = single_input(args, kwargs, layout_of)
    o = first_tensor(out)
    if t is None or lay is UNKNOWN or o is None or lay.dim >= t.dim() - 2:
        return UNKNOWN
    return lay.at(lay.dim + o.dim() - t.dim())


@handles("matrix_exp", "inverse", "cholesky", "det", "logdet", "slogdet", "trace", "pinverse",
         "linalg_inv", "linalg_inv_ex", "linalg_det", "linalg_slogdet", "linalg_cholesky",
         "linalg_cholesky_ex", "linalg_matrix_exp", "linalg_pinv", "linalg_cond",
         "linalg_matrix_power", "linalg_matrix_rank", "linalg_eigvalsh", "linalg_svdvals")  # fmt: skip
def _whole_matrices(args, kwargs, out, layout_of):
    """Functions of whole matrices in the last two dimensions (each entry of an inverse, a
    determinant, a trace depends on the whole matrix): a layout among the leading dimensions
    stays; the examples in the matrix's rows or columns are mixed."""
    t, lay = single_input(args, kwargs, layout_of)
    o = first_tensor(out)
    if t is None or lay is UNKNOWN or o is None:
        return UNKNOWN
    if lay.dim >= t.dim() - 2:
        return MIXED
    return lay.at(lay.dim + o.dim() - t.dim())


@handles("linalg_solve_triangular", "linalg_solve", "cholesky_solve", "triangular_solve")
def _solves(args, kwargs, out, layout_of):
    """Batched solves of two operands (``[..., n, n]`` and ``[..., n, k]``): a layout among the
    leading dimensions of each, the same in both (or one operand without examples), stays."""
    ts = [a for a in args[:2] if isinstance(a, Tensor)]
    o = first_tensor(out)
    lays = {layout_of(t) for t in ts} - {None}
    if len(ts) != 2 or o is None or len(lays) != 1:
        return UNKNOWN
    (lay,) = lays
    if lay is UNKNOWN or ts[0].dim() != ts[1].dim() or lay.dim >= ts[0].dim() - 2:
        return UNKNOWN
    return lay


def _mm_side(lay: Layout, n: int, is_left: bool, out_n: int, other_n: int) -> Layout | None:
    """Where a layout of one operand of ``matmul`` goes (``None``: it is contracted)."""
    if is_left:
        if n == 1 or lay.dim == n - 1:
            return None
        if lay.dim == n - 2:
            return lay.at(out_n - (2 if other_n >= 2 else 1))
    else:
        if n == 1 or lay.dim == n - 2:
            return None
        if lay.dim == n - 1:
            return lay.at(out_n - 1)
    lead = n - 2  # batch dimensions of this operand, right-aligned with the output's
    out_lead = out_n - (2 if (n >= 2 and other_n >= 2) else 1)
    return lay.at(lay.dim + out_lead - lead)


@handles("matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "mv", "dot", "inner", "vdot")
def matmul(args, kwargs, out, layout_of):
    a, b = arg(args, kwargs, 0, "input"), arg(args, kwargs, 1, "other")
    if not isinstance(b, Tensor):
        b = arg(args, kwargs, 1, "mat2")
    o = first_tensor(out)
    if o is None or not isinstance(a, Tensor) or not isinstance(b, Tensor):
        return UNKNOWN
    found = None
    for t, left, other in ((a, True, b), (b, False, a)):
        lay = layout_of(t)
        if lay is None:
            continue
        if lay is UNKNOWN:
            return UNKNOWN
        where = _mm_side(lay, t.dim(), left, o.dim(), other.dim())
        if where is None or found not in (None, where):
            return MIXED  # the examples contracted, or two examples' rows multiplied
        found = where
    return found


def _contracted(dims: Any, a: Tensor, b: Tensor) -> tuple[list[int], list[int]] | None:
    """The dimensions of ``a`` and of ``b`` that ``tensordot``'s ``dims`` contracts (an int
    ``n``: the last ``n`` of ``a`` and the first ``n`` of ``b``; a pair of ints, of lists or
    of tensors), normalized; ``None`` where they cannot be read."""
    if isinstance(dims, Tensor):
        dims = dims.tolist()
    if isinstance(dims, int):
        return list(range(a.dim() - dims, a.dim())), list(range(dims))
    if not isinstance(dims, list | tuple) or len(dims) != 2:
        return None
    pair = []
    for d, t in zip(dims, (a, b)):
        if isinstance(d, Tensor):
            d = d.tolist()
        d = [d] if isinstance(d, int) else d
        if not isinstance(d, list | tuple) or not all(isinstance(k, int) for k in d):
            return None
        pair.append([norm_dim(k, t.dim()) for k in d])
    return pair[0], pair[1]


@handles("tensordot")
def _tensordot(args, kwargs, out, layout_of):
    """``tensordot(a, b, dims)``: the output's dimensions are ``a``'s that are not contracted,
    then ``b``'s; the examples contracted are summed over (mixed)."""
    a, b = arg(args, kwargs, 0, "a"), arg(args, kwargs, 1, "b")
    o = first_tensor(out)
    if o is None or not isinstance(a, Tensor) or not isinstance(b, Tensor):
        return UNKNOWN
    contracted = _contracted(arg(args, kwargs, 2, "dims", 2), a, b)
    if contracted is None:
        return UNKNOWN
    kept_a = [d for d in range(a.dim()) if d not in contracted[0]]
    kept_b = [d for d in range(b.dim()) if d not in contracted[1]]
    found = None
    for t, kept, offset in ((a, kept_a, 0), (b, kept_b, len(kept_a))):
        lay = layout_of(t)
        if lay is None:
            continue
        if lay is UNKNOWN:
            return UNKNOWN
        if lay.dim not in kept:
            return MIXED  # summed over the examples
        where = lay.at(offset + kept.index(lay.dim))
        if found not in (None, where):
            return MIXED
        found = where
    return found


@handles("cdist")
def _cdist(args, kwargs, out, layout_of):
    """``cdist(x1 [*, P, M], x2 [*, R, M]) -> [*, P, R]``: as ``x1 @ x2.mT`` (the features
    ``M`` contracted; the rows of ``x1`` on ``P``, those of ``x2`` on ``R``)."""
    a, b = arg(args, kwargs, 0, "x1"), arg(args, kwargs, 1, "x2")
    o = first_tensor(out)
    if o is None or not isinstance(a, Tensor) or not isinstance(b, Tensor):
        return UNKNOWN
    found = None
    for t, row in ((a, o.dim() - 2), (b, o.dim() - 1)):
        lay = layout_of(t)
        if lay is None:
            continue
        if lay is UNKNOWN:
            return UNKNOWN
        n = t.dim()
        if lay.dim == n - 1:
            return MIXED  # the examples among the features a distance sums over
        where = lay.at(row if lay.dim == n - 2 else lay.dim + (o.dim() - 2) - (n - 2))
        if found not in (None, where):
            return MIXED  # two examples' rows compared
        found = where
    return found


@handles("baddbmm", "addmm", "addmv", "addr")
def _addmm(args, kwargs, out, layout_of):
    """``input + m1 @ m2``: the product's layout, which the added input must share."""
    o = first_tensor(out)
    m1, m2 = arg(args, kwargs, 1, "mat1"), arg(args, kwargs, 2, "mat2")
    if not (isinstance(m1, Tensor) and isinstance(m2, Tensor)):
        m1, m2 = arg(args, kwargs, 1, "batch1"), arg(args, kwargs, 2, "batch2")
    if o is None or not (isinstance(m1, Tensor) and isinstance(m2, Tensor)):
        return UNKNOWN
    prod = matmul((m1, m2), {}, o, layout_of)
    base = arg(args, kwargs, 0, "input")
    lay = layout_of(base) if isinstance(base, Tensor) else None
    if lay is not None:
        added = pointwise((base,), {}, o, layout_of)
        if prod is not None and added != prod:
            return UNKNOWN
        return added
    return prod


@handles("addbmm")
def _addbmm(args, kwargs, out, layout_of):
    """``input + Σ_k batch1[k] @ batch2[k]``: the product's rows are ``batch1``'s dimension 1,
    its columns ``batch2``'s dimension 2; the examples on dimension 0 of either, or on the
    contracted one, are summed over (mixed). The added input must share the layout."""
    o = first_tensor(out)
    b1, b2 = arg(args, kwargs, 1, "batch1"), arg(args, kwargs, 2, "batch2")
    if o is None or not (isinstance(b1, Tensor) and isinstance(b2, Tensor)) or o.dim() != 2:
        return UNKNOWN
    found = None
    for t, kept in ((b1, 1), (b2, 2)):
        lay = layout_of(t)
        if lay is None:
            continue
        if lay is UNKNOWN:
            return UNKNOWN
        if lay.dim != kept:
            return MIXED  # summed over the examples
        where = lay.at(kept - 1)
        if found not in (None, where):
            return MIXED
        found = where
    base = arg(args, kwargs, 0, "input")
    if isinstance(base, Tensor) and layout_of(base) is not None:
        added = pointwise((base,), {}, o, layout_of)
        if found is not None and added != found:
            return UNKNOWN
        return added
    return found


@handles("cov", "corrcoef", "pdist")
def _pairs(args, kwargs, out, layout_of):
    """Statistics of pairs of rows or of variables (``cov``, ``corrcoef``: of the variables in
    the rows over the observations in the columns; ``pdist``: distances between rows): every
    entry holds two rows' or the whole of a column's values, so that examples on either
    dimension are mixed."""
    t, lay = single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN:
        return UNKNOWN
    return MIXED


@handles("linalg_matrix_norm")
def _matrix_norm(args, kwargs, out, layout_of):
    """``linalg.matrix_norm(A, ord, dim=(-2, -1), keepdim)``: a reduction over the two ``dim``
    (the last two by default), the leading dimensions kept."""
    t, lay = single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN:
        return UNKNOWN
    dims = normalized_dims(arg(args, kwargs, 2, "dim", (-2, -1)), t.dim())
    if dims is None or lay.dim in dims:
        return MIXED  # a norm over the examples
    if arg(args, kwargs, 3, "keepdim", False):
        return lay
    return lay.at(lay.dim - sum(1 for d in dims if d < lay.dim))


@handles("dist")
def _dist(args, kwargs, out, layout_of):
    """``dist(a, b, p)``: the norm of ``a - b`` over every entry, the examples' together."""
    lays = [layout_of(t) for t in args[:2] if isinstance(t, Tensor)]
    if any(lay is UNKNOWN for lay in lays):
        return UNKNOWN
    return MIXED if any(lay is not None for lay in lays) else None


@handles("renorm", "renorm_")
def _renorm(args, kwargs, out, layout_of):
    """``renorm(x, p, dim, maxnorm)``: each slice ``x.select(dim, i)`` rescaled by its own norm;
    along the examples' dimension each example is one slice, else a slice holds them all."""
    t, lay = single_input(args, kwargs, layout_of)
    dim = arg(args, kwargs, 2, "dim")
    if t is None or lay is UNKNOWN or not isinstance(dim, int):
        return UNKNOWN
    return lay if norm_dim(dim, t.dim()) == lay.dim else MIXED


@handles("einsum")
def _einsum(args, kwargs, out, layout_of):
    eq = args[0]
    ops = args[1:]
    if len(ops) == 1 and isinstance(ops[0], list | tuple):
        ops = tuple(ops[0])
    o = first_tensor(out)
    if not isinstance(eq, str) or o is None:
        return UNKNOWN
    eq = eq.replace(" ", "")
    if "->" in eq:
        lhs, rhs = eq.split("->")
    else:
        lhs = eq
        letters = [c for c in lhs if c.isalpha()]
        rhs = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
        if "..." in lhs:
            rhs = "..." + rhs
    terms = lhs.split(",")
    if len(terms) != len(ops):
        return UNKNOWN
    ell = max((t.dim() - len(term.replace("...", "")) for term, t in zip(terms, ops)
               if "..." in term), default=0)  # fmt: skip

    def expand(term: str, ndim: int) -> list[str]:
        if "..." not in term:
            return list(term)
        head, tail = term.split("...")
        k = ndim - len(head) - len(tail)
        return list(head) + [f"_{ell - k + j}" for j in range(k)] + list(tail)

    out_letters = expand(rhs, o.dim()) if "..." in rhs else list(rhs)
    if "..." in rhs:
        head, tail = rhs.split("...")
        out_letters = list(head) + [f"_{j}" for j in range(ell)] + list(tail)
    found = None
    for term, t in zip(terms, ops):
        lay = layout_of(t) if isinstance(t, Tensor) else None
        if lay is None:
            continue
        if lay is UNKNOWN:
            return UNKNOWN
        letter = expand(term, t.dim())[lay.dim]
        if letter not in out_letters:
            return MIXED  # summed over the examples
        where = lay.at(out_letters.index(letter))
        if found not in (None, where):
            return MIXED
        found = where
    return found

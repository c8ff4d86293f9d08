"""Whether what the tracker cannot see into gives each example's rows from that example alone.

An operation without a handler (:meth:`~gradhooks.tracking.Tracker.guard_rows`), or a
TorchScript module (:mod:`gradhooks.engine.opaque`), whose output holds as many rows as the
batch where its input held the examples, is run again, without gradient, on its first and on
its last example alone: where each gives its own row of every output (to the rounding of the
outputs' dtype), those rows are the examples; otherwise the operation combined rows of
different examples (a decomposition or a solve of the batch as one matrix, ``torch.take``'s
flat positions, a scatter along the batch's dimension), or reads the batch as something else
(a size given as an argument, ``native_group_norm``'s ``N``), and no example's rows are there.
A result of no dimension (a loss) is only run on one example alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .._torch import tree_flatten, tree_map

# the relative rounding two computations of one row may differ by, by dtype (others: half
# precisions)
_ROUNDING = {torch.float64: 1e-7, torch.float32: 1e-4}


def same_row(row: Tensor, alone: Tensor) -> bool:
    """Whether ``alone`` is ``row`` to the rounding of their dtype."""
    if row.shape != alone.shape or row.dtype != alone.dtype:
        return False
    if not row.is_floating_point() and not row.is_complex():
        return torch.equal(row, alone)
    tol = _ROUNDING.get(row.dtype, 1e-2)
    size = alone.abs().nan_to_num(0.0, 0.0, 0.0)
    scale = size.amax() if size.numel() else 0.0
    close = ((row - alone).abs() <= tol * (size + scale)) | (row == alone)
    close |= row.isnan() & alone.isnan()
    return bool(close.all())


def differs_alone(
    run: Callable[[tuple, dict], Any],
    args: tuple,
    kwargs: dict,
    holds: Callable[[Tensor], bool],
    dim: int,
    batch: int,
    outs: list[Tensor],
    out_dims: list[int | None],
) -> str | None:
    """Why ``run(args, kwargs)`` on its first and on its last example alone (the tensors that
    ``holds`` says hold the examples, narrowed along ``dim``) does not give their rows of
    ``outs`` (of its tensor results in order) along ``out_dims`` (``None``: not compared; a
    result of no dimension: only of no dimension alone too); ``None`` where it does. Run
    without gradient; the caller keeps what it changes (buffers, the random generator)."""
    with torch.no_grad():
        for i in sorted({0, batch - 1}):

            def alone(t: Any, i: int = i) -> Any:
                # (a copy: an operation on its storage, as_strided, sees the example's alone)
                return t.narrow(dim, i, 1).clone() if isinstance(t, Tensor) and holds(t) else t

            a, k = tree_map(alone, (args, kwargs))
            try:
                got = run(a, k)
            except Exception as e:  # (BatchNorm in training mode: one value per channel)
                return f"which fails on one example alone ({type(e).__name__})"
            got = [t for t in tree_flatten(got)[0] if isinstance(t, Tensor)]
            if len(got) != len(outs):
                return "whose output for an example alone is not that example's row"
            for o, g, d in zip(outs, got, out_dims):
                if d is None:
                    continue
                if o.dim() == 0 and g.dim() == 0:
                    continue
                if o.dim() <= d or not same_row(o.narrow(d, i, 1), g):
                    return "whose output for an example alone is not that example's row"
    return None

"""The per-example loop: a computation run for one example at a time, its results stacked.

Every place that cannot batch a computation over the examples runs it through
:func:`per_example`: the reference :func:`gradhooks.oracle.loop_grad`, the ``torch.func``
fallback where ``vmap`` cannot run a module, a rule called once per example on a call that
does not depend on them, the tracker's per-example gradients where ``is_grads_batched`` fails,
and the LSTM's ``create_graph`` pieces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["per_example"]


def per_example(
    batch: int,
    one: Callable[[int], Sequence[Tensor | None]],
    like: Sequence[Tensor | None] | None = None,
) -> list[Tensor | None]:
    """``one(b)`` for each example ``b`` in ``range(batch)``, stacked position by position
    along a new dimension 0: ``one(b)[j]`` becomes row ``b`` of result ``j``.

    ``one(b)`` gives ``None`` where example ``b`` has no result at position ``j`` (a parameter
    its loss does not reach). That row is then zeros, shaped and typed as ``like[j]`` where
    ``like`` gives it, else as the other examples' results; a position no example gave is
    ``None``, unless ``like[j]`` is given: then it is zeros, ``[batch, *like[j].shape]`` (also
    for ``batch == 0``).

    >>> per_example(3, lambda b: [torch.full((2,), float(b)), None])
    [tensor([[0., 0.],
            [1., 1.],
            [2., 2.]]), None]
    """
    rows = [list(one(b)) for b in range(batch)]
    width = len(like) if like is not None else len(rows[0]) if rows else 0
    out: list[Tensor | None] = []
    for j in range(width):
        column = [row[j] for row in rows]
        model = like[j] if like is not None else None
        if model is None:
            model = next((t for t in column if t is not None), None)
            if model is None:
                out.append(None)
                continue
        elif not column:
            out.append(model.new_zeros(0, *model.shape))
            continue
        out.append(torch.stack([torch.zeros_like(model) if t is None else t for t in column]))
    return out

"""Whether what the tracker cannot see into gives each example's rows from that example alone.

An operation without a handler (:func:`guard_rows`), or a
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
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .._torch import tree_flatten, tree_map
from .layout import Layout

if TYPE_CHECKING:
    from .tracker import Tracker

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


def guard_rows(tr: Tracker, name: str, ins: list, outs: list, call: tuple | None = None) -> None:
    """An operation without a handler, ``name``, gave ``outs`` from tensors that hold the
    examples. Where an output keeps their rows where its input had them, they are
    presumed there (:func:`~.propagate.presume`), and the engine's check of one example (the
    probe) reads them so; where ``call`` (its function, arguments and keyword arguments)
    is given and the outputs have a gradient, that is checked first: run again on its
    first and on its last example alone (:func:`differs_alone`), it must give
    their rows (a result of no dimension, a loss: run at all). An output with a gradient
    that holds them nowhere the tracker can say (``torch.kron``, ``torch.combinations``:
    other rows than the batch's, which a loss, a rule or the probe would take as the
    examples, or whose rows no check can split; an operation that combined the rows of
    the batch as one matrix, ``torch.linalg.eigh`` of ``[batch, batch]``, or read it as
    something else) is armed: a backward that writes ``grad1`` and reaches its autograd
    node is refused (:meth:`EngineLink.lost_reached`). (Otherwise a result of no
    dimension is a loss, taken as a sum of per-example losses, as one computed by an
    operation followed.)"""
    lost = [o for o in outs if o.requires_grad and o.dim() and o not in tr.presumed]
    held = next(
        ((t, lay) for t in ins if (lay := tr.presumed_of(t)) is not None and lay.dim >= 0),
        None,
    )
    if held is None:
        return  # (lost before: armed there, where it had a gradient)
    t, lay = held
    alone = None
    if not lost and call is not None and any(o.requires_grad for o in outs):
        alone = rows_alone(tr, call, ins, outs, lay)
        if alone is not None:
            lost = [o for o in outs if o.requires_grad]
            for o in lost:
                tr.presumed.pop(o, None)
    if not lost:
        return
    node = next((o.grad_fn for o in lost if o.grad_fn is not None), None)
    if node is None:
        return
    why = (
        f"{tr.in_call(name)}, which gradhooks does not follow: from a tensor of shape "
        f"{tuple(t.shape)} holding the {tr.batch} examples on {lay.describe(tr.batch)}, it "
        f"gave one of shape {tuple(lost[0].shape)}" + (f", {alone}" if alone else "")
    )
    # (the hook holds the nodes after this one, not this one: no cycle through the graph)
    after = tuple(n for n, _ in node.next_functions if n is not None)
    engine = tr.engine
    node.register_prehook(lambda grad_outputs: engine.lost_reached(why, after))


def rows_alone(tr: Tracker, call: tuple, ins: list, outs: list, lay: Layout) -> str | None:
    """:func:`guard_rows`' check of an operation ``call`` whose inputs hold the examples on
    ``lay``: why its first and its last example alone do not give their rows of ``outs``
    (``None``: they do, or the inputs do not hold them on one plain dimension, which this
    cannot narrow; a tensor without them as many rows, :func:`rows_of_batch`, is narrowed
    with them). The random generator is put back as it was after; an operation that
    drew from it is not judged."""
    firm = {got for t in ins if (got := tr.presumed_of(t)) is not None}
    if tr.batch < 2 or firm != {lay} or not lay.plain:
        return None
    if any(t.layout is not torch.strided for t in (*ins, *outs)):
        return None  # (sparse: no rows to narrow or compare)
    dims: list[int | None] = []  # (where each output's rows are; None: not compared)
    for o in outs:
        kept = tr.presumed.get(o) if o.dim() else Layout(0)
        dims.append(kept.dim if kept is not None and kept.plain else None)
    func, args, kwargs = call
    # (a size given as the shape of a tensor with the examples, x.as_strided(x.shape, ...),
    # is given for one example as its shape)
    shapes = {tuple(t.shape) for t in (*ins, *outs) if rows_of_batch(tr, t, lay)}

    def one(a: Any) -> Any:
        if isinstance(a, tuple | list) and tuple(a) in shapes:
            return type(a)([1 if i == lay.dim else n for i, n in enumerate(a)])
        return a

    args, kwargs = tuple(one(a) for a in args), {k: one(a) for k, a in kwargs.items()}
    devices = sorted({t.device.index or 0 for t in ins if t.is_cuda})
    with torch.random.fork_rng(devices=devices):
        state = torch.random.get_rng_state()
        why = differs_alone(
            lambda a, k: func(*a, **k), args, kwargs,
            lambda t: rows_of_batch(tr, t, lay), lay.dim, tr.batch, outs, dims,
        )  # fmt: skip
        if why is not None and not torch.equal(state, torch.random.get_rng_state()):
            return None  # (it draws random numbers: one example's are not its rows')
    return why


def rows_of_batch(tr: Tracker, t: Tensor, lay: Layout) -> bool:
    """Whether ``t`` has a row per example on ``lay``'s dimension: it holds the examples
    there, or, not depending on them, as many rows (``axis.expand_as(h)``: taken row by
    row with them by an operation on each example's rows)."""
    got = tr.presumed_of(t)
    if got is None:
        return t.dim() > lay.dim and t.shape[lay.dim] == tr.batch
    return got == lay

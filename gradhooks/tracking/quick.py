"""The short way through the tracker, and the layouts it keeps.

Most torch calls of a forward are followed by what a call of the same kind gave before: the
key of a call (its function, the batch size, and each argument's class, shape, dtype and
layout) finds the layouts kept for its outputs in :mod:`.memo`. A call that a key cannot
describe, or whose key is new, takes the long way (:func:`~.propagate.propagate_op`), which
keeps what it found where nothing else about the forward decided it.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from . import memo
from .layout import MIXED
from .ops import INDEX, OpFacts
from .ops.common import out_tensors, tensor_args
from .propagate import propagate_op
from .read import note_read

if TYPE_CHECKING:
    from .tracker import Tracker

PLAIN = memo.PLAIN


UNLAID: Any = object()  # (quick_key: no tensor of the call has a layout)


_ref = weakref.ref


def _other_part(a: Any, entries: dict) -> Any:
    """:func:`.memo.part` of argument ``a``, neither a tensor nor of :data:`.memo.PLAIN`, on
    the short way of :meth:`Tracker.__torch_function__`; ``None`` where the call takes the
    long way (a list or tuple holding a tensor, whose tensors the long way looks at)."""
    cls = a.__class__
    if cls is tuple or cls is list or cls is torch.Size:
        plain = True
        for x in a:
            if x.__class__ not in PLAIN:
                if isinstance(x, Tensor):
                    return None
                plain = False
        if plain:
            return (cls, *a)  # (memo.part's, without a call per entry: view(shape))
    p = memo.part(a, entries)
    return None if p is memo.NO_KEY else p


COMPILING = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)


# what a torch function returns that holds no tensor (``x.shape``, ``x.dtype``, ``x.dim()``)
NO_TENSOR = frozenset({bool, int, float, str, type(None), torch.Size, torch.dtype, torch.device})


def untainted(tr: Tracker, op: OpFacts, args: tuple, kwargs: dict) -> bool:
    """Whether a call of :data:`~.ops.METADATA` or :data:`~.ops.FREE` function ``op`` is
    only run by the long way: a question about tensors of which none has sources (whose
    answer, no tensor, is not followed), a new tensor made from no tensor."""
    if op.free:
        return not tensor_args(args, kwargs)
    tainted = tr.taints.entries
    if not tainted:
        return True
    for t in tensor_args(args, kwargs):
        e = tainted.get(id(t))
        if e is not None and e[0]() is t and e[1]:
            return False
    return True


def quick_key(tr: Tracker, op: OpFacts, args: tuple, kwargs: dict) -> Any:
    """The parts of :func:`.memo.key` for a call on the short way, where the tensors among
    ``args`` and ``kwargs`` (as :func:`tensor_args` finds them) include one with a layout;
    :data:`UNLAID` where none has one; ``None`` where the call takes the long way (a
    tensor with sources, rows picked by an index, a parameter used directly, a list of
    tensors, an ``out=``, a second tensor given to a :data:`~.ops.LIKE` function). Notes
    the parameters used inside the hooked calls covering them, as the long way does."""
    entries, params, tainted = tr.layouts.entries, tr.params, tr.taints.entries
    parts = [id(op), tr.batch]
    laid = False
    n = 0
    for a in args:
        cls = a.__class__
        if cls in PLAIN:
            parts.append(a)
            continue
        if not isinstance(a, Tensor):
            p = _other_part(a, entries)
            if p is None:
                return None
            parts.append(p)
            continue
        # (as quick_tensor, inlined: the usual argument)
        n += 1
        if n > 1 and op.like:
            return None
        k = id(a)
        e = entries.get(k)
        if e is not None and e[0]() is a:
            lay = e[1]
            if lay.owners is not None:
                return None
            laid = True
            parts.append((cls, lay.dim, lay.outer, lay.inner, a.shape, a.dtype))
        else:
            parts.append((cls, None, a.shape, a.dtype))
        if tainted:
            e = tainted.get(k)
            if e is not None and e[0]() is a and e[1]:
                return None
        if k in params and not quick_param(tr, k):
            return None
    if kwargs:
        if "out" in kwargs:
            return None
        for name, a in kwargs.items():
            parts.append(name)
            cls = a.__class__
            if cls in PLAIN:
                parts.append(a)
                continue
            if not isinstance(a, Tensor):
                p = _other_part(a, entries)
                if p is None:
                    return None
                parts.append(p)
                continue
            n += 1
            if n > 1 and op.like:
                return None
            p = quick_tensor(tr, a)
            if p is None:
                return None
            laid = laid or p[1] is not None
            parts.append(p)
    return parts if laid else UNLAID


def quick_tensor(tr: Tracker, a: Tensor) -> tuple | None:
    """:func:`quick_key`'s part for tensor ``a`` (``None``: the long way)."""
    k = id(a)
    e = tr.layouts.entries.get(k)
    if e is not None and e[0]() is a:
        lay = e[1]
        if lay.owners is not None:
            return None
        p = (a.__class__, lay.dim, lay.outer, lay.inner, a.shape, a.dtype)
    else:
        p = (a.__class__, None, a.shape, a.dtype)
    e = tr.taints.entries.get(k)
    if e is not None and e[0]() is a and e[1]:
        return None
    if k in tr.params and not quick_param(tr, k):
        return None
    return p


def quick_param(tr: Tracker, pid: int) -> bool:
    """Note the use of parameter ``pid`` by the hooked call covering it, as the long way
    does; ``False`` where none does, or one without a rule (a direct use: the long way)."""
    where = tr.covering(pid)
    if where is None or tr.used[where].soft:
        return False
    tr.used[where].params.add(pid)
    return True


def quick_follow(tr: Tracker, op: OpFacts, func, args: tuple, kwargs: dict, parts: list) -> Any:
    """Run a call on the short way (:func:`quick_key` gave ``parts``) and follow it: the
    layouts kept for its key, or, where none are, as :func:`follow` does."""
    tr.off += 1
    try:
        out = func(*args, **kwargs)
        if out.__class__ in NO_TENSOR:
            if out.__class__ is float:
                first = tensor_args(args, kwargs)[0]
                if tr.layouts.get(first) is MIXED:
                    note_read(tr.read, out, op.name)  # (a statistic of the batch)
            return out
        if isinstance(out, Tensor):
            if out.dtype is not tr.precision:
                tr.note_precision(out)
            if not COMPILING():
                hit = memo.KEPT.get(tuple(parts))
                if hit is not None and len(hit[0]) == 1 and out.shape == hit[0][0]:
                    lay = hit[1][0]
                    if lay is not None:
                        # (tr.layouts[out] = lay, inlined)
                        layouts = tr.layouts
                        entries = layouts.entries
                        entries[id(out)] = (_ref(out), lay)
                        if len(entries) >= layouts.sweep_at:
                            layouts.sweep()
                    return out
        tr.func = func
        try:
            ins = tensor_args(args, kwargs)
            if COMPILING():
                propagate_op(tr, op, args, kwargs, out, ins)
            else:
                replay(tr, op, args, kwargs, out, ins, tuple(parts))
        finally:
            tr.func = None
        return out
    finally:
        tr.off -= 1


def follow(tr: Tracker, op: OpFacts, args, kwargs, out, ins: list) -> None:
    """:func:`~.propagate.propagate_op` for a call on tensors with layouts and no sources, or,
    where a call with the same key was followed before, the layouts it gave (:mod:`.memo`)."""
    if (
        tr.coupled.entries
        or tr.read
        or tr.row_index.entries
        or tr.positions.entries
        or tr.reordered.entries
        or tr.packed_orders.entries
        # (traced by torch.compile, where the hooks cannot leave compiled code: dynamo
        # would guard on the kept table, as large as every model's calls so far)
        or COMPILING()
        or (op.kept == INDEX and len(args) > 1 and memo.holds_tensor(args[1]))
        or (tr.lineage.entries and any([t in tr.lineage for t in ins]))
    ):
        return propagate_op(tr, op, args, kwargs, out, ins)
    found = memo.key(op, tr.batch, args, kwargs, tr.layouts.entries)
    if found is memo.NO_KEY:
        return propagate_op(tr, op, args, kwargs, out, ins)
    return replay(tr, op, args, kwargs, out, ins, found)


def replay(tr: Tracker, op: OpFacts, args, kwargs, out, ins: list, found: tuple) -> None:
    """:func:`follow` for a call of key ``found``: the layouts kept for it, or, where
    none are (or not for outputs of these shapes), :func:`~.propagate.propagate_op`, kept if
    it could be."""
    layouts = tr.layouts
    hit = memo.KEPT.get(found)
    if isinstance(out, Tensor):
        if hit is not None and len(hit[0]) == 1 and out.shape == hit[0][0]:
            lay = hit[1][0]
            if lay is not None:
                layouts[out] = lay
            return None
        outs = [out]
    else:
        outs = out_tensors(out)
        if not outs and op.inplace and args and isinstance(args[0], Tensor):
            outs = [args[0]]
        if hit is not None and len(hit[0]) == len(outs):
            shapes, lays = hit
            same = True
            for o, shape in zip(outs, shapes):
                if o.shape != shape:
                    same = False
                    break
            if same:
                for o, lay in zip(outs, lays):
                    if lay is not None:
                        layouts[o] = lay
                return None
    notes = len(tr.unknown), len(tr.mixed), len(tr.presumed.entries), tr.rejoined
    propagate_op(tr, op, args, kwargs, out, ins)
    if notes == (len(tr.unknown), len(tr.mixed), len(tr.presumed.entries), tr.rejoined):
        memo.keep(found, outs, layouts)
    return None

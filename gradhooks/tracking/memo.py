"""What the tracker found for a torch function, kept for the next call that looks the same.

A handler (:mod:`.ops`) computes its result's layout from the call's other arguments, its
tensors' layouts, shapes and dtypes, the batch size and the result's shapes, and from nothing
else, unless it reads tensors' values (:data:`.ops.READS_VALUES`: an index's entries, a
condition). So the layouts it gave once are what it gives again for a call with the same
:func:`key`: a forward that repeats its calls (every training step) is followed at the cost of
building the key and one lookup per call, not of the handlers' work. This is a cache of a pure
function, not a replay of a recorded forward: a call that differs in anything a handler could
read has another key, and is followed afresh, wherever it comes in the forward, so a change of
control flow (a branch taken on the data, a different sequence length, a module switched off)
is followed exactly as the first time.

Kept: only calls whose every result was followed (no mixed, unknown or packed layout, no rows
picked by an index), that changed nothing else the tracker knows (messages, presumed layouts),
and none of whose tensors are coupled, reordered, candidates' lineage or row indices (the
tracker's per-tensor facts beyond layouts, which the key does not hold).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

# (the types of the other arguments a key holds as they are; hashable and immutable)
PLAIN = frozenset(
    {int, float, complex, str, type(None), type(Ellipsis), torch.dtype, torch.device,
     torch.memory_format, torch.layout}
)  # fmt: skip

NO_KEY: Any = object()  # (an argument a key cannot hold: the call is followed afresh)

# key -> (the results' shapes, their layouts); emptied when it grows past _LIMIT (a model
# whose shapes change at every step, unpadded sequences of every length)
KEPT: dict[tuple, tuple[tuple, tuple]] = {}
_LIMIT = 1 << 14  # (some hundred bytes each: a few MB at most)


def part(a: Any, entries: dict) -> Any:
    """What a key holds of argument ``a`` (``entries``: the tracker's layouts'
    :attr:`~.tensormap.TensorMap.entries`)."""
    cls = a.__class__
    if cls in PLAIN:
        return a
    if isinstance(a, Tensor):
        e = entries.get(id(a))
        if e is None or e[0]() is not a:
            return (cls, None, a.shape, a.dtype)
        lay = e[1]
        if lay.owners is not None:
            return NO_KEY  # (rows picked by an index: the index's values)
        return (cls, lay.dim, lay.outer, lay.inner, a.shape, a.dtype)
    if cls is bool:
        return (bool, a)  # (True is 1 to a dict)
    if cls is tuple or cls is list or cls is torch.Size:
        parts = [cls]
        for x in a:
            p = part(x, entries)
            if p is NO_KEY:
                return NO_KEY
            parts.append(p)
        return tuple(parts)
    if cls is slice:
        parts = (slice, part(a.start, entries), part(a.stop, entries), part(a.step, entries))
        return NO_KEY if NO_KEY in parts else parts
    return NO_KEY


def holds_tensor(a: Any) -> bool:
    """Whether ``a`` is a tensor or holds one, at any depth of lists, tuples and slices (an
    index whose entries a handler reads)."""
    if isinstance(a, Tensor):
        return True
    if isinstance(a, list | tuple):
        return any([holds_tensor(x) for x in a])
    if isinstance(a, slice):
        return holds_tensor(a.start) or holds_tensor(a.stop) or holds_tensor(a.step)
    return False


def key(op: Any, batch: int, args: tuple, kwargs: dict, entries: dict) -> tuple | Any:
    """What a handler's result depends on, for torch function ``op`` (its
    :class:`~.ops.OpFacts`, one object per function) on ``args`` and ``kwargs`` with the
    batch of ``batch`` examples (``entries``: the tracker's layouts'): :data:`NO_KEY` where
    an argument is not one a key holds."""
    parts = [id(op), batch]
    for a in args:
        cls = a.__class__
        if cls in PLAIN:
            parts.append(a)
            continue
        p = part(a, entries)
        if p is NO_KEY:
            return NO_KEY
        parts.append(p)
    if kwargs:
        for k, a in kwargs.items():
            p = part(a, entries)
            if p is NO_KEY:
                return NO_KEY
            parts.append(k)
            parts.append(p)
    return tuple(parts)


def keep(found: tuple, outs: list[Tensor], layouts) -> None:
    """Keep the layouts the tracker gave ``outs`` for the call of key ``found``, where every
    one is followed (or none was given)."""
    lays = []
    for o in outs:
        lay = layouts.get(o)
        if lay is not None and (lay.dim < 0 or lay.owners is not None):
            return
        lays.append(lay)
    if len(KEPT) >= _LIMIT:
        KEPT.clear()
    KEPT[found] = (tuple([o.shape for o in outs]), tuple(lays))


def clear() -> None:
    KEPT.clear()

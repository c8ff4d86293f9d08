"""A map keyed by tensors, by identity, that keeps none of them alive: what the tracker knows
of each tensor of a forward (its layout, its sources, ...).

``torch.utils.weak.WeakIdKeyDictionary`` does this too, but builds a weak reference of its own
(a Python object) for every lookup; the tracker looks tensors up several times per torch
function, so :class:`TensorMap` finds an entry by ``id(t)`` and checks it with the weak
reference stored beside the value (``ref() is t``): a tensor freed and its id reused by
another is never taken for the old one.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

from torch import Tensor

_MISSING: Any = object()


class TensorMap:
    """``{tensor: value}`` by the tensor's identity, holding weak references only.

    Entries of freed tensors are not found (their weak reference is dead) and are dropped when
    the map has doubled since it last dropped them (no callback per entry: cheaper to set).
    ``len(m)`` counts the live entries. :attr:`entries` (read it, never change it) holds every
    entry, live or not: where it is empty no tensor is found, so ``if m.entries:`` skips lookups
    at the cost of an attribute (``bool(m)`` says the same through a Python call)."""

    __slots__ = ("entries", "sweep_at")

    def __init__(self) -> None:
        # id(t) -> (weak reference to t, value)
        self.entries: dict[int, tuple[weakref.ref, Any]] = {}
        self.sweep_at = 64

    def get(self, t: Any, default: Any = None) -> Any:
        e = self.entries.get(id(t))
        if e is not None and e[0]() is t:
            return e[1]
        return default

    def __contains__(self, t: Any) -> bool:
        e = self.entries.get(id(t))
        return e is not None and e[0]() is t

    def __getitem__(self, t: Any) -> Any:
        e = self.entries.get(id(t))
        if e is None or e[0]() is not t:
            raise KeyError(f"no entry for a tensor of id {id(t)}")
        return e[1]

    def __setitem__(self, t: Tensor, value: Any) -> None:
        data = self.entries
        data[id(t)] = (weakref.ref(t), value)
        if len(data) >= self.sweep_at:
            self.sweep()

    def __delitem__(self, t: Any) -> None:
        if self.pop(t, _MISSING) is _MISSING:
            raise KeyError(f"no entry for a tensor of id {id(t)}")

    def pop(self, t: Any, default: Any = _MISSING) -> Any:
        e = self.entries.get(id(t))
        if e is not None and e[0]() is t:
            del self.entries[id(t)]
            return e[1]
        if default is _MISSING:
            raise KeyError(f"no entry for a tensor of id {id(t)}")
        return default

    def clear(self) -> None:
        self.entries.clear()
        self.sweep_at = 64

    def items(self) -> list[tuple[Tensor, Any]]:
        """The live entries, as a list (safe to change the map while going through it)."""
        return [(t, v) for r, v in list(self.entries.values()) if (t := r()) is not None]

    def keys(self) -> list[Tensor]:
        return [t for t, _ in self.items()]

    def values(self) -> list[Any]:
        return [v for _, v in self.items()]

    def __iter__(self) -> Iterator[Tensor]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.items())

    def __bool__(self) -> bool:
        return bool(self.entries)

    def sweep(self) -> None:
        data = self.entries
        for k in [k for k, e in data.items() if e[0]() is None]:
            del data[k]
        self.sweep_at = max(64, 2 * len(data))

    def __repr__(self) -> str:
        return f"TensorMap({len(self)} live entries)"

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
    ``bool(m)`` says whether it holds any entry, live or not: false means no tensor is found
    (use it to skip lookups); ``len(m)`` counts the live ones."""

    __slots__ = ("_data", "_sweep_at")

    def __init__(self) -> None:
        self._data: dict[int, tuple[weakref.ref, Any]] = {}
        self._sweep_at = 64

    def get(self, t: Any, default: Any = None) -> Any:
        e = self._data.get(id(t))
        if e is not None and e[0]() is t:
            return e[1]
        return default

    def __contains__(self, t: Any) -> bool:
        e = self._data.get(id(t))
        return e is not None and e[0]() is t

    def __getitem__(self, t: Any) -> Any:
        e = self._data.get(id(t))
        if e is None or e[0]() is not t:
            raise KeyError(f"no entry for a tensor of id {id(t)}")
        return e[1]

    def __setitem__(self, t: Tensor, value: Any) -> None:
        data = self._data
        data[id(t)] = (weakref.ref(t), value)
        if len(data) >= self._sweep_at:
            self._sweep()

    def __delitem__(self, t: Any) -> None:
        if self.pop(t, _MISSING) is _MISSING:
            raise KeyError(f"no entry for a tensor of id {id(t)}")

    def pop(self, t: Any, default: Any = _MISSING) -> Any:
        e = self._data.get(id(t))
        if e is not None and e[0]() is t:
            del self._data[id(t)]
            return e[1]
        if default is _MISSING:
            raise KeyError(f"no entry for a tensor of id {id(t)}")
        return default

    def clear(self) -> None:
        self._data.clear()
        self._sweep_at = 64

    def items(self) -> list[tuple[Tensor, Any]]:
        """The live entries, as a list (safe to change the map while going through it)."""
        return [(t, v) for r, v in list(self._data.values()) if (t := r()) is not None]

    def keys(self) -> list[Tensor]:
        return [t for t, _ in self.items()]

    def values(self) -> list[Any]:
        return [v for _, v in self.items()]

    def __iter__(self) -> Iterator[Tensor]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.items())

    def __bool__(self) -> bool:
        return bool(self._data)

    def _sweep(self) -> None:
        self._data = {k: e for k, e in self._data.items() if e[0]() is not None}
        self._sweep_at = max(64, 2 * len(self._data))

    def __repr__(self) -> str:
        return f"TensorMap({len(self)} live entries)"

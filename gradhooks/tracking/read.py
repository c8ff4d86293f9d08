"""Numbers and rows read into Python from tensors computed across the examples.

A statistic of the batch read with ``float()`` or ``.item()``, or indices read with
``.tolist()`` or ``.numpy()``, and given back to an operation of the forward as an argument,
mixes the examples there as the tensor it was read from would.
"""

from __future__ import annotations

from typing import Any


def note_read(read: dict[float, str], value: float, name: str) -> None:
    """Keep ``value``, read into Python by ``name`` from a tensor computed across the examples,
    unless it is a whole number (a count of the batch's tokens, a mask's largest entry, 0: what
    is read to trim padding or to divide a loss by, and what literals in the model's code
    hold)."""
    if not value.is_integer():
        read[value] = name


def read_back(read: dict[float, str], args: tuple, kwargs: dict) -> str | None:
    """The operation that read a number of ``read`` into Python where one is an argument
    (``h / s``, ``clamp(h, max=s)``): the same double, so the same value, not a coincidence."""
    for a in (*args, *kwargs.values()):
        if a.__class__ is float and a in read:
            return read[a]
    return None


# the operations that read a tensor into a Python list or a NumPy array
READS_ROWS = frozenset({"numpy", "tolist"})


def rows_back(read: dict[int, tuple[Any, str]], args: tuple, kwargs: dict) -> str | None:
    """The operation that read a list or array of ``read`` into Python where that same object
    is an argument, or a part of an index (``h[:, idx]``), of another."""
    for a in (*args, *kwargs.values()):
        for b in a if a.__class__ is tuple else (a,):
            found = read.get(id(b))
            if found is not None and found[0] is b:
                return found[1]
    return None

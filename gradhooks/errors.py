"""The warning and the exception of gradhooks' own (both also ``gradhooks.<name>``).

This module imports nothing from gradhooks, so that every other module can import it.
"""

from __future__ import annotations

__all__ = ["GradhooksWarning", "Grad1TooLarge"]


class GradhooksWarning(RuntimeWarning):
    """A backward whose per-example gradients gradhooks could not capture."""


class Grad1TooLarge(MemoryError):
    """``grad1`` for the captured batch would exceed the memory limit (nothing was allocated;
    see :mod:`gradhooks.engine.memory`)."""

"""The warning and the exceptions of gradhooks' own (both also ``gradhooks.<name>``).

This module imports nothing from gradhooks, so that every other module can import it.
"""

from __future__ import annotations

__all__ = ["GradhooksWarning", "Grad1TooLarge", "PrivacyBudgetExceeded"]


class GradhooksWarning(RuntimeWarning):
    """A backward whose per-example gradients gradhooks could not capture."""


class Grad1TooLarge(MemoryError):
    """``grad1`` for the captured batch would exceed the memory limit (nothing was allocated;
    see :mod:`gradhooks.engine.memory`)."""


class PrivacyBudgetExceeded(RuntimeError):
    """A DP-SGD step past the privacy budget that :func:`gradhooks.make_private` was given
    (its ε, δ and number of steps are in the message); nothing was computed or changed."""

"""Pausing capture: one switch per handle, under one for the whole process.

A :class:`Pause` is on unless a ``with pause():`` block is running, it was switched off
(:meth:`Pause.switch`), or its parent is not on. Every :class:`gradhooks.Hooks` handle has one
whose parent is :data:`PROCESS`: ``with h.paused():`` pauses that handle alone,
:func:`paused` and :func:`set_enabled` (autograd-hacks' ``disable_hooks`` /
``enable_hooks``) every handle. Capture is also off while ``torch.jit.trace`` traces (the
trace is of the model alone). This module imports nothing of gradhooks, so rules and oracles
may pause capture without importing the engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..errors import ConfigurationTypeError

__all__ = ["Pause", "PROCESS", "paused", "set_enabled"]


class Pause:
    """Whether capture is on, for one handle (``parent``: the process's switch) or all."""

    def __init__(self, parent: Pause | None = None) -> None:
        self.parent = parent
        self._depth = 0  # `with pause():` blocks running
        self._off = False  # switched off until switched on again

    @property
    def on(self) -> bool:
        if self._off or self._depth:
            return False
        parent = self.parent
        while parent is not None:  # (its parents' switches read here: one call, not one each)
            if parent._off or parent._depth:
                return False
            parent = parent.parent
        # (torch.jit.trace of a hooked model records the model's operations, not the hooks':
        # capture is off while it traces)
        return not torch.jit.is_tracing()

    def switch(self, on: bool) -> None:
        """Switch capture on or off until the next switch (``with`` blocks still pause)."""
        self._off = not on

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        """Capture is off within the block (blocks nest)."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1


PROCESS = Pause()
"""The switch every handle's :class:`Pause` is under."""


def set_enabled(enabled: bool) -> None:
    """Switch capture on or off for every hooked model (autograd-hacks' enable/disable)."""
    if enabled is None or isinstance(enabled, (str, bytes)):
        raise ConfigurationTypeError(
            f"set_enabled takes True or False, got {type(enabled).__qualname__} {enabled!r}"
        )
    PROCESS.switch(bool(enabled))


def paused() -> contextlib.AbstractContextManager[None]:
    """Within the block, no hooked model captures anything (the oracles run under it)::

    with gradhooks.paused():
        loss.backward()  # no grad1 written, on any model
    """
    return PROCESS()

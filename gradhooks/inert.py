"""What a gradhooks hook becomes in a copy or an unpickled model.

A hooked model's hook objects pickle (and deep-copy) as :class:`InertHook`, so a saved model
names this class by its path, ``gradhooks.inert.InertHook``: it stays here, in a module that
imports nothing from gradhooks.
"""

from __future__ import annotations

from typing import Any

__all__ = ["InertHook"]


class InertHook:
    """What a gradhooks hook becomes in a copy or an unpickled model: it does nothing (the copy
    is not hooked; hook it with ``add_hooks``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        return None

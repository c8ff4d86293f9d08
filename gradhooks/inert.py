"""What a gradhooks hook becomes in a copy or an unpickled model.

A hooked model's hook objects pickle (and deep-copy) as :class:`InertHook`, so a saved model
names this class by its path, ``gradhooks.inert.InertHook``: it stays here, in a module that
imports nothing from gradhooks when it is loaded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["InertHook"]


class InertHook:
    """What a gradhooks hook becomes in a copy or an unpickled model: it computes nothing (the
    copy is not hooked; hook it with ``add_hooks``).

    A pickled model (``pickle``, ``torch.save(model)``) carries its parameters' ``grad1``: the
    original's, of its last backward. At the first call of its module with grad enabled, this
    hook deletes the ``grad1`` of the module's parameters that no active handle covers, so that
    a copy trained without hooks never shows the original's ``grad1`` as its own (read before
    that, it is the original's, as saved). Where an active handle covers them
    (``add_hooks(copy)``), that handle's first backward replaces the ``grad1`` it carries, or
    deletes it where the backward does not reach the parameter. A deep copy carries no
    ``grad1`` (``Parameter.__deepcopy__`` copies the data alone).
    """

    def __init__(self) -> None:
        self.swept = False

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        if self.swept or not args or not isinstance(args[0], nn.Module):
            return None
        if torch.is_grad_enabled():
            self.swept = True
            from .engine.handle import drop_uncovered_grad1  # (not at import: see above)

            drop_uncovered_grad1(args[0])
        return None

    def __reduce__(self):
        return (InertHook, ())  # (each copy sweeps its own parameters afresh)

"""What a gradhooks hook, or handle, becomes in a copy or an unpickled model.

A hooked model's hook objects pickle (and deep-copy) as :class:`InertHook`, and a handle the
model holds as an attribute as :class:`InertHandle`, so a saved model names these classes by
their path, ``gradhooks.inert.InertHook``: they stay here, in a module that imports nothing
of gradhooks but its errors. What an inert hook deletes is said by the engine, which registers
it with :func:`sweep_with`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .errors import StateError

__all__ = ["InertHandle", "InertHook", "sweep_with"]

# deletes the grad1 of a module's parameters that no active handle covers (the engine's)
_sweeps: list[Callable[[nn.Module], None]] = []


def sweep_with(sweep: Callable[[nn.Module], None]) -> None:
    """Register what an :class:`InertHook` does at its module's first call with grad enabled
    (:func:`gradhooks.engine.handle.drop_uncovered_grad1`)."""
    if sweep not in _sweeps:
        _sweeps.append(sweep)


_COMPILING = getattr(getattr(torch, "compiler", None), "is_compiling", None)


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
    ``grad1`` (``Parameter.__deepcopy__`` copies the data alone). Inside ``torch.compile``'s
    tracing (a copy compiled, an EMA of a compiled model) it does nothing: an eager call of
    the module sweeps.
    """

    def __init__(self) -> None:
        self.swept = False

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        if self.swept or not args or not isinstance(args[0], nn.Module):
            return None
        if _COMPILING is not None and _COMPILING():
            return None  # (traced by torch.compile, which cannot run the sweep: an eager call's)
        if torch.is_grad_enabled():
            self.swept = True
            for sweep in _sweeps:
                sweep(args[0])
        return None

    def __reduce__(self):
        return (InertHook, ())  # (each copy sweeps its own parameters afresh)


class InertHandle:
    """What a :class:`gradhooks.Hooks` handle held by a model (``self.hooks =
    gradhooks.add_hooks(self)``) becomes in the model's deep copy or unpickled copy: the copy
    is not hooked. ``active`` is ``False`` and ``remove()`` does nothing, as on a removed
    handle; anything else raises :class:`gradhooks.StateError`, saying to hook the copy."""

    active = False

    def __init__(self, model: str) -> None:
        self._model = model

    def remove(self) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_model":
            raise AttributeError(name)
        raise StateError(
            f"this gradhooks handle was copied with the model that holds it ({self._model}): "
            f"the copy is not hooked, so its handle has no {name!r}. Hook the copy with "
            "gradhooks.add_hooks(copy) (and keep that handle), or keep the handle outside "
            "the model."
        )

    def __reduce__(self):
        return (InertHandle, (self._model,))

    def __repr__(self) -> str:
        return f"Hooks(copied with {self._model}: not hooked)"

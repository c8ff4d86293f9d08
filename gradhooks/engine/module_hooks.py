"""A module's backward hooks of the user's that change the gradient.

A full backward hook (``register_full_backward_hook``) may return a new gradient for its
module's inputs, a backward pre-hook (``register_full_backward_pre_hook``) one for its outputs.
No check of gradhooks' own runs a backward through them (they fire as often as without
gradhooks: :meth:`gradhooks.engine.verify.Verifier.user_backward_hooks`), so what they do is
checked where they run. On each module that holds such hooks when :func:`gradhooks.add_hooks`
is called, a hook of gradhooks' put first keeps the gradients the user's hooks are given, and
one put last compares them with what the user's hooks made of them (returned, or changed in
place): the same, or the same multiplied by one number (a gradient reversal, or a division by
the batch gradient's norm), and the per-example gradients follow, as for a parameter's hook;
anything else (a clamp, a division by the batch's norm, which mixes the examples) is refused,
since no per-example gradient gives the ``.grad`` it makes. Hooks registered after
``add_hooks`` (or removed) change the module's backward hooks, which the forwards compare
(:func:`gradhooks.engine.plan.state_key`): at the next forward gradhooks' two hooks are put
around them again (on the model itself, whose call takes its hooks before its forward
pre-hooks run, from the forward after).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .. import _torch
from ..errors import UnsupportedError
from .records import Hook
from .state import CaptureState

__all__ = ["BackwardHookGuards"]


class BackwardHookGuards:
    """gradhooks' first and last hooks around the backward hooks of the user's on each module
    of a model, put again where a module's hooks changed since (:meth:`follow`). ``abort``
    undoes the backward a refusal stops (its ``grad1`` and its additions to ``.grad``)."""

    def __init__(self, state: CaptureState, abort: Callable[[], None]) -> None:
        self.state, self.abort = state, abort
        self.kept: dict[tuple[int, str], tuple] = {}
        # id(module) -> (the ids of its backward hooks, ours with them; our handles on it)
        self.guarded: dict[int, tuple[tuple, list]] = {}

    def follow(self, model: nn.Module) -> None:
        """Guard each module of ``model`` whose backward hooks differ from those it held when
        it was last guarded (or that was never guarded): ours come off, and go on again around
        the user's, first and last."""
        none: tuple = ((), ())
        if all(
            _torch.module_backward_hooks(m) == self.guarded.get(id(m), (none,))[0]
            for m in model.modules()
        ):
            return
        seen = set()
        for name, m in model.named_modules():
            seen.add(id(m))
            was = self.guarded.pop(id(m), None)
            if was is not None:
                if _torch.module_backward_hooks(m) == was[0]:
                    self.guarded[id(m)] = was
                    continue
                for h in was[1]:
                    h.remove()
            full, pre = _torch.module_backward_hooks(m)
            if full or pre:
                handles = self._guard(name, m, bool(full), bool(pre))
                self.guarded[id(m)] = (_torch.module_backward_hooks(m), handles)
        for key in [k for k in self.guarded if k not in seen]:  # (modules taken out)
            for h in self.guarded.pop(key)[1]:
                h.remove()

    def remove(self) -> None:
        for _, handles in self.guarded.values():
            for h in handles:
                h.remove()
        self.guarded.clear()

    def _guard(self, name: str, m: nn.Module, full: bool, pre: bool) -> list:
        state, kept, abort, handles = self.state, self.kept, self.abort, []
        where = f"'{name or '<model>'}' ({type(m).__qualname__})"
        for on, key, kind, register in (
            (full, (id(m), "in"), "full backward hook", m.register_full_backward_hook),
            (pre, (id(m), "out"), "backward pre-hook", m.register_full_backward_pre_hook),
        ):
            if on:
                handles.append(register(Hook(_keep(state, kept, key, 1)), prepend=True))
                handles.append(register(Hook(_compare(state, kept, key, 1, where, kind, abort))))
        return handles


def _active(state: CaptureState) -> bool:
    return not state.removed and state.mode.capture and state.capturing_backward()


def _keep(state: CaptureState, kept: dict, key: tuple, at: int):
    def keep(*args: Any) -> None:
        if _active(state):  # (copies: a hook may change the tensors it is given in place)
            kept[key] = tuple(None if g is None else g.detach().clone() for g in args[at])

    return keep


def _compare(
    state: CaptureState, kept: dict, key: tuple, at: int, where: str, kind: str,
    abort: Callable[[], None],
):  # fmt: skip
    def compare(*args: Any) -> None:
        before = kept.pop(key, None)
        if before is None or not _active(state):
            return
        after = tuple(args[at])
        if all(_multiple(a, b) for a, b in zip(after, before, strict=True)):
            return
        abort()
        raise UnsupportedError(
            f"gradhooks: a {kind} of yours on {where} changed the gradient it was given "
            "otherwise than by a factor (each entry clamped, or the batch's gradient divided "
            "by its norm, which mixes the examples): no per-example gradient gives the .grad "
            "it makes, and grad1 would not be the examples' own. Change grad1 or the "
            "gradients after the backward, or remove the hook while the hooks are on; a hook "
            "that multiplies the gradient by a number is followed."
        )

    return compare


def _multiple(a: Tensor | None, b: Tensor | None) -> bool:
    """Whether ``a`` is ``b`` multiplied by one number (``None`` only as ``None``)."""
    if a is None or b is None:
        return a is b
    if a.shape != b.shape:
        return False
    a64, b64 = a.detach().double(), b.detach().double()
    if torch.equal(a64, b64):
        return True
    scale = float(b64.square().sum())
    if scale == 0.0:
        return not bool(a64.any())
    c = float((a64 * b64).sum()) / scale
    tol = 8 * torch.finfo(a.dtype).eps if a.is_floating_point() else 0.0
    return bool(torch.allclose(a64, c * b64, rtol=tol, atol=tol * float(a64.abs().max())))

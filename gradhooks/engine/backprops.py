"""What autograd-hacks parks on each layer (``layer.activations``, ``layer.backprops_list``),
kept by the handle instead, for ``add_hooks(model, keep_backprops=True)``:
:meth:`gradhooks.Hooks.activations` and :meth:`gradhooks.Hooks.backprops`.

Per hooked module, the input of its last call in the forward that a captured backward went
through, and the gradient of the loss with
respect to its output, one per captured call reached by a backward, in the order the backwards
reached them (a module called twice in a forward gets two per backward). Both are detached and
taken as the call saw them: the output-gradient of a mean-reduced loss holds its ``1/batch``.
Kept until :meth:`gradhooks.Hooks.clear` (``clear_backprops``), as autograd-hacks keeps them
until its ``clear_backprops``.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from ..errors import ConfigurationError, StateError
from ..rules.registry import Call
from .plan import Target

__all__ = ["KeptBackprops"]


class KeptBackprops:
    """Per module (by identity), the last call's first input and every output-gradient."""

    def __init__(self) -> None:
        self._activations: dict[int, Tensor | None] = {}
        self._backprops: dict[int, list[Tensor | None]] = {}
        self._task: dict[int, int] = {}  # the backward that set each module's activations

    def record(self, module: nn.Module, call: Call, task: int) -> None:
        """Backward ``task`` reached ``call`` of ``module``. A backward reaches a module's
        calls last to first: its first one there is the forward's last (the one whose input
        autograd-hacks' forward hook kept)."""
        if self._task.get(id(module)) != task:
            self._task[id(module)] = task
            first = call.inputs[0] if call.inputs else None
            self._activations[id(module)] = first if isinstance(first, Tensor) else None
        grad = call.grad_outputs[0] if call.grad_outputs else None
        self._backprops.setdefault(id(module), []).append(None if grad is None else grad.detach())

    def activations(self, module: nn.Module) -> Tensor | None:
        return self._activations.get(id(module))

    def backprops(self, module: nn.Module) -> list[Tensor | None]:
        return list(self._backprops.get(id(module), []))

    def reached(self, module: nn.Module) -> bool:
        return id(module) in self._backprops

    def clear(self) -> None:
        self._activations.clear()
        self._backprops.clear()
        self._task.clear()


def kept_for(
    kept: KeptBackprops | None, targets: Sequence[Target], module: nn.Module, what: str
) -> KeptBackprops:
    """What a handle kept (``kept``), for :meth:`gradhooks.Hooks.activations` and
    :meth:`gradhooks.Hooks.backprops` of ``module``; refused where it keeps nothing, does not
    hook ``module``, or no captured backward reached it."""
    if kept is None:
        raise StateError(
            f"Hooks.{what}: this handle keeps no layer inputs or output-gradients; add the "
            "hooks with gradhooks.add_hooks(model, keep_backprops=True) (they then stay in "
            "memory until h.clear())"
        )
    if not any(t.module is module for t in targets):
        raise ConfigurationError(
            f"Hooks.{what}: {type(module).__qualname__} is not a module this handle hooks "
            "(h.modules() lists them: modules with trainable parameters and a rule, or the "
            "fallback)"
        )
    if not kept.reached(module):
        name = next(t.name for t in targets if t.module is module)
        raise StateError(
            f"Hooks.{what}: no captured backward reached '{name}' "
            f"({type(module).__qualname__}) since the hooks were added or h.clear(); run "
            "the forward and the backward first"
        )
    return kept

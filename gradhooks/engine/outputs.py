"""The output a hooked layer computed, where a global forward hook returns another.

A layer's rule takes its output-gradient at the output the engine's forward hook sees. The
engine's hook runs first among the module's own forward hooks, but torch runs the global ones
(``torch.nn.modules.module.register_module_forward_hook``) before any module's: one that
returns a new output (``out * 2``) would hide the layer's own, and the output-gradient would be
the new output's (a wrong ``grad1``). So while global forward hooks of someone else's are
registered, a global hook of gradhooks' runs first of them all (:class:`LayerOutputs`) and
keeps, for each hooked call, the output the layer returned; the engine's forward hook takes
that one. With no other global forward hook, none of gradhooks' is registered (a global hook
makes every module call in the process take torch's slower path).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from .. import _torch


class LayerOutputs:
    """Keeps the output each hooked call returned, before the global forward hooks of others
    run (see the module docstring). ``hooked(module)``: whether the engine captures the
    module's calls."""

    def __init__(self, hooked: Callable[[nn.Module], bool]) -> None:
        self.hooked = hooked
        self.handle: Any = None
        self.kept: dict[int, Any] = {}  # id(module) -> the output its call returned

    def follow(self) -> None:
        """At each forward of the model: first among the global forward hooks while others'
        are registered; none of gradhooks' otherwise."""
        others = _torch.global_forward_hook_count() - (self.handle is not None)
        if others > 0:
            self.handle = _torch.first_global_forward_hook(self._keep, self.handle)
        elif self.handle is not None:
            self.remove()
        self.kept.clear()

    def _keep(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.hooked(module):
            self.kept[id(module)] = output

    def take(self, module: nn.Module, output: Any) -> Any:
        """The output ``module``'s call returned (``output``, the one the hooks before the
        engine's left, where no global hook of others ran)."""
        return self.kept.pop(id(module), output) if self.kept else output

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        self.kept.clear()

"""What a forward's tracker tells the engine, and asks of it.

A :class:`~gradhooks.tracking.tracker.Tracker` follows the batch through one forward; where the
model uses a parameter outside its module's call, or runs a torch function the registry has a
rule for, the engine must act. The tracker reaches it only through :class:`EngineLink`, which
the engine implements (:class:`gradhooks.engine.link.TrackerLink`); ``None`` in tests of the
layouts alone. Nothing here imports :mod:`gradhooks.engine`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from torch import Tensor

if TYPE_CHECKING:
    from .sources import Source
    from .tracker import Tracker

__all__ = ["EngineLink"]


class EngineLink(Protocol):
    """The engine, as a tracker sees it."""

    @property
    def probing(self) -> bool:
        """Inside the engine's check of one example, whose backward captures nothing (no
        source is given its per-example gradients)."""
        ...

    def nested(self) -> AbstractContextManager[None]:
        """A backward of the tracker's own, run inside one of the model's (per-example
        gradients through batch-free operations): the hooks it reaches are not the model's."""
        ...

    def direct_source(self, source: Source, p: Tensor) -> None:
        """``p`` was used outside its module's call; ``source`` collects the per-example
        gradients of those uses, for ``p.grad1``."""
        ...

    def direct_reached(self, held: tuple[tuple[int, Source], ...], unknown: dict) -> None:
        """A backward passes through an operation that used parameters directly: ``held``,
        ``(id(param), source)`` pairs; ``unknown``: the tracker's operations of unknown layout."""
        ...

    def unheld(self, source: Source) -> None:
        """``source`` has a problem that no autograd graph holds: keep it until a backward
        ends, so that the parameter's gradient reports it."""
        ...

    def coupled_reached(self, why: str, after: tuple) -> None:
        """A backward reaches a product that couples the examples' gradients (``why``, see
        :mod:`gradhooks.tracking.couplings`); ``after``: the autograd nodes it passes to
        next. The engine refuses a backward that writes ``grad1``."""
        ...

    def lost_reached(self, why: str, after: tuple) -> None:
        """A backward reaches an operation that lost the examples' rows (``why``, see
        :func:`~gradhooks.tracking.alone.guard_rows`); ``after``: the autograd nodes
        it passes to next. The engine refuses a backward that writes ``grad1``."""
        ...

    def functional_use(
        self,
        func: Callable,
        name: str,
        args: tuple,
        kwargs: dict,
        direct: list[Tensor],
        tracker: Tracker,
    ) -> Any:
        """Parameters ``direct`` used directly in ``func(*args, **kwargs)``: the engine runs and
        captures the call (a torch function the registry has a rule for) and returns its
        output, or returns ``NotImplemented`` and the tracker goes on."""
        ...

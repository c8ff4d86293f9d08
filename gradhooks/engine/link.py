"""The engine as a forward's tracker sees it: :class:`TrackerLink`, which implements
:class:`gradhooks.tracking.link.EngineLink` by handing each report of the tracker to the part of
the engine that acts on it."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ..tracking import Source, Tracker

__all__ = ["TrackerLink"]


@dataclass(frozen=True)
class TrackerLink:
    """:class:`~gradhooks.tracking.link.EngineLink`, made of the engine's own methods (see
    there for what each does)."""

    is_probing: Callable[[], bool]
    nested: Callable[[], AbstractContextManager[None]]
    direct_source: Callable[[Source, Tensor], None]
    direct_reached: Callable[[tuple[tuple[int, Source], ...], dict], None]
    unheld: Callable[[Source], None]
    coupled_reached: Callable[[str, tuple], None]
    lost_reached: Callable[[str, tuple], None]
    functional_use: Callable[[Callable, str, tuple, dict, list[Tensor], Tracker], Any]

    @property
    def probing(self) -> bool:
        return self.is_probing()

"""The autocast a computation ran under, to run it again under the same: a layer's call
recomputed by its rule or the fallback, an operation recomputed by the tracker at the backward
(where autocast is off, or other, than at the forward)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["autocast_as", "autocast_enabled", "autocast_state"]


def autocast_enabled(device: str) -> bool:
    """Whether autocast is on for ``device`` (``"cpu"`` or ``"cuda"``)."""
    try:
        return torch.is_autocast_enabled(device)
    except TypeError:  # (torch before 2.4: no device argument)
        return torch.is_autocast_cpu_enabled() if device == "cpu" else torch.is_autocast_enabled()


def autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    """The autocast on now: ``((device, dtype), ...)`` for each device it is on for."""
    state = []
    for d in ("cpu", "cuda"):
        if autocast_enabled(d):
            try:
                dtype = torch.get_autocast_dtype(d)
            except AttributeError:  # (torch before 2.4)
                dtype = (
                    torch.get_autocast_cpu_dtype() if d == "cpu" else torch.get_autocast_gpu_dtype()
                )
            state.append((d, dtype))
    return tuple(state)


@contextlib.contextmanager
def autocast_as(state: tuple[tuple[str, torch.dtype], ...]) -> Iterator[None]:
    """Autocast on as :func:`autocast_state` found it (nothing, for an empty state)."""
    with contextlib.ExitStack() as stack:
        for d, dtype in state:
            stack.enter_context(torch.autocast(d, dtype=dtype))
        yield

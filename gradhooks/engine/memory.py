"""The memory limit on ``grad1``.

Before a forward is captured, the engine estimates the size of ``grad1`` for the whole model,
``batch × Σ numel(p) × element size`` over the trainable parameters it covers, and refuses
with :class:`~gradhooks.Grad1TooLarge` when it exceeds the limit. The limit is, in order: the
``max_grad1_bytes`` given to :func:`gradhooks.add_hooks`, the one set with
:func:`set_memory_limit`, or half of the memory of the parameters' device (total RAM for CPU).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from ..errors import ConfigurationError, Grad1TooLarge

__all__ = ["set_memory_limit", "memory_limit", "refuse_if_too_large"]

# None: no limit; "auto": half of the device's memory; an int: bytes
_LIMIT: list[int | str | None] = ["auto"]
_AUTO_FRACTION = 0.5


def set_memory_limit(limit: int | str | None) -> None:
    """Largest ``grad1`` (all parameters of a hooked model together, in bytes) that a captured
    forward may lead to: an int, ``"auto"`` (default: half of the memory of the device holding
    the parameters, total RAM for CPU) or ``None`` (no limit). ``add_hooks(...,
    max_grad1_bytes=...)`` overrides it for one handle."""
    whole = isinstance(limit, int) and not isinstance(limit, bool) and limit >= 0
    if not (limit is None or limit == "auto" or whole):  # (True: 1 byte, every grad1 refused)
        raise ConfigurationError(
            f"the memory limit must be bytes (int >= 0), 'auto' or None, got {limit!r}"
        )
    _LIMIT[0] = limit


def memory_limit(device: torch.device, override: int | str | None = "auto") -> int | None:
    """The limit in bytes for ``grad1`` on ``device`` (``None``: unlimited)."""
    limit = override if override != "auto" else _LIMIT[0]
    if limit != "auto":
        return limit  # type: ignore[return-value]
    total = _device_memory(device)
    return None if total is None else int(total * _AUTO_FRACTION)


def _device_memory(device: torch.device) -> int | None:
    """The memory of ``device`` (``None``: not known), asked once per device (a backward asks
    at its first call). By the device itself: reading its ``type`` costs more than the
    lookup."""
    found = _MEMORY.get(device, _UNASKED)
    if found is _UNASKED:
        found = _MEMORY[device] = _ask_device_memory(device)
    return found


_MEMORY: dict[torch.device, int | None] = {}
_UNASKED = object()


def _ask_device_memory(device: torch.device) -> int | None:
    try:
        if device.type == "cuda":
            return torch.cuda.get_device_properties(device).total_memory
        if device.type == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError, RuntimeError):
        pass
    return None


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def refuse_if_too_large(
    model_name: str | Callable[[], str], batch: int, numel: int, itemsize: int,
    device: torch.device, override,
) -> None:  # fmt: skip
    """Raise :class:`~gradhooks.Grad1TooLarge` when ``batch × numel × itemsize`` exceeds the
    limit (``model_name``: the model as the message names it, or what makes that name, called
    only to say so: this runs at every backward)."""
    need = batch * numel * itemsize
    limit = memory_limit(device, override)
    if limit is None or need <= limit:
        return
    if callable(model_name):
        model_name = model_name()
    per_example = numel * itemsize
    fits = limit // max(per_example, 1)
    raise Grad1TooLarge(
        f"grad1 for {model_name} would take {_size(need)} (batch {batch} × {numel:,} trainable "
        f"parameters × {itemsize} bytes), over the limit of {_size(limit)} on {device}; nothing "
        f"was allocated and the forward was not run. Use add_hooks(model, quantities=('norms',)) "
        f"(per-example norms, DP-SGD by ghost clipping: never forms grad1), a batch of at most "
        f"{fits}, or freeze parameters; or raise the limit with add_hooks(..., max_grad1_bytes=...) "
        "or gradhooks.set_memory_limit(bytes or None). What looks for a smaller batch when a "
        "step runs out of memory (accelerate's find_executable_batch_size, the Trainer's "
        "auto_find_batch_size) takes this as out of memory."
    )

"""The autocast a computation ran under, to run it again under the same: a layer's call
recomputed by its rule or the fallback, an operation recomputed by the tracker at the backward
(where autocast is off, or other, than at the forward)."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator, Mapping

import torch
from torch import Tensor

from . import _torch

__all__ = ["CastCache", "autocast_as", "autocast_enabled", "autocast_state", "cast_versions"]


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


class CastCache:
    """The versions of the parameters whose casts ``torch.autocast``'s cache may hold.

    Within one autocast block with its cache on (the default), autocast casts a float32 leaf
    that requires grad (a parameter) at its first use and reuses that cast until the outermost
    block exits, also after the parameter was changed in place: an optimizer's step taken
    inside the block leaves the block's later forwards running with the weights of before the
    step. A rule that computes from the parameters (:meth:`gradhooks.Call.parameter`) would
    compute with the new values, where autograd's ``.grad`` is of the cast the forward ran with;
    so a call's parameter versions are those of its parameters' first captured call in the
    block, and the rule's read of one changed since is refused, as a parameter changed in place
    between the forward and its backward is.

    The blocks are told apart by a sentinel of this object's own that the cache holds too: the
    autograd node of its cast is the same object for as long as the block lasts (no values are
    read, nothing waits for a device). Autocast's cache is one per thread, shared by every
    model and handle: so is this object (:func:`cast_versions`), so that hooks added again
    inside the block see what the earlier ones saw."""

    def __init__(self) -> None:
        self._sentinels: dict[str, Tensor] = {}  # a float32 leaf per device type
        self._block: tuple = ()  # the nodes of the sentinels' casts in the block seen last
        self._first: dict[int, tuple[weakref.ref, int]] = {}  # id -> (parameter, version)

    def _nodes(self, state: tuple[tuple[str, torch.dtype], ...]) -> tuple:
        nodes = []
        for device, _ in state:
            s = self._sentinels.get(device)
            if s is None:
                s = self._sentinels[device] = torch.ones(1, 1, device=device, requires_grad=True)
            with torch.enable_grad():
                nodes.append(torch.mm(s, s).grad_fn.next_functions[0][0])
        return tuple(nodes)

    def versions(
        self, params: Mapping[str, Tensor], state: tuple[tuple[str, torch.dtype], ...]
    ) -> dict[str, int]:
        """The version of each of ``params`` (a captured call's, under the autocast ``state``
        with its cache on) that the call's forward ran with: its version at its first captured
        call in this autocast block, where autocast may have cast it; its version now where
        autocast does not cache it (not a float32 leaf that requires grad on a device autocast
        is on for)."""
        try:
            block = self._nodes(state)
        except (RuntimeError, NotImplementedError):  # (no product of the autocast dtype here)
            return {n: _torch.version(t) for n, t in params.items()}
        if len(block) != len(self._block) or any(a is not b for a, b in zip(block, self._block)):
            self._block, self._first = block, {}  # (a new block: a new cache)
        devices = {d for d, _ in state}
        found = {}
        for n, t in params.items():
            version = _torch.version(t)
            leaf = t.requires_grad and t.is_leaf and _torch.view_base(t) is None
            if t.dtype == torch.float32 and leaf and t.device.type in devices:
                seen = self._first.get(id(t))
                if seen is not None and seen[0]() is t:
                    version = seen[1]
                else:
                    self._first[id(t)] = (weakref.ref(t), version)
            found[n] = version
        return found


_per_thread = threading.local()


def cast_versions(
    params: Mapping[str, Tensor], state: tuple[tuple[str, torch.dtype], ...]
) -> dict[str, int]:
    """:meth:`CastCache.versions` by this thread's :class:`CastCache`, as autocast's cache is
    this thread's."""
    cache = getattr(_per_thread, "cache", None)
    if cache is None:
        cache = _per_thread.cache = CastCache()
    return cache.versions(params, state)

"""Calls the tracker cannot see into: a TorchScript module inside the hooked model.

No torch function that a TorchScript module runs reaches the tracker's mode, so on its own the
tracker would take the module's outputs for tensors without the examples, and the layer after
it for one whose gradient belongs to no example. While a tracked forward of a model that holds
such a module runs, a forward hook on every module (torch's ``register_module_forward_hook``:
a TorchScript module takes no hook of its own) sees each of its calls. Where its inputs hold the
examples on one dimension, the module runs again, without gradient, on its first and on its
last example alone: where each gives its own row of every output (to the rounding of the
outputs' dtype), the outputs hold the examples on that dimension; otherwise (a statistic of the
batch, dropout in training mode) they are mixed, and a layer that reads them is refused naming
the module. A trainable TorchScript module is refused before anything is hooked
(:func:`.plan.refuse_scripted`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ..tracking import UNKNOWN, Layout, Tracker
from ..tracking.alone import differs_alone
from .records import tree_leaves

__all__ = ["follow_scripted"]


def follow_scripted(tracker: Tracker, scripted: dict[int, str]) -> RemovableHandle | None:
    """While the handle it returns is not removed, each call of a module of ``scripted`` (by
    id, with its qualified name) gives its outputs a layout in ``tracker``; ``None`` where
    there is no such module."""
    if not scripted:
        return None

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        name = scripted.get(id(module))
        if name is not None and not tracker.off:
            _follow(tracker, module, name, args, kwargs, output)

    return torch.nn.modules.module.register_module_forward_hook(hook, with_kwargs=True)


def _follow(
    tracker: Tracker, module: nn.Module, name: str, args: tuple, kwargs: dict, output: Any
) -> None:
    ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
    lays = {lay for t in ins if (lay := tracker.presumed_of(t)) is not None}
    outs = [t for t in tree_leaves(output) if isinstance(t, Tensor)]
    if not lays or not outs:
        return  # (inputs without the examples: so are its outputs)
    where = f"the TorchScript module '{name}' ({type(module).__qualname__})"
    lay = next(iter(lays))
    if len(lays) > 1 or lay is UNKNOWN or not lay.plain or lay.dim < 0:
        tracker.mark_mixed(outs, f"{where}, whose inputs hold the examples as it cannot check")
        return
    n, d = tracker.batch, lay.dim
    if any(o.dim() <= d or o.shape[d] != n for o in outs):
        tracker.mark_mixed(outs, f"{where}, an output of which does not hold the batch")
        return
    why = _mixes(tracker, module, lay, args, kwargs, outs) if n > 1 else None
    if why is not None:
        tracker.mark_mixed(outs, f"{where}, {why}")
        return
    for o in outs:
        tracker.set_layout(o, lay)


def _mixes(
    tracker: Tracker, module: nn.Module, lay: Layout, args: tuple, kwargs: dict, outs: list
) -> str | None:
    """Why ``module`` run on its first and on its last example alone does not give their rows
    of ``outs``; ``None`` where it does. Its buffers are put back as they were after."""
    kept = [(b, b.clone()) for b in module.buffers()]
    try:
        with tracker.paused():
            return differs_alone(
                lambda a, k: module(*a, **k), args, kwargs,
                lambda t: tracker.presumed_of(t) == lay, lay.dim, tracker.batch, outs,
                [lay.dim] * len(outs),
            )  # fmt: skip
    finally:
        with torch.no_grad():
            for b, before in kept:
                b.copy_(before)

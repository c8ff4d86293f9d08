"""autograd-hacks' API, so that ``import gradhooks as autograd_hacks`` runs its recipe unchanged::

    autograd_hacks.add_hooks(model)
    loss_fn(model(x), y).backward()
    autograd_hacks.compute_grad1(model)        # loss_type='mean' (default) or 'sum'
    param.grad1                                # [batch, *param.shape]
    autograd_hacks.clear_backprops(model)
    autograd_hacks.remove_hooks(model)

Differences, all in the user's favour: ``grad1`` is already there after ``backward()``
(``compute_grad1`` only confirms or corrects the loss reduction); modules called twice, tied
weights and every layer with a rule are correct; a second backward without ``clear_backprops``
accumulates (as ``.grad`` does) instead of asserting.
"""

from __future__ import annotations

from typing import Literal

from torch import nn

from .engine import hooks_of, set_enabled
from .registry import REGISTRY

__all__ = ["compute_grad1", "clear_backprops", "disable_hooks", "enable_hooks", "is_supported"]


def compute_grad1(model: nn.Module, loss_type: Literal["mean", "sum"] = "mean") -> None:
    """Make ``param.grad1`` hold per-example gradients for a loss reduced with ``loss_type``.

    gradhooks computes ``grad1`` during ``backward()`` with the ``loss_reduction`` given to
    :func:`add_hooks` (default ``"mean"``); when ``loss_type`` differs, the ``grad1`` of the
    captured backward is rescaled and later backwards use ``loss_type``.
    """
    hooks = hooks_of(model)
    if not hooks.captured:
        raise RuntimeError(
            "compute_grad1: no backward pass was captured since add_hooks or clear_backprops. "
            "Run the forward and loss.backward() with the hooks on (add_hooks before the forward)."
        )
    hooks.rescale(loss_type)


def clear_backprops(model: nn.Module) -> None:
    """End the current accumulation: the next backward replaces ``grad1`` instead of adding."""
    hooks_of(model).clear()


def disable_hooks() -> None:
    """Stop capturing on every hooked model until :func:`enable_hooks`."""
    set_enabled(False)


def enable_hooks() -> None:
    """Capture again after :func:`disable_hooks`."""
    set_enabled(True)


def is_supported(layer: nn.Module) -> bool:
    """Whether a rule in the default registry covers ``layer``."""
    return REGISTRY.lookup(layer) is not None

"""autograd-hacks' API, so that ``import gradhooks as autograd_hacks`` runs its recipe unchanged::

    autograd_hacks.add_hooks(model)
    loss_fn(model(x), y).backward()
    autograd_hacks.compute_grad1(model)        # loss_type='mean' (default) or 'sum'
    param.grad1                                # [batch, *param.shape]
    autograd_hacks.clear_backprops(model)
    autograd_hacks.remove_hooks(model)

and its Hessian helpers, for a loss of the network's output ``[batch, classes]``::

    autograd_hacks.backprop_hess(output, hess_type="CrossEntropy")  # or "LeastSquares"
    autograd_hacks.compute_hess(model)
    param.hess                                 # [numel, numel]: the loss's Hessian block

Differences, all in the user's favour: ``grad1`` is already there after ``backward()``
(``compute_grad1`` only confirms or corrects the loss reduction); modules called twice, tied
weights and every layer with a rule are correct; ``optimizer.zero_grad()`` /
``model.zero_grad()`` starts ``grad1`` afresh as ``clear_backprops`` does. As in
autograd-hacks, ``compute_grad1`` refuses ``grad1`` that sums several backwards (a second
backward with neither ``clear_backprops`` nor ``zero_grad`` between: "Multiple backprops
detected"); ``param.grad1`` itself holds that sum, as ``.grad`` does.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .engine.api import engine_of
from .engine.handle import active_handles, hooks_of, require_module
from .engine.pause import set_enabled
from .errors import ConfigurationError, ConfigurationTypeError, StateError
from .rules.registry import REGISTRY

__all__ = [
    "compute_grad1",
    "clear_backprops",
    "disable_hooks",
    "enable_hooks",
    "is_supported",
    "backprop_hess",
    "compute_hess",
]


def compute_grad1(model: nn.Module, loss_type: Literal["mean", "sum"] = "mean") -> None:
    """Make ``param.grad1`` hold per-example gradients for a loss reduced with ``loss_type``.

    gradhooks computes ``grad1`` during ``backward()`` with the ``loss_reduction`` given to
    :func:`add_hooks` (default ``"mean"``); when ``loss_type`` differs, the ``grad1`` of the
    captured backward is rescaled and later backwards use ``loss_type``.

    As autograd-hacks' does, it refuses (``RuntimeError``, nothing changed) where ``grad1``
    holds more than one backward: a second backward with neither :func:`clear_backprops` nor
    ``zero_grad()`` since the first.
    """
    require_module(model, "compute_grad1")
    hooks = hooks_of(model)
    if not hooks.captured:
        raise StateError(
            "compute_grad1: no backward pass was captured since add_hooks or clear_backprops. "
            "Run the forward and loss.backward() with the hooks on (add_hooks before the forward)."
        )
    if hooks.accumulated > 1:
        raise StateError(
            f"compute_grad1: Multiple backprops detected: grad1 holds the sum of "
            f"{hooks.accumulated} backwards, as .grad does, with neither clear_backprops(model) "
            "nor optimizer.zero_grad() / model.zero_grad() between them. Call one of them "
            "before each step's forward and backward (or read param.grad1 itself, which keeps "
            "the sum, without compute_grad1)."
        )
    hooks.rescale(loss_type)


def clear_backprops(model: nn.Module) -> None:
    """End the current accumulation: the next backward replaces ``grad1`` instead of adding
    (and the backprops :func:`backprop_hess` kept are forgotten)."""
    require_module(model, "clear_backprops")
    hooks_of(model).clear()


def disable_hooks() -> None:
    """Stop capturing on every hooked model until :func:`enable_hooks`."""
    set_enabled(False)


def enable_hooks() -> None:
    """Capture again after :func:`disable_hooks`."""
    set_enabled(True)


def is_supported(layer: nn.Module) -> bool:
    """Whether a rule in the default registry covers ``layer`` (a module instance)."""
    if not isinstance(layer, nn.Module):  # (a class, or a name: False, whatever it is)
        what = f"the class {layer.__qualname__}" if isinstance(layer, type) else (
            f"{type(layer).__qualname__} {layer!r}"
        )  # fmt: skip
        raise ConfigurationTypeError(
            f"is_supported takes a module instance (torch.nn.Linear(3, 2)), got {what}"
        )
    return REGISTRY.lookup(layer) is not None


def backprop_hess(output: Tensor, hess_type: Literal["CrossEntropy", "LeastSquares"]) -> None:
    """Backpropagate, from the network's ``output`` ``[batch, classes]``, the columns of the
    square root of each example's loss Hessian with respect to it (``"CrossEntropy"``:
    ``diag(p) - p pᵀ`` with ``p`` the softmax; ``"LeastSquares"``: the identity), one backward
    per column, keeping every hooked model's per-example gradients of each for
    :func:`compute_hess`. Each backward adds to ``.grad`` as autograd does; ``grad1`` is left as
    it was. :func:`clear_backprops` forgets what was kept."""
    if hess_type not in ("CrossEntropy", "LeastSquares"):
        raise ConfigurationError(
            f"hess_type must be 'CrossEntropy' or 'LeastSquares', got {hess_type!r}"
        )
    if not isinstance(output, Tensor):
        raise ConfigurationTypeError(
            f"backprop_hess takes the network's output [batch, classes], got "
            f"{type(output).__qualname__}"
        )
    if not output.requires_grad:
        raise ConfigurationError(
            "backprop_hess: the output has no autograd history (detached, or computed under "
            "torch.no_grad()): pass the hooked model's output itself"
        )
    if output.dim() == 2 and output.shape[0] == 0:
        raise ConfigurationError(
            f"backprop_hess: the output {tuple(output.shape)} holds no example: the Hessian, "
            "a mean over the examples, would be 0/0 (NaN)"
        )
    if output.dim() != 2:
        raise ConfigurationError(
            f"backprop_hess needs an output [batch, classes], got {tuple(output.shape)}"
        )
    n, classes = output.shape
    with torch.no_grad():
        if hess_type == "CrossEntropy":
            p = F.softmax(output.detach(), dim=1)
            hess = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]  # [n, c, c]
            vals, vecs = torch.linalg.eigh(hess)
            root = vecs @ torch.diag_embed(vals.clamp_min(0).sqrt()) @ vecs.transpose(1, 2)
            columns = root.transpose(0, 1)  # [c, n, c]: column o of each example's root
        else:
            eye = torch.eye(classes, dtype=output.dtype, device=output.device)
            columns = eye[:, None, :].expand(classes, n, classes)
    handles = active_handles()
    params = {id(h): engine_of(h).parameters() for h in handles}
    kept = {id(h): {pid: getattr(p, "grad1", None) for pid, (_, p) in params[id(h)].items()}
            for h in handles}  # fmt: skip
    records = {id(h): [] for h in handles}
    for column in columns:
        for h in handles:
            h.clear()
        output.backward(column, retain_graph=True)
        for h in handles:
            scale = n if h.loss_reduction == "mean" else 1  # (grad1 is of a sum here)
            written = {id(q) for q in engine_of(h).written()}
            records[id(h)].append({
                pid: p.grad1.detach() / scale
                for pid, (_, p) in params[id(h)].items() if id(p) in written
            })  # fmt: skip
    for h in handles:
        h.clear()
        engine_of(h).hessian_backprops.extend(records[id(h)])
        for pid, (_, p) in params[id(h)].items():
            before = kept[id(h)][pid]
            if before is None:
                if hasattr(p, "grad1"):
                    del p.grad1
            else:
                p.grad1 = before


def compute_hess(model: nn.Module) -> None:
    """``param.hess``, ``[numel, numel]``, for every parameter of a layer with a rule: the
    Hessian of the loss of :func:`backprop_hess` with respect to it (its Gauss-Newton block,
    ``Σ_{example, column} g gᵀ / batch``, which is the Hessian for a layer followed by
    piecewise-linear activations), from the per-example gradients kept since the last
    :func:`clear_backprops`."""
    require_module(model, "compute_hess")
    hooks = hooks_of(model)
    if not engine_of(hooks).hessian_backprops:
        raise StateError(
            "compute_hess: no backprop_hess was run since add_hooks or clear_backprops; run the "
            "forward with the hooks on, then backprop_hess(output, hess_type)"
        )
    for module in model.modules():
        if not is_supported(module):
            continue
        for p in module.parameters(recurse=False):
            rows = [rec[id(p)] for rec in engine_of(hooks).hessian_backprops if id(p) in rec]
            if not rows:
                continue
            jac = torch.stack(rows).flatten(2)  # [columns, batch, numel]
            p.hess = torch.einsum("onp,onq->pq", jac, jac) / jac.shape[1]

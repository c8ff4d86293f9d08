"""The check of a rule: :func:`check_rule` compares its ``grad1`` with the ``torch.func``
oracle (``vmap(grad)``), in float64, for a layer and a batch of inputs, for whoever writes a rule.
It returns a :class:`CheckReport`, as :meth:`gradhooks.Hooks.check` (the check of a handle after
a backward, :mod:`gradhooks.engine.verify`) does.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import Tensor, nn

from .._torch import tree_flatten, tree_map
from ..engine.handle import add_hooks
from ..engine.verify import CheckReport
from ..errors import (
    CheckFailedError,
    ConfigurationError,
    ConfigurationTypeError,
    require_number,
)
from ..oracle import Inputs, _as_tuple, one_number, vmap_grad
from ..rules.registry import REGISTRY, Registry

__all__ = ["check_rule", "CheckReport"]


def _default_loss(output) -> Tensor:
    """Half the sum of squares of every output tensor: sum-reduced over the batch."""
    leaves = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.is_floating_point()]
    return sum(0.5 * (t**2).sum() for t in leaves)


def check_rule(
    module: nn.Module,
    inputs: Inputs,
    loss_fn: Callable[..., Tensor] | None = None,
    *,
    registry: Registry = REGISTRY,
    rtol: float = 1e-7,
    atol: float = 1e-9,
    raise_on_mismatch: bool = True,
) -> CheckReport:
    """Compare gradhooks' ``grad1`` for ``module`` with ``vmap(grad)``, in float64.

    Args:
        module: the layer (or a model) to check; it is copied and converted to float64, so the
            original is untouched.
        inputs: a batched input tensor (or a tuple of them), batch on dimension 0.
        loss_fn: ``loss_fn(output) -> scalar`` that *sums* per-example losses (default: half
            the sum of squares of every output tensor). Both ``loss_reduction="sum"`` and
            ``"mean"`` (the same loss divided by the batch size) are checked.
        registry: the registry that holds the rule under test.

    Returns:
        A :class:`CheckReport`; with ``raise_on_mismatch`` (default) a
        :class:`~gradhooks.CheckFailedError` (an ``AssertionError``) naming each parameter that
        differs, and by how much, is raised instead of returning a failed report.

    Example::

        >>> import torch, gradhooks
        >>> print(gradhooks.check_rule(torch.nn.Linear(3, 2), torch.randn(4, 3)).ok)
        True
    """
    if not isinstance(module, nn.Module):
        what = "the class" if isinstance(module, type) else type(module).__qualname__
        raise ConfigurationTypeError(
            f"check_rule takes a module instance (torch.nn.Linear(3, 2)), got {what} "
            f"{getattr(module, '__qualname__', '')}".rstrip()
        )
    if not any(p.requires_grad for p in module.parameters()):
        raise ConfigurationError(
            f"check_rule: {type(module).__qualname__} has no trainable parameter, so no rule "
            "of it computes anything to check (a frozen copy? check the module with "
            "requires_grad_(True))"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigurationTypeError(
            f"check_rule: loss_fn must be a function loss_fn(output) -> scalar or None, got "
            f"{type(loss_fn).__qualname__} {loss_fn!r}"
        )
    for name, tol in (("rtol", rtol), ("atol", atol)):
        require_number(name, tol, "check_rule")
        if not tol >= 0:
            raise ConfigurationError(f"check_rule: {name} must be >= 0, got {tol!r}")
    if not isinstance(raise_on_mismatch, bool):
        raise ConfigurationTypeError(
            f"check_rule: raise_on_mismatch takes True or False, got {raise_on_mismatch!r}"
        )
    # (gradients whatever the caller's grad mode: under torch.no_grad() nothing would record)
    with torch.inference_mode(False), torch.enable_grad():
        return _check_rule(module, inputs, loss_fn, registry, rtol, atol, raise_on_mismatch)


def _check_rule(
    module: nn.Module, inputs: Inputs, loss_fn: Callable[..., Tensor] | None,
    registry: Registry, rtol: float, atol: float, raise_on_mismatch: bool,
) -> CheckReport:  # fmt: skip
    loss_fn = loss_fn or _default_loss
    model = copy.deepcopy(module).double()
    # (nested inputs too: an LSTMCell's state (h, c); None or a number: no tuple of them)
    xs = tree_map(
        lambda x: x.double() if isinstance(x, Tensor) and x.is_floating_point() else x,
        _as_tuple(inputs) if isinstance(inputs, (Tensor, tuple, list)) else (),
    )
    if not xs or not isinstance(xs[0], Tensor):
        raise ConfigurationTypeError(
            f"check_rule: inputs must be a tensor [batch, ...] (or a tuple of inputs, the first "
            f"a tensor), got {type(inputs).__qualname__}"
        )
    batch = xs[0].shape[0]
    if not batch:  # (every comparison of no example passes)
        raise ConfigurationError(
            f"check_rule: inputs of shape {tuple(xs[0].shape)} hold no example, so nothing "
            "would be compared: give a batch of at least one (two or more test the examples "
            "apart)"
        )
    name = type(module).__qualname__
    report = CheckReport(name, check="check_rule")
    for reduction in ("sum", "mean"):
        denom = batch if reduction == "mean" and batch else 1
        with add_hooks(model, loss_reduction=reduction, registry=registry, verify=False):
            loss = one_number(
                "check_rule", loss_fn(model(*xs)), f"the batch of {batch}",
                "one number, the sum of the examples' losses (out.pow(2).sum(), or a loss "
                "with reduction='sum')",
            )  # fmt: skip
            (loss / denom).backward()
        # (after the rule's own pass: an input it refuses, one without a batch dimension, is
        # told by the rule's typed error rather than by a shape error inside vmap)
        expected = vmap_grad(model, loss_fn, xs)
        for pname, p in model.named_parameters():
            if not p.requires_grad:
                continue
            key = f"{pname} ({reduction})"
            got = getattr(p, "grad1", None)
            want = expected[pname]
            if got is None or got.shape != want.shape:
                report.differences[key] = float("inf")
                report.failures.append(key)
                continue
            diff = (got - want).abs().max().item() if got.numel() else 0.0
            report.differences[key] = diff
            if not torch.allclose(got, want, rtol=rtol, atol=atol):
                report.failures.append(key)
            del p.grad1
        model.zero_grad(set_to_none=True)
    if raise_on_mismatch and not report.ok:
        raise CheckFailedError(str(report))
    return report

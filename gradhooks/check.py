"""Check a rule against the ``torch.func`` oracle, in float64."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ._torch import tree_flatten
from .engine import add_hooks
from .oracle import Inputs, _as_tuple, vmap_grad
from .registry import REGISTRY, Registry

__all__ = ["check_rule", "CheckReport"]


def _default_loss(output) -> Tensor:
    """Half the sum of squares of every output tensor: sum-reduced over the batch."""
    leaves = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.is_floating_point()]
    return sum(0.5 * (t**2).sum() for t in leaves)


@dataclass
class CheckReport:
    """Result of :func:`check_rule`: the largest absolute difference per parameter and
    reduction, and which ones exceed the tolerance."""

    module: str
    differences: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def __str__(self) -> str:
        rows = [f"check_rule({self.module}): {'ok' if self.ok else 'MISMATCH'}"]
        rows += [
            f"  {key:<40} max |hooks - vmap(grad)| = {d:.3e}"
            + ("   <-- differs" if key in self.failures else "")
            for key, d in self.differences.items()
        ]
        return "\n".join(rows)


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
        A :class:`CheckReport`; with ``raise_on_mismatch`` (default) an ``AssertionError``
        naming each parameter that differs, and by how much, is raised instead of returning a
        failed report.

    Example::

        >>> import torch, gradhooks
        >>> print(gradhooks.check_rule(torch.nn.Linear(3, 2), torch.randn(4, 3)).ok)
        True
    """
    loss_fn = loss_fn or _default_loss
    model = copy.deepcopy(module).double()
    xs = tuple(x.double() if x.is_floating_point() else x for x in _as_tuple(inputs))
    batch = xs[0].shape[0]
    name = type(module).__qualname__
    report = CheckReport(name)
    for reduction in ("sum", "mean"):
        denom = batch if reduction == "mean" and batch else 1
        expected = vmap_grad(model, loss_fn, xs)
        with add_hooks(model, loss_reduction=reduction, registry=registry, verify=False):
            (loss_fn(model(*xs)) / denom).backward()
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
        raise AssertionError(str(report))
    return report

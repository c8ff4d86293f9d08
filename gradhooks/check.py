"""The checks that per-example gradients are what they claim to be, each returning a
:class:`CheckReport`:

- :func:`check_rule`: a rule's ``grad1`` against the ``torch.func`` oracle (``vmap(grad)``),
  in float64, for a layer and a batch of inputs: for whoever writes a rule.
- :func:`check_hooks` (what :meth:`gradhooks.Hooks.check` calls): after a backward, ``grad1``
  against autograd's ``.grad`` and, given the loss, against a per-example recomputation; it
  names what is wrong and what to do.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from ._torch import tree_flatten
from .registry import REGISTRY, Registry

if TYPE_CHECKING:
    from .engine import Hooks
    from .oracle import Inputs

__all__ = ["check_rule", "check_hooks", "CheckReport"]


@dataclass
class CheckReport:
    """What a check found, from :func:`check_rule` or :meth:`gradhooks.Hooks.check`.

    ``module``: the type of the layer or model checked; ``check``: which check made the report
    (``"check_rule"`` or ``"Hooks.check"``); ``ok``: nothing failed (no ``failures`` and no
    ``problems``). ``str(report)`` lists all of it, one line each.

    From :func:`check_rule`: ``differences``: ``{"<parameter> (<reduction>)": max |hooks -
    vmap(grad)|}`` for every trainable parameter and both reductions (``inf`` where ``grad1``
    is missing or of another shape); ``failures``: the keys of those beyond the tolerance.

    From ``Hooks.check``: ``problems``: one sentence each, naming what is wrong and what to do;
    ``reduction``: the reduction the loss really used (``"mean"``/``"sum"``), when the loss was
    given and it could be told; ``nonfinite``: ``{param_name: [example indices]}`` whose
    ``grad1`` holds NaN or Inf.
    """

    module: str = ""
    differences: dict[str, float] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    reduction: str | None = None
    nonfinite: dict[str, list[int]] = field(default_factory=dict)
    check: str = "check"

    @property
    def ok(self) -> bool:
        return not self.failures and not self.problems

    def __str__(self) -> str:
        status = "ok" if self.ok else "MISMATCH" if self.failures else "FAILED"
        rows = [f"{self.check}({self.module}): {status}"]
        rows += [
            f"  {key:<40} max |hooks - vmap(grad)| = {d:.3e}"
            + ("   <-- differs" if key in self.failures else "")
            for key, d in self.differences.items()
        ]
        if self.reduction is not None:
            rows.append(f"  the loss's reduction: {self.reduction}")
        rows += [f"  - {problem}" for problem in self.problems]
        return "\n".join(rows)


# -- check_rule: a rule against vmap(grad) ---------------------------------------------------------


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
        A :class:`CheckReport`; with ``raise_on_mismatch`` (default) an ``AssertionError``
        naming each parameter that differs, and by how much, is raised instead of returning a
        failed report.

    Example::

        >>> import torch, gradhooks
        >>> print(gradhooks.check_rule(torch.nn.Linear(3, 2), torch.randn(4, 3)).ok)
        True
    """
    from .engine import add_hooks
    from .oracle import _as_tuple, vmap_grad

    loss_fn = loss_fn or _default_loss
    model = copy.deepcopy(module).double()
    xs = tuple(x.double() if x.is_floating_point() else x for x in _as_tuple(inputs))
    batch = xs[0].shape[0]
    name = type(module).__qualname__
    report = CheckReport(name, check="check_rule")
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


# -- check_hooks (Hooks.check): grad1 after a backward ---------------------------------------------


def _tol(dtype: torch.dtype) -> float:
    return {torch.float64: 1e-6, torch.float32: 1e-3}.get(dtype, 3e-2)


def check_hooks(
    hooks: Hooks,
    loss_fn: Callable[..., Tensor] | None = None,
    inputs: Tensor | Sequence[Tensor] | None = None,
    target: Tensor | None = None,
    *,
    examples: int = 2,
    raise_on_error: bool = True,
) -> CheckReport:
    """See :meth:`gradhooks.Hooks.check`."""
    model = hooks.model
    if model is None:
        raise RuntimeError("check(): the hooked model no longer exists")
    report = CheckReport(type(model).__qualname__, check="Hooks.check")
    names = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    written = {names.get(i, "?"): p for i, p in hooks._written.items()}
    for name in hooks._missed:
        report.problems.append(
            f"'{name}': a backward computed its gradient but no forward call of its module was "
            "captured for it (the forward ran before add_hooks, or while capture was paused): "
            "its grad1 is missing or from another backward. Run the forward after add_hooks."
        )
    if not written:
        report.problems.append(
            "no backward has written grad1 since add_hooks or clear(): run the forward and the "
            "backward with the hooks on (add_hooks before the forward)"
            + ("" if "grad1" in hooks.quantities else f" (this handle computes {hooks.quantities})")
        )
    reduce = "mean" if hooks.loss_reduction == "mean" else "sum"
    for name, p in written.items():
        g1 = p.grad1.detach()
        bad = ~torch.isfinite(g1.flatten(1)).all(1) if g1.dim() > 1 else ~torch.isfinite(g1)
        if bad.any():
            report.nonfinite[name] = bad.nonzero().flatten().tolist()
        if p.grad is None or not g1.shape[0]:
            continue
        got = g1.mean(0) if reduce == "mean" else g1.sum(0)
        want = p.grad.detach().to(got.dtype)
        if not (torch.isfinite(got).all() and torch.isfinite(want).all()):
            continue  # reported as non-finite
        tol = _tol(got.dtype)
        scale = want.abs().max().item() + got.abs().max().item()
        diff = (got - want).abs().max().item()
        if diff > tol * max(scale, 1e-30):
            report.problems.append(
                f"'{name}': grad1.{reduce}(0) differs from .grad (max difference {diff:.3e}, "
                f"largest entry {want.abs().max().item():.3e}): .grad holds more than the "
                f"backwards captured since clear(): gradients from before clear() (call "
                "optimizer.zero_grad() and h.clear() together), a term of the loss that does "
                "not go through a hooked layer's output (weight decay added to the loss: add "
                "its gradient to grad1 yourself, or use the optimizer's weight_decay), or a loss "
                "built from derivatives of the model (gradient penalties)"
            )
    for name, rows in report.nonfinite.items():
        report.problems.append(
            f"'{name}': grad1 holds NaN or Inf for examples {rows[:10]}"
            f"{' ...' if len(rows) > 10 else ''} (carried through from the backward, as autograd "
            "does): check those examples' losses and inputs, or lower the learning rate"
        )
    if loss_fn is not None:
        if inputs is None:
            raise ValueError("check(loss_fn, inputs, target): the inputs of the captured forward")
        _check_reduction(hooks, model, written, loss_fn, inputs, target, examples, report)
    if report.problems and raise_on_error:
        raise RuntimeError("gradhooks check failed:\n  - " + "\n  - ".join(report.problems))
    return report


def _check_reduction(hooks, model, written, loss_fn, inputs, target, examples, report) -> None:
    """Recompute the first examples' own gradients (a batch of one each) and compare."""
    from .oracle import loop_grad

    xs = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
    batch = xs[0].shape[0]
    if not written:
        return
    g1_batch = next(iter(written.values())).grad1.shape[0]
    if g1_batch != batch:
        report.problems.append(
            f"check(): grad1 has {g1_batch} examples, the inputs given have {batch}: pass the "
            "inputs of the captured forward"
        )
        return
    k = min(examples, batch)
    if k == 0:
        return
    want = loop_grad(
        model, loss_fn, tuple(x[:k] for x in xs), None if target is None else target[:k]
    )
    got_parts, want_parts = [], []
    for name, p in written.items():
        if name in want:
            got_parts.append(p.grad1[:k].detach().reshape(k, -1).double())
            want_parts.append(want[name].detach().reshape(k, -1).double())
    if not got_parts:
        return
    got, ref = torch.cat(got_parts, 1), torch.cat(want_parts, 1)
    if not (torch.isfinite(got).all() and torch.isfinite(ref).all()):
        return
    tol = 10 * _tol(next(iter(written.values())).grad1.dtype)
    norm = ref.norm().item()
    if norm == 0:
        if got.norm().item() > 0:
            report.problems.append(
                f"the first {k} examples' own losses, each computed on its own, have no "
                "gradient, but their rows of grad1 do: the loss couples the examples of the "
                "batch (a contrastive or InfoNCE loss, a loss over the batch's statistics), so "
                "no example has a loss of its own and grad1 holds each example's share of the "
                "batch loss's gradient, not a per-example gradient. For DP-SGD, clip a loss "
                "that is a sum over examples."
            )
        return

    def close(factor: float) -> bool:
        return (got - factor * ref).norm().item() <= tol * factor * norm

    if close(1.0):
        report.reduction = hooks.loss_reduction if batch > 1 else None
        return
    other = "sum" if hooks.loss_reduction == "mean" else "mean"
    factor = float(batch) if hooks.loss_reduction == "mean" else 1.0 / batch
    if batch > 1 and close(factor):
        report.reduction = other
        report.problems.append(
            f"the loss is the {other} of the per-example losses, but the hooks were told "
            f"loss_reduction={hooks.loss_reduction!r}: grad1 is {factor:g}× each example's own "
            f"gradient. Pass add_hooks(model, loss_reduction={other!r}) (or call "
            f"h.rescale({other!r}) for the grad1 computed so far)"
        )
        return
    ratio = (got * ref).sum().item() / (ref * ref).sum().item()
    report.problems.append(
        f"grad1 of the first {k} examples is not their own gradient (about {ratio:.3g}× it, "
        f"loss_reduction={hooks.loss_reduction!r}, batch {batch}): the loss may be scaled "
        "(divided by the number of micro-batches, or a mean over more than the batch), grad1 "
        "may hold several backwards (call h.clear() between steps), the examples may not be "
        "independent (batch statistics, or a loss that couples them: contrastive, InfoNCE), "
        "the model may be random (dropout: check in eval "
        "mode), or loss_fn / inputs differ from those of the captured backward"
    )

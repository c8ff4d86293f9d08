"""Guards against silently wrong per-example gradients: ``Hooks.check``.

:func:`check` (``Hooks.check``) compares what the hooks computed with what autograd computed
and, given the loss, with a per-example recomputation; it names what is wrong and what to do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .engine import Hooks

__all__ = ["CheckReport"]


@dataclass
class CheckReport:
    """What :meth:`Hooks.check` found.

    ``reduction``: the reduction the loss really used (``"mean"``/``"sum"``), when the loss was
    given and it could be told; ``problems``: one sentence each (empty when all is well);
    ``nonfinite``: ``{param_name: [example indices]}`` whose ``grad1`` holds NaN or Inf.
    """

    reduction: str | None = None
    problems: list[str] = field(default_factory=list)
    nonfinite: dict[str, list[int]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems


def _tol(dtype: torch.dtype) -> float:
    return {torch.float64: 1e-6, torch.float32: 1e-3}.get(dtype, 3e-2)


def check(
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
    report = CheckReport()
    if model is None:
        raise RuntimeError("check(): the hooked model no longer exists")
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

"""A K-FAC optimizer: running Kronecker factors, their damped inverses, any base optimizer.

:class:`KFAC` wraps a torch optimizer. Each :meth:`KFAC.step`, after the loss's backward:

1. every ``factors_every`` steps, new factors from the batch (:func:`gradhooks.kfac`: a
   forward and a backward of its own, of sampled labels for the Fisher) are averaged into
   running factors, ``A ← decay·A + (1 - decay)·A_new`` (the same for ``G``; the first
   estimate is taken as it is);
2. every ``inverse_every`` steps (and whenever the damping changed), the running factors are
   inverted: ``(kron(G, A) + damping·I)⁻¹`` from their eigendecompositions;
3. every weight's gradient (its bias's as the last column) is preconditioned in place
   (:func:`gradhooks.kfac_precondition`), and the base optimizer steps. Parameters without
   factors (a norm's scale, an embedding) keep their gradient. A weight that gets none because
   its layer has no rule (a ``Bilinear``, your own module:
   :attr:`~gradhooks.quantities.kfac.KfacAccumulator.unfactored`) is refused, unless
   ``unfactored="keep"`` says to let it keep its gradient.

With ``adaptive=True`` and a ``closure``, the damping follows the Levenberg-Marquardt rule of
Martens and Grosse (2015, §6.5): every ``adapt_every`` steps the loss's actual change is
compared with the change the damped quadratic model predicts for the step taken, and the
damping is lowered where the model was good (ratio above 3/4) and raised where it was poor
(below 1/4), by ``ω = (19/20)^adapt_every``.

The factors' conventions (``expand`` / ``reduce`` for weight-sharing layers, the bias column,
the mean reduction) are those of :mod:`gradhooks.workflows.kfac`. The factors' forward leaves the
model's buffers as it found them (a BatchNorm's running statistics move once per training
step, as without K-FAC).

Example::

    >>> import torch, torch.nn.functional as F, gradhooks
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    >>> opt = gradhooks.KFAC(net, torch.optim.SGD(net.parameters(), lr=0.1), damping=1e-2)
    >>> for _ in range(3):
    ...     x, y = torch.randn(16, 4), torch.randint(3, (16,))
    ...     opt.zero_grad()
    ...     F.cross_entropy(net(x), y).backward()
    ...     opt.step(x)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..errors import (
    ConfigurationError,
    ConfigurationTypeError,
    NumericalError,
    UnsupportedError,
    is_whole,
    require_number,
)
from ..quantities.kfac import KFactors, KFactorsInverse, weight_matrix
from .kfac import (
    Fisher,
    Inputs,
    LossFn,
    LossName,
    _accumulate,
    _check_model,
    check_fisher_and_loss,
    check_sampling,
    kfac_precondition,
)

__all__ = ["KFAC"]


class KFAC:
    """K-FAC preconditioning around any torch optimizer (see :mod:`gradhooks.workflows.kfac_optimizer`).

    Args:
        model: the model whose weights are preconditioned (its layers need rules; the model
            must not be hooked by :func:`gradhooks.add_hooks` while :meth:`step` runs).
        optimizer: the base optimizer over ``model``'s parameters (SGD, Adam, ...); it steps
            on the preconditioned gradients.
        damping: ``> 0``, added to ``kron(G, A)`` (the initial value when ``adaptive``).
        decay: weight of the old factors in the running average, in ``[0, 1)``.
        factors_every: steps between new factor estimates (each costs a forward and a
            backward).
        inverse_every: steps between inversions of the running factors.
        fisher, loss, expand, bias, mc_samples, generator: as for :func:`gradhooks.kfac`.
        adaptive: adapt the damping by the Levenberg-Marquardt rule (needs ``closure`` in
            :meth:`step` on the steps that adapt).
        adapt_every: steps between adaptations.
        damping_range: the bounds of the adapted damping.
        unfactored: ``"error"`` (default): refuse a weight of a layer without a rule, which
            gets no Kronecker factors and would otherwise step on its own gradient unseen; ``"keep"``: let such weights keep their gradient (a warning
            names them).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        damping: float = 1e-3,
        decay: float = 0.95,
        factors_every: int = 1,
        inverse_every: int = 1,
        fisher: Fisher = "mc",
        loss: LossName | LossFn = "cross_entropy",
        expand: bool = True,
        bias: bool = True,
        mc_samples: int = 1,
        generator: torch.Generator | None = None,
        adaptive: bool = False,
        adapt_every: int = 5,
        damping_range: tuple[float, float] = (1e-8, 1e3),
        unfactored: Literal["error", "keep"] = "error",
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigurationTypeError(
                f"KFAC wraps a torch optimizer, got {type(optimizer).__qualname__}: "
                "KFAC(model, torch.optim.SGD(model.parameters(), lr=...))"
            )
        _check_model(model, "KFAC")
        check_fisher_and_loss(fisher, loss)
        check_sampling(mc_samples, generator, expand, bias)
        owned = {id(p) for p in model.parameters()}
        if not any(id(p) in owned for g in optimizer.param_groups for p in g["params"]):
            raise ConfigurationError(
                f"KFAC: the optimizer steps no parameter of the model ({type(model).__qualname__}"
                "): the preconditioned gradients would never be used. Give it the model's "
                "parameters: KFAC(model, torch.optim.SGD(model.parameters(), lr=...))"
            )
        require_number("damping", damping, "KFAC")
        require_number("decay", decay, "KFAC")
        if not (damping > 0 and math.isfinite(damping)):
            raise ConfigurationError(f"damping must be > 0 and finite, got {damping!r}")
        if not 0 <= decay < 1:
            raise ConfigurationError(f"decay must be in [0, 1), got {decay!r}")
        for what, n in [
            ("factors_every", factors_every), ("inverse_every", inverse_every),
            ("adapt_every", adapt_every),
        ]:  # fmt: skip
            require_number(what, n, "KFAC")  # (True is no number of steps)
            if not is_whole(n) or n < 1:
                raise ConfigurationError(f"{what} must be a whole number >= 1, got {n!r}")
        if not isinstance(adaptive, bool):  # (a string taken by its truth)
            raise ConfigurationTypeError(
                f"KFAC: adaptive takes True or False, got {type(adaptive).__qualname__} "
                f"{adaptive!r}"
            )
        if unfactored not in ("error", "keep"):
            raise ConfigurationError(f"unfactored must be 'error' or 'keep', got {unfactored!r}")
        if not isinstance(damping_range, tuple | list) or len(damping_range) != 2:
            raise ConfigurationTypeError(
                "KFAC: damping_range must be a pair (low, high) of numbers, got "
                f"{type(damping_range).__qualname__} {damping_range!r}"
            )
        low, high = damping_range
        require_number("damping_range[0]", low, "KFAC")
        require_number("damping_range[1]", high, "KFAC")
        if not 0 < low <= damping <= high:
            raise ConfigurationError(
                f"damping_range must hold the damping: {low!r} <= {damping!r} <= {high!r}"
            )
        self.model, self.optimizer = model, optimizer
        # the model's parameters the optimizer steps, by name (checked again at every step)
        self._stepped = {
            name: p for name, p in model.named_parameters() if id(p) in _ids(optimizer)
        }
        self.damping, self.decay = float(damping), decay
        self.factors_every, self.inverse_every = int(factors_every), int(inverse_every)
        self.adaptive, self.adapt_every = adaptive, int(adapt_every)
        self.damping_range = (float(low), float(high))
        self.unfactored = unfactored
        self._kfac_args: dict[str, Any] = dict(
            fisher=fisher, loss=loss, reduction="mean", expand=expand, bias=bias,
            mc_samples=mc_samples, generator=generator,
        )  # fmt: skip
        self.steps = 0
        self.factors: dict[str, KFactors] = {}  # the running averages
        self._inverses: dict[str, KFactorsInverse] = {}
        self._inverted_at: float | None = None  # the damping of the inverses
        self.last_ratio: float | None = None  # the last adaptation's reduction ratio

    # -- the step ----------------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The base optimizer's ``param_groups``: what a float16 ``GradScaler`` unscales, so
        that ``scaler.step(kfac, inputs, target)`` skips a step whose scaled gradients
        overflowed and otherwise calls :meth:`step` with the inputs (then
        ``scaler.update()``)."""
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The base optimizer's ``zero_grad``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(
        self,
        inputs: Inputs,
        target: Tensor | None = None,
        *,
        kwargs: Mapping[str, Any] | None = None,
        mask: Tensor | None = None,
        closure: Callable[[], Tensor | float] | None = None,
    ) -> None:
        """Precondition the gradients of the backward just run, and step.

        Args:
            inputs: the batch the gradients are of (``[batch, ...]``, or a tuple of the
                model's positional inputs), for new factors.
            target: its labels, needed for ``fisher="empirical"``.
            kwargs: the model's keyword inputs (``{"attention_mask": mask}``), as for
                :func:`gradhooks.kfac`: the factors' forward is ``model(*inputs, **kwargs)``.
            mask: which output positions have a loss, as for :func:`gradhooks.kfac`.
            closure: with ``adaptive``: a function returning the loss on the same batch at
                the current parameters (no backward needed; it is called under
                ``torch.no_grad()``, before and after the base optimizer's step).
        """
        self._check_stepped()
        adapt = self.adaptive and self.steps % self.adapt_every == 0
        if adapt and closure is None:
            raise ConfigurationError(
                "KFAC(adaptive=True) adapts its damping from the loss before and after a "
                "step: pass step(inputs, ..., closure=lambda: loss_fn(model(inputs), target))"
            )
        for name, p in self.model.named_parameters():
            if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                raise NumericalError(
                    f"KFAC: the gradient of '{name}' {tuple(p.shape)} holds NaN or inf: the "
                    "loss or the model diverged. Lower the learning rate or raise the "
                    "damping, and restart from a checkpoint. (The backward of a float16 "
                    "GradScaler's scaled loss overflows now and then: step through "
                    "scaler.step(kfac, inputs, target), which skips such a step, then "
                    "scaler.update().)"
                )
        if self.steps % self.factors_every == 0:
            with torch.enable_grad():
                self._update_factors(inputs, target, kwargs, mask)
        stale = self._inverted_at != self.damping
        if stale or self.steps % self.inverse_every == 0:
            self._invert()
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if adapt:
            before = [p.detach().clone() for p in params]
            grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
            loss_before = float(closure())
        kfac_precondition(self.model, self._inverses)
        self.optimizer.step()
        if adapt:
            loss_after = float(closure())
            self._adapt(params, before, grads, loss_after - loss_before)
        self.steps += 1

    def _check_stepped(self) -> None:
        """Refuses a step where a parameter the optimizer stepped as the model's is no longer
        the model's (replaced by ``load_state_dict(..., assign=True)`` or a new
        ``nn.Parameter``): the optimizer would step the old tensor, and the model's own would
        never move, its gradient never zeroed."""
        now = {id(p) for p in self.model.parameters()}
        for name, p in self._stepped.items():
            if id(p) not in now:
                raise ConfigurationError(
                    f"KFAC.step: the optimizer steps the parameter that was '{name}' "
                    f"{tuple(p.shape)} of the model ({type(self.model).__qualname__}) when "
                    "KFAC was built, and the model's is another tensor now (replaced by "
                    "load_state_dict(..., assign=True), or layer.weight = nn.Parameter(...)): "
                    "the step would move the old one and leave the model as it was. Build the "
                    "optimizer over model.parameters() again and KFAC around it (kfac."
                    "state_dict() keeps the factors), or load checkpoints without "
                    "assign=True. Nothing was changed."
                )

    def _update_factors(
        self, inputs: Inputs, target: Tensor | None, kwargs: Mapping | None, mask: Tensor | None
    ) -> None:
        buffers = {n: b.detach().clone() for n, b in self.model.named_buffers()}
        try:
            args = dict(self._kfac_args)
            reduction = args.pop("reduction")
            acc = _accumulate(self.model, inputs, target, **args, kwargs=kwargs, mask=mask)
        finally:  # the factors' forward is not a training step: buffers as they were
            for name, b in self.model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
        missing = acc.unfactored
        if missing and self.unfactored == "error":
            raise UnsupportedError(
                f"KFAC: no Kronecker factors for {'; '.join(missing.values())}: a layer "
                "without a rule (its per-example gradient is the fallback's, not an input and "
                "an output-gradient), so K-FAC would leave it out and the base optimizer step "
                "it on its own gradient. Register a rule that returns an Outer piece for it "
                "(docs/extending.md), freeze it, or pass KFAC(..., unfactored='keep') to step "
                "it unpreconditioned"
            )
        new = acc.factors(reduction, last=True)
        for name, f in new.items():
            _check_finite(name, f, "new")
            old = self.factors.get(name)
            if old is None or self.decay == 0:
                self.factors[name] = f
                continue
            if old.A.shape != f.A.shape or old.G.shape != f.G.shape:
                raise ConfigurationError(
                    f"KFAC: the factors of '{name}' changed shape (A {tuple(old.A.shape)} -> "
                    f"{tuple(f.A.shape)}, G {tuple(old.G.shape)} -> {tuple(f.G.shape)}): the "
                    "layer was replaced; make a new KFAC for the new model"
                )
            old.A.mul_(self.decay).add_(f.A, alpha=1 - self.decay)
            old.G.mul_(self.decay).add_(f.G, alpha=1 - self.decay)

    def _invert(self) -> None:
        inverses = {}
        for name, f in self.factors.items():
            _check_finite(name, f, "running")
            try:
                inverses[name] = f.inverse(self.damping)
            except torch.linalg.LinAlgError as e:
                raise NumericalError(
                    f"KFAC: the factors of '{name}' (A {tuple(f.A.shape)}, G "
                    f"{tuple(f.G.shape)}) could not be inverted at damping {self.damping:g}: "
                    f"{e}. Raise the damping, or lower the learning rate"
                ) from e
        self._inverses, self._inverted_at = inverses, self.damping

    def _adapt(self, params: list, before: list, grads: list, change: float) -> None:
        """Levenberg-Marquardt: the loss's change against the damped quadratic model's."""
        deltas = [p.detach() - b for p, b in zip(params, before, strict=True)]
        linear = sum(float((g * d).sum()) for g, d in zip(grads, deltas) if g is not None)
        quadratic = self.damping * sum(float(d.pow(2).sum()) for d in deltas)
        named = {id(p): n for n, p in self.model.named_parameters()}
        by_name = {named[id(p)]: d for p, d in zip(params, deltas) if id(p) in named}
        for name, f in self.factors.items():  # δᵀ (G ⊗ A) δ per weight, bias column appended
            weight = by_name.get(name)
            if weight is None:
                continue
            delta = weight_matrix(weight, tuple(f.G.shape[:-2]), f.G.shape[-1], f.layout)
            if f.bias and f.bias_name in by_name:
                bias = by_name[f.bias_name].reshape(*delta.shape[:-1], 1)
                delta = torch.cat([delta, bias], -1)
            quadratic += float((delta * (f.G @ delta @ f.A)).sum())
        predicted = linear + quadratic / 2
        if not predicted < 0 or not math.isfinite(change):
            ratio = -math.inf  # the model predicted no decrease, or the loss diverged
        else:
            ratio = change / predicted
        omega = (19 / 20) ** self.adapt_every
        low, high = self.damping_range
        if ratio > 0.75:
            self.damping = max(low, self.damping * omega)
        elif ratio < 0.25:
            self.damping = min(high, self.damping / omega)
        self.last_ratio = ratio

    # -- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The base optimizer's state, the running factors, the damping and the step count."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "factors": {
                n: (f.A, f.G, f.bias, f.bias_name, f.layout) for n, f in self.factors.items()
            },
            "damping": self.damping,
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; a checkpoint that is not one is refused before
        anything is loaded."""
        if not isinstance(state, dict):
            raise ConfigurationTypeError(
                f"KFAC.load_state_dict takes the dict of KFAC.state_dict(), got "
                f"{type(state).__qualname__}"
            )
        missing = [k for k in ("optimizer", "factors", "damping", "steps") if k not in state]
        if missing:
            raise ConfigurationError(
                f"KFAC.load_state_dict: the checkpoint lacks {missing} (it has "
                f"{sorted(map(str, state))}): not a KFAC.state_dict() (the base optimizer's "
                "own goes to kfac.optimizer.load_state_dict)"
            )
        self.optimizer.load_state_dict(state["optimizer"])
        self.factors = {  # (a checkpoint without the layout: "out_in", the only one then)
            n: KFactors(a.clone(), g.clone(), bias, bias_name, *layout)
            for n, (a, g, bias, bias_name, *layout) in state["factors"].items()
        }
        self.damping, self.steps = float(state["damping"]), int(state["steps"])
        self._inverses, self._inverted_at = {}, None

    def __repr__(self) -> str:
        return (
            f"KFAC({type(self.optimizer).__name__}, damping={self.damping:g}, "
            f"decay={self.decay}, steps={self.steps}, weights={len(self.factors)})"
        )


def _check_finite(name: str, f: KFactors, which: Literal["new", "running"]) -> None:
    bad = [what for what, t in (("A", f.A), ("G", f.G)) if not bool(torch.isfinite(t).all())]
    if bad:
        raise NumericalError(
            f"KFAC: the {which} factor{'s' if len(bad) > 1 else ''} {' and '.join(bad)} of "
            f"'{name}' hold NaN or inf (A {tuple(f.A.shape)}, G {tuple(f.G.shape)}): the "
            "layer's inputs or output-gradients diverged. Lower the learning rate or raise "
            "the damping, and restart from a checkpoint"
        )


def _ids(optimizer: torch.optim.Optimizer) -> set[int]:
    return {id(p) for group in optimizer.param_groups for p in group["params"]}

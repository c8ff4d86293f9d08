"""DP-SGD training that cannot be wired wrong: :class:`DPOptimizer` and :func:`make_private`.

:func:`gradhooks.dp_sgd_step`, :class:`gradhooks.PoissonSampler` and
:class:`gradhooks.PrivacyAccountant` are right on their own; a training loop has to wire them
together, and each wire can be forgotten without any error: dividing a Poisson batch by its own
size instead of the expected one, never recording a step (ε stays 0.0), recording a step that a
GradScaler skipped, adding the noise once per micro-batch instead of once per step, drawing
fixed-size shuffled batches that the accountant does not describe. This module does the wiring
once.

- :class:`DPOptimizer` wraps any torch optimizer: ``backward(losses)`` adds one physical
  batch's clipped per-example gradients into a buffer (as often as a logical batch needs),
  ``step()`` adds the noise once, divides by the expected batch size, steps the optimizer and
  records the step in the accountant.
- :func:`make_private` returns a :class:`PrivateTraining` that owns the whole mechanism: the
  hooks, the Poisson batches (split into physical batches), the noise generator, the
  accountant, the privacy budget, and the checkpoint of all of it.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from ..engine.handle import Hooks
from ..privacy.accounting import PrivacyAccountant
from . import dp as _dp

__all__ = ["DPOptimizer"]


class DPOptimizer(torch.optim.Optimizer):
    """A torch optimizer whose steps are DP-SGD steps: per-example clipping, Gaussian noise
    once per step, the noisy sum divided by the expected batch size.

    ::

        opt = gradhooks.DPOptimizer(torch.optim.AdamW(model.parameters()), hooks,
                                    max_grad_norm=1.0, noise_multiplier=1.1,
                                    expected_batch_size=64, sample_rate=64 / len(data),
                                    accountant=gradhooks.PrivacyAccountant())
        for x, y in loader:                   # one logical (Poisson) batch, in one or more
            opt.backward(F.cross_entropy(model(x), y, reduction="none"))   # physical ones
            opt.step()                        # after the last physical batch
            opt.zero_grad()

    Each :meth:`backward` takes one physical batch's per-example losses (``[batch]``), runs
    the backward, clips each example's whole-model gradient to norm ``C = max_grad_norm``
    (:func:`gradhooks.clipped_sum`) and adds the sum to a buffer. :meth:`step` then sets, for
    every trainable parameter of the hooked model,

        p.grad = (Σ_i min(1, C/‖g_i‖) · g_i  +  σ·C · N(0, I)) / expected_batch_size

    (the sum over every example of every physical batch since the last step, the noise drawn
    once, from ``generator``, parameter after parameter in the model's order), steps the
    wrapped optimizer, records ``(noise_multiplier, sample_rate)`` in the ``accountant`` and
    empties the buffer. ``p.grad`` is replaced: whatever a backward of the user's left there
    is not used.

    It is a ``torch.optim.Optimizer`` whose ``param_groups``, ``state``, ``defaults``,
    ``state_dict()`` and ``load_state_dict()`` are the wrapped optimizer's, so any
    ``torch.optim.lr_scheduler`` takes it (or the wrapped optimizer: they share their
    ``param_groups``).

    Args:
        optimizer: any ``torch.optim.Optimizer`` over (some of) the hooked model's parameters.
        hooks: the handle of ``gradhooks.add_hooks(model, quantities=("norms",))`` (or with
            ``"grad1"``), added before the forwards.
        max_grad_norm: ``C``, the clipping norm of each example's whole-model gradient.
        noise_multiplier: ``σ``; the noise std is ``σ·C``.
        expected_batch_size: the divisor, the *expected* size of a logical batch (for Poisson
            sampling: ``sample_rate · len(dataset)``), public, unlike a batch's own size.
        sample_rate: the Poisson sampling rate ``q``, which the accountant records.
        accountant: a :class:`gradhooks.PrivacyAccountant` in which each step is recorded
            (needs ``sample_rate``).
        generator: a ``torch.Generator`` for the noise (keep its seed secret).
        method: :func:`gradhooks.dp_sgd_step`'s ``method``.
        scaler: a ``torch.amp.GradScaler`` (float16 autocast): the backwards run on the scaled
            losses, and :meth:`step` runs ``scaler.step(optimizer)`` and ``scaler.update()``
            itself. A step in which a scaled gradient overflowed is skipped, as GradScaler
            skips it: no noise is drawn, the optimizer does not step, the accountant records
            nothing.

    A misuse raises before anything changes: a step with no backward since the last one,
    losses that are not ``[batch]``, a handle without ``"grad1"`` or ``"norms"``, an optimizer
    over a parameter the hooks do not clip, an optimizer step fused into the backward.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        hooks: Hooks,
        *,
        max_grad_norm: float,
        noise_multiplier: float,
        expected_batch_size: float,
        sample_rate: float | None = None,
        accountant: PrivacyAccountant | None = None,
        generator: torch.Generator | None = None,
        method: Literal["grad1", "ghost", "bookkeeping"] | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        # (torch.optim.Optimizer.__init__ is not called: the state is the wrapped optimizer's)
        if isinstance(optimizer, DPOptimizer) or not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "DPOptimizer wraps a torch.optim.Optimizer (SGD, AdamW, ...), got "
                f"{type(optimizer).__qualname__}"
            )
        if not isinstance(hooks, Hooks):
            raise TypeError(
                f"hooks must be the handle of gradhooks.add_hooks(model, quantities=('norms',)),"
                f" got {type(hooks).__qualname__}"
            )
        if not ({"grad1", "norms"} & set(hooks.quantities)):
            raise ValueError(
                "DPOptimizer needs a handle that computes per-example norms or gradients: "
                "gradhooks.add_hooks(model, quantities=('norms',)) (or ('grad1',)), this one "
                f"has quantities={hooks.quantities!r}"
            )
        _dp._check_clipping(max_grad_norm, noise_multiplier, generator)
        _dp._check_expected_batch_size(expected_batch_size, "mean")
        _dp.check_scaler(scaler)
        if method is not None:
            _dp._checked_method(hooks, method)
        if sample_rate is not None and not 0 < sample_rate <= 1:
            raise ValueError(
                f"sample_rate must be in (0, 1] (expected batch size / number of examples), "
                f"got {sample_rate!r}"
            )
        if accountant is not None:
            if not isinstance(accountant, PrivacyAccountant):
                raise TypeError(
                    "accountant must be a gradhooks.PrivacyAccountant or None, got "
                    f"{type(accountant).__qualname__}"
                )
            if sample_rate is None:
                raise ValueError(
                    "DPOptimizer(accountant=...) records each step's sampling rate: pass "
                    "sample_rate= (expected batch size / number of examples)"
                )
        params = _dp._covered_params(hooks)
        _check_optimizer_params(optimizer, hooks, params)
        self.optimizer = optimizer
        self.hooks = hooks
        self.max_grad_norm = float(max_grad_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.expected_batch_size = expected_batch_size
        self.sample_rate = sample_rate
        self.accountant = accountant
        self.generator = generator
        self.method = method
        self.scaler = scaler
        self._sums: list[Tensor] | None = None  # the clipped sum since the last step
        self._finite = True  # no scaled backward since the last step overflowed
        self._examples = 0  # examples in the buffer
        self._backwards = 0  # physical batches in the buffer

    # -- the wrapped optimizer's state (for LR schedulers and checkpoints) ---------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict()``. The clipped sum of a logical batch in
        progress is not in it: save between steps."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The wrapped optimizer's ``load_state_dict()``; empties the clipped-sum buffer."""
        self.optimizer.load_state_dict(state_dict)
        self._forget()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        probe = torch.optim.SGD(param_group["params"], lr=0.0)
        _check_optimizer_params(probe, self.hooks, _dp._covered_params(self.hooks))
        self.optimizer.add_param_group(param_group)

    # -- DP-SGD ---------------------------------------------------------------------------------

    @property
    def examples(self) -> int:
        """The number of examples whose clipped gradients the buffer holds."""
        return self._examples

    def backward(self, per_example_loss: Tensor) -> Tensor:
        """Backward of one physical batch's per-example losses (``[batch]``): their clipped
        gradients are added to the buffer :meth:`step` uses. Returns the per-example norms
        before clipping, ``[batch]``. ``p.grad`` is left as it was."""
        got = _dp.clipped_sum(
            self.hooks, per_example_loss, max_norm=self.max_grad_norm, method=self.method,
            scaler=self.scaler,
        )  # fmt: skip
        if self._sums is None:
            self._sums = [s.to(_accumulation_dtype(s.dtype)) for s in got.sums]
        else:
            for buf, s in zip(self._sums, got.sums, strict=True):
                buf.add_(s)
        self._finite = self._finite and got.finite
        self._examples += per_example_loss.shape[0]
        self._backwards += 1
        return got.norms

    def step(self, closure: None = None) -> bool:  # type: ignore[override]
        """Noise once, ``p.grad = (clipped sum + σ·C·N(0, I)) / expected_batch_size``, the
        wrapped optimizer's step (through the scaler where there is one), the step recorded in
        the accountant, the buffer emptied. Returns whether the optimizer stepped (False only
        where a scaled backward overflowed and the step was skipped)."""
        if closure is not None:
            raise ValueError(
                "DPOptimizer.step takes no closure: call backward(per_example_loss) on each "
                "physical batch, then step()"
            )
        if self._sums is None:
            raise RuntimeError(
                "DPOptimizer.step: no backward(per_example_loss) since the last step, so "
                "there is no clipped gradient to noise. Call opt.backward(losses) on each "
                "physical batch of the logical batch (an empty batch too: its losses have 0 "
                "rows), then opt.step(); a plain loss.backward() is not clipped."
            )
        params = _dp._covered_params(self.hooks)
        if len(params) != len(self._sums):
            raise RuntimeError(
                "DPOptimizer.step: the hooked model's trainable parameters changed since the "
                "backward; call zero_grad() and run the logical batch again"
            )
        scale = 1.0
        if self.scaler is not None and self.scaler.is_enabled():
            scale = float(self.scaler.get_scale())
        if not self._finite:  # (scaler.step sees NaN, skips, and update() lowers the scale)
            for p in params:
                p.grad = torch.full(p.shape, float("nan"), dtype=p.dtype, device=p.device)
        else:
            std = self.noise_multiplier * self.max_grad_norm
            for p, s in zip(params, self._sums, strict=True):
                grad = s.to(p.dtype)
                if std > 0:
                    grad = torch.add(grad, _dp.gaussian(p, self.generator), alpha=std)
                p.grad = grad.div_(self.expected_batch_size).mul_(scale).detach()
        stepped = self._finite
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if stepped and self.accountant is not None:
            assert self.sample_rate is not None
            self.accountant.step(
                noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate
            )
        self._forget()
        return stepped

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad`` and an empty clipped-sum buffer."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._forget()

    def _forget(self) -> None:
        self._sums = None
        self._finite = True
        self._examples = 0
        self._backwards = 0

    def __repr__(self) -> str:
        return (
            f"DPOptimizer({type(self.optimizer).__qualname__}, max_grad_norm="
            f"{self.max_grad_norm}, noise_multiplier={self.noise_multiplier}, "
            f"expected_batch_size={self.expected_batch_size})"
        )


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least float32 for the buffer (bfloat16 parameters' sums over physical batches)."""
    return torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else dtype


def _check_optimizer_params(
    optimizer: torch.optim.Optimizer, hooks: Hooks, covered: list[torch.nn.Parameter]
) -> None:
    """Every trainable parameter the optimizer steps is one the hooks clip: another would be
    stepped on a gradient that is neither clipped nor noised."""
    ids = {id(p) for p in covered}
    model = hooks.model
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and id(p) not in ids:
                what = f"'{names[id(p)]}'" if id(p) in names else f"of shape {tuple(p.shape)}"
                raise ValueError(
                    f"DPOptimizer: the optimizer steps a trainable parameter {what} that the "
                    "hooks do not clip (not the hooked model's, or without a rule): its step "
                    "would use a gradient with neither clipping nor noise. Give the optimizer "
                    "the hooked model's parameters only, or freeze that one."
                )

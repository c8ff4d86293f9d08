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

import collections
import copy
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torch.utils.data.dataloader import default_collate

from .. import _torch
from ..engine.api import engine_of
from ..engine.handle import Hooks, add_hooks
from ..errors import (
    ConfigurationError,
    ConfigurationTypeError,
    GradhooksWarning,
    PrivacyBudgetExceeded,
    StateError,
    is_whole,
    require_number,
)
from ..privacy.accounting import (
    PrivacyAccountant,
    noise_multiplier_for,
    warn_if_delta_not_small,
)
from ..privacy.sampling import EmptyAware, PoissonSampler
from . import clipping as _clip
from . import dp as _dp

__all__ = ["DPOptimizer", "PrivateTraining", "make_private"]


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
        max_grad_norm: ``C``, the clipping norm of each example's whole-model gradient; with
            ``clipping_groups``, a float ``C`` (each of ``K`` groups clipped to ``C/√K``) or
            one bound per group (total ``C = √(Σ_k C_k²)``).
        noise_multiplier: ``σ``; the noise std is ``σ·C`` (``C`` the total bound, so the
            accountant's ``σ`` is relative to it).
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
        clipping: :func:`gradhooks.dp_sgd_step`'s ``clipping``: ``"flat"`` (``min(1, C/‖g_i‖)``)
            or ``"automatic"`` (``C/(‖g_i‖ + 0.01)``).
        clipping_groups: :func:`gradhooks.dp_sgd_step`'s ``clipping_groups``: ``None`` (one
            bound), ``"parameter"`` (Opacus' per-layer clipping), ``"layer"``, or a list of
            groups of parameters or names (the wrapped optimizer's ``param_groups`` too);
            resolved against the hooked model at every backward.
        adaptive_clipping: a :class:`gradhooks.AdaptiveClipping`: the bound ``C`` starts at
            ``max_grad_norm`` and follows a quantile of the norms, updated at each step from
            a noised count of the examples it left unclipped (:attr:`max_grad_norm` is the
            bound now; :meth:`state_dict` keeps it). The accountant records
            ``noise_multiplier``; the gradient's noise is drawn with the larger multiplier
            that leaves room for the count's.

    A misuse raises before anything changes: a step with no backward since the last one,
    losses that are not ``[batch]``, a handle without ``"grad1"`` or ``"norms"``, an optimizer
    over a parameter the hooks do not clip, an optimizer step fused into the backward.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        hooks: Hooks,
        *,
        max_grad_norm: float | Sequence[float],
        noise_multiplier: float,
        expected_batch_size: float,
        sample_rate: float | None = None,
        accountant: PrivacyAccountant | None = None,
        generator: torch.Generator | None = None,
        method: Literal["grad1", "ghost", "bookkeeping"] | None = None,
        scaler: torch.amp.GradScaler | None = None,
        clipping: Literal["flat", "automatic"] = "flat",
        clipping_groups: _clip.ClippingGroups = None,
        adaptive_clipping: _clip.AdaptiveClipping | None = None,
    ) -> None:
        # (torch.optim.Optimizer.__init__ is not called: the state is the wrapped optimizer's)
        if isinstance(optimizer, DPOptimizer) or not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigurationTypeError(
                "DPOptimizer wraps a torch.optim.Optimizer (SGD, AdamW, ...), got "
                f"{type(optimizer).__qualname__}"
            )
        if not isinstance(hooks, Hooks):
            raise ConfigurationTypeError(
                f"hooks must be the handle of gradhooks.add_hooks(model, quantities=('norms',)),"
                f" got {type(hooks).__qualname__}"
            )
        if not ({"grad1", "norms"} & set(hooks.quantities)):
            raise ConfigurationError(
                "DPOptimizer needs a handle that computes per-example norms or gradients: "
                "gradhooks.add_hooks(model, quantities=('norms',)) (or ('grad1',)), this one "
                f"has quantities={hooks.quantities!r}"
            )
        _check_settings(
            "DPOptimizer", max_grad_norm, noise_multiplier, expected_batch_size, generator,
            clipping, clipping_groups, adaptive_clipping,
        )  # fmt: skip
        _dp.check_scaler(scaler)
        resolved = _dp._checked_method(hooks, method)
        if sample_rate is not None:
            require_number("sample_rate", sample_rate, "DPOptimizer")
        if sample_rate is not None and not 0 < sample_rate <= 1:
            raise ConfigurationError(
                f"sample_rate must be in (0, 1] (expected batch size / number of examples), "
                f"got {sample_rate!r}"
            )
        if accountant is not None:
            if not isinstance(accountant, PrivacyAccountant):
                raise ConfigurationTypeError(
                    "accountant must be a gradhooks.PrivacyAccountant or None, got "
                    f"{type(accountant).__qualname__}"
                )
            if sample_rate is None:
                raise ConfigurationError(
                    "DPOptimizer(accountant=...) records each step's sampling rate: pass "
                    "sample_rate= (expected batch size / number of examples)"
                )
        params = _dp._covered_params(hooks)
        _check_optimizer_params(optimizer, hooks, params)
        # (the groups refused now, as each backward would refuse them)
        _dp.grouped(
            hooks, resolved, params, max_grad_norm, clipping_groups, "DPOptimizer",
            "max_grad_norm",
        )  # fmt: skip
        self.optimizer = optimizer
        self.hooks = hooks
        self.max_grad_norm: float | list[float] = (
            [float(c) for c in max_grad_norm]
            if isinstance(max_grad_norm, Sequence)
            else float(max_grad_norm)
        )
        self.clipping_groups = clipping_groups
        self.noise_multiplier = float(noise_multiplier)
        self.expected_batch_size = expected_batch_size
        self.sample_rate = sample_rate
        self.accountant = accountant
        self.generator = generator
        self.method = method
        self.scaler = scaler
        self.clipping = clipping
        self.adaptive_clipping = adaptive_clipping
        self._sums: list[Tensor] | None = None  # the clipped sum since the last step
        # (name, parameter) of each of the buffer's sums: the trainable parameters the first
        # backward since the last step clipped, in the order of the sums
        self._held: list[tuple[str, torch.nn.Parameter]] = []
        # the .grad the last backward left each of them with (_GradMark), which the step
        # replaces: a change made to it since would be lost
        self._marks: list[_GradMark] = []
        self._unclipped: Tensor | None = None  # (adaptive) examples not clipped since then
        self._bound: float | list[float] | None = None  # the bound of the buffer's backwards
        self._finite = True  # no scaled backward since the last step overflowed
        self._examples = 0  # examples in the buffer
        self._backwards = 0  # physical batches in the buffer
        # (the wrapped optimizer stepped by hand would step on the unclipped, unnoised .grad)
        self._guarded = _guard(optimizer, _refuse_direct_steps(self))

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
        """The wrapped optimizer's ``state_dict()`` (with adaptive clipping, and the bound now
        under ``"adaptive_clipping_bound"``). The clipped sum of a logical batch in progress is
        not in it: save between steps."""
        state = self.optimizer.state_dict()
        if self.adaptive_clipping is not None:
            state = {**state, _BOUND_KEY: self.max_grad_norm}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The wrapped optimizer's ``load_state_dict()`` (and the adaptive bound, where
        saved); empties the clipped-sum buffer."""
        if not isinstance(state_dict, Mapping):
            raise ConfigurationTypeError(
                "DPOptimizer.load_state_dict takes the dictionary that state_dict() returned, "
                f"got {type(state_dict).__qualname__}"
            )
        bound = state_dict.get(_BOUND_KEY)
        if (bound is None) != (self.adaptive_clipping is None):
            raise ConfigurationError(
                "DPOptimizer.load_state_dict: "
                + ("the state has an adaptive clipping bound and this optimizer has no "
                   "adaptive_clipping" if bound is not None else
                   "this optimizer has adaptive_clipping and the state has no bound to resume "
                   "from (a state of an optimizer without it)")
            )  # fmt: skip
        self.optimizer.load_state_dict({k: v for k, v in state_dict.items() if k != _BOUND_KEY})
        if bound is not None:
            self.max_grad_norm = float(bound)
        self._forget()

    # (hooks of the step and of the state dict: the wrapped optimizer's, which run them)
    def register_step_pre_hook(self, hook: Any) -> Any:  # type: ignore[override]
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Any) -> Any:  # type: ignore[override]
        return self.optimizer.register_step_post_hook(hook)

    def register_state_dict_pre_hook(self, hook: Any, prepend: bool = False) -> Any:  # type: ignore[override]
        return self.optimizer.register_state_dict_pre_hook(hook, prepend)

    def register_state_dict_post_hook(self, hook: Any, prepend: bool = False) -> Any:  # type: ignore[override]
        return self.optimizer.register_state_dict_post_hook(hook, prepend)

    def register_load_state_dict_pre_hook(self, hook: Any, prepend: bool = False) -> Any:  # type: ignore[override]
        return self.optimizer.register_load_state_dict_pre_hook(hook, prepend)

    def register_load_state_dict_post_hook(self, hook: Any, prepend: bool = False) -> Any:  # type: ignore[override]
        return self.optimizer.register_load_state_dict_post_hook(hook, prepend)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not isinstance(param_group, Mapping) or "params" not in param_group:
            raise ConfigurationTypeError(
                "DPOptimizer.add_param_group takes a dict with 'params' (as "
                f"torch.optim.Optimizer.add_param_group does), got {type(param_group).__qualname__}"
            )
        probe = torch.optim.SGD(param_group["params"], lr=0.0)
        _check_optimizer_params(
            probe, self.hooks, _dp._covered_params(self.hooks), "DPOptimizer.add_param_group",
            first=len(self.optimizer.param_groups),
        )  # fmt: skip
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
        self._check_settings("DPOptimizer.backward")
        _check_optimizer_params(  # (before the backward: a refusal changes nothing)
            self.optimizer, self.hooks, _dp._covered_params(self.hooks), "DPOptimizer.backward"
        )
        if self._sums is not None:
            self._same_params("DPOptimizer.backward")
            self._same_bound("DPOptimizer.backward")
            self._same_grads("DPOptimizer.backward")
        got = _dp.warned_clipped_sum(
            self.hooks, per_example_loss, self.max_grad_norm, self.method, self.scaler,
            self.clipping, self.clipping_groups, "DPOptimizer.backward",
        )  # fmt: skip
        if self._sums is None:
            self._sums = [s.to(_accumulation_dtype(s.dtype)) for s in got.sums]
            plan = _dp._checked_plan(self.hooks)
            self._held = list(zip(plan.names, got.params, strict=True))
            self._bound = copy.copy(self.max_grad_norm)
            self._sparse = got.sparse
        else:
            for buf, s in zip(self._sums, got.sums, strict=True):
                buf.add_(s)
        if self.adaptive_clipping is not None:  # (a tensor: read once, at the step)
            count = (got.norms <= self.max_grad_norm).sum()
            self._unclipped = count if self._unclipped is None else self._unclipped + count
        self._marks = [_GradMark.of(p) for _, p in self._held]
        self._finite = self._finite and got.finite
        self._examples += per_example_loss.shape[0]
        self._backwards += 1
        return got.norms

    def step(self, closure: Callable[[], Any] | None = None) -> bool:  # type: ignore[override]
        """Noise once, ``p.grad = (clipped sum + σ·C·N(0, I)) / expected_batch_size`` (``C`` the
        total bound), the wrapped optimizer's step (through the scaler where there is one), the
        step recorded in the accountant, the buffer emptied. Returns whether the optimizer
        stepped (False only where a scaled backward overflowed and the step was skipped).

        ``closure``: as torch's optimizers take one (PyTorch Lightning's manual optimization
        passes one that does nothing), called first, with gradients enabled; it may run the
        forward and :meth:`backward` of the last physical batch."""
        if closure is not None and not callable(closure):
            raise ConfigurationTypeError(
                f"DPOptimizer.step: closure must be a function or None, got "
                f"{type(closure).__qualname__}"
            )
        if closure is not None:
            with torch.enable_grad():
                closure()
        if self._sums is None:
            raise StateError(
                "DPOptimizer.step: no backward(per_example_loss) since the last step, so "
                "there is no clipped gradient to noise. Call opt.backward(losses) on each "
                "physical batch of the logical batch (an empty batch too: its losses have 0 "
                "rows), then opt.step(); a plain loss.backward() is not clipped."
            )
        self._check_settings("DPOptimizer.step")
        _dp.check_batch_against_expected(
            self._examples, self.expected_batch_size, "DPOptimizer.step"
        )
        params = self._same_params("DPOptimizer.step")
        self._same_bound("DPOptimizer.step")
        self._same_grads("DPOptimizer.step")
        _check_optimizer_params(self.optimizer, self.hooks, params, "DPOptimizer.step")
        scale = 1.0
        if self.scaler is not None and self.scaler.is_enabled():
            scale = float(self.scaler.get_scale())
        if not self._finite:  # (scaler.step sees NaN, skips, and update() lowers the scale)
            for p in params:
                _dp.write_grad(p, torch.full(p.shape, float("nan"), dtype=p.dtype, device=p.device))
        else:
            multiplier = self.noise_multiplier
            if self.adaptive_clipping is not None:
                multiplier = self.adaptive_clipping.gradient_noise_multiplier(
                    multiplier, self.expected_batch_size
                )
            groups = _dp.grouped(
                self.hooks, _dp._checked_method(self.hooks, self.method), params,
                self.max_grad_norm, self.clipping_groups, "DPOptimizer.step", "max_grad_norm",
            )  # fmt: skip
            std = multiplier * _dp.noise_bound(self.max_grad_norm, groups)
            for p, s, sparse in zip(params, self._sums, self._sparse, strict=True):
                # (the noise drawn into the gradient's own tensor, around the sum)
                grad = _dp.noise(p, self.generator, std, s) if std > 0 else s.to(p.dtype)
                grad = grad.div_(self.expected_batch_size)
                _dp.write_grad(p, _dp.as_grad(grad if scale == 1.0 else grad.mul_(scale), sparse))
        _dp.drop_stale_grads(self, params)
        stepped = self._finite
        if stepped and self.adaptive_clipping is not None:
            self._adapt_bound(params[0].device if params else torch.device("cpu"))
        _STEPPING.add(id(self._guarded))
        try:
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        finally:
            _STEPPING.discard(id(self._guarded))
        if stepped and self.accountant is not None:
            assert self.sample_rate is not None
            self.accountant.step(
                noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate
            )
        self._forget()
        return stepped

    def zero_grad(self, set_to_none: bool = True, *, discard: bool = False) -> None:
        """The wrapped optimizer's ``zero_grad`` and an empty clipped-sum buffer; called once
        per logical batch, after :meth:`step` (or before its first :meth:`backward`). Refused
        while the buffer holds physical batches of a logical batch not stepped yet (Opacus'
        ``BatchMemoryManager`` loops call ``zero_grad()`` before every physical batch: here
        that would drop the ones before, and the step would be of the last alone), unless
        ``discard=True`` says to drop them."""
        if not isinstance(discard, bool):  # (discard="no" dropped them, by its truth)
            raise ConfigurationTypeError(
                f"DPOptimizer.zero_grad: discard takes True or False, got "
                f"{type(discard).__qualname__} {discard!r}"
            )
        if self._backwards and not discard:
            raise StateError(
                f"DPOptimizer.zero_grad: the buffer holds the clipped gradients of "
                f"{self._backwards} physical batch(es) ({self._examples} examples) of a logical "
                "batch not stepped yet, which zero_grad() would drop: the step would be of the "
                "physical batches after it alone, divided by expected_batch_size="
                f"{self.expected_batch_size!r}. Call zero_grad() once per logical batch, after "
                "step() (an Opacus BatchMemoryManager loop calls it before every physical "
                "batch: leave that call out, and call step() at the logical batch's end only); "
                "or zero_grad(discard=True) to drop them on purpose. Nothing was changed."
            )
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._forget()

    def _adapt_bound(self, device: torch.device) -> None:
        """The next step's bound, from this step's count of unclipped examples and the
        count's noise (drawn after the gradient's, from the same generator)."""
        adaptive = self.adaptive_clipping
        assert adaptive is not None
        if self.generator is not None:
            device = self.generator.device
        z = torch.randn((), generator=self.generator, dtype=torch.float64, device=device)
        count = self._unclipped
        noisy = (0.0 if count is None else float(count)) + adaptive.count_std(
            self.expected_batch_size
        ) * float(z)
        bound = self.max_grad_norm
        assert isinstance(bound, float)  # (one bound: AdaptiveClipping.check)
        self.max_grad_norm = adaptive.updated(bound, noisy, self.expected_batch_size)

    def _same_params(self, where: str) -> list[torch.nn.Parameter]:
        """The hooked model's trainable parameters now, after refusing a change since the
        buffer's first backward (a layer frozen or unfrozen between the physical batches of a
        logical batch): its sums are of the parameters as they were then, in their order, and
        would be added to, or noised as, the gradients of others."""
        plan = _dp._checked_plan(self.hooks)
        held = [p for _, p in self._held]
        if [id(p) for p in plan.params] == [id(p) for p in held]:
            return list(plan.params)
        now = {id(p) for p in plan.params}
        was = {id(p) for p in held}
        joined = [
            f"'{n}' {tuple(p.shape)}"
            for n, p in zip(plan.names, plan.params, strict=True)
            if id(p) not in was
        ]
        left = [f"'{n}' {tuple(p.shape)}" for n, p in self._held if id(p) not in now]
        what = "; ".join(
            part for part in (
                f"trainable now and not then: {', '.join(joined)}" if joined else "",
                f"trainable then and not now: {', '.join(left)}" if left else "",
                "the same parameters in another order" if not joined and not left else "",
            ) if part
        )  # fmt: skip
        raise StateError(
            f"{where}: the hooked model's trainable parameters changed since the first "
            f"backward of this logical batch ({self._backwards} physical batch(es), "
            f"{self._examples} examples, in the buffer): {what}. The buffer holds the clipped "
            "sums of the parameters as they were, which would go to other parameters' "
            "gradients. Change requires_grad (or the model's layers) between steps, after "
            "opt.step(); or call opt.zero_grad(discard=True) to drop the batches so far and run "
            "the logical batch again. Nothing was changed by this call."
        )

    def _check_settings(self, where: str) -> None:
        """The settings as they are now, refused before anything changes: a schedule may
        rewrite ``max_grad_norm``, ``noise_multiplier`` or ``expected_batch_size`` between
        steps (Opacus' noise and clipping schedulers do), and a NaN or negative noise
        multiplier would draw no noise at all, silently."""
        _check_settings(
            where, self.max_grad_norm, self.noise_multiplier, self.expected_batch_size,
            self.generator, self.clipping, self.clipping_groups, self.adaptive_clipping,
        )  # fmt: skip

    def _same_bound(self, where: str) -> None:
        """Refuses a bound changed since the buffer's first backward (a clipping schedule
        stepped between the physical batches of a logical batch): its examples were clipped
        to the bound as it was, and the noise of another bound would not cover them."""
        if self.max_grad_norm == self._bound:
            return
        raise StateError(
            f"{where}: max_grad_norm changed from {self._bound!r} to {self.max_grad_norm!r} "
            f"since the first backward of this logical batch ({self._backwards} physical "
            f"batch(es), {self._examples} examples, in the buffer), whose examples were "
            "clipped to the bound as it was: the noise, σ times the bound, would not match "
            "their clipping (too little noise where the bound went down). Change the bound "
            "between steps, after opt.step(); or call opt.zero_grad(discard=True) to drop the "
            "batches so far. Nothing was changed by this call."
        )

    def _same_grads(self, where: str) -> None:
        """Refuses a ``.grad`` changed since the last backward (``clip_grad_value_`` or
        ``clip_grad_norm_`` there, as a plain loop clips, a ``GradScaler``'s ``unscale_``, a
        plain ``loss.backward()`` adding to it): the step replaces ``.grad`` with the noised
        clipped mean, and the change would be lost without a word. A ``.grad`` set to ``None``
        since is no change that matters."""
        for (name, p), mark in zip(self._held, self._marks, strict=True):
            how = mark.changed(p)
            if how is None:
                continue
            raise StateError(
                f"{where}: the .grad of parameter '{name}' {tuple(p.shape)} was {how} since "
                f"DPOptimizer.backward left it (the buffer holds {self._backwards} physical "
                f"batch(es), {self._examples} examples): torch.nn.utils.clip_grad_value_ or "
                "clip_grad_norm_ between the backward and the step, a GradScaler's unscale_, "
                "or a plain loss.backward(). The step writes .grad afresh, the noised clipped "
                "mean of the buffer, so that change would be lost. To clip or rescale the DP "
                "step's gradient, do it after the step wrote it and before the wrapped "
                "optimizer uses it: opt.register_step_pre_hook(lambda *_: "
                "torch.nn.utils.clip_grad_value_(model.parameters(), value)) (post-processing "
                "of the private gradient). Or let go of the change (model.zero_grad(), which "
                "keeps the buffer) and call step() again. Nothing was changed by this call."
            )

    def _forget(self) -> None:
        self._bound = None
        self._unclipped = None
        self._sums = None
        self._held = []
        self._marks = []
        self._sparse: list[bool] = []
        self._finite = True
        self._examples = 0
        self._backwards = 0

    def __repr__(self) -> str:
        adaptive = "" if self.adaptive_clipping is None else f", {self.adaptive_clipping}"
        return (
            f"DPOptimizer({type(self.optimizer).__qualname__}, max_grad_norm="
            f"{self.max_grad_norm}, noise_multiplier={self.noise_multiplier}, "
            f"expected_batch_size={self.expected_batch_size}{adaptive})"
        )


class _GradMark(NamedTuple):
    """The ``.grad`` a parameter held: the tensor (weakly, ``None`` for none) and its version."""

    grad: weakref.ref | None
    version: int

    @classmethod
    def of(cls, p: torch.nn.Parameter) -> _GradMark:
        g = p.grad
        return cls(None, -1) if g is None else cls(weakref.ref(g), _torch.version(g))

    def changed(self, p: torch.nn.Parameter) -> str | None:
        """How ``p.grad`` changed since it was marked (``None``: it did not, or it is ``None``
        now)."""
        g = p.grad
        if g is None:
            return None
        if self.grad is None:
            return "set"
        if self.grad() is not g:
            return "replaced by another tensor"
        return "changed in place" if _torch.version(g) != self.version else None


# (DPOptimizer.state_dict's key for the adaptive bound now)
_BOUND_KEY = "adaptive_clipping_bound"


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least float32 for the buffer (bfloat16 parameters' sums over physical batches)."""
    return torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else dtype


def _check_optimizer_params(
    optimizer: torch.optim.Optimizer,
    hooks: Hooks,
    covered: list[torch.nn.Parameter],
    where: str = "DPOptimizer",
    first: int = 0,
) -> None:
    """Every trainable parameter the optimizer steps is one the hooks clip: another would be
    stepped on a gradient that is neither clipped nor noised. Checked when the optimizer is
    wrapped and again at each backward and step (``where``): a parameter of the model replaced
    since (``load_state_dict(assign=True)``, ``layer.weight = nn.Parameter(...)``) stays in
    the optimizer, which would step the old one and leave the model as it was. ``first``: the
    index of the optimizer's first group among those of the optimizer it is added to."""
    ids = {id(p) for p in covered}
    planned = {id(p) for p in _dp._plan(hooks).walked}  # (the model's at its last forward)
    model = hooks.model
    # (the model's parameters now; FSDP2: the sharded ones, whatever stand-in is in a slot)
    names = {id(p): n for n, p in engine_of(hooks).named_parameters()}
    for k, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if not p.requires_grad or (id(p) in ids and id(p) in names):
                continue
            if id(p) in names and id(p) not in planned:
                continue  # (put in the model since its last forward: checked at the backward)
            if id(p) in names:
                raise ConfigurationError(
                    f"{where}: the optimizer steps a trainable parameter '{names[id(p)]}' "
                    f"{tuple(p.shape)} that the hooks do not clip (its layer has no rule): its "
                    "step would use a gradient with neither clipping nor noise. Freeze it, or "
                    "give the optimizer the clipped parameters only. Nothing was changed."
                )
            owner = type(model).__qualname__ if model is not None else "no longer alive"
            if where.endswith("add_param_group"):
                raise ConfigurationError(
                    f"{where}: the new group (param_groups[{first + k}]) holds a trainable "
                    f"parameter of shape {tuple(p.shape)} that is not one of the hooked "
                    f"model's ({owner}), so the hooks do not clip it: its step would use a "
                    "gradient with neither clipping nor noise. Give add_param_group the "
                    "model's own parameters (a new layer: put it in the model first, so that "
                    "its forward runs under the hooks), or freeze that tensor "
                    "(requires_grad_(False)). Nothing was changed."
                )
            raise ConfigurationError(
                f"{where}: the optimizer steps a trainable parameter of shape "
                f"{tuple(p.shape)} that the hooks do not clip (param_groups[{first + k}]): it is "
                f"not one of the hooked model's ({owner}) now. The model's parameter was replaced "
                "after the optimizer was built (load_state_dict(..., assign=True), "
                "layer.weight = nn.Parameter(...)), or the optimizer is another model's, or the "
                f"hooks were added to a part of the model ({owner}: add_hooks(model.body)) and "
                "the optimizer holds the rest of it too (a head, a learned temperature), which "
                "the hooks do not see. Its step would move that old tensor and leave the model "
                "as it was, or use a gradient with neither clipping nor noise. Build the "
                "optimizer over model.parameters() again (and the DPOptimizer around it), load "
                "checkpoints without assign=True, or hook the whole model that the losses are "
                "computed through (add_hooks(model)). Nothing was changed."
            )


def _check_settings(
    where: str, max_grad_norm: Any, noise_multiplier: Any, expected_batch_size: Any,
    generator: Any, clipping: Any, clipping_groups: _clip.ClippingGroups,
    adaptive_clipping: Any,
) -> None:  # fmt: skip
    """Refuse the settings of a :class:`DPOptimizer` that cannot be a DP step: bounds that are
    not numbers > 0 and finite, a noise multiplier that is not a number >= 0 and finite, an
    expected batch size that is not a number > 0 (required: ``None`` would divide by the
    batch's own size), adaptive clipping it cannot follow."""
    _clip.check_bounds(max_grad_norm, clipping_groups, where, "max_grad_norm")
    require_number("noise_multiplier", noise_multiplier, where)
    _dp._check_clipping(_clip.total_bound(max_grad_norm), noise_multiplier, generator, clipping)
    require_number("expected_batch_size", expected_batch_size, where)
    _dp._check_expected_batch_size(expected_batch_size, "mean")
    if adaptive_clipping is not None:
        if not isinstance(adaptive_clipping, _clip.AdaptiveClipping):
            raise ConfigurationTypeError(
                "adaptive_clipping must be a gradhooks.AdaptiveClipping or None, got "
                f"{type(adaptive_clipping).__qualname__}"
            )
        adaptive_clipping.check(
            max_grad_norm, noise_multiplier, expected_batch_size, clipping, clipping_groups, where
        )


_STEPPING: set[int] = set()  # the wrapped optimizers a DPOptimizer.step is stepping now


def _guard(optimizer: torch.optim.Optimizer, hook: Callable[..., None]) -> Any:
    """``hook`` registered as a step pre-hook of ``optimizer``, or of the optimizer it wraps
    where it takes none itself (accelerate's ``AcceleratedOptimizer`` is an ``Optimizer``
    whose ``Optimizer.__init__`` never ran; its step is the wrapped one's): the optimizer
    whose hooks run, or ``None``."""
    for _ in range(8):
        try:
            optimizer.register_step_pre_hook(hook)
            return optimizer
        except AttributeError:
            inner = getattr(optimizer, "optimizer", None)
            if not isinstance(inner, torch.optim.Optimizer):
                return None
            optimizer = inner
    return None


def _refuse_direct_steps(dp: DPOptimizer) -> Callable[..., None]:
    """A step pre-hook for the optimizer ``dp`` wraps: its own ``step()``, called by hand
    while ``dp`` and its hooks are there, would step on ``.grad`` as a plain backward left it,
    neither clipped nor noised, and unrecorded: refused before it changes anything. (The hook
    holds ``dp`` weakly: once it is gone, or its hooks removed, the optimizer steps freely.)"""
    ref = weakref.ref(dp)

    def refuse(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        owner = ref()
        if owner is None or id(optimizer) in _STEPPING or not owner.hooks.active:
            return
        private = isinstance(owner, _OwnedDPOptimizer)
        raise StateError(
            f"{type(optimizer).__qualname__}.step() called on the optimizer that "
            + ("a gradhooks.make_private training" if private else "a gradhooks.DPOptimizer")
            + " wraps: it would step on .grad as a plain backward left it, neither clipped "
            "nor noised, and the accountant would not record it, so the model would no longer "
            "be private. "
            + ("Call private.backward(losses) and private.step() instead"
               if private else "Call dp_optimizer.backward(losses) and dp_optimizer.step()")
            + " (or close the private training, or remove its hooks, to train without DP). "
            "The optimizer did not step."
        )  # fmt: skip

    return refuse


class _OwnedDPOptimizer(DPOptimizer):
    """The DPOptimizer of a :class:`PrivateTraining`: its ``backward`` and ``step`` run only
    through the owner, which checks the batch, the logical batch's end and the budget."""

    _by_owner = False

    def backward(self, per_example_loss: Tensor) -> Tensor:
        self._refuse_unless_owner("backward")
        return super().backward(per_example_loss)

    def step(self, closure: Callable[[], Any] | None = None) -> bool:  # type: ignore[override]
        self._refuse_unless_owner("step")
        return super().step(closure)

    def _refuse_unless_owner(self, what: str) -> None:
        if not self._by_owner:
            raise StateError(
                f"this DPOptimizer belongs to a gradhooks.make_private training: call "
                f"private.{what}(...), which knows where a logical batch ends and the budget "
                "(an LR scheduler may still take private.optimizer)"
            )


def changed_setting(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """The first of a run's settings ``now`` that a checkpoint's ``saved`` differs in."""
    return next((k for k in now if saved.get(k) != now[k]), None)


# the make_private run training each model (both held weakly)
_RUNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _gone() -> None:
    return None


class PrivateTraining:
    """A DP-SGD training run that owns its whole mechanism; made by :func:`make_private`.

    Its parts are the ones a hand-written loop wires together, wired once: the hooks
    (per-example clipping), the Poisson batches over the data (each split into physical
    batches of at most ``max_physical_batch_size``), the :class:`DPOptimizer` (noise once per
    logical batch, divided by the expected batch size), the :class:`PrivacyAccountant` (every
    step recorded, no other) and the budget (a step past it raises
    :class:`gradhooks.PrivacyBudgetExceeded`). The loop is::

        for x, y in private.batches():          # physical batches, until the budget is spent
            private.backward(F.cross_entropy(model(x), y, reduction="none"))
            if private.step():                  # True where a logical batch ended
                scheduler.step()                # (any torch LR scheduler of private.optimizer)
        private.epsilon                         # the ε spent, at private.delta

    The API is small so that a loop has one way to be written: the batches come only from
    :meth:`batches` (so their sampling is the accountant's), :meth:`backward` takes one loss
    per example of the batch it just gave, :meth:`step` is called after every physical batch
    and steps only at a logical batch's end, and the optimizer it wraps refuses to be stepped
    around it. :meth:`batches` runs to the end of the planned steps; called again once they
    are all taken it raises (an epoch loop around it would otherwise train on past the
    budget). Breaking out of it and calling it again restarts the unfinished logical batch.

    Attributes:
        model, hooks, optimizer (the :class:`DPOptimizer`, for LR schedulers), accountant,
        noise_multiplier (σ), max_grad_norm (C; with adaptive clipping, the bound now),
        sample_rate (q), expected_batch_size (qn),
        steps (the planned number of steps), delta, target_epsilon (or None).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Any,
        loader_kwargs: dict[str, Any],
        collate_fn: Any,
        *,
        noise_multiplier: float,
        max_grad_norm: float | Sequence[float],
        sample_rate: float,
        expected_batch_size: float,
        steps: int,
        delta: float,
        target_epsilon: float | None,
        accountant: Literal["rdp", "pld"],
        max_physical_batch_size: int | None,
        generator: torch.Generator | None,
        scaler: torch.amp.GradScaler | None,
        clipping: Literal["flat", "automatic"] = "flat",
        clipping_groups: _clip.ClippingGroups = None,
        adaptive_clipping: _clip.AdaptiveClipping | None = None,
    ) -> None:
        self.model = model
        self.dataset = dataset
        self.num_examples = len(dataset)
        self.noise_multiplier = float(noise_multiplier)
        self.clipping = clipping
        self.clipping_groups = clipping_groups
        self.adaptive_clipping = adaptive_clipping
        self.sample_rate = float(sample_rate)
        self.expected_batch_size = float(expected_batch_size)
        self.steps = int(steps)
        self.delta = float(delta)
        self.target_epsilon = target_epsilon
        self.max_physical_batch_size = max_physical_batch_size
        self.scaler = scaler
        self.accountant = PrivacyAccountant(accountant)
        self._collate = EmptyAware(dataset, collate_fn)
        self._loader_kwargs = loader_kwargs
        # two streams from the user's generator (or the OS's entropy): the batches' and the
        # noise's, each saved with a checkpoint
        if generator is None:
            generator = torch.Generator()
            generator.seed()
        seeds = torch.randint(2**62, (2,), generator=generator).tolist()
        device = next(p.device for p in model.parameters())
        self._batch_generator = torch.Generator().manual_seed(seeds[0])
        noise = torch.Generator(device=device).manual_seed(seeds[1])
        running = _RUNS.get(model, _gone)()
        if running is not None and not running._closed and running.hooks.active:
            raise StateError(
                f"{type(model).__qualname__} is already trained by a gradhooks.make_private run "
                "that was not closed (its hooks clip every gradient): call close() on that run "
                "(or use it as a context manager, with gradhooks.make_private(...) as private:) "
                "before starting another. Nothing was changed."
            )
        self.hooks = add_hooks(model, quantities=("norms",))
        try:
            self.optimizer: DPOptimizer = _OwnedDPOptimizer(
                optimizer, self.hooks, max_grad_norm=max_grad_norm,
                noise_multiplier=noise_multiplier, expected_batch_size=self.expected_batch_size,
                sample_rate=self.sample_rate, accountant=self.accountant, generator=noise,
                scaler=scaler, clipping=clipping, clipping_groups=clipping_groups,
                adaptive_clipping=adaptive_clipping,
            )  # fmt: skip
        except BaseException:
            self.hooks.remove()
            raise
        self._initial_bound = self.optimizer.max_grad_norm  # (the plan's)
        self._done = 0  # logical batches done (stepped, or skipped by the scaler)
        self._states: dict[int, Tensor] = {}  # batch generator's state before logical batch k
        self._pending: collections.deque = collections.deque()  # (k, last, size) per physical
        self._current: _Physical | None = None
        self._loops = 0  # loops over batches() started
        self._closed = False
        _RUNS[model] = weakref.ref(self)

    # -- the loop ------------------------------------------------------------------------------

    @property
    def max_grad_norm(self) -> float | list[float]:
        """``C``, the clipping bound (with adaptive clipping, the bound now)."""
        return self.optimizer.max_grad_norm

    @property
    def epsilon(self) -> float:
        """The ε spent so far, at :attr:`delta`, by the accountant (0.0 before any step)."""
        return self.accountant.epsilon(self.delta)

    @property
    def steps_taken(self) -> int:
        """The steps taken and recorded (a step the scaler skipped is not one)."""
        return self.accountant.steps

    def batches(self) -> Iterator[Any]:
        """The physical batches of every remaining logical batch, as the data's collate
        function gives them, until the planned steps are all taken. Each logical batch holds
        every example independently with probability :attr:`sample_rate`; it is split into
        physical batches of at most ``max_physical_batch_size`` examples (one physical batch
        with 0 rows where it is empty: run it too, it steps on the noise alone)."""
        self._check_open()
        if self.accountant.steps >= self.steps:
            raise PrivacyBudgetExceeded(self._spent())
        self._restart()
        self._loops += 1
        loop = self._loops  # (a loop started later takes over; this one may not go on)
        loader = DataLoader(
            self.dataset, batch_sampler=_Indices(self), collate_fn=self._collate,
            **self._loader_kwargs,
        )  # fmt: skip
        it = iter(loader)
        try:
            while self.accountant.steps < self.steps:
                batch = next(it)
                k, last, size = self._pending.popleft()
                self._current = _Physical(k, last, size)
                yield batch
                if loop != self._loops:
                    raise StateError(
                        "private.batches(): another loop over private.batches() started since; "
                        "it restarted the logical batch in progress, and this one cannot go on"
                    )
                if self._current is not None and not self._current.stepped:
                    raise StateError(
                        "private.batches(): the next batch was asked for before "
                        "private.backward(losses) and private.step() on the last one; call both "
                        "for every batch before taking the next (step() only steps at a logical "
                        "batch's end). A loop that reads a batch ahead (PyTorch Lightning's fit "
                        "loop fetches the next batch before the training step of this one) "
                        "cannot take private.batches() as its loader: take each batch inside "
                        "the step (Lightning: def training_step(self, dataloader_iter): batch, "
                        "batch_idx, _ = next(dataloader_iter))"
                    )
        finally:
            if loop == self._loops:
                self._current = None
            del it

    def backward(self, per_example_loss: Tensor) -> Tensor:
        """Backward of the current physical batch's per-example losses (``[batch]``, one per
        example of the batch :meth:`batches` just gave): their clipped gradients are added to
        the logical batch's sum. Returns their norms before clipping."""
        self._check_open()
        now = self._current
        if now is None:
            raise StateError(
                "private.backward: no current batch; take the batches from private.batches() "
                "(a batch from elsewhere is not the accountant's Poisson sample)"
            )
        if now.backward:
            raise StateError(
                "private.backward was already called on this physical batch; call "
                "private.step() next"
            )
        if per_example_loss.dim() != 1 or per_example_loss.shape[0] != now.size:
            raise ConfigurationError(
                f"private.backward: per_example_loss has shape {tuple(per_example_loss.shape)},"
                f" the batch private.batches() gave holds {now.size} examples: pass one loss "
                "per example, [batch] (reduction='none')"
            )
        self.optimizer._by_owner = True
        try:
            norms = self.optimizer.backward(per_example_loss)
        finally:
            self.optimizer._by_owner = False
        now.backward = True
        return norms

    def step(self) -> bool:
        """After each physical batch's :meth:`backward`: at a logical batch's end, the DP-SGD
        step (noise, the optimizer's step, the accountant's record) and ``zero_grad``; else
        nothing. Returns whether a logical batch ended (a step was taken, or skipped by the
        scaler: then the accountant records nothing and :meth:`batches` draws another)."""
        self._check_open()
        now = self._current
        if now is None or not now.backward or now.stepped:
            raise StateError(
                "private.step: call private.backward(losses) on the batch private.batches() "
                "just gave first (once per physical batch)"
            )
        if not now.last:
            now.stepped = True
            return False
        if self.accountant.steps >= self.steps:
            raise PrivacyBudgetExceeded(self._spent())
        self.optimizer._check_settings("private.step")
        if self.optimizer.noise_multiplier < self.noise_multiplier:
            raise PrivacyBudgetExceeded(self._lowered())
        self.optimizer._by_owner = True
        try:
            self.optimizer.step()
        finally:
            self.optimizer._by_owner = False
        self.optimizer.zero_grad(set_to_none=True)
        self._states.pop(self._done, None)
        self._done += 1
        now.stepped = True
        return True

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue as this one would have: the model's and
        the optimizer's state, the scaler's, the accountant's history, both generators' states
        and the number of logical batches done. Taken in the middle of a logical batch, it is
        the state before that batch (which a resumed run draws and runs again). An LR
        scheduler's state is its own ``scheduler.state_dict()``."""
        self._check_open()
        sampler = self._states.get(self._done, None)
        if sampler is None:
            sampler = self._batch_generator.get_state()
        return {
            "plan": self._plan(),
            "logical_batches": self._done,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "accountant": self.accountant.state_dict(),
            "batch_generator": sampler.clone(),
            "noise_generator": self.optimizer.generator.get_state().clone(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` of a run with the same plan (σ, C, q, steps, δ,
        accountant, physical batch size, number of examples)."""
        self._check_open()
        if self._current is not None:
            raise StateError(
                "load_state_dict inside a loop over private.batches(): load the checkpoint "
                "before the loop (a new loop then starts where the checkpoint was taken)"
            )
        keys = ("plan", "logical_batches", "model", "optimizer", "accountant",
                "batch_generator", "noise_generator", "scaler")  # fmt: skip
        if not isinstance(state, Mapping):
            raise ConfigurationTypeError(
                f"load_state_dict takes what private.state_dict() returned (a dict), got "
                f"{type(state).__qualname__}"
            )
        missing = [k for k in keys if k not in state]
        if missing:  # (refused before the model or the optimizer is loaded)
            raise ConfigurationError(
                f"load_state_dict: the checkpoint lacks {missing}: it is not a "
                "private.state_dict() (a model's state_dict goes to model.load_state_dict)"
            )
        plan = self._plan()
        # (a checkpoint from before the choices)
        saved = {"clipping": "flat", "clipping_groups": None, "adaptive_clipping": None,
                 **state["plan"]}  # fmt: skip
        k = changed_setting(saved, plan)
        if k is not None:
            raise ConfigurationError(
                f"load_state_dict: the checkpoint's {k} is {saved.get(k)!r}, this "
                f"run's is {plan[k]!r}: resume with make_private(...) given the same settings"
            )
        if (state["scaler"] is None) != (self.scaler is None):
            raise ConfigurationError(
                "load_state_dict: the checkpoint and this run differ in a scaler"
            )
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.accountant.load_state_dict(state["accountant"])
        self._batch_generator.set_state(state["batch_generator"])
        self.optimizer.generator.set_state(state["noise_generator"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        self._done = int(state["logical_batches"])
        self._states = {}
        self._pending.clear()
        self._current = None

    # -- the end -------------------------------------------------------------------------------

    def close(self) -> None:
        """Remove the hooks and what the run left on the parameters (``grad1``, ``.grad``):
        the model is as it was before :func:`make_private`, but for its trained weights.
        Idempotent; the run can be used no more."""
        if self._closed:
            return
        self._closed = True
        self.optimizer.zero_grad(set_to_none=True, discard=True)
        self.hooks.remove()
        for p in self.model.parameters():
            if hasattr(p, "grad1"):
                del p.grad1

    def __enter__(self) -> PrivateTraining:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"PrivateTraining(steps={self.steps_taken}/{self.steps}, noise_multiplier="
            f"{self.noise_multiplier:.4g}, sample_rate={self.sample_rate:.4g}, "
            f"max_grad_norm={self.max_grad_norm}, delta={self.delta:g})"
        )

    # -- internals -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StateError("this private training was closed (its hooks are removed)")

    def _plan(self) -> dict[str, Any]:
        return {
            "noise_multiplier": self.noise_multiplier,
            "max_grad_norm": self._initial_bound,
            "clipping": self.clipping,
            "adaptive_clipping": (
                None if self.adaptive_clipping is None else self.adaptive_clipping.describe()
            ),
            "clipping_groups": _clip.describe(self.clipping_groups, self.model),
            "sample_rate": self.sample_rate,
            "steps": self.steps,
            "delta": self.delta,
            "accountant": self.accountant.method,
            "max_physical_batch_size": self.max_physical_batch_size,
            "num_examples": self.num_examples,
        }

    def _restart(self) -> None:
        """Start drawing at logical batch ``_done`` (again, if it was drawn before)."""
        state = self._states.get(self._done)
        if state is not None:
            self._batch_generator.set_state(state)
        self._states = {}
        self._pending.clear()
        self.optimizer.zero_grad(set_to_none=True, discard=True)

    def _spent(self) -> str:
        planned = PrivacyAccountant(self.accountant.method)
        planned.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate,
                     steps=self.steps)  # fmt: skip
        target = "" if self.target_epsilon is None else f" (target ε = {self.target_epsilon})"
        return (
            f"the privacy budget is spent: {self.steps_taken} of {self.steps} planned steps "
            f"are taken, at noise multiplier {self.noise_multiplier:.4g} and sampling rate "
            f"{self.sample_rate:.4g}, which give ε = {planned.epsilon(self.delta):.4g} at "
            f"δ = {self.delta:g}{target} by the {self.accountant.method!r} accountant; "
            "another step would spend more. Stop here (private.epsilon is the run's ε), or "
            "plan a longer run from the start: make_private(..., epochs= or steps=)."
        )

    def _lowered(self) -> str:
        target = "" if self.target_epsilon is None else f" (target ε = {self.target_epsilon})"
        return (
            f"private.step: private.optimizer.noise_multiplier is "
            f"{self.optimizer.noise_multiplier:.4g}, below the run's σ = "
            f"{self.noise_multiplier:.4g} (a noise schedule?): each step at it spends more "
            f"privacy than planned, so the {self.steps} planned steps would spend more than "
            f"their ε at δ = {self.delta:g}{target}. A schedule may raise σ (each step then "
            "spends less, and the accountant records the σ used), not lower it below the "
            "plan's; for a schedule of your own, use gradhooks.DPOptimizer with a "
            "PrivacyAccountant. Nothing was changed (restore the multiplier and call "
            "private.step() again)."
        )


class _Physical:
    """The physical batch :meth:`PrivateTraining.batches` gave last."""

    def __init__(self, logical: int, last: bool, size: int) -> None:
        self.logical, self.last, self.size = logical, last, size
        self.backward = False
        self.stepped = False


class _Indices:
    """A DataLoader's ``batch_sampler``: the physical batches of logical batches ``_done``,
    ``_done + 1``, ... of a :class:`PrivateTraining`, endlessly (the owner stops). It keeps
    the generator's state before each logical batch, and each physical batch's place, for the
    owner to read in order (the DataLoader may draw ahead of the training)."""

    def __init__(self, owner: PrivateTraining) -> None:
        self.owner = owner

    def __iter__(self) -> Iterator[list[int]]:
        owner = self.owner
        gen = owner._batch_generator
        with warnings.catch_warnings():  # (named expected_batch_size=: not a rate misplaced)
            warnings.simplefilter("ignore", GradhooksWarning)
            sampler = PoissonSampler(
                owner.num_examples, owner.expected_batch_size, steps=1, generator=gen
            )
        size = owner.max_physical_batch_size
        k = owner._done
        while True:
            owner._states[k] = gen.get_state()
            idx = next(iter(sampler))
            chunks = [idx[i : i + size] for i in range(0, len(idx), size)] if size else [idx]
            chunks = chunks or [[]]
            for i, chunk in enumerate(chunks):
                owner._pending.append((k, i == len(chunks) - 1, len(chunk)))
                yield chunk
            k += 1


def make_private(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Dataset | DataLoader,
    *,
    delta: float,
    max_grad_norm: float | Sequence[float],
    target_epsilon: float | None = None,
    noise_multiplier: float | None = None,
    epochs: float | None = None,
    steps: int | None = None,
    expected_batch_size: float | None = None,
    sample_rate: float | None = None,
    accountant: Literal["rdp", "pld"] = "rdp",
    max_physical_batch_size: int | None = None,
    generator: torch.Generator | None = None,
    scaler: torch.amp.GradScaler | None = None,
    clipping: Literal["flat", "automatic"] = "flat",
    clipping_groups: _clip.ClippingGroups = None,
    adaptive_clipping: _clip.AdaptiveClipping | None = None,
) -> PrivateTraining:
    """A DP-SGD training run of ``model`` by ``optimizer`` on ``data``: a
    :class:`PrivateTraining` that owns the hooks, the Poisson batches, the noise, the
    accountant and the budget.

    ::

        private = gradhooks.make_private(model, torch.optim.AdamW(model.parameters()), train_set,
                                         target_epsilon=3.0, delta=1e-5, epochs=3,
                                         expected_batch_size=64, max_grad_norm=1.0)
        for x, y in private.batches():
            private.backward(F.cross_entropy(model(x), y, reduction="none"))
            private.step()
        print(private.epsilon)       # <= 3.0
        private.close()              # the hooks off the model

    Args:
        model: the model; its hooks (``quantities=("norms",)``, book-keeping clipping: no
            ``grad1`` formed) are added here and removed by :meth:`PrivateTraining.close`.
        optimizer: any torch optimizer over the model's parameters.
        data: a map-style ``Dataset``, or a ``DataLoader`` over one, whose ``collate_fn``,
            ``num_workers``, ``pin_memory`` and worker settings are kept (its batch size,
            sampler and shuffling are replaced by Poisson sampling).
        delta: δ of the (ε, δ) guarantee, well below 1 / number of examples (one of
            ``1/n`` or more, which publishing one example in the clear meets, warns with a
            :class:`gradhooks.GradhooksWarning`).
        max_grad_norm: ``C``, the clipping norm of each example's gradient; with
            ``clipping_groups``, a float (each of ``K`` groups clipped to ``C/√K``) or one
            bound per group (total ``√(Σ_k C_k²)``, which the noise is scaled to).
        target_epsilon: the ε to spend over the planned steps: the noise multiplier is the
            smallest whose ε is at most it (:func:`gradhooks.noise_multiplier_for`)...
        noise_multiplier: ...or ``σ`` itself (give one of the two).
        epochs: the length of the run in epochs of ``round(1 / sample_rate)`` steps...
        steps: ...or in steps (logical batches; give one of the two).
        expected_batch_size: the expected size of a logical batch...
        sample_rate: ...or each example's probability of being in it (give one of the two).
        accountant: ``"rdp"`` (the default) or ``"pld"`` (tighter, slower): see
            :class:`gradhooks.PrivacyAccountant`.
        max_physical_batch_size: split each logical batch into physical batches of at most
            this many examples (memory), stepping once per logical batch.
        generator: a CPU ``torch.Generator`` the batches' and the noise's seeds are drawn
            from (keep its seed secret); by default seeded from the OS's entropy.
        scaler: a ``torch.amp.GradScaler`` for float16 autocast (the forwards under
            ``torch.autocast`` are the loop's): a step whose scaled gradients overflow is
            skipped and not recorded. bfloat16 autocast needs none.
        clipping: ``"flat"`` (each example's gradient scaled by ``min(1, C/‖g_i‖)``, the
            default) or ``"automatic"`` (by ``C/(‖g_i‖ + 0.01)``, fastDP's default: see
            :func:`gradhooks.clip_factors`); the same noise, the same ε.
        clipping_groups: ``None`` (one bound over the whole model), ``"parameter"``,
            ``"layer"`` or a list of groups of parameters or names: each group of each
            example's gradient clipped to its own bound (:func:`gradhooks.dp_sgd_step`); the
            noise is scaled to the total bound, so ε is the same for the same ``σ``. Kept in
            the checkpoint's plan.
        adaptive_clipping: a :class:`gradhooks.AdaptiveClipping`: the bound starts at
            ``max_grad_norm`` and follows a quantile of the per-example norms (one bound, flat
            clipping); the ε is that of ``σ``, which covers the count's release too. The
            bound now is ``private.max_grad_norm``, kept in checkpoints.
    """
    if not isinstance(model, torch.nn.Module):
        raise ConfigurationTypeError(
            f"make_private takes the model (an nn.Module), got {type(model).__qualname__}"
        )
    for name, value in [
        ("delta", delta), ("target_epsilon", target_epsilon),
        ("noise_multiplier", noise_multiplier), ("epochs", epochs), ("steps", steps),
        ("expected_batch_size", expected_batch_size), ("sample_rate", sample_rate),
    ]:  # fmt: skip
        if value is not None or name == "delta":
            require_number(name, value, "make_private")
    if (target_epsilon is None) == (noise_multiplier is None):
        raise ConfigurationError(
            "make_private: give target_epsilon= or noise_multiplier=, one of them"
        )
    if (epochs is None) == (steps is None):
        raise ConfigurationError("make_private: give epochs= or steps=, one of them")
    if (expected_batch_size is None) == (sample_rate is None):
        raise ConfigurationError(
            "make_private: give expected_batch_size= or sample_rate=, one of them"
        )
    dataset, loader_kwargs, collate_fn = _data(data)
    n = len(dataset)
    if n < 1:
        raise ConfigurationError("make_private: the dataset is empty")
    if sample_rate is None:
        assert expected_batch_size is not None
        if not 0 < expected_batch_size <= n:
            raise ConfigurationError(
                f"expected_batch_size must be in (0, len(dataset)={n}], got {expected_batch_size!r}"
            )
        sample_rate = expected_batch_size / n
    if not 0 < sample_rate <= 1:
        raise ConfigurationError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    if expected_batch_size is None:
        expected_batch_size = sample_rate * n
    if steps is None:
        assert epochs is not None
        if not epochs > 0:
            raise ConfigurationError(f"epochs must be > 0, got {epochs!r}")
        steps = max(1, round(epochs * max(1, round(1 / sample_rate))))
    if not is_whole(steps) or steps < 1:
        raise ConfigurationError(f"steps must be a whole number >= 1, got {steps!r}")
    if max_physical_batch_size is not None:  # (True is no size)
        require_number("max_physical_batch_size", max_physical_batch_size, "make_private")
    if max_physical_batch_size is not None and (
        not is_whole(max_physical_batch_size) or max_physical_batch_size < 1
    ):
        raise ConfigurationError(
            f"max_physical_batch_size must be a whole number >= 1 or None, got "
            f"{max_physical_batch_size!r}"
        )
    if generator is not None and (
        not isinstance(generator, torch.Generator) or generator.device.type != "cpu"
    ):
        raise ConfigurationTypeError("generator must be a CPU torch.Generator or None")
    if accountant not in ("rdp", "pld"):
        raise ConfigurationError(f"accountant must be 'rdp' or 'pld', got {accountant!r}")
    if not 0 < delta < 1:
        raise ConfigurationError(f"delta must be in (0, 1), got {delta!r}")
    warn_if_delta_not_small(delta, n, "make_private")
    if target_epsilon is not None:
        if not 0 < target_epsilon < float("inf"):
            raise ConfigurationError(
                f"target_epsilon must be > 0 and finite, got {target_epsilon!r}"
            )
        noise_multiplier = noise_multiplier_for(
            target_epsilon, delta, sample_rate, int(steps), method=accountant
        )
    assert noise_multiplier is not None
    return PrivateTraining(
        model, optimizer, dataset, loader_kwargs, collate_fn,
        noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
        sample_rate=sample_rate, expected_batch_size=expected_batch_size, steps=int(steps),
        delta=delta, target_epsilon=target_epsilon,
        accountant=accountant, max_physical_batch_size=max_physical_batch_size,
        generator=generator, scaler=scaler, clipping=clipping, clipping_groups=clipping_groups,
        adaptive_clipping=adaptive_clipping,
    )  # fmt: skip


# the DataLoader settings make_private keeps from a user's loader (the batching is its own)
_KEPT = ("num_workers", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
         "persistent_workers", "pin_memory_device")  # fmt: skip


def _data(data: Any) -> tuple[Dataset, dict[str, Any], Any]:
    """The dataset, the DataLoader settings to keep and the collate function of ``data``."""
    if isinstance(data, DataLoader):
        dataset, collate = data.dataset, data.collate_fn
        kwargs = {k: getattr(data, k) for k in _KEPT if hasattr(data, k)}
        if data.num_workers > 0:
            kwargs["prefetch_factor"] = data.prefetch_factor
        else:
            kwargs.pop("persistent_workers", None)
    else:
        dataset, collate, kwargs = data, default_collate, {}
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
        raise ConfigurationTypeError(
            "make_private needs a map-style Dataset (len() and [i]), or a DataLoader over one: "
            "Poisson sampling picks each example by its index"
        )
    if not hasattr(dataset, "__len__"):
        raise ConfigurationTypeError("make_private needs a Dataset with len()")
    return dataset, kwargs, collate

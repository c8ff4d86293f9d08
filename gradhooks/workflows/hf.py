"""DP fine-tuning with Hugging Face's ``Trainer``: :class:`DPTrainer` and :class:`DPArguments`.

:class:`DPTrainer` is a ``transformers.Trainer`` whose steps are DP-SGD steps, on the model as
it is (a PEFT adapter included), with nothing changed in it:

- the training set is drawn by Poisson sampling: each logical batch holds every example
  independently with probability ``q = L / len(train_dataset)``, ``L =
  per_device_train_batch_size × gradient_accumulation_steps`` (the expected logical batch),
  and is split into ``gradient_accumulation_steps`` physical batches of about
  ``per_device_train_batch_size`` examples each;
- each example's loss is its own (:func:`per_example_loss`): for token-level labels, the mean
  over the example's own labelled tokens (``-100`` ignored; a causal LM's labels shifted as
  Hugging Face shifts them), not the mean over every labelled token of the batch;
- each physical batch's per-example gradients are clipped to ``max_grad_norm`` and summed
  (:class:`gradhooks.DPOptimizer`, over the hooks of
  ``gradhooks.add_hooks(model, quantities=("norms",))``, which only the trainable parameters
  get); the optimizer step adds the Gaussian noise once per logical batch, divides by ``L``
  and steps the Trainer's optimizer (its learning-rate schedule as usual);
- the :class:`gradhooks.PrivacyAccountant` records every step, ``epsilon`` is logged with the
  other metrics (at ``delta``), and a run that would spend more than ``target_epsilon`` is
  refused before it takes a step (:class:`gradhooks.errors.PrivacyBudgetExceeded`): the
  steps already taken (an earlier ``train()``) and the planned run together.

Why each example's own mean token loss: with the batch's token mean, example ``i``'s share of
the loss is ``Σ_t loss_it / Σ_j T_j``, its weight set by the other examples' lengths ``T_j``;
its clipped gradient is then not a function of example ``i`` alone, and the bound on one
example's influence that the privacy analysis rests on no longer holds as stated. With
``mean_t loss_it`` every example's contribution is its own gradient, clipped.

``transformers`` is imported here only: ``gradhooks.hf`` is the public name of this module
(``pip install "gradhooks[hf]"``).
"""

from __future__ import annotations

import copy
import math
import os
import sys
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
import transformers
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ..engine.handle import Hooks, add_hooks
from ..errors import (
    ConfigurationError,
    ConfigurationTypeError,
    PrivacyBudgetExceeded,
    StateError,
    require_number,
)
from ..privacy.accounting import (
    PrivacyAccountant,
    noise_multiplier_for,
    warn_if_delta_not_small,
)
from ..privacy.sampling import PoissonSampler
from . import clipping as _clip
from .private import DPOptimizer, changed_setting

__all__ = ["DPArguments", "DPTrainer", "per_example_loss"]

IGNORE_INDEX = -100  # (Hugging Face's label for a token that is no target)


@dataclass
class DPArguments:
    """The privacy settings of a :class:`DPTrainer`.

    Args:
        max_grad_norm: ``C``, the clipping norm of each example's gradient (of every trainable
            parameter together). Replaces the Trainer's own ``args.max_grad_norm``, which
            clips the batch gradient and is turned off. With ``clipping_groups``, a float
            ``C`` (each of ``K`` groups clipped to ``C/√K``) or one bound per group (the noise
            then scaled to the total bound ``√(Σ_k C_k²)``).
        delta: the δ at which ε is reported and the budget is held, well below ``1 /
            len(train_dataset)`` (one of ``1/n`` or more warns at ``train()``, with a
            :class:`gradhooks.GradhooksWarning`).
        target_epsilon: the privacy budget ε. Without ``noise_multiplier``, the noise
            multiplier is the smallest that keeps the planned run (``max_steps``, or
            ``num_train_epochs`` at one expected epoch per ``len(train_dataset) / L`` steps)
            within it (:func:`gradhooks.noise_multiplier_for`). With both, a run that would
            exceed it is refused before its first step.
        noise_multiplier: ``σ``; the noise std is ``σ·C``, added once per logical batch.
        accountant: ``"rdp"`` or ``"pld"`` (:class:`gradhooks.PrivacyAccountant`).
        method: :func:`gradhooks.dp_sgd_step`'s ``method`` (``"bookkeeping"`` by default,
            ``"ghost"`` for the least memory).
        noise_seed: seeds the noise's generator (a secret in earnest); ``None``: torch's
            global generator (seeded by the Trainer's ``args.seed``).
        sampling_seed: seeds the Poisson sampler's generator; ``None``: torch's global one.
        clipping_groups: ``None`` (one bound over every trainable parameter), ``"parameter"``
            (each trainable parameter clipped on its own), ``"layer"`` (each module's), or a
            list of groups of parameter names (of the model as trained: a PEFT model's
            names): :func:`gradhooks.dp_sgd_step`'s ``clipping_groups``.
        adaptive_clipping: a :class:`gradhooks.AdaptiveClipping`: the bound starts at
            ``max_grad_norm`` and follows a quantile of the per-example norms
            (:class:`gradhooks.DPOptimizer`'s ``adaptive_clipping``); the bound in use is
            saved with the optimizer's state in each checkpoint.
    """

    max_grad_norm: float | list[float]
    delta: float
    target_epsilon: float | None = None
    noise_multiplier: float | None = None
    accountant: Literal["rdp", "pld"] = "rdp"
    method: Literal["ghost", "bookkeeping"] | None = None
    noise_seed: int | None = None
    sampling_seed: int | None = None
    clipping_groups: Literal["parameter", "layer"] | list[list[str]] | None = None
    adaptive_clipping: _clip.AdaptiveClipping | None = None

    def __post_init__(self) -> None:
        _clip.check_bounds(self.max_grad_norm, self.clipping_groups, "DPArguments", "max_grad_norm")
        for name in ("delta", "target_epsilon", "noise_multiplier"):
            value = getattr(self, name)
            if value is not None or name == "delta":
                require_number(name, value, "DPArguments")
        for name in ("noise_seed", "sampling_seed"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ConfigurationTypeError(
                    f"DPArguments: {name} must be an int or None, got {type(value).__qualname__} "
                    f"{value!r}"
                )
        if not 0 < _clip.total_bound(self.max_grad_norm) < math.inf:
            raise ConfigurationError(f"DPArguments: max_grad_norm must be > 0 and finite, got "
                             f"{self.max_grad_norm!r}")  # fmt: skip
        if not 0 < self.delta < 1:
            raise ConfigurationError(f"DPArguments: delta must be in (0, 1), got {self.delta!r}")
        if self.target_epsilon is None and self.noise_multiplier is None:
            raise ConfigurationError(
                "DPArguments: give target_epsilon (the noise multiplier is then calibrated to "
                "it), noise_multiplier, or both (the run is then refused if it would exceed "
                "the budget)"
            )
        if self.target_epsilon is not None and not 0 < self.target_epsilon < math.inf:
            raise ConfigurationError(f"DPArguments: target_epsilon must be > 0 and finite, got "
                             f"{self.target_epsilon!r}")  # fmt: skip
        if self.noise_multiplier is not None and not 0 <= self.noise_multiplier < math.inf:
            raise ConfigurationError(f"DPArguments: noise_multiplier must be >= 0 and finite, got "
                             f"{self.noise_multiplier!r}")  # fmt: skip
        if self.accountant not in ("rdp", "pld"):
            raise ConfigurationError(f"DPArguments: accountant must be 'rdp' or 'pld', got "
                             f"{self.accountant!r}")  # fmt: skip
        if self.adaptive_clipping is not None and not isinstance(
            self.adaptive_clipping, _clip.AdaptiveClipping
        ):
            raise ConfigurationTypeError(
                "DPArguments: adaptive_clipping must be a gradhooks.AdaptiveClipping or None, "
                f"got {type(self.adaptive_clipping).__qualname__}"
            )
        if self.method not in (None, "ghost", "bookkeeping"):
            raise ConfigurationError(f"DPArguments: method must be None, 'ghost' or 'bookkeeping', got "
                             f"{self.method!r}")  # fmt: skip


def per_example_loss(
    logits: Tensor,
    labels: Tensor,
    *,
    shift: bool = False,
    problem_type: str | None = None,
    label_smoothing: float = 0.0,
) -> Tensor:
    """Each example's own loss, ``[batch]``, as a Hugging Face model computes the batch's.

    - token labels (``labels`` ``[batch, T]``, ``logits`` ``[batch, T, vocab]``): the
      cross-entropy of each labelled token (``IGNORE_INDEX = -100`` is none), averaged over the
      example's own labelled tokens (0 for an example without any). ``shift=True`` for a
      causal LM: the logits at ``t`` predict the label at ``t + 1``, as Hugging Face shifts
      them.
    - one label per example (``labels`` ``[batch]`` or ``[batch, labels]``, ``logits``
      ``[batch, labels]``), by ``problem_type`` as Hugging Face's classifiers: ``"regression"``
      the squared error (averaged over the outputs), ``"single_label_classification"`` the
      cross-entropy, ``"multi_label_classification"`` the binary cross-entropy averaged over
      the labels. ``None``: regression for one output, single-label for integer labels,
      multi-label otherwise.

    The logits are taken in at least float32 (as Hugging Face's losses take them).
    """
    for name, value in (("logits", logits), ("labels", labels)):
        if not isinstance(value, Tensor):
            raise ConfigurationTypeError(
                f"per_example_loss: {name} must be a tensor, got {type(value).__qualname__} (the "
                "model's output.logits and the batch's labels)"
            )
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    batch = labels.shape[0]
    if logits.dim() == 3 and labels.dim() == 2:
        if shift:
            logits, labels = logits[:, :-1], labels[:, 1:]
        if logits.shape[:2] != labels.shape:
            raise ConfigurationError(
                f"per_example_loss: logits {tuple(logits.shape)} and labels "
                f"{tuple(labels.shape)} do not have the same [batch, tokens]"
                + (" after the causal shift" if shift else "")
            )
        tokens = F.cross_entropy(
            logits.transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none",
            label_smoothing=label_smoothing,
        )  # fmt: skip
        counts = (labels != IGNORE_INDEX).sum(1).clamp(min=1)
        return tokens.sum(1) / counts.to(tokens.dtype)
    if logits.dim() != 2 or logits.shape[0] != batch:
        raise ConfigurationError(
            f"per_example_loss: logits {tuple(logits.shape)} and labels {tuple(labels.shape)}: "
            "expected [batch, T, vocab] with [batch, T] token labels, or [batch, labels] with "
            "one label (or one row of labels) per example. Pass DPTrainer(per_example_loss=) "
            "for another loss."
        )
    if problem_type is None:
        if logits.shape[1] == 1:
            problem_type = "regression"
        elif not labels.is_floating_point():
            problem_type = "single_label_classification"
        else:
            problem_type = "multi_label_classification"
    wanted = {"regression": logits.shape[1], "single_label_classification": 1}.get(problem_type)
    per_example = labels[0].numel() if batch else wanted
    if wanted is not None and per_example != wanted:  # (broadcast, or a reshape that fails)
        raise ConfigurationError(
            f"per_example_loss ({problem_type}): labels {tuple(labels.shape)} hold "
            f"{per_example} values per example, logits {tuple(logits.shape)} want {wanted}: "
            "give one label per output (one class index per example for single-label "
            "classification)"
        )
    if problem_type == "regression":
        diff = logits.reshape(batch, -1) - labels.reshape(batch, -1).to(logits.dtype)
        return diff.pow(2).mean(1)
    if problem_type == "single_label_classification":
        return F.cross_entropy(logits, labels.reshape(batch), reduction="none",
                               label_smoothing=label_smoothing)  # fmt: skip
    if problem_type == "multi_label_classification":
        return F.binary_cross_entropy_with_logits(
            logits, labels.to(logits.dtype), reduction="none"
        ).mean(1)
    raise ConfigurationError(f"per_example_loss: unknown problem_type {problem_type!r}")


class _Physical(Sampler[list[int]]):
    """Poisson logical batches (:class:`PoissonSampler`), each yielded as ``parts`` physical
    batches: the sorted indices cut into ``parts`` runs whose sizes differ by at most 1
    (some may be empty). The cut depends on the batch's size only."""

    def __init__(self, sampler: PoissonSampler, parts: int) -> None:
        self.sampler = sampler
        self.parts = parts
        # the seeded generator's state where the epoch now drawn started (DPTrainer._resume)
        self.epoch_start: Tensor | None = None

    def __len__(self) -> int:
        return len(self.sampler) * self.parts

    def __iter__(self) -> Iterator[list[int]]:
        if self.sampler.generator is not None:
            self.epoch_start = self.sampler.generator.get_state()
        for idx in self.sampler:
            n = len(idx)
            for k in range(self.parts):
                yield idx[k * n // self.parts : (k + 1) * n // self.parts]


class _Collate:
    """The Trainer's collate function, and for an empty physical batch the collate of one
    stand-in example (the dataset's first) marked to count for nothing: Hugging Face models do
    not run on 0 rows. Picklable, for ``dataloader_num_workers > 0``."""

    def __init__(self, dataset: Dataset, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn

    def __call__(self, batch: list[Any]) -> Any:
        if batch:
            return self.collate_fn(batch)
        return _StandIn(self.collate_fn([self.dataset[0]]))


class _StandIn(dict):
    """The inputs of an empty physical batch: one example whose loss is multiplied by 0."""


class DPTrainer(transformers.Trainer):
    """A ``transformers.Trainer`` that trains with DP-SGD (see :mod:`gradhooks.workflows.hf`).

    Args:
        model, args, ...: as for ``transformers.Trainer`` (every argument it takes).
        dp: the privacy settings, :class:`DPArguments`.
        per_example_loss: ``(outputs, labels) -> [batch]``, each example's own loss from the
            model's outputs (run without ``labels``, except for an encoder-decoder model, which
            builds its decoder inputs from them); by default :func:`per_example_loss` on
            ``outputs.logits``, shifted for a causal LM.

    Attributes:
        accountant: the :class:`gradhooks.PrivacyAccountant` of every step taken.
        noise_multiplier: ``σ`` (given, or calibrated to ``target_epsilon`` at ``train()``).
        sample_rate: ``q``, the Poisson sampling rate.

    Example::

        trainer = DPTrainer(model, TrainingArguments("out", per_device_train_batch_size=32,
                            gradient_accumulation_steps=4, num_train_epochs=3),
                            train_dataset=data,
                            dp=DPArguments(max_grad_norm=1.0, delta=1e-5, target_epsilon=8.0))
        trainer.train()
        trainer.accountant.epsilon(1e-5)   # <= 8.0, also logged as "epsilon"

    Refused, before anything changes: ``fp16`` (a ``GradScaler``), several processes
    (``torch.distributed``) or GPUs (``DataParallel``), ``auto_find_batch_size`` (the batch
    size is ``L``'s), ``compute_loss_func`` (a batch loss: pass ``per_example_loss``), an
    iterable dataset or one without a length, a hyperparameter search ``trial``.
    ``train_sampling_strategy`` does not apply: the batches are Poisson's.

    Checkpoints: each checkpoint the Trainer saves holds the privacy state too
    (``dp_state.pt``: the accountant's steps, σ, q, C, L and both generators' states), and
    ``train(resume_from_checkpoint=...)`` continues from it: ε counts the steps before, the
    budget is checked for the steps left, a calibrated σ is the checkpoint's, and the seeded
    noise and sampling continue their sequences instead of repeating them (the same noise on
    two steps would break the analysis). A checkpoint without it, or of other settings, is
    refused.
    """

    def __init__(
        self,
        model: Any = None,
        args: transformers.TrainingArguments | None = None,
        *more: Any,
        dp: DPArguments,
        per_example_loss: Callable[[Any, Tensor], Tensor] | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(dp, DPArguments):
            raise ConfigurationTypeError(
                f"DPTrainer: dp must be a DPArguments, got {type(dp).__qualname__}"
            )
        if per_example_loss is not None and not callable(per_example_loss):
            raise ConfigurationTypeError(
                "DPTrainer: per_example_loss must be a function (outputs, labels) -> [batch] "
                f"(gradhooks.hf.per_example_loss is the default), got "
                f"{type(per_example_loss).__qualname__} {per_example_loss!r}"
            )
        if args is not None:
            _check_args(args)
            args = copy.copy(args)  # (the caller's arguments are left as they were)
            args.max_grad_norm = 0.0  # (the batch gradient's clipping: per-example here)
        if kwargs.get("compute_loss_func") is not None:
            raise ConfigurationError(
                "DPTrainer: compute_loss_func computes the batch's loss; DP-SGD needs each "
                "example's own: pass per_example_loss=(outputs, labels) -> [batch] instead"
            )
        super().__init__(model, args, *more, **kwargs)
        if args is None:  # (the Trainer made its defaults)
            _check_args(self.args)
            self.args.max_grad_norm = 0.0
        self.dp = dp
        self.per_example_loss_fn = per_example_loss
        self.accountant = PrivacyAccountant(dp.accountant)
        self.noise_multiplier: float | None = dp.noise_multiplier
        self.sample_rate: float | None = None
        self._noise = (
            None if dp.noise_seed is None else torch.Generator().manual_seed(dp.noise_seed)
        )
        self._sampling = (
            None if dp.sampling_seed is None else torch.Generator().manual_seed(dp.sampling_seed)
        )
        self._hooks: Hooks | None = None
        self._dp_optimizer: DPOptimizer | None = None
        self._physical: _Physical | None = None  # (the batches of the last dataloader made)
        self.add_callback(_SaveDPState(self))

    # -- the logical batch -----------------------------------------------------------------------

    @property
    def expected_batch_size(self) -> int:
        """``L = per_device_train_batch_size × gradient_accumulation_steps``."""
        return self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps

    def _examples(self) -> int:
        dataset = self.train_dataset
        iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        if dataset is None or iterable or not hasattr(dataset, "__len__"):
            raise ConfigurationError(
                "DPTrainer: train_dataset must be a map-style dataset with a length (Poisson "
                "sampling draws each example with probability L / len(train_dataset)); got "
                f"{type(dataset).__qualname__}"
            )
        return len(dataset)

    def get_train_dataloader(self) -> DataLoader:
        """The Poisson-sampled batches, ``gradient_accumulation_steps`` physical batches per
        logical batch (``len(train_dataset) / L`` logical batches per epoch)."""
        n = self._examples()
        dataset, collate = self.train_dataset, self.data_collator
        if _is_datasets_dataset(dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collate = self._get_collator_with_removed_columns(collate, description="training")
        sampler = PoissonSampler(n, self.expected_batch_size, generator=self._sampling)
        self._physical = _Physical(sampler, self.args.gradient_accumulation_steps)
        loader = DataLoader(
            dataset,
            batch_sampler=self._physical,
            collate_fn=_Collate(dataset, collate),
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
        )
        return self.accelerator.prepare(loader)

    # -- the optimizer ---------------------------------------------------------------------------

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer (made as usual, or the one given), wrapped in a
        :class:`gradhooks.DPOptimizer` over the hooks of this ``train()``."""
        base = self.optimizer if self.optimizer is not None else super().create_optimizer(model)
        base = _unwrapped(base)
        if self._hooks is None:
            raise StateError("DPTrainer: the optimizer is made inside train() only")
        self._dp_optimizer = DPOptimizer(
            base, self._hooks, max_grad_norm=self.dp.max_grad_norm,
            noise_multiplier=self.noise_multiplier, expected_batch_size=self.expected_batch_size,
            sample_rate=self.sample_rate, accountant=self.accountant, generator=self._noise,
            method=self.dp.method, clipping_groups=self.dp.clipping_groups,
            adaptive_clipping=self.dp.adaptive_clipping,
        )  # fmt: skip
        self.optimizer = self._dp_optimizer
        return self.optimizer

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train`` with the model hooked (``quantities=("norms",)``) for its length;
        refused before the first step if the steps taken and the planned run together exceed
        ``target_epsilon``."""
        resume = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        if kwargs.get("trial") is not None or len(args) > 1:
            raise ConfigurationError(
                "DPTrainer: a hyperparameter search trial changes the arguments (the batch "
                "size, the steps) after the privacy budget was checked; search without DP, or "
                "run one DPTrainer per setting"
            )
        taken = 0
        if resume not in (None, False):
            taken = self._resume(resume)
        self._plan(taken)
        model = self.model
        with add_hooks(model, quantities=("norms",)) as hooks:
            self._hooks = hooks
            try:
                return super().train(*args, **kwargs)
            finally:
                self._hooks = None
                if self.optimizer is not None:  # (the next train() wraps it anew)
                    self.optimizer = _unwrapped(self.optimizer)
                self._dp_optimizer = None

    # -- checkpoints -----------------------------------------------------------------------------

    def _dp_plan(self) -> dict[str, Any]:
        """The settings a checkpoint's privacy state holds only for (:meth:`_resume`)."""
        return {
            "noise_multiplier": self.noise_multiplier, "sample_rate": self.sample_rate,
            "expected_batch_size": self.expected_batch_size, "examples": self._examples(),
            "max_grad_norm": self.dp.max_grad_norm, "delta": self.dp.delta,
            "accountant": self.dp.accountant, "method": self.dp.method,
            "clipping_groups": self.dp.clipping_groups,
            "adaptive_clipping": (
                None if self.dp.adaptive_clipping is None else self.dp.adaptive_clipping.describe()
            ),
        }  # fmt: skip

    def dp_state_dict(self) -> dict[str, Any]:
        """The privacy state a checkpoint holds beside the Trainer's (``dp_state.pt``): the
        settings, the accountant's steps, both generators' states, and the sampling
        generator's where the epoch in progress started, with the logical batches of an epoch
        (which a resumed run draws again up to the checkpoint, as the Trainer skips them)."""
        physical = self._physical
        start = None if physical is None else physical.epoch_start
        return {
            "plan": self._dp_plan(),
            "accountant": self.accountant.state_dict(),
            "noise_generator": None if self._noise is None else self._noise.get_state(),
            "sampling_generator": None if self._sampling is None else self._sampling.get_state(),
            "sampling_epoch_start": None if start is None else start.clone(),
            "steps_per_epoch": None if physical is None else len(physical.sampler),
        }

    def _resume(self, resume: Any) -> int:
        """Load the privacy state of the checkpoint ``train(resume_from_checkpoint=resume)``
        resumes from (``True``: the last in ``output_dir``); returns the steps it had taken."""
        from transformers.trainer_utils import get_last_checkpoint

        path = get_last_checkpoint(self.args.output_dir) if resume is True else str(resume)
        if path is None:
            raise ConfigurationError(
                f"DPTrainer: resume_from_checkpoint=True, but {self.args.output_dir} holds no "
                "checkpoint (checkpoint-<step> folders, saved with save_strategy)"
            )
        found = os.path.join(path, DP_STATE_NAME)
        if not os.path.isfile(found):
            raise ConfigurationError(
                f"DPTrainer: the checkpoint {path} holds no privacy state ({DP_STATE_NAME}: the "
                "accountant's steps, σ and the generators), so ε after resuming would leave out "
                "the steps before it. Resume from a checkpoint a DPTrainer saved"
            )
        state = torch.load(found, weights_only=True)
        saved = state["plan"]
        self.sample_rate = self.expected_batch_size / self._examples()
        if self.dp.noise_multiplier is None:  # (calibrated for the run it resumes)
            self.noise_multiplier = saved["noise_multiplier"]
        now = self._dp_plan()
        k = changed_setting(saved, now)
        if k is not None:
            raise ConfigurationError(
                f"DPTrainer: the checkpoint {path} was taken with {k}={saved.get(k)!r}, this "
                f"run has {now[k]!r}: resume with the same DPArguments, batch sizes and "
                "dataset (ε would not describe a run whose settings changed in silence)"
            )
        for name, generator in (("noise", self._noise), ("sampling", self._sampling)):
            kept = state[f"{name}_generator"]
            if (kept is None) != (generator is None):
                raise ConfigurationError(
                    f"DPTrainer: the checkpoint {path} and this run differ in {name}_seed (one "
                    "seeded, one not): resume with the same DPArguments"
                )
            if generator is not None:
                generator.set_state(kept)
        self._rewind_sampling(path, state)
        self.accountant.load_state_dict(state["accountant"])
        return self.accountant.steps

    def _rewind_sampling(self, path: str, state: dict[str, Any]) -> None:
        """Where the checkpoint was taken inside an epoch, the Trainer resumes by drawing that
        epoch's batches again and skipping those trained on: the sampling generator starts
        where that epoch started, so that the skipped draws are the ones before the checkpoint
        and every batch after it is the one an uninterrupted run trains on. (At an epoch's end,
        or with ``ignore_data_skip``, the Trainer skips nothing: the generator goes on from the
        checkpoint's state, so that no batch is drawn twice.)"""
        start, per_epoch = state.get("sampling_epoch_start"), state.get("steps_per_epoch")
        if self._sampling is None or start is None or not per_epoch or self.args.ignore_data_skip:
            return
        from transformers import TrainerState
        from transformers.trainer import TRAINER_STATE_NAME

        found = os.path.join(path, TRAINER_STATE_NAME)
        if not os.path.isfile(found):
            return
        if TrainerState.load_from_json(found).global_step % per_epoch:
            self._sampling.set_state(start)

    def _plan(self, taken: int = 0) -> None:
        """``q``, ``σ`` (calibrated where not given) and the steps the budget allows (``taken``
        of the planned ones already, by the checkpoint resumed from)."""
        n = self._examples()
        if self.expected_batch_size > n:
            raise ConfigurationError(
                f"DPTrainer: the expected logical batch L = per_device_train_batch_size × "
                f"gradient_accumulation_steps = {self.expected_batch_size} exceeds the "
                f"{n} examples of train_dataset"
            )
        self.sample_rate = self.expected_batch_size / n
        warn_if_delta_not_small(self.dp.delta, n, "DPTrainer")
        per_epoch = max(1, round(n / self.expected_batch_size))
        if self.args.max_steps > 0:
            planned = self.args.max_steps
        else:
            planned = math.ceil(self.args.num_train_epochs * per_epoch)
        planned = max(planned - taken, 0)
        target = self.dp.target_epsilon
        if self.noise_multiplier is None:
            assert target is not None
            self.noise_multiplier = noise_multiplier_for(
                target, self.dp.delta, self.sample_rate, planned, method=self.dp.accountant
            )
            if not self.accountant.steps:
                return  # (calibrated for this run: within the budget)
        if target is None:
            return
        spent = self._epsilon_after(planned)
        if spent > target:
            fits = self._steps_within(target, planned)
            taken = self.accountant.steps
            raise PrivacyBudgetExceeded(
                f"DPTrainer: {planned} more steps (noise_multiplier={self.noise_multiplier:.4g}, "
                f"sample rate {self.sample_rate:.4g}) would spend ε = {spent:.4g} at δ = "
                f"{self.dp.delta:g}, over target_epsilon={target:g}"
                + (f" (after the {taken} steps already taken)" if taken else "")
                + f"; {fits} steps fit. Lower max_steps or num_train_epochs, raise "
                "noise_multiplier, or leave it None to have it calibrated. No step was taken."
            )

    def _epsilon_after(self, steps: int) -> float:
        """ε at ``delta`` after the steps taken and ``steps`` more at ``(σ, q)``."""
        scratch = PrivacyAccountant(self.dp.accountant)
        scratch.history = list(self.accountant.history)
        assert self.noise_multiplier is not None and self.sample_rate is not None
        scratch.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate,
                     steps=steps)  # fmt: skip
        return scratch.epsilon(self.dp.delta)

    def _steps_within(self, target: float, upper: int) -> int:
        """The most steps (below ``upper``) that keep ε within ``target`` (bisection)."""
        lo, hi = 0, upper  # (lo fits, hi does not)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self._epsilon_after(mid) <= target else (lo, mid)
        return lo

    # -- one physical batch ----------------------------------------------------------------------

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> Tensor:
        """One physical batch: each example's own loss, its clipped gradient added to the
        step's sum. Returns the batch's summed loss over ``L`` (detached): the logged
        ``loss`` is, over a logical batch, the sum of its examples' losses over ``L``."""
        model.train()
        weight = 0.0 if isinstance(inputs, _StandIn) else 1.0
        inputs = self._prepare_inputs(dict(inputs))
        with self.compute_loss_context_manager():
            losses = self.per_example_losses(model, inputs)
        if weight == 0.0:
            losses = losses * 0.0  # (an empty physical batch: a stand-in that adds nothing)
        assert self._dp_optimizer is not None
        self._dp_optimizer.backward(losses)
        return (losses.detach().sum() / self.expected_batch_size).to(self.args.device)

    def per_example_losses(self, model: torch.nn.Module, inputs: dict[str, Any]) -> Tensor:
        """Each example's own loss, ``[batch]``: the model run on ``inputs`` (without
        ``labels``, but for an encoder-decoder model), then ``per_example_loss``."""
        if "labels" not in inputs:
            raise ConfigurationError(
                "DPTrainer: the batch has no 'labels' (it has "
                f"{sorted(inputs)}); each example's loss is computed from them"
            )
        base = _base_model(model)
        config = getattr(base, "config", None)
        encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
        labels = inputs["labels"]
        outputs = model(**(inputs if encoder_decoder
                           else {k: v for k, v in inputs.items() if k != "labels"}))  # fmt: skip
        if self.per_example_loss_fn is not None:
            losses = self.per_example_loss_fn(outputs, labels)
        else:
            logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
            losses = per_example_loss(
                logits, labels, shift=type(base).__name__ in _CAUSAL_LMS,
                problem_type=getattr(config, "problem_type", None),
                label_smoothing=self.args.label_smoothing_factor,
            )  # fmt: skip
        batch = labels.shape[0]
        if not isinstance(losses, Tensor) or losses.shape != (batch,):
            raise ConfigurationError(
                f"DPTrainer: the per-example losses must be a tensor of shape [{batch}] (one "
                f"per example of the batch), got {getattr(losses, 'shape', type(losses))}"
            )
        return losses

    # -- logging ---------------------------------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's logs, with ``epsilon`` (at ``delta``) once a step was taken. The
        batch gradient's ``grad_norm`` is left out: before the step there is none (the clipped
        sum and the noise are formed by the step)."""
        logs.pop("grad_norm", None)
        if self.accountant.steps:
            logs["epsilon"] = self.accountant.epsilon(self.dp.delta)
        super().log(logs, start_time)


_CAUSAL_LMS = frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())

DP_STATE_NAME = "dp_state.pt"  # (in each checkpoint, beside the Trainer's files)


class _SaveDPState(transformers.TrainerCallback):
    """Writes the trainer's privacy state into each checkpoint the Trainer saves."""

    def __init__(self, trainer: DPTrainer) -> None:
        self.trainer = weakref.ref(trainer)

    def on_save(self, args, state, control, **kwargs):
        trainer = self.trainer()
        if trainer is not None and state.is_world_process_zero:
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            if os.path.isdir(folder):
                torch.save(trainer.dp_state_dict(), os.path.join(folder, DP_STATE_NAME))
        return control


def _check_args(args: transformers.TrainingArguments) -> None:
    """Refuses the Trainer settings DP-SGD here does not support."""
    if args.fp16:
        raise ConfigurationError(
            "DPTrainer: fp16 (float16 with a GradScaler) is not supported; use bf16=True, or "
            "gradhooks.DPOptimizer(..., scaler=) in a loop of your own"
        )
    if args.world_size > 1:
        raise ConfigurationError(
            f"DPTrainer runs in one process (world_size={args.world_size}): the noise and the "
            "clipping across processes are gradhooks.distributed.dp_sgd_step's"
        )
    if args.n_gpu > 1:
        raise ConfigurationError(
            f"DPTrainer: the Trainer would wrap the model in DataParallel over {args.n_gpu} "
            "GPUs, whose replicas the hooks do not follow; make one GPU visible "
            "(CUDA_VISIBLE_DEVICES)"
        )
    if args.auto_find_batch_size:
        raise ConfigurationError(
            "DPTrainer: auto_find_batch_size changes the batch size, and with it the sampling "
            "rate the privacy analysis uses; set per_device_train_batch_size"
        )


def _is_datasets_dataset(dataset: Any) -> bool:
    """Whether ``dataset`` is a ``datasets.Dataset`` (whose unused columns the Trainer drops
    from the dataset itself; for another dataset, its collate function drops them)."""
    datasets = sys.modules.get("datasets")  # (imported wherever such a dataset exists)
    return datasets is not None and isinstance(dataset, datasets.Dataset)


def _unwrapped(optimizer: Any) -> torch.optim.Optimizer:
    """The user's optimizer inside accelerate's wrapper and a :class:`DPOptimizer`."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a PEFT wrapper."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model

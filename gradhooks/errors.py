"""The warning and the exceptions of gradhooks' own (all also ``gradhooks.<name>``).

Every error gradhooks raises on purpose is a :class:`GradhooksError`, so one ``except``
catches them all::

    try:
        ...
    except gradhooks.GradhooksError as e:
        ...

Each subclass says what to do about it, and each is also the builtin exception that gradhooks
raised there before it had its own (``ConfigurationError`` is a ``ValueError``, ...), so that
``except ValueError`` keeps working. Nothing was changed when one is raised: the model, its
``.grad`` and ``grad1`` are as they were before the call that raised.

This module imports nothing from gradhooks, so that every other module can import it.
"""

from __future__ import annotations

import math
from numbers import Real

__all__ = [
    "GradhooksWarning",
    "SharedInputWarning",
    "GradhooksError",
    "ConfigurationError",
    "ConfigurationTypeError",
    "StateError",
    "BatchNotFoundError",
    "UnbatchedInputError",
    "MixedExamplesError",
    "UnsupportedError",
    "UnsupportedInputError",
    "UnsupportedModuleError",
    "RuleError",
    "CheckFailedError",
    "NumericalError",
    "MissingDependencyError",
    "Grad1TooLarge",
    "PrivacyBudgetExceeded",
    "describe_module",
    "require_number",
    "is_whole",
]


class GradhooksWarning(RuntimeWarning):
    """A backward whose per-example gradients gradhooks could not capture, or a setting that
    runs but is likely not what was meant (a DP step's noise repeated across steps, a δ not
    below 1 / the number of examples)."""


class SharedInputWarning(GradhooksWarning):
    """A DP step whose per-example gradients came from a forward that took an input of the
    model as long as the batch as shared by every example (the passages of a retriever
    trained on in-batch negatives, ``q @ p.T``; a memory bank): each example's gradient holds
    what every row of that input adds, so those rows are not protected by the step. Give the
    model its shared rows from outside the private data, or compute each example's loss from
    its own rows alone; where that input holds no example's data (a mask, a fixed table that
    happens to be as long as the batch), filter this warning by its class."""


class GradhooksError(Exception):
    """The base of every error gradhooks raises on purpose: ``except
    gradhooks.GradhooksError`` catches gradhooks' refusals and nothing else (a bug in your
    model or in torch still raises its own error). Its message names what was refused (the
    module, the parameter, the shapes) and what to do."""


class ConfigurationError(GradhooksError, ValueError):
    """An argument, a combination of arguments or a setting that cannot work: a value out of
    range (``max_norm=0``, ``delta=1``), options that contradict each other, a tensor of the
    wrong shape, a module setting gradhooks cannot follow (an RNN's dropout in training mode).
    Change the call as the message says; nothing ran."""


class ConfigurationTypeError(ConfigurationError, TypeError):
    """A :class:`ConfigurationError` where an argument has the wrong type (a generator that is
    not a ``torch.Generator``, a class that is not an ``nn.Module`` given to ``register``);
    also a ``TypeError``."""


class StateError(GradhooksError, RuntimeError):
    """A call that comes at the wrong time: ``compute_grad1`` with no backward captured, a
    ``step`` before its ``backward``, a handle whose hooks are removed, ranks that hold
    different models. Call what the message names first (or make a new object)."""


class BatchNotFoundError(GradhooksError, RuntimeError):
    """gradhooks cannot tell which rows of a tensor are which example's (the hooked layers
    saw different batch sizes in one backward; a layer got no batch dimension, see
    :class:`UnbatchedInputError`). Keep the examples on dimension 0 through the model, or say
    where they are with ``add_hooks(model, batch_dim=...)``."""


class UnbatchedInputError(BatchNotFoundError, ValueError):
    """A layer got an input without a batch dimension (``[features]`` rather than
    ``[batch, features]``): per-example gradients need one. Add it (``x.unsqueeze(0)`` for a
    single example). Also a ``ValueError``."""


class MixedExamplesError(GradhooksError, RuntimeError):
    """Each example's output depends on the other examples of the batch (BatchNorm in
    training mode), so per-example gradients do not exist at all. Remove the coupling
    (``nn.GroupNorm`` for ``nn.BatchNorm2d``, or ``model.eval()``); see the message. Also a
    layer given one example taken out of the batch alone (``x[i]``, ``for xi in x``), whose
    input has no batch dimension left: keep it (``x[i : i + 1]``, ``x.split(1)``)."""


class UnsupportedError(GradhooksError, NotImplementedError):
    """A layer, a layer setting or a torch feature gradhooks does not handle (dropout inside
    ``nn.MultiheadAttention`` in training mode, ``EmbeddingBag(scale_grad_by_freq=True)``, a
    torch without the internals it reads). Change the model as the message says, freeze the
    parameters concerned, or hook with ``unsupported='skip'``. Also a ``NotImplementedError``
    (and so a ``RuntimeError``)."""


class UnsupportedInputError(UnsupportedError, ValueError):
    """An :class:`UnsupportedError` about what a layer was given or returns: a nested tensor,
    several sequences packed along one dimension, rows picked from the batch by an index, an
    output whose rows the torch.func fallback cannot match with the examples. Pad the
    examples into one batch as the message says, or register a rule for the module. Also a
    ``ValueError``."""


class UnsupportedModuleError(UnsupportedError, TypeError):
    """An :class:`UnsupportedError` about a module's type: a module with trainable parameters
    and no rule (under ``unsupported='error'``), a TorchScript module, which takes no hooks.
    Register a rule with ``@gradhooks.register``, hook the module before scripting it, or
    freeze its parameters. Also a ``TypeError``."""


class RuleError(GradhooksError, RuntimeError):
    """A rule (a built-in one, or one given to :func:`gradhooks.register`) could not compute
    its pieces: it read ``call.grad_output`` of an output that received no gradient. Read
    ``call.grad_outputs`` and handle ``None``; check your rule with
    :func:`gradhooks.check_rule`."""


class CheckFailedError(GradhooksError, AssertionError, RuntimeError):
    """A check found per-example quantities that disagree with their reference:
    :func:`gradhooks.check_rule` with ``raise_on_mismatch=True``, or the probe of
    :func:`gradhooks.dp_sgd_step` (the clipped gradients would not bound each example's
    influence). Nothing was written. An ``AssertionError``, as a failed test is, and a
    ``RuntimeError``, as gradhooks' guards raised before."""


class NumericalError(GradhooksError, FloatingPointError):
    """A computation met NaN or inf, or a matrix it could not invert (the K-FAC optimizer
    after a diverged step). Lower the learning rate or raise the damping, and restart from a
    checkpoint. Also a ``FloatingPointError``."""


class MissingDependencyError(GradhooksError, ImportError):
    """An optional library that this feature needs is not installed (``dp-accounting`` for
    the privacy accountant): ``pip install "gradhooks[dp]"``. Also an ``ImportError``."""


class Grad1TooLarge(GradhooksError, MemoryError, RuntimeError):
    """``grad1`` for the captured batch would exceed the memory limit (nothing was allocated;
    see :mod:`gradhooks.engine.memory`). Use ``quantities=('norms',)``, a smaller batch, or
    raise the limit. Also a ``MemoryError``, and a ``RuntimeError`` whose message reads as
    torch's out-of-memory errors do, so that what retries a smaller batch on those (accelerate's
    ``find_executable_batch_size``, the Trainer's ``auto_find_batch_size``) retries on it."""


class PrivacyBudgetExceeded(GradhooksError, RuntimeError):
    """A DP-SGD step, or a run, past the privacy budget that :func:`gradhooks.make_private` or
    ``gradhooks.hf.DPTrainer`` was given (its ε, δ and number of steps are in the message);
    nothing was computed or changed."""


def describe_module(name: str | None, module: object) -> str:
    """How an error names a module: its qualified name in the model and its class,
    ``'encoder.0.fc' (Linear)`` (``'<model>'`` for the model itself)."""
    return f"'{name or '<model>'}' ({type(module).__qualname__})"


def require_number(name: str, value: object, where: str | None = None) -> None:
    """Refuse ``value`` given as the number ``name`` (of ``where``) where it is not one: a
    string, ``None`` or a bool compared with a bound fails with a ``TypeError`` that names
    neither the argument nor the call. A one-element tensor counts as a number."""
    numel = getattr(value, "numel", None)
    if isinstance(value, Real) and not isinstance(value, bool):
        return
    if callable(numel) and not isinstance(value, type) and numel() == 1:
        return
    raise ConfigurationTypeError(
        f"{where + ': ' if where else ''}{name} must be a number, got "
        f"{type(value).__qualname__} {value!r}"
    )


def is_whole(value: object) -> bool:
    """Whether the number ``value`` is a whole number: finite (``int(inf)`` raises an
    ``OverflowError`` and ``int(nan)`` a ``ValueError``, naming neither the argument nor the
    call) and without a fraction."""
    return math.isfinite(value) and int(value) == value  # type: ignore[arg-type]


def listed_names(names: list[str], n: int = 5) -> str:
    """The first ``n`` of ``names`` quoted, for an error's message: ``'a', 'b' and 3 more``."""
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(f"'{x}'" for x in names[:n]) + more

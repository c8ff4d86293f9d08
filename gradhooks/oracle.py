"""Reference per-example gradients: ``torch.func`` ``vmap(grad)`` and an explicit loop.

Both define example ``i``'s own loss as ``loss_fn(model(x[i:i+1]), target[i:i+1])``: the loss of
a batch of one, where mean and sum reductions agree. Shipped in the package so that users can
check their own rules (:func:`gradhooks.check_rule`) and models against the same references the
test suite uses. Capture by gradhooks is paused while they run.

Both return ``{param_name: [batch, *param.shape]}`` for every parameter that requires grad
(tied parameters appear once, under their first name, as in ``named_parameters()``).

``inputs`` is a tensor, a sequence of them (``model(*inputs)``), or a mapping of names to them
(``model(**inputs)``, a tokenizer's batch): every tensor is split along its dimension 0, and
anything else is passed as it is to every example::

    batch = {"x": torch.randn(4, 3), "scale": 2.0}
    grads = loop_grad(model, loss_fn, batch)  # model(x=x[i:i+1], scale=2.0), i = 0..3
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from . import _torch
from .engine.pause import paused
from .errors import ConfigurationError, ConfigurationTypeError
from .loop import per_example

__all__ = ["vmap_grad", "loop_grad", "Inputs"]

Inputs = Tensor | Sequence[Tensor] | Mapping[str, Any]
LossFn = Callable[..., Tensor]


def _as_tuple(inputs: Inputs) -> tuple[Tensor, ...]:
    return (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)


def _as_call(inputs: Inputs, where: str) -> tuple[tuple, dict[str, Any]]:
    """The positional and keyword arguments of ``model(...)``: a mapping is keywords."""
    if not isinstance(inputs, (Tensor, Sequence, Mapping)) or isinstance(inputs, str):
        raise ConfigurationTypeError(  # (None, a number: a bare TypeError from tuple())
            f"{where}: inputs must be a tensor [batch, ...], a sequence of the model's positional "
            f"inputs or a mapping of its keyword inputs, got {type(inputs).__qualname__}"
        )
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    return _as_tuple(inputs), {}


def _batch_size(args: tuple, kwargs: dict[str, Any]) -> int:
    """Dimension 0 of the first tensor among the arguments (in their nested containers)."""
    for leaf in _torch.tree_flatten((args, kwargs))[0]:
        if isinstance(leaf, Tensor):
            return leaf.shape[0]
    raise ConfigurationError("the inputs hold no tensor: no batch to take the examples from")


def _checked_batch(
    where: str, model: nn.Module, loss_fn: LossFn, args: tuple, kwargs: dict[str, Any],
    target: Tensor | None,
) -> int:  # fmt: skip
    """The batch size, every tensor of the inputs and the target holding it on dimension 0:
    each example is row ``i`` of every one of them (a longer one's rows past the batch would
    be left out, silently)."""
    if not isinstance(model, nn.Module):
        raise ConfigurationTypeError(
            f"{where}: model must be an nn.Module, got {type(model).__qualname__}"
        )
    if not callable(loss_fn):
        raise ConfigurationTypeError(
            f"{where}: loss_fn must be a function (output[, target]) -> loss, got "
            f"{type(loss_fn).__qualname__}"
        )
    batch = _batch_size(args, kwargs)
    leaves = [t for t in _torch.tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
    if target is not None:
        if not isinstance(target, Tensor):
            raise ConfigurationTypeError(
                f"{where}: target must be a tensor [batch, ...] or None, got "
                f"{type(target).__qualname__}"
            )
        leaves.append(target)
    if any(t.dim() == 0 or t.shape[0] != batch for t in leaves):
        raise ConfigurationError(
            f"{where}: every input tensor and the target hold one row per example on "
            f"dimension 0, and these do not agree: {', '.join(str(tuple(t.shape)) for t in leaves)}"
            f" (the first says a batch of {batch})"
        )
    return batch


def one_number(where: str, loss: Any, of: str, must: str) -> Tensor:
    """``loss``, what ``loss_fn`` returned ``of`` one example or a batch, as one number (shape
    ``()``): a tensor of one element (a loss of ``reduction="none"`` of one example is of
    shape ``[1]``). Anything else (several losses, whose gradient is not one: torch's bare
    ``RuntimeError``, under ``vmap`` also for one element) is refused with a
    :class:`~gradhooks.ConfigurationError` naming ``where`` and what it ``must`` return."""
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        got = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__qualname__
        raise ConfigurationError(f"{where}: loss_fn returned {got} for {of}; it must return {must}")
    return loss.reshape(())


def _scalar(where: str, loss: Any) -> Tensor:
    """Example ``i``'s loss, of a batch of one (:func:`one_number`)."""
    return one_number(
        where, loss, "one example",
        "that example's loss, one number: reduce it (a loss of reduction='none' over "
        "positions: .sum() or .mean(), as the training loss does)",
    )  # fmt: skip


def _split(model: nn.Module):
    trainable = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    rest = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    rest.update({n: b.detach() for n, b in model.named_buffers()})
    return trainable, rest


def _empty(model: nn.Module, trainable: dict[str, Tensor]) -> dict[str, Tensor]:
    return {n: p.new_zeros((0, *p.shape)) for n, p in trainable.items()}


def vmap_grad(
    model: nn.Module, loss_fn: LossFn, inputs: Inputs, target: Tensor | None = None
) -> dict[str, Tensor]:
    """Per-example gradients by ``vmap(grad(...))`` over dimension 0 of inputs and target
    (by :func:`loop_grad` for a model with an RNN where torch's Python dispatcher, which makes
    RNNs vmappable, cannot be reached: :func:`gradhooks._torch.python_dispatcher`)."""
    args, kwargs = _as_call(inputs, "vmap_grad")
    batch = _checked_batch("vmap_grad", model, loss_fn, args, kwargs, target)
    trainable, rest = _split(model)
    if batch == 0:
        return _empty(model, trainable)
    # The Python dispatcher runs torch's own decompositions of composite ops that vmap has
    # no batching rule for (aten::lstm, gru, rnn_tanh, rnn_relu): stock RNNs become
    # vmappable. Only where needed, so that vmap(grad) is timed at its usual speed elsewhere.
    recurrent = any(isinstance(m, nn.RNNBase) for m in model.modules())
    dispatch = _torch.python_dispatcher() if recurrent else contextlib.nullcontext()
    if dispatch is None:
        return loop_grad(model, loss_fn, inputs, target)
    # (the tensors are vmapped over; anything else, a flag or a number, is given as it is)
    leaves, spec = _torch.tree_flatten((args, kwargs))
    split = [isinstance(t, Tensor) for t in leaves]

    def one_loss(params, xs, y):
        # (nested inputs too: an LSTMCell's state (h, c))
        it = iter(xs)
        one = [next(it).unsqueeze(0) if sp else t for t, sp in zip(leaves, split)]
        xargs, xkwargs = _torch.tree_unflatten(one, spec)
        out = functional_call(model, (params, rest), xargs, xkwargs)
        return _scalar("vmap_grad", loss_fn(out) if y is None else loss_fn(out, y.unsqueeze(0)))

    # functional_call does not always put back a parameter of a module that appears under
    # several names (nn.Sequential(*[conv] * 3)): put every one back ourselves.
    originals = [(m, n, p) for m in model.modules() for n, p in _torch.own_parameters(m).items()]
    try:
        with paused(), dispatch:
            in_dims = (None, 0, None if target is None else 0)
            xs = [t for t, sp in zip(leaves, split) if sp]
            return vmap(grad(one_loss), in_dims=in_dims, randomness="same")(trainable, xs, target)
    finally:
        for m, n, p in originals:
            _torch.own_parameters(m)[n] = p


def loop_grad(
    model: nn.Module, loss_fn: LossFn, inputs: Inputs, target: Tensor | None = None
) -> dict[str, Tensor]:
    """Per-example gradients by one forward and backward per example (``loss.backward()``,
    each parameter's ``.grad`` put back as it was: ``torch.autograd.grad`` would not run
    reentrant activation checkpointing again, and give those parameters nothing)."""
    args, kwargs = _as_call(inputs, "loop_grad")
    batch = _checked_batch("loop_grad", model, loss_fn, args, kwargs, target)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:  # (as vmap_grad: no parameter, no gradient; its loss has no history)
        return {}
    kept = [p.grad for p in params]

    def row(i: int):
        return lambda x: x[i : i + 1] if isinstance(x, Tensor) else x

    def one(i: int) -> list[Tensor | None]:
        for p in params:
            p.grad = None
        out = model(*_torch.tree_map(row(i), args), **_torch.tree_map(row(i), kwargs))
        loss = loss_fn(out) if target is None else loss_fn(out, target[i : i + 1])
        _scalar("loop_grad", loss).backward()
        return [None if p.grad is None else p.grad.to_dense() for p in params]

    try:  # (recording whatever the caller's grad mode)
        with paused(), torch.inference_mode(False), torch.enable_grad():
            grads = per_example(batch, one, like=params)
    finally:
        for p, g in zip(params, kept):
            p.grad = g
    return dict(zip(names, grads))

"""Reference per-example gradients: ``torch.func`` ``vmap(grad)`` and an explicit loop.

Both define example ``i``'s own loss as ``loss_fn(model(x[i:i+1]), target[i:i+1])``: the loss of
a batch of one, where mean and sum reductions agree. Shipped in the package so that users can
check their own rules (:func:`gradhooks.check_rule`) and models against the same references the
test suite uses. Capture by gradhooks is paused while they run.

Both return ``{param_name: [batch, *param.shape]}`` for every parameter that requires grad
(tied parameters appear once, under their first name, as in ``named_parameters()``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from . import _torch
from .engine.pause import paused
from .loop import per_example

__all__ = ["vmap_grad", "loop_grad", "Inputs"]

Inputs = Tensor | Sequence[Tensor]
LossFn = Callable[..., Tensor]


def _as_tuple(inputs: Inputs) -> tuple[Tensor, ...]:
    return (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)


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
    inputs = _as_tuple(inputs)
    trainable, rest = _split(model)
    if inputs[0].shape[0] == 0:
        return _empty(model, trainable)
    # The Python dispatcher runs torch's own decompositions of composite ops that vmap has
    # no batching rule for (aten::lstm, gru, rnn_tanh, rnn_relu): stock RNNs become
    # vmappable. Only where needed, so that vmap(grad) is timed at its usual speed elsewhere.
    recurrent = any(isinstance(m, nn.RNNBase) for m in model.modules())
    dispatch = _torch.python_dispatcher() if recurrent else contextlib.nullcontext()
    if dispatch is None:
        return loop_grad(model, loss_fn, inputs, target)

    def one_loss(params, xs, y):
        # (nested inputs too: an LSTMCell's state (h, c))
        xs = _torch.tree_map(lambda x: x.unsqueeze(0) if isinstance(x, Tensor) else x, xs)
        out = functional_call(model, (params, rest), xs)
        return loss_fn(out) if y is None else loss_fn(out, y.unsqueeze(0))

    # functional_call does not always put back a parameter of a module that appears under
    # several names (nn.Sequential(*[conv] * 3)): put every one back ourselves.
    originals = [(m, n, p) for m in model.modules() for n, p in _torch.own_parameters(m).items()]
    try:
        with paused(), dispatch:
            in_dims = (None, 0, None if target is None else 0)
            return vmap(grad(one_loss), in_dims=in_dims, randomness="same")(
                trainable, inputs, target
            )
    finally:
        for m, n, p in originals:
            _torch.own_parameters(m)[n] = p


def loop_grad(
    model: nn.Module, loss_fn: LossFn, inputs: Inputs, target: Tensor | None = None
) -> dict[str, Tensor]:
    """Per-example gradients by one forward and backward per example (``loss.backward()``,
    each parameter's ``.grad`` put back as it was: ``torch.autograd.grad`` would not run
    reentrant activation checkpointing again, and give those parameters nothing)."""
    inputs = _as_tuple(inputs)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    kept = [p.grad for p in params]

    def one(i: int) -> list[Tensor | None]:
        for p in params:
            p.grad = None
        out = model(
            *_torch.tree_map(lambda x: x[i : i + 1] if isinstance(x, Tensor) else x, inputs)
        )
        loss = loss_fn(out) if target is None else loss_fn(out, target[i : i + 1])
        loss.backward()
        return [None if p.grad is None else p.grad.to_dense() for p in params]

    try:  # (recording whatever the caller's grad mode)
        with paused(), torch.inference_mode(False), torch.enable_grad():
            grads = per_example(inputs[0].shape[0], one, like=params)
    finally:
        for p, g in zip(params, kept):
            p.grad = g
    return dict(zip(names, grads))

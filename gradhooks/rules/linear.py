"""nn.Linear: ``y = x Wᵀ + b`` on ``[batch, *, in]``; the ``*`` positions share the weight."""

import math

from einops import rearrange
from torch import Tensor, nn

from .. import devices
from ..errors import UnbatchedInputError, describe_module
from ..pieces import Direct, Outer, Piece
from ..tuning import TUNING
from .registry import REGISTRY, Call, register


def many_positions(module: nn.Module, args: tuple) -> bool:
    """Whether a Linear call's batch gradient is better taken as the sum of its ``grad1`` (on
    CPU, at least ``TUNING.sum_grad1_positions`` positions per example)."""
    x = args[0] if args else None
    if not isinstance(x, Tensor):
        return False
    # (one position, [batch, in]: asked before the device, at every call of an MLP's layers)
    if x.dim() < 2 or (x.dim() == 2 and TUNING.sum_grad1_positions > 1):
        return False
    return devices.cpu_trade_offs(x) and math.prod(x.shape[1:-1]) >= TUNING.sum_grad1_positions


def large_product(module: nn.Module, args: tuple) -> bool:
    """Whether a Linear call's batch gradient, where the backward wants none, is costly
    enough not to form (:attr:`gradhooks.tuning.Tuning.unused_grad_macs`): rows x weight
    entries multiply-adds. The weight's entries, in x out, also for a layer that stores it
    transposed (Hugging Face's Conv1D)."""
    x = args[0] if args else None
    weight = getattr(module, "weight", None)
    if not isinstance(x, Tensor) or x.dim() < 2 or not isinstance(weight, Tensor):
        return False
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return rows * weight.numel() >= unused_grad_macs(x)


def unused_grad_macs(x: Tensor) -> int:
    """The threshold of :func:`large_product` for a call on ``x``'s device."""
    if devices.cpu_trade_offs(x):
        return TUNING.unused_grad_macs
    return TUNING.unused_grad_macs_device


def _positions(t: Tensor) -> Tensor:
    """``[batch, *, features]`` as ``[batch, positions, features]``: einops'
    ``"batch ... f -> batch (...) f"``, as a plain reshape (einops costs a few µs more per call,
    which a small layer called often feels). Other shapes go to einops, for its error."""
    dim = t.dim()
    if dim == 3:
        return t  # (already: no view of the same shape)
    if dim == 2:
        return t.unsqueeze(1)  # (one position: the cheapest view)
    if dim < 2:
        return rearrange(t, "batch ... f -> batch (...) f")
    return t.reshape(t.shape[0], math.prod(t.shape[1:-1]), t.shape[-1])


@register(
    nn.Linear, grad_from_grad1=many_positions, detach_without_grads=large_product,
    batch_dim="positions",
)  # fmt: skip
def linear(call: Call) -> dict[str, Outer]:
    """``x``: ``[batch, *, in]``, ``g``: ``[batch, *, out]``; the ``*`` positions are the
    pieces' ``shared`` axis."""
    (x,) = call.inputs
    if x.dim() < 2:
        raise UnbatchedInputError(
            f"{describe_module(call.name, call.module)} got an input of shape {tuple(x.shape)} "
            "without a batch dimension: per-example gradients need [batch, *, in_features] "
            "(x.unsqueeze(0) for a single example)"
        )
    g = _positions(call.grad_output)
    return {"weight": Outer(_positions(x.conj() if x.is_complex() else x), g),
            "bias": Outer(None, g)}  # fmt: skip


REGISTRY.register_function("linear", linear, {"weight": (1, "weight"), "bias": (2, "bias")})


def addmm(call: Call) -> dict[str, Piece]:
    """``torch.addmm(bias, x, weight)``: a Linear with its weight ``[in, out]`` (Hugging Face's
    ``Conv1D``): ``grad1[b] = Σ_s x[b, s]ᵀ g[b, s]``, ``[in, out]``, an :class:`Outer` with
    ``x`` on its rows; the bias ``Σ_s g[b, s]`` lies along the weight's columns, not its rows
    (no column of K-FAC's bias-augmented factor): a :class:`Direct`."""
    (x,) = call.inputs
    g = _positions(call.grad_output)
    x = _positions(x.conj() if x.is_complex() else x)  # (mat2's gradient is mat1ᴴ g)
    return {"weight": Outer(g, x, inputs_in_g=True), "bias": Direct(g.sum(-2))}


def _plain_addmm(args: tuple, kwargs: dict) -> bool:
    return kwargs.get("beta", 1) == 1 and kwargs.get("alpha", 1) == 1 and len(args) == 3


REGISTRY.register_function(
    "addmm", addmm, {"bias": (0, "input"), "weight": (2, "mat2")}, input=(1, "mat1"),
    applies=_plain_addmm,
)  # fmt: skip

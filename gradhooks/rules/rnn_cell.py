"""nn.RNNCell (tanh, relu), nn.LSTMCell and nn.GRUCell: one step of a recurrent layer, every row
of its input ``[rows, in]`` and state ``[rows, hidden]`` alone (rows may fold the batch with
time or positions, as x-transformers' GRU gating of the residual does).

The gate pre-activations are recomputed from the captured input and state (torch's gate order:
LSTM ``i, f, g, o``; GRU ``r, z, n`` with ``n = tanh(W_in x + b_in + r * (W_hn h + b_hn))``),
and their gradients follow in closed form from the output-gradients (``h'``, and ``c'`` for the
LSTM). Each weight is then an :class:`Outer`, with ``shared`` = the rows of one example:

- ``weight_ih``: ``a`` = the input, ``g`` = grad of ``x W_ihᵀ + b_ih``;
- ``weight_hh``: ``a`` = the state ``h``, ``g`` = grad of ``h W_hhᵀ + b_hh``;
- ``bias_ih``, ``bias_hh``: ``Outer(None, g)`` of the same.

Recomputed as the call ran (under its autocast, from inputs in the parameters' precision), so
that a batch and one example round alike.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..autocast import autocast_as
from ..errors import UnbatchedInputError, UnsupportedInputError, describe_module
from ..pieces import Outer
from .registry import Call, register


def _rows(call: Call, hidden: int, states: int) -> tuple[Tensor, list[Tensor]]:
    """The input ``[batch, *, in]`` and the state(s) ``[batch, *, hidden]`` (zeros where the
    call had none), in the parameters' dtype."""
    m = call.module
    x = call.inputs[0]
    if x.dim() < 2:
        raise UnbatchedInputError(
            f"{describe_module(call.name, m)} got an input of shape {tuple(x.shape)} without a "
            "batch dimension: per-example gradients need [batch, input_size]"
        )
    hx = call.inputs[1] if len(call.inputs) > 1 else call.kwargs.get("hx")
    given = list(hx) if isinstance(hx, tuple | list) else [hx]
    dtype = call.parameter("weight_ih").dtype
    shape = (*x.shape[:-1], hidden)
    zeros = x.new_zeros(shape, dtype=dtype)
    found = [zeros if h is None else _like_rows(call, h, shape).to(dtype) for h in given]
    return x.to(dtype), found + [zeros] * (states - len(found))


def _like_rows(call: Call, h: Tensor, shape: tuple[int, ...]) -> Tensor:
    """The state as the input's rows: as given where the engine gave it so; a state the same
    for every row (zeros, a learned initial state expanded) beside an input whose rows the
    engine regrouped (batch and time folded, ``[batch * time, in]`` made ``[batch, time, in]``)
    broadcast to them; any other state, whose rows could not be matched, refused."""
    if tuple(h.shape) == shape:
        return h
    if h.dim() == 2 and h.shape[-1] == shape[-1] and bool((h == h[:1]).all()):
        return h[0].expand(shape)
    raise UnsupportedInputError(
        f"{describe_module(call.name, call.module)}: its state {tuple(h.shape)} does not hold "
        f"the examples while its input's rows do, {shape[:-1]} here, and its rows differ: "
        "per-example gradients cannot match them with the input's. Compute the state from "
        "the batch (e.g. from the input), or pass the same state for every row."
    )


def _pre(call: Call, x: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
    """The two pre-activations, with the parameters the call ran with."""
    w = call.parameter
    bias = call.module.bias
    gi = torch.nn.functional.linear(x, w("weight_ih"), w("bias_ih") if bias else None)
    gh = torch.nn.functional.linear(h, w("weight_hh"), w("bias_hh") if bias else None)
    return gi, gh


def _pieces(m: nn.Module, x: Tensor, h: Tensor, dgi: Tensor, dgh: Tensor) -> dict[str, Outer]:
    def flat(t: Tensor) -> Tensor:
        return t.reshape(t.shape[0], math.prod(t.shape[1:-1]), t.shape[-1])

    x, h, dgi, dgh = flat(x), flat(h), flat(dgi), flat(dgh)
    pieces = {"weight_ih": Outer(x, dgi), "weight_hh": Outer(h, dgh)}
    if m.bias:
        pieces |= {"bias_ih": Outer(None, dgi), "bias_hh": Outer(None, dgh)}
    return pieces


def _grad(call: Call, i: int, like: Tensor) -> Tensor:
    g = call.grad_outputs[i] if i < len(call.grad_outputs) else None
    return torch.zeros_like(like) if g is None else g.to(like.dtype)


@register(nn.RNNCell, batch_dim="positions")
def rnn_cell(call: Call) -> dict[str, Outer]:
    """``h' = act(x W_ihᵀ + b_ih + h W_hhᵀ + b_hh)``: both pre-activations get ``dh' · act'``."""
    m: nn.RNNCell = call.module
    x, (h,) = _rows(call, m.hidden_size, 1)
    with autocast_as(call.autocast):
        gi, gh = _pre(call, x, h)
        pre = (gi + gh).to(x.dtype)
        out = torch.tanh(pre) if m.nonlinearity == "tanh" else torch.relu(pre)
        g = _grad(call, 0, out)
        d = g * (1 - out * out) if m.nonlinearity == "tanh" else g * (pre > 0)
    return _pieces(m, x, h, d, d)


@register(nn.LSTMCell, batch_dim="positions")
def lstm_cell(call: Call) -> dict[str, Outer]:
    """``c' = f c + i g``, ``h' = o tanh(c')``; the gates' pre-activations get (``σ'``, ``tanh'``)
    ``dc = dc' + dh' o tanh'(c')``: ``di = dc g``, ``df = dc c``, ``dg = dc i``,
    ``do = dh' tanh(c')``."""
    m: nn.LSTMCell = call.module
    x, (h, c) = _rows(call, m.hidden_size, 2)
    with autocast_as(call.autocast):
        gi, gh = _pre(call, x, h)
        i, f, g, o = (gi + gh).to(x.dtype).chunk(4, -1)
        i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
        c1 = f * c + i * g
        t = c1.tanh()
        dh, dc1 = _grad(call, 0, t), _grad(call, 1, t)
        dc = dc1 + dh * o * (1 - t * t)
        d = torch.cat(
            [dc * g * i * (1 - i), dc * c * f * (1 - f), dc * i * (1 - g * g),
             dh * t * o * (1 - o)], -1,
        )  # fmt: skip
    return _pieces(m, x, h, d, d)


@register(nn.GRUCell, batch_dim="positions")
def gru_cell(call: Call) -> dict[str, Outer]:
    """``r = σ(·)``, ``z = σ(·)``, ``n = tanh(gi_n + r gh_n)``, ``h' = (1 - z) n + z h``:
    ``dn = dh' (1 - z) tanh'``, ``dz = dh' (h - n) σ'``, ``dr = dn gh_n σ'``; the input side
    gets ``(dr, dz, dn)``, the state side ``(dr, dz, dn r)``."""
    m: nn.GRUCell = call.module
    x, (h,) = _rows(call, m.hidden_size, 1)
    with autocast_as(call.autocast):
        gi, gh = _pre(call, x, h)
        gi, gh = gi.to(x.dtype), gh.to(x.dtype)
        ir, iz, i_n = gi.chunk(3, -1)
        hr, hz, hn = gh.chunk(3, -1)
        r, z = (ir + hr).sigmoid(), (iz + hz).sigmoid()
        n = (i_n + r * hn).tanh()
        dh = _grad(call, 0, n)
        dn = dh * (1 - z) * (1 - n * n)
        dz = dh * (h - n) * z * (1 - z)
        dr = dn * hn * r * (1 - r)
        dgi = torch.cat([dr, dz, dn], -1)
        dgh = torch.cat([dr, dz, dn * r], -1)
    return _pieces(m, x, h, dgi, dgh)

"""nn.RNN (tanh, relu), nn.LSTM (with ``proj_size``) and nn.GRU, by recompute and differentiate.

The captured call is re-run with explicit cell maths (torch's gate order: LSTM ``i, f, g, o``;
GRU ``r, z, n`` with ``n = tanh(W_in x + b_in + r * (W_hn h + b_hn))``), in a batch-first padded
layout, with a zero *probe* added to every pre-activation. One ``torch.autograd.grad`` of the
recomputed outputs against the captured output-gradients then gives the gradient of every
pre-activation at every step, per example. Each weight sees its input at every step, so its
per-example gradient is an :class:`Outer` with ``shared`` = time steps:

- ``weight_ih_l{k}[_reverse]``: ``a`` = the layer's input ``[batch, time, in]``,
  ``g`` = grad of ``x W_ihᵀ + b_ih`` ``[batch, time, gates * hidden]``;
- ``weight_hh_l{k}[_reverse]``: ``a`` = the previous hidden state ``h_{t-1}``, ``g`` = grad of
  ``h_{t-1} W_hhᵀ + b_hh``;
- ``weight_hr_l{k}[_reverse]`` (LSTM ``proj_size``): ``a = o * tanh(c_t)``, ``g`` = grad of ``h_t``;
- biases: ``Outer(None, g)`` with the same ``g``.

``num_layers``, ``bidirectional``, ``batch_first``, ``bias``, an initial state (``h0``, or
``(h0, c0)``) and :class:`~torch.nn.utils.rnn.PackedSequence` inputs are handled; with packed
inputs, steps past an example's length are masked out and contribute nothing. As for every rule,
the output-gradients are those of the backpropagated loss; the engine does the mean/sum scaling.
"""

from __future__ import annotations

import torch
from einops import rearrange
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence
from torch.utils._pytree import tree_flatten

from ..pieces import Outer
from ..registry import Call, register

GATES = {"RNN_TANH": 1, "RNN_RELU": 1, "LSTM": 4, "GRU": 3}


def _initial_state(call: Call) -> Tensor | tuple[Tensor, Tensor] | None:
    """``hx`` as passed to ``forward``: ``h0``, ``(h0, c0)`` for the LSTM, or ``None``."""
    if len(call.inputs) > 1:
        return call.inputs[1]
    return call.kwargs.get("hx")


def _cell(mode: str, pre_ih: Tensor, pre_hh: Tensor, c_prev: Tensor | None):
    """One step from the two pre-activations ``[batch, gates * hidden]``: ``(h, c)``, where for
    the LSTM ``h`` is ``o * tanh(c)`` before any projection, and ``c`` is ``None`` otherwise."""
    if mode == "RNN_TANH":
        return torch.tanh(pre_ih + pre_hh), None
    if mode == "RNN_RELU":
        return torch.relu(pre_ih + pre_hh), None
    if mode == "LSTM":
        i, f, g, o = (pre_ih + pre_hh).chunk(4, -1)
        c = torch.sigmoid(f) * c_prev + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c
    # GRU
    ih_r, ih_z, ih_n = pre_ih.chunk(3, -1)
    hh_r, hh_z, hh_n = pre_hh.chunk(3, -1)
    r = torch.sigmoid(ih_r + hh_r)
    z = torch.sigmoid(ih_z + hh_z)
    n = torch.tanh(ih_n + r * hh_n)
    return n, z  # combined with h_prev by the caller: (1 - z) * n + z * h_prev


def recompute(
    module: nn.RNNBase, x: Tensor, lengths: Tensor, hx=None
) -> tuple[tuple[Tensor, ...], dict[str, tuple[Tensor | None, Tensor]]]:
    """Re-run ``module`` on a batch-first padded ``x`` ``[batch, time, in]`` with per-example
    ``lengths`` ``[batch]`` and an optional initial state (torch's layout, ``[layers * dirs,
    batch, hidden]``), under autograd.

    Returns ``(outputs, probes)``: ``outputs`` = ``(output [batch, time, dirs * hidden_out],
    h_n [layers * dirs, batch, hidden_out][, c_n])``, the output zero past each length; ``probes``
    maps every parameter name to ``(a, probe)``: ``a`` ``[batch, time, in]`` (``None`` for a
    bias) is what the parameter multiplies, ``probe`` ``[batch, time, out]`` a zero tensor
    requiring grad, added to that parameter's pre-activation, whose gradient is ``g``.
    """
    mode, lstm = module.mode, module.mode == "LSTM"
    dirs = 2 if module.bidirectional else 1
    batch, time = x.shape[:2]
    hidden, proj = module.hidden_size, module.proj_size
    h_size = proj if proj > 0 else hidden
    if hx is None:
        h0 = x.new_zeros(module.num_layers * dirs, batch, h_size)
        c0 = x.new_zeros(module.num_layers * dirs, batch, hidden)
    else:
        h0, c0 = hx if lstm else (hx, None)
    valid = torch.arange(time, device=x.device)[None, :] < lengths.to(x.device)[:, None]
    valid = valid[..., None]  # [batch, time, 1]
    probes: dict[str, tuple[Tensor | None, Tensor]] = {}
    h_n, c_n = [], []
    layer_in = x
    for layer in range(module.num_layers):
        outs = []
        for d in range(dirs):
            sfx = f"_l{layer}" + ("_reverse" if d else "")
            w_ih, w_hh = getattr(module, "weight_ih" + sfx), getattr(module, "weight_hh" + sfx)
            gates = w_ih.shape[0]
            z_ih = x.new_zeros(batch, time, gates, requires_grad=True)
            z_hh = x.new_zeros(batch, time, gates, requires_grad=True)
            pre_ih = layer_in @ w_ih.detach().T + z_ih
            b_ih = b_hh = None
            if module.bias:
                b_ih = getattr(module, "bias_ih" + sfx).detach()
                b_hh = getattr(module, "bias_hh" + sfx).detach()
                pre_ih = pre_ih + b_ih
            z_hr = x.new_zeros(batch, time, proj, requires_grad=True) if proj > 0 else None
            w_hr = getattr(module, "weight_hr" + sfx).detach() if proj > 0 else None
            h, c = h0[layer * dirs + d], c0[layer * dirs + d] if lstm else None
            steps = range(time - 1, -1, -1) if d else range(time)
            out_t: list[Tensor] = [None] * time  # type: ignore[list-item]
            h_prev_t: list[Tensor] = [None] * time  # type: ignore[list-item]
            pre_proj_t: list[Tensor] = [None] * time  # type: ignore[list-item]
            for t in steps:
                h_prev_t[t] = h
                pre_hh = h @ w_hh.detach().T + z_hh[:, t]
                if b_hh is not None:
                    pre_hh = pre_hh + b_hh
                new_h, aux = _cell(mode, pre_ih[:, t], pre_hh, c)
                if mode == "GRU":
                    new_h = (1 - aux) * new_h + aux * h
                if lstm:
                    c = torch.where(valid[:, t], aux, c)
                if w_hr is not None:
                    pre_proj_t[t] = new_h
                    new_h = new_h @ w_hr.T + z_hr[:, t]
                h = torch.where(valid[:, t], new_h, h)
                out_t[t] = h
            outs.append(torch.stack(out_t, 1))
            h_n.append(h)
            if lstm:
                c_n.append(c)
            h_prev = torch.stack(h_prev_t, 1).detach()
            probes["weight_ih" + sfx] = (layer_in.detach(), z_ih)
            probes["weight_hh" + sfx] = (h_prev, z_hh)
            if module.bias:
                probes["bias_ih" + sfx] = (None, z_ih)
                probes["bias_hh" + sfx] = (None, z_hh)
            if w_hr is not None:
                probes["weight_hr" + sfx] = (torch.stack(pre_proj_t, 1).detach(), z_hr)
        layer_in = torch.where(valid, torch.cat(outs, -1), 0.0)
    outputs = (layer_in, torch.stack(h_n))
    if lstm:
        outputs = (*outputs, torch.stack(c_n))
    return outputs, probes


def _error(call: Call, what: str, todo: str) -> ValueError:
    m = call.module
    return ValueError(f"'{call.name}' ({type(m).__qualname__}, {m.mode}): {what}; {todo}")


@register(nn.RNN, nn.LSTM, nn.GRU)
def rnn(call: Call) -> dict[str, Outer]:
    module: nn.RNNBase = call.module
    x, hx = call.inputs[0], _initial_state(call)
    if module.training and module.dropout > 0 and module.num_layers > 1:
        raise _error(
            call,
            f"dropout={module.dropout} between layers in training mode draws a mask that "
            "gradhooks cannot see, so per-example gradients cannot be recomputed",
            "set dropout=0, call model.eval(), or apply nn.Dropout between single-layer RNNs",
        )
    packed = isinstance(x, PackedSequence)
    grads = call.grad_outputs
    if packed:
        time = x.batch_sizes.shape[0]
        x_pad, lengths = pad_packed_sequence(x, batch_first=True)
        g_out = grads[0]
        if g_out is not None:
            g_out, _ = pad_packed_sequence(
                PackedSequence(g_out, x.batch_sizes, x.sorted_indices, x.unsorted_indices),
                batch_first=True,
                total_length=time,
            )
        # The output PackedSequence flattens like the input one: data (the only leaf with a
        # gradient), batch_sizes, sorted_indices, unsorted_indices; then h_n (and c_n).
        grads = (g_out, *grads[len(tree_flatten(x)[0]) :])
    else:
        if x.dim() != 3:
            raise _error(
                call,
                f"got an input of shape {tuple(x.shape)} without a batch dimension",
                "per-example gradients need a batch: pass [batch, time, features] "
                "(batch_first=True) or [time, batch, features]",
            )
        if not module.batch_first:
            x = rearrange(x, "time batch inp -> batch time inp")
            if grads[0] is not None:
                grads = (rearrange(grads[0], "time batch out -> batch time out"), *grads[1:])
        x_pad = x
        lengths = torch.full((x.shape[0],), x.shape[1], dtype=torch.long)
    with torch.enable_grad():
        outputs, probes = recompute(module, x_pad, lengths, hx)
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None]
        zs = list({id(z): z for _, z in probes.values()}.values())  # a bias shares its weight's
        got = [None] * len(zs)
        if pairs:
            got = torch.autograd.grad(
                [o for o, _ in pairs], zs, [g for _, g in pairs], allow_unused=True
            )
    g_of = {id(z): torch.zeros_like(z) if g is None else g for z, g in zip(zs, got, strict=True)}
    return {name: Outer(a, g_of[id(z)]) for name, (a, z) in probes.items()}

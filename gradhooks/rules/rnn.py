"""nn.RNN (tanh, relu), nn.LSTM (with ``proj_size``) and nn.GRU, by recompute and backpropagate
through time by hand.

The captured call is re-run without autograd (torch's gate order: LSTM ``i, f, g, o``; GRU
``r, z, n`` with ``n = tanh(W_in x + b_in + r * (W_hn h + b_hn))``), time-major, keeping the
gate activations: the input-side pre-activations of all steps are one matmul, each step one
matmul with ``W_hh`` and a few elementwise ops. The backward through time is then written out
with the gates' closed-form derivatives (one matmul with ``W_hh`` and a few elementwise ops per
step, no autograd graph), from the captured output-gradients, and gives the gradient of every
pre-activation at every step, per example.

An LSTM whose every sequence is full length (not packed, or packed at full length) goes faster:
its hidden states come from torch's fused forward (the last layer's are the module's own
output, kept with ``needs_output``; the earlier layers' are kept at the forward where the call
runs with grad mode off, see below and :class:`_LayerOutputs`, else each is one fused no-grad
run again; under a half precision's autocast, every layer's is run again in the parameters'
dtype), so all gate pre-activations are two matmuls and the cell states one ``addcmul``
per step. Its backward through time is three ops per step into preallocated buffers (inside
``vmap``, for the Jacobians, the step-by-step backward is used instead). An RNN, GRU or LSTM
call on a padded input (no dropout between layers) runs without autograd while ``grad1`` or
the norms are computed (``grad_from_grad1`` with ``owns_backward``): torch's own backward of
the layer is not run, the batch gradients are the sums of the per-example ones and the input-,
``h0``- (and ``c0``-) gradients come from the same backward through time (``d x_t = d G_t
W_ih``, ``d h0 = d G_0 W_hh`` (a GRU's plus ``d h_0 z_0``), ``d c0 = d c_0 f_0``). Under
autocast the rule computes in the parameters' dtype from the call's input, and so does the
run-time check's reference of such a call (:func:`gradhooks.engine.capture._rerun_as_rule`):
the two agree to that dtype's rounding.

Each weight sees its input at every step, so its per-example gradient is an :class:`Outer` with
``shared`` = time steps:

- ``weight_ih_l{k}[_reverse]``: ``a`` = the layer's input ``[batch, time, in]``,
  ``g`` = grad of ``x W_ihᵀ + b_ih`` ``[batch, time, gates * hidden]``;
- ``weight_hh_l{k}[_reverse]``: ``a`` = the previous hidden state ``h_{t-1}``, ``g`` = grad of
  ``h_{t-1} W_hhᵀ + b_hh``;
- ``weight_hr_l{k}[_reverse]`` (LSTM ``proj_size``): ``a = o * tanh(c_t)``, ``g`` = grad of ``h_t``;
- biases: ``Outer(None, Σ_t g)`` (one shared position), with the same ``g`` summed over time
  once: where ``bias_ih`` and ``bias_hh`` see the same ``g`` (RNN, LSTM) they share it.

(For the reverse direction the ``shared`` axis runs backwards in time: the sum over it is the
same.) ``num_layers``, ``bidirectional``, ``batch_first``, ``bias``, an initial state (``h0``,
or ``(h0, c0)``) and :class:`~torch.nn.utils.rnn.PackedSequence` inputs are handled; with packed
inputs, steps past an example's length are masked out and contribute nothing. As for every rule,
the output-gradients are those of the backpropagated loss; the engine does the mean/sum scaling.
In a ``create_graph=True`` backward the per-example gradients come from the ``torch.func``
fallback instead, which keeps their graph (the backward through time here has none), where it
can split the call into examples (a padded ``batch_first`` input and no initial state); the
other calls (a ``PackedSequence``, a time-major input, an initial state) are run again one
example at a time, each example's gradients taken by autograd with their graph
(:func:`_example_by_example`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial

import torch
from einops import rearrange
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence
from torch.overrides import TorchFunctionMode

from .. import _torch
from .._torch import tree_flatten
from ..engine.pause import paused
from ..engine.records import half_precision
from ..errors import ConfigurationError, UnbatchedInputError
from ..loop import per_example
from ..pieces import Direct, Outer
from ..tracking import note
from .fallback import fallback
from .registry import Call, batch_first, register

GATES = {"RNN_TANH": 1, "RNN_RELU": 1, "LSTM": 4, "GRU": 3}


def _initial_state(call: Call) -> Tensor | tuple[Tensor, Tensor] | None:
    """``hx`` as passed to ``forward``: ``h0``, ``(h0, c0)`` for the LSTM, or ``None``."""
    if len(call.inputs) > 1:
        return call.inputs[1]
    return call.kwargs.get("hx")


def _shift(first: Tensor, steps: Tensor) -> Tensor:
    """The state before each step: ``[first, steps[0], ..., steps[-2]]`` ``[time, batch, n]``."""
    return torch.cat([first[None], steps[:-1]])


def _transformed(*trees) -> bool:
    """Whether this runs inside a ``torch.func`` transform (the Jacobians' ``vmap``); where
    torch cannot be asked, ``trees`` (tensors of the call) help tell
    (:func:`gradhooks._torch.in_transform`)."""
    return _torch.in_transform(*trees)


def _activate(pre: Tensor) -> Tensor:
    """An LSTM's gate pre-activations ``[..., 4H]`` to its gates ``i, f, g, o``, in place."""
    H = pre.shape[-1] // 4
    pre[..., : 2 * H].sigmoid_()
    pre[..., 2 * H : 3 * H].tanh_()
    pre[..., 3 * H :].sigmoid_()
    return pre


def _one_minus(x: Tensor) -> Tensor:
    """``1 - x``, new."""
    return torch.rsub(x, 1)


def _one_minus_sq(x: Tensor) -> Tensor:
    """``1 - x²``, new (the derivative of tanh at its output ``x``)."""
    return torch.addcmul(x.new_ones(()), x, x, value=-1)


class _Direction:
    """One layer and direction of an RNN module, time-major, in its own step order (a reverse
    direction is handed its input flipped in time).

    :meth:`forward` runs the recurrence without autograd and keeps what the backward needs;
    :meth:`backward` takes the gradients of the outputs and of the final state and returns the
    ``(a, g)`` of every parameter (time-major ``[time, batch, n]``) and the input-gradient.
    ``keep`` ``[time, batch, 1]`` (bool), or ``None`` when every step is valid: where it is
    false the step is skipped (the state carried over unchanged, as for packed sequences).

    Letters in shapes: ``T`` time steps, ``B`` batch, ``H`` hidden size, ``P`` the size of the
    output state (``proj_size`` or ``H``).
    """

    def __init__(self, module: nn.RNNBase, sfx: str, weight: Callable[[str], Tensor]) -> None:
        def get(name: str) -> Tensor:
            return weight(name + sfx).detach()

        self.mode, self.sfx, self.hidden = module.mode, sfx, module.hidden_size
        self.d_state0: tuple[Tensor | None, Tensor | None] = (None, None)  # d h0, d c0
        self.w_ih, self.w_hh = get("weight_ih"), get("weight_hh")
        self.b_ih = get("bias_ih") if module.bias else None
        self.b_hh = get("bias_hh") if module.bias else None
        self.w_hr = get("weight_hr") if module.proj_size > 0 else None

    # -- forward ---------------------------------------------------------------------------

    def forward(self, x: Tensor, keep: Tensor | None, h0: Tensor, c0: Tensor | None):
        """``x`` ``[T, B, in]``; ``h0`` ``[B, P]``, ``c0`` ``[B, H]`` (LSTM). Returns
        ``(out [T, B, P], h_n, c_n)``; ``out`` past a sequence's end repeats its last state."""
        self.x, self.keep, self.h0 = x, keep, h0
        step = {"LSTM": self._lstm, "GRU": self._gru}.get(self.mode, self._rnn)
        return step(x, keep, h0, c0)

    def forward_lstm_from(self, x: Tensor, h: Tensor, h0: Tensor, c0: Tensor):
        """The LSTM's forward when its states ``h`` ``[T, B, P]`` are known (torch's fused
        run computed them) and every step is valid: no recurrence over ``h``. All gate
        pre-activations ``x W_ihᵀ + h_{t-1} W_hhᵀ + b`` ``[T, B, 4H]`` are two matmuls, their
        nonlinearities three batched ops, and the cell states ``c_t = f_t c_{t-1} + i_t g_t``
        one ``addcmul`` per step. Keeps what :meth:`forward` keeps; returns ``(h, h_n, c_n)``."""
        H, P = self.hidden, h.shape[-1]
        self.x, self.keep, self.h0, self.c0, self.out = x, None, h0, c0, h
        steps, batch = x.shape[:2]
        act = self._pre_ih(x, self._bias(), self._gate_buffer(steps, batch, x))  # [T, B, 4H]
        if steps > 1:  # + h_{t-1} W_hhᵀ, without materializing the shifted states
            act[1:].view(-1, 4 * H).addmm_(h[:-1].reshape(-1, P), self.w_hh.T)
        act[0].addmm_(h0, self.w_hh.T)
        self.act = _activate(act)  # i, f, g, o after their nonlinearity
        i, f, g, o = act.chunk(4, -1)
        self.c = c = torch.mul(i, g)  # then c_t = i_t g_t + f_t c_{t-1}, in place
        cs, fs = c.unbind(0), f.unbind(0)  # (views made once: the loop is per-op overhead)
        torch.addcmul(cs[0], fs[0], c0, out=cs[0])
        for t in range(1, steps):
            torch.addcmul(cs[t], fs[t], cs[t - 1], out=cs[t])
        self.tanh_c = torch.tanh(c)
        self.proj_in = None if self.w_hr is None else torch.mul(o, self.tanh_c)
        return h, h[-1], c[-1]

    def _pre_ih(self, x: Tensor, bias: Tensor | None, out: Tensor | None = None) -> Tensor:
        """``x W_ihᵀ + bias`` for all steps at once: ``[T, B, gates * H]`` (written into
        ``out``, which may have rows apart, if given)."""
        flat = x.reshape(-1, x.shape[-1])
        into = None if out is None else out.view(flat.shape[0], self.w_ih.shape[0])
        if bias is None:
            pre = torch.mm(flat, self.w_ih.T, out=into)
        else:
            pre = torch.addmm(bias, flat, self.w_ih.T, out=into)
        return pre.view(*x.shape[:2], self.w_ih.shape[0]) if out is None else out

    def _gate_buffer(self, steps: int, batch: int, like: Tensor, masked: bool = False) -> Tensor:
        """The LSTM's gates ``i, f, g, o`` after their nonlinearity, ``[T, B, 4H]`` (what
        ``self.act`` holds). Where :meth:`_lstm_back_fast` will run (no masked steps, not under
        a transform), slots 1-4 of a ``[T, B, 5H]`` buffer: it writes each gate's factor over
        the gate and its carried cell factor into slot 0, so that its backward needs no buffer
        of its own (on CPU, fresh memory costs a page fault per 4 KiB written)."""
        if masked or _transformed(like):
            self.slots = None
            return like.new_empty(steps, batch, 4 * self.hidden)
        self.slots = like.new_empty(steps, batch, 5 * self.hidden)
        return self.slots[..., self.hidden :]

    def _bias(self) -> Tensor | None:
        return None if self.b_ih is None else self.b_ih + self.b_hh

    def _rnn(self, x, keep, h, _):
        pre = self._pre_ih(x, self._bias())
        act = torch.tanh if self.mode == "RNN_TANH" else partial(torch.clamp, min=0)

        self.h_new = torch.empty_like(pre)  # [T, B, H]: each step's new state, before masking
        out = self.h_new if keep is None else torch.empty_like(pre)
        w_hh = self.w_hh.T
        for t in range(x.shape[0]):
            act(torch.addmm(pre[t], h, w_hh), out=self.h_new[t])
            h = self.h_new[t] if keep is None else torch.where(keep[t], self.h_new[t], h)
            if keep is not None:
                out[t] = h
        self.out = out
        return out, h, None

    def _lstm(self, x, keep, h, c):
        H = self.hidden
        pre = self._pre_ih(x, self._bias())
        steps, batch = pre.shape[:2]
        self.act = act = self._gate_buffer(steps, batch, pre, masked=keep is not None)
        self.tanh_c = torch.empty(steps, batch, H, dtype=pre.dtype, device=pre.device)
        self.c = torch.empty_like(self.tanh_c)  # [T, B, H]: the cell state after each step
        self.proj_in = None if self.w_hr is None else torch.empty_like(self.tanh_c)
        out = pre.new_empty(steps, batch, h.shape[-1])  # [T, B, P]
        self.c0 = c
        w_hh = self.w_hh.T
        for t in range(steps):
            a = act[t]
            gates = torch.addmm(pre[t], h, w_hh)
            torch.sigmoid(gates, out=a)
            torch.tanh(gates[:, 2 * H : 3 * H], out=a[:, 2 * H : 3 * H])
            i, f, g, o = a.chunk(4, 1)
            c_new = torch.mul(f, c) if keep is not None else torch.mul(f, c, out=self.c[t])
            c_new.addcmul_(i, g)
            tc = torch.tanh(c_new, out=self.tanh_c[t])
            if self.w_hr is None:
                h_new = torch.mul(o, tc, out=out[t] if keep is None else None)
            else:
                torch.mul(o, tc, out=self.proj_in[t])
                h_new = torch.mm(self.proj_in[t], self.w_hr.T, out=out[t] if keep is None else None)
            if keep is None:
                c, h = c_new, h_new
            else:
                c = torch.where(keep[t], c_new, c, out=self.c[t])
                h = torch.where(keep[t], h_new, h, out=out[t])
        self.out = out
        return out, h, c

    def _gru(self, x, keep, h, _):
        H = self.hidden
        pre = self._pre_ih(x, self.b_ih)  # [T, B, 3H]
        self.act = act = torch.empty_like(pre)  # r, z, n
        self.hh = hh = torch.empty_like(pre)  # h W_hhᵀ + b_hh
        out = torch.empty_like(pre[..., :H])
        w_hh = self.w_hh.T
        for t in range(x.shape[0]):
            if self.b_hh is None:
                torch.mm(h, w_hh, out=hh[t])
            else:
                torch.addmm(self.b_hh, h, w_hh, out=hh[t])
            rz, n = act[t, :, : 2 * H], act[t, :, 2 * H :]
            torch.add(pre[t, :, : 2 * H], hh[t, :, : 2 * H], out=rz).sigmoid_()
            torch.addcmul(pre[t, :, 2 * H :], rz[:, :H], hh[t, :, 2 * H :], out=n).tanh_()
            z = rz[:, H:]
            if keep is None:
                h = torch.lerp(n, h, z, out=out[t])  # (1 - z) n + z h
            else:
                h = torch.where(keep[t], torch.lerp(n, h, z), h, out=out[t])
        self.out = out
        return out, h, None

    # -- backward --------------------------------------------------------------------------

    def backward(self, d_out: Tensor, d_hn: Tensor, d_cn: Tensor | None, need_dx: bool):
        """``d_out`` ``[T, B, P]`` (zero past each sequence's end), ``d_hn`` ``[B, P]``,
        ``d_cn`` ``[B, H]`` (LSTM): the gradients of the outputs. Returns ``(pairs, d_x)``:
        ``pairs`` maps each parameter name to ``(a, g)``, time-major; ``d_x`` ``[T, B, in]``
        (``None`` unless ``need_dx``)."""
        h_prev = _shift(self.h0, self.out)  # [T, B, P]
        m = None if self.keep is None else self.keep.to(d_out.dtype)
        if self.mode == "LSTM" and m is None and not _transformed(d_out, d_hn, d_cn):
            g_ih, g_hh, extra = self._lstm_back_fast(d_out, d_hn, d_cn)
        elif self.mode == "LSTM":
            g_ih, g_hh, extra = self._lstm_back(d_out, d_hn, d_cn, m)
        elif self.mode == "GRU":
            g_ih, g_hh, extra = self._gru_back(d_out, d_hn, m, h_prev)
        else:
            g_ih, g_hh, extra = self._rnn_back(d_out, d_hn, m)
        s = self.sfx
        pairs = {"weight_ih" + s: (self.x, g_ih), "weight_hh" + s: (h_prev, g_hh), **extra}
        if self.b_ih is not None:
            pairs["bias_ih" + s], pairs["bias_hh" + s] = (None, g_ih), (None, g_hh)
        d_x = None
        if need_dx:  # (one 2-d matmul: g_ih may be a strided view, which it reads in place)
            flat = torch.mm(g_ih.reshape(-1, g_ih.shape[-1]), self.w_ih)
            d_x = flat.view(*g_ih.shape[:2], self.w_ih.shape[1])
        return pairs, d_x

    def _through_time(self, d_out, d_h, m, step) -> Tensor:
        """The backward recurrence. ``step(t, d_h)`` takes the gradient of the state after step
        ``t`` and returns ``(d_pre_hh [B, gates * H], d_h_direct)``: the gradient of step
        ``t``'s ``h W_hhᵀ + b_hh``, and that of ``h_{t-1}`` other than through ``W_hh`` (or
        ``None``); this adds ``d_out[t - 1]``, the matmul with ``W_hh`` and, at skipped steps,
        the state carried over. Returns every step's ``d_pre_hh``, ``[T, B, gates * H]``.

        Written without ``out=`` or in-place writes into buffers: the Jacobians run it under
        ``vmap`` over the output-gradients."""
        d_h = d_out[-1] + d_h
        skip = None if m is None else 1 - m
        d_pre = []
        for t in range(d_out.shape[0] - 1, -1, -1):
            d_pre_t, direct = step(t, d_h)
            d_pre.append(d_pre_t)
            nxt = direct if t == 0 else d_out[t - 1] if direct is None else direct + d_out[t - 1]
            if m is not None:
                nxt = d_h * skip[t] if nxt is None else torch.addcmul(nxt, d_h, skip[t])
            # (at t = 0, the initial state's: d h0)
            d_h = d_pre_t @ self.w_hh if nxt is None else torch.addmm(nxt, d_pre_t, self.w_hh)
        if self.mode != "LSTM":  # (an LSTM's d h0 and d c0: its fast path's, _lstm_back_fast)
            self.d_state0 = (d_h, None)
        return torch.stack(d_pre[::-1])

    def _rnn_back(self, d_out, d_hn, m):
        h = self.h_new
        slope = _one_minus_sq(h) if self.mode == "RNN_TANH" else (h > 0).to(h.dtype)
        if m is not None:
            slope.mul_(m)
        g = self._through_time(d_out, d_hn, m, lambda t, d_h: (d_h * slope[t], None))
        return g, g, {}

    def _lstm_back(self, d_out, d_hn, d_cn, m):
        H = self.hidden
        i, f, g, o = self.act.chunk(4, -1)
        tc, c = self.tanh_c, self.c
        # d c_t (new) = d c_t (carried) + d h_t o (1 - tanh² c_t)
        to_c = _one_minus_sq(tc).mul_(o)
        # d (i, f, g, o)_pre = (d c_t, d c_t, d c_t, d h_t) *
        #     (g i (1 - i), c_{t-1} f (1 - f), i (1 - g²), tanh(c_t) o (1 - o)): [T, B, 4, H]
        to_pre = self.act.new_empty(*tc.shape[:2], 4, H)
        to_i, to_f, to_g, to_o = to_pre.unbind(-2)
        torch.mul(_one_minus(i).mul_(i), g, out=to_i)
        torch.mul(_one_minus(f).mul_(f), _shift(self.c0, c), out=to_f)
        torch.mul(_one_minus_sq(g), i, out=to_g)
        torch.mul(_one_minus(o).mul_(o), tc, out=to_o)
        forget = f
        if m is not None:
            to_c, to_pre = to_c.mul_(m), to_pre.mul_(m[..., None])
            forget = torch.where(self.keep, f, 1.0)
        batch = d_out.shape[1]
        d_hs = []  # the gradients of the (projected) states, for weight_hr
        d_c = [torch.zeros_like(tc[0]) if d_cn is None else d_cn]

        def step(t, d_h):
            if self.w_hr is not None:
                d_hs.append(d_h)
                d_h = d_h @ self.w_hr
            d_c_new = torch.addcmul(d_c[0], d_h, to_c[t])
            d_pre_t = torch.stack([d_c_new, d_c_new, d_c_new, d_h], 1).mul_(to_pre[t])
            d_c[0] = d_c_new * forget[t]
            return d_pre_t.view(batch, 4 * H), None

        d_pre = self._through_time(d_out, d_hn, m, step)
        extra = {}
        if self.w_hr is not None:
            d_hs = torch.stack(d_hs[::-1])
            extra["weight_hr" + self.sfx] = (self.proj_in, d_hs if m is None else d_hs * m)
        return d_pre, d_pre, extra

    def _lstm_back_fast(self, d_out, d_hn, d_cn):
        """:meth:`_lstm_back` when every step is valid: three ops per step (four with
        ``proj_size``), written into preallocated buffers. The gradients at step ``t``:
        ``d h_t = d_out[t] + d G_{t+1} W_hh``, ``d (o tanh c_t) = d h_t`` (``d h_t W_hr`` with a
        projection), ``d c_t = d c_{t+1} f_{t+1} + d (o tanh c_t) o (1 - tanh² c_t)`` and
        ``(d c_t f_t, d G_t) = (d c_t, d c_t, d c_t, d c_t, d (o tanh c_t)) * (f, i (1 - i) g,
        f (1 - f) c_{t-1}, (1 - g²) i, o (1 - o) tanh c_t)``: one ``[batch, 5, H]`` product whose
        first slot is the cell gradient carried to the step before and the other four the gate
        gradients ``i, f, g, o``. Uses ``out=``, so not under ``vmap`` (the Jacobians use
        :meth:`_lstm_back`)."""
        H = self.hidden
        steps, batch = d_out.shape[:2]
        # [T, B, 5, H]: slot 0 free, then the gates i, f, g, o (:meth:`_gate_buffer`). Each
        # slot becomes the factor that step's cell (or, for o, state) gradient multiplies: f
        # (slot 0, the cell gradient carried back), i (1 - i) g, f (1 - f) c_{t-1},
        # (1 - g²) i, o (1 - o) tanh c_t, written in an order that reads each gate before it
        # is overwritten, with the cell states' buffer as the scratch.
        to_pre = self.slots.view(steps, batch, 5, H)
        _, i, f, g, o = to_pre.unbind(2)
        tc, scratch = self.tanh_c, self.c
        to_pre[:, :, 0] = f
        torch.addcmul(f, f, f, value=-1, out=f)
        f[1:] *= scratch[:-1]
        f[0] *= self.c0
        torch.addcmul(g.new_ones(()), g, g, value=-1, out=scratch).mul_(i)  # (1 - g²) i
        torch.addcmul(i, i, i, value=-1, out=i).mul_(g)
        g.copy_(scratch)
        to_c = torch.addcmul(tc.new_ones(()), tc, tc, value=-1, out=scratch).mul_(o)
        torch.addcmul(o, o, o, value=-1, out=o).mul_(tc)
        to_c = to_c[:, :, None]  # [T, B, 1, H]: d c_t (new) = d c_t (carried) + d h_t to_c
        # The gates are factors now, the cell states scratch: not read again
        self.act = self.c = self.tanh_c = self.slots = None
        del i, f, g, o, tc
        # [T, B, 5, H]: d c_t f_t, d G_t (i, f, g, o), written over to_pre (step t's product
        # replaces the factors only step t reads)
        grads = to_pre
        d_pre = grads.view(steps, batch, 5 * H)[..., H:]  # [T, B, 4H] (rows 5H apart)
        state = to_pre.new_empty(batch, 5, H)  # d c_t four times, d (o tanh c_t)
        d_proj = state[:, 4]
        d_hs = None if self.w_hr is None else d_out.new_empty(d_out.shape)  # d h_t, [T, B, P]
        # views made once: the loop's cost is mostly per-op overhead
        outs, to_cs, to_pres = d_out.unbind(0), to_c.unbind(0), to_pre.unbind(0)
        d_pres, gs = d_pre.unbind(0), grads.unbind(0)
        carries = grads[:, :, :1].expand(-1, -1, 4, -1).unbind(0)  # d c_{t+1} f_{t+1}
        targets = [d_proj] * steps if d_hs is None else d_hs.unbind(0)
        carry = (to_pre.new_zeros(batch, H) if d_cn is None else d_cn)[:, None].expand(-1, 4, -1)
        d_dc, d_o_tanh_c = state[:, :4], state[:, 4:]
        d_h = torch.add(outs[-1], d_hn, out=targets[-1])
        for t in range(steps - 1, -1, -1):
            if t < steps - 1:
                d_h = torch.addmm(outs[t], d_pres[t + 1], self.w_hh, out=targets[t])
                carry = carries[t + 1]
            if d_hs is not None:
                torch.mm(d_h, self.w_hr, out=d_proj)
            torch.addcmul(carry, d_o_tanh_c, to_cs[t], out=d_dc)
            torch.mul(state, to_pres[t], out=gs[t])
        self.d_state0 = (d_pre[0] @ self.w_hh, grads[0, :, 0])  # c_0 = f_0 c0 + i_0 g_0
        extra = {}
        if d_hs is not None:
            extra["weight_hr" + self.sfx] = (self.proj_in, d_hs)
        return d_pre, d_pre, extra

    def _gru_back(self, d_out, d_hn, m, h_prev):
        H = self.hidden
        r, z, n = self.act.chunk(3, -1)
        hh_n = self.hh[..., 2 * H :]
        # h = (1 - z) n + z h_prev: d n_pre = d h (1 - z)(1 - n²); d z_pre = d h (h_prev - n) z (1 - z);
        # d (W_hn h + b_hn) = d n_pre r; d r_pre = d n_pre (W_hn h + b_hn) r (1 - r)
        to_n = _one_minus_sq(n).mul_(_one_minus(z))
        to_hh = self.act.new_empty(*n.shape[:2], 3, H)  # [T, B, 3, H]
        to_r, to_z, to_hn = to_hh.unbind(-2)
        torch.mul(to_n, r, out=to_hn)
        torch.mul(to_hn, hh_n, out=to_r).mul_(_one_minus(r))
        torch.sub(h_prev, n, out=to_z).mul_(z).mul_(_one_minus(z))
        carry = z
        if m is not None:
            to_n, to_hh = to_n.mul_(m), to_hh.mul_(m[..., None])
            carry = torch.where(self.keep, z, 0.0)  # the skipped steps' carry is added apart
        batch = d_out.shape[1]
        d_hs = []

        def step(t, d_h):
            d_hs.append(d_h)
            return (d_h[:, None] * to_hh[t]).view(batch, 3 * H), d_h * carry[t]

        g_hh = self._through_time(d_out, d_hn, m, step)
        g_ih = torch.cat([g_hh[..., : 2 * H], torch.stack(d_hs[::-1]) * to_n], -1)
        return g_ih, g_hh, {}


def _lstm_layer(
    module: nn.RNNBase, weight: Callable[[str], Tensor], layer: int, x: Tensor, h0: Tensor,
    c0: Tensor,
) -> Tensor | None:  # fmt: skip
    """torch's own (fused) forward of one layer of an LSTM, both directions, without autograd:
    ``x`` ``[T, B, in]``, ``h0`` ``[dirs, B, P]``, ``c0`` ``[dirs, B, H]`` -> the layer's
    output ``[T, B, dirs * P]``; ``None`` where torch's fused LSTM is not reachable
    (:func:`gradhooks._torch.fused_lstm`). ``weight(name)``: the parameter the call ran with."""
    lstm = _torch.fused_lstm()
    if lstm is None:
        return None
    names = ["weight_ih", "weight_hh"]
    names += ["bias_ih", "bias_hh"] if module.bias else []
    names += ["weight_hr"] if module.proj_size > 0 else []
    sfxs = [f"_l{layer}", f"_l{layer}_reverse"][: 2 if module.bidirectional else 1]
    weights = [weight(n + s).detach() for s in sfxs for n in names]
    out, _, _ = lstm(  # (input, hx, weights, bias, layers, dropout, train, bidir, batch_first)
        x, (h0, c0), weights, module.bias, 1, 0.0, False, module.bidirectional, False
    )
    return out


class _LayerOutputs(TorchFunctionMode):
    """The ``record`` of an ``nn.LSTM`` call run with grad mode off (:func:`_owns_backward`).
    torch's fused multi-layer LSTM (:func:`gradhooks._torch.fused_lstm`) runs one layer at a
    time (the same kernel and the same floats), and the outputs of every layer but the last,
    time-major ``[T, B, dirs * P]``, are kept in ``outputs``, so that :func:`recompute` need
    not run the lower layers again. Each layer runs with grad mode on and nothing requiring
    grad (no graph is made): the form torch runs under autograd, so that the call's outputs
    are, bit for bit, the module's without hooks (torch's oneDNN kernel, float32 on CPU, runs
    another form with grad mode off, a rounding apart). Any other call passes through
    unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[Tensor] | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (
            func is _torch.fused_lstm()
            and self.outputs is None
            and not kwargs
            and len(args) == 9
            and not torch.is_grad_enabled()
        ):
            x, hx, params, has_biases, layers, dropout, train, bidirectional, batch_first = args
            if isinstance(hx, (tuple, list)) and not (train and dropout > 0 and layers > 1):
                out = self._by_layer(
                    func, x, hx, params, has_biases, layers, train, bidirectional, batch_first
                )
                note(func, args, kwargs, out)  # (the batch's layout, as torch's call gives it)
                return out
        return func(*args, **kwargs)

    def _by_layer(self, lstm, x, hx, params, has_biases, layers, train, bidirectional, batch_first):
        dirs = 2 if bidirectional else 1
        per = len(params) // layers
        params = [p.detach() for p in params]
        h0, c0 = (t.detach() for t in hx)
        layer_in = x.detach().transpose(0, 1) if batch_first else x.detach()  # (as torch does)
        self.outputs, h_n, c_n = [], [], []
        with torch.enable_grad():  # (nothing requires grad: no graph)
            for k in range(layers):
                ks = slice(k * dirs, (k + 1) * dirs)
                layer_in, h, c = lstm(
                    layer_in, (h0[ks], c0[ks]), params[k * per : (k + 1) * per], has_biases, 1,
                    0.0, train, bidirectional, False,
                )  # fmt: skip
                h_n.append(h)
                c_n.append(c)
                if k < layers - 1:
                    self.outputs.append(layer_in)
        out = layer_in.transpose(0, 1) if batch_first else layer_in
        return out, torch.cat(h_n), torch.cat(c_n)


def _record_layers(module: nn.LSTM) -> AbstractContextManager:
    """``nn.LSTM``'s ``owns_backward``: :class:`_LayerOutputs`, a recording."""
    return _LayerOutputs()


def recompute(
    module: nn.RNNBase,
    x: Tensor,
    lengths: Tensor,
    hx=None,
    output: Tensor | None = None,
    fast: bool = True,
    lower: list[Tensor] | None = None,
    weight: Callable[[str], Tensor] | None = None,
) -> tuple[tuple[Tensor, ...], list[list[_Direction]]]:
    """Re-run ``module`` without autograd on a batch-first padded ``x`` ``[batch, time, in]``
    with per-example ``lengths`` ``[batch]`` and an optional initial state (torch's layout,
    ``[layers * dirs, batch, hidden]``).

    An LSTM whose every sequence is full length (and ``fast``) takes a faster way: torch's own
    fused forward gives each layer's states (``output`` ``[batch, time, dirs * hidden_out]``,
    the module's output if given, is the last layer's; ``lower``, the earlier layers'
    time-major outputs if the forward kept them, :class:`_LayerOutputs`), then
    :meth:`_Direction.forward_lstm_from` the gates and cell states with no recurrence over
    ``h``. Otherwise the recurrence is run step by step. ``weight(name)``: the parameter the
    call ran with (:meth:`Call.parameter`; by default the module's own).

    Returns ``(outputs, layers)``: ``outputs`` = ``(output [batch, time, dirs * hidden_out],
    h_n [layers * dirs, batch, hidden_out][, c_n])``, the output zero past each length;
    ``layers[k][d]`` the :class:`_Direction` of layer ``k`` and direction ``d``, holding what
    :func:`backpropagate` needs.
    """
    lstm = module.mode == "LSTM"
    dirs = 2 if module.bidirectional else 1
    batch, time = x.shape[:2]
    h_size = module.proj_size or module.hidden_size
    # in the parameters' dtype: under autocast the call ran in a lower precision, and its
    # outputs (the states read below) are in that one
    if weight is None:
        weight = partial(getattr, module)
    dtype = weight("weight_ih_l0").dtype
    x = x.to(dtype)
    if output is not None:
        output = output.to(dtype)
    if lower is not None:
        lower = [t.to(dtype) for t in lower]
    with torch.no_grad():
        if hx is None:
            h0 = x.new_zeros(module.num_layers * dirs, batch, h_size)
            c0 = x.new_zeros(module.num_layers * dirs, batch, module.hidden_size)
        else:
            h0, c0 = (t.detach().to(dtype) for t in hx) if lstm else (hx.detach().to(dtype), None)
        lengths = lengths.to(x.device)
        keep = None
        if bool((lengths < time).any()):
            keep = (torch.arange(time, device=x.device)[:, None] < lengths[None, :])[..., None]
        layer_in = rearrange(x.detach(), "batch time inp -> time batch inp").contiguous()
        layers: list[list[_Direction]] = []
        h_n, c_n = [], []
        fast = fast and lstm and keep is None
        for layer in range(module.num_layers):
            outs, layers_d = [], []
            states = None  # the layer's output, where torch's fused run gives it
            if fast:
                ks = slice(layer * dirs, (layer + 1) * dirs)
                if layer == module.num_layers - 1 and output is not None:
                    states = rearrange(output.detach(), "batch time out -> time batch out")
                elif lower is not None and layer < len(lower):
                    states = lower[layer]
                else:
                    states = _lstm_layer(module, weight, layer, layer_in, h0[ks], c0[ks])
            for d in range(dirs):
                k = layer * dirs + d
                run = _Direction(module, f"_l{layer}" + ("_reverse" if d else ""), weight)
                flip = (lambda t: t.flip(0)) if d else (lambda t: t)
                if states is not None:
                    own = states[..., d * h_size : (d + 1) * h_size] if dirs > 1 else states
                    out, h, c = run.forward_lstm_from(flip(layer_in), flip(own), h0[k], c0[k])
                    outs.append(flip(out))
                    h_n.append(h)
                    c_n.append(c)
                    layers_d.append(run)
                    continue
                out, h, c = run.forward(
                    flip(layer_in),
                    None if keep is None else flip(keep),
                    h0[k],
                    c0[k] if lstm else None,
                )
                outs.append(flip(out))
                h_n.append(h)
                c_n.append(c)
                layers_d.append(run)
            layers.append(layers_d)
            layer_in = (
                states if states is not None else torch.cat(outs, -1) if dirs > 1 else outs[0]
            )
            if keep is not None:
                layer_in = layer_in * keep
        outputs = (rearrange(layer_in, "time batch out -> batch time out"), torch.stack(h_n))
        if lstm:
            outputs = (*outputs, torch.stack(c_n))
    return outputs, layers


def backpropagate(
    module: nn.RNNBase,
    layers: list[list[_Direction]],
    grads: tuple[Tensor | None, ...],
    inputs: list[Tensor] | None = None,
) -> dict[str, Outer]:
    """The backward through time of a :func:`recompute`, from ``grads`` (for ``output``
    batch-first ``[batch, time, dirs * hidden_out]``, ``h_n`` and ``c_n`` in torch's layout;
    ``None`` where no gradient flowed): one :class:`Outer` per parameter. ``inputs``: a list
    to fill, where every direction took the LSTM's fast path, with the gradients of the input
    (batch-first ``[batch, time, in]``), of ``h0`` and of ``c0`` (torch's layout)."""
    dirs = 2 if module.bidirectional else 1
    first = layers[0][0]
    keep = first.keep
    steps, batch = first.x.shape[:2]
    h_size = module.proj_size or module.hidden_size
    like = first.out
    pieces: dict[str, Outer] = {}
    d_h0: list[Tensor] = []
    d_c0: list[Tensor] = []
    with torch.no_grad():
        # (in the recompute's dtype: under autocast the output-gradients are in a lower one)
        g_out, g_h, g_c = (None if g is None else g.to(like.dtype) for g in (*grads, None)[:3])
        if g_out is None:
            d_out = like.new_zeros(steps, batch, dirs * h_size)
        else:
            d_out = rearrange(g_out.detach(), "batch time out -> time batch out")
            if keep is not None:
                d_out = d_out * keep
        for layer in range(module.num_layers - 1, -1, -1):
            d_x = None
            for d, run in enumerate(layers[layer]):
                k = layer * dirs + d
                flip = (lambda t: t.flip(0)) if d else (lambda t: t)
                d_o = d_out[..., d * h_size : (d + 1) * h_size] if dirs > 1 else d_out
                d_hn = like.new_zeros(batch, h_size) if g_h is None else g_h[k].detach()
                d_cn = None if g_c is None else g_c[k].detach()
                want_dx = layer > 0 or inputs is not None
                pairs, dx_d = run.backward(flip(d_o), d_hn, d_cn, need_dx=want_dx)
                d_h0.insert(d, run.d_state0[0])
                d_c0.insert(d, run.d_state0[1])
                summed: dict[int, Tensor] = {}  # id(g) -> Σ_t g [batch, 1, n]
                # the steps each example ran (a packed batch's shorter sequences skip the rest,
                # whose g is zero: K-FAC counts only those run)
                ran = None if run.keep is None else run.keep[..., 0].T  # [batch, time]
                for name, (a, g) in pairs.items():
                    if a is None:  # a bias: Σ_t g once, shared by b_ih and b_hh where g is
                        if id(g) not in summed:
                            summed[id(g)] = g.sum(0)[:, None]
                        pieces[name] = Outer(None, summed[id(g)])
                        continue
                    pieces[name] = Outer(
                        rearrange(a, "time batch n -> batch time n"),
                        rearrange(g, "time batch n -> batch time n"),
                        ran,
                    )
                if want_dx:
                    d_x = flip(dx_d) if d_x is None else d_x + flip(dx_d)
            if layer > 0:
                d_out = d_x if keep is None else d_x * keep
        if inputs is not None and all(s is not None for s in d_h0):
            d_x = rearrange(d_x, "time batch inp -> batch time inp")
            lstm = module.mode == "LSTM"
            inputs.extend([d_x, torch.stack(d_h0), torch.stack(d_c0) if lstm else None])
    return pieces


def _example_by_example(
    module: nn.RNNBase, weight: Callable[[str], Tensor], x: Tensor, lengths: Tensor, hx,
    grads: tuple[Tensor | None, ...],
) -> dict[str, Direct]:  # fmt: skip
    """The pieces of a call in a ``create_graph`` backward that the fallback cannot split into
    examples (a ``PackedSequence``, a time-major input, an initial state): each example's
    gradients by autograd, with their graph, through the module's forward run again on that
    example alone (its own length, its own column of the initial state). ``x``: batch-first
    padded ``[batch, time, in]`` with ``lengths`` ``[batch]``; ``grads``: the output's gradient
    batch-first, then ``h_n``'s (and ``c_n``'s) in torch's layout, as for :func:`backpropagate`.
    A forward and a backward per example: slower than the backward through time, and only
    taken in this mode, whose derivatives that backward could not give."""
    named = {n: weight(n) for n, p in module.named_parameters() if p.requires_grad}
    lstm = module.mode == "LSTM"
    g_out, g_h, g_c = (*grads, None)[:3]

    def one(b: int) -> tuple[Tensor | None, ...]:
        steps = int(lengths[b])
        xb = x[b : b + 1, :steps]
        if not module.batch_first:
            xb = xb.transpose(0, 1)
        state = None
        if hx is not None:
            state = tuple(t[:, b : b + 1].contiguous() for t in hx) if lstm else hx[:, b : b + 1]
        g_b = None if g_out is None else g_out[b : b + 1, :steps]
        if g_b is not None and not module.batch_first:
            g_b = g_b.transpose(0, 1)
        # An alias of each parameter (as the fallback's loop): the gradient is taken through
        # this rerun only, not through an input computed from the same parameter; and paused,
        # the rerun and its backward are not ones the hooks capture or account for
        aliases = {n: p.view_as(p) for n, p in named.items()}
        with paused():
            out, h_n = functional_call(module, aliases, (xb, state))
            found = [(out, g_b)]
            if lstm:
                h_n, c_n = h_n
                found.append((c_n, None if g_c is None else g_c[:, b : b + 1]))
            found.append((h_n, None if g_h is None else g_h[:, b : b + 1]))
            found = [(t, g) for t, g in found if g is not None]
            if not found:
                return (None,) * len(aliases)
            outs, gs = zip(*found)
            return torch.autograd.grad(
                outs, list(aliases.values()), gs, create_graph=True, allow_unused=True
            )

    grads = per_example(x.shape[0], one, like=list(named.values()))
    return {name: Direct(g) for name, g in zip(named, grads)}


def _fallback_splits(call: Call) -> bool:
    """Whether the fallback, which takes dimension 0 of every tensor input as the batch, can
    split the call into examples: a padded ``batch_first`` input and no initial state (whose
    batch is on dimension 1)."""
    return (
        call.module.batch_first
        and len(call.inputs) == 1
        and not call.kwargs
        and isinstance(call.inputs[0], Tensor)
    )


def _error(kind: type[ValueError], call: Call, what: str, todo: str) -> ValueError:
    return _named_error(kind, call.module, call.name, what, todo)


def _named_error(
    kind: type[ValueError], m: nn.RNNBase, name: str | None, what: str, todo: str
) -> ValueError:
    return kind(f"'{name or '<model>'}' ({type(m).__qualname__}, {m.mode}): {what}; {todo}")


def refuse_dropout(module: nn.RNNBase, name: str | None, training: bool | None = None) -> None:
    """At the forward (and again in the rule, with ``training`` the mode the call ran in):
    dropout between layers in training mode draws a mask inside torch's kernel, which the rule
    cannot replay."""
    training = module.training if training is None else training
    if training and module.dropout > 0 and module.num_layers > 1:
        raise _named_error(
            ConfigurationError,
            module,
            name,
            f"dropout={module.dropout} between layers in training mode draws a mask that "
            "gradhooks cannot see, so per-example gradients cannot be recomputed",
            "set dropout=0, call model.eval(), or apply nn.Dropout between single-layer RNNs",
        )


def rnn(call: Call) -> dict[str, Outer]:
    module: nn.RNNBase = call.module
    x, hx = call.inputs[0], _initial_state(call)
    refuse_dropout(module, call.name, call.training)
    packed = isinstance(x, PackedSequence)
    if torch.is_grad_enabled() and _fallback_splits(call) and not _transformed(call.grad_outputs):
        # A create_graph backward: the backward through time below has no graph, so the
        # per-example gradients come from torch.func (the fallback), which keeps it.
        return fallback(call)  # type: ignore[return-value]
    given = x  # as passed
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
                UnbatchedInputError,
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
    if torch.is_grad_enabled() and not _transformed(grads):
        # A create_graph backward the fallback cannot split into examples
        return _example_by_example(module, call.parameter, x_pad, lengths, hx, grads)
    device = x_pad.device.type
    half = any(d == device and half_precision(t) for d, t in call.autocast)
    output = lower = None
    # (an LSTM's states as its forward computed them, but where that ran under a half
    # precision's autocast: then in the parameters' dtype, by torch's fused forward again, so
    # that this rule computes in that one precision from the call's inputs, as the run-time
    # check's reference of a call it owns does: gradhooks.engine.capture._rerun_as_rule)
    if not half:
        lower = getattr(call.recorded, "outputs", None)
        if not packed and call.output is not None:
            output = call.output[0]
            output = output if module.batch_first else rearrange(output, "t b o -> b t o")
    found: list[Tensor] | None = None if call.input_grads is None else []
    # in the parameters' dtype, also where the backward runs under autocast
    with torch.autocast(device, enabled=False):
        _, layers = recompute(module, x_pad, lengths, hx, output, lower=lower,
                              weight=call.parameter)  # fmt: skip
        pieces = backpropagate(module, layers, grads, found)
    if call.input_grads is None and half:
        # autograd's own backward of the call (on a PackedSequence: not this rule's, see
        # _owns_backward, whose calls are checked in the parameters' dtype instead) ran under
        # the forward's autocast: torch's RNN and GRU round each time step's share of the
        # parameters' gradients to its precision, and its backward through time takes the
        # gates' derivatives (1 - h², σ(1 - σ)) from states rounded at the forward, far off
        # relative to themselves where a state saturates, against the float32 recomputation
        # here: a rounding per step and 16 units more (pieces.Piece.rounded_terms). The states,
        # the inputs of the recurrent weights and of the layers above the first, were rounded
        # as the gate pre-activations they come from were (through tanh and sigmoids, slopes
        # at most 1): a state near 0 by cancellation is off by a rounding of those terms, of
        # the order of 1, not of its own value (pieces.Piece.input_scale). Measured (RNN, GRU,
        # LSTM, 1 and 2 layers, hidden 1 and 3, bfloat16), the largest difference from .grad:
        # up to 9.4 units of the terms' scale (Piece.terms_scale) at 4 steps, 3.7 at 16, 19 at
        # 64 (allowed: 20, 32, 80), where it was up to 46, 15 and 1761 units of the gradient's
        # own largest entry (biases and hidden weights whose terms cancel, states near 0).
        for name, piece in pieces.items():
            if piece is not None:
                piece.rounded_terms = x_pad.shape[1] + 16
                if not name.startswith(("weight_ih_l0", "bias")):
                    piece.input_scale = 1.0
    if found:  # the call ran without autograd (_owns_backward): the inputs' gradients too
        d_x, d_h0, d_c0 = found
        if not module.batch_first:
            d_x = rearrange(d_x, "batch time inp -> time batch inp")
        by_id = {id(given): d_x}
        if isinstance(hx, (tuple, list)):
            by_id.update({id(hx[0]): d_h0, id(hx[1]): d_c0})
        elif hx is not None:
            by_id[id(hx)] = d_h0
        leaves = tree_flatten((call.inputs, call.kwargs))[0]
        call.input_grads.extend(by_id.get(id(t)) for t in leaves)
    return pieces


def _owns_backward(module: nn.RNNBase, args: tuple) -> bool:
    """Whether an RNN, GRU or LSTM call runs without autograd, its rule giving the parameters'
    batch gradients and the input-gradients (the backward through time, run anyway for the
    per-example gradients, replaces torch's): a padded ``[batch, time, in]`` or
    ``[time, batch, in]`` input, and no dropout between layers. Its gradients are then the
    rule's alone, computed in the parameters' dtype also under autocast, and the run-time
    check's reference of the call is autograd's in that dtype too."""
    x = args[0] if args else None
    return (
        isinstance(x, Tensor)
        and x.dim() == 3
        and not (module.training and module.dropout > 0 and module.num_layers > 1)
    )


register(
    nn.RNN, nn.GRU, grad_from_grad1=_owns_backward, owns_backward=True, batch_dim=batch_first,
    on_forward=refuse_dropout,
)(rnn)  # fmt: skip
# needs_output: the last layer's states are not recomputed
register(
    nn.LSTM, needs_output=True, grad_from_grad1=_owns_backward, owns_backward=_record_layers,
    batch_dim=batch_first, on_forward=refuse_dropout,
)(rnn)  # fmt: skip

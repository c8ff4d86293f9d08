"""nn.RNN / nn.LSTM / nn.GRU over a sweep of every option (hypothesis), packed sequences, errors.

The oracles slice and vmap inputs on dimension 0, so the RNN is wrapped in :class:`BatchFirst`,
which takes and returns batch-first tensors and hands the RNN its own layout (time-major when
``batch_first=False``, hidden states ``[layers * dirs, batch, hidden]``).
"""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import gradhooks
from gradhooks.oracle import loop_grad, vmap_grad
from gradhooks.rules.rnn import _Direction, backpropagate, recompute
from harness import Case, _double, assert_close, check, run_hooked

TYPES = {
    "tanh": lambda *a, **k: nn.RNN(*a, nonlinearity="tanh", **k),
    "relu": lambda *a, **k: nn.RNN(*a, nonlinearity="relu", **k),
    "lstm": nn.LSTM,
    "gru": nn.GRU,
}


class BatchFirst(nn.Module):
    """``forward(x [batch, time, in], [lengths,] [h0[, c0]])``, ``h0``/``c0`` ``[batch, layers *
    dirs, hidden]``; returns ``(output [batch, time, dirs * hidden_out], h_n [batch, layers *
    dirs, hidden_out][, c_n])``. With ``packed``, ``lengths`` (int64 ``[batch]``) packs the
    input (``enforce_sorted`` as given) and the output is padded back."""

    def __init__(self, rnn: nn.RNNBase, hx_as_kwarg=False, packed=False, enforce_sorted=False):
        super().__init__()
        self.rnn, self.hx_as_kwarg = rnn, hx_as_kwarg
        self.packed, self.enforce_sorted = packed, enforce_sorted

    def forward(self, x, *rest):
        rnn = self.rnn
        time = x.shape[1]
        x = x if rnn.batch_first else x.transpose(0, 1)
        if self.packed:
            lengths, *rest = rest
            x = pack_padded_sequence(
                x, lengths, batch_first=rnn.batch_first, enforce_sorted=self.enforce_sorted
            )
        hx = tuple(h.transpose(0, 1).contiguous() for h in rest)
        hx = None if not hx else hx if len(hx) == 2 else hx[0]
        out, h = rnn(x, hx=hx) if self.hx_as_kwarg else rnn(x, hx)
        if self.packed:
            out, _ = pad_packed_sequence(out, batch_first=rnn.batch_first, total_length=time)
        out = out if rnn.batch_first else out.transpose(0, 1)
        hs = h if isinstance(h, tuple) else (h,)
        return (out, *(t.transpose(0, 1) for t in hs))


def _loss(which: str):
    """Sum-reduced losses that reach all outputs, only the sequence output, or only h_n."""

    def loss(out, target=None):
        parts = {"all": out, "output": out[:1], "last": out[1:2]}[which]
        return sum(0.5 * (t**2).sum() + t.sum() for t in parts)

    return loss


@st.composite
def rnn_cases(draw, packed: bool = False):
    kind = draw(st.sampled_from(sorted(TYPES)))
    layers = draw(st.integers(1, 3))
    bidirectional = draw(st.booleans())
    proj = draw(st.sampled_from([0, 0, 1, 2])) if kind == "lstm" else 0
    hidden = draw(st.integers(max(1, proj + 1), 3))
    in_size = draw(st.integers(1, 3))
    time = draw(st.integers(1, 4))
    kwargs = dict(
        num_layers=layers,
        bidirectional=bidirectional,
        batch_first=draw(st.booleans()),
        bias=draw(st.booleans()),
        dropout=draw(st.sampled_from([0.0, 0.5])) if layers > 1 else 0.0,
    )
    if proj:
        kwargs["proj_size"] = proj
    h0 = draw(st.sampled_from(["none", "positional", "kwarg"]))
    enforce_sorted = draw(st.booleans())
    which = draw(st.sampled_from(["all", "output", "last"]))
    dirs_layers = layers * (2 if bidirectional else 1)
    h_out = proj or hidden

    def model():
        rnn = TYPES[kind](in_size, hidden, **kwargs)
        m = BatchFirst(rnn, h0 == "kwarg", packed, enforce_sorted)
        return m.eval() if kwargs["dropout"] else m  # dropout is only exact in eval mode

    def inputs(b):
        x = torch.randn(b, time, in_size)
        lengths = torch.randint(1, time + 1, (b,))
        if enforce_sorted:
            lengths = lengths.sort(descending=True).values
        state = ()
        if h0 != "none":
            state = (torch.randn(b, dirs_layers, h_out),)
            if kind == "lstm":
                state = (*state, torch.randn(b, dirs_layers, hidden))
        if packed:
            return (x, lengths, *state)
        return (x, *state) if state else x

    return Case(f"{kind}{kwargs} h0={h0} loss={which} T={time}", model, inputs, loss=_loss(which))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@settings(max_examples=12)
@given(case=rnn_cases(), batch=st.sampled_from([0, 1, 3]))
def test_rnn_sweep(case, batch, reduction):
    check(case, batch, reduction)


def check_packed(case: Case, batch: int, reduction: str, seed: int = 0) -> None:
    """:func:`harness.check` for packed inputs. ``vmap`` cannot pack (lengths are data), so the
    ``vmap(grad)`` oracle runs, per group of equal length, the same model on the sequences cut to
    that length without packing (what packing a batch of one means); the loop packs for real."""
    torch.manual_seed(seed)
    model = case.model().double()
    x, lengths, *state = _double(case.inputs(batch))
    want = {n: torch.zeros(batch, *p.shape, dtype=p.dtype) for n, p in model.named_parameters()}
    for length in lengths.unique().tolist():
        idx = (lengths == length).nonzero()[:, 0]
        cut = (x[idx, :length], *(s[idx] for s in state))
        model.packed = False
        for n, g in vmap_grad(model, case.loss, cut).items():
            want[n][idx] = g
        model.packed = True
    loop = loop_grad(model, case.loss, (x, lengths, *state))
    run_hooked(model, case, (x, lengths, *state), None, reduction)
    for name, p in model.named_parameters():
        assert_close(loop[name], want[name], f"{case.id}: loop vs vmap, {name}")
        assert_close(p.grad1, want[name], f"{case.id} ({reduction}, batch {batch}): {name}")
        reduced = p.grad1.mean(0) if reduction == "mean" else p.grad1.sum(0)
        assert_close(reduced, p.grad, f"{case.id}: grad1 reduced vs .grad, {name}")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@settings(max_examples=10)
@given(case=rnn_cases(packed=True), batch=st.sampled_from([1, 4]))
def test_rnn_packed_sweep(case, batch, reduction):
    check_packed(case, batch, reduction)


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_recompute_matches_module(kind):
    """The rule's recomputation gives the module's own output, h_n (and c_n), packed or not."""
    torch.manual_seed(0)
    kw = dict(proj_size=2) if kind == "lstm" else {}
    rnn = TYPES[kind](3, 4, num_layers=2, bidirectional=True, batch_first=True, **kw).double()
    x = torch.randn(5, 6, 3, dtype=torch.float64)
    lengths = torch.tensor([6, 2, 5, 1, 6])
    for ls in (torch.full((5,), 6), lengths):
        packed = pack_padded_sequence(x, ls, batch_first=True, enforce_sorted=False)
        out, h = rnn(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=6)
        got, _ = recompute(rnn, x, ls)
        for g, w in zip(got, (out, *(h if isinstance(h, tuple) else (h,))), strict=True):
            assert_close(g.detach(), w.detach(), f"{kind}: recomputed vs module")


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_check_rule(kind):
    kw = dict(proj_size=1) if kind == "lstm" else {}
    rnn = TYPES[kind](2, 3, num_layers=2, bidirectional=True, batch_first=True, **kw)
    assert gradhooks.check_rule(rnn, torch.randn(3, 4, 2)).ok


def _backward(model: nn.Module, *inputs: Tensor) -> None:
    with gradhooks.add_hooks(model):
        out = model(*inputs)
        out[0].sum().backward()


def test_dropout_in_training_is_an_error():
    model = nn.Sequential()
    model.add_module("enc", nn.LSTM(2, 3, num_layers=2, dropout=0.3))
    with pytest.raises(ValueError, match=r"'enc' \(LSTM.*dropout=0.3.*eval\(\)"):
        _backward(model, torch.randn(4, 2, 2))
    model.eval()  # no dropout: exact
    _backward(model, torch.randn(4, 2, 2))
    assert model.enc.weight_hh_l1.grad1.shape == (2, 12, 3)


def test_unbatched_input_is_an_error():
    with pytest.raises(ValueError, match=r"GRU.*shape \(4, 2\).*batch"):
        _backward(nn.GRU(2, 3), torch.randn(4, 2))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("batch", [0, 1, 3])
@pytest.mark.parametrize("kind", sorted(TYPES))
def test_rnn_every_batch_size(kind, batch, reduction):
    """Two layers, bidirectional, time-major, initial state given: every output reached."""
    proj = dict(proj_size=2) if kind == "lstm" else {}
    layers_dirs, h_out = 4, 2 if kind == "lstm" else 3

    def inputs(b):
        state = (torch.randn(b, layers_dirs, h_out),)
        if kind == "lstm":
            state = (*state, torch.randn(b, layers_dirs, 3))
        return (torch.randn(b, 5, 2), *state)

    case = Case(
        f"{kind} 2 layers bidirectional time-major",
        lambda: BatchFirst(TYPES[kind](2, 3, num_layers=2, bidirectional=True, **proj)),
        inputs,
        loss=_loss("all"),
    )
    check(case, batch, reduction)


class TwoCalls(nn.Module):
    """One GRU run on a sequence and on its reverse: each call adds its share to grad1."""

    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(2, 3, batch_first=True)

    def forward(self, x):
        return self.gru(x)[0] + self.gru(x.flip(1))[0]


class RowsFolded(nn.Module):
    """Sequencer2d's pattern: an RNN over the rows of each image folded into the batch
    (``[batch * rows, width, channels]``), then a Linear on the rows moved to dimension 0
    (``[rows, batch, ...]``), as many rows as examples."""

    def __init__(self, kind, batch_first):
        super().__init__()
        self.batch_first = batch_first
        self.rnn = TYPES[kind](4, 4, batch_first=batch_first)
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(3 * 2 * 4, 5)

    def forward(self, x):  # [batch, rows 3, width 2, channels 4]
        r = x.reshape(-1, 2, 4)
        h = self.rnn(r if self.batch_first else r.transpose(0, 1))[0]
        h = h if self.batch_first else h.transpose(0, 1)
        z = self.fc(h.reshape(x.shape).transpose(0, 1)).transpose(0, 1)
        return self.head(z.reshape(x.shape[0], -1))


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kind", list(TYPES))
def test_rnn_over_rows_folded_into_the_batch(kind, batch_first):
    torch.manual_seed(0)
    model = RowsFolded(kind, batch_first).double()
    x = torch.randn(3, 3, 2, 4, dtype=torch.float64)
    want = loop_grad(model, lambda out: out.pow(2).sum(), x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        model(x).pow(2).sum().backward()
    for name, p in model.named_parameters():
        assert_close(p.grad1, want[name], f"{kind}: {name}")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_module_called_twice(reduction):
    check(Case("gru twice", TwoCalls, lambda b: torch.randn(b, 4, 2)), 3, reduction)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("kind", sorted(TYPES))
def test_packed_every_mode(kind, reduction):
    """Each mode's backward through time with skipped steps (packed, unsorted lengths, both
    directions, two layers, initial state given, every output reached)."""
    proj = dict(proj_size=2) if kind == "lstm" else {}
    h_out = 2 if kind == "lstm" else 3

    def inputs(b):
        state = (torch.randn(b, 4, h_out),)
        if kind == "lstm":
            state = (*state, torch.randn(b, 4, 3))
        return (torch.randn(b, 5, 2), torch.tensor([3, 5, 1, 4])[:b], *state)

    model = lambda: BatchFirst(  # noqa: E731
        TYPES[kind](2, 3, num_layers=2, bidirectional=True, batch_first=True, **proj), packed=True
    )
    check_packed(Case(f"{kind} packed", model, inputs, loss=_loss("all")), 4, reduction)


@pytest.mark.parametrize("enforce_sorted", [True, False])
@pytest.mark.parametrize("kind", sorted(TYPES))
def test_packed_sequences_of_one_step(kind, enforce_sorted):
    """Every sequence of length 1 (``T = 1``): the packed data is ``[batch, in]``, one row per
    example (in the order of their lengths)."""

    def inputs(b):
        return (torch.randn(b, 1, 2), torch.ones(b, dtype=torch.long))

    model = lambda: BatchFirst(  # noqa: E731
        TYPES[kind](2, 3, bidirectional=True, batch_first=True), packed=True,
        enforce_sorted=enforce_sorted,
    )  # fmt: skip
    for reduction in ("sum", "mean"):
        check_packed(Case(f"{kind} packed T=1", model, inputs, loss=_loss("all")), 3, reduction)


class StepByStep(nn.Module):
    """A recurrent layer written in Python (as Opacus's DPLSTM is) over a PackedSequence: its
    own linear layers called on the packed data, one time step's rows at a time."""

    def __init__(self, ih=True):
        super().__init__()
        self.ih, self.hh = nn.Linear(2, 3) if ih else nn.Identity(), nn.Linear(3, 3)

    def forward(self, packed):
        data, sizes = packed.data, packed.batch_sizes.tolist()
        h = torch.zeros(sizes[0], 3, dtype=data.dtype)
        outs, start = [], 0
        for n in sizes:
            h = torch.tanh(self.ih(data[start : start + n]) + self.hh(h[:n]))
            outs.append(h)
            start += n
        return torch.cat(outs)


@pytest.mark.parametrize("time", [1, 3])
def test_layer_on_the_data_of_a_packed_sequence_is_refused(time):
    """A layer called on rows of a PackedSequence's data: they are the examples' time steps in
    the order of their lengths, not one example each (also for ``T = 1``, where there are as many
    rows as examples). Refused at the forward, naming the layer."""
    torch.manual_seed(0)
    model = StepByStep().double()
    x = torch.randn(3, time, 2, dtype=torch.float64)
    packed = pack_padded_sequence(x, torch.tensor([time] * 3), batch_first=True)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with pytest.raises(RuntimeError, match=r"'ih' \(Linear\): its input \(\(3, 2\)\) is the "
                           "data of a PackedSequence"):  # fmt: skip
            model(packed)
    # without the layer on the data: the first state (zeros, the same for every example) meets
    # it after 'hh', whose share of each example's gradient cannot be told: the backward says so
    model = StepByStep(ih=False).double()
    x = torch.randn(3, time, 3, dtype=torch.float64)
    packed = pack_padded_sequence(x, torch.tensor([time] * 3), batch_first=True)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        out = model(packed)
        with pytest.raises(RuntimeError, match=r"'hh' \(Linear\): its inputs do not depend on "
                           r"the examples.*the data of a PackedSequence"):  # fmt: skip
            out.pow(2).sum().backward()


def test_opacus_rnn_on_packed_sequences_of_one_step_is_refused():
    layers = pytest.importorskip("opacus.layers", reason="needs opacus")
    torch.manual_seed(0)
    rnn = layers.DPLSTM(5, 9, num_layers=1, batch_first=True, bias=False).double()
    x = torch.randn(2, 1, 5, dtype=torch.float64)
    packed = pack_padded_sequence(x, torch.tensor([1, 1]), batch_first=True)
    with gradhooks.add_hooks(rnn, loss_reduction="sum"):
        with pytest.raises(RuntimeError, match=r"'l0\.ih' \(RNNLinear\).*PackedSequence"):
            rnn(packed)


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_pre_activation_gradients_match_autograd(kind):
    """The hand-written backward through time against autograd through the module itself: the
    summed grad1 of every parameter, three layers (gradients through two layer inputs), both
    directions, skipped steps, gradients reaching output, h_n (and c_n)."""
    torch.manual_seed(1)
    proj = dict(proj_size=2) if kind == "lstm" else {}
    rnn = TYPES[kind](3, 4, num_layers=3, bidirectional=True, batch_first=True, **proj).double()
    x = torch.randn(5, 7, 3, dtype=torch.float64)
    lengths = torch.tensor([7, 2, 5, 1, 7])
    (out, *state), layers = recompute(rnn, x, lengths)
    grads = (torch.randn_like(out) * (torch.arange(7)[:, None] < lengths).T[..., None],)
    grads = (*grads, *(torch.randn_like(s) for s in state))
    pieces = backpropagate(rnn, layers, grads)
    xr = x.clone().requires_grad_()
    packed = pack_padded_sequence(xr, lengths, batch_first=True, enforce_sorted=False)
    o, h = rnn(packed)
    o, _ = pad_packed_sequence(o, batch_first=True, total_length=7)
    outs = (o, *(h if isinstance(h, tuple) else (h,)))
    names = [n for n, _ in rnn.named_parameters()]
    want = torch.autograd.grad(outs, [p for _, p in rnn.named_parameters()], grads)
    for name, w in zip(names, want, strict=True):
        got = pieces[name].grad1(w.shape).sum(0)
        assert_close(got, w, f"{kind}: summed grad1 vs autograd, {name}")


@settings(max_examples=10, deadline=None)
@given(
    layers=st.integers(1, 3),
    bidirectional=st.booleans(),
    proj=st.sampled_from([0, 1, 2]),
    bias=st.booleans(),
    state=st.booleans(),
    time=st.integers(1, 5),
    give_output=st.booleans(),
)
def test_lstm_fast_path_matches_step_by_step(
    layers, bidirectional, proj, bias, state, time, give_output
):
    """The LSTM's fast path (states from torch's fused forward, gates batched, three ops per step
    of the backward) against the step-by-step recurrence and backward (the packed path), on
    the same module and gradients: outputs, every parameter's ``a`` and ``g``, and autograd."""
    torch.manual_seed(layers * 100 + time)
    kw = dict(proj_size=proj) if proj else {}
    rnn = nn.LSTM(3, 3, layers, bias=bias, bidirectional=bidirectional, batch_first=True, **kw)
    rnn = rnn.double()
    batch, k = 4, layers * (2 if bidirectional else 1)
    x = torch.randn(batch, time, 3, dtype=torch.float64)
    hx = None
    if state:
        hx = (torch.randn(k, batch, proj or 3, dtype=torch.float64),
              torch.randn(k, batch, 3, dtype=torch.float64))  # fmt: skip
    lengths = torch.full((batch,), time)
    with torch.no_grad():
        module_out = rnn(x, hx)[0] if give_output else None
    with patch.object(_Direction, "forward", side_effect=AssertionError("not the fast path")):
        (out, *st_fast), fast = recompute(rnn, x, lengths, hx, module_out)
    (out_s, *st_slow), slow = recompute(rnn, x, lengths, hx, fast=False)
    for g, w in zip((out, *st_fast), (out_s, *st_slow), strict=True):
        assert_close(g, w, "fast vs step-by-step recompute")
    grads = (torch.randn_like(out), *(torch.randn_like(s) for s in st_fast))
    got, want = backpropagate(rnn, fast, grads), backpropagate(rnn, slow, grads)
    params = dict(rnn.named_parameters())
    o, (h, c) = rnn(x, hx)
    auto = torch.autograd.grad((o, h, c), list(params.values()), grads)
    for (name, p), w in zip(params.items(), auto, strict=True):
        g1 = got[name].grad1(p.shape)
        assert_close(g1, want[name].grad1(p.shape), f"fast vs step-by-step grad1, {name}")
        assert_close(g1.sum(0), w, f"fast summed grad1 vs autograd, {name}")


@pytest.mark.parametrize("proj", [0, 2])
def test_lstm_jacobians(proj):
    """The Jacobians run the rule's backward under vmap (the step-by-step backward, after the
    fast forward): against one autograd backward per example and output."""
    torch.manual_seed(0)
    kw = dict(proj_size=proj) if proj else {}

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(2, 3, 2, bidirectional=True, batch_first=True, **kw)

        def forward(self, x):
            out, (h, c) = self.rnn(x)
            return torch.cat([out[:, -1], h.transpose(0, 1).flatten(1), c[-1]], -1)

    model = Head().double()
    x = torch.randn(3, 4, 2, dtype=torch.float64)
    got = gradhooks.jacobians(model, x)
    params = dict(model.named_parameters())
    for b in range(x.shape[0]):
        out = model(x[b : b + 1]).flatten()
        for j, o in enumerate(out):
            want = torch.autograd.grad(o, list(params.values()), retain_graph=True)
            for (name, _), w in zip(params.items(), want, strict=True):
                assert_close(got[name][b, j], w, f"Jacobian of {name}, example {b}, output {j}")

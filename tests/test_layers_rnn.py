"""nn.RNN / nn.LSTM / nn.GRU over a sweep of every option (hypothesis), packed sequences, errors.

The oracles slice and vmap inputs on dimension 0, so the RNN is wrapped in :class:`BatchFirst`,
which takes and returns batch-first tensors and hands the RNN its own layout (time-major when
``batch_first=False``, hidden states ``[layers * dirs, batch, hidden]``).
"""

from __future__ import annotations

import copy
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
    with pytest.raises(gradhooks.ConfigurationError, match=r"'enc' \(LSTM.*dropout=0.3.*eval\(\)"):
        _backward(model, torch.randn(4, 2, 2))
    model.eval()  # no dropout: exact
    _backward(model, torch.randn(4, 2, 2))
    assert model.enc.weight_hh_l1.grad1.shape == (2, 12, 3)


@pytest.mark.parametrize("kind", [nn.RNN, nn.GRU, nn.LSTM])
def test_dropout_in_training_is_refused_at_the_forward(kind):
    """The refusal comes at the forward, before a backward could run (or a loss be formed from
    the output), with the backward's message; a forward under no_grad (an evaluation) and one
    in eval mode run."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("enc", kind(2, 3, num_layers=2, dropout=0.3, batch_first=True).double())
    x = torch.randn(4, 2, 2, dtype=torch.float64)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with pytest.raises(
            gradhooks.ConfigurationError,
            match=rf"'enc' \({kind.__name__}, .*dropout=0.3 between layers.*model.eval\(\)",
        ):
            model(x)
        with torch.no_grad():
            model(x)
        assert not any(hasattr(p, "grad1") for p in model.parameters())
        model.eval()
        want = loop_grad(model, lambda out: out[0].pow(2).sum(), x)
        model.zero_grad()
        model(x)[0].pow(2).sum().backward()
    for n, p in model.named_parameters():
        assert_close(p.grad1, want[n], n)


def test_unbatched_input_is_an_error():
    with pytest.raises(gradhooks.UnbatchedInputError, match=r"GRU.*shape \(4, 2\).*batch"):
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
    """A layer called on rows of a PackedSequence's data, one time step's at a time: they are
    the examples' time steps in the order of their lengths, part of the data, not one example
    each. Refused at the forward, naming the layer. For ``T = 1`` the one step's rows are the
    whole data, each row one example's (in the order of their lengths), which the layer's
    rule is given; the first state (zeros, the same for every example) meets them after
    'hh', whose share of each example's gradient cannot be told: the backward says so, with
    nothing written."""
    torch.manual_seed(0)
    model = StepByStep().double()
    x = torch.randn(3, time, 2, dtype=torch.float64)
    packed = pack_padded_sequence(x, torch.tensor([time] * 3), batch_first=True)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        if time > 1:
            with pytest.raises(gradhooks.UnsupportedError, match=r"'ih' \(Linear\): its input "
                               r"\(\(3, 2\)\) is the data of a PackedSequence"):  # fmt: skip
                model(packed)
        else:
            out = model(packed)
            with pytest.raises(gradhooks.BatchNotFoundError, match=r"'hh' \(Linear\): its inputs "
                               r"do not depend on the examples.*the data of a PackedSequence"):  # fmt: skip
                out.pow(2).sum().backward()
    assert all(not hasattr(p, "grad1") and p.grad is None for p in model.parameters())
    # without the layer on the data: the same meeting; from the second step on, 'hh' is given
    # the state computed from the data's rows, part of the data: refused at the forward
    model = StepByStep(ih=False).double()
    x = torch.randn(3, time, 3, dtype=torch.float64)
    packed = pack_padded_sequence(x, torch.tensor([time] * 3), batch_first=True)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        if time > 1:
            with pytest.raises(gradhooks.UnsupportedError, match=r"'hh' \(Linear\): its input "
                               r"\(\(3, 3\)\) is the data of a PackedSequence"):  # fmt: skip
                model(packed)
            return
        out = model(packed)
        with pytest.raises(gradhooks.BatchNotFoundError, match=r"'hh' \(Linear\): its inputs do not depend on "
                           r"the examples.*the data of a PackedSequence"):  # fmt: skip
            out.pow(2).sum().backward()


class OnPackedData(nn.Module):
    """A tagger that gives a Linear what an operation made of its LSTM's packed data (the
    examples' time steps, packed longest first)."""

    def __init__(self, op, enforce_sorted: bool = False):
        super().__init__()
        self.op, self.enforce_sorted = op, enforce_sorted
        self.rnn, self.fc = nn.LSTM(2, 3, batch_first=True), nn.Linear(3, 2)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        packed = pack_padded_sequence(
            x, lengths, batch_first=True, enforce_sorted=self.enforce_sorted
        )
        out, _ = self.rnn(packed)
        return self.fc(self.op(out.data))


# what keeps each row of the packed data apart and in place (its rows still the whole data)
ROW_BY_ROW = {
    "as it is": lambda d: d,
    "tanh": torch.tanh,
    "clone": torch.clone,
    "stacked and summed": lambda d: torch.stack([d, d], 1).sum(1),
    "matmul": lambda d: d @ torch.arange(9.0, dtype=d.dtype).view(3, 3),
}
# what regroups, moves, combines or cuts its rows
NOT_ROW_BY_ROW = {
    "batched matmul": lambda d: torch.bmm(d[None], torch.eye(3, dtype=d.dtype)[None])[0],
    "regrouped by view": lambda d: d.view(2, -1, 3).reshape(-1, 3),
    "unflattened": lambda d: d.unflatten(0, (2, -1)).flatten(0, 1),
    "unsqueezed": lambda d: d.unsqueeze(0).squeeze(0),
    "transposed twice": lambda d: d.swapaxes(0, 1).swapaxes(0, 1),
    "summed along the rows": lambda d: d - d.sum(0, keepdim=True),
    "rolled along the rows": lambda d: d.roll(1, 0),
    "its first rows": lambda d: d[:6],
}


@pytest.mark.parametrize("sort", [True, False], ids=["sorted", "unsorted"])
@pytest.mark.parametrize("what", sorted(ROW_BY_ROW))
def test_a_layer_on_the_whole_data_of_a_packed_sequence(what, sort):
    """A layer given the whole data of its LSTM's PackedSequence (a tagger's ``fc(out.data)``),
    or what keeps each of its rows apart and in place: each row is one example's time step
    (their batch sizes and order are the PackedSequence's), and each example's gradient is
    the sum of its rows'. Three steps of a loop, each against the float64 per-example loop,
    the examples packed sorted by length or not."""
    op = ROW_BY_ROW[what]
    torch.manual_seed(0)
    model = OnPackedData(op, enforce_sorted=sort).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 5, 2, dtype=torch.float64)
    lengths = torch.tensor([5, 4, 3, 2] if sort else [5, 2, 4, 3])

    def loss(out):
        return out.pow(2).sum()

    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for _ in range(3):
            want = loop_grad(model, loss, (x, lengths))
            optimizer.zero_grad()
            loss(model(x, lengths)).backward()
            for n, p in model.named_parameters():
                assert_close(p.grad1, want[n], n)
            optimizer.step()


class SortsItsBatch(nn.Module):
    """An encoder that sorts its batch by length itself (``index_select``), packs it with
    ``enforce_sorted=True`` (a PackedSequence without ``sorted_indices``) and puts the padded
    outputs and the last states back in the batch's order, as ESIM's ``Seq2SeqEncoder`` and
    many text classifiers written before ``enforce_sorted=False`` do."""

    def __init__(self):
        super().__init__()
        self.rnn, self.fc = nn.LSTM(2, 3, batch_first=True, bidirectional=True), nn.Linear(6, 2)
        self.last = nn.Linear(3, 2)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        sorted_lengths, order = lengths.sort(0, descending=True)
        packed = pack_padded_sequence(x.index_select(0, order), sorted_lengths, batch_first=True)
        out, (h, _) = self.rnn(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        restore = order.argsort()
        return self.fc(out.index_select(0, restore)).sum(1) + self.last(h[-1][restore])


def test_a_batch_sorted_by_the_model_then_packed_then_put_back():
    """Each example's gradient follows it through the model's own sort: the recurrent layer's
    rows are the examples in the order they were packed in. Five steps of a loop whose first
    batches come sorted already (the sort keeps them in place) and whose later ones do not,
    each against the float64 per-example loop."""
    torch.manual_seed(0)
    model = SortsItsBatch().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss(out):
        return out.pow(2).sum()

    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for lengths in ([5, 4, 2], [5, 3, 3], [2, 5, 4], [3, 2, 5], [4, 5, 1]):
            lengths = torch.tensor(lengths)
            x = torch.randn(3, 5, 2, dtype=torch.float64)
            x = x * (torch.arange(5) < lengths[:, None])[..., None]
            want = loop_grad(model, loss, (x, lengths))
            optimizer.zero_grad()
            loss(model(x, lengths)).backward()
            for n, p in model.named_parameters():
                assert_close(p.grad1, want[n], f"{lengths.tolist()} {n}")
            optimizer.step()


def test_a_layer_on_the_whole_data_of_a_packed_sequence_under_bfloat16_autocast():
    """As above, the model in float32 under CPU bfloat16 autocast: each parameter's ``grad1``
    within 3% of its largest entry of the float64 loop's."""
    torch.manual_seed(0)
    model = OnPackedData(torch.tanh).float()
    twin = copy.deepcopy(model).double()
    x, lengths = torch.randn(4, 5, 2), torch.tensor([5, 2, 4, 3])
    want = loop_grad(twin, lambda out: out.pow(2).sum(), (x.double(), lengths))
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x, lengths)
        out.float().pow(2).sum().backward()
    for n, p in model.named_parameters():
        err = (p.grad1.double() - want[n]).abs().max() / want[n].abs().max()
        assert err < 3e-2, f"{n}: {float(err):.3g} of its largest entry"


@pytest.mark.parametrize("what", sorted(NOT_ROW_BY_ROW))
def test_a_layer_on_what_regroups_packed_data_is_refused(what):
    """A layer given what an operation made of a PackedSequence's data by regrouping, moving,
    combining or cutting its rows: refused at the forward, naming the layer, also with
    ``verify=False`` (once, the data regrouped by a view or unsqueezed was taken for a batch
    of blocks of rows, and ``grad1`` had a row per block, with no error; transposed, the rule
    failed and the message blamed it); the parameters get neither ``grad1`` nor ``.grad``."""
    torch.manual_seed(0)
    model = OnPackedData(NOT_ROW_BY_ROW[what]).double()
    x, lengths = torch.randn(4, 5, 2, dtype=torch.float64), torch.tensor([5, 2, 4, 3])
    with gradhooks.add_hooks(model, loss_reduction="sum", verify=False):
        with pytest.raises(
            (gradhooks.UnsupportedError, gradhooks.MixedExamplesError, gradhooks.BatchNotFoundError)
        ) as caught:
            model(x, lengths).pow(2).sum().backward()
    assert "'fc' (Linear)" in str(caught.value)
    assert all(not hasattr(p, "grad1") and p.grad is None for p in model.parameters())


def test_opacus_rnn_on_packed_sequences_of_one_step_is_refused():
    """Opacus' DPLSTM (its cells' linear layers in Python) on a PackedSequence of one step:
    its input projection takes the whole data, each row one example's; its first state
    (zeros, the same for every example) meets it after the hidden projection, whose share of
    each example's gradient cannot be told: refused at the backward, with nothing written."""
    layers = pytest.importorskip("opacus.layers", reason="needs opacus")
    torch.manual_seed(0)
    rnn = layers.DPLSTM(5, 9, num_layers=1, batch_first=True, bias=False).double()
    x = torch.randn(2, 1, 5, dtype=torch.float64)
    packed = pack_padded_sequence(x, torch.tensor([1, 1]), batch_first=True)
    with gradhooks.add_hooks(rnn, loss_reduction="sum"):
        out, _ = rnn(packed)
        with pytest.raises(
            gradhooks.BatchNotFoundError, match=r"'l0\.hh' \(RNNLinear\).*PackedSequence"
        ):
            out.data.pow(2).sum().backward()
    assert all(not hasattr(p, "grad1") and p.grad is None for p in rnn.parameters())


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


# -- LSTM calls autograd records nothing of ------------------------------------------------------
# nn.LSTM calls that autograd records nothing of (the rule's ``grad_from_grad1`` with
# ``owns_backward``): the rule's backward through time gives ``.grad`` and the gradients of the
# input, ``h0`` and ``c0``; torch's own LSTM backward is not run. Everything must stay what
# autograd computes without hooks, in every setup (create_graph, paused and repeated backwards,
# a forward that raises), and grad1 / the norms the oracles'.

D = torch.float64


def owned(out) -> bool:
    return type(out.grad_fn).__name__ == "_JoinBackward"


def lstm_setup(seed, layers, bidirectional, proj, batch_first, state, x_grad, batch=4, time=5):
    torch.manual_seed(seed)
    kw = dict(proj_size=proj) if proj else {}
    rnn = nn.LSTM(3, 4, layers, bidirectional=bidirectional, batch_first=batch_first, **kw)
    rnn = rnn.to(D)
    shape = (batch, time, 3) if batch_first else (time, batch, 3)
    x = torch.randn(*shape, dtype=D, requires_grad=x_grad)
    k = layers * (2 if bidirectional else 1)
    hx = None
    if state:
        hx = (torch.randn(k, batch, proj or 4, dtype=D, requires_grad=True),
              torch.randn(k, batch, 4, dtype=D, requires_grad=True))  # fmt: skip
    return rnn, x, hx


def loss_of(out, h, c, which):
    parts = {"all": (out, h, c), "output": (out,), "h_n": (h,), "c_n": (c,)}[which]
    return sum((t**2).sum() + t.sum() for t in parts)


def leaves(x, hx):
    return [t for t in (x, *(hx or ())) if t.requires_grad]


def oracle_grad1(rnn, x, hx, batch_first, which):
    """vmap(grad) of loss_of(rnn(x, hx), which) per parameter, the batch moved to dimension 0
    of every input and output for the oracle (the LSTM lays it out on dimension 1 of the state
    and, time-major, of x)."""

    class Split(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = rnn

        def forward(self, x, *state):
            x = x if batch_first else x.transpose(0, 1)
            state = tuple(s.transpose(0, 1).contiguous() for s in state) or None
            out, (h, c) = self.rnn(x, state)
            return out if batch_first else out.transpose(0, 1), h.transpose(0, 1), c.transpose(0, 1)

    xb = (x if batch_first else x.transpose(0, 1)).detach()
    st_b = tuple(s.detach().transpose(0, 1) for s in hx or ())
    return vmap_grad(Split(), lambda o: loss_of(*o, which), (xb, *st_b))


@settings(max_examples=15, deadline=None)
@given(
    layers=st.integers(1, 3),
    bidirectional=st.booleans(),
    proj=st.sampled_from([0, 0, 2]),
    batch_first=st.booleans(),
    state=st.booleans(),
    x_grad=st.booleans(),
    which=st.sampled_from(["all", "output", "h_n", "c_n"]),
    quantity=st.sampled_from(["grad1", "norms"]),
)
def test_grads_equal_autograd_without_hooks(
    layers, bidirectional, proj, batch_first, state, x_grad, which, quantity
):
    """.grad of every parameter and the gradients of x, h0, c0 against the same LSTM without
    hooks; grad1 (or the norms) against vmap(grad) (sum reduction)."""
    rnn, x, hx = lstm_setup(layers, layers, bidirectional, proj, batch_first, state, x_grad)
    ref = copy.deepcopy(rnn)
    out, (h, c) = ref(x, hx)
    loss_of(out, h, c, which).backward()
    want_in = [t.grad for t in leaves(x, hx)]
    for t in leaves(x, hx):
        t.grad = None
    with gradhooks.add_hooks(rnn, loss_reduction="sum", quantities=(quantity,)) as hooks:
        out, (h, c) = rnn(x, hx)
        assert owned(out) and owned(h) and owned(c)
        loss_of(out, h, c, which).backward()
    for (n, p), r in zip(rnn.named_parameters(), ref.parameters(), strict=True):
        assert_close(p.grad, r.grad, f"{n}: .grad")
    for t, w in zip(leaves(x, hx), want_in, strict=True):
        assert_close(t.grad, w, "input-gradient")

    want = oracle_grad1(rnn, x, hx, batch_first, which)
    names = [n for n, _ in rnn.named_parameters()]
    if quantity == "grad1":
        for n, p in rnn.named_parameters():
            assert_close(p.grad1, want["rnn." + n], f"{n}: grad1")
    else:
        sq = sum(want["rnn." + n].flatten(1).pow(2).sum(1) for n in names)
        assert_close(hooks.norms(), sq.sqrt(), "norms")


def test_create_graph_backward_is_autograds():
    """A gradient penalty through the LSTM (create_graph, then differentiated again): the call
    is run again under autograd; .grad as without hooks."""
    rnn, x, hx = lstm_setup(0, 2, True, 2, True, True, True)
    ref = copy.deepcopy(rnn)

    def penalty(m):
        out, (h, c) = m(x, hx)
        (dx,) = torch.autograd.grad(loss_of(out, h, c, "all"), x, create_graph=True)
        return dx.pow(2).sum()

    penalty(ref).backward()
    want = [p.grad for p in ref.parameters()]
    with gradhooks.add_hooks(rnn) as h:
        value = penalty(rnn)
        with h.paused():
            value.backward()
    for (n, p), w in zip(rnn.named_parameters(), want, strict=True):
        assert_close(p.grad, w, f"{n}: gradient of the penalty")


def test_paused_and_repeated_backwards():
    """A paused backward (the rule run for .grad only), a captured one, a second forward:
    .grad and the input-gradients accumulate as autograd's."""
    rnn, x, hx = lstm_setup(1, 2, False, 0, True, True, True)
    ref = copy.deepcopy(rnn)

    def twice(m, h=None):
        out, (hn, cn) = m(x, hx)
        loss = loss_of(out, hn, cn, "all")
        if h is None:
            loss.backward(retain_graph=True)
        else:
            with h.paused():
                loss.backward(retain_graph=True)
        (2 * loss).backward()
        out, (hn, cn) = m(x, hx)
        loss_of(out, hn, cn, "output").backward()

    twice(ref)
    want = [p.grad for p in ref.parameters()]
    want_in = [t.grad.clone() for t in leaves(x, hx)]
    for t in leaves(x, hx):
        t.grad = None
    with gradhooks.add_hooks(rnn, loss_reduction="sum") as h:
        twice(rnn, h)
    for (n, p), w in zip(rnn.named_parameters(), want, strict=True):
        assert_close(p.grad, w, f"{n}: .grad")
    for t, w in zip(leaves(x, hx), want_in, strict=True):
        assert_close(t.grad, w, "input-gradient")


# nn.RNN and nn.GRU calls on a padded input run so too: their rule's backward through time
# gives .grad and the gradients of the input and of h0.


@pytest.mark.parametrize("kind", ["tanh", "relu", "gru"])
@pytest.mark.parametrize(
    "layers, bidirectional, batch_first, state, x_grad",
    [(1, False, True, True, True), (2, True, False, True, True), (2, False, True, False, True),
     (1, True, False, True, False)],
    ids=["1-layer-h0", "2-bidir-time-major-h0", "2-layer", "bidir-h0-only"],
)  # fmt: skip
def test_rnn_and_gru_grads_equal_autograd_without_hooks(
    monkeypatch, kind, layers, bidirectional, batch_first, state, x_grad
):
    """.grad of every parameter and the gradients of x and h0 against the same nn.RNN or
    nn.GRU without hooks (float64), all from the rule (autograd's backward of the call is
    never run again for them); grad1 against vmap(grad) (sum reduction)."""
    from gradhooks.engine import capture

    def rerun(*args):
        raise AssertionError("the call was run again under autograd for its gradients")

    monkeypatch.setattr(capture, "_rerun_alone", rerun)
    torch.manual_seed(layers)
    rnn = TYPES[kind](3, 4, layers, bidirectional=bidirectional, batch_first=batch_first)
    rnn = rnn.to(D)
    batch, time, k = 4, 5, layers * (2 if bidirectional else 1)
    x = torch.randn(*((batch, time, 3) if batch_first else (time, batch, 3)), dtype=D)
    x.requires_grad_(x_grad)
    h0 = torch.randn(k, batch, 4, dtype=D, requires_grad=True) if state else None
    inputs = [t for t in (x, h0) if t is not None and t.requires_grad]

    def loss(out, h):
        return (out**2).sum() + out.sum() + (h**2).sum()

    ref = copy.deepcopy(rnn)
    loss(*ref(x, h0)).backward()
    want_in = [t.grad for t in inputs]
    for t in inputs:
        t.grad = None
    with gradhooks.add_hooks(rnn, loss_reduction="sum"):
        out, h = rnn(x, h0)
        assert owned(out) and owned(h)
        loss(out, h).backward()
    for (n, p), r in zip(rnn.named_parameters(), ref.parameters(), strict=True):
        assert_close(p.grad, r.grad, f"{n}: .grad")
    for t, w in zip(inputs, want_in, strict=True):
        assert_close(t.grad, w, "input-gradient")

    class Split(nn.Module):  # (the batch on dimension 0 of every input and output)
        def __init__(self):
            super().__init__()
            self.rnn = rnn

        def forward(self, x, *state):
            x = x if batch_first else x.transpose(0, 1)
            out, h = self.rnn(x, state[0].transpose(0, 1).contiguous() if state else None)
            return out if batch_first else out.transpose(0, 1), h.transpose(0, 1)

    xb = (x if batch_first else x.transpose(0, 1)).detach()
    st_b = () if h0 is None else (h0.detach().transpose(0, 1),)
    want = vmap_grad(Split(), lambda o: loss(*o), (xb, *st_b))
    for n, p in rnn.named_parameters():
        assert_close(p.grad1, want["rnn." + n], f"{n}: grad1")


@pytest.mark.parametrize("layers", [1, 2])
def test_forward_that_raises_restores_grad_mode_and_parameters(layers):
    rnn = nn.LSTM(3, 4, layers)
    weight = rnn.weight_ih_l0
    with gradhooks.add_hooks(rnn):
        with pytest.raises(RuntimeError):
            rnn(torch.randn(5, 2, 7))  # 7 features, the LSTM takes 3
        assert torch.is_grad_enabled()
        assert torch._C._len_torch_function_stack() == 0  # the layers' recording was left
        assert rnn._parameters["weight_ih_l0"] is weight
        out, _ = rnn(torch.randn(5, 2, 3))
        assert owned(out)
        out.sum().backward()
        assert weight.grad1.shape == (2, *weight.shape)


@pytest.mark.parametrize("dtype", [torch.float32, D])
@pytest.mark.parametrize("batch_first,bidirectional,proj", [(True, False, 0), (False, True, 2)])
def test_lower_layers_kept_at_the_forward_not_run_again(
    monkeypatch, dtype, batch_first, bidirectional, proj
):
    """A 3-layer LSTM run with grad mode off: torch's fused call runs a layer at a time and
    keeps the lower layers' outputs for the rule (which must not run them again). The outputs
    are, bit for bit, those of the unhooked module: in float32 without a projection (torch's
    oneDNN kernel, run with grad mode on, in the form it takes under autograd) as it runs under
    autograd, else with its parameters detached, as the call runs (in float64, torch's matmul may sum in
    another order for weights that require grad); and grad1 is vmap(grad)'s."""
    from gradhooks.rules import rnn as rules

    def rerun(*args):
        raise AssertionError("a lower layer was run again")

    monkeypatch.setattr(rules, "_lstm_layer", rerun)
    rnn, x, hx = lstm_setup(3, 3, bidirectional, proj, batch_first, True, True)
    rnn, x, hx = rnn.to(dtype), x.detach().to(dtype), tuple(t.detach().to(dtype) for t in hx)
    ref = copy.deepcopy(rnn)
    for n, p in list(ref.named_parameters()):
        ref._parameters[n] = p.detach()
    if dtype is torch.float32 and not proj:
        want_out = copy.deepcopy(rnn)(x, hx)
    else:
        with torch.no_grad():
            want_out = ref(x, hx)
    with gradhooks.add_hooks(rnn, loss_reduction="sum"):
        out, (h, c) = rnn(x, hx)
        assert owned(out)
        for got, want in zip((out, h, c), (want_out[0], *want_out[1]), strict=True):
            assert torch.equal(got, want)
        loss_of(out, h, c, "all").backward()
    assert torch._C._len_torch_function_stack() == 0
    if dtype is D:
        want = oracle_grad1(rnn, x, hx, batch_first, "all")
        for n, p in rnn.named_parameters():
            assert_close(p.grad1, want["rnn." + n], f"{n}: grad1")


def test_where_autograd_still_runs_the_lstm():
    """Packed sequences, dropout between layers in training (refused at the forward), no
    grad mode: not taken."""
    rnn = nn.LSTM(3, 4, batch_first=True)
    x = torch.randn(2, 5, 3)
    with gradhooks.add_hooks(rnn):
        out, _ = rnn(pack_padded_sequence(x, torch.tensor([5, 3]), batch_first=True))
        assert not owned(out.data)
        with torch.no_grad():
            assert rnn(x)[0].grad_fn is None
        assert torch.is_grad_enabled()
    drop = nn.LSTM(3, 4, 2, dropout=0.5)
    with gradhooks.add_hooks(drop):
        with torch.no_grad():
            assert not owned(drop(torch.randn(5, 2, 3))[0])
        with pytest.raises(gradhooks.ConfigurationError, match="dropout=0.5"):
            drop(torch.randn(5, 2, 3))  # (refused at the forward)


def test_a_later_pre_hook_keeps_autograd():
    """A forward pre-hook registered after add_hooks changes the input: the call keeps
    autograd (the input-gradient goes through the pre-hook's own operations)."""
    rnn, x, _ = lstm_setup(2, 1, False, 0, True, False, True)
    ref = copy.deepcopy(rnn)
    ref.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    ref(x)[0].sum().backward()
    want = x.grad
    x.grad = None
    with gradhooks.add_hooks(rnn):
        rnn.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
        out, _ = rnn(x)
        assert not owned(out)
        out.sum().backward()
    assert_close(x.grad, want, "input-gradient through the pre-hook")
    for (n, p), r in zip(rnn.named_parameters(), ref.parameters(), strict=True):
        assert_close(p.grad, r.grad, f"{n}: .grad")


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_dp_step_after_an_embedding(method):
    """A DP-SGD step on Embedding -> LSTM -> Linear: every method's clipped gradient equals the
    clipped per-example loop. (The book-keeping step's backward wants no parameter gradients:
    the LSTM's backward must not rerun its forward under autograd, whose nested backward would
    reach the embedding's hooks a second time.)"""
    from gradhooks.oracle import loop_grad

    torch.manual_seed(0)
    from gradhooks.models import LSTMLanguageModel

    model = LSTMLanguageModel(vocab=11, dim=4, hidden=5, layers=2).double()
    tokens, target = torch.randint(11, (5, 6)), torch.randint(11, (5, 6))

    def loss(out, y):  # the sum over examples of each example's mean over positions
        return nn.functional.cross_entropy(out.transpose(1, 2), y, reduction="none").mean(1).sum()

    loop = loop_grad(model, loss, tokens, target)
    norms = torch.cat([g.flatten(1) for g in loop.values()], 1).norm(dim=1)
    max_norm = norms.median().item()
    factors = torch.clamp(max_norm / norms, max=1.0)
    with gradhooks.add_hooks(model, quantities=("grad1" if method == "grad1" else "norms",)) as h:
        seen = []
        model.lstm.register_forward_hook(lambda m, a, out: seen.append(owned(out[0])))
        out = model(tokens)
        assert seen == [True]
        losses = nn.functional.cross_entropy(out.transpose(1, 2), target, reduction="none").mean(1)
        got = gradhooks.dp_sgd_step(
            h, losses, max_norm=max_norm, noise_multiplier=0.0, method=method
        )
    assert_close(got, norms, f"{method}: norms")
    for name, p in model.named_parameters():
        want = torch.einsum("b,b...->...", factors, loop[name]) / 5
        assert_close(p.grad, want, f"{method}: clipped {name}")


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("batch", [0, 1, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_bias_pieces_per_parameter_quantities(kind, batch, reduction):
    """A bias's piece is Σ_t g summed once (shared by bias_ih and bias_hh where g is the same,
    the LSTM's): every parameter's own norm, squared sum and grad1 against vmap(grad)."""
    torch.manual_seed(1)
    rnn = getattr(nn, kind)(3, 4, 2, batch_first=True).to(D)
    x = torch.randn(batch, 5, 3, dtype=D)

    def loss(out):
        return (out[0] ** 2 + out[0]).sum()

    class First(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = rnn

        def forward(self, x):
            return (self.rnn(x)[0],)

    want = vmap_grad(First(), loss, (x,))  # per-example gradients of each example's own loss
    qs = ("grad1", "norms", "sum_grad_sq")
    with gradhooks.add_hooks(rnn, loss_reduction=reduction, quantities=qs) as hooks:
        total = loss(First()(x))
        (total / max(batch, 1) if reduction == "mean" else total).backward()
    norms, sums = hooks.param_norms(), hooks.sum_grad_sq()
    for n, p in rnn.named_parameters():
        w = want["rnn." + n]
        assert_close(p.grad1, w, f"{n}: grad1")
        assert_close(norms[n], w.flatten(1).norm(dim=1), f"{n}: norm")
        assert_close(sums[n], (w**2).sum(0), f"{n}: sum_grad_sq")


def float32_against_float64_oracle(layers, bidirectional, batch_first, bias, state, quantity):
    """A float32 LSTM (torch's oneDNN kernel on CPU) under hooks: .grad and the input-,
    h0- and c0-gradients against the same module without hooks, grad1 (or the norms) against
    vmap(grad) of its float64 copy, to float32 rounding."""
    torch.manual_seed(layers)
    rnn = nn.LSTM(3, 4, layers, bias=bias, bidirectional=bidirectional, batch_first=batch_first)
    shape = (4, 6, 3) if batch_first else (6, 4, 3)
    x = torch.randn(*shape, requires_grad=True)
    k = layers * (2 if bidirectional else 1)
    hx = (torch.randn(k, 4, 4, requires_grad=True), torch.randn(k, 4, 4)) if state else None
    ref = copy.deepcopy(rnn)
    out, (h, c) = ref(x, hx)
    loss_of(out, h, c, "all").backward()
    want_in = [t.grad for t in leaves(x, hx)]
    for t in leaves(x, hx):
        t.grad = None
    with gradhooks.add_hooks(rnn, loss_reduction="sum", quantities=(quantity,)) as hooks:
        out, (h, c) = rnn(x, hx)
        assert owned(out)
        loss_of(out, h, c, "all").backward()

    def close(got, want, what):
        diff = (got.double() - want.double()).abs().max().item()
        assert torch.allclose(got.double(), want.double(), rtol=1e-4, atol=1e-5), f"{what}: {diff}"

    for (n, p), r in zip(rnn.named_parameters(), ref.parameters(), strict=True):
        close(p.grad, r.grad, f"{n}: .grad")
    for t, w in zip(leaves(x, hx), want_in, strict=True):
        close(t.grad, w, "input-gradient")
    hx64 = None if hx is None else tuple(t.detach().double() for t in hx)
    want = oracle_grad1(copy.deepcopy(rnn).double(), x.detach().double(), hx64, batch_first, "all")
    if quantity == "grad1":
        for n, p in rnn.named_parameters():
            close(p.grad1, want["rnn." + n], f"{n}: grad1")
    else:
        sq = sum(w.flatten(1).pow(2).sum(1) for w in want.values())
        close(hooks.norms(), sq.sqrt(), "norms")


@pytest.mark.parametrize("layers,bidirectional,batch_first,bias,state", [
    (1, False, True, True, False),
    (2, False, False, True, True),
    (1, True, True, False, True),
    (2, True, False, True, False),
    (2, True, True, True, True),
])  # fmt: skip
@pytest.mark.parametrize("quantity", ["grad1", "norms"])
def test_float32_against_float64_oracle(layers, bidirectional, batch_first, bias, state, quantity):
    """In float32 on CPU (where torch runs its oneDNN kernel) every gradient is the oracles',
    to float32 rounding."""
    float32_against_float64_oracle(layers, bidirectional, batch_first, bias, state, quantity)


def reference_or_skip(step, model) -> None:
    """Run ``step(model)`` unhooked (the reference); skip the test, saying why, where plain
    torch cannot run it on this machine: oneDNN has no bfloat16 LSTM forward for a CPU
    without AVX-512 (it cannot create the primitive), so there is nothing to compare with."""
    try:
        step(model)
    except RuntimeError as e:
        if "could not create a primitive descriptor" not in str(e):
            raise
        cpu = torch.backends.cpu.get_cpu_capability()
        pytest.skip(
            f"plain torch cannot run the reference on this CPU ({cpu}): oneDNN's bfloat16 "
            f"{type(model).__name__} needs AVX-512 ({str(e).splitlines()[0]})"
        )


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("backward_inside", [False, True])
def test_autocast_bfloat16(kind, backward_inside):
    """Under CPU autocast to bfloat16 the LSTM runs in bfloat16 and its outputs and
    output-gradients are bfloat16 (torch keeps the GRU in float32); the rule recomputes and backpropagates in the parameters'
    float32 (also where the backward runs inside the autocast block): .grad as autograd's
    without hooks, grad1 float32 and the per-example loop's of the float32 model, to bfloat16
    rounding."""
    torch.manual_seed(0)
    rnn = getattr(nn, kind)(3, 8, 2, bidirectional=True, batch_first=True)
    x = torch.randn(4, 6, 3)
    ref = copy.deepcopy(rnn)
    from gradhooks.oracle import loop_grad

    want = loop_grad(copy.deepcopy(rnn), lambda out: loss_of(out[0], out[0], out[0], "output"), x)

    def step(model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)[0]
            assert out.dtype == (torch.bfloat16 if kind == "LSTM" else torch.float32)
            loss = loss_of(out.float(), out.float(), out.float(), "output")
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()

    reference_or_skip(step, ref)
    with gradhooks.add_hooks(rnn, loss_reduction="sum"):
        step(rnn)
    for (n, p), r in zip(rnn.named_parameters(), ref.parameters(), strict=True):
        assert p.grad1.dtype == torch.float32
        scale = r.grad.abs().max().item()
        assert torch.allclose(p.grad, r.grad, rtol=2e-2, atol=2e-2 * scale), f"{n}: .grad"
        # (the LSTM's .grad is grad1's sum; the GRU's, autograd's, which torch computes in
        # bfloat16 in places)
        tol = 1e-4 if kind == "LSTM" else 2e-2
        assert torch.allclose(p.grad1.sum(0), p.grad, rtol=tol, atol=tol * scale), n
        if want is not None:
            w = want[n]
            wscale = w.abs().max().item()
            assert torch.allclose(p.grad1, w, rtol=5e-2, atol=5e-2 * wscale), f"{n}: grad1"


@pytest.mark.parametrize("quantity", ["grad1", "norms"])
def test_a_weight_changed_in_place_before_the_backward_is_refused(quantity):
    """The LSTM's call runs with grad mode off (its rule gives the whole backward), so autograd
    saves none of its tensors; a weight changed after the forward would silently enter the
    backward. It is refused as autograd refuses it for the unhooked module, naming it."""
    torch.manual_seed(0)
    model = nn.LSTM(3, 4, num_layers=2, batch_first=True).double()
    x = torch.randn(5, 7, 3, dtype=torch.float64)
    plain = copy.deepcopy(model)
    loss = plain(x)[0].pow(2).sum()
    with torch.no_grad():
        plain.weight_hh_l1.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    with gradhooks.add_hooks(model, quantities=(quantity,)):
        loss = model(x)[0].pow(2).sum()
        with torch.no_grad():
            model.weight_hh_l1.mul_(2)
        with pytest.raises(gradhooks.StateError, match=r"parameter 'weight_hh_l1' .*\(LSTM\)"):
            loss.backward()


# -- learned initial states, and a packed GRU inside a module without a rule ----------------------


class _LearnedState(nn.Module):
    """An RNN whose initial state is a parameter of its parent, ``[layers, 1, hidden]``,
    expanded over the batch (``h0.expand(-1, batch, -1).contiguous()``; ``c0`` too for the
    LSTM), then a Linear on the outputs."""

    def __init__(self, kind: str, batch_first: bool, layers: int = 2, hidden: int = 4):
        super().__init__()
        self.rnn = getattr(nn, kind)(3, hidden, num_layers=layers, batch_first=batch_first)
        self.h0 = nn.Parameter(torch.randn(layers, 1, hidden))
        self.c0 = nn.Parameter(torch.randn(layers, 1, hidden)) if kind == "LSTM" else None
        self.out = nn.Linear(hidden, 2)

    def forward(self, x: Tensor) -> Tensor:
        batch = x.shape[0 if self.rnn.batch_first else 1]
        hx = self.h0.expand(-1, batch, -1).contiguous()
        if self.c0 is not None:
            hx = (hx, self.c0.expand(-1, batch, -1).contiguous())
        y, _ = self.rnn(x, hx)
        return self.out(y)


class _PackedGRU(nn.Module):
    """A GRU on a PackedSequence inside a module without a rule (its own learned ``h0`` and
    output ``scale``, so the fallback recomputes it per example), read out through
    ``pad_packed_sequence``."""

    def __init__(self, batch_first: bool, enforce_sorted: bool):
        super().__init__()
        self.batch_first, self.enforce_sorted = batch_first, enforce_sorted
        self.gru = nn.GRU(3, 4, batch_first=batch_first)
        self.h0 = nn.Parameter(torch.randn(1, 1, 4))
        self.scale = nn.Parameter(torch.randn(4))

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        time = x.shape[1 if self.batch_first else 0]
        packed = pack_padded_sequence(
            x, lengths, batch_first=self.batch_first, enforce_sorted=self.enforce_sorted
        )
        out, _ = self.gru(packed, self.h0.expand(-1, len(lengths), -1).contiguous())
        y, _ = pad_packed_sequence(out, batch_first=self.batch_first, total_length=time)
        return y * self.scale


class _ReadOut(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.out = inner, nn.Linear(4, 2)

    def forward(self, *args):
        return self.out(self.inner(*args))


def _loop_along(model: nn.Module, x: Tensor, dim: int, *per_row: Tensor) -> dict[str, Tensor]:
    """The float64 per-example loop, example ``i`` being ``x.narrow(dim, i, 1)`` (and row ``i``
    of each of ``per_row``), with the loss ``0.5 * sum of squares``."""
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    rows = []
    for i in range(x.shape[dim]):
        out = model(x.narrow(dim, i, 1), *(t[i : i + 1] for t in per_row))
        rows.append(torch.autograd.grad(0.5 * out.pow(2).sum(), list(named.values())))
    return {n: torch.stack([r[k] for r in rows]) for k, n in enumerate(named)}


@pytest.mark.parametrize("quantity", ["grad1", "norms"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "time_first"])
@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_learned_initial_state_of_the_parent(kind, batch_first, quantity):
    """A learned ``h0`` (and ``c0``) of the parent, expanded over the batch: its grad1, and the
    RNN's, against the per-example loop; the LSTM as the GRU."""
    torch.manual_seed(0)
    m = _LearnedState(kind, batch_first).double()
    dim = 0 if batch_first else 1
    x = torch.randn(3, 5, 3, dtype=D) if batch_first else torch.randn(5, 3, 3, dtype=D)
    want = _loop_along(m, x, dim)
    with gradhooks.add_hooks(m, loss_reduction="sum", batch_dim=dim,
                             quantities=(quantity,)) as h:  # fmt: skip
        (0.5 * m(x).pow(2).sum()).backward()
    for n, p in m.named_parameters():
        if quantity == "grad1":
            assert_close(p.grad1, want[n], f"{kind} {n}")
        else:
            assert_close(h.param_norms()[n], want[n].flatten(1).norm(dim=1), f"{kind} {n}")


@pytest.mark.parametrize(
    "batch_first,enforce_sorted",
    [(True, True), (True, False), (False, True), (False, False)],
    ids=["batch_first-sorted", "batch_first-unsorted", "time_first-sorted", "time_first-unsorted"],
)
def test_packed_gru_in_a_module_without_a_rule(batch_first, enforce_sorted):
    """The fallback recomputes a module that packs, runs a GRU from its own learned ``h0`` and
    pads back, one example at a time (packing cannot run under torch.func): grad1 of ``h0``,
    ``scale``, the GRU's weights and the Linear after it against the per-example loop."""
    torch.manual_seed(0)
    m = _ReadOut(_PackedGRU(batch_first, enforce_sorted)).double()
    dim = 0 if batch_first else 1
    x = torch.randn(3, 5, 3, dtype=D) if batch_first else torch.randn(5, 3, 3, dtype=D)
    lengths = torch.tensor([5, 3, 2])
    want = _loop_along(m, x, dim, lengths)
    with gradhooks.add_hooks(m, loss_reduction="sum", batch_dim=dim):
        (0.5 * m(x, lengths).pow(2).sum()).backward()
    for n, p in m.named_parameters():
        assert_close(p.grad1, want[n], n)


def test_a_module_without_a_rule_returning_a_packed_sequence_is_refused():
    """The fallback cannot match a recomputation of one example with the rows of a
    PackedSequence it returns: refused, saying so."""

    class Packs(nn.Module):
        def __init__(self):
            super().__init__()
            self.gru, self.h0 = nn.GRU(3, 4, batch_first=True), nn.Parameter(torch.zeros(1, 1, 4))

        def forward(self, x, lengths):
            packed = pack_padded_sequence(x, lengths, batch_first=True)
            return self.gru(packed, self.h0.expand(-1, len(lengths), -1).contiguous())[0]

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.packs, self.out = Packs(), nn.Linear(4, 2)

        def forward(self, x, lengths):
            return self.out(pad_packed_sequence(self.packs(x, lengths), batch_first=True)[0])

    m = Model().double()
    x = torch.randn(3, 5, 3, dtype=D)
    with (
        gradhooks.add_hooks(m),
        pytest.raises(gradhooks.UnsupportedInputError, match="'packs'.*PackedSequence"),
    ):
        m(x, torch.tensor([5, 3, 2])).sum().backward()

"""Every torch internal gradhooks uses (``gradhooks._torch``) against its fallback.

For each internal with a fallback: a model where the internal is used (a spy on the module's
function sees it), run with it and with ``gradhooks._torch.disabled(name)``; both give the
oracle's numbers in float64. For each required one: ``add_hooks`` refuses, naming it. And no
private torch name is used outside ``gradhooks/_torch.py``.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import tokenize
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradhooks
from gradhooks import _torch
from gradhooks.oracle import loop_grad, vmap_grad
from harness import Between, assert_close, sum_of_squares


@pytest.fixture(autouse=True)
def _float64():
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def spy(monkeypatch, name: str) -> list:
    """Record what ``gradhooks._torch.<name>`` returns (the call sites look it up there)."""
    seen: list = []
    original = getattr(_torch, name)

    def wrapped(*args, **kwargs):
        out = original(*args, **kwargs)
        seen.append(out)
        return out

    monkeypatch.setattr(_torch, name, wrapped)
    return seen


def switched_off(name: str, off: bool):
    return _torch.disabled(name) if off else contextlib.nullcontext()


def grad1(model: nn.Module, *inputs, loss=sum_of_squares) -> dict:
    model.zero_grad()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        loss(model(*inputs)).backward()
    got = {n: p.grad1 for n, p in model.named_parameters() if p.requires_grad}
    gradhooks.clear_grad1(model)
    return got


def check_both_ways(
    name: str, model: nn.Module, *inputs, want: dict | None = None, seen=None, used=None
) -> None:
    """grad1 with the internal and with its fallback, each the vmap(grad) oracle's; where
    ``seen`` (a :func:`spy`'s list) is given, ``used(seen)`` must hold with the internal and
    not with the fallback."""
    if want is None:
        want = vmap_grad(model, sum_of_squares, inputs)
    for off in (False, True):
        if seen is not None:
            seen.clear()
        with switched_off(name, off):
            got = grad1(model, *inputs)
        if seen is not None:
            assert used(seen) != off, f"{name} (switched off: {off}): {seen}"
        assert got.keys() == want.keys()
        for n in want:
            assert_close(got[n], want[n], f"{name} (switched off: {off}): {n}")


# -- internals with a fallback -----------------------------------------------------------------


class _Tokens(nn.Module):
    """A Linear over positions, a position table added to the batch (an elementwise meeting),
    a LayerNorm and self-attention, these two optionally under non-reentrant checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 8)
        self.pos = nn.Parameter(torch.randn(5, 8))
        self.norm = nn.LayerNorm(8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = nn.Linear(8, 2)
        self.checkpointed = False

    def block(self, h):
        h = self.norm(h)
        return h + self.attn(h, h, h, need_weights=False)[0]

    def forward(self, x):
        h = self.inp(x) + self.pos
        h = checkpoint(self.block, h, use_reentrant=False) if self.checkpointed else self.block(h)
        return self.out(h)


def _tokens():
    torch.manual_seed(0)
    return _Tokens(), torch.randn(4, 5, 3)


def test_saved_tensor_hooks(monkeypatch):
    """Checkpointed and not: LayerNorm's saved statistics, attention's taps and
    the position table's expanded meeting are used only where no saved-tensor hooks are on;
    switched off, the hooks are taken to be on everywhere (all recomputed)."""
    seen = spy(monkeypatch, "saved_tensor_hooks_active")
    model, x = _tokens()
    check_both_ways("saved_tensor_hooks", model, x, seen=seen, used=lambda s: False in s)
    # Checkpointed (torch.func refuses checkpointing: the oracle runs without). The position
    # table is frozen: switched off, its meeting outside the checkpoint would be recomputed by
    # the fallback of the whole model, which torch.func cannot run under checkpointing.
    model.pos.requires_grad_(False)
    want = vmap_grad(model, sum_of_squares, x)
    model.checkpointed = True
    check_both_ways("saved_tensor_hooks", model, x, want=want)
    with _torch.disabled("saved_tensor_hooks"):
        assert _torch.saved_tensor_hooks_active()


def test_autograd_saved(monkeypatch):
    """LayerNorm's mean and rstd, self-attention's projection and context, as autograd saved
    them; switched off, the rules recompute them."""
    seen = spy(monkeypatch, "saved")
    model, x = _tokens()
    # (input, result1, result2, mat2, mat1 at least)
    used = lambda s: sum(isinstance(t, torch.Tensor) for t in s) >= 5  # noqa: E731
    check_both_ways("autograd_saved", model, x, seen=seen, used=used)
    node = model.inp(x).grad_fn
    assert _torch.saved(node, "no_such_field") is None
    with _torch.disabled("autograd_saved"):
        assert _torch.saved(node, "self") is None


def test_use_counts():
    """A Linear over positions writes the next grad1 into the last one's memory where
    nothing else holds it; switched off, every backward allocates anew, same numbers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
    batches = [torch.randn(4, 6, 3) for _ in range(3)]
    for off in (False, True):
        with switched_off("use_counts", off), gradhooks.add_hooks(model, "sum") as hooks:
            ptrs = []
            for x in batches:
                hooks.clear()
                model.zero_grad()
                sum_of_squares(model(x)).backward()
                want = vmap_grad(model, sum_of_squares, x)
                for n, p in model.named_parameters():
                    assert_close(p.grad1, want[n], f"use_counts (switched off: {off}): {n}")
                ptrs.append(model[0].weight.grad1.data_ptr())
        assert (len(set(ptrs)) == 1) != off, ptrs


def test_is_view(monkeypatch):
    """A Linear over positions gives a view; an in-place ReLU after it keeps the hooks (the
    output gets a node of its own), the last Linear's output is no view; switched off, every
    output gets one."""
    seen = spy(monkeypatch, "is_view")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(48, 2))
    check_both_ways("is_view", model, torch.randn(4, 6, 3), seen=seen, used=lambda s: False in s)


def test_view_base(monkeypatch):
    """An RNN cell stepped over a sequence-first tensor (``x[t]``, the same examples at every
    step) gives the loop's grad1 with the internal; switched off, the views' own strides take
    the steps for other rows of one batch, and the backward is refused. A batch in two chunks
    in one backward is refused both ways."""
    seen = spy(monkeypatch, "view_base")
    torch.manual_seed(0)
    cell = nn.RNNCell(3, 4)
    xs = torch.randn(5, 4, 3)

    def over_time(xs):
        h = torch.zeros(xs.shape[1], 4)
        for x in xs:
            h = cell(x, h)
        return h.square().sum()

    class Steps(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = cell

        def forward(self, x):  # (batch first, as the loop runs it)
            return over_time(x.transpose(0, 1))

    want = {
        n.split(".", 1)[1]: g
        for n, g in loop_grad(Steps(), lambda out: out, xs.transpose(0, 1)).items()
    }
    for off in (False, True):
        seen.clear()
        gradhooks.clear_grad1(cell)
        with switched_off("view_base", off), gradhooks.add_hooks(cell, loss_reduction="sum"):
            if off:
                with pytest.raises(gradhooks.MixedExamplesError, match="other examples"):
                    over_time(xs).backward()
                assert not hasattr(cell.weight_ih, "grad1")
            else:
                over_time(xs).backward()
                for n, p in cell.named_parameters():
                    assert_close(p.grad1, want[n], f"view_base: {n}")
        assert any(b is not None for b in seen) != off, seen
        lin, x = nn.Linear(3, 2), torch.randn(6, 3)
        with switched_off("view_base", off), gradhooks.add_hooks(lin):
            with pytest.raises(gradhooks.MixedExamplesError, match="rows 3 to 5"):
                torch.cat([lin(c) for c in x.chunk(2)]).square().sum().backward()
            assert lin.weight.grad is None and not hasattr(lin.weight, "grad1")


def test_mode_stack(monkeypatch):
    """The forward's tracker is taken off torch's mode stack while the hooks work: Linears
    over positions run detached (the tracker hands their calls detached aliases, and puts
    itself back for them), a position table meets the batch, self-attention carries its
    parameters on its input (the tracker follows the carrying node made in its pre-hook);
    switched off, the tracker stays on, paused, and the numbers are the same."""
    seen = spy(monkeypatch, "pop_mode")
    model, x = _tokens()
    with gradhooks.tuned(sum_grad1_positions=1):
        check_both_ways("mode_stack", model, x, seen=seen, used=lambda s: True in s)
    with _torch.disabled("mode_stack"):
        assert not _torch.pop_mode(object())


class _Mixer(nn.Module):
    """No rule: the fallback runs its forward under torch.func, its hooked Linear inside."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return torch.linalg.matrix_exp(0.1 * self.w).mm(self.lin(x).T).T.sin()


def test_functorch_stack(monkeypatch):
    """Inside torch.func transforms (the fallback rule's vmap, the Jacobians' vmap, a user's
    vmap over the hooked model) nothing is captured and the pieces and LayerNorm's rule write
    out of place; switched off, gradhooks' own transforms are marked and the call's tensors
    are looked at."""
    seen = spy(monkeypatch, "in_transform")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), _Mixer(), nn.Linear(4, 2))
    x = torch.randn(5, 3)
    want = vmap_grad(model, sum_of_squares, x)
    input_grads = torch.func.vmap(torch.func.grad(lambda xi: model(xi[None]).pow(2).sum()))
    want_input = input_grads(x)
    want_jac = torch.func.vmap(
        torch.func.jacrev(lambda p, xi: torch.func.functional_call(model, p, (xi[None],))[0]),
        in_dims=(None, 0),
    )(dict(model.named_parameters()), x)
    for off in (False, True):
        with switched_off("functorch_stack", off):
            jac = gradhooks.jacobians(model, x)
            with gradhooks.add_hooks(model, loss_reduction="sum") as hooks:
                assert [n for n, _ in hooks.fallback_modules()] == ["2"]
                got_input = input_grads(x)  # a user's transforms: nothing captured
                assert not any(hasattr(p, "grad1") for p in model.parameters())
                sum_of_squares(model(x)).backward()
            for n, p in model.named_parameters():
                assert_close(p.grad1, want[n], f"functorch_stack (switched off: {off}): {n}")
                assert_close(jac[n], want_jac[n], f"functorch_stack ({off}): jacobian {n}")
            assert_close(got_input, want_input, f"functorch_stack ({off}): input-gradients")
            gradhooks.clear_grad1(model)
            model.zero_grad()
    assert True in seen and False in seen


def test_functorch_batched(monkeypatch):
    """The Jacobians and K-FAC's exact Fisher run their backwards under vmap and read the
    batched pieces (a Linear's, a convolution's, an embedding's rows); switched off, one
    backward per output-gradient, the same numbers."""
    seen = spy(monkeypatch, "unbatched")
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(7, 2)
            self.conv = nn.Conv1d(2, 3, 3)
            self.fc = nn.Linear(3 * 4, 3)

        def forward(self, tokens):
            h = self.conv(self.emb(tokens).transpose(1, 2)).tanh()
            return self.fc(h.flatten(1))

    model = Net()
    tokens = torch.randint(7, (4, 6))
    params = dict(model.named_parameters())
    want = torch.func.vmap(
        torch.func.jacrev(lambda p, t: torch.func.functional_call(model, p, (t[None],))[0]),
        in_dims=(None, 0),
    )(params, tokens)
    got = gradhooks.jacobians(model, tokens)
    with _torch.disabled("functorch_batched"):
        assert not _torch.batched_backwards()
        fallback = gradhooks.jacobians(model, tokens)
        flat = gradhooks.jacobians(model, tokens, flatten=True)
    for n in want:
        assert_close(got[n], want[n], f"functorch_batched (internal): jacobian {n}")
        assert_close(fallback[n], want[n], f"functorch_batched (fallback): jacobian {n}")
    assert_close(flat, torch.cat([want[n].flatten(2) for n in params], -1), "flattened")
    assert any(isinstance(t, torch.Tensor) for t in seen)

    mlp = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4))
    x = torch.randn(6, 3)
    kf = gradhooks.kfac(mlp, x, fisher="exact")
    with _torch.disabled("functorch_batched"):
        kf_fallback = gradhooks.kfac(mlp, x, fisher="exact")
    assert kf.keys() == kf_fallback.keys()
    for k in kf:
        assert_close(kf_fallback[k].A, kf[k].A, f"kfac A {k}")
        assert_close(kf_fallback[k].G, kf[k].G, f"kfac G {k}")


def _lstm_case(dtype=torch.float64):
    torch.manual_seed(0)
    rnn = nn.LSTM(3, 4, 2, bidirectional=True, batch_first=True).to(dtype)
    x = torch.randn(5, 6, 3, dtype=dtype, requires_grad=True)
    hx = tuple(torch.randn(4, 5, 4, dtype=dtype, requires_grad=True) for _ in range(2))
    return rnn, x, hx


def _lstm_loss(out):
    out, (h, c) = out
    return out.pow(2).sum() + h.pow(2).sum() + c.sum()


def _lstm_per_example(rnn, x, hx) -> dict:
    """The per-example loop (the initial state is split with the examples, on dimension 1)."""
    x, hx = x.detach(), [t.detach() for t in hx]
    rows = [
        torch.autograd.grad(
            _lstm_loss(rnn(x[i : i + 1], tuple(t[:, i : i + 1] for t in hx))),
            list(rnn.parameters()),
        )
        for i in range(x.shape[0])
    ]
    return {n: torch.stack(g) for (n, _), g in zip(rnn.named_parameters(), zip(*rows))}


def _run_lstm(rnn, x, hx):
    """grad1 and the input-, h0- and c0-gradients of a hooked LSTM (its calls own their
    backward: the rule gives the input-gradients)."""
    for t in (x, *hx):
        t.grad = None
    rnn.zero_grad()
    with gradhooks.add_hooks(rnn, loss_reduction="sum"):
        _lstm_loss(rnn(x, hx)).backward()
    got = {n: p.grad1 for n, p in rnn.named_parameters()}
    gradhooks.clear_grad1(rnn)
    return got, [t.grad.clone() for t in (x, *hx)]


def test_fused_lstm(monkeypatch):
    """A two-layer bidirectional LSTM with an initial state: the lower layer's states come
    from torch's fused LSTM (its call recognized, run one layer at a time); switched off, from
    the rule's own recurrence. grad1 the oracle's, the input-gradients autograd's."""
    from gradhooks.rules import rnn as rules

    by_layer = []
    original = rules._LayerOutputs._by_layer
    monkeypatch.setattr(
        rules._LayerOutputs, "_by_layer", lambda *a: by_layer.append(1) or original(*a)
    )
    rnn, x, hx = _lstm_case()
    ref = copy.deepcopy(rnn)
    _lstm_loss(ref(x, hx)).backward()
    want_in = [t.grad.clone() for t in (x, *hx)]
    want = _lstm_per_example(rnn, x, hx)
    for off in (False, True):
        with switched_off("fused_lstm", off):
            got, grads_in = _run_lstm(rnn, x, hx)
        for n in want:
            assert_close(got[n], want[n], f"fused_lstm (switched off: {off}): {n}")
        for g, w in zip(grads_in, want_in, strict=True):
            assert_close(g, w, f"fused_lstm (switched off: {off}): input-gradient")
        assert bool(by_layer) != off
        by_layer.clear()


def test_python_dispatcher(monkeypatch):
    """vmap_grad of a model with an RNN runs under torch's Python dispatcher; switched off,
    it is the per-example loop: the same numbers."""
    seen = spy(monkeypatch, "python_dispatcher")
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.GRU(3, 4, batch_first=True)
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(self.rnn(x)[0][:, -1])

    model, x = Net(), torch.randn(4, 5, 3)
    want = loop_grad(model, sum_of_squares, x)
    got = vmap_grad(model, sum_of_squares, x)
    with _torch.disabled("python_dispatcher"):
        fallback = vmap_grad(model, sum_of_squares, x)
    for n in want:
        assert_close(got[n], want[n], f"python_dispatcher (internal): {n}")
        assert_close(fallback[n], want[n], f"python_dispatcher (fallback): {n}")
    assert seen[0] is not None and seen[1] is None


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"),
        lambda: nn.Conv2d(2, 3, (3, 2), padding=(2, 1), padding_mode="circular"),
        lambda: nn.Conv2d(2, 3, (4, 3), padding="same", dilation=(1, 2), padding_mode="replicate"),
        lambda: nn.Conv1d(2, 3, 4, padding="same"),
        lambda: nn.Conv3d(2, 2, 3, padding="valid"),
        lambda: nn.Conv1d(2, 3, 3, padding=2),
    ],
    ids=["reflect", "circular", "same-dilated", "same-even", "valid", "zeros"],
)
def test_conv_padding(make):
    """The padding a convolution's forward applies, read from the module; switched off,
    computed from its public attributes: the same padding, the same grad1."""
    torch.manual_seed(0)
    conv = make()
    pads = _torch.conv_padding(conv)
    with _torch.disabled("conv_padding"):
        assert _torch.conv_padding(conv) == pads
    spatial = {nn.Conv1d: (9,), nn.Conv2d: (7, 8), nn.Conv3d: (5, 6, 5)}[type(conv)]
    x = torch.randn(3, 2, *spatial)
    features = conv(x)[0].numel()
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(features, 2))
    check_both_ways("conv_padding", model, x)


@pytest.mark.parametrize("off", [False, True], ids=["internal", "fallback"])
def test_op_schema(off):
    """The dimension of an operation the tracker has no handler for, passed by position
    (``torch.special.softmax(h, 0)``, along the batch): refused either way; along the
    features, by keyword or by position, each example's own gradient either way."""
    assert _torch.dim_arguments("special_softmax", (torch.zeros(2), 0), {}) == [0]
    with switched_off("op_schema", off):
        for along in (
            lambda h: torch.special.softmax(h, 0),
            lambda h: torch.special.softmax(h, 0, torch.float64),
        ):
            model = Between(along).double()
            with gradhooks.add_hooks(model, loss_reduction="sum"):
                with pytest.raises(
                    gradhooks.MixedExamplesError, match="computed across the examples"
                ):
                    model(torch.randn(4, 3, dtype=torch.float64))
        for along in (
            lambda h: torch.special.softmax(h, dim=1),
            lambda h: torch.special.softmax(h, 1) * h,
        ):
            model = Between(along).double()
            x = torch.randn(4, 3, dtype=torch.float64)
            want = vmap_grad(model, sum_of_squares, x)
            with gradhooks.add_hooks(model, loss_reduction="sum"):
                sum_of_squares(model(x)).backward()
            for n, p in model.named_parameters():
                assert_close(p.grad1, want[n], n)


class KeywordInput(nn.Module):
    """A frozen ``F.linear`` given the batch by keyword, then the batch moved to dimension 1
    (a layer that sees ``[T, B, F]``), with as many positions as examples."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Parameter(torch.randn(4, 4), requires_grad=False)
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        h = torch.nn.functional.linear(input=x, weight=self.frozen)
        return self.head(h.transpose(0, 1)).transpose(0, 1)


@pytest.mark.parametrize("off", [False, True], ids=["internal", "fallback"])
def test_op_schema_puts_keyword_arguments_in_place(off):
    """The arguments of ``F.linear(input=x, weight=w)`` in their places: the tracker follows
    the batch through it, and the layer after the transpose gets each example's own gradient;
    switched off, the layout is unknown there, and the call is refused rather than read from
    the wrong dimension (the first backward's check of one example)."""
    assert _torch.positional("linear", (), {"input": 1, "weight": 2}) == ((1, 2), {})
    torch.manual_seed(0)
    model = KeywordInput().double()
    x = torch.randn(3, 3, 4, dtype=torch.float64)
    want = loop_grad(model, sum_of_squares, x)
    with switched_off("op_schema", off), gradhooks.add_hooks(model, loss_reduction="sum"):
        if off:
            with pytest.raises(gradhooks.CheckFailedError, match="grad1 is not the examples' own"):
                sum_of_squares(model(x)).backward()
            return
        sum_of_squares(model(x)).backward()
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert_close(p.grad1, want[n], n)


@pytest.mark.parametrize("off", [False, True], ids=["internal", "fallback"])
@pytest.mark.parametrize("head", [True, False], ids=["head", "ode-last"])
def test_autograd_node(monkeypatch, off, head):
    """An adjoint ODE's backward takes its parameters' gradients with torch.autograd.grad
    inside the model's backward: refused with the internal, and with its fallback too (the
    inner backward's calls ran their forward during a backward, or the outer backward reached
    a hooked call first), whether or not a hooked layer comes after the ODE; grad1 unwritten."""
    from test_nested_backward import ODENet

    seen = spy(monkeypatch, "enclosing_backward")
    torch.manual_seed(0)
    model = ODENet(head).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    with switched_off("autograd_node", off), gradhooks.add_hooks(model):
        with pytest.raises(gradhooks.UnsupportedError, match="inside another backward"):
            sum_of_squares(model(x)).backward()
    assert not any(hasattr(p, "grad1") for p in model.parameters())
    assert (True in seen) != off and (None in seen) == off, seen


@pytest.mark.parametrize("off", [False, True], ids=["internal", "fallback"])
def test_engine_executes(monkeypatch, off):
    """A ``torch.autograd.grad`` backward of a new forward, right after a ``backward()`` that
    added to ``.grad``: with the internal, its ``grad1`` starts afresh (that forward's
    examples' own); with the fallback, it adds to what the ``backward()`` left."""
    seen = spy(monkeypatch, "adds_to_grad")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x1, x2 = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    first, second = vmap_grad(model, sum_of_squares, x1), vmap_grad(model, sum_of_squares, x2)
    with switched_off("engine_executes", off), gradhooks.add_hooks(model, loss_reduction="sum"):
        sum_of_squares(model(x1)).backward()
        torch.autograd.grad(sum_of_squares(model(x2)), list(model.parameters()))
    for n, p in model.named_parameters():
        want = second[n] if not off else first[n] + second[n]
        assert_close(p.grad1, want, n)
    assert (False in seen) != off and all(s is None for s in seen) == off, seen


class _RNNOutput(nn.Module):
    """An RNN's output (of its two, output and state), as the model's output."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.RNN(3, 2, batch_first=True)

    def forward(self, x):
        return self.rnn(x)[0]


class _CellOutput(nn.Module):
    """An LSTM cell's state ``h`` (of its two outputs, ``h`` and ``c``), as the model's output:
    a call autograd runs (an ``nn.RNN`` on a padded input runs with grad mode off, its rule
    giving every gradient through one node)."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(3, 2)

    def forward(self, x):
        return self.cell(x)[0]


@pytest.mark.parametrize("off", [False, True], ids=["internal", "fallback"])
def test_engine_executes_for_a_backward_rooted_at_a_calls_output(off):
    """``out.backward(v)`` where ``out`` is one of a hooked call's several outputs: with the
    internal, :func:`gradhooks._torch.all_grads_hook` counts the backward's root and the call
    gets its gradients (``grad1`` is the oracle's); with the fallback, torch's
    ``register_multi_grad_hook`` waits for the root forever: no ``grad1``, and a warning that
    no call was captured for those parameters."""
    torch.manual_seed(0)
    model = _CellOutput().double()
    x = torch.randn(3, 3, dtype=torch.float64)
    v = torch.randn(3, 2, dtype=torch.float64)
    want = loop_grad(model, lambda out, t: (out * t).sum(), x, v)
    with switched_off("engine_executes", off), gradhooks.add_hooks(model, loss_reduction="sum"):
        if off:
            with pytest.warns(gradhooks.GradhooksWarning, match="no forward call"):
                model(x).backward(v)
        else:
            model(x).backward(v)
    for n, p in model.named_parameters():
        if off:
            assert not hasattr(p, "grad1"), n
        else:
            assert_close(p.grad1, want[n], n)


@pytest.mark.parametrize("off", [False, True], ids=["internal", "fallback"])
def test_jacobians_of_a_model_returning_a_calls_output(off):
    """``gradhooks.jacobians`` of a model that returns an RNN's output as it is: each
    backward is rooted at that output. With the internal, the Jacobians are the oracle's; with
    the fallback, whose hook never fires, the hooks write none for the RNN, and autograd
    still finds a path to its parameters: refused, not zeros."""
    torch.manual_seed(0)
    model = _RNNOutput().double()
    x = torch.randn(3, 4, 3, dtype=torch.float64)
    want = {n: torch.zeros(3, 4, 2, *p.shape, dtype=torch.float64)
            for n, p in model.named_parameters()}  # fmt: skip
    for i in range(3):
        jac = torch.func.jacrev(
            lambda params, i=i: torch.func.functional_call(model, params, x[i : i + 1])[0]
        )(dict(model.named_parameters()))
        for n in want:
            want[n][i] = jac[n]
    with switched_off("engine_executes", off):
        if off:
            with pytest.raises(gradhooks.CheckFailedError, match=r"depend on 'rnn\.weight_ih_l0'"):
                gradhooks.jacobians(model, x)
        else:
            got = gradhooks.jacobians(model, x)
            for n in want:
                assert_close(got[n], want[n].flatten(1, 2), n)


def test_foreach(monkeypatch):
    """The DP step divides its noised sums with ``torch._foreach_div_``; switched off, a loop
    over the parameters: the same numbers, bit for bit."""
    seen = spy(monkeypatch, "foreach_div_")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(5, 3)
    got = []
    for off in (False, True):
        twin = copy.deepcopy(model)
        with switched_off("foreach", off), gradhooks.add_hooks(twin, quantities=("norms",)) as h:
            losses = twin(x).square().sum(1)
            gradhooks.dp_sgd_step(
                h, losses, max_norm=0.1, noise_multiplier=0.5, expected_batch_size=4.0,
                generator=torch.Generator().manual_seed(3),
            )  # fmt: skip
        got.append([p.grad for p in twin.parameters()])
    assert seen, "the DP step did not divide its sums through foreach_div_"
    assert all(torch.equal(a, b) for a, b in zip(*got, strict=True))


@contextlib.contextmanager
def _bf16_setting(holder):
    """``holder.fp32_precision`` set to ``"bf16"`` for the block. torch.backends' own and
    oneDNN's setting refuse a plain assignment once torch's test utilities froze the flags
    (the tracker's OpInfo sweep imports them): set through their ``flags()`` there."""
    b = torch.backends
    if holder is b:
        with b.flags(fp32_precision="bf16"):
            yield
    elif holder is b.mkldnn:
        with b.mkldnn.flags(
            enabled=b.mkldnn.enabled, deterministic=b.mkldnn.deterministic, fp32_precision="bf16"
        ):
            yield
    elif holder is None:
        yield
    else:
        old = holder.fp32_precision
        holder.fp32_precision = "bf16"
        try:
            yield
        finally:
            holder.fp32_precision = old


@pytest.mark.parametrize(
    "setting", [None, "generic", "mkldnn", "matmul", "conv", "rnn"], ids=lambda s: str(s)
)
def test_fp32_precision(monkeypatch, setting):
    """A forward reads torch.backends' ``fp32_precision`` settings from torch's C++ side;
    switched off, through the attributes: the same settings either way, each one of them set
    to ``"bf16"`` in turn, and a forward's checks take its products as bfloat16 after it."""
    from gradhooks.engine.records import float32_products

    b = torch.backends
    holders = {
        "generic": b, "mkldnn": b.mkldnn, "matmul": b.mkldnn.matmul, "conv": b.mkldnn.conv,
        "rnn": b.mkldnn.rnn,
    }  # fmt: skip
    if not hasattr(b.mkldnn.matmul, "fp32_precision") and not _torch.available("fp32_precision"):
        pytest.skip("no fp32_precision settings in this torch")
    seen = spy(monkeypatch, "fp32_precisions")
    holder = holders.get(setting)
    with _bf16_setting(holder):
        ways = []
        for off in (False, True):
            with switched_off("fp32_precision", off):
                ways.append((_torch.fp32_precisions(), float32_products()))
        assert ways[0] == ways[1]
        assert ways[0][1] is (None if holder is None else torch.bfloat16)
        model = nn.Linear(3, 2)
        with gradhooks.add_hooks(model):
            model(torch.randn(4, 3)).sum().backward()
    assert seen, "a forward did not read the settings through fp32_precisions"


@pytest.mark.parametrize("off", [False, True], ids=["internal", "fallback"])
def test_eval_frame(monkeypatch, off):
    """``torch.compile(model)`` of a hooked model (the forward pre-hook of a model of its own
    code: dynamo compiles that frame): the internal turns compilation off there, the fallback
    runs the hooks through ``torch.compiler.disable``; grad1 the oracle's both ways, twice
    (the code dynamo made reused)."""
    dynamo = pytest.importorskip("torch._dynamo")
    seen = spy(monkeypatch, "leave_compiled")
    torch.manual_seed(0)
    model = Between(lambda h: h * 2 + 1)
    x = torch.randn(4, 3)
    want = vmap_grad(model, sum_of_squares, x)
    dynamo.reset()
    try:
        with switched_off("eval_frame", off), gradhooks.add_hooks(model, loss_reduction="sum") as h:
            compiled = torch.compile(model)
            for step in range(2):
                h.clear()
                sum_of_squares(compiled(x)).backward()
                for n, p in model.named_parameters():
                    assert_close(p.grad1, want[n], f"eval_frame (off: {off}), step {step}: {n}")
    finally:
        dynamo.reset()
    assert (True in seen) != off, seen


def test_put_tensor_hook_first():
    """A gradient hook put first runs before those registered earlier (autograd walks the
    dict's entries in the order they were put in), sees autograd's own gradient, and still
    comes off with its handle; the others run as before, in their order."""
    p = nn.Parameter(torch.ones(3))
    seen = []
    p.register_hook(lambda g: seen.append(("a", g.clone())) or g * 0.5)
    p.register_hook(lambda g: seen.append(("b", g.clone())))
    ours = p.register_hook(lambda g: seen.append(("ours", g.clone())))
    _torch.put_tensor_hook_first(p, ours.id)
    (2 * p).sum().backward()
    assert [k for k, _ in seen] == ["ours", "a", "b"]
    assert torch.equal(seen[0][1], torch.full((3,), 2.0))
    assert torch.equal(seen[2][1], torch.ones(3)) and torch.equal(p.grad, torch.ones(3))
    ours.remove()
    seen.clear()
    (2 * p).sum().backward()
    assert [k for k, _ in seen] == ["a", "b"]


@pytest.mark.parametrize("off", [False, True], ids=["internal", "fallback"])
def test_mutation_on_saved(off):
    """Under ``allow_mutation_on_saved_tensors()``, the batch changed in place after the
    forward: with the internal, grad1 is the oracle's of the batch the forward saw (the engine
    kept a copy, as autograd did); with the fallback, the change is refused as outside the
    context (a ``StateError``), never a grad1 of the changed batch."""
    from torch.autograd.graph import allow_mutation_on_saved_tensors

    torch.manual_seed(0)
    model = Between(lambda h: h * 2 + 1).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    want = vmap_grad(model, sum_of_squares, x)
    assert not _torch.mutation_on_saved_allowed()
    with switched_off("mutation_on_saved", off), gradhooks.add_hooks(model, loss_reduction="sum"):
        with allow_mutation_on_saved_tensors():
            assert _torch.mutation_on_saved_allowed() != off
            batch = x.clone()
            loss = sum_of_squares(model(batch))
            batch.mul_(3.0)
            if off:
                with pytest.raises(gradhooks.StateError):
                    loss.backward()
                return
            loss.backward()
    for n, p in model.named_parameters():
        assert_close(p.grad1, want[n], f"mutation_on_saved: {n}")


# -- required internals ------------------------------------------------------------------------

REQUIRED = [
    "graph_task_id", "backward_callback", "version_counter", "module_state", "pytree",
    "tensor_impl",
]  # fmt: skip


@pytest.mark.parametrize("name", REQUIRED)
def test_required_internal_missing_is_refused(name):
    """Without a required internal, add_hooks refuses, naming it and what it reads."""
    model = nn.Linear(2, 2)
    with _torch.disabled(name), pytest.raises(gradhooks.UnsupportedError, match=name) as e:
        gradhooks.add_hooks(model)
    assert _torch.INTERNALS[name].reads.split(",")[0] in str(e.value)
    with gradhooks.add_hooks(model):  # (nothing was left behind)
        pass


def test_a_torch_without_internals(tmp_path):
    """Where torch lacks internals, gradhooks imports with a GradhooksWarning naming them and
    their fallbacks, uses the fallbacks, and refuses to hook where a required one is missing."""
    script = tmp_path / "without.py"
    script.write_text(
        textwrap.dedent(
            """
            import warnings
            import torch
            del torch._C._functorch.peek_interpreter_stack
            del torch._C._storage_Use_Count
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                import gradhooks
            from gradhooks import _torch
            print(_torch.missing())
            print([str(w.message) for w in caught if w.category is gradhooks.GradhooksWarning])
            model = torch.nn.Linear(3, 2)
            with gradhooks.add_hooks(model, loss_reduction="sum"):
                model(torch.randn(4, 3)).pow(2).sum().backward()
            print(tuple(model.weight.grad1.shape))
            del torch._C._current_graph_task_id
            import importlib
            importlib.reload(_torch)
            try:
                _torch.require()
            except RuntimeError as e:
                print(e)
            """
        )
    )
    root = pathlib.Path(_torch.__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert run.returncode == 0, run.stderr
    missing, warned, shape, refused = run.stdout.splitlines()[:4]
    assert missing == "['functorch_stack', 'use_counts']"
    assert "peek_interpreter_stack" in warned and "_storage_Use_Count" in warned
    assert shape == "(4, 2, 3)"
    assert "graph_task_id (torch._C._current_graph_task_id)" in refused


@pytest.mark.parametrize("off", [False, True], ids=["internal", "fallback"])
def test_keep_graph(off):
    """A training loop that keeps its last loss until the next forward (three steps, SGD):
    with the internal, each step's hooked inputs are let go of at the next forward, the
    backward having not kept its graph; with the fallback, they live as long as the loss. The
    same grad1, the oracle's, both ways."""
    from gradhooks.oracle import loop_grad

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with switched_off("keep_graph", off), gradhooks.add_hooks(model, loss_reduction="sum"):
        loss, last = None, None
        for step in range(3):
            x = torch.randn(5, 3, dtype=torch.float64)
            want = loop_grad(model, sum_of_squares, x)
            model.zero_grad()
            out = model(x)
            if step:
                assert (last() is None) != off, (
                    f"step {step - 1}'s input alive: {last() is not None}"
                )
            last = weakref.ref(x)
            loss = sum_of_squares(out)
            loss.backward()
            for n, p in model.named_parameters():
                assert_close(p.grad1, want[n], f"step {step}, {n}")
            opt.step()
        del loss, out


# -- the list itself ---------------------------------------------------------------------------

TESTED = {
    "saved_tensor_hooks": test_saved_tensor_hooks,
    "autograd_saved": test_autograd_saved,
    "use_counts": test_use_counts,
    "is_view": test_is_view,
    "functorch_stack": test_functorch_stack,
    "functorch_batched": test_functorch_batched,
    "fused_lstm": test_fused_lstm,
    "python_dispatcher": test_python_dispatcher,
    "conv_padding": test_conv_padding,
    "op_schema": test_op_schema,
    "autograd_node": test_autograd_node,
    "engine_executes": test_engine_executes,
    "mode_stack": test_mode_stack,
    "view_base": test_view_base,
    "eval_frame": test_eval_frame,
    "keep_graph": test_keep_graph,
    "mutation_on_saved": test_mutation_on_saved,
    "foreach": test_foreach,
    "fp32_precision": test_fp32_precision,
    **{name: test_required_internal_missing_is_refused for name in REQUIRED},
}


def test_every_internal_is_listed_documented_and_tested():
    assert set(TESTED) == set(_torch.INTERNALS)
    assert {n for n, i in _torch.INTERNALS.items() if i.required} == set(REQUIRED)
    for name, internal in _torch.INTERNALS.items():
        assert f"``{name}``" in _torch.__doc__, f"{name} is not in gradhooks._torch's docstring"
        assert internal.required or internal.fallback, f"{name} has no fallback"


def test_disabled_names_must_exist():
    with pytest.raises(gradhooks.ConfigurationError), _torch.disabled("nope"):
        pass
    with _torch.disabled("is_view"):
        with _torch.disabled("is_view", "use_counts"):
            assert not _torch.available("use_counts")
        assert not _torch.available("is_view") and _torch.available("use_counts")
    assert _torch.available("is_view")


# Private torch names in code: an underscore attribute of torch (torch._C, torch._VF,
# torch.utils._pytree, nn.modules.module._global_forward_hooks...), a field torch keeps private
# on its tensors, modules and autograd nodes, an internal op.
_PRIVATE = re.compile(
    r"\btorch(\.\w+)*\._\w"
    r"|\bnn(\.\w+)*\._\w"
    r"|\.(_version|_base|_is_view|_use_count|_cdata|_parameters|_buffers|_modules"
    r"|_forward_hooks|_forward_pre_hooks|_backward_hooks|_execution_engine"
    r"|_reversed_padding_repeated_twice|_qkv_same_embed_dim|_get_no_batch_dim"
    r"|_flat_weights|_saved_\w+)\b"
    r"|\btorch\.ops\.aten\.mkldnn"
)
# ... or such a field named in a string (getattr(node, "_saved_mat1"))
_PRIVATE_STRING = re.compile(
    r"[rbf]*[\"'](_saved_\w*|_version|_use_count|_is_view|_parameters|_forward_hooks"
    r"|_forward_pre_hooks|_current_graph_task_id|_top_saved_tensors_default_hooks"
    r"|_storage_Use_Count|_reversed_padding_repeated_twice|_qkv_same_embed_dim)[\"']"
)
_TEXT = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", -1)}


def private_uses(source: str) -> list[tuple[int, str]]:
    """(line, code) of every private torch name in ``source``'s code (not in its docstrings
    and comments, which may name them)."""
    lines = source.splitlines()
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.STRING and _PRIVATE_STRING.fullmatch(tok.string):
            found.append((tok.start[0], tok.string))
        if tok.type in _TEXT:  # blanked out
            (r0, c0), (r1, c1) = tok.start, tok.end
            for r in range(r0, r1 + 1):
                line = lines[r - 1]
                a, b = (c0 if r == r0 else 0), (c1 if r == r1 else len(line))
                lines[r - 1] = line[:a] + " " * (b - a) + line[b:]
    found += [(i, line.strip()) for i, line in enumerate(lines, 1) if _PRIVATE.search(line)]
    return found


def test_no_private_torch_name_outside_the_module():
    """Every private torch name gradhooks uses is reached through gradhooks/_torch.py."""
    root = pathlib.Path(_torch.__file__).parent
    found = [
        f"{path.relative_to(root)}:{line}: {text}"
        for path in sorted(root.rglob("*.py"))
        if path.name != "_torch.py"
        for line, text in private_uses(path.read_text())
    ]
    assert not found, "private torch names outside gradhooks/_torch.py:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "used",
    [
        "torch._C._functorch.peek_interpreter_stack()",
        "x = node._saved_mat2",
        "getattr(node, '_saved_mat1')",
        "ok = t._use_count() == 1",
        "torch._VF.lstm(x)",
        "from torch.utils._pytree import tree_map",
        "import torch._dynamo",
        "module._parameters[n] = p",
        "v = x._version",
        "f = nn.modules.module._global_forward_hooks",
        "torch.ops.aten.mkldnn_rnn_layer(x)",
    ],
)
def test_the_scan_finds_private_names(used):
    assert private_uses(used + "\n"), used
    assert not private_uses(f'x = """{used}"""  # {used}\n') or "_saved_mat1" in used

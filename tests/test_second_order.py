"""Differentiating through grad1: a create_graph backward gives grad1 with a graph, and the
derivative of a function of it matches a per-example loop in float64, for every layer, RNN
calls on packed sequences, time-major or with an initial state included."""

from __future__ import annotations

import copy

import pytest
import torch
from cases import CASES, Case, _first, _head, _last_step, _SelfAttention, _seq
from test_fallback import CASES as FALLBACK_CASES
from test_fallback import _only
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import gradhooks
from gradhooks.oracle import loop_grad
from gradhooks.rules import fallback
from harness import _double, assert_close, cpu_only

BATCH = 3
NO_DOUBLE_BACKWARD = {"embedding_bag"}  # torch has no derivative of its backward

# The paths taken from TUNING.sum_grad1_positions (32) positions on: parameters run detached
# (Linear, convolution), the in-projection carried by the input (self-attention).
MANY_POSITIONS = [
    Case(
        "conv_many_positions",
        _seq(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Conv2d(3, 2, 3, padding=1), nn.Flatten()),
        lambda b: torch.randn(b, 2, 6, 6),
    ),
    Case(
        "linear_many_positions",
        _seq(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3), nn.Flatten()),
        lambda b: torch.randn(b, 40, 4),
    ),
    Case("attention_carried", _head(_SelfAttention, 4, _first), lambda b: torch.randn(b, 40, 4)),
]
# RNNs in a create_graph backward go through the torch.func fallback: more of their options
RNN_OPTIONS = [
    Case(
        "lstm_layers_bidirectional",
        _head(lambda: nn.LSTM(3, 4, 2, batch_first=True, bidirectional=True), 8, _last_step),
        lambda b: torch.randn(b, 5, 3),
    ),
    Case(
        "gru_layers",
        _head(lambda: nn.GRU(3, 4, 2, batch_first=True), 4, _last_step),
        lambda b: torch.randn(b, 5, 3),
    ),
]


def _loss(case: Case, out, target):
    return case.loss(out) if target is None else case.loss(out, target)


@pytest.mark.parametrize("case", CASES + MANY_POSITIONS + RNN_OPTIONS, ids=repr)
def test_derivative_of_a_function_of_grad1(case):
    if case.id in NO_DOUBLE_BACKWARD:
        pytest.skip("torch cannot differentiate this layer's backward")
    _check(case)


@pytest.mark.parametrize("loop", [False, True], ids=["vmap", "loop"])
@pytest.mark.parametrize("case", FALLBACK_CASES, ids=repr)
def test_derivative_of_a_function_of_grad1_by_the_fallback(case, loop, monkeypatch):
    """Every layer but Linear through the torch.func fallback, which differentiates a
    create_graph backward one example at a time by autograd (under vmap, torch drops the graph
    from layer_norm's gradients to its input: the LayerNorm case), also where vmap fails."""
    _check(case, loop=loop, monkeypatch=monkeypatch, registry=_only(nn.Linear))


def _check(case: Case, loop: bool = False, monkeypatch=None, **hook_kwargs) -> None:
    """d/dθ Σ_b w_b ‖grad1_b‖² (random w_b > 0, every trainable parameter) from gradhooks'
    grad1 of a create_graph backward, against a per-example loop; grad1's value too."""
    torch.manual_seed(0)
    model = case.model().double()
    inputs = _double(case.inputs(BATCH))
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    target = case.target(BATCH) if case.target else None
    weights = torch.rand(BATCH, dtype=torch.double) + 0.5  # each example's own weight

    # the oracle: each example's gradient with a graph, one example at a time
    ref = copy.deepcopy(model)
    ref_params = [p for p in ref.parameters() if p.requires_grad]
    per_example, objective = [], 0
    # torch's fused attention has no double backward on CPU: the math kernel, both sides
    with sdpa_kernel(SDPBackend.MATH):
        for b in range(BATCH):
            t = None if target is None else target[b : b + 1]
            out = ref(*(a[b : b + 1] for a in args))
            grads = torch.autograd.grad(_loss(case, out, t), ref_params, create_graph=True)
            per_example.append(grads)
            objective = objective + weights[b] * sum(g.pow(2).sum() for g in grads)
        want = torch.autograd.grad(objective, ref_params, allow_unused=True)

        params = [p for p in model.parameters() if p.requires_grad]
        if loop:  # torch.func's vmap fails on every module: the fallback's loop instead

            def no_vmap(*args, **kwargs):
                def fail(*args, **kwargs):
                    raise RuntimeError("vmap is not available in this test")

                return fail

            monkeypatch.setattr(fallback, "vmap", no_vmap)
        with gradhooks.add_hooks(model, loss_reduction="sum", **hook_kwargs) as h:
            torch.autograd.grad(_loss(case, model(*args), target), params, create_graph=True)
            for i, p in enumerate(params):
                value = torch.stack([grads[i] for grads in per_example]).detach()
                assert_close(p.grad1.detach(), value, f"{case.id}: grad1 of parameter {i}")
            value = sum((weights * p.grad1.pow(2).reshape(BATCH, -1).sum(1)).sum() for p in params)
            with h.paused():
                got = torch.autograd.grad(value, params, allow_unused=True)
    for i, (g, w, p) in enumerate(zip(got, want, params, strict=True)):
        g = torch.zeros_like(p) if g is None else g
        w = torch.zeros_like(p) if w is None else w
        assert_close(g, w, f"{case.id}: d Σ_b w_b ‖grad1_b‖² / d parameter {i}")


@cpu_only("a call runs detached (its batch gradient from grad1) on the CPU alone")
@pytest.mark.parametrize("case", MANY_POSITIONS, ids=repr)
def test_many_positions_cases_take_their_paths(case):
    """The MANY_POSITIONS cases' first layer runs its parameters detached (else they test
    nothing more than the small cases)."""
    model = case.model()
    first = next(m for m in model.modules() if gradhooks.REGISTRY.lookup(m) is not None)
    x = case.inputs(BATCH)
    args = (x, x, x) if isinstance(first, nn.MultiheadAttention) else (x,)
    assert gradhooks.REGISTRY.lookup(first).grad_from_grad1(first, args)


class _Unsplit(nn.Module):
    """An RNN call the fallback cannot split into examples (its last state, to 3): on a packed
    batch (lengths 4, 3, 2, ...), time-major, or with an initial state."""

    def __init__(self, how, kind, **options):
        super().__init__()
        self.how, self.kind = how, kind
        self.rnn = kind(3, 4, batch_first=how != "time_major", **options)
        self.head = nn.Linear(4, 3)

    def forward(self, x):  # [batch, time, 3]
        lstm = self.kind is nn.LSTM
        if self.how == "packed":
            lengths = torch.arange(x.shape[1], x.shape[1] - x.shape[0], -1)
            out = self.rnn(nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True))
        elif self.how == "time_major":
            out = self.rnn(x.transpose(0, 1))
        else:  # an initial state, from the input
            layers = self.rnn.num_layers * (2 if self.rnn.bidirectional else 1)
            h0 = x[:, 0, :1].expand(-1, 4)[None].expand(layers, -1, -1).contiguous()
            out = self.rnn(x, (h0, torch.zeros_like(h0)) if lstm else h0)
        h = out[1][0] if lstm else out[1]
        return self.head(h[-1])


@pytest.mark.parametrize(
    "kind, options",
    [
        (nn.LSTM, {}),
        (nn.GRU, {}),
        (nn.RNN, {}),
        (nn.LSTM, {"num_layers": 2, "bidirectional": True}),
    ],
    ids=["LSTM", "GRU", "RNN", "LSTM-2-layers-bidirectional"],
)
@pytest.mark.parametrize("how", ["packed", "time_major", "initial_state"])
def test_rnn_calls_the_fallback_cannot_split(how, kind, options):
    """Calls the torch.func fallback cannot split go one example at a time: grad1 and the
    derivative of Σ_b w_b ‖grad1_b‖², against each example's gradient taken through the
    batch's own forward (the examples are independent)."""
    torch.manual_seed(0)
    model = _Unsplit(how, kind, **options).double()
    x = torch.randn(BATCH, 4, 3, dtype=torch.double)
    weights = torch.rand(BATCH, dtype=torch.double) + 0.5

    ref = copy.deepcopy(model)
    ref_params = list(ref.parameters())
    out = ref(x)
    per_example, objective = [], 0
    for b in range(BATCH):
        grads = torch.autograd.grad(out[b].pow(2).sum(), ref_params, create_graph=True)
        per_example.append(grads)
        objective = objective + weights[b] * sum(g.pow(2).sum() for g in grads)
    want = torch.autograd.grad(objective, ref_params)

    params = list(model.parameters())
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        torch.autograd.grad(model(x).pow(2).sum(), params, create_graph=True)
        for i, p in enumerate(params):
            value = torch.stack([grads[i] for grads in per_example]).detach()
            assert_close(p.grad1.detach(), value, f"{how}: grad1 of parameter {i}")
        value = sum((weights * p.grad1.pow(2).reshape(BATCH, -1).sum(1)).sum() for p in params)
        with h.paused():
            got = torch.autograd.grad(value, params)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_close(g, w, f"{how}: d Σ_b w_b ‖grad1_b‖² / d parameter {i}")


class UsesWeightOutsideItsCall(nn.Module):
    """A Linear called, and its weight used again outside its call (a tied output)."""

    def __init__(self, n=4):
        super().__init__()
        self.proj = nn.Linear(n, n, bias=False)

    def forward(self, x):
        return torch.tanh(self.proj(x)) + torch.tanh(x) @ self.proj.weight.T


def test_a_weight_used_outside_its_call_in_a_create_graph_backward_is_refused():
    """The per-example gradient of a use outside the module's call is formed without a graph:
    a derivative of grad1 missed its terms (off the loop's by 18, silently). Refused, naming
    the parameter, where the backward keeps its graph; matched without it."""
    torch.manual_seed(0)
    model = UsesWeightOutsideItsCall().double()
    x = torch.randn(3, 4, dtype=torch.double)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        loss = model(x).pow(2).sum()
        with pytest.raises(gradhooks.UnsupportedError, match="'proj.weight'.*create_graph"):
            torch.autograd.grad(loss, [model.proj.weight], create_graph=True)
    assert getattr(model.proj.weight, "grad1", None) is None
    want = loop_grad(model, lambda out: out.pow(2).sum(), x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        model(x).pow(2).sum().backward()
    torch.testing.assert_close(model.proj.weight.grad1, want["proj.weight"], rtol=1e-7, atol=1e-10)

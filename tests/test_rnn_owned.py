"""nn.LSTM calls that autograd records nothing of (the rule's ``grad_from_grad1`` with
``input_grads``): the rule's backward through time gives ``.grad`` and the gradients of the
input, ``h0`` and ``c0``; torch's own LSTM backward is not run. Everything must stay what
autograd computes without hooks, in every setup (create_graph, paused and repeated backwards,
a forward that raises), and grad1 / the norms the oracles'."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import gradhooks
from gradhooks.oracle import vmap_grad
from harness import assert_close

D = torch.float64


def owned(out) -> bool:
    return type(out.grad_fn).__name__ == "_AttachAllBackward"


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
    """Packed sequences, dropout between layers in training (an error at the backward), no
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
        assert not owned(drop(torch.randn(5, 2, 3))[0])


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

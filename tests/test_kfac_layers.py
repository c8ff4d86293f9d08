"""K-FAC factors of layers whose pieces are not a plain ``[batch, shared, features]`` input and
output-gradient: the experts of a mixture (rows routed per token, padded per example), and
layers whose per-example gradient is written in another orientation than ``[out, in]``. Each
is compared, in float64, with the factors' definition computed by hand: the inputs and
output-gradients each example's positions give the layer, one example's own loss at a time."""

from __future__ import annotations

import copy
import itertools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_moe import MoE
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import gradhooks

D = torch.float64


def routed_definition(model: MoE, x: torch.Tensor, expand: bool, reduction: str) -> dict:
    """{weight name: (A, G)} of every expert Linear by the definition, one example at a time:
    the example's tokens routed to the expert (its rows of the expert's input) and the gradient
    of the example's own loss (``sum of squares``) with respect to the expert's output there.
    ``A`` is bias-augmented and divided by the positions the expert saw (expand) or by the
    examples that sent it any (reduce: each its rows' mean input); ``G`` sums (or, reduced,
    sums each example's rows first) and is divided by the batch for ``"mean"``."""
    layers = {
        f"experts.{e}.{part}.weight": getattr(expert, part)
        for e, expert in enumerate(model.experts)
        for part in ("up", "down")
    }
    a_terms = {n: [] for n in layers}
    g_terms = {n: [] for n in layers}
    for b in range(x.shape[0]):
        seen = []
        handles = [
            m.register_forward_hook(
                lambda m, args, out, n=n, seen=seen: seen.append((n, args[0], out))
            )
            for n, m in layers.items()
        ]
        with gradhooks.paused():
            out = model(x[b : b + 1])
        for h in handles:
            h.remove()
        grads = torch.autograd.grad(out.pow(2).sum(), [o for *_, o in seen], allow_unused=True)
        for (n, inp, _), g in zip(seen, grads):
            if inp.shape[0] == 0:
                continue  # (no token of this example was routed there)
            a = torch.cat([inp, torch.ones_like(inp[:, :1])], 1)  # [rows, in + 1]
            if not expand:
                a, g = a.mean(0, keepdim=True), g.sum(0, keepdim=True)
            a_terms[n].append(a)
            g_terms[n].append(g)
    want = {}
    for n in layers:
        a, g = torch.cat(a_terms[n]), torch.cat(g_terms[n])
        G = g.T @ g / (x.shape[0] if reduction == "mean" else 1)
        want[n] = (a.T @ a / a.shape[0], G)
    return want


@pytest.mark.parametrize("how", ["kfac", "hooks"])
@pytest.mark.parametrize("expand", [True, False], ids=["expand", "reduce"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("style", ["where", "mask", "select"])
def test_expert_factors_count_the_tokens_routed_to_them(style, reduction, expand, how):
    """Each example sends a different number of tokens to an expert (the engine pads them to
    the most of one example): the factors count only the tokens routed, not the padding."""
    torch.manual_seed(0)
    model = MoE(style=style).double()
    x = torch.randn(4, 6, 4, dtype=D)
    want = routed_definition(model, x, expand, reduction)
    if how == "kfac":
        got = gradhooks.kfac(
            model, x, fisher="empirical", loss=lambda out: out.pow(2).sum(),
            reduction=reduction, expand=expand,
        )  # fmt: skip
    else:
        with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("kfac",)) as h:
            h._state.collector.kfac.expand = expand
            model(x).pow(2).sum().backward()
            got = h.kfac_factors(reduction)
    counts = [[len(t) for t in _routed(model, x, e)] for e in range(len(model.experts))]
    assert any(len(set(c)) > 1 for c in counts), counts  # (uneven: padding was added)
    for n, (A, G) in want.items():
        torch.testing.assert_close(got[n].A, A, rtol=1e-10, atol=1e-12, msg=f"{n} A")
        torch.testing.assert_close(got[n].G, G, rtol=1e-10, atol=1e-12, msg=f"{n} G")


def _routed(model: MoE, x: torch.Tensor, expert: int) -> list[torch.Tensor]:
    """Each example's tokens routed to ``expert`` (top-1)."""
    with torch.no_grad():
        chosen = model.gate(x).argmax(-1)  # [batch, tokens]
    return [torch.where(c == expert)[0] for c in chosen]


def hand_patches(m: nn.Module, x: torch.Tensor, out_spatial) -> torch.Tensor:
    """``[batch, groups, out positions, in/groups · K]`` by the definition, index by index: at
    output position ``p``, input channel ``i`` and kernel offset ``k`` of a transposed
    convolution, ``x[i, q]`` with ``q · stride - padding + k · dilation = p`` (else zero)."""
    groups, per = m.groups, m.in_channels // m.groups
    offsets = list(itertools.product(*[range(k) for k in m.kernel_size]))
    positions = list(itertools.product(*[range(n) for n in out_spatial]))
    out = x.new_zeros(x.shape[0], groups, len(positions), per * len(offsets))
    for pi, p in enumerate(positions):
        for ki, k in enumerate(offsets):
            q = []
            for pj, kj, s, pad, d, n in zip(p, k, m.stride, m.padding, m.dilation, x.shape[2:]):
                num = pj + pad - kj * d
                if num % s or not 0 <= num // s < n:
                    break
                q.append(num // s)
            else:
                for grp in range(groups):
                    for i in range(per):
                        out[:, grp, pi, i * len(offsets) + ki] = x[(slice(None), grp * per + i, *q)]
    return out


def transposed_definition(model, x, y, expand: bool, reduction: str):
    """(A, G) of ``model[0]`` (a transposed convolution) by their definition: each example's
    own cross-entropy, its output-gradient at every output position and the input patch that
    position reads (ones column appended), per group; ``[groups, ...]``."""
    m = model[0]
    a_rows, g_rows = [], []
    for b in range(x.shape[0]):
        seen = []
        handle = m.register_forward_hook(lambda mod, args, out, seen=seen: seen.append(out))
        with gradhooks.paused():
            out = model(x[b : b + 1])
        handle.remove()
        (g,) = torch.autograd.grad(F.cross_entropy(out, y[b : b + 1], reduction="sum"), seen)
        a = hand_patches(m, x[b : b + 1], g.shape[2:])[0]  # [groups, P, in/G·K]
        # (the patches are the layer's: its output is the weight matrix times them, plus bias)
        per_in, per_out = m.in_channels // m.groups, m.out_channels // m.groups
        w = m.weight.reshape(m.groups, per_in, per_out, -1).transpose(1, 2).flatten(2)
        y_hand = (a @ w.mT).transpose(0, 1).flatten(1) + m.bias  # [P, out]
        torch.testing.assert_close(y_hand, seen[0][0].flatten(1).T, rtol=1e-12, atol=1e-12)
        a = torch.cat([a, torch.ones_like(a[..., :1])], -1)
        g = g[0].flatten(1).T.reshape(-1, m.groups, m.out_channels // m.groups).transpose(0, 1)
        if not expand:
            a, g = a.mean(-2, keepdim=True), g.sum(-2, keepdim=True)
        a_rows.append(a)
        g_rows.append(g)
    a, g = torch.cat(a_rows, 1), torch.cat(g_rows, 1)  # [groups, rows, features]
    A = a.mT @ a / a.shape[1]
    G = g.mT @ g / (x.shape[0] if reduction == "mean" else 1)
    return (A[0], G[0]) if m.groups == 1 else (A, G)


TRANSPOSED = {
    "2d-stride2": (lambda: nn.ConvTranspose2d(2, 3, 3, stride=2), (2, 4, 4)),
    "1d-pad-dil-outpad-groups": (
        lambda: nn.ConvTranspose1d(
            4, 6, 3, stride=3, padding=2, dilation=2, output_padding=1, groups=2
        ),
        (4, 5),
    ),  # fmt: skip
    "2d-rect": (lambda: nn.ConvTranspose2d(3, 2, (2, 3), stride=(1, 2), padding=(0, 1)), (3, 3, 4)),
}


def transposed_model(name: str):
    torch.manual_seed(0)
    make, shape = TRANSPOSED[name]
    conv = make().double()
    x = torch.randn(5, *shape, dtype=D)
    out = conv(x)
    model = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(out[0].numel(), 3)).double()
    return model, x, torch.randint(3, (5,))


@pytest.mark.parametrize("expand", [True, False], ids=["expand", "reduce"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", list(TRANSPOSED))
def test_transposed_convolution_factors_equal_their_definition(name, reduction, expand):
    """G over the output channels, A over the (bias-augmented) input patch each output
    position reads: the weight as the matrix [out, in · K], its first two axes swapped."""
    model, x, y = transposed_model(name)
    want_a, want_g = transposed_definition(model, x, y, expand, reduction)
    loss = lambda out, target: F.cross_entropy(out, target, reduction="sum")
    f = gradhooks.kfac(model, x, y, fisher="empirical", loss=loss, reduction=reduction,
                       expand=expand)["0.weight"]  # fmt: skip
    assert f.layout == "in_out" and f.bias and f.bias_name == "0.bias"
    torch.testing.assert_close(f.A, want_a, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(f.G, want_g, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", list(TRANSPOSED))
def test_transposed_convolution_preconditioning_is_the_damped_solve(name):
    """kfac_precondition takes the weight as [out, in · K] (axes swapped per group) with the
    bias column, solves with kron(G, A) + λI, and writes the result back in the weight's own
    layout: checked against a dense solve of the same matrix, laid out by hand."""
    model, x, y = transposed_model(name)
    factors = gradhooks.kfac(model, x, fisher="mc", generator=torch.Generator().manual_seed(1))
    F.cross_entropy(model(x), y).backward()
    m = model[0]
    groups, per_in, per_out = m.groups, m.in_channels // m.groups, m.out_channels // m.groups
    w = m.weight.grad.reshape(groups, per_in, per_out, -1).transpose(1, 2).flatten(2)
    grad = torch.cat([w, m.bias.grad.reshape(groups, per_out, 1)], -1)  # [groups, out, in·K+1]
    f = factors["0.weight"]
    A, G = (f.A, f.G) if groups > 1 else (f.A[None], f.G[None])
    want = []
    for gr in range(groups):
        dense = torch.kron(G[gr], A[gr]) + 1e-3 * torch.eye(G.shape[-1] * A.shape[-1], dtype=D)
        want.append(torch.linalg.solve(dense, grad[gr].flatten()).view(grad[gr].shape))
    want = torch.stack(want)
    gradhooks.kfac_precondition(model, factors, damping=1e-3)
    got_w = m.weight.grad.reshape(groups, per_in, per_out, -1).transpose(1, 2).flatten(2)
    torch.testing.assert_close(got_w, want[..., :-1], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(m.bias.grad, want[..., -1].flatten(), rtol=1e-9, atol=1e-12)


def test_kfac_optimizer_on_a_transposed_convolution():
    """The optimizer preconditions it (as kfac_precondition does), adapts its damping through
    the same matrix, and its checkpoint keeps the layout (an older one, without, loads as
    "out_in")."""
    model, x, y = transposed_model("1d-pad-dil-outpad-groups")
    opt = gradhooks.KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1), damping=1e-2,
                         adaptive=True, adapt_every=1)  # fmt: skip
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.item())
        opt.step(x, closure=lambda: F.cross_entropy(model(x), y))
    assert losses[-1] < losses[0]
    state = opt.state_dict()
    assert state["factors"]["0.weight"][4] == "in_out"
    opt.load_state_dict(state)
    assert opt.factors["0.weight"].layout == "in_out"
    state["factors"] = {n: f[:4] for n, f in state["factors"].items()}
    opt.load_state_dict(state)
    assert opt.factors["3.weight"].layout == "out_in"


class Packed(nn.Module):
    """A recurrent layer on a packed batch of sequences of different lengths; the output is a
    head on its last states."""

    def __init__(self, kind: str = "RNN", layers: int = 1, bidirectional: bool = False):
        super().__init__()
        rnn = getattr(nn, kind)
        self.rnn = rnn(3, 4, layers, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(4 * (1 + bidirectional), 2)

    def forward(self, x, lengths):
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        _, h = self.rnn(packed)
        h = h[0] if isinstance(h, tuple) else h
        return self.head(h[-1 - self.rnn.bidirectional :].transpose(0, 1).flatten(1))


def _squares(out):
    return out.pow(2).sum()


def test_packed_rnn_factors_count_only_the_steps_each_sequence_ran():
    """A tanh RNN by hand, one example at a time over its own steps: ``A`` of ``weight_ih``
    (``weight_hh``) the inputs (previous states) of the steps run, over their number; ``G`` the
    gradients of the pre-activations of the example's own loss. The padded steps of shorter
    sequences (their input zero, their state the last one carried) do not count."""
    torch.manual_seed(0)
    model = Packed().double()
    x, lengths = torch.randn(4, 6, 3, dtype=D), torch.tensor([6, 2, 4, 3])
    rnn = model.rnn
    terms = {"ih": ([], []), "hh": ([], [])}
    for b in range(4):
        h, pres, prev = x.new_zeros(4), [], []
        for t in range(int(lengths[b])):
            pre = x[b, t] @ rnn.weight_ih_l0.T + rnn.bias_ih_l0 + h @ rnn.weight_hh_l0.T
            pre = pre + rnn.bias_hh_l0
            pres.append(pre)
            prev.append(h)
            h = torch.tanh(pre)
        grads = torch.autograd.grad(_squares(model.head(h)), pres)
        terms["ih"][0].append(x[b, : int(lengths[b])])
        terms["hh"][0].append(torch.stack(prev).detach())
        for part in ("ih", "hh"):
            terms[part][1].append(torch.stack(grads))
    got = gradhooks.kfac(model, (x, lengths), fisher="empirical", loss=_squares, reduction="sum")
    for part, (a, g) in terms.items():
        a, g = torch.cat(a), torch.cat(g)
        f = got[f"rnn.weight_{part}_l0"]
        torch.testing.assert_close(f.A, a.T @ a / a.shape[0], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(f.G, g.T @ g, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["RNN", "LSTM", "GRU"])
def test_packed_bidirectional_rnn_factors_are_those_of_each_sequence_alone(kind):
    """Two bidirectional layers on a packed batch: the factors (sums over the steps run) equal
    those of the examples run one at a time at their own length, with no padding."""
    torch.manual_seed(0)
    model = Packed(kind, layers=2, bidirectional=True).double()
    x, lengths = torch.randn(4, 6, 3, dtype=D), torch.tensor([6, 2, 4, 3])
    kw = dict(fisher="empirical", loss=_squares, reduction="sum")
    got = gradhooks.kfac(model, (x, lengths), **kw)
    alone = [gradhooks.kfac(model, (x[b : b + 1, :n], lengths[b : b + 1]), **kw)
             for b, n in enumerate(lengths.tolist())]  # fmt: skip
    for name, f in got.items():
        if name.startswith("rnn."):
            A = sum(p[name].A * n for p, n in zip(alone, lengths.tolist())) / int(lengths.sum())
            torch.testing.assert_close(f.A, A, rtol=1e-10, atol=1e-12, msg=name)
            torch.testing.assert_close(f.G, sum(p[name].G for p in alone), rtol=1e-10, atol=1e-12)


class CrossAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.att = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, q, kv):
        return self.head(self.att(q, kv, kv, need_weights=False)[0].mean(1))


def test_cross_attention_projection_factors_count_each_projections_own_positions():
    """A packed in_proj_weight seen by a query of 2 positions and a key/value of 5: the
    rule pads the query to 5 (groups of one stacked piece); its group's A divides by the
    query's own positions. Checked against the attention by hand, one example at a time:
    ``A`` of each projection its input, ``G`` the gradient of its output."""
    torch.manual_seed(0)
    model = CrossAttention().double()
    q, kv = torch.randn(3, 2, 4, dtype=D), torch.randn(3, 5, 4, dtype=D)
    att = model.att
    w_q, w_k, w_v = att.in_proj_weight.chunk(3)
    b_q, b_k, b_v = att.in_proj_bias.chunk(3)
    a_terms, g_terms = [[], [], []], [[], [], []]
    for b in range(3):
        proj = [q[b] @ w_q.T + b_q, kv[b] @ w_k.T + b_k, kv[b] @ w_v.T + b_v]
        heads = [p.view(p.shape[0], 2, 2).transpose(0, 1) for p in proj]  # [heads, seq, 2]
        probs = (heads[0] @ heads[1].mT / 2**0.5).softmax(-1)
        ctx = (probs @ heads[2]).transpose(0, 1).reshape(-1, 4)
        out = model.head((ctx @ att.out_proj.weight.T + att.out_proj.bias).mean(0, keepdim=True))
        want_out = model(q[b : b + 1], kv[b : b + 1])
        torch.testing.assert_close(out, want_out)  # (the attention by hand is the module's)
        grads = torch.autograd.grad(_squares(out), proj)
        for i, (x, g) in enumerate(zip((q[b], kv[b], kv[b]), grads)):
            a_terms[i].append(x)
            g_terms[i].append(g)
    f = gradhooks.kfac(model, (q, kv), fisher="empirical", loss=_squares, reduction="sum")
    f = f["att.in_proj_weight"]
    for i in range(3):
        a, g = torch.cat(a_terms[i]), torch.cat(g_terms[i])
        torch.testing.assert_close(f.A[i], a.T @ a / a.shape[0], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(f.G[i], g.T @ g, rtol=1e-10, atol=1e-12)


def test_a_weight_tied_between_a_convolution_and_its_transpose_is_refused():
    """Its matrix is [out, in·K] for one use and the transpose's [in, out·K] for the other (both
    19 x 3 here, which once summed into one pair of factors): refused, naming the weight."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.dec = nn.Conv2d(2, 3, 3), nn.ConvTranspose2d(3, 2, 3)
            self.dec.weight = self.enc.weight

        def forward(self, x):
            return self.dec(torch.tanh(self.enc(x))).flatten(1)

    model = Tied().double()
    with pytest.raises(
        gradhooks.UnsupportedError, match="'enc.weight' is used by modules that lay"
    ):
        gradhooks.kfac(model, torch.randn(4, 2, 6, 6, dtype=D), fisher="empirical", loss=_squares)


@pytest.mark.parametrize("name", ["2d-stride2", "2d-rect"])
def test_transposed_convolution_factors_match_backpack(name):
    """BackPACK's KFLR (the exact GGN's factors) for a transposed convolution is over the same
    patches and output channels, in its own scaling: its A is ``Σ_{b,p} a aᵀ / batch`` (ours,
    expanded without the bias column, times the output positions), its G
    ``Σ_b (Σ_p g)(Σ_p g)ᵀ / batch`` (ours reduced, mean). (BackPACK has no groups or
    output_padding for it.)"""
    backpack = pytest.importorskip("backpack")
    from backpack.extensions import KFLR

    model, x, y = transposed_model(name)
    theirs = backpack.extend(copy.deepcopy(model))
    loss = backpack.extend(nn.CrossEntropyLoss())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (it warns that its factors are of weight.transpose(0, 1))
        with backpack.backpack(KFLR()):
            loss(theirs(x), y).backward()
    g_bp, a_bp = theirs[0].weight.kflr
    expanded = gradhooks.kfac(model, x, fisher="exact", bias=False)["0.weight"]
    reduced = gradhooks.kfac(model, x, fisher="exact", bias=False, expand=False)["0.weight"]
    positions = math.prod(model[0](x).shape[2:])
    torch.testing.assert_close(expanded.A * positions, a_bp, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(reduced.G, g_bp, rtol=1e-10, atol=1e-12)

"""Per-example norms of Linear calls run with their parameters detached (many positions per
example on CPU, ``grad_from_grad1``): the norms and the call's batch gradient come either from
the Gram form plus a batch product, or from ``grad1`` formed a slice at a time (its batch sum
being the batch gradient). Both against ``vmap(grad)`` and the per-example loop in float64, and
``.grad`` against autograd without hooks."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks import pieces as P
from gradhooks.models import EmbedBlock
from gradhooks.oracle import loop_grad, vmap_grad
from gradhooks.quantities import collector as Q
from harness import assert_close, cpu_only

D = torch.float64
POSITIONS = 32  # TUNING.sum_grad1_positions: these calls run detached


class Tokens(nn.Module):
    """A Linear over ``positions`` tokens, an activation, a Linear back, mean-pooled."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [batch, positions, dim]
        return self.down(torch.tanh(self.up(x))).mean(1)


def forms(dim: int, hidden: int, positions: int) -> tuple[bool, bool]:
    """Whether the cost model takes the Gram form for the up-projection's weight, and whether
    it still does when the batch gradient is wanted too."""
    piece = P.Outer(torch.zeros(1, positions, dim), torch.zeros(1, positions, hidden))
    li = P.gram_is_cheaper(piece, piece)
    return li, li and Q._gram_with_sum_is_cheaper(piece)


def norms_and_grads(model, x, loss_fn, reduction):
    with gradhooks.add_hooks(model, loss_reduction=reduction, quantities=("norms",)) as h:
        loss_fn(model(x)).backward()
        return h.param_norms(), h.norms(), {n: p.grad for n, p in model.named_parameters()}


def check_squared_error_norms(model, x, target, reduction):
    """Under a squared-error loss against ``target``: the norms (per parameter and in total)
    against ``vmap(grad)`` and the per-example loop, ``.grad`` against autograd without hooks."""
    batch = x.shape[0]

    def loss_fn(out, t=target):
        loss = 0.5 * ((out - t) ** 2).sum()
        return loss / max(out.shape[0], 1) if reduction == "mean" else loss

    def one(out, t):
        return 0.5 * ((out - t) ** 2).sum()

    want = vmap_grad(model, one, x, target)
    loop = loop_grad(model, one, x, target)
    ref = copy.deepcopy(model)
    if batch:
        loss_fn(ref(x)).backward()
    param_norms, norms, grads = norms_and_grads(model, x, loss_fn, reduction)
    total = torch.zeros(batch, dtype=D)
    for n, p in ref.named_parameters():
        assert_close(loop[n], want[n], f"{n}: loop vs vmap")
        expected = want[n].flatten(1).norm(dim=1)
        assert_close(param_norms[n], expected, f"{n} norms ({reduction}, batch {batch})")
        total += expected**2
        if batch:
            assert_close(grads[n], p.grad, f"{n} .grad vs autograd without hooks")
    assert_close(norms, total.sqrt(), "total norms")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("batch", [0, 1, 3])
@pytest.mark.parametrize(
    "dim, hidden, li, gram",
    [(160, 160, True, True), (32, 128, True, False), (4, 6, False, False)],
    ids=["gram-and-batch-product", "grad1-slices-with-the-batch-product", "grad1-slices"],
)
def test_detached_linear_norms(dim, hidden, li, gram, batch, reduction):
    assert forms(dim, hidden, POSITIONS) == (li, gram)
    torch.manual_seed(0)
    model = Tokens(dim, hidden).to(D)
    x = torch.randn(batch, POSITIONS, dim, dtype=D)
    target = torch.randn(batch, dim, dtype=D)
    check_squared_error_norms(model, x, target, reduction)


def test_benchmark_layers_take_grad1_slices():
    """EmbedBlock's MLP (64 positions, 64 x 256 and back) forms grad1 a slice at a time: the
    Gram form would cost as much, and then a batch product more (measured ~2x slower). Li et
    al.'s memory criterion, 2·T² < in·out, would have taken the Gram form."""
    assert forms(64, 256, 64)[1] is False and 2 * 64 * 64 < 64 * 256
    assert forms(256, 64, 64)[1] is False


def test_cost_model_takes_the_cheaper_form_for_a_vocabulary_projection():
    """GPT-2's output layer (256 to 50,257): the Gram form costs ``T²·(in + out)`` per example,
    materializing ``T·in·out``; the Gram form up to ``T = 269``, not beyond (Li et al.'s
    2·T² < in·out would take it up to ``T = 2,536``, at 10x the multiply-adds)."""

    def choice(t):
        piece = P.Outer(torch.zeros(1, t, 256), torch.zeros(1, t, 50257))
        return P.gram_is_cheaper(piece, piece)

    assert choice(128) and choice(200)
    assert not choice(512) and not choice(1024)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_embed_block_norms_and_grad(reduction):
    """A small EmbedBlock (embedding rows, LayerNorm, a detached MLP over 40 tokens)."""
    torch.manual_seed(0)
    model = EmbedBlock(vocab=30, dim=8, classes=3).to(D)
    x, y = torch.randint(0, 30, (4, 40)), torch.randint(0, 3, (4,))

    def loss_fn(out, t=y):
        return F.cross_entropy(out, t, reduction=reduction)

    want = vmap_grad(model, F.cross_entropy, x, y)
    ref = copy.deepcopy(model)
    loss_fn(ref(x)).backward()
    param_norms, norms, grads = norms_and_grads(model, x, loss_fn, reduction)
    total = torch.zeros(4, dtype=D)
    for n, p in ref.named_parameters():
        expected = want[n].flatten(1).norm(dim=1)
        assert_close(param_norms[n], expected, f"{n} norms")
        assert_close(grads[n], p.grad, f"{n} .grad vs autograd without hooks")
        total += expected**2
    assert_close(norms, total.sqrt(), "total norms")


class ConvMap(nn.Module):
    """A 3x3 convolution over an 8x8 map (64 positions: run detached), mean-pooled."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [batch, cin, 8, 8]
        return torch.tanh(self.conv(x)).mean((2, 3))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("batch", [0, 1, 3])
@pytest.mark.parametrize(
    "cin, cout, gram",
    [(16, 64, True), (16, 16, False)],
    ids=["gram-from-positions-and-conv-backward", "grad1-slices"],
)
@cpu_only("a convolution runs detached on the CPU alone")
def test_detached_conv_norms(cin, cout, gram, batch, reduction):
    """A convolution run detached with few output positions: its norms from the Gram form
    (the input's Gram over positions) and ``.grad`` from one convolution backward where the
    cost model prefers that to forming grad1 through the columns, else grad1 a slice at a time;
    both against ``vmap(grad)`` and the loop, ``.grad`` against autograd without hooks."""
    from gradhooks.rules.conv import ConvWeight, many_positions

    torch.manual_seed(0)
    model = ConvMap(cin, cout).to(D)
    x = torch.randn(batch, cin, 8, 8, dtype=D)
    target = torch.randn(batch, cout, dtype=D)
    assert many_positions(model.conv, (x,))
    with torch.no_grad():
        piece = ConvWeight(model.conv, x, torch.zeros(batch, cout, 8, 8, dtype=D))
    assert (P.gram_is_cheaper(piece, piece) and Q._gram_with_sum_is_cheaper(piece)) == gram
    check_squared_error_norms(model, x, target, reduction)


ONE_PIECE = [
    pytest.param(lambda: nn.Linear(5, 3), (5,), id="linear-one-position"),
    pytest.param(lambda: nn.Conv2d(4, 6, 3, groups=2), (4, 3, 3), id="grouped-conv-one-position"),
    pytest.param(lambda: nn.LayerNorm(5), (2, 5), id="layernorm-direct"),
]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("batch", [0, 1, 3])
@pytest.mark.parametrize("make, shape", ONE_PIECE)
def test_one_piece_norms(make, shape, batch, reduction):
    """Parameters with one piece whose norm needs no product (one shared position, a bias, a
    Direct piece) take a short path: against vmap(grad) and the loop."""
    torch.manual_seed(0)
    model = make().to(D)
    x = torch.randn(batch, *shape, dtype=D)

    def one(out, t=None):
        return 0.5 * (out**2).sum()

    def loss_fn(out):
        return one(out) / max(batch, 1) if reduction == "mean" else one(out)

    want = vmap_grad(model, one, x)
    loop = loop_grad(model, one, x)
    with gradhooks.add_hooks(model, loss_reduction=reduction, quantities=("norms",)) as h:
        loss_fn(model(x)).backward()
        param_norms, forms = h.param_norms(), h.norm_forms()
    # a weight of a call run detached (GRADHOOKS_SUM_GRAD1_POSITIONS=1) takes the general path
    detached = gradhooks.TUNING.sum_grad1_positions <= 1
    assert set(forms) == set(want)
    assert all(form in ("outer", "direct") or detached for form in forms.values()), forms
    for n in want:
        assert_close(loop[n], want[n], f"{n}: loop vs vmap")
        assert_close(param_norms[n], want[n].flatten(1).norm(dim=1), f"{n} norms")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_grad1_slices_of_a_few_examples(reduction, monkeypatch):
    """grad1 formed a cache-sized slice of the batch at a time (here 2 and 4 examples of 5, the
    last slice shorter): norms, squared sums and .grad against the oracles and autograd."""
    monkeypatch.setattr(gradhooks.TUNING, "cache_elements", 1024)
    monkeypatch.setattr(gradhooks.TUNING, "cache_min_rows", 2)
    torch.manual_seed(0)
    model = Tokens(8, 16).to(D)
    x, target = torch.randn(5, POSITIONS, 8, dtype=D), torch.randn(5, 8, dtype=D)

    def one(out, t):
        return 0.5 * ((out - t) ** 2).sum()

    def loss_fn(out):
        return one(out, target) / 5 if reduction == "mean" else one(out, target)

    want = vmap_grad(model, one, x, target)
    ref = copy.deepcopy(model)
    loss_fn(ref(x)).backward()
    slices = []
    real = Q._materialized

    def materialized(h):
        for sl, g in real(h):
            slices.append(g.shape[0])
            yield sl, g

    monkeypatch.setattr(Q, "_materialized", materialized)
    quantities = ("norms", "sum_grad_sq")
    with gradhooks.add_hooks(model, loss_reduction=reduction, quantities=quantities) as h:
        loss_fn(model(x)).backward()
    assert sorted(set(slices)) == [1, 2, 4], slices  # 2, 2, 1 and 4, 1 examples
    for n, p in ref.named_parameters():
        assert_close(h.param_norms()[n], want[n].flatten(1).norm(dim=1), f"{n} norms")
        assert_close(h.sum_grad_sq()[n], (want[n] ** 2).sum(0), f"{n} sum_grad_sq")
        assert_close(dict(model.named_parameters())[n].grad, p.grad, f"{n} .grad vs autograd")


@pytest.mark.parametrize("dim, hidden", [(160, 160), (4, 6)], ids=["gram", "materialized"])
def test_norm_forms_say_which_form_each_parameter_took(dim, hidden):
    """``Hooks.norm_forms()``: the form the cost model chose for each parameter's norm (the
    norms themselves against ``vmap(grad)``)."""
    torch.manual_seed(0)

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, dim)
            self.tokens = Tokens(dim, hidden)
            self.head = nn.Linear(dim, 2)

        def forward(self, ids):  # [batch, positions]
            return self.head(self.tokens(self.emb(ids)))

    model = Mixed().to(D)
    ids = torch.randint(10, (3, POSITIONS))

    def one(out, t=None):
        return 0.5 * (out**2).sum()

    want = vmap_grad(model, one, ids)
    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("norms",)) as h:
        one(model(ids)).backward()
        norms, got = h.param_norms(), h.norm_forms()
    li, gram = forms(dim, hidden, POSITIONS)
    assert got == {
        "emb.weight": "rows",
        "tokens.up.weight": "gram" if gram else "materialized",
        "tokens.up.bias": "direct",
        "tokens.down.weight": "gram" if gram else "materialized",
        "tokens.down.bias": "direct",
        "head.weight": "outer",
        "head.bias": "direct",
    }
    for n in want:
        assert_close(norms[n], want[n].flatten(1).norm(dim=1), n)

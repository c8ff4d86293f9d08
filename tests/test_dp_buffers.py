"""The DP step builds each gradient in one tensor: the noise drawn into it, the clipped sums
added to it in place (``Piece.add_batch_sum``: an embedding's looked-up rows by one
``index_add_``; a layer's product by one ``addmm_``, formed before the noise is drawn, from
pieces then freed). Checked against dense constructions
from ``grad1`` and, for a model whose output layer shares the embedding's weight (a tied
head), against the float64 per-example loop, also under bfloat16 autocast."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_dp_autocast import clipped_reference, reference_median, within
from test_pieces_rows import random_rows
from torch import nn

import gradhooks
from gradhooks import pieces as P
from gradhooks.oracle import loop_grad, vmap_grad
from harness import assert_close


def _outer(groups: bool, bias: bool) -> P.Outer:
    gen = torch.Generator().manual_seed(7)
    shape = (4, 2, 3) if groups else (4, 3)  # [batch, *groups, shared]
    g = torch.randn(*shape, 5, generator=gen, dtype=torch.float64)
    a = None if bias else torch.randn(*shape, 6, generator=gen, dtype=torch.float64)
    return P.Outer(a, g)


PIECES = {
    "rows": lambda: (random_rows(4, 7, 3, 15, 1), torch.Size([7, 3])),
    "rows-positions": lambda: (random_rows(4, 7, 3, 0, 2, positions=5), torch.Size([7, 3])),
    "outer": lambda: (_outer(False, False), torch.Size([5, 6])),
    "outer-groups": lambda: (_outer(True, False), torch.Size([2, 5, 6])),
    "outer-bias": lambda: (_outer(False, True), torch.Size([5])),
    "direct": lambda: (P.Direct(torch.randn(4, 3, 2, dtype=torch.float64)), torch.Size([3, 2])),
}


@pytest.mark.parametrize("out_dtype", [torch.float64, torch.float32], ids=["same", "float32"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("kind", list(PIECES))
def test_add_batch_sum_adds_the_weighted_sum_of_grad1(kind, weighted, out_dtype):
    piece, shape = PIECES[kind]()
    weights = torch.tensor([0.5, 1.0, 0.0, 2.0], dtype=torch.float64) if weighted else None
    g1 = piece.grad1(shape)
    want_sum = g1.sum(0) if weights is None else torch.einsum("b,b...->...", weights, g1)
    start = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    out = start.clone().to(out_dtype)
    kept = out.data_ptr()
    piece.add_batch_sum(out, weights)
    assert out.data_ptr() == kept and out.dtype == out_dtype, "added in place"
    if out_dtype == torch.float64:
        assert_close(out, start + want_sum, f"{kind}: out + the batch sum")
    else:  # (the float64 sum rounded to float32, added to a float32 start: 2 roundings)
        want = start.float().double() + want_sum
        diff = float((out.double() - want).abs().max())
        assert diff <= 4 * torch.finfo(torch.float32).eps * float(want.abs().max()), (kind, diff)


class TiedHead(nn.Module):
    """A token embedding whose weight is also the output layer's: logits per position."""

    def __init__(self, vocab: int = 23, dim: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, t):
        return self.out(torch.tanh(self.mix(self.emb(t))))


def next_token(out, y):
    """Each example's mean cross-entropy over its positions: ``[batch]``, or the batch mean
    for one example (the oracle's loss)."""
    each = F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none").view(y.shape)
    return each.mean(1)


def tied_problem(batch: int = 6, seq: int = 12):
    """``seq`` 12: the norms of both weights are formed from ``grad1`` (materialized, cheaper
    than Gram at more positions than features); 5: by Gram."""
    torch.manual_seed(0)
    model = TiedHead()
    x = torch.randint(23, (batch, seq))
    y = torch.randint(23, (batch, seq))
    return model, x, y


@pytest.mark.parametrize("seq", [5, 12], ids=["gram", "materialized"])
@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_tied_head_step_is_the_float64_loops_clipped_sum_plus_the_noise(method, seq, monkeypatch):
    """Book-keeping where the norms formed grad1: the clipped sum is its weighted sum (kept by
    the collector), not a product of the pieces."""
    from gradhooks.workflows import dp

    weighted = []
    real = dp._add_weighted
    monkeypatch.setattr(
        dp, "_add_weighted", lambda out, *a: weighted.append(out.shape) or real(out, *a)
    )
    model, x, y = tied_problem(seq=seq)
    model = model.double()
    want = loop_grad(model, lambda o, t: next_token(o, t).mean(), x, y)
    oracle = vmap_grad(model, lambda o, t: next_token(o, t).mean(), x, y)
    for n in want:
        assert_close(oracle[n], want[n], f"the two oracles agree on {n}")
    max_norm = reference_median(want)
    norms, clipped = clipped_reference(want, max_norm)
    sigma, seed, batch = 0.8, 4, x.shape[0]
    quantity = "grad1" if method == "grad1" else "norms"
    with gradhooks.add_hooks(model, quantities=(quantity,)) as h:
        got = gradhooks.dp_sgd_step(
            h, next_token(model(x), y), max_norm=max_norm, noise_multiplier=sigma,
            method=method, generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
        forms = h.norm_forms() if quantity == "norms" else {}
    assert_close(got, norms, f"{method}: norms")
    if method == "bookkeeping":
        formed = {n for n, f in forms.items() if f == "materialized"}
        assert formed == ({"emb.weight", "mix.weight"} if seq == 12 else set()), forms
        assert sorted(weighted) == sorted(model.get_parameter(n).shape for n in formed)
    gen = torch.Generator().manual_seed(seed)
    names = [n for n, _ in model.named_parameters()]  # (the tied weight once: emb.weight)
    assert names == ["emb.weight", "mix.weight", "mix.bias"]
    for n, p in model.named_parameters():
        z = torch.randn(p.shape, generator=gen, dtype=p.dtype) * sigma * max_norm
        assert_close(p.grad, (clipped[n] + z) / batch, f"{method}: {n}")


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_tied_head_step_under_bf16_autocast_matches_the_float64_loop(method):
    """Tolerance: test_dp_autocast's, 16 bfloat16 eps of the largest entry of the clipped sum
    (the output-gradients and inputs of each layer rounded to bfloat16; the noise, drawn in
    float32, is subtracted exactly up to float32 rounding, far below that)."""
    model, x, y = tied_problem()
    want = loop_grad(copy.deepcopy(model).double(), lambda o, t: next_token(o, t).mean(), x, y)
    max_norm = reference_median(want)
    norms, clipped = clipped_reference(want, max_norm)
    sigma, seed, batch = 0.5, 3, x.shape[0]
    quantity = "grad1" if method == "grad1" else "norms"
    with gradhooks.add_hooks(model, quantities=(quantity,)) as h:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        got = gradhooks.dp_sgd_step(
            h, next_token(out.float(), y), max_norm=max_norm, noise_multiplier=sigma,
            method=method, generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
    within(got, norms, torch.bfloat16, f"{method}: norms")
    gen = torch.Generator().manual_seed(seed)
    for n, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=p.dtype).double() * sigma * max_norm
        assert p.grad.dtype == torch.float32
        within(p.grad.double() * batch - noise, clipped[n], torch.bfloat16, f"{method} {n}")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_collector_keeps_the_materialized_grad1_of_each_examples_own_loss(reduction):
    """``Collector.keeping_grad1``: the slices a norm formed are each example's own gradient
    (float64 loop), for the tied weight (embedding rows and output layer together) and the
    Linear; none outside the block, and none for a parameter whose norm took the Gram form."""
    from gradhooks.engine.api import engine_of

    model, x, y = tied_problem()
    model = model.double()
    want = loop_grad(model, lambda o, t: next_token(o, t).mean(), x, y)
    with gradhooks.add_hooks(model, quantities=("norms",), loss_reduction=reduction) as h:
        collector = engine_of(h).collector
        with collector.keeping_grad1() as store:
            losses = next_token(model(x), y)
            (losses.mean() if reduction == "mean" else losses.sum()).backward()
        assert h.norm_forms()["emb.weight"] == "materialized"
        for n in ("emb.weight", "mix.weight"):
            got = torch.cat(store[id(model.get_parameter(n))])
            assert_close(got, want[n], f"{reduction}: kept grad1 of {n}")
        assert len(store) == 2, "the bias's norm is direct: nothing kept"
        kept = {k: [id(t) for t in v] for k, v in store.items()}
        h.clear()
        next_token(model(x), y).mean().backward()
    assert {k: [id(t) for t in v] for k, v in store.items()} == kept, "kept only within"


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_the_backwards_unused_gradients_are_freed_before_the_noise_is_drawn(method, monkeypatch):
    """The step's (first) backward returns autograd's gradients of every parameter (for an
    embedding a whole dense table) only to check what was captured: none of them is alive once
    the gradients are being built."""
    import weakref

    from gradhooks.workflows import dp

    refs: list = []
    real_grads, real_noise = dp._grads, dp.noise

    def grads(*args, **kwargs):
        out = real_grads(*args, **kwargs)
        if not refs:  # (the first backward's; ghost's second gives the clipped sums)
            refs.extend(weakref.ref(t) for t in out if t is not None)
        return out

    alive: list[int] = []

    def noise(*args):
        alive.append(sum(r() is not None for r in refs))
        return real_noise(*args)

    monkeypatch.setattr(dp, "_grads", grads)
    monkeypatch.setattr(dp, "noise", noise)
    model, x, y = tied_problem()
    quantity = "grad1" if method == "grad1" else "norms"
    with gradhooks.add_hooks(model, quantities=(quantity,)) as h:
        for _ in range(2):  # (the first step is checked against autograd, the second not)
            refs.clear()
            gradhooks.dp_sgd_step(
                h, next_token(model(x), y), max_norm=0.1, noise_multiplier=1.0, method=method
            )
    assert refs and alive and not any(alive), alive


def test_weighted_rows_is_the_dense_weighted_sum_held_as_its_rows():
    """``weighted_rows``: two calls of an embedding (different scales, rows looked up by both
    and more than once) give ``Σ_b w_b grad1[b]`` (from grad1, float64) as a sparse tensor of
    the rows looked up alone; not for pieces other than Rows."""
    from gradhooks.engine.compare import dense

    param = torch.zeros(7, 3, dtype=torch.float64)
    first, second = random_rows(4, 7, 3, 15, 1), random_rows(4, 7, 3, 9, 2)
    weights = torch.tensor([0.5, 1.0, 0.0, 2.0], dtype=torch.float64)
    uses = [P.PieceUse(first, param, 4.0), P.PieceUse(second, param, 4.0)]
    got = P.weighted_rows(uses, weights)
    want = sum(torch.einsum("b,b...->...", weights, p.grad1(param.shape)) for p in (first, second))
    assert got.is_sparse and got.shape == param.shape
    rows = torch.cat([first.index, second.index]).unique()
    assert torch.equal(got.indices()[0], rows), "the rows looked up, each once"
    assert_close(dense(got), want * 4.0, "weighted rows")
    assert_close(dense(got), P.weighted_sum(uses, weights), "as weighted_sum")
    mixed = uses + [P.PieceUse(P.Direct(torch.randn(4, 7, 3, dtype=torch.float64)), param, 4.0)]
    assert P.weighted_rows(mixed, weights) is None


def test_bookkeeping_uses_the_pieces_up_before_drawing_the_noise(monkeypatch):
    """A book-keeping step holds the calls' pieces (layer inputs and output-gradients, about
    the activations) and the gradients (the noise, a whole table for an embedding) one after
    the other, not together: every product of pieces is formed before the first noise is
    drawn, and an embedding's looked-up rows are added into its noise's own tensor after it
    is drawn (no table of its own). The result is the float64 loop's clipped sum plus the
    noise (the other tests of this file)."""
    from gradhooks.workflows import dp

    events: list[tuple[str, int]] = []
    real_noise = dp.noise
    real_outer, real_rows = P.Outer.add_batch_sum, P.Rows.add_batch_sum

    def noise(p, *args):
        out = real_noise(p, *args)
        events.append(("noise", out.data_ptr()))
        return out

    def outer(self, out, *args):
        events.append(("outer", out.data_ptr()))
        return real_outer(self, out, *args)

    def rows(self, out, *args):
        events.append(("rows", out.data_ptr()))
        return real_rows(self, out, *args)

    monkeypatch.setattr(dp, "noise", noise)
    monkeypatch.setattr(P.Outer, "add_batch_sum", outer)
    monkeypatch.setattr(P.Rows, "add_batch_sum", rows)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(30, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    x, y = torch.randint(30, (5, 7)), torch.randint(4, (5, 7))
    noise_generator = torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        for _ in range(2):  # (the first step checked against autograd, the second not)
            events.clear()
            model.zero_grad()  # (a .grad kept is written into, as autograd adds into it)
            out = model(x)
            losses = F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none")
            gradhooks.dp_sgd_step(
                h, losses.view(5, 7).mean(1), max_norm=0.1, noise_multiplier=1.0,
                generator=noise_generator, method="bookkeeping",
            )  # fmt: skip
            kinds = [k for k, _ in events]
            first = kinds.index("noise")
            assert "outer" in kinds and "outer" not in kinds[first:], kinds
            table = next(ptr for k, ptr in events if k == "noise")  # (the embedding's, first)
            assert ("rows", table) in events[first:], "the rows added into the noise's tensor"
            assert model[0].weight.grad.data_ptr() == table


def test_the_checked_bookkeeping_step_sees_a_wrong_embedding_gradient_in_its_rows():
    """The step's check compares an embedding's weighted pieces as its rows alone
    (``weighted_rows``) with autograd's: a loss that couples the examples only through the
    embedding's output is refused, naming the embedding alone, and nothing is written."""
    torch.manual_seed(0)
    emb, head = nn.Embedding(30, 8), nn.Linear(8, 4)
    head.requires_grad_(False)
    model = nn.Sequential(emb, head)
    x, y = torch.randint(30, (5, 7)), torch.randint(4, (5, 7))
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        e = emb(x)
        out = head(e + 0.5 * e.mean(0, keepdim=True))  # (each example sees the others' rows)
        losses = F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none")
        with pytest.raises(gradhooks.CheckFailedError, match=r"for '0\.weight' \(differs"):
            gradhooks.dp_sgd_step(
                h, losses.view(5, 7).mean(1), max_norm=0.1, noise_multiplier=1.0,
                method="bookkeeping",
            )  # fmt: skip
    assert emb.weight.grad is None


@pytest.mark.parametrize("shape", [(5,), (40, 7)], ids=["scalar-path", "vectorized"])
def test_the_noise_is_drawn_scaled_in_one_pass(shape):
    """``dp.noise``: ``std`` times the numbers ``torch.randn`` draws from the same generator
    (within one rounding of float32: the product is rounded once), written by one kernel,
    with no second pass over the tensor to scale it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from gradhooks.workflows import dp

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    p = torch.zeros(shape)
    with Ops() as seen:
        got = dp.noise(p, torch.Generator().manual_seed(4), 1.3)
    want = torch.randn(shape, generator=torch.Generator().manual_seed(4)).double() * 1.3
    assert got.shape == p.shape and got.dtype == p.dtype and got.is_contiguous()
    assert float((got.double() - want).abs().max()) <= 2 * 2**-24 * float(want.abs().max())
    # (torch.normal of a size: one operation that allocates and draws, as empty().normal_())
    drawn = [op for op in seen.ops if op not in ("empty", "empty_strided")]
    assert drawn in (["normal"], ["normal_"]), seen.ops


def test_ghost_frees_each_clipped_gradient_once_added_to_its_noise(monkeypatch):
    """Ghost clipping's second backward gives autograd's clipped sums of every parameter at
    once; each is freed once added to its noise, before the next parameter's noise is drawn
    (not all held until the last one's)."""
    import weakref

    from gradhooks.workflows import dp

    backwards: list[list] = []
    real_grads, real_noise = dp._grads, dp.noise

    def grads(*args, **kwargs):
        out = real_grads(*args, **kwargs)
        backwards.append([None if t is None else weakref.ref(t) for t in out])
        return out

    alive: list[int] = []

    def noise(*args):
        drawn = len(alive)  # (the parameters whose noise was drawn, and their sums added)
        alive.append(sum(r is not None and r() is not None for r in backwards[-1][:drawn]))
        return real_noise(*args)

    monkeypatch.setattr(dp, "_grads", grads)
    monkeypatch.setattr(dp, "noise", noise)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    x, y = torch.randn(5, 6), torch.randint(4, (5,))
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        for _ in range(2):
            backwards.clear()
            alive.clear()
            gradhooks.dp_sgd_step(
                h, F.cross_entropy(model(x), y, reduction="none"), max_norm=0.1,
                noise_multiplier=1.0, method="ghost",
            )  # fmt: skip
            assert len(backwards) == 2 and len(alive) == 4 and not any(alive), alive


@pytest.mark.parametrize("groups", [None, "parameter"], ids=["one-bound", "per-parameter"])
def test_bookkeeping_clipped_sum_of_an_embedding_model_is_the_float64_loops(groups):
    """``clipped_sum`` (no noise: an embedding's looked-up rows added into zeros once the other
    sums are formed), one bound or one per parameter, against the float64 per-example loop."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(30, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    model = model.double()
    x, y = torch.randint(30, (5, 7)), torch.randint(4, (5, 7))

    def loss(out, t):
        return (
            F.cross_entropy(out.flatten(0, 1), t.flatten(), reduction="none").view(t.shape).mean(1)
        )

    want = loop_grad(model, lambda o, t: loss(o, t).mean(), x, y)
    max_norm = reference_median(want) if groups is None else 0.05
    if groups is None:
        _, clipped = clipped_reference(want, max_norm)
    else:  # (each parameter clipped to C/√K on its own)
        bound = max_norm / len(want) ** 0.5
        clipped = {}
        for n, g in want.items():
            f = torch.clamp(bound / g.flatten(1).norm(dim=1), max=1.0)
            clipped[n] = torch.einsum("b,b...->...", f, g)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        for _ in range(2):  # (the first step checked, the second not)
            got = gradhooks.clipped_sum(
                h, loss(model(x), y), max_norm=max_norm, method="bookkeeping",
                clipping_groups=groups,
            )  # fmt: skip
            names = {id(p): n for n, p in model.named_parameters()}
            for p, s in zip(got.params, got.sums, strict=True):
                assert_close(s, clipped[names[id(p)]], f"{groups}: {names[id(p)]}")

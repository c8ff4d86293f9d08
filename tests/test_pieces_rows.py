"""The Rows piece (embedding tables): its grad1, grad1_into, select, norms, squared sums and
batch sums against a dense construction, and norms / squared sums of models with embeddings
(tied to an output Linear, reused, padding_idx, bags) against the per-example loop oracle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gradhooks
from gradhooks import pieces as P
from gradhooks.oracle import loop_grad, vmap_grad
from harness import assert_close


def random_rows(batch, rows, dim, entries, seed, positions=None):
    gen = torch.Generator().manual_seed(seed)
    if positions is not None:
        example = torch.arange(batch).repeat_interleave(positions)
    else:
        example = (
            torch.randint(max(batch, 1), (entries,), generator=gen)
            if batch
            else torch.zeros(0, dtype=torch.long)
        )
    index = torch.randint(rows, (example.numel(),), generator=gen)
    g = torch.randn(example.numel(), dim, generator=gen, dtype=torch.float64)
    return P.Rows(example, index, g, batch, rows, positions)


def dense(piece: P.Rows) -> torch.Tensor:
    out = torch.zeros(piece.batch, piece.num_rows, piece.g.shape[-1], dtype=piece.g.dtype)
    for e in range(piece.example.numel()):
        out[piece.example[e], piece.index[e]] += piece.g[e]
    return out


@settings(max_examples=20, deadline=None)
@given(
    batch=st.sampled_from([0, 1, 5]),
    rows=st.integers(1, 6),
    dim=st.integers(1, 4),
    entries=st.integers(0, 12),
    seed=st.integers(0, 100),
    scale=st.sampled_from([1.0, 2.5]),
)
@pytest.mark.parametrize("free", [True, False], ids=["cpu", "device-like"])
@pytest.mark.parametrize("positions", [None, 3], ids=["scattered", "positions"])
def test_rows_methods_against_dense(free, positions, batch, rows, dim, entries, seed, scale):
    """Also as on a device whose values cost a wait to read back (:func:`gradhooks.devices.reads_are_free`),
    and with every example's entries together, in order (``positions``)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gradhooks.devices, "reads_are_free", lambda t: free)
        _rows_methods_against_dense(batch, rows, dim, entries, seed, scale, positions)


def _rows_methods_against_dense(batch, rows, dim, entries, seed, scale, positions):
    p = random_rows(batch, rows, dim, entries, seed, positions)
    q = random_rows(batch, rows, dim, entries + 3, seed + 1)
    shape = torch.Size([rows, dim])
    want = dense(p)
    assert_close(p.grad1(shape, scale), want * scale, "grad1")
    out = torch.full((batch, rows, dim), 7.0, dtype=torch.float64)
    p.grad1_into(out, scale)
    assert_close(out, want * scale, "grad1_into")
    p.grad1_into(out, 1.0, accumulate=True)
    assert_close(out, want * (scale + 1), "grad1_into accumulate")
    if batch:
        sl = slice(1, batch)
        assert_close(p.select(sl).grad1(shape), want[sl], "select")
    both = want * scale + dense(q) * 2.0
    assert_close(P.rows_sq_norm([(p, scale), (q, 2.0)]), both.flatten(1).pow(2).sum(1), "sq_norm")
    assert_close(P.rows_sum_sq([(p, scale), (q, 2.0)], shape), both.pow(2).sum(0), "sum_sq")
    assert_close(p.sum_sq(shape), want.pow(2).sum(0), "sum_sq one piece")
    assert_close(p.batch_sum(shape), want.sum(0), "batch_sum")


@pytest.mark.parametrize("shared", [1, 3, 40])  # 40: Gram dearer than materializing -> None
def test_rows_outer_inner_against_dense(shared):
    batch, rows, dim, positions = 3, 9, 5, 4
    p = random_rows(batch, rows, dim, 0, 3, positions)
    gen = torch.Generator().manual_seed(5)
    a = torch.randn(batch, shared, dim, generator=gen, dtype=torch.float64)
    g = torch.randn(batch, shared, rows, generator=gen, dtype=torch.float64)
    q = P.Outer(a, g)
    got = P.rows_outer_inner(p, q)
    if 2 * positions * shared >= rows * dim:
        assert got is None
        return
    want = (dense(p) * q.grad1(torch.Size([rows, dim]))).flatten(1).sum(1)
    assert_close(got, want, "rows_outer_inner")


class TiedLM(nn.Module):
    def __init__(self, vocab, dim, padding_idx, reuse):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.tok.weight
        self.reuse = reuse

    def forward(self, x):
        h = self.tok(x)
        if self.reuse:
            h = h + self.tok(x.flip(1))
        return self.out(torch.tanh(self.mix(h)))


def sum_of_squares(out):
    return (out**2).sum()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("batch", [0, 1, 4])
@pytest.mark.parametrize(
    "vocab,dim,seq,padding_idx,reuse",
    [
        (50, 8, 5, 0, False),  # Gram cross term (2·5·5 < 50·8)
        (50, 8, 5, None, True),  # reused embedding, tied
        (7, 3, 6, 2, False),  # cross term dearer than materializing: per-chunk fallback
        (7, 3, 6, None, True),
    ],
)
def test_tied_embedding_norms_against_loop(vocab, dim, seq, padding_idx, reuse, batch, reduction):
    torch.manual_seed(0)
    model = TiedLM(vocab, dim, padding_idx, reuse).double()
    x = torch.randint(vocab, (batch, seq))
    if batch and padding_idx is not None:
        x[0, :2] = padding_idx
    loop = loop_grad(model, sum_of_squares, x)
    with gradhooks.add_hooks(model, reduction, quantities=("norms", "sum_grad_sq")) as h:
        loss = sum_of_squares(model(x))
        (loss / max(batch, 1) if reduction == "mean" else loss).backward()
    norms, sums = h.param_norms(), h.sum_grad_sq()
    for name, g in loop.items():
        assert_close(norms[name], g.flatten(1).norm(dim=1), f"{name} norm")
        assert_close(sums[name], (g**2).sum(0), f"{name} sum_grad_sq")
    with gradhooks.add_hooks(model, reduction):
        loss = sum_of_squares(model(x))
        (loss / max(batch, 1) if reduction == "mean" else loss).backward()
    for name, p in model.named_parameters():
        assert_close(p.grad1, loop[name], f"{name} grad1")
    if batch:
        assert_close(p.grad1, vmap_grad(model, sum_of_squares, x)[name], f"{name} vmap")


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_embedding_bag_norms_against_loop(mode, weighted):
    torch.manual_seed(1)
    if weighted and mode == "mean":
        pytest.skip("torch: per_sample_weights only with mode='sum'")
    model = nn.EmbeddingBag(9, 4, mode=mode, padding_idx=1).double()
    x = torch.randint(9, (5, 6))
    x[0, :3] = 1
    w = torch.rand(5, 6, dtype=torch.float64)

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.bag = model

        def forward(self, x, w):
            return self.bag(x, per_sample_weights=w if weighted else None)

    wrap = Wrap()
    loop = loop_grad(wrap, sum_of_squares, (x, w))
    with gradhooks.add_hooks(wrap, "sum", quantities=("norms", "sum_grad_sq")) as h:
        sum_of_squares(wrap(x, w)).backward()
    g = loop["bag.weight"]
    assert_close(h.param_norms()["bag.weight"], g.flatten(1).norm(dim=1), "bag norm")
    assert_close(h.sum_grad_sq()["bag.weight"], (g**2).sum(0), "bag sum_grad_sq")


def test_grad1_into_a_reused_buffer_zeroes_only_the_rows_written_before(monkeypatch):
    """Writing a piece into a buffer that pieces were written into (and accumulated into) zeroes
    only the rows they wrote; all of it where the buffer was changed in place since (also
    through a view)."""
    first, second = (random_rows(3, 20, 2, 0, seed, positions=4) for seed in (1, 2))
    out = torch.empty(3, 20, 2, dtype=torch.float64)
    first.grad1_into(out, 2.0)
    torch.testing.assert_close(out, dense(first) * 2.0)
    calls = []
    original = torch.Tensor.zero_
    monkeypatch.setattr(torch.Tensor, "zero_", lambda t: calls.append(t.shape) or original(t))
    second.grad1_into(out, 3.0)  # only first's rows are zeroed
    assert calls == []
    torch.testing.assert_close(out, dense(second) * 3.0)
    first.grad1_into(out, 1.0, accumulate=True)  # both pieces' rows are recorded
    second.grad1_into(out, 1.0)
    assert calls == []
    torch.testing.assert_close(out, dense(second))
    for change in (lambda t: t[1].add_(1.0), lambda t: t.view(-1)[5].fill_(7.0),
                   lambda t: t.mul_(0.5).add_(1.0)):  # fmt: skip
        change(out)
        first.grad1_into(out, 1.0)
        torch.testing.assert_close(out, dense(first))
    assert len(calls) == 3  # each change: zeroed everywhere
    for _ in range(5):  # more entries accumulated than rows: zeroed everywhere next time
        first.grad1_into(out, 1.0, accumulate=True)
    second.grad1_into(out, 1.0)
    torch.testing.assert_close(out, dense(second))
    assert len(calls) == 4


def test_embedding_grad1_over_steps_with_reused_memory():
    """An embedding's grad1, its memory reused step after step (other tokens each step, a step
    with an in-place change of grad1 in between), against vmap(grad)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(7, 3), nn.Flatten(), nn.Linear(12, 2)).double()
    loss_fn = nn.functional.cross_entropy
    with gradhooks.add_hooks(model) as h:
        ptr = None
        for step in range(4):
            x, y = torch.randint(7, (5, 4)), torch.randint(2, (5,))
            h.clear()
            model.zero_grad()
            loss_fn(model(x), y).backward()
            g1 = model[0].weight.grad1
            torch.testing.assert_close(g1, vmap_grad(model, loss_fn, x, y)["0.weight"])
            assert ptr is None or g1.data_ptr() == ptr
            ptr = g1.data_ptr()
            if step == 1:
                g1.add_(1.0)  # a change in place: the next step zeroes everything
            del g1


def test_positions_over_the_full_table_then_fewer(monkeypatch):
    """A position embedding looked up at every row once, in order (a full context), writes the
    entries themselves (no zeroing, no scatter); then a shorter context into the same memory
    zeroes the rows past it. Both against vmap(grad), at mean and sum."""
    torch.manual_seed(0)

    class Positions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pos = nn.Embedding(6, 3)

        def forward(self, x):  # x [batch, seq, 3]
            pos = torch.arange(x.shape[1]).expand(x.shape[:2])
            return x * self.pos(pos)

    model = Positions().double()
    scatters = []
    original = torch.Tensor.index_add_
    monkeypatch.setattr(
        torch.Tensor, "index_add_", lambda t, *a: scatters.append(t.shape) or original(t, *a)
    )
    for reduction in ("mean", "sum"):
        with gradhooks.add_hooks(model, reduction) as h:
            for seq in (6, 6, 4, 6):
                x = torch.randn(5, seq, 3, dtype=torch.float64)
                h.clear()
                scatters.clear()
                loss = sum_of_squares(model(x))
                (loss / 5 if reduction == "mean" else loss).backward()
                want = vmap_grad(model, sum_of_squares, x)["pos.weight"]
                torch.testing.assert_close(model.pos.weight.grad1, want)
                # (off the CPU, where the order cannot be read back: always a scatter)
                full = seq == 6 and gradhooks.devices.reads_are_free(x)
                assert bool(scatters) != full, (seq, scatters)


@pytest.mark.parametrize("scale", [1.0, 2.5])
@pytest.mark.parametrize(
    "batch,rows,dim,positions",
    [
        (16, 400, 16, 64),  # 1,024 lookups, few repeats: the shared rows counted
        (16, 40, 8, 64),  # many repeats: every lookup compacted
        (16, 5000, 2, 64),  # a table of counts larger than the rows compacted
        (2, 200, 8, 4),  # few lookups
        (0, 200, 8, 600),
    ],
)
def test_one_rows_piece_sq_norm_against_dense(batch, rows, dim, positions, scale):
    """The squared norm of one Embedding call's piece (``Rows.sq_norm``), on each of its
    paths, against the dense per-example gradient."""
    piece = random_rows(batch, rows, dim, None, seed=1, positions=positions)
    want = (dense(piece) * scale).flatten(1).square().sum(1)
    sq, form, _ = piece.sq_norm(dense(piece).shape[1:], scale)
    assert_close(sq, want, "rows sq norm")
    assert form == "rows"


@pytest.mark.parametrize("padding_idx", [None, 3])
def test_embedding_norms_with_many_lookups_against_oracles(padding_idx):
    """An Embedding with enough lookups for the counted path, repeats and padding included."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(600, 16, padding_idx=padding_idx), nn.Linear(16, 2)).double()
    x = torch.randint(600, (16, 80))
    x[0, :5] = 3  # repeats within an example (and the padding row, where there is one)
    loss = lambda out: (out**2).sum()  # noqa: E731
    loop, vmapped = loop_grad(model, loss, x), vmap_grad(model, loss, x)
    with gradhooks.add_hooks(model, "sum", quantities=("norms",)) as h:
        loss(model(x)).backward()
    got = h.param_norms()["0.weight"]
    assert_close(got, loop["0.weight"].flatten(1).norm(dim=1), "embedding norm vs loop")
    assert_close(got, vmapped["0.weight"].flatten(1).norm(dim=1), "embedding norm vs vmap")

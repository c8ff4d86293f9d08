"""Mixtures of experts whose experts are hooked ``nn.Linear`` children: the tokens each expert
gets are rows picked from the batch by an index (``h[top_x]``, ``h[mask]``) and put back
(``index_add_``, ``out[mask] = ...``); each row is one example's, so each example's gradient
is the sum of its rows'. Checked against the per-example loop in float64 (routing per token:
the loop routes each example's tokens as the batch does)."""

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_close, sq

D = torch.float64


class Expert(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


class MoE(nn.Module):
    """Top-``k`` routing per token. ``style``: ``"where"`` (Mixtral: ``torch.where`` of the
    choices, rows picked by index and put back with ``index_add_``), ``"iadd"`` (the same put
    back by ``out[token] += ...``, Mixtral's reference code), ``"mask"`` (a boolean mask
    per expert, ``out[mask] = ...``), ``"select"`` (``index_select``, each expert's rows
    concatenated and put back with ``index_copy``). ``skip``: an expert that gets no token is
    not called (no gradient) rather than called on no rows (a zero gradient). ``capacity``:
    each expert keeps its first ``capacity`` tokens of the whole batch (counted across it)."""

    def __init__(self, k=1, style="where", skip=False, capacity=None, dim=4, hidden=5, experts=3):
        super().__init__()
        self.k, self.style, self.skip, self.capacity = k, style, skip, capacity
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(experts))
        self.head = nn.Linear(dim, 2)

    def forward(self, x):  # [batch, tokens, dim]
        b, t, d = x.shape
        h = x.view(-1, d)
        weights, chosen = self.gate(h).softmax(-1).topk(self.k, -1)
        if self.capacity is not None:  # (Switch's capacity, but counted over the whole batch)
            hits = F.one_hot(chosen[:, 0], len(self.experts))
            kept = (hits.cumsum(0) * hits).sum(-1) <= self.capacity
            chosen = torch.where(kept[:, None], chosen, -1)
        out = torch.zeros_like(h)
        if self.style == "select":
            order, parts = [], []
            for e, expert in enumerate(self.experts):
                rows = torch.where(chosen[:, 0] == e)[0]
                order.append(rows)
                parts.append(expert(h.index_select(0, rows)) * weights[rows, :1])
            out = out.index_copy(0, torch.cat(order), torch.cat(parts))
            return self.head(out.view(b, t, d))
        for e, expert in enumerate(self.experts):
            if self.style == "iadd":
                token, slot = torch.where(chosen == e)
                out[token] += expert(h[token]) * weights[token, slot, None]
            elif self.style == "where":
                token, slot = torch.where(chosen == e)
                if self.skip and token.numel() == 0:
                    continue
                out.index_add_(0, token, expert(h[token]) * weights[token, slot, None])
            else:
                mask = (chosen == e).any(-1)
                if self.skip and not bool(mask.any()):
                    continue
                weight = (weights * (chosen == e)).sum(-1)
                out[mask] = out[mask] + expert(h[mask]) * weight[mask, None]
        return self.head(out.view(b, t, d))


def check(m, x, quantity="grad1"):
    want = loop_grad(m, sq, x)
    with gradhooks.add_hooks(m, loss_reduction="sum", quantities=(quantity,)) as h:
        sq(m(x)).backward()
        if quantity == "norms":
            flat = [g.reshape(x.shape[0], -1) for g in want.values() if g is not None]
            assert_close(h.norms(), torch.cat(flat, 1).norm(dim=1), "norms")
            return
    for n, p in m.named_parameters():
        if p.grad is None:
            assert not hasattr(p, "grad1"), n  # (as .grad: no gradient, no grad1)
        else:
            assert_close(p.grad1, want[n], n)


@pytest.mark.parametrize("style", ["where", "iadd", "mask", "select"])
@pytest.mark.parametrize("k", [1, 2], ids=["top-1", "top-2"])
@pytest.mark.parametrize("quantity", ["grad1", "norms"])
def test_routed_experts_against_the_loop(k, style, quantity):
    if style == "select" and k == 2:
        pytest.skip("the select form routes each token's first choice alone")
    torch.manual_seed(0)
    m = MoE(k=k, style=style).double()
    check(m, torch.randn(3, 5, 4, dtype=D), quantity)


class _Numbered(MoE):
    """Mixtral's reference routing, ``out[token] += ...``, into rows numbered across the batch
    (``arange`` of the flattened batch's size) rather than zeros: an example alone would number
    its rows from 0, so the rows picked from them are not its own."""

    def forward(self, x):
        h = x.view(-1, x.shape[-1])
        weights, chosen = self.gate(h).softmax(-1).topk(self.k, -1)
        out = torch.arange(h.numel(), dtype=h.dtype).view_as(h)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            out[token] += expert(h[token]) * weights[token, slot, None]
        return self.head(out.view(x.shape))


def test_rows_picked_from_rows_that_differ_across_the_batch_are_refused():
    """Rows of zeros (``zeros_like(h)``) picked by the experts' index are zeros for an example
    alone too, and are followed (``test_routed_experts_against_the_loop``); rows numbered across
    the batch are not an example's own, and stay refused, nothing written."""
    torch.manual_seed(0)
    m, x = _Numbered(k=2).double(), torch.randn(3, 5, 4, dtype=D)
    want = loop_grad(m, sq, x)
    with torch.no_grad():
        full = m(x)
        alone = torch.cat([m(x[i : i + 1]) for i in range(3)])
    assert not torch.allclose(full, alone)  # (the batch's rows are not each example's)
    with pytest.raises(gradhooks.MixedExamplesError, match="'head' \\(Linear\\)"):
        with gradhooks.add_hooks(m, loss_reduction="sum"):
            sq(m(x)).backward()
    assert all(p.grad is None and not hasattr(p, "grad1") for p in m.parameters())
    assert want


def _no_tokens_for(m, expert: int) -> None:
    """The gate never picks ``expert`` (for inputs of positive entries)."""
    with torch.no_grad():
        m.gate.weight[expert] = -100


@pytest.mark.parametrize("style", ["where", "mask"])
def test_an_expert_without_tokens_gets_zeros_for_every_example(style):
    """Called on no rows: autograd gives it a zero gradient, and every example a zero grad1."""
    torch.manual_seed(0)
    m = MoE(style=style).double()
    _no_tokens_for(m, 1)
    x = torch.randn(3, 5, 4, dtype=D).abs()
    check(m, x)
    g1 = m.experts[1].up.weight.grad1
    assert g1.shape == (3, 5, 4) and not g1.any()


def test_an_expert_not_called_gets_no_grad1():
    torch.manual_seed(0)
    m = MoE(skip=True).double()
    _no_tokens_for(m, 1)
    check(m, torch.randn(3, 5, 4, dtype=D).abs())
    assert m.experts[1].up.weight.grad is None


def test_tokens_per_expert_change_from_step_to_step():
    """The same hooks over several steps: each expert gets other tokens, of other examples,
    and as many as the routing gives."""
    torch.manual_seed(0)
    m = MoE(k=2).double()
    with gradhooks.add_hooks(m, loss_reduction="sum") as h:
        for step in range(3):
            x = torch.randn(2 + step, 4 + step, 4, dtype=D)
            want = loop_grad(m, sq, x)
            h.clear()
            m.zero_grad()
            sq(m(x)).backward()
            for n, p in m.named_parameters():
                assert_close(p.grad1, want[n], f"step {step} {n}")


def test_capacity_counted_across_the_batch_is_refused():
    """Which tokens an expert drops depends on other examples' tokens: one example alone would
    keep others, so its gradient in the batch is not its own. Refused, naming the layer."""
    torch.manual_seed(0)
    m = MoE(capacity=2).double()
    x = torch.randn(3, 5, 4, dtype=D)
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        with pytest.raises(gradhooks.MixedExamplesError, match=r"'experts\.\d\.up' \(Linear\).*index computed "
                                               r"across the batch \(cumsum"):  # fmt: skip
            m(x)
    assert not any(hasattr(p, "grad1") for p in m.parameters())


class Truncated(MoE):
    """Each expert keeps the first ``capacity`` of its tokens in the batch, by slicing the
    positions ``torch.where`` found (``how="slice"``), or by a mask of their positions
    (``"arange"``): the first tokens of the batch, not of each example. ``"per-token"``
    drops the tokens whose weight is small: each token's own choice."""

    def __init__(self, how="slice", **kw):
        super().__init__(**kw)
        self.how = how

    def forward(self, x):
        b, t, d = x.shape
        h = x.view(-1, d)
        weights, chosen = self.gate(h).softmax(-1).topk(1, -1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            token = torch.where(chosen[:, 0] == e)[0]
            if self.how == "slice":
                token = token[: self.capacity]
            elif self.how == "arange":
                token = token[torch.arange(token.numel()) < self.capacity]
            else:
                token = token[weights[token, 0] > 0.4]
            out.index_add_(0, token, expert(h[token]) * weights[token])
        return self.head(out.view(b, t, d))


@pytest.mark.parametrize("how", ["slice", "arange"])
def test_capacity_by_position_among_the_tokens_found_is_refused(how):
    torch.manual_seed(0)
    m = Truncated(how, capacity=2).double()
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        with pytest.raises(gradhooks.MixedExamplesError, match=r"'experts\.\d\.up' \(Linear\).*index computed "
                                               r"across the batch \(__getitem__ of the rows"):  # fmt: skip
            m(torch.randn(3, 5, 4, dtype=D))


def test_tokens_dropped_each_by_its_own_weight():
    torch.manual_seed(0)
    m = Truncated("per-token").double()
    x = torch.randn(3, 5, 4, dtype=D)
    check(m, x)


def test_rows_picked_into_a_module_without_a_rule_are_refused():
    """An expert with a bare parameter gets rows of different numbers per example: its
    torch.func fallback cannot split them, and says so."""

    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            return x @ self.w

    torch.manual_seed(0)
    m = MoE().double()
    m.experts[0] = Bare().double()
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        with pytest.raises(
            gradhooks.UnsupportedError, match=r"'experts\.0' \(.*Bare\).*cannot split"
        ):
            sq(m(torch.randn(3, 5, 4, dtype=D))).backward()


class Unpadded(nn.Module):
    """The unpadded tokens of a batch (flash-attention's varlen path: ``_unpad_input``), a
    Linear on them, padded back: picked by ``x[indices]`` or ``gather``, put back by
    ``out[indices] = ...`` or ``scatter_add_``."""

    def __init__(self, how):
        super().__init__()
        self.how, self.a, self.b, self.head = how, nn.Linear(3, 5), nn.Linear(5, 5), nn.Linear(5, 2)

    def forward(self, x, mask):  # [batch, seq, 3], [batch, seq] (True: a token)
        b, t, _ = x.shape
        h = torch.tanh(self.a(x)).flatten(0, 1)
        indices = torch.nonzero(mask.flatten()).flatten()
        if self.how == "index":
            packed = self.b(h[indices])  # [tokens, 5]
            out = h.new_zeros(b * t, 5)
            out[indices] = packed
        else:
            rows = indices[:, None].expand(-1, 5)
            packed = self.b(torch.gather(h, 0, rows))
            out = h.new_zeros(b * t, 5).scatter_add_(0, rows, packed)
        return self.head(out.view(b, t, 5))


@pytest.mark.parametrize("how", ["index", "gather"])
def test_unpadded_tokens(how):
    torch.manual_seed(0)
    m = Unpadded(how).double()
    x = torch.randn(3, 4, 3, dtype=D)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    want = loop_grad(m, sq, (x, mask))
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        sq(m(x, mask)).backward()
    for n, p in m.named_parameters():
        assert_close(p.grad1, want[n], n)


# -- Hugging Face --------------------------------------------------------------------------------


@pytest.fixture
def transformers():
    sys.modules.setdefault("torchvision", None)  # (a CUDA build's C ops do not load on CPU)
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    return tf


class Hidden(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).last_hidden_state


@pytest.mark.parametrize("capacity", [64, 1], ids=["no-drop", "drops"])
def test_switch_transformers(transformers, capacity):
    """Switch's capacity is counted per sequence (``cumsum`` along the tokens of each): the
    loop drops the same tokens, so a capacity that drops tokens is as right as one that
    does not."""
    cfg = transformers.SwitchTransformersConfig(
        vocab_size=32, d_model=8, d_kv=4, d_ff=12, num_layers=2, num_heads=2, num_experts=3,
        expert_capacity=capacity, encoder_sparse_step=1, dropout_rate=0.0,
        router_jitter_noise=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.SwitchTransformersEncoderModel(cfg).double().eval()
    for mod in model.modules():  # (the router in float64 too, as the rest)
        if type(mod).__name__.endswith("Router"):
            mod.dtype = D
    m, ids = Hidden(model), torch.randint(0, 32, (3, 7))
    if capacity == 1:
        with torch.no_grad():
            chosen = (
                model.encoder.block[0]
                .layer[1]
                .mlp.router(model.encoder.block[0].layer[0](model.shared(ids))[0])[0]
            )
        assert (chosen.sum((1, 2)) < ids.shape[1]).all()  # (tokens are dropped)
    want = loop_grad(m, sq, ids)
    with gradhooks.add_hooks(m, loss_reduction="sum"):  # (verify=True: T5's float32 softmax)
        sq(m(ids)).backward()
    for n, p in m.named_parameters():
        assert_close(p.grad1, want[n], n)


def _nllb(transformers, capacity):
    cfg = transformers.NllbMoeConfig(
        vocab_size=32, d_model=8, encoder_layers=2, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=12, decoder_ffn_dim=12, num_experts=3,
        expert_capacity=capacity, encoder_sparse_step=1, decoder_sparse_step=1, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, max_position_embeddings=32,
        moe_token_dropout=0.0, moe_eval_capacity_token_fraction=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.NllbMoeModel(cfg).double().eval()
    for mod in model.modules():  # (the router in float64 too, as the rest)
        if type(mod).__name__.endswith("Router"):
            mod.dtype = D
    return Hidden(model.encoder)


def test_nllb_moe_with_a_capacity_that_drops_nothing(transformers):
    """NLLB-MoE counts its capacity over every token of the batch (``cumsum`` along it); where
    no expert overflows, the mask it multiplies by keeps every token, and each example's
    gradient is its own."""
    m, ids = _nllb(transformers, 64), torch.randint(2, 32, (3, 6))
    want = loop_grad(m, sq, ids)
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        sq(m(ids)).backward()
    for n, p in m.named_parameters():
        if p.grad is None:
            assert not hasattr(p, "grad1"), n
        else:
            assert_close(p.grad1, want[n], n)


def test_nllb_moe_dropping_tokens_across_the_batch_is_refused(transformers):
    """A capacity of 2 tokens per expert over the whole batch: which tokens an expert drops
    depends on the other examples, so the layer after the routing is refused, naming it."""
    m, ids = _nllb(transformers, 2), torch.randint(2, 32, (3, 6))
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        with pytest.raises(gradhooks.MixedExamplesError, match=r"'model\.layers\.0\.ffn\.experts\.expert_\d\.fc1' "
                                               r"\(Linear\).*index computed across the batch "
                                               r"\(cumsum"):  # fmt: skip
            m(ids)


# -- the layout itself ---------------------------------------------------------------------------


def _followed(fn, batch=3, tokens=4):
    """``fn(h)`` of ``h`` ``[batch * tokens, 5]`` (tokens folded into the batch) under a tracker:
    the layouts it gives, by name."""
    from gradhooks.tracking import Layout, Tracker

    x = torch.randn(batch, tokens, 5, dtype=D, requires_grad=True)
    tracker = Tracker(batch, {})
    tracker.set_layout(x, Layout(0))
    with tracker:
        found = fn(x.view(-1, 5))
    return {k: tracker.layout(v) for k, v in found.items()}


def test_rows_picked_are_owned_by_their_examples_and_put_back():
    from gradhooks.tracking import MIXED, Layout

    token = torch.tensor([0, 5, 6, 11])  # (examples 0, 1, 1, 2 of 3 x 4 tokens)

    def fn(h):
        rows = h[token]
        out = torch.zeros_like(h).index_add_(0, token, rows * 2)
        other = h[token.flip(0)]
        shifted = torch.zeros_like(h).index_add_(0, (token + 1) % 12, rows)
        return {
            "rows": rows, "wide": rows.view(4, 1, 5), "out": out, "back": out.view(3, 4, 5),
            "mixed": rows + other, "shifted": shifted, "repeat": rows.repeat(2, 1),
            "split": rows.split([1, 3])[0], "sliced": rows[:2],
        }  # fmt: skip

    lays = _followed(fn)
    assert torch.equal(lays["rows"].owners.rows, torch.tensor([0, 1, 1, 2]))
    assert lays["wide"] == Layout(0, owners=lays["rows"].owners)
    assert lays["out"] == Layout(0, inner=4) and lays["back"] == Layout(0)
    assert lays["mixed"] is MIXED  # (row 0 of example 0 added to row 3 of example 2)
    assert lays["shifted"] is MIXED  # (token 11, example 2's, written into row 0, example 0's)
    assert lays["repeat"] is MIXED  # (an operation that does not follow owned rows)
    assert lays["split"] is MIXED and lays["sliced"] is MIXED  # (by position: as a capacity)


def test_whole_examples_picked_are_still_refused():
    """``x[[1, 0, 0]]`` on ``[batch, F]``: the batch itself changed (an example twice, one
    gone), not tokens of examples picked."""
    from gradhooks.tracking import MIXED, Layout, Tracker

    x = torch.randn(3, 5, dtype=D, requires_grad=True)
    tracker = Tracker(3, {})
    tracker.set_layout(x, Layout(0))
    with tracker:
        out = x[torch.tensor([1, 0, 0])]
    assert tracker.layout(out) is MIXED


class _SequenceFirst(MoE):
    """fairseq's and Tutel's layout: ``[tokens, batch, dim]`` flattened to rows (``t * B + b``),
    the experts' rows picked and put back as :class:`MoE` does."""

    def forward(self, x):  # [tokens, batch, dim]
        return super().forward(x.transpose(0, 1).contiguous()).transpose(0, 1)


class _SequenceFirstRows(MoE):
    """The same rows routed without moving the batch first: ``x.reshape(-1, dim)`` of
    ``[tokens, batch, dim]``, each row a token of one example, the examples repeated along it."""

    def forward(self, x):  # [tokens, batch, dim]
        t, b, d = x.shape
        h = x.reshape(-1, d)
        weights, chosen = self.gate(h).softmax(-1).topk(self.k, -1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            if self.style == "iadd":
                out[token] += expert(h[token]) * weights[token, slot, None]
            else:
                out.index_add_(0, token, expert(h[token]) * weights[token, slot, None])
        return self.head(out.view(t, b, d))


@pytest.mark.parametrize("style", ["where", "iadd"])
@pytest.mark.parametrize("cls", [_SequenceFirst, _SequenceFirstRows], ids=["moved", "folded"])
def test_sequence_first_tokens_routed_to_experts(cls, style):
    """Rows of a sequence-first batch flattened (``[T * B, dim]``, the examples repeated along
    them) picked by the experts' index are tokens, each of one example, as rows of a batch
    first one are (they were taken for whole examples picked, and refused); against the loop,
    ``batch_dim=1``."""
    torch.manual_seed(0)
    m, x = cls(k=2, style=style).double(), torch.randn(5, 3, 4, dtype=D)
    want = {n: [] for n, _ in m.named_parameters()}
    for i in range(3):
        grads = torch.autograd.grad(sq(m(x[:, i : i + 1])), list(m.parameters()))
        for (n, _), g in zip(m.named_parameters(), grads):
            want[n].append(g)
    with gradhooks.add_hooks(m, loss_reduction="sum", batch_dim=1):
        sq(m(x)).backward()
    for n, p in m.named_parameters():
        assert_close(p.grad1, torch.stack(want[n]), n)


def test_tokens_sorted_by_expert_across_the_batch_are_refused():
    """Sorting the tokens by expert (``argsort`` along the batch's tokens) and picking them in
    that order: the order comes from every example's tokens, and what follows (a split by the
    counts) cannot be told from a capacity; refused at the first expert, naming the argsort."""

    class Sorted(MoE):
        def forward(self, x):
            b, t, d = x.shape
            h = x.view(-1, d)
            weights, chosen = self.gate(h).softmax(-1).topk(1, -1)
            order = torch.argsort(chosen[:, 0], stable=True)
            counts = torch.bincount(chosen[:, 0], minlength=len(self.experts)).tolist()
            parts = torch.split(h[order], counts)
            done = torch.cat([ex(part) for ex, part in zip(self.experts, parts)])
            out = torch.zeros_like(h).index_copy(0, order, done * weights[order])
            return self.head(out.view(b, t, d))

    torch.manual_seed(0)
    m = Sorted().double()
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        with pytest.raises(
            gradhooks.MixedExamplesError, match=r"'experts\.0\.up' \(Linear\).*\(argsort"
        ):
            m(torch.randn(3, 5, 4, dtype=D))


class _Seq(nn.Module):
    """``[rows, time, 4]`` to the same: a layer in which each row of the batch runs alone."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        if kind == "conv1d":
            self.layer = nn.Conv1d(4, 4, 3, padding=1)
        elif kind == "attention":
            self.layer = nn.MultiheadAttention(4, 2, batch_first=True)
        elif kind == "gru_cell":
            self.layer = nn.GRUCell(4, 4)
        else:
            self.layer = getattr(nn, kind.upper())(4, 4, batch_first=True)

    def forward(self, x):
        if self.kind == "conv1d":
            return self.layer(x.transpose(1, 2)).transpose(1, 2)
        if self.kind == "attention":
            return self.layer(x, x, x, need_weights=False)[0]
        if self.kind == "gru_cell":
            return self.layer(x.flatten(0, 1)).view_as(x)
        return self.layer(x)[0]


class _Cut(nn.Module):
    """A layer called on a cut of the batch and on rows picked by an index, put back."""

    def __init__(self, kind: str):
        super().__init__()
        self.first, self.second, self.head = _Seq(kind), _Seq(kind), nn.Linear(4, 4)

    def forward(self, x):
        x = torch.cat([self.first(x[:1]), self.first(x[1:])])  # (the rows the batch's, in order)
        picked = (x[:, 0, 0] > 0).nonzero()[:, 0]
        x = x.index_add(0, picked, self.second(x[picked]))
        return self.head(torch.tanh(x))


@pytest.mark.parametrize("kind", ["conv1d", "attention", "gru", "lstm", "gru_cell"])
def test_layers_whose_rows_run_alone_on_rows_picked_from_the_batch(kind):
    """Convolutions, attention and recurrent layers run each row of the batch alone: called on
    ``x[:1]`` and ``x[1:]``, or on rows picked by an index, each row is still one example's."""
    torch.manual_seed(0)
    model = _Cut(kind).to(D)
    x = torch.randn(5, 6, 4, dtype=D)
    want = loop_grad(model, sq, x)
    with gradhooks.add_hooks(model, "sum"):
        sq(model(x)).backward()
    for name, p in model.named_parameters():
        assert_close(p.grad1, want[name], f"grad1 of {name}")

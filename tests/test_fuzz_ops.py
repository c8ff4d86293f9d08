"""Fuzzing the batch tracker: random chains of torch operations between layers, some of which
mix the examples, against the per-example loop.

:mod:`test_tracking_ops` checks each operation alone against an ownership oracle;
:mod:`test_fuzz` chains layers with a ``tanh`` between them. Here the activations
``[batch, time, features]`` go through drawn operations between the layers: views and
permutations inside an example, reductions along its time or features, shifts, gathers and
scatters, einsums, in-place writes into slices and views, rows picked by a mask and written
back, a recurrence written by hand over the unbound time steps, a layer called on the rows
folded into the batch, on a time-major view, on a cut of the batch or on the rows a mask
picks, a parameter of the model's own used directly; and operations across the batch (a
batch mean, even detached; a shift, flip or permutation of the examples; a ``reshape`` that
regroups them; a reduction, scatter or einsum over them). The layer each operation calls is
a Linear, a Conv1d over time, a LayerNorm, ``nn.MultiheadAttention``, a GRU or LSTM (batch
first) or a layer without a rule (the ``torch.func`` fallback); the model starts from
features or from tokens (an Embedding), batch-major or time-major (``batch_dim=1``).
Whatever the chain, hooks added once and trained for three steps (the third on a batch of
another size) must either give each example's gradient as the loop computes it, example by
example, or stop with a typed gradhooks error: a number that differs from the loop's, or an
error of torch's own from inside the hooks, fails. ``GRADHOOKS_FUZZ_OPS`` sets how many
chains (default 40); ``GRADHOOKS_FUZZ_RANDOM=1`` draws new ones on every run.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from fuzz_models import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn

import gradhooks
from gradhooks.errors import GradhooksError
from gradhooks.oracle import loop_grad
from harness import assert_close, sum_of_squares

EXAMPLES = int(os.environ.get("GRADHOOKS_FUZZ_OPS", "40"))
# time steps and features of every activation: never as many time steps as examples, where a
# reshape that regroups batch and time would regroup nothing (``x.transpose(0, 1).reshape(
# x.shape)`` is then a batch-major model turned time-major, which a batch of one is not)
T, D = 7, 4
TRIED: Counter = Counter()


def _perm(n: int) -> Tensor:
    return torch.arange(n).roll(1)


# Each operation maps [batch, T, D] to [batch, T, D]; ``lin`` is the next Linear(D, D) and
# ``p`` a [D] parameter of the model's own. Those that call ``lin`` themselves say so.
WITHIN = {
    "flip time": lambda x, lin, p: lin(x.flip(1)),
    "roll features": lambda x, lin, p: lin(x.roll(1, dims=2)),
    "transpose, reshape": lambda x, lin, p: lin(x.transpose(1, 2).reshape(x.shape)),
    "cat halves scaled": lambda x, lin, p: lin(torch.cat([x[..., :2], 2 * x[..., 2:]], -1)),
    "softmax gate": lambda x, lin, p: lin(x.softmax(-1) * x),
    "cumsum time": lambda x, lin, p: lin(x.cumsum(1)),
    "centre over time": lambda x, lin, p: lin(x - x.mean(1, keepdim=True)),
    "self-attention": lambda x, lin, p: lin((x @ x.transpose(1, 2)).softmax(-1) @ x),
    "fold time into batch": lambda x, lin, p: lin(x.reshape(-1, D)).reshape(x.shape),
    "time-major call": lambda x, lin, p: lin(x.transpose(0, 1)).transpose(0, 1),
    "stack, sum": lambda x, lin, p: lin(torch.stack([x, x.flip(1)]).sum(0)),
    "own parameter": lambda x, lin, p: lin(x * p),
    "where": lambda x, lin, p: lin(torch.where(x > 0, x, 0.1 * x)),
    "shift time by pad": lambda x, lin, p: lin(F.pad(x, (0, 0, 1, 0))[:, : x.shape[1]]),
    "index features": lambda x, lin, p: lin(x[..., _perm(D)]),
    "gather time": lambda x, lin, p: lin(
        x.gather(1, torch.arange(x.shape[1]).flip(0).view(1, -1, 1).expand(x.shape))
    ),
    "repeat, stride": lambda x, lin, p: lin(x.repeat(1, 2, 1)[:, ::2]),
    "outer over time": lambda x, lin, p: lin(
        torch.einsum("btf,btg->bfg", x, x).sum(-1).unsqueeze(1).expand(x.shape)
    ),
    "masked fill": lambda x, lin, p: lin(x.masked_fill(x < -0.5, 0.0)),
    "in-place slice": lambda x, lin, p: _in_place_slice(lin(x)),
    "flat roll": lambda x, lin, p: lin(x.reshape(x.shape[0], -1).roll(1, 1).reshape(x.shape)),
    "norm scale": lambda x, lin, p: lin(x / (x**2).sum(-1, keepdim=True).add(1).sqrt()),
    "layer norm": lambda x, lin, p: lin(F.layer_norm(x, (D,))),
    "chunks swapped": lambda x, lin, p: lin(torch.cat(x.chunk(2, -1)[::-1], -1)),
    "call twice": lambda x, lin, p: lin(torch.tanh(lin(x))),
    "split on batch, cat": lambda x, lin, p: torch.cat([lin(x[:1]), lin(x[1:])]),
    "heads": lambda x, lin, p: lin(_heads(x)),
    "masked mean over time": lambda x, lin, p: lin(_masked_mean(x)),
    "index_add over time": lambda x, lin, p: lin(
        torch.zeros_like(x).index_add(1, torch.arange(x.shape[1]) // 2 * 2, x)
    ),
    "windows": lambda x, lin, p: lin(F.pad(x.unfold(1, 2, 1).mean(-1), (0, 0, 0, 1))),
    "sort over time": lambda x, lin, p: lin(x.sort(1).values),
    "example mean expanded": lambda x, lin, p: lin(x.mean((1, 2), keepdim=True).expand_as(x) + x),
    "view, transpose, reshape": lambda x, lin, p: lin(
        x.view(*x.shape[:2], 2, 2).transpose(-1, -2).reshape(x.shape)
    ),
    "relu_ on a clone": lambda x, lin, p: lin(x.clone().relu_()),
    "where by example": lambda x, lin, p: lin(torch.where(x.sum((1, 2), keepdim=True) > 0, x, -x)),
    "normalize": lambda x, lin, p: lin(F.normalize(x, dim=-1)),
    "permute batch and back": lambda x, lin, p: lin(
        x[_perm(x.shape[0])][_perm(x.shape[0]).argsort()]
    ),
    "einsum of three": lambda x, lin, p: lin(torch.einsum("btf,bsf,bsg->btg", x, x, x) / T),
    "einsum with own parameter": lambda x, lin, p: lin(torch.einsum("btf,f,btg->btg", x, p, x)),
    "scatter_add over time": lambda x, lin, p: lin(
        torch.zeros_like(x).scatter_add(
            1, (torch.arange(x.shape[1]) // 3).view(1, -1, 1).expand(x.shape), x
        )
    ),
    "scatter_add by own order": lambda x, lin, p: lin(
        torch.zeros_like(x).scatter_add(2, x.detach().argsort(-1), x)
    ),
    "mask pick, written back": lambda x, lin, p: lin(_mask_written_back(x)),
    "layer on masked rows": lambda x, lin, p: _layer_on_masked_rows(x, lin),
    "unbind, stack time": lambda x, lin, p: lin(_scan(x)),
    "narrow": lambda x, lin, p: lin(
        torch.cat([x.narrow(1, 1, x.shape[1] - 1), x.narrow(1, 0, 1)], 1)
    ),
    "masked_select, scatter back": lambda x, lin, p: lin(
        x.masked_scatter(x.detach() > 0, x.masked_select(x.detach() > 0).sin())
    ),
    "split batch by two, cat": lambda x, lin, p: torch.cat([lin(c) for c in torch.split(x, 2)]),
    "split batch unevenly, cat": lambda x, lin, p: torch.cat(
        [lin(c) for c in torch.split(x, [1, x.shape[0] - 1])]
    ),
    "in-place on input view": lambda x, lin, p: lin(_in_place_views(x)),
    "in-place on output view": lambda x, lin, p: _in_place_output(lin(x)),
    "diff over time": lambda x, lin, p: lin(torch.diff(x, dim=1, prepend=x[:, :1])),
    "max pool over time": lambda x, lin, p: lin(
        F.max_pool1d(x.transpose(1, 2), 3, 1, 1).transpose(1, 2)
    ),
    "topk over time": lambda x, lin, p: lin(x + x.topk(2, dim=1).values.mean(1, keepdim=True)),
    "layer on a slice of time": lambda x, lin, p: torch.cat([lin(x[:, :2]), x[:, 2:]], 1),
}

# rows of the batch in another order through a layer, put back after it (a batch sorted by
# length for a recurrent layer): followed, or refused; never given a number that is not the
# loop's
REORDERED = {
    "sorted through a layer": lambda x, lin, p: _sorted_call(x, lin),
    "flip batch twice": lambda x, lin, p: lin(x.flip(0).flip(0)),
    "split batch, swapped": lambda x, lin, p: lin(
        torch.cat(torch.split(x, [1, x.shape[0] - 1])[::-1])
    ),
    # (each example taken out alone, flipped, and stacked again: the batch in its order)
    "unbind batch, stack": lambda x, lin, p: lin(torch.stack([e.flip(0) for e in x.unbind(0)])),
}

ACROSS = {
    "batch mean": lambda x, lin, p: lin(x - x.mean(0)),
    "detached batch mean": lambda x, lin, p: lin(x * x.detach().mean(0)),
    "roll batch": lambda x, lin, p: lin(x.roll(1, 0)),
    "batch sum added": lambda x, lin, p: lin(x + x.sum(0, keepdim=True)),
    "flip batch": lambda x, lin, p: lin(x.flip(0)),
    "permute batch": lambda x, lin, p: lin(x[_perm(x.shape[0])]),
    "batch norm": lambda x, lin, p: lin(
        F.batch_norm(x.transpose(1, 2), None, None, training=True).transpose(1, 2)
    ),
    "regrouping reshape": lambda x, lin, p: lin(x.reshape(x.shape[1], x.shape[0], D)).reshape(
        x.shape
    ),
    "transpose batch, reshape": lambda x, lin, p: lin(x.transpose(0, 1).reshape(x.shape)),
    "batch max": lambda x, lin, p: lin(x.max(0, keepdim=True).values * x),
    "cumsum batch": lambda x, lin, p: lin(x.cumsum(0)),
    "gram over batch": lambda x, lin, p: lin(
        (torch.einsum("btf,ctf->bc", x, x).softmax(-1) @ x.reshape(x.shape[0], -1)).reshape(x.shape)
    ),
    "rows shifted in place": lambda x, lin, p: lin(_shift_rows_in_place(x)),
    "scatter_add over batch": lambda x, lin, p: lin(
        torch.zeros_like(x).scatter_add(0, torch.zeros_like(x, dtype=torch.long), x)
    ),
    "einsum over batch": lambda x, lin, p: lin(torch.einsum("btf,ctf->ctf", x, x)),
    "unbind batch, stack reversed": lambda x, lin, p: lin(torch.stack(x.unbind(0)[::-1])),
    "masked rows of another example": lambda x, lin, p: lin(_other_rows(x)),
}

OPS = {**WITHIN, **ACROSS, **REORDERED}


def _heads(x: Tensor) -> Tensor:
    """Two heads of self-attention over time, split from the features and merged back."""
    b, t, d = x.shape
    q = x.view(b, t, 2, d // 2).transpose(1, 2)  # [b, heads, t, d / heads]
    att = (q @ q.transpose(-1, -2)).softmax(-1) @ q
    return att.transpose(1, 2).reshape(b, t, d)


def _masked_mean(x: Tensor) -> Tensor:
    """Each example's mean over its first steps (lengths from its own data), broadcast back."""
    lengths = (x[:, :, 0].detach() > 0).sum(1).clamp(min=1)
    mask = (torch.arange(x.shape[1]) < lengths[:, None]).unsqueeze(-1).to(x.dtype)
    return x * mask + (x * mask).sum(1, keepdim=True) / lengths[:, None, None]


def _mask_written_back(x: Tensor) -> Tensor:
    """Rows (time steps) picked by a mask from the data (``x[mask]``: ``[n, D]``, the examples
    folded with their steps), changed and written back into a copy."""
    mask = x[..., 0].detach() > 0
    y = x.clone()
    y[mask] = 2 * x[mask].sin()
    return y


def _layer_on_masked_rows(x: Tensor, lin: nn.Module) -> Tensor:
    """The layer on the rows a mask picks, its output written back in their place."""
    mask = x[..., 0].detach() > -0.3
    if not mask.any():  # (a recurrent layer on no rows, an empty sequence, is torch's error)
        return x
    y = x.clone()
    y[mask] = lin(x[mask]).to(y.dtype)
    return y


def _scan(x: Tensor) -> Tensor:
    """A recurrence written by hand: the steps unbound, each added to the state, stacked."""
    state, out = torch.zeros_like(x[:, 0]), []
    for step in x.unbind(1):
        state = torch.tanh(state + step)
        out.append(state)
    return torch.stack(out, 1)


def _in_place_views(x: Tensor) -> Tensor:
    y = x.clone()
    y[:, 1:].mul_(2)
    y.transpose(1, 2)[:, 0].add_(1)
    y.select(1, 0).copy_(y.select(1, -1))
    return y


def _in_place_output(y: Tensor) -> Tensor:
    y[..., :2].mul_(2)
    return y


def _shift_rows_in_place(x: Tensor) -> Tensor:
    y = x.clone()
    y[1:] = x[:-1]
    return y


def _other_rows(x: Tensor) -> Tensor:
    """Each picked example's rows replaced by the first example's."""
    y = x.clone()
    y[1:] = x[:1].expand_as(x[1:]) * 0.5 + x[1:]
    return y


def _sorted_call(x: Tensor, lin: nn.Module) -> Tensor:
    order = x.detach().sum((1, 2)).argsort()
    return lin(x[order])[order.argsort()]


def _in_place_slice(x: Tensor) -> Tensor:
    y = x.clone()
    y[:, 0] += x[:, 1]
    return y


class Channels(nn.Module):
    """A Conv1d over time: ``[batch, T, D]`` transposed to channels ``[batch, D, T]`` and back
    (a 2-d ``[rows, D]``: one unbatched sequence of the rows)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(D, D, 3, padding=1)

    def forward(self, x):
        return self.conv(x.transpose(-1, -2)).transpose(-1, -2)


class Attend(nn.Module):
    """Self-attention over time, ``nn.MultiheadAttention(batch_first=True)``."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(D, 2, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]


class Recur(nn.Module):
    """A batch-first GRU or LSTM over time, its outputs."""

    def __init__(self, kind: type[nn.RNNBase]):
        super().__init__()
        self.rnn = kind(D, D, batch_first=True)

    def forward(self, x):
        return self.rnn(x)[0]


class NoRule(nn.Module):
    """A layer with parameters of its own and no rule: the ``torch.func`` fallback."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D, D) / D**0.5)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, D))

    def forward(self, x):
        return torch.sin(x @ self.weight) * self.scale + x


# The layer each operation calls: any of these maps [..., D] to [..., D].
LAYERS = {
    "linear": lambda: nn.Linear(D, D),
    "conv1d": Channels,
    "layer norm": lambda: nn.LayerNorm(D),
    "attention": Attend,
    "gru": lambda: Recur(nn.GRU),
    "lstm": lambda: Recur(nn.LSTM),
    "no rule": NoRule,
}
VOCAB = 6


class Chain(nn.Module):
    """The first layer (a Linear, or an Embedding of tokens ``[batch, T]``), then each
    operation with its layer, ``tanh`` between. Time-major (``[T, batch, ...]`` in and out,
    ``batch_dim=1``): the first layer runs on the time-major input, the rest batch-major."""

    def __init__(self, ops: list[str], layers: list[str] | None = None, tokens: bool = False,
                 time_major: bool = False):  # fmt: skip
        super().__init__()
        self.ops, self.kinds = ops, layers or ["linear"] * len(ops)
        self.tokens, self.time_major = tokens, time_major
        self.first = nn.Embedding(VOCAB, D) if tokens else nn.Linear(D, D)
        self.layers = nn.ModuleList(LAYERS[kind]() for kind in self.kinds)
        self.own = nn.Parameter(torch.linspace(0.5, 1.5, D))

    def forward(self, x):
        x = torch.tanh(self.first(x))
        if self.time_major:
            x = x.transpose(0, 1)
        for name, lin in zip(self.ops, self.layers):
            x = torch.tanh(OPS[name](x, lin, self.own))
        return x.transpose(0, 1) if self.time_major else x

    def __repr__(self) -> str:
        steps = [f"{op} [{kind}]" for op, kind in zip(self.ops, self.kinds)]
        start = ("tokens" if self.tokens else "features") + (
            ", time-major" if self.time_major else ""
        )
        return f"Chain({start}: {' -> '.join(steps)})"


class _BatchMajor(nn.Module):
    """A time-major model seen batch-major, for the loop (which cuts dimension 0)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x.transpose(0, 1)).transpose(0, 1)


def _loop(model: Chain, x: Tensor) -> dict[str, Tensor]:
    if not model.time_major:
        return loop_grad(model, sum_of_squares, x)
    want = loop_grad(_BatchMajor(model), sum_of_squares, x.transpose(0, 1))
    return {name.removeprefix("model."): g for name, g in want.items()}


@st.composite
def chains(draw):
    ops = draw(st.lists(st.sampled_from(sorted(OPS)), min_size=1, max_size=4))
    # a Linear half the time, another layer the other half
    kinds = [draw(st.sampled_from(["linear"] * 6 + sorted(LAYERS))) for _ in ops]
    batch = draw(st.integers(2, 4))  # (the third step takes one more: fewer than T)
    seed = draw(st.integers(0, 2**16))
    tokens, time_major = draw(st.booleans()), draw(st.integers(0, 3)) == 0
    return ops, batch, seed, kinds, tokens, time_major


def _inputs(batch: int, seed: int, tokens: bool) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    if tokens:
        return torch.randint(VOCAB, (batch, T), generator=gen)
    return torch.randn(batch, T, D, generator=gen, dtype=torch.float64)


def run_chain(ops: list[str], batch: int, seed: int, layers: list[str] | None = None,
              tokens: bool = False, time_major: bool = False) -> str:  # fmt: skip
    """Three steps of SGD on ``Chain(ops)``; returns what happened ("match" or "refused")."""
    torch.manual_seed(seed)
    model = Chain(ops, layers, tokens, time_major).double()
    x = _inputs(batch, seed, tokens)
    # the third step's extra example: the first one changed
    extra = (x[:1] + 1) % VOCAB if tokens else x[:1] + 0.5
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    h = gradhooks.add_hooks(model, "sum", batch_dim=1 if time_major else "auto")
    try:
        for step, size in enumerate((batch, batch, batch + 1)):
            xs = x if size == batch else torch.cat([x, extra])
            if time_major:
                xs = xs.transpose(0, 1)
            want = _loop(model, xs)
            opt.zero_grad()
            try:
                sum_of_squares(model(xs)).backward()
            except GradhooksError:
                return "refused"
            for name, p in model.named_parameters():
                if p.grad is None:  # (a parameter no operation uses, or an unused token row)
                    assert getattr(p, "grad1", None) is None and not want[name].any()
                    continue
                assert_close(p.grad1, want[name], f"{model!r}, step {step}: grad1 of {name}")
            opt.step()
    finally:
        h.remove()
    return "match"


@fuzz_settings(EXAMPLES)
@given(chains())
def fuzz(chain) -> None:
    ops, batch, seed, kinds, tokens, time_major = chain
    outcome = run_chain(ops, batch, seed, kinds, tokens, time_major)
    TRIED[outcome] += 1
    TRIED["chains"] += 1


def test_random_operation_chains_match_the_loop_or_are_refused():
    before = TRIED["chains"]
    fuzz()
    tried = TRIED["chains"] - before
    print(f"\nfuzz: {tried} chains, {TRIED['match']} matched the loop, {TRIED['refused']} refused")
    assert tried >= min(EXAMPLES, 10), f"only {tried} chains were tried"


@pytest.mark.parametrize("name", sorted(WITHIN))
def test_each_operation_within_the_examples_is_followed(name):
    """Alone between two layers, none of these is refused: each example's entries stay its
    own (a refusal here is a false one)."""
    assert run_chain([name], 3, 0) == "match"


@pytest.mark.parametrize("name", sorted(ACROSS))
def test_each_operation_across_the_examples_is_refused(name):
    """Alone between two layers, each of these makes an example's output depend on the
    others': refused, never given a number."""
    assert run_chain([name], 3, 0) == "refused"


# Chains the fuzz found refused while each example's entries stayed its own.
FOUND = [
    # the batch cut in two, each part through the layer, put back together, then its rows and
    # time steps merged for the next layer and split again: the rows picked by the cut are
    # the batch's own, in order
    ["split on batch, cat", "fold time into batch", "centre over time"],
    ["split on batch, cat", "fold time into batch"],
    # a permutation of the batch put back, then a time-major call
    ["permute batch and back", "time-major call"],
]


@pytest.mark.parametrize("name", sorted(WITHIN))
def test_each_operation_after_the_batch_cut_and_put_back_is_followed(name):
    """After ``torch.cat([lin(x[:1]), lin(x[1:])])`` the rows are the batch's own, in order:
    whatever follows is followed as on the batch itself."""
    for batch in (2, 3):
        assert run_chain(["split on batch, cat", name], batch, 0) == "match"


@pytest.mark.parametrize("name", sorted(ACROSS))
def test_each_operation_across_the_examples_after_a_permutation_put_back_is_refused(name):
    """``x[perm][perm.argsort()]`` is the batch in its order again: a mean over its examples
    (detached too, which the run-time check cannot see) is mixing there as on the batch."""
    assert run_chain(["permute batch and back", name], 3, 0) == "refused"


@pytest.mark.parametrize("ops", FOUND, ids=" -> ".join)
def test_chains_once_refused_are_followed(ops):
    for batch in (1, 2, 3):
        assert run_chain(ops, batch, 0) == "match"


class _PickedSteps(nn.Module):
    """Examples picked by a mask (``h[keep]``: their rows are data), their time steps merged
    into the rows for a layer and split again, reduced over time, written back in place."""

    def __init__(self):
        super().__init__()
        self.inner, self.outer = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x, keep):
        picked = x[keep]  # [n, T, D]
        y = self.inner(picked.reshape(-1, D)).reshape(picked.shape)
        y = y - y.mean(1, keepdim=True)
        return self.outer(torch.zeros_like(x).index_put((keep.nonzero()[:, 0],), y))


def test_rows_picked_by_a_mask_merged_with_their_steps_and_split_again_are_followed():
    torch.manual_seed(0)
    model = _PickedSteps().double()
    x = torch.randn(4, T, D, dtype=torch.float64)
    keep = torch.tensor([True, False, True, True])
    want: dict[str, list[Tensor]] = {}
    for i in range(4):
        model.zero_grad()
        sum_of_squares(model(x[i : i + 1], keep[i : i + 1])).backward()
        for name, p in model.named_parameters():
            want.setdefault(name, []).append(p.grad.clone())
    model.zero_grad()
    with gradhooks.add_hooks(model, "sum"):
        sum_of_squares(model(x, keep)).backward()
    for name, p in model.named_parameters():
        assert_close(p.grad1, torch.stack(want[name]), f"grad1 of {name}")


@pytest.mark.parametrize("tokens", [False, True], ids=["features", "tokens"])
@pytest.mark.parametrize("time_major", [False, True], ids=["batch-major", "time-major"])
@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_each_layer_between_operations_within_the_examples_is_followed(layer, time_major, tokens):
    """Each layer after operations that keep every example's entries its own, called on the
    whole batch and on a cut of it; from features or tokens, batch-major or time-major."""
    ops = ["flip time", "split on batch, cat", "in-place on input view"]
    if layer == "no rule":
        # (the fallback refuses rows picked from the batch, a cut of it too, by design: the
        # examples may have different numbers of rows)
        cut = run_chain(["split on batch, cat"], 3, 0, [layer], tokens, time_major)
        assert cut == "refused"
        ops.remove("split on batch, cat")
    got = run_chain(ops, 3, 0, [layer] * len(ops), tokens, time_major)
    assert got == "match"


# Chains the fuzz found given a number that was not the loop's.
FOUND_WRONG = [
    # the batch permuted and put back, then scaled by its detached batch mean: the tracker
    # took the rows put back as of unknown layout, and the mean over them as not mixing
    ["permute batch and back", "detached batch mean"],
]


@pytest.mark.parametrize("ops", FOUND_WRONG, ids=" -> ".join)
@pytest.mark.parametrize("time_major", [False, True], ids=["batch-major", "time-major"])
def test_chains_once_given_a_wrong_number_are_refused(ops, time_major):
    assert run_chain(ops, 2, 0, None, False, time_major) == "refused"

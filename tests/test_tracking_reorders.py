"""The examples reordered, taken apart and put back inside a forward, against the oracles.

Each case puts an operation between two layers of a small model (``Linear(3, 5)``, ``tanh``,
the operation, ``Linear(5, 2)``; the operation may call a third layer, ``mid``, ``Linear(5,
5)``): rows written back through a mask that picks every row, the batch rolled along its
examples and rolled back, unbound into its examples and stacked again, sorted by a key of
each example's own data and unsorted after a layer. Each example's rows stay its own, so
``grad1`` must be the float64 per-example loop's (and ``vmap(grad)``'s where it runs), in
float64, under bfloat16 autocast (within bfloat16's precision), and at every step of a short
training loop whose batch size changes.

The same operations where they do mix the examples (a rolled batch added to the batch in
order, a row of one example added to every other, the sorted rows cut by their rank) are
refused with a typed error, and so is a model whose output holds the examples in another
order than its input (a loss with targets would pair each example's output with another's
target).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pack_sequence, pad_packed_sequence

import gradhooks
from gradhooks.errors import GradhooksError
from gradhooks.oracle import loop_grad, vmap_grad
from harness import assert_close, sum_of_squares

BATCH = 4
# bfloat16 keeps 8 significant bits (u = 2^-9): a few roundings per layer through three layers,
# summed over an example's features, as tests/test_autocast.py allows (about 16 units)
BF16_TOL = 5e-2


class Around(nn.Module):
    """``l2(how(tanh(l1(x)), x, self))``: ``how`` may call ``self.mid`` and read ``x``."""

    def __init__(self, how: Callable[[Tensor, Tensor, nn.Module], Tensor]):
        super().__init__()
        self.how = how
        self.l1, self.mid, self.l2 = nn.Linear(3, 5), nn.Linear(5, 5), nn.Linear(5, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(self.how(torch.tanh(self.l1(x)), x, self))


@dataclass
class Reorder:
    id: str
    how: Callable[[Tensor, Tensor, nn.Module], Tensor]
    vmaps: bool = True  # whether vmap(grad) runs it (a boolean mask's rows are data)

    def __repr__(self) -> str:
        return self.id


def _every_row_written(h: Tensor, x: Tensor, m: nn.Module) -> Tensor:
    """``y[mask] = v`` with a mask that picks every row of the batch."""
    y = h.clone()
    mask = torch.ones(h.shape[0], dtype=torch.bool)
    y[mask] = m.mid(h[mask]).sin()
    return y


def _every_entry_written(h: Tensor, x: Tensor, m: nn.Module) -> Tensor:
    """``y[mask] = v`` with a mask of the data that picks every entry (``tanh > -1``): as many
    entries of each example, written back where they were."""
    y = h.clone()
    mask = h.detach() > -2
    y[mask] = 2 * h[mask].sin()
    return m.mid(y)


def _every_row_put(h: Tensor, x: Tensor, m: nn.Module) -> Tensor:
    mask = torch.ones(h.shape[0], dtype=torch.bool)
    return h.index_put((mask,), m.mid(h[mask]).sin())


def _sorted_by_input(h: Tensor, x: Tensor, m: nn.Module) -> Tensor:
    """The layer on the rows sorted by a key of each example's input, then unsorted (the
    sorted-by-length trick of packed recurrent code)."""
    idx = x.norm(dim=1).argsort()
    return torch.tanh(m.mid(h[idx]))[idx.argsort()]


def _sorted_by_own_rows(h: Tensor, x: Tensor, m: nn.Module) -> Tensor:
    idx = h.norm(dim=1).argsort(descending=True)
    s = h[idx]
    return (m.mid(s) * s.sigmoid())[idx.argsort()]


def _sorted_twice(h: Tensor, x: Tensor, m: nn.Module) -> Tensor:
    """Sorted, the layer, rolled along the sorted rows, the layer again, put back."""
    idx = x.norm(dim=1).argsort()
    s = torch.tanh(m.mid(h[idx])).roll(1, 0)
    return m.mid(s)[idx.roll(1, 0).argsort()]


def _sorted_scattered_back(h: Tensor, x: Tensor, m: nn.Module) -> Tensor:
    """Sorted, the layer, written back into place by the sorting index (``out[idx] = y``),
    then through the layer again."""
    idx = x.norm(dim=1).argsort()
    out = torch.empty_like(h)
    out[idx] = torch.tanh(m.mid(h[idx]))
    return m.mid(out)


def _sorted_copied_back(h: Tensor, x: Tensor, m: nn.Module) -> Tensor:
    idx = x.norm(dim=1).argsort()
    return torch.zeros_like(h).index_copy(0, idx, m.mid(h[idx]))


FOLLOWED = [
    Reorder("mask of every row, written back", _every_row_written, vmaps=False),
    Reorder("mask of every entry, written back", _every_entry_written, vmaps=False),
    Reorder("index_put of every row", _every_row_put, vmaps=False),
    Reorder("roll, layer, roll back", lambda h, x, m: m.mid(h.roll(1, 0)).roll(-1, 0)),
    Reorder(
        "roll by two, layer, roll back",
        lambda h, x, m: torch.roll(torch.tanh(m.mid(torch.roll(h, 2, dims=0))), -2, dims=0),
    ),
    Reorder(
        "roll with shifts and dims, elementwise, roll back",
        lambda h, x, m: m.mid(torch.roll(h, (3, 1), (0, 1)).sin()).roll((-3,), (0,)),
    ),
    Reorder("unbind, stack", lambda h, x, m: m.mid(torch.stack(h.unbind(0)))),
    Reorder(
        "unbind, a per-row operation, stack",
        lambda h, x, m: m.mid(torch.stack([r.flip(0) * r.sum() for r in h.unbind(0)])),
    ),
    Reorder(
        "rows taken one by one, stacked along another dimension",
        lambda h, x, m: m.mid(torch.stack([h[i] for i in range(h.shape[0])], 1).t()),
    ),
    Reorder(
        "unbind, each unsqueezed, cat",
        lambda h, x, m: m.mid(torch.cat([r.unsqueeze(0).tanh() for r in h.unbind(0)])),
    ),
    Reorder(
        "unbind reversed, stack, reversed back",
        lambda h, x, m: m.mid(torch.stack(h.unbind(0)[::-1]))[torch.arange(h.shape[0]).flip(0)],
    ),
    Reorder("sorted by the input, layer, unsorted", _sorted_by_input),
    Reorder("sorted by its rows, layer, unsorted", _sorted_by_own_rows),
    Reorder("sorted, layer, rolled, layer, unsorted", _sorted_twice),
    Reorder("sorted, layer, written back by the index", _sorted_scattered_back),
    Reorder("sorted, layer, copied back by the index", _sorted_copied_back),
]
_BY_ID = {c.id: c for c in FOLLOWED}


def _inputs(batch: int, seed: int, dtype=torch.float64) -> Tensor:
    """``batch`` examples whose norms differ by far more than bfloat16 rounds (a sort by them
    gives one order in every precision)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, generator=g, dtype=torch.float64)
    scale = 0.4 + 0.5 * torch.randperm(batch, generator=g).to(torch.float64)
    return (x / x.norm(dim=1, keepdim=True) * scale[:, None]).to(dtype)


def _model(case: Reorder, dtype=torch.float64) -> Around:
    torch.manual_seed(0)
    return Around(case.how).to(dtype)


def _hooked_grad1(model: nn.Module, x: Tensor, loss=sum_of_squares) -> dict[str, Tensor]:
    model.zero_grad(set_to_none=True)
    with gradhooks.add_hooks(model, "sum"):
        loss(model(x)).backward()
        return {n: p.grad1.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", FOLLOWED, ids=repr)
def test_followed_against_the_loop_and_vmap(case):
    model, x = _model(case), _inputs(BATCH, 0)
    got = _hooked_grad1(model, x)
    want = loop_grad(model, sum_of_squares, x)
    for name, g in want.items():
        assert_close(got[name], g, f"{case.id}: grad1 of {name} against the loop")
    if case.vmaps:
        want = vmap_grad(model, sum_of_squares, x)
        for name, g in want.items():
            assert_close(got[name], g, f"{case.id}: grad1 of {name} against vmap(grad)")


def _rel_err(got: Tensor, ref: Tensor) -> float:
    scale = float(ref.abs().max())
    diff = float((got.double() - ref).abs().max())
    return diff / scale if scale else diff


@pytest.mark.parametrize("case", FOLLOWED, ids=repr)
def test_followed_under_bfloat16_autocast(case):
    model = _model(case, torch.float32)
    x = _inputs(BATCH, 1, torch.float32)
    want = loop_grad(copy.deepcopy(model).double(), sum_of_squares, x.double())
    model.zero_grad(set_to_none=True)
    with gradhooks.add_hooks(model, "sum"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        sum_of_squares(out.float()).backward()
        for name, p in model.named_parameters():
            err = _rel_err(p.grad1, want[name])
            assert err <= BF16_TOL, f"{case.id}: grad1 of {name}: relative error {err:.2e}"


@pytest.mark.parametrize("case", FOLLOWED, ids=repr)
def test_followed_through_a_training_loop(case):
    """Three SGD steps, hooks added once, the third on a batch of another size: each step's
    grad1 is the loop's for the parameters of that step."""
    model = _model(case)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model, "sum"):
        for step, size in enumerate((BATCH, BATCH, BATCH + 1)):
            x = _inputs(size, 10 + step)
            want = loop_grad(model, sum_of_squares, x)
            opt.zero_grad()
            sum_of_squares(model(x)).backward()
            for name, p in model.named_parameters():
                assert_close(p.grad1, want[name], f"{case.id}, step {step}: grad1 of {name}")
            opt.step()


def _refused_or_exact(how, loss=sum_of_squares, target=None) -> str:
    """``"refused"`` (a typed error) or ``"exact"`` (grad1 the loop's); anything else fails."""
    torch.manual_seed(0)
    model, x = Around(how).double(), _inputs(BATCH, 2)
    want = loop_grad(model, loss, x, target)
    try:
        with gradhooks.add_hooks(model, "sum"):
            out = model(x)
            (loss(out) if target is None else loss(out, target)).backward()
            for name, p in model.named_parameters():
                assert_close(p.grad1, want[name], f"grad1 of {name}")
    except GradhooksError:
        return "refused"
    return "exact"


def _other_row_written(h: Tensor, x: Tensor, m: nn.Module) -> Tensor:
    """Every row written back through a mask, each with the next example's values."""
    y = h.clone()
    mask = torch.ones(h.shape[0], dtype=torch.bool)
    y[mask] = h[mask].flip(0)
    return y


def _first_row_everywhere(h: Tensor, x: Tensor, m: nn.Module) -> Tensor:
    y = h.clone()
    mask = torch.ones(h.shape[0], dtype=torch.bool)
    y[mask] = h[mask] + h[0]
    return y


def _sorted_then_cut(h: Tensor, x: Tensor, m: nn.Module) -> Tensor:
    """The sorted rows cut by rank: which example the layer sees depends on the others'."""
    idx = x.norm(dim=1).argsort()
    s = h[idx]
    return torch.cat([m.mid(s[:1]), s[1:]])[idx.argsort()]


def _sorted_then_weighted_by_rank(h: Tensor, x: Tensor, m: nn.Module) -> Tensor:
    idx = x.norm(dim=1).argsort()
    ranks = torch.linspace(0.5, 1.5, h.shape[0], dtype=h.dtype)
    return m.mid(h[idx] * ranks[:, None])[idx.argsort()]


MIXING = {
    "mask of every row, rows of the others written": _other_row_written,
    "mask of every row, the first example's row added": _first_row_everywhere,
    "rolled added to the batch in order": lambda h, x, m: m.mid(h) + m.mid(h.roll(1, 0)),
    "rolled, layer, added to the batch": lambda h, x, m: m.mid(h.roll(1, 0)) + h,
    "rolled, layer, rolled back by another shift": lambda h, x, m: (
        m.mid(h.roll(1, 0)).roll(1, 0) + h
    ),
    "rolled along the flattened batch": lambda h, x, m: m.mid(h.roll(1)),
    "sorted, added to the batch in order": lambda h, x, m: m.mid(h[x.norm(dim=1).argsort()] + h),
    "sorted, cut by rank": _sorted_then_cut,
    "sorted, weighted by rank": _sorted_then_weighted_by_rank,
    "sorted, the batch mean": lambda h, x, m: m.mid(h[x.norm(dim=1).argsort()].mean(0) + h),
    "unbind, the first row added to each, stack": lambda h, x, m: m.mid(
        torch.stack([r + h[0] for r in h.unbind(0)])
    ),
    "unbind, two rows combined, stack": lambda h, x, m: m.mid(
        torch.stack([r * s for r, s in zip(h.unbind(0), h.unbind(0)[1:] + h.unbind(0)[:1])])
    ),
    "unbind, stack with a row of no example": lambda h, x, m: m.mid(
        torch.stack([*h.unbind(0), torch.zeros_like(h[0])])
    )[:-1],
    "unbind, stack, the batch's sum": lambda h, x, m: m.mid(
        torch.stack(h.unbind(0)).sum(0, keepdim=True) + h
    ),
}


@pytest.mark.parametrize("name", sorted(MIXING))
def test_mixing_is_refused(name):
    assert _refused_or_exact(MIXING[name]) == "refused"


# the examples left in another order at the model's output: each row is one example's, but a
# loss with targets pairs the rows with the targets in the input's order
IN_ANOTHER_ORDER = {
    "rolled": lambda h, x, m: m.mid(h.roll(1, 0)),
    "permuted": lambda h, x, m: m.mid(h[torch.arange(h.shape[0]).roll(1)]),
    "sorted": lambda h, x, m: m.mid(h[x.norm(dim=1).argsort()]),
    "split and swapped": lambda h, x, m: torch.cat(torch.split(h, [1, h.shape[0] - 1])[::-1]),
    "unbind reversed, stacked": lambda h, x, m: m.mid(torch.stack(h.unbind(0)[::-1])),
}


def _cross_entropy(out: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(out, target, reduction="sum")


@pytest.mark.parametrize("name", sorted(IN_ANOTHER_ORDER))
def test_an_output_in_another_order_is_refused(name):
    """With targets, the hooks' numbers would pair each example with another's target (not
    the loop's): refused at the forward, naming the output."""
    target = torch.tensor([0, 1, 1, 0])
    assert _refused_or_exact(IN_ANOTHER_ORDER[name], _cross_entropy, target) == "refused"


@pytest.mark.xfail(
    strict=True,
    raises=GradhooksError,
    reason="a hooked layer called on one example taken out alone (x.unbind(0), x[i]) is "
    "refused: its input has no batch dimension, where every rule reads which example each "
    "row is, and handing the rule the call with a batch of one added is the engine's (a kind "
    "of call, beside the rows an index picks), not the tracker's; the refusal names the "
    "remedy, x.split(1) and torch.cat, which is followed",
)
def test_a_layer_on_each_row_alone_then_stacked():
    torch.manual_seed(0)
    model = Around(lambda h, x, m: torch.stack([m.mid(r) for r in h.unbind(0)]))
    model, x = model.double(), _inputs(BATCH, 2)
    want = loop_grad(model, sum_of_squares, x)
    got = _hooked_grad1(model, x)
    for name, g in want.items():
        assert_close(got[name], g, f"grad1 of {name}")


def test_a_layer_on_each_row_as_a_batch_of_one_then_cat():
    """The remedy the refusal above names: each example a batch of one, joined by cat."""
    how = lambda h, x, m: torch.cat([m.mid(r) for r in h.split(1)])  # noqa: E731
    assert _refused_or_exact(how) == "exact"


class _MixedInput(nn.Module):
    """The input mixed with itself in another order before any layer, where no gradient
    flows."""

    def __init__(self, how: Callable[[Tensor], Tensor]):
        super().__init__()
        self.how, self.l1 = how, nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.l1(self.how(x))


def test_the_input_mixed_with_its_roll_is_still_refused():
    """``x[perm]`` mixed into the input is MixUp, mixing before the model (docs/guarantees.md),
    as it was; the data mixed with its roll was refused as a statistic of the batch, and still
    is, though a roll is followed as a permutation now."""
    x = _inputs(BATCH, 3)
    perm = torch.tensor([2, 0, 3, 1])
    torch.manual_seed(0)
    model = _MixedInput(lambda x: 0.7 * x + 0.3 * x[perm]).double()
    with gradhooks.add_hooks(model, "sum"):
        sum_of_squares(model(x)).backward()
    plain = _MixedInput(lambda x: x).double()
    plain.load_state_dict(model.state_dict())
    want = loop_grad(plain, sum_of_squares, 0.7 * x + 0.3 * x[perm])
    assert_close(model.l1.weight.grad1, want["l1.weight"], "MixUp by a permutation")
    model = _MixedInput(lambda x: 0.7 * x + 0.3 * x.roll(1, 0)).double()
    with gradhooks.add_hooks(model, "sum"), pytest.raises(gradhooks.MixedExamplesError):
        sum_of_squares(model(x)).backward()


class _Recurrent(nn.Module):
    """A GRU on the padded batch sorted by length (a key of each example's data), then unsorted:
    packed (``enforce_sorted``: the sorting done here, or by ``pack_padded_sequence``) or
    not."""

    def __init__(self, pack: str):
        super().__init__()
        self.pack = pack
        self.l1, self.l2 = nn.Linear(3, 4), nn.Linear(4, 2)
        self.rnn = nn.GRU(4, 4, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.l1(x))
        lengths = 2 + (x[:, 0, 0] > 0).long() + 2 * (x[:, 1, 0] > 0).long()
        if self.pack == "by pack_padded_sequence":
            p = pack_padded_sequence(h, lengths, batch_first=True, enforce_sorted=False)
            o = pad_packed_sequence(self.rnn(p)[0], batch_first=True, total_length=x.shape[1])[0]
            return self.l2(o)
        idx = lengths.argsort(descending=True, stable=True)
        if self.pack == "here":
            p = pack_padded_sequence(h[idx], lengths[idx], batch_first=True)
            o = pad_packed_sequence(self.rnn(p)[0], batch_first=True, total_length=x.shape[1])[0]
        else:
            o = self.rnn(h[idx])[0]
        return self.l2(o[idx.argsort()])


def _sequences(batch: int, seed: int) -> Tensor:
    """Sequences whose lengths (from their first two steps) are in no sorted order."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 5, 3, generator=g, dtype=torch.float64)
    x[:, 0, 0] = torch.tensor([-1.0, 1.0, -1.0, 1.0, 1.0])[:batch]
    x[:, 1, 0] = torch.tensor([-1.0, -1.0, 1.0, 1.0, -1.0])[:batch]
    return x


@pytest.mark.parametrize("pack", ["not packed", "by pack_padded_sequence"])
def test_a_recurrent_layer_on_the_sorted_batch_matches_the_loop(pack):
    torch.manual_seed(0)
    model = _Recurrent(pack).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model, "sum"):
        for step, size in enumerate((BATCH, BATCH, BATCH + 1)):
            x = _sequences(size, step)
            want = loop_grad(model, sum_of_squares, x)
            opt.zero_grad()
            sum_of_squares(model(x)).backward()
            for name, p in model.named_parameters():
                assert_close(p.grad1, want[name], f"{pack}, step {step}: grad1 of {name}")
            opt.step()


def test_a_batch_sorted_here_then_packed_is_refused():
    """Sorted here and packed with ``enforce_sorted=True``: the PackedSequence holds no order
    (``sorted_indices`` is None), so the recurrent rule would read its rows as the examples in
    order; refused at the forward (before, only the run-time check caught it)."""
    torch.manual_seed(0)
    model = _Recurrent("here").double()
    with gradhooks.add_hooks(model, "sum", verify=False):
        with pytest.raises(GradhooksError, match=r"'rnn' \(GRU\)"):
            sum_of_squares(model(_sequences(BATCH, 0))).backward()


class _PackedGiven(nn.Module):
    """A GRU over the PackedSequence the model is given (``pack_sequence`` in a data loader's
    ``collate_fn``), padded back by ``pad_packed_sequence`` (``sorted_indices``' order, put
    back by its ``index_select``), time-major or batch-first, and a Linear on every step."""

    def __init__(self, batch_first: bool):
        super().__init__()
        self.batch_first = batch_first
        self.rnn = nn.GRU(3, 4, bidirectional=True)
        self.l2 = nn.Linear(8, 2)

    def forward(self, packed):
        out, _ = self.rnn(packed)
        padded, _ = pad_packed_sequence(out, batch_first=self.batch_first, total_length=5)
        return self.l2(padded).sum(1 if self.batch_first else 0)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("enforce_sorted", [True, False])
def test_a_packed_sequence_given_to_the_model_padded_back(batch_first, enforce_sorted):
    """Packed with its examples in another order than the batch's (``enforce_sorted=False``),
    the padded rows are in that order until ``pad_packed_sequence`` puts them back: the
    Linear after it gets the batch in order (once refused as reading a permutation of it),
    and ``grad1`` is each example's; sorted, as before. A first forward of sorted sequences
    of the same shapes does not leave its layouts to the second."""
    torch.manual_seed(0)
    model = _PackedGiven(batch_first).double()
    g = torch.Generator().manual_seed(1)
    for lengths in ((5, 3, 2), (3, 5, 2) if not enforce_sorted else (5, 3, 2)):
        seqs = [torch.randn(n, 3, generator=g, dtype=torch.float64) for n in lengths]
        want = {n: [] for n, _ in model.named_parameters()}
        for s in seqs:
            grads = torch.autograd.grad(
                sum_of_squares(model(pack_sequence([s]))), list(model.parameters())
            )
            for (n, _), gr in zip(model.named_parameters(), grads):
                want[n].append(gr)
        with gradhooks.add_hooks(model, "sum"):
            sum_of_squares(model(pack_sequence(seqs, enforce_sorted=enforce_sorted))).backward()
        for name, p in model.named_parameters():
            assert_close(p.grad1, torch.stack(want[name]), f"{lengths}: grad1 of {name}")
        model.zero_grad(set_to_none=True)
        gradhooks.clear_grad1(model)


class _PacksTimeFirst(nn.Module):
    """``pack_padded_sequence(..., enforce_sorted=False)`` of a time-first batch inside the
    model (sorted by length there, by ``index_select``), a GRU, the padding back, and a Linear
    on every step; or (``on_data``) a Linear on the packed rows themselves."""

    def __init__(self, on_data: bool = False):
        super().__init__()
        self.on_data = on_data
        self.rnn = nn.GRU(3, 4)
        self.l2 = nn.Linear(4, 2)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        out, _ = self.rnn(pack_padded_sequence(x, lengths, enforce_sorted=False))
        if self.on_data:
            return self.l2(out.data)
        padded, _ = pad_packed_sequence(out, total_length=x.shape[0])
        return self.l2(padded)


def test_a_time_first_batch_packed_unsorted_in_the_model():
    """The packed data of a batch sorted by ``pack_padded_sequence`` are followed as a
    PackedSequence's, packed in its ``sorted_indices``' order, which padding back puts back:
    ``grad1`` is each example's (once refused, the batch lost where it was sorted). A Linear on
    the packed rows themselves gets each example's rows, in that order too (once refused)."""
    x = torch.randn(5, 3, 3, dtype=torch.float64)
    lengths = torch.tensor([3, 5, 2])
    for on_data in (False, True):
        torch.manual_seed(0)
        model = _PacksTimeFirst(on_data).double()
        want = {n: [] for n, _ in model.named_parameters()}
        for i in range(3):
            grads = torch.autograd.grad(
                sum_of_squares(model(x[:, i : i + 1], lengths[i : i + 1])),
                list(model.parameters()),
            )
            for (n, _), g in zip(model.named_parameters(), grads):
                want[n].append(g)
        with gradhooks.add_hooks(model, "sum", batch_dim=1):
            sum_of_squares(model(x, lengths)).backward()
        for name, p in model.named_parameters():
            assert_close(p.grad1, torch.stack(want[name]), f"grad1 of {name}")

"""Whole examples (or tokens) picked by an index that ``nonzero`` found in a mask of the
examples' own: ``idx = mask.nonzero().squeeze()`` then ``h.index_select(0, idx)``, ``h[idx]``
or ``h.gather(0, ...)``, as ``nn.AdaptiveLogSoftmaxWithLoss`` does with the targets of each
cluster and Hugging Face's unpadding for flash-attention does with the real tokens of a padded
batch. An example alone finds the same positions of its own, so each picked row is its
example's. Checked in float64 against the per-example loop, ``grad1`` and the norms; an index
that mixes the examples (taken across the batch, or changed after ``nonzero``) stays refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_close, assert_grad1, sq

D = torch.float64

# the index of the examples (or tokens) whose entry of a 1-D mask is set
FORMS = {
    "nonzero().squeeze()": lambda m: m.nonzero().squeeze(),
    "nonzero().squeeze(1)": lambda m: m.nonzero().squeeze(1),
    "nonzero().view(-1)": lambda m: m.nonzero().view(-1),
    "nonzero().flatten()": lambda m: torch.nonzero(m, as_tuple=False).flatten(),
    "nonzero(as_tuple=True)[0]": lambda m: m.nonzero(as_tuple=True)[0],
    "where(mask)[0]": lambda m: torch.where(m)[0],
    "argwhere(mask)[:, 0]": lambda m: torch.argwhere(m)[:, 0],
}

# the rows of h (dimension 0) that an index picks
PICKS = {
    "index_select": lambda h, idx: h.index_select(0, idx),
    "h[idx]": lambda h, idx: h[idx],
    "gather": lambda h, idx: torch.gather(h, 0, idx[:, None].expand(-1, h.shape[1])),
}


def check(model: nn.Module, inputs: tuple, what: str) -> None:
    """``grad1`` and the per-example norms of half the sum of squares of the model's output,
    against the per-example loop."""
    want = loop_grad(model, sq, inputs)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(*inputs)).backward()
        assert_grad1(model, want, what)
    model.zero_grad(set_to_none=True)
    norm = torch.stack([g.flatten(1).pow(2).sum(1) for g in want.values()]).sum(0).sqrt()
    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("norms",)) as h:
        sq(model(*inputs)).backward()
        assert_close(h.norms(), norm, f"{what}: norms")
    model.zero_grad(set_to_none=True)


# -- whole examples picked by the flags of each -------------------------------------------------


class Flagged(nn.Module):
    """The examples whose flag is set take a second layer: their rows picked by an index that
    ``nonzero`` found in the flags (an input of the model's own, or computed from ``x``), put
    back with ``index_copy``."""

    def __init__(self, form: str, pick: str, computed: bool = False):
        super().__init__()
        self.form, self.pick, self.computed = FORMS[form], PICKS[pick], computed
        self.a, self.b, self.c = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x, flag):
        h = torch.tanh(self.a(x))
        mask = x[:, 0] > 0 if self.computed else flag > 0
        idx = self.form(mask)
        h = h.index_copy(0, idx, torch.tanh(self.b(self.pick(h, idx))))
        return self.c(h)


def flagged_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(3), dtype=D)
    x[:, 0] = torch.tensor([1.0, -1.0, 2.0, 0.5, -0.5], dtype=D)
    return x, (x[:, 0] > 0).long()  # (examples 0, 2 and 3 flagged)


# (``squeeze()`` makes an index of one example 0-d, as the per-example loop's always is: only
# index_select takes it as one row)
PAIRS = [(f, p) for f in FORMS for p in PICKS if f != "nonzero().squeeze()" or p == "index_select"]


@pytest.mark.parametrize(("form", "pick"), PAIRS)
def test_examples_picked_by_nonzero_of_their_flags(form, pick):
    torch.manual_seed(0)
    check(Flagged(form, pick).to(D), flagged_inputs(), f"{form}, {pick}")


@pytest.mark.parametrize("pick", PICKS)
def test_examples_picked_by_nonzero_of_a_mask_computed_from_them(pick):
    torch.manual_seed(0)
    check(Flagged("nonzero().squeeze(1)", pick, computed=True).to(D), flagged_inputs(), pick)


@pytest.mark.parametrize("pick", PICKS)
@pytest.mark.parametrize(
    "flags", [[0, 0, 0, 0, 0], [0, 0, 1, 0, 0], [1, 1, 1, 1, 1]], ids=["none", "one", "all"]
)
def test_no_example_one_or_every_example_flagged(flags, pick):
    """No row picked, one (``gather``'s rows then as long as one, its features longer), every
    example in its place."""
    torch.manual_seed(0)
    x, _ = flagged_inputs()
    check(Flagged("nonzero().view(-1)", pick).to(D), (x, torch.tensor(flags)), f"{flags}, {pick}")


def test_the_layout_of_examples_picked_by_positions():
    """Under a tracker: the rows an index of positions picks are owned by the flagged
    examples, a constant written at them keeps the batch where it was; a part of the index
    (its first two, of the batch) picks rows that are mixed."""
    from gradhooks.tracking import MIXED, Layout, Tracker

    x, flag = flagged_inputs()
    x.requires_grad_()
    tracker = Tracker(5, {})
    tracker.set_layout(x, Layout(0))
    tracker.set_layout(flag, Layout(0))
    with tracker:
        idx = (flag > 0).nonzero().squeeze(1)
        picked, cut = x.index_select(0, idx), x.index_select(0, idx[:2])
        filled = x.detach().index_fill(0, idx, 0.0)
    assert torch.equal(tracker.layout(picked).owners.rows, torch.tensor([0, 2, 3]))
    assert tracker.layout(cut) is MIXED
    assert tracker.layout(filled) == Layout(0)


# -- the real tokens of a padded batch: Hugging Face's unpadding for flash-attention ------------


class Unpadded(nn.Module):
    """``transformers``' ``_upad_input`` and ``pad_input`` around a layer: the real tokens
    gathered from ``[batch * seq, dim]`` by the ``nonzero`` indices of the flattened attention
    mask (``index_first_axis``: a ``gather`` of the indices repeated along the features), a
    Linear on them alone, scattered back into zeros of ``[batch * seq, ...]`` and reshaped."""

    def __init__(self, pick: str, put: str):
        super().__init__()
        self.pick, self.put = PICKS[pick], put
        self.a, self.b, self.c = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x, mask):  # [batch, seq, 3], [batch, seq]
        batch, seq, _ = x.shape
        h = torch.tanh(self.a(x)).reshape(batch * seq, -1)
        indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
        y = torch.tanh(self.b(self.pick(h, indices)))
        out = y.new_zeros(batch * seq, y.shape[1])
        if self.put == "out[indices] = y":
            out[indices] = y
        elif self.put == "index_put":
            out = out.index_put((indices,), y)
        else:
            out = out.scatter(0, indices[:, None].expand(-1, y.shape[1]), y)
        return self.c(out.reshape(batch, seq, -1))


@pytest.mark.parametrize("put", ["out[indices] = y", "index_put", "scatter"])
@pytest.mark.parametrize("pick", PICKS)
def test_tokens_unpadded_by_nonzero_of_the_flattened_mask(pick, put):
    torch.manual_seed(0)
    x = torch.randn(4, 5, 3, generator=torch.Generator().manual_seed(1), dtype=D)
    mask = torch.ones(4, 5, dtype=torch.long)
    mask[1, 3:] = 0
    mask[2, 1:] = 0
    mask[3, 4:] = 0
    check(Unpadded(pick, put).to(D), (x, mask), f"{pick}, {put}")


# -- nn.AdaptiveLogSoftmaxWithLoss ---------------------------------------------------------------


class Adaptive(nn.Module):
    """A Linear, then torch's adaptive softmax (a head and two tail clusters), its ``.loss``
    the mean over the batch."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 8)
        self.asm = nn.AdaptiveLogSoftmaxWithLoss(8, 10, cutoffs=[3, 6], div_value=2.0)

    def forward(self, x, target):
        return self.asm(torch.tanh(self.a(x)), target).loss


def test_adaptive_log_softmax_with_loss_over_three_steps():
    """``AdaptiveLogSoftmaxWithLoss`` picks each cluster's examples with ``nonzero`` of a mask
    of the targets and ``index_select``, and puts their log-probabilities back with
    ``index_copy_``: ``grad1`` is the per-example loop's at each of three SGD steps (a cluster
    with one target, whose index ``squeeze`` makes 0-d; the tails unused at the third, which
    get no gradient, as ``.grad``)."""
    torch.manual_seed(0)
    model = Adaptive().to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    with gradhooks.add_hooks(model):
        for step, target in enumerate(([0, 1, 4, 7, 8, 2], [9, 5, 3, 1, 2, 0], [1, 2, 0, 1, 2, 0])):
            x, target = torch.randn(6, 5, generator=g, dtype=D), torch.tensor(target)
            want = loop_grad(model, lambda loss: loss, (x, target))
            opt.zero_grad()
            model(x, target).backward()
            unused = {n for n, p in model.named_parameters() if p.grad is None}
            assert unused == (set() if step < 2 else {n for n in want if ".tail." in n})
            for n, p in model.named_parameters():
                if n in unused:
                    assert not hasattr(p, "grad1") and not want[n].any(), f"step {step}: {n}"
                else:
                    assert_close(p.grad1, want[n], f"step {step}: {n}")
            opt.step()


# -- indices that mix the examples stay refused --------------------------------------------------


def _top_two(h, flag):  # the two examples of the largest scores over the batch
    return h.detach().sum(1).argsort(descending=True)[:2]


def _above_the_mean(h, flag):  # a mask against a statistic of the batch
    s = h.detach().sum(1)
    return (s > s.mean()).nonzero().squeeze(1)


def _running_count(h, flag):  # a count over the batch: up to its second flagged
    return (flag.cumsum(0) <= 2).nonzero().squeeze(1)


def _first_two_flagged(h, flag):  # the first two flagged examples of the batch, not of each
    return (flag > 0).nonzero().squeeze(1)[:2]


def _next_example(h, flag):  # the rows of the example after each flagged one
    return ((flag > 0).nonzero().squeeze(1) + 1) % flag.shape[0]


def _shifted_in_place(h, flag):  # as _next_example, through a view taken before
    idx = (flag > 0).nonzero().squeeze(1)
    view = idx.view(-1)
    idx.add_(1).remainder_(flag.shape[0])
    return view


def _fixed_positions(h, flag):  # positions in the batch, not a property of an example
    return (torch.arange(h.shape[0]) % 2 == 0).nonzero().squeeze(1)


MIXING = {
    "argsort of scores over the batch": _top_two,
    "nonzero of a mask against the batch's mean": _above_the_mean,
    "nonzero of a running count over the batch": _running_count,
    "the index cut to its first two": _first_two_flagged,
    "the index shifted by one": _next_example,
    "the index shifted by one in place": _shifted_in_place,
    "nonzero of a mask of positions in the batch": _fixed_positions,
}


class Mixing(nn.Module):
    def __init__(self, index, pick: str):
        super().__init__()
        self.index, self.pick = index, PICKS[pick]
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x, flag):
        h = torch.tanh(self.a(x))
        return self.b(self.pick(h, self.index(h, flag)))


@pytest.mark.parametrize("pick", PICKS)
@pytest.mark.parametrize("index", MIXING)
def test_an_index_that_mixes_the_examples_is_refused(index, pick):
    torch.manual_seed(0)
    model = Mixing(MIXING[index], pick).to(D)
    x, flag = flagged_inputs()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with pytest.raises(gradhooks.MixedExamplesError):
            F.mse_loss(model(x, flag), torch.zeros(1, dtype=D), reduction="sum").backward()


# -- parts of the batch by position: rows of their examples ------------------------------------


@pytest.mark.parametrize(
    "part, rows",
    [
        pytest.param(lambda x: x.split(1)[2], [2], id="split"),
        pytest.param(lambda x: x.chunk(5)[4], [4], id="chunk"),
        pytest.param(lambda x: x.tensor_split(2)[1], [3, 4], id="tensor_split"),
        pytest.param(lambda x: x[1:3], [1, 2], id="slice"),
        pytest.param(lambda x: x[::2], [0, 2, 4], id="step"),
        pytest.param(lambda x: x.narrow(0, -2, 2), [3, 4], id="narrow"),
        pytest.param(lambda x: x.repeat(2, 1)[4:6], [4, 0], id="part-of-a-repeat"),
    ],
)
def test_a_part_of_the_batch_by_position_holds_the_rows_of_its_examples(part, rows):
    """A part of the batch dimension taken by position is laid out as the rows it picks, as an
    index of those positions would give. (A part of such a part, ``x[2:][1:]``, is mixed, as
    any part of rows picked by an index cut by position.)"""
    from gradhooks.tracking import Layout, Tracker

    x = torch.randn(5, 3, requires_grad=True)
    tracker = Tracker(5, {})
    tracker.set_layout(x, Layout(0))
    with tracker:
        got = tracker.layout(part(x))
    assert got.dim == 0 and got.owners.rows.tolist() == rows


@pytest.mark.parametrize(
    "alone",
    [lambda x: x[1], lambda x: x.unbind()[1], lambda x: x.select(0, 1)],
    ids=["index", "unbind", "select"],
)
def test_one_example_taken_out_alone_is_mixed(alone):
    """``x[i]``: no dimension holds the example, so no layout follows it."""
    from gradhooks.tracking import MIXED, Layout, Tracker

    x = torch.randn(5, 3, requires_grad=True)
    tracker = Tracker(5, {})
    tracker.set_layout(x, Layout(0))
    with tracker:
        got = tracker.layout(alone(x))
    assert got is MIXED


@pytest.mark.parametrize(
    "sizes, rows",
    [
        pytest.param([2, 2, 1], [[0, 0], [1, 1], [2]], id="into-its-examples"),
        pytest.param([2, 0, 2, 1], [[0, 0], [], [1, 1], [2]], id="with-an-empty-part"),
        pytest.param([3, 2], None, id="one-example-and-a-part-of-another"),
        pytest.param([2, 3], None, id="two-examples-in-a-part"),
        pytest.param([1, 4], None, id="a-part-of-one"),
    ],
)
def test_rows_picked_by_an_index_split_into_their_examples_are_followed(sizes, rows):
    """Tokens picked by an index (of examples 0, 0, 1, 1, 2), split by position: into parts
    that each hold every row of one example (a varlen batch split by its lengths), each part
    is that example's; split elsewhere, or cut by a slice, every part is mixed, since where
    the cut falls depends on the other examples' rows (the first rows an expert gets)."""
    from gradhooks.tracking import MIXED, Layout, Tracker

    x = torch.randn(3, 2, 3, requires_grad=True)
    tracker = Tracker(3, {})
    tracker.set_layout(x, Layout(0))
    with tracker:
        picked = x.flatten(0, 1)[torch.tensor([0, 1, 2, 3, 4])]
        assert tracker.layout(picked).owners.rows.tolist() == [0, 0, 1, 1, 2]
        got = [tracker.layout(p) for p in picked.split(sizes)]
        assert tracker.layout(picked[:2]) is MIXED
        assert tracker.layout(picked.narrow(0, 2, 2)) is MIXED
    if rows is None:
        assert all(lay is MIXED for lay in got)
    else:
        assert [lay.owners.rows.tolist() for lay in got] == rows


def test_attention_between_the_rows_of_two_examples_is_mixed():
    """SDPA along the rows of one example alone is followed; a query of one example's rows with
    keys of another's is not."""
    from gradhooks.tracking import MIXED, UNKNOWN, Layout, Tracker

    x = torch.randn(2, 6, 4, requires_grad=True)
    tracker = Tracker(2, {})
    tracker.set_layout(x, Layout(0))
    with tracker:
        rows = x.flatten(0, 1)[torch.arange(12)].unflatten(-1, (1, 4)).transpose(0, 1)
        first, second = rows[:, :6], rows[:, 6:]
        alone = F.scaled_dot_product_attention(first, first, first)
        across = F.scaled_dot_product_attention(first, second, second)
    assert tracker.layout(alone).owners.rows.tolist() == [0] * 6
    assert tracker.layout(across) in (MIXED, UNKNOWN)

"""Rows of the batch picked by their place in it and used for the whole batch: one example's
rows expanded to the batch (``lin(x[0:1].expand(B, -1))``, ``x[0].unsqueeze(0).expand_as(x)``),
the first rows alone (``lin(x[:2])``, returned or beside the batch's output), rows routed to
layers by their position; a whole number read from one example's values and used as a slice
bound or a size for every example (``h[:, : int(ids[0, 0])]``, ``torch.narrow(h, 1, 0, n)``);
one example's row of a second input of the batch's size met with the batch (``h + ids[0:1]``,
``torch.gather`` by ``ids[0:1].expand(B, -1)``).

The per-example loop (``gradhooks.oracle.loop_grad``, batches of one, float64) runs the model on
each example alone, where every example stands first: there each gets its own rows, its own
bound, its own row of ``ids``. In the batch all get the first example's, or some get none, so
the batch's gradient is not the sum of the loop's (each test checks that first) and no
``grad1`` can be both. Each such forward used to give a ``grad1`` different from the loop's
without an error; each is now refused with a ``MixedExamplesError`` naming the layer (or the
model) and the shapes, the model, ``.grad``, ``grad1`` and the hooks as they were, and the
handle trains on afterwards as the loop does. What the loop agrees with is not refused: a loop
over every example (joined, kept apart, each example's rows repeated), chunks and splits each
given the same layers, a branch each example's own values decide, each example's own bound.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from gradhooks.tracking.ops.common import is_inplace
from harness import assert_untouched, model_state, one_thread, raised  # noqa: F401

D = torch.float64
B = 4


def _sum_sq(out, target=None):
    """Half the sum of squares of the output, or of each output of a list or tuple."""
    if isinstance(out, list | tuple):
        return sum(0.5 * o.pow(2).sum() for o in out)
    return 0.5 * out.pow(2).sum()


def _batch(step: int):
    """``B`` float64 examples of 6 features and 6 small ids each (``ids[:, 0]`` differs per
    example: a bound of 1 to 5)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(B, 6, generator=g, dtype=D)
    ids = torch.randint(0, 3, (B, 6), generator=g)
    ids[:, 0] = torch.tensor([2, 5, 1, 4])[torch.randperm(B, generator=g)]
    return x, ids


class Fixed(nn.Module):
    """A Linear ``lin`` (6 to 6), a second ``other`` and a ``head`` (6 to 2), an embedding
    of the ids, run by ``forward(self, x, ids)`` (one of the dicts below, chosen by ``how``,
    changeable between forwards)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.other, self.head = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 2)
        self.emb = nn.Embedding(6, 6)
        self.how = how

    def forward(self, x, ids):
        return FORMS[self.how](self, x, ids)


# -- rows by fixed positions fed to a layer for the whole batch ----------------------------------

FIXED = {
    "expand": lambda m, x, ids: m.head(m.lin(x[0:1].expand(x.shape[0], -1))),
    "expand-as": lambda m, x, ids: m.head(m.lin(x[0].unsqueeze(0).expand_as(x))),
    "broadcast-to": lambda m, x, ids: m.head(m.lin(torch.broadcast_to(x[0:1], x.shape))),
    "first-rows": lambda m, x, ids: m.head(m.lin(x[:2])),
    "narrow": lambda m, x, ids: m.head(m.lin(x.narrow(0, 0, 1))),
    # (beside the batch's output, both in the loss)
    "first-rows-beside": lambda m, x, ids: (m.head(m.lin(x)), m.head(m.other(x[:2]))),
    "first-rows-of-output": lambda m, x, ids: m.head(m.lin(x))[:2],
    "expanded-output": lambda m, x, ids: m.head(m.lin(x))[0:1].expand(x.shape[0], -1),
    "loop-over-two": lambda m, x, ids: [m.head(m.lin(x[i : i + 1])) for i in range(2)],
    "routed-by-position": lambda m, x, ids: m.head(
        torch.cat([m.other(m.lin(x[:2])), m.lin(x[2:])])
    ),
    "a-layer-per-position": lambda m, x, ids: m.head(
        torch.cat([(m.lin if i else m.other)(x[i : i + 1]) for i in range(x.shape[0])])
    ),
}

# where each is refused: the layer (or the model) and the shape the message names
FIXED_AT = {
    "expand": ("'lin' (Linear)", "(4, 6)"),
    "expand-as": ("'lin' (Linear)", "(4, 6)"),
    "broadcast-to": ("'lin' (Linear)", "(4, 6)"),
    "first-rows": ("'lin' (Linear)", "(2, 6)"),
    "narrow": ("'lin' (Linear)", "(1, 6)"),
    "first-rows-beside": ("'other' (Linear)", "(2, 6)"),
    "first-rows-of-output": ("'Fixed' (the model): its output", "(2, 2)"),
    "expanded-output": ("'Fixed' (the model): its output", "(4, 2)"),
    "loop-over-two": ("'lin' (Linear)", "(1, 6)"),
    "routed-by-position": ("'other' (Linear)", "(2, 6)"),
    "a-layer-per-position": ("'other' (Linear)", "(1, 6)"),
}

# -- what the per-example loop agrees with -------------------------------------------------------

ALIKE = {
    "loop-joined": lambda m, x, ids: m.head(
        torch.cat([m.lin(x[i : i + 1]) for i in range(x.shape[0])])
    ),
    "loop-kept-apart": lambda m, x, ids: [m.head(m.lin(x[i][None])) for i in range(x.shape[0])],
    "loop-each-repeated": lambda m, x, ids: [
        m.head(m.lin(x[i : i + 1].expand(3, -1)) * torch.arange(1.0, 4.0, dtype=D)[:, None])
        for i in range(x.shape[0])
    ],
    "chunks": lambda m, x, ids: m.head(torch.cat([m.lin(c) for c in x.chunk(2)])),
    "uneven-split": lambda m, x, ids: m.head(torch.cat([m.lin(c) for c in x.split(3)])),
    "halves-alike": lambda m, x, ids: m.head(torch.cat([m.lin(x[:2]), m.lin(x[2:])])),
    # (NeRF's batchify: each example's 3 points folded into the rows, run in chunks of 5 rows
    # that cut across the examples, one example in two calls)
    "chunks-across-rows": lambda m, x, ids: m.head(
        torch.cat(
            [
                m.lin(c)
                for c in (x[:, None] * torch.arange(1.0, 4.0, dtype=D)[:, None])
                .reshape(-1, 6)
                .split(5)
            ]
        )
        .view(x.shape[0], 3, 6)
        .sum(1)
    ),
    # (each example's own values decide its branch, as they do in the loop)
    "own-branch": lambda m, x, ids: m.head(
        torch.cat([m.lin(xi) if xi.sum() > 0 else m.other(xi) for xi in x.split(1)])
    ),
}

# -- a whole number read from one example and used for the whole batch ---------------------------

BOUNDS = {
    "int": lambda m, x, ids: m.head(m.lin(x)[:, : int(ids[0, 0])].sum(1, keepdim=True) * x),
    "item": lambda m, x, ids: m.head(
        m.lin(x)[:, : ids[0, :2].sum().item() + 1].sum(1, keepdim=True) * x
    ),
    "narrow": lambda m, x, ids: m.head(
        torch.narrow(m.lin(x), 1, 0, int(ids[0, 0])).sum(1, keepdim=True) * x
    ),
    "branch": lambda m, x, ids: m.head(m.lin(x) if ids[0, 0] > 2 else m.other(x)),
}

OWN_BOUNDS = {
    "int-of-each": lambda m, x, ids: m.head(
        torch.cat(
            [
                m.lin(x[i : i + 1])[:, : int(ids[i, 0])].sum(1, keepdim=True) * x[i : i + 1]
                for i in range(x.shape[0])
            ]
        )
    ),
    "branch-of-each": lambda m, x, ids: m.head(
        torch.cat(
            [
                m.lin(x[i : i + 1]) if ids[i, 0] > 2 else m.other(x[i : i + 1])
                for i in range(x.shape[0])
            ]
        )
    ),
    # (each example's own bound kept a tensor: the remedy the refusal names)
    "mask-of-each": lambda m, x, ids: m.head(m.lin(x) * (torch.arange(6) < ids[:, :1]).to(D)),
}

# -- one example's row of a second input met with the batch --------------------------------------

SECOND = {
    "added": lambda m, x, ids: m.head(m.lin(x) + ids[0:1].to(D)),
    "expanded-added": lambda m, x, ids: m.head(m.lin(x) + ids[0:1].expand(x.shape[0], -1).to(D)),
    "gather": lambda m, x, ids: m.head(torch.gather(m.lin(x), 1, ids[0:1].expand(x.shape[0], -1))),
    "embedded": lambda m, x, ids: m.head(m.lin(x) + m.emb(ids[0:1].expand(x.shape[0], -1)).sum(1)),
}

OWN_SECOND = {
    "added": lambda m, x, ids: m.head(m.lin(x) + ids.to(D)),
    "gather": lambda m, x, ids: m.head(torch.gather(m.lin(x), 1, ids)),
    "embedded": lambda m, x, ids: m.head(m.lin(x) + m.emb(ids).sum(1)),
}

FORMS = {
    **{f"fixed/{k}": f for k, f in FIXED.items()},
    **{f"alike/{k}": f for k, f in ALIKE.items()},
    **{f"bound/{k}": f for k, f in BOUNDS.items()},
    **{f"own-bound/{k}": f for k, f in OWN_BOUNDS.items()},
    **{f"second/{k}": f for k, f in SECOND.items()},
    **{f"own-second/{k}": f for k, f in OWN_SECOND.items()},
}


def _batch_grad(model: nn.Module, x, ids) -> dict[str, torch.Tensor]:
    """Autograd's gradient of the batch's loss, hooks aside."""
    model.zero_grad()
    _sum_sq(model(x, ids)).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return got


def _loop_disagrees(model: nn.Module, x, ids) -> None:
    """The batch's gradient is not the sum of the per-example loop's: no ``grad1`` can be
    the loop's and sum to ``.grad``, so the forward has no per-example gradients."""
    ref = copy.deepcopy(model)
    want = loop_grad(ref, _sum_sq, (x, ids))
    got = _batch_grad(ref, x, ids)
    assert any(
        not torch.allclose(want[n].sum(0), got.get(n, torch.zeros_like(want[n][0]))) for n in want
    ), "the loop agrees with the batch: nothing to refuse"


def _refused(how: str, says: list[str]) -> None:
    """``how`` is refused with a ``MixedExamplesError`` that says ``says``, the model, its
    ``.grad``, ``grad1`` and hooks as they were (after a step that wrote them); the handle then
    trains a loop over every example as the per-example loop does."""
    model = Fixed(how).to(D)
    x, ids = _batch(0)
    _loop_disagrees(model, x, ids)
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        model.how = "alike/loop-joined"
        _sum_sq(model(x, ids)).backward()  # (a step before: grad and grad1 to keep)
        model.how = how
        before = model_state(model)
        raised(gradhooks.MixedExamplesError, says, lambda: _sum_sq(model(x, ids)).backward())
        assert_untouched(model, before)
        model.how = "alike/loop-joined"
        x, ids = _batch(1)
        want = loop_grad(copy.deepcopy(model), _sum_sq, (x, ids))
        model.zero_grad()
        h.clear()
        _sum_sq(model(x, ids)).backward()
        _matches(model, want, f"{how}, after")


def _matches(model: nn.Module, want: dict, what: str) -> dict[str, torch.Tensor]:
    """Each parameter the loop gives a gradient has ``grad1`` equal to it, summing to
    ``.grad``; the others have none (or zeros). Returns those compared."""
    used = {n: g for n, g in want.items() if g.any()}
    assert used, what
    for n, p in model.named_parameters():
        if n in used:
            torch.testing.assert_close(p.grad1, used[n], msg=f"{what}: {n}")
            torch.testing.assert_close(p.grad1.sum(0), p.grad, msg=f"{what}: {n}")
        else:
            assert getattr(p, "grad1", None) is None or not p.grad1.any(), f"{what}: {n}"
    return used


def _as_the_loop(how: str, steps: int = 2) -> None:
    """``steps`` SGD steps of ``how``: each step's ``grad1`` and norms are the float64 loop's,
    and ``grad1`` sums to ``.grad``."""
    model = Fixed(how).to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("grad1", "norms")) as h:
        for step in range(steps):
            x, ids = _batch(step)
            want = loop_grad(copy.deepcopy(model), _sum_sq, (x, ids))
            opt.zero_grad()
            h.clear()
            _sum_sq(model(x, ids)).backward()
            used = _matches(model, want, f"{how}, step {step}")
            norms = torch.cat([g.flatten(1) for g in used.values()], 1).norm(dim=1)
            torch.testing.assert_close(h.norms(), norms)
            opt.step()


@pytest.mark.parametrize("form", list(FIXED))
def test_rows_by_fixed_positions_for_the_whole_batch_are_refused(form):
    """One example's rows expanded to the batch, the first rows alone, rows routed by their
    position: the layer (or the model's output) that some examples' rows reach and others'
    do not, is named, with its input's shape and where the examples stand."""
    where, shape = FIXED_AT[form]
    _refused(f"fixed/{form}", [where, shape, "by their place", "and not for others"])


@pytest.mark.parametrize("form", list(ALIKE))
def test_rows_by_position_that_reach_every_example_alike_train_as_the_loop(form):
    _as_the_loop(f"alike/{form}")


@pytest.mark.parametrize("form", list(BOUNDS))
def test_a_bound_read_from_one_example_for_the_whole_batch_is_refused(form):
    """The model is named, with the read (``int()``, ``.item()``, ``bool()``) and the example
    it read."""
    read = {"int": "int()", "item": ".item()", "narrow": "int()", "branch": "bool()"}[form]
    says = ["'Fixed' (the model)", "values of some examples alone", "example 0", read]
    _refused(f"bound/{form}", says)


@pytest.mark.parametrize("form", list(OWN_BOUNDS))
def test_each_examples_own_bound_trains_as_the_loop(form):
    _as_the_loop(f"own-bound/{form}")


@pytest.mark.parametrize("form", list(SECOND))
def test_one_examples_row_of_a_second_input_met_with_the_batch_is_refused(form):
    """``ids`` (as long as the batch) is taken as the examples'; its first row alone, as
    ``ids[0]`` is, is the first example's, never a row shared by every example: met with
    every example's rows it mixes them, refused at the layer after."""
    _refused(f"second/{form}", ["'head' (Linear)", "(4, 6)", "computed across the examples"])


@pytest.mark.parametrize("form", list(OWN_SECOND))
def test_each_examples_own_row_of_a_second_input_trains_as_the_loop(form):
    _as_the_loop(f"own-second/{form}")


def test_a_forward_without_a_gradient_is_not_refused():
    """Nothing is refused where no backward can follow (evaluation under ``no_grad``)."""
    model = Fixed("fixed/first-rows").to(D)
    x, ids = _batch(0)
    with gradhooks.add_hooks(model), torch.no_grad():
        assert model(x, ids).shape == (2, 2)


def test_int_and_index_are_reads_not_in_place_operations():
    """``int(t)`` and ``operator.index(t)`` read a value; by their names (``__i...__``) they
    were taken for in-place operators, and the tracker never saw them as reads."""
    assert not is_inplace("__int__") and not is_inplace("__index__")
    assert is_inplace("__iadd__") and is_inplace("__imatmul__")

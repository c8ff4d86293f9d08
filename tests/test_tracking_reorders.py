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


FOLLOWED = [
    Reorder("mask of every row, written back", _every_row_written, vmaps=False),
    Reorder("mask of every entry, written back", _every_entry_written, vmaps=False),
    Reorder("index_put of every row", _every_row_put, vmaps=False),
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


MIXING = {
    "mask of every row, rows of the others written": _other_row_written,
    "mask of every row, the first example's row added": _first_row_everywhere,
}


@pytest.mark.parametrize("name", sorted(MIXING))
def test_mixing_is_refused(name):
    assert _refused_or_exact(MIXING[name]) == "refused"

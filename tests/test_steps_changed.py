"""A training loop that changes, between two steps, what a hooked call's work depends on.

The engine does some of each hooked call's work once and reuses it while the call's inputs
look the same (the tracker's memo of the torch calls, the plan of the hooks): a change it
missed would leave a silently wrong ``grad1``. Each test runs an ordinary loop (``zero_grad``,
forward, backward, ``optimizer.step()``) on a small float64 model, two steps as it was, two
after one change (a parameter frozen or replaced, the dtype, the input's shape, the batch
size, a submodule skipped, eval mode, the loss reduction, the quantities, autocast), and two
after the change is undone; every step's ``grad1`` (or norms) is compared with
``torch.func``'s ``vmap(grad)`` at the same parameters."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from torch import nn

import gradhooks
from gradhooks.oracle import vmap_grad
from harness import assert_close

D = torch.float64


class Net(nn.Module):
    """Linear, LayerNorm and Tanh, a residual Linear that ``use_extra`` turns off, a scale
    taken only in eval mode, and an output Linear; on ``[batch, features]`` or
    ``[batch, positions, features]`` (where each Linear's output is a view)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.norm = nn.Linear(4, 6), nn.LayerNorm(6)
        self.extra, self.fc2 = nn.Linear(6, 6), nn.Linear(6, 3)
        self.use_extra = True

    def forward(self, x):
        h = torch.tanh(self.norm(self.fc1(x)))
        if self.use_extra:
            h = h + self.extra(h)
        if not self.training:
            h = h * 0.5
        return self.fc2(h)


def sq(out):
    return out.square().sum()


class Loop:
    """The state a loop changes: the model, its optimizer, the handle, the batch's shape, the
    loss reduction and autocast."""

    def __init__(self, quantities: tuple[str, ...] = ("grad1",)) -> None:
        self.model = Net().to(D)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.h = gradhooks.add_hooks(self.model, loss_reduction="mean", quantities=quantities)
        self.shape = (4, 5, 4)
        self.autocast = False
        self.step_no = 0

    def rehook(self, quantities: tuple[str, ...]) -> None:
        self.h.remove()
        self.h = gradhooks.add_hooks(self.model, loss_reduction="mean", quantities=quantities)

    def replace(self, name: str) -> None:
        """A new tensor for parameter ``name`` (re-assigned: ``layer.weight = nn.Parameter``),
        and an optimizer for the parameters as they now are."""
        owner, _, leaf = name.rpartition(".")
        module = self.model.get_submodule(owner)
        old = getattr(module, leaf)
        setattr(module, leaf, nn.Parameter(old.detach().clone() + 0.1))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)

    def step(self, what: str) -> None:
        """One step, checked against vmap(grad) at the parameters it starts from."""
        self.step_no += 1
        dtype = next(self.model.parameters()).dtype
        x = torch.randn(
            *self.shape, generator=torch.Generator().manual_seed(self.step_no), dtype=dtype
        )
        batch = x.shape[0]
        mean = self.h.loss_reduction == "mean"
        cast = (
            torch.autocast("cpu", dtype=torch.bfloat16)
            if self.autocast
            else contextlib.nullcontext()
        )
        want = vmap_grad(self.model, sq, x)  # (under autocast: without, in float32)
        self.opt.zero_grad()
        with cast:
            loss = sq(self.model(x))
        (loss / batch if mean else loss).backward()
        what = f"step {self.step_no} ({what})"
        if "grad1" in self.h.quantities:
            tol = {}
            if dtype != D or self.autocast:
                scale = max(float(w.abs().max()) for w in want.values())
                low = 3e-2 if self.autocast else 1e-5
                tol = dict(rtol=low, atol=low * scale)
            checked = 0
            for n, p in self.model.named_parameters():
                if not p.requires_grad or p.grad is None:  # (frozen, or in a skipped call)
                    assert not hasattr(p, "grad1"), f"{what}: {n} has a grad1 but no .grad"
                    continue
                if tol:
                    torch.testing.assert_close(
                        p.grad1.to(D), want[n].to(D), **tol, msg=lambda m, n=n: f"{what} {n}: {m}"
                    )
                else:
                    assert_close(p.grad1, want[n], f"{what}: {n}")
                checked += 1
            assert checked, what
        else:
            norms = torch.stack(
                [w.flatten(1).square().sum(1) for w in want.values()]
            ).sum(0).sqrt()  # fmt: skip
            torch.testing.assert_close(self.h.norms(), norms, msg=lambda m: f"{what}: {m}")
        self.opt.step()


def _freeze(loop: Loop, on: bool) -> None:
    loop.model.fc1.bias.requires_grad_(not on)


def _shape(shape: tuple[int, ...]) -> Callable[[Loop], None]:
    def change(loop: Loop) -> None:
        loop.shape = shape

    return change


def _set(attr: str, value) -> Callable[[Loop], None]:
    def change(loop: Loop) -> None:
        setattr(loop.model, attr, value)

    return change


def _reduction(value: str) -> Callable[[Loop], None]:
    def change(loop: Loop) -> None:
        loop.h.loss_reduction = value

    return change


def _autocast(on: bool) -> Callable[[Loop], None]:
    def change(loop: Loop) -> None:
        loop.model.to(torch.float32 if on else D)
        loop.autocast = on

    return change


# (what changes, its change and what undoes it)
CHANGES = {
    "requires_grad": (lambda loop: _freeze(loop, True), lambda loop: _freeze(loop, False)),
    "replaced weight": (
        lambda loop: loop.replace("fc2.weight"),
        lambda loop: loop.replace("fc1.weight"),
    ),
    "dtype": (lambda loop: loop.model.float(), lambda loop: loop.model.double()),
    "positions": (_shape((4, 7, 4)), _shape((4, 5, 4))),
    "batch size": (_shape((3, 5, 4)), _shape((4, 5, 4))),
    "rank": (_shape((4, 4)), _shape((4, 5, 4))),
    "module skipped": (_set("use_extra", False), _set("use_extra", True)),
    "eval": (lambda loop: loop.model.eval(), lambda loop: loop.model.train()),
    "loss reduction": (_reduction("sum"), _reduction("mean")),
    "quantities": (lambda loop: loop.rehook(("norms",)), lambda loop: loop.rehook(("grad1",))),
    "autocast": (_autocast(True), _autocast(False)),
}


@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
def test_change_between_steps(change):
    do, undo = CHANGES[change]
    loop = Loop()
    try:
        for what, before in (("as it was", None), (change, do), (f"{change} undone", undo)):
            if before is not None:
                before(loop)
            loop.step(what)
            loop.step(f"{what}, again")
    finally:
        loop.h.remove()


def test_every_change_in_one_loop():
    """The changes one after another on one handle: each step against vmap(grad)."""
    loop = Loop()
    try:
        loop.step("first")
        for change, (do, undo) in CHANGES.items():
            do(loop)
            loop.step(change)
            loop.step(f"{change}, again")
            undo(loop)
            loop.step(f"{change} undone")
    finally:
        loop.h.remove()

"""Training loops as real projects write them, each step checked against the float64 oracle.

Each test follows the idioms of one kind of published training script (the PyTorch examples'
MNIST, word language model and DCGAN loops, nanoGPT's accumulation loop, timm's
``train_one_epoch``, Hugging Face's accelerate-free fine-tuning loop, Opacus' and
private-transformers' DP loops, the autograd-hacks and BackPACK recipes) on a small model, and
at every step compares ``grad1`` (and the norms or the DP step where the loop uses them) with
each example's own gradient by a per-example loop in float64 (:func:`gradhooks.oracle.loop_grad`
or a loop written out where the examples are not on dimension 0), or checks that a misuse
stops with an error that says what went wrong.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_close

D = torch.float64


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad1.clone() for n, p in model.named_parameters() if hasattr(p, "grad1")}


def assert_grad1(model, want: dict, what: str, **tol) -> None:
    """Every trainable parameter's ``grad1`` is ``want[name]`` (float64 tolerances of the
    harness, or ``torch.testing.assert_close`` with ``tol``)."""
    checked = 0
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        assert hasattr(p, "grad1"), f"{what}: {n} has no grad1"
        if tol:
            torch.testing.assert_close(
                p.grad1.to(want[n].dtype), want[n], **tol, msg=lambda m, n=n: f"{what} {n}: {m}"
            )
        else:
            assert_close(p.grad1, want[n], f"{what}: {n}")
        checked += 1
    assert checked, what


def assert_same(model, twin, what: str) -> None:
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert_close(p.detach(), q.detach(), f"{what}: parameter {n}")


def scaled(want: dict, c: float) -> dict:
    return {n: c * g for n, g in want.items()}


def added(a: dict | None, b: dict) -> dict:
    return dict(b) if a is None else {n: a[n] + b[n] for n in b}


# -- the PyTorch examples' MNIST loop -------------------------------------------------------------


class MnistNet(nn.Module):
    """The MNIST example's network, shrunk: two convolutions, max-pooling, two Linear layers,
    log_softmax (the example's dropout is left out: its mask cannot be replayed by the loop)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1, self.conv2 = nn.Conv2d(1, 4, 3), nn.Conv2d(4, 6, 3)
        self.fc1, self.fc2 = nn.Linear(6 * 2 * 2, 8), nn.Linear(8, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


def test_mnist_example_loop_with_steplr_and_a_summed_test_pass():
    """zero_grad, forward, ``nll_loss``, backward, Adadelta step, StepLR at each epoch's end,
    and between epochs a test pass in eval mode under ``no_grad`` with ``reduction="sum"`` on
    a batch of another size: every training step's grad1 is its examples' own gradients."""
    model = MnistNet().to(D)
    twin = copy.deepcopy(model)
    opts = [torch.optim.Adadelta(m.parameters(), lr=1.0) for m in (model, twin)]
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7) for o in opts]
    g = torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(model):
        for epoch in range(2):
            model.train()
            for step in range(2):
                x = torch.randn(5, 1, 8, 8, generator=g, dtype=D)
                y = torch.randint(10, (5,), generator=g)
                want = loop_grad(twin, F.nll_loss, x, y)
                for m, o in zip((model, twin), opts):
                    o.zero_grad()
                    F.nll_loss(m(x), y).backward()
                    o.step()
                assert_grad1(model, want, f"epoch {epoch} step {step}")
                assert_same(model, twin, f"epoch {epoch} step {step}")
            model.eval()
            with torch.no_grad():
                xt = torch.randn(7, 1, 8, 8, generator=g, dtype=D)
                yt = torch.randint(10, (7,), generator=g)
                F.nll_loss(model(xt), yt, reduction="sum").item()
            assert model.fc2.weight.grad1.shape[0] == 5  # the test pass captured nothing
            for s in scheds:
                s.step()


# -- the tutorials' loop without an optimizer -----------------------------------------------------


@pytest.mark.parametrize("zero", ["grad.zero_", "grad.data.zero_", "grad = None"])
def test_manual_sgd_with_the_gradients_zeroed_by_hand(zero):
    """The "learning PyTorch with examples" loop: backward, ``p.data -= lr * p.grad.data``,
    then each gradient zeroed by hand (``p.grad.data.zero_()`` in the older versions, which
    torch does not count as a change of ``.grad``): every step's grad1 is that step's alone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 1)).to(D)
    mse = lambda out, y: F.mse_loss(out, y, reduction="sum")  # noqa: E731
    g = torch.Generator().manual_seed(1)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for step in range(3):
            x, y = torch.randn(5, 3, generator=g, dtype=D), torch.randn(5, 1, generator=g, dtype=D)
            want = loop_grad(model, mse, x, y)
            mse(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            for p in model.parameters():
                p.data -= 1e-2 * p.grad.data
                if zero == "grad.zero_":
                    p.grad.zero_()
                elif zero == "grad.data.zero_":
                    p.grad.data.zero_()
                else:
                    p.grad = None

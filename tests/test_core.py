"""grad1 for Linear and Conv2d models against vmap(grad) and a per-example loop."""

import pytest
import torch
from torch import nn

from gradhooks.models import MLP, LeNet, SimpleCNN
from harness import Case, check, cross_entropy_sum

CASES = [
    Case(
        "simple_cnn",
        SimpleCNN,
        lambda b: torch.randn(b, 1, 28, 28),
        lambda b: torch.randint(10, (b,)),
        cross_entropy_sum,
    ),
    Case(
        "lenet",
        LeNet,
        lambda b: torch.randn(b, 1, 28, 28),
        lambda b: torch.randint(10, (b,)),
        cross_entropy_sum,
    ),
    Case("mlp", lambda: MLP(7, 5, 3), lambda b: torch.randn(b, 7)),
    Case("linear_3d", lambda: nn.Linear(5, 3), lambda b: torch.randn(b, 6, 5)),
    Case(
        "linear_4d_nobias", lambda: nn.Linear(5, 3, bias=False), lambda b: torch.randn(b, 2, 3, 5)
    ),
    Case("linear_2d", lambda: nn.Linear(4, 2), lambda b: torch.randn(b, 4)),
]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("batch", [0, 1, 5])
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_matches_oracles(case, batch, reduction):
    check(case, batch=batch, reduction=reduction)


def test_empty_batch_gives_empty_grad1():
    model = check(CASES[3], batch=0)
    assert model.weight.grad1.shape == (0, 3, 5)


def test_real_mean_loss_matches_the_tutorial_oracle():
    """The user's code path: F.cross_entropy with its default mean reduction."""
    import torch.nn.functional as F

    import gradhooks

    torch.manual_seed(1)
    model = SimpleCNN().double()
    x, y = torch.randn(6, 1, 28, 28, dtype=torch.float64), torch.randint(10, (6,))
    want = gradhooks.oracle.vmap_grad(model, F.cross_entropy, x, y)
    gradhooks.add_hooks(model)
    F.cross_entropy(model(x), y).backward()
    gradhooks.remove_hooks(model)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad1, want[name], rtol=1e-7, atol=1e-10)
        torch.testing.assert_close(p.grad1.mean(0), p.grad, rtol=1e-7, atol=1e-10)

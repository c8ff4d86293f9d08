"""The autograd-hacks recipe, unchanged, with `import gradhooks as autograd_hacks`."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gradhooks as autograd_hacks
from gradhooks.oracle import loop_grad


class Net(nn.Module):
    """autograd-hacks' own test network."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 20, 5)
        self.conv2 = nn.Conv2d(20, 30, 5)
        self.fc1 = nn.Linear(4 * 4 * 30, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(x, 2, 2)
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2, 2)
        x = x.view(-1, 4 * 4 * 30)
        x = F.relu(self.fc1(x))
        x = self.fc2(x)
        return x


@pytest.mark.parametrize("loss_type", ["mean", "sum"])
def test_autograd_hacks_recipe(loss_type):
    torch.manual_seed(1)
    model = Net().double()
    loss_fn = nn.CrossEntropyLoss(reduction=loss_type)
    data = torch.rand(5, 1, 28, 28, dtype=torch.float64)
    targets = torch.LongTensor(5).random_(0, 10)

    autograd_hacks.add_hooks(model)
    output = model(data)
    loss_fn(output, targets).backward(retain_graph=True)
    autograd_hacks.compute_grad1(model, loss_type=loss_type)
    autograd_hacks.disable_hooks()

    want = loop_grad(model, nn.CrossEntropyLoss(reduction="sum"), data, targets)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad1, want[name], rtol=1e-7, atol=1e-10)
    autograd_hacks.enable_hooks()
    autograd_hacks.clear_backprops(model)
    autograd_hacks.remove_hooks(model)


def test_disable_enable_and_is_supported():
    model = nn.Linear(3, 2)
    autograd_hacks.add_hooks(model)
    autograd_hacks.disable_hooks()
    try:
        model(torch.randn(4, 3)).sum().backward()
    finally:
        autograd_hacks.enable_hooks()
    assert not hasattr(model.weight, "grad1")
    with pytest.raises(RuntimeError, match="no backward pass was captured"):
        autograd_hacks.compute_grad1(model)
    model(torch.randn(4, 3)).sum().backward()
    autograd_hacks.compute_grad1(model)
    assert model.weight.grad1.shape == (4, 2, 3)
    autograd_hacks.remove_hooks(model)
    assert autograd_hacks.is_supported(nn.Linear(2, 2))
    assert autograd_hacks.is_supported(nn.Conv2d(2, 2, 1))
    assert not autograd_hacks.is_supported(nn.ReLU())


def test_training_loop_with_clear_backprops():
    """grad1 is fresh every step when clear_backprops is called, as autograd-hacks users do."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    autograd_hacks.add_hooks(model)
    for _ in range(3):
        x = torch.randn(6, 3, dtype=torch.float64)
        model.zero_grad()
        model(x).pow(2).mean().backward()
        autograd_hacks.compute_grad1(model)
        for p in model.parameters():
            torch.testing.assert_close(p.grad1.mean(0), p.grad)
        autograd_hacks.clear_backprops(model)
    autograd_hacks.remove_hooks(model)

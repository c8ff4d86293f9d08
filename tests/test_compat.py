"""The autograd-hacks recipe, unchanged, with `import gradhooks as autograd_hacks`."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gradhooks as autograd_hacks
from gradhooks.oracle import loop_grad, vmap_grad


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
    with pytest.raises(autograd_hacks.StateError):
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


def _jacobian(y: torch.Tensor, x: torch.Tensor, create_graph: bool = False) -> torch.Tensor:
    """d y / d x, one backward per entry of y (as autograd-hacks' tests take it)."""
    rows = []
    flat = y.reshape(-1)
    for i in range(flat.numel()):
        (g,) = torch.autograd.grad(flat[i], x, retain_graph=True, create_graph=create_graph)
        rows.append(g)
    return torch.stack(rows).reshape(*y.shape, *x.shape)


def test_more_gradients_after_disable_hooks_leave_grad1_alone():
    """autograd-hacks' own test: after disable_hooks(), the per-example losses' Jacobian is
    taken by more backwards through the graph recorded with the hooks on."""
    torch.manual_seed(1)
    model = Net().double()
    loss_fn = nn.CrossEntropyLoss()
    data = torch.rand(4, 1, 28, 28, dtype=torch.float64)
    targets = torch.LongTensor(4).random_(0, 10)
    autograd_hacks.add_hooks(model)
    try:
        output = model(data)
        loss_fn(output, targets).backward(retain_graph=True)
        autograd_hacks.compute_grad1(model)
        autograd_hacks.disable_hooks()
        losses = torch.stack([loss_fn(output[i : i + 1], targets[i : i + 1]) for i in range(4)])
        for layer in model.modules():
            if not autograd_hacks.is_supported(layer):
                continue
            for param in layer.parameters():
                torch.testing.assert_close(param.grad, param.grad1.mean(dim=0))
                torch.testing.assert_close(_jacobian(losses, param), param.grad1)
    finally:
        autograd_hacks.remove_hooks(model)
        autograd_hacks.enable_hooks()


def test_paused_and_set_enabled_stop_a_backward_of_a_captured_forward():
    model = nn.Linear(3, 2).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    with autograd_hacks.add_hooks(model) as h:
        out = model(x)
        out.sum().backward(retain_graph=True)
        first = model.weight.grad1.clone()
        with h.paused():
            out.sum().backward(retain_graph=True)
        with autograd_hacks.paused():
            out.sum().backward(retain_graph=True)
        autograd_hacks.set_enabled(False)
        try:
            out.sum().backward(retain_graph=True)
        finally:
            autograd_hacks.set_enabled(True)
        torch.testing.assert_close(model.weight.grad1, first)


def test_add_hooks_captures_again_after_disable_hooks():
    autograd_hacks.disable_hooks()
    model = nn.Linear(3, 2)
    with autograd_hacks.add_hooks(model):
        model(torch.randn(4, 3)).sum().backward()
    assert model.weight.grad1.shape == (4, 2, 3)


class TinyNet(nn.Module):
    """autograd-hacks' Hessian test network: ReLUs and max-pooling only, so each layer's
    Hessian block is its Gauss-Newton block."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 2, 2, 1)
        self.conv2 = nn.Conv2d(2, 2, 2, 1)
        self.fc1 = nn.Linear(2, 2)
        self.fc2 = nn.Linear(2, 10)

    def forward(self, x):
        x = F.max_pool2d(x, 4, 4)
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(x, 2, 2)
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2, 2)
        x = x.view(-1, 2)
        return self.fc2(F.relu(self.fc1(x)))


@pytest.mark.parametrize("hess_type", ["CrossEntropy", "LeastSquares"])
def test_compute_hess_equals_autograds_hessian(hess_type):
    torch.manual_seed(1)
    model = TinyNet().double()
    n = 3
    data = torch.rand(n, 1, 28, 28, dtype=torch.float64)
    autograd_hacks.add_hooks(model)
    try:
        output = model(data)
        if hess_type == "CrossEntropy":
            targets = torch.LongTensor(n).random_(0, 10)
            loss = nn.CrossEntropyLoss()(output, targets)
        else:
            targets = torch.rand(output.shape, dtype=torch.float64)
            loss = ((output - targets) ** 2).sum() / 2 / n
        autograd_hacks.backprop_hess(output, hess_type=hess_type)
        autograd_hacks.clear_backprops(model)  # forgets the first run: only the second counts
        autograd_hacks.backprop_hess(output, hess_type=hess_type)
        autograd_hacks.compute_hess(model)
        autograd_hacks.disable_hooks()
        for layer in model.modules():
            if not autograd_hacks.is_supported(layer):
                continue
            for param in layer.parameters():
                want = _jacobian(_jacobian(loss, param, create_graph=True), param)
                torch.testing.assert_close(param.hess, want.reshape(param.hess.shape))
    finally:
        autograd_hacks.remove_hooks(model)
        autograd_hacks.enable_hooks()


def test_compute_grad1_refuses_two_backwards_as_autograd_hacks_asserts():
    """autograd-hacks asserts "Multiple backprops detected" when a second backward ran without
    clear_backprops; so does compute_grad1 here, leaving grad1 (the sum of both, as .grad)
    untouched. zero_grad() between the steps starts grad1 afresh, as clear_backprops does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    xs = [torch.randn(5, 3, dtype=torch.float64) for _ in range(3)]
    autograd_hacks.add_hooks(model)
    try:
        model(xs[0]).pow(2).mean().backward()
        model(xs[1]).pow(2).mean().backward()  # neither clear_backprops nor zero_grad
        held = {n: p.grad1.clone() for n, p in model.named_parameters()}
        with pytest.raises(
            autograd_hacks.StateError, match="Multiple backprops detected.*2 backwards"
        ):
            autograd_hacks.compute_grad1(model)
        want = [vmap_grad(model, lambda o: o.pow(2).mean(), x) for x in xs[:2]]
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1, held[n], rtol=0, atol=0)  # untouched
            torch.testing.assert_close(p.grad1, want[0][n] + want[1][n])
        model.zero_grad()  # (what the ordinary loop does instead of clear_backprops)
        model(xs[2]).pow(2).mean().backward()
        autograd_hacks.compute_grad1(model)
        want = vmap_grad(model, lambda o: o.pow(2).mean(), xs[2])
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1, want[n])
        out = model(xs[2])
        out.pow(2).mean().backward(retain_graph=True)
        out.pow(2).mean().backward()  # a retain_graph backward twice: two backprops too
        with pytest.raises(autograd_hacks.StateError):
            autograd_hacks.compute_grad1(model)
        autograd_hacks.clear_backprops(model)
        model(xs[0]).pow(2).mean().backward()  # .grad accumulates; grad1 is this backward's
        autograd_hacks.compute_grad1(model)
        want = vmap_grad(model, lambda o: o.pow(2).mean(), xs[0])
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad1, want[n])
    finally:
        autograd_hacks.remove_hooks(model)


def test_compute_grad1_in_a_loop_with_zero_grad_and_no_clear_backprops():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    autograd_hacks.add_hooks(model)
    try:
        for _ in range(3):
            x = torch.randn(6, 3, dtype=torch.float64)
            want = vmap_grad(model, lambda o: o.pow(2).mean(), x)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            autograd_hacks.compute_grad1(model)
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.grad1, want[n])
            opt.step()
    finally:
        autograd_hacks.remove_hooks(model)

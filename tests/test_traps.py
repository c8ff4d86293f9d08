"""Where autograd-hacks is wrong: reuse, tying, freezing, repeated backward, no_grad forwards."""

import torch
import torch.nn.functional as F
from cases import Reused  # one Linear called twice in a forward
from torch import nn

import gradhooks
from harness import Case, assert_close, check


class Tied(nn.Module):
    """A weight shared between two modules (input embedding tied to an output layer)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(5, 3, bias=False)
        self.mid = nn.Linear(3, 3)
        self.dec = nn.Linear(3, 5, bias=False)
        self.dec.weight = nn.Parameter(self.enc.weight.detach().clone().t().contiguous())
        self.dec2 = nn.Linear(5, 3)
        self.dec2.weight = self.enc.weight  # same Parameter, same shape

    def forward(self, x):
        h = torch.tanh(self.mid(torch.tanh(self.enc(x))))
        return self.dec2(self.dec(h))


def frozen_first():
    m = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    m[0].weight.requires_grad_(False)
    return m


CASES = [
    Case("reused_module", Reused, lambda b: torch.randn(b, 4)),
    Case("tied_weight", Tied, lambda b: torch.randn(b, 5)),
    Case("frozen_parameter", frozen_first, lambda b: torch.randn(b, 4)),
    Case(
        "reused_conv",
        lambda: nn.Sequential(*[nn.Conv2d(2, 2, 3, padding=1)] * 3),
        lambda b: torch.randn(b, 2, 5, 5),
    ),
]


def test_reused_tied_frozen():
    for case in CASES:
        for reduction in ("mean", "sum"):
            for batch in (1, 4):
                check(case, batch=batch, reduction=reduction)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def test_second_backward_accumulates_like_grad():
    model = _mlp()
    x = torch.randn(5, 3, dtype=torch.float64)
    x2 = torch.randn(5, 3, dtype=torch.float64)
    want = gradhooks.oracle.vmap_grad(model, lambda o: o.pow(2).sum(), x)
    want2 = gradhooks.oracle.vmap_grad(model, lambda o: o.pow(2).sum(), x2)
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        model(x).pow(2).sum().backward()
        model(x2).pow(2).sum().backward()
        for n, p in model.named_parameters():
            assert_close(p.grad1, want[n] + want2[n], f"accumulated {n}")
            assert_close(p.grad1.sum(0), p.grad, f"accumulated .grad {n}")
        h.clear()
        model(x2).pow(2).sum().backward()
        for n, p in model.named_parameters():
            assert_close(p.grad1, want2[n], f"after clear {n}")


def test_retain_graph_backward_twice_accumulates():
    model = _mlp()
    x = torch.randn(4, 3, dtype=torch.float64)
    want = gradhooks.oracle.vmap_grad(model, lambda o: o.pow(2).sum(), x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        loss = model(x).pow(2).sum()
        loss.backward(retain_graph=True)
        loss.backward()
    for n, p in model.named_parameters():
        assert_close(p.grad1, 2 * want[n], n)


def test_no_grad_forward_in_between_is_not_captured():
    model = _mlp()
    x = torch.randn(4, 3, dtype=torch.float64)
    want = gradhooks.oracle.vmap_grad(model, lambda o: o.pow(2).sum(), x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        out = model(x)
        with torch.no_grad():
            model(torch.randn(7, 3, dtype=torch.float64))  # an evaluation batch of another size
        out.pow(2).sum().backward()
    for n, p in model.named_parameters():
        assert_close(p.grad1, want[n], n)


def test_inplace_relu_after_layer():
    case = Case(
        "inplace_relu",
        lambda: nn.Sequential(nn.Linear(3, 5), nn.ReLU(inplace=True), nn.Linear(5, 2)),
        lambda b: torch.randn(b, 3),
    )
    check(case, batch=4)


def test_mean_reduction_with_default_loss():
    model = _mlp()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    want = gradhooks.oracle.vmap_grad(model, F.mse_loss, x, y)
    with gradhooks.add_hooks(model):
        F.mse_loss(model(x), y).backward()
    for n, p in model.named_parameters():
        assert_close(p.grad1, want[n], n)

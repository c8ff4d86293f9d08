"""The normalization rules multiply ``x̂`` by the output-gradient in ``x̂``'s own memory in a
plain backward, and out of place where that would be wrong: a ``create_graph`` backward (grad1
gets a graph) and under ``vmap`` (the Jacobians). Plain backwards and the Jacobians are checked
for every norm layer in test_layers_norm.py and test_quantities.py; here, differentiating
through grad1 against torch.func, in float64."""

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import gradhooks
from harness import assert_close

D = torch.float64


def sq(out):
    return 0.5 * out.pow(2).sum()


@pytest.mark.parametrize(
    "norm, shape",
    [(lambda: nn.LayerNorm(4), (3, 4)), (lambda: nn.GroupNorm(2, 4), (4, 3))],
    ids=["layer_norm", "group_norm"],
)
def test_differentiate_through_grad1_of_norm_layers(norm, shape):
    torch.manual_seed(0)
    model = nn.Sequential(norm(), nn.Tanh(), nn.Flatten(), nn.Linear(12, 2)).to(D)
    with torch.no_grad():  # not the default ones and zeros: every term counts
        model[0].weight.normal_()
        model[0].bias.normal_()
    x = torch.randn(5, *shape, dtype=D)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())

    def objective(ps):
        def one(ps, xi):
            return sq(functional_call(model, ps, (xi[None],)))

        per_example = vmap(grad(one), in_dims=(None, 0))(ps, x)
        return sum(g.pow(2).sum() for g in per_example.values())

    want = grad(objective)({n: p.detach() for n, p in model.named_parameters()})
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        torch.autograd.grad(sq(model(x)), params, create_graph=True)
        value = sum(p.grad1.pow(2).sum() for p in params)
        with h.paused():
            got = torch.autograd.grad(value, params)
    for n, g in zip(names, got, strict=True):
        assert_close(g, want[n], f"d Σ‖grad1‖² / d {n}")

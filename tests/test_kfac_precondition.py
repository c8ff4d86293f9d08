"""K-FAC preconditioning (``KFactors.inverse``, ``gradhooks.kfac_precondition``) against the
exact solve ``torch.linalg.solve(kron(G, A) + damping·I, vec(grad))`` in float64, with the
weight as a matrix ``[*groups, out, in]`` and the bias as its last column."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from harness import assert_close

D = torch.float64


def exact_solve(f: gradhooks.KFactors, grad: torch.Tensor, damping: float) -> torch.Tensor:
    """``(kron(G, A) + damping·I)⁻¹ vec(grad)`` by one dense solve per group; ``grad`` is
    ``[*groups, out, in(+1)]``."""
    A, G, M = f.A, f.G, grad
    if A.dim() == 2:
        A, G, M = A[None], G[None], M[None]
    out = []
    for a, g, m in zip(A, G, M):
        K = torch.kron(g, a) + damping * torch.eye(g.shape[0] * a.shape[0], dtype=D)
        out.append(torch.linalg.solve(K, m.flatten()).view_as(m))
    return torch.stack(out).view_as(grad)


class Net(nn.Module):
    """A convolution (grouped or not), a Linear with and one without a bias, a LayerNorm (a
    parameter without Kronecker factors, whose gradient stays)."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 6, 3, groups=groups)
        self.norm = nn.LayerNorm(24)
        self.fc = nn.Linear(24, 5)
        self.head = nn.Linear(5, 3, bias=False)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(self.norm(torch.tanh(self.conv(x)).flatten(1)))))


def matrix(net: Net, name: str, f: gradhooks.KFactors) -> torch.Tensor:
    """The gradient of ``name`` as the factors see it: ``[*groups, out, in]`` plus the bias
    column, written out by hand for each layer of ``Net``."""
    if name == "conv.weight":
        groups = net.conv.groups
        w = net.conv.weight.grad.flatten(1)  # [out, in/groups · 3 · 3]
        if f.bias:
            w = torch.cat([w, net.conv.bias.grad[:, None]], 1)
        return w.view(groups, 6 // groups, -1) if groups > 1 else w
    if name == "fc.weight":
        w = net.fc.weight.grad
        return torch.cat([w, net.fc.bias.grad[:, None]], 1) if f.bias else w
    assert name == "head.weight" and not f.bias
    return net.head.weight.grad


@pytest.mark.parametrize("inverted", [False, True], ids=["factors", "inverse"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias-augmented", "no-bias"])
@pytest.mark.parametrize("groups", [1, 2], ids=["conv", "grouped-conv"])
def test_precondition_is_the_exact_damped_solve(groups, bias, inverted):
    torch.manual_seed(0)
    net = Net(groups).to(D)
    x, y = torch.randn(6, 4, 4, 4, dtype=D), torch.randint(3, (6,))
    factors = gradhooks.kfac(net, x, fisher="mc", bias=bias)
    assert set(factors) == {"conv.weight", "fc.weight", "head.weight"}
    assert factors["fc.weight"].bias_name == ("fc.bias" if bias else None)
    F.cross_entropy(net(x), y).backward()
    damping = 1e-2
    want = {n: exact_solve(f, matrix(net, n, f), damping) for n, f in factors.items()}
    untouched = {n: p.grad.clone() for n, p in net.named_parameters()}
    if inverted:
        gradhooks.kfac_precondition(net, {n: f.inverse(damping) for n, f in factors.items()})
    else:
        gradhooks.kfac_precondition(net, factors, damping=damping)
    for name, f in factors.items():
        assert_close(matrix(net, name, f), want[name], f"{name}: preconditioned")
    kept = ["norm.weight", "norm.bias"] + ([] if bias else ["conv.bias", "fc.bias"])
    for name in kept:
        assert torch.equal(net.get_parameter(name).grad, untouched[name]), f"{name} changed"


@pytest.mark.parametrize("groups", [(), (3,)], ids=["one-group", "three-groups"])
def test_inverse_applied_to_a_matrix_is_the_exact_damped_solve(groups):
    """On random positive semi-definite factors, one of them singular."""
    torch.manual_seed(1)
    a, g = torch.randn(*groups, 4, 3, dtype=D), torch.randn(*groups, 5, 5, dtype=D)
    f = gradhooks.KFactors(a @ a.mT, g @ g.mT, bias=False)  # A: rank 3 of 4
    grad = torch.randn(*groups, 5, 4, dtype=D)
    for damping in (1e-3, 1.0):
        got = f.inverse(damping).apply(grad)
        assert_close(got, exact_solve(f, grad, damping), f"damping {damping}")


def test_a_tied_weight_and_a_wrapped_model_keep_their_bias_names():
    """Factors name the bias they cover as named_parameters() does (a DDP-style wrapper's
    ``module.`` prefix included)."""

    class Wrapper(nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, x):
            return self.module(x)

    torch.manual_seed(2)
    net = Wrapper(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))).to(D)
    factors = gradhooks.kfac(net, torch.randn(5, 3, dtype=D), fisher="exact")
    assert {n: f.bias_name for n, f in factors.items()} == {
        "module.0.weight": "module.0.bias",
        "module.2.weight": "module.2.bias",
    }


def test_errors_name_the_weight_and_what_to_do():
    torch.manual_seed(3)
    net = Net(1).to(D)
    x, y = torch.randn(4, 4, 4, 4, dtype=D), torch.randint(3, (4,))
    factors = gradhooks.kfac(net, x, fisher="mc")
    with pytest.raises(
        gradhooks.ConfigurationError, match=r"'head.weight' has no .grad: run the loss's backward"
    ):
        gradhooks.kfac_precondition(net, factors, damping=1e-3)
    F.cross_entropy(net(x), y).backward()
    before = {n: p.grad.clone() for n, p in net.named_parameters()}
    with pytest.raises(
        gradhooks.ConfigurationError, match=r"KFactors of 'head.weight' and no damping"
    ):
        gradhooks.kfac_precondition(net, factors)
    with pytest.raises(gradhooks.ConfigurationError):
        gradhooks.kfac_precondition(net, factors, damping=0)
    inverses = {n: f.inverse(1e-3) for n, f in factors.items()}
    with pytest.raises(
        gradhooks.ConfigurationError, match=r"'head.weight' are already inverted with damping"
    ):
        gradhooks.kfac_precondition(net, inverses, damping=1e-3)
    # the last weight's factors do not fit: nothing is written, not even the first weights'
    other = gradhooks.kfac(Net(2).to(D), x, fisher="mc")
    mixed = {**factors, "conv.weight": other["conv.weight"]}
    mixed = {n: mixed[n] for n in ("fc.weight", "head.weight", "conv.weight")}
    with pytest.raises(gradhooks.ConfigurationError, match=r"'conv.weight' are of a \(2, 3, 19\) weight matrix.*"
                       r"weight \(6, 4, 3, 3\), bias \(6,\)"):  # fmt: skip
        gradhooks.kfac_precondition(net, mixed, damping=1e-3)
    by_hand = {
        "fc.weight": gradhooks.KFactors(factors["fc.weight"].A, factors["fc.weight"].G, True)
    }
    with pytest.raises(
        gradhooks.ConfigurationError, match=r"'fc.weight' cover a bias column but name no bias"
    ):
        gradhooks.kfac_precondition(net, by_hand, damping=1e-3)
    with pytest.raises(
        gradhooks.ConfigurationError, match=r"'head.weight' refer to a parameter 'head.weight' that"
    ):
        gradhooks.kfac_precondition(nn.Linear(2, 2), factors, damping=1e-3)
    for n, p in net.named_parameters():
        assert torch.equal(p.grad, before[n]), f"{n}: written by a call that raised"
    with pytest.raises(
        gradhooks.ConfigurationError, match=r"shape \(6, 36\) given to factors of a \(6, 37\)"
    ):
        inverses["conv.weight"].apply(net.conv.weight.grad.flatten(1))


def test_the_kfac_docstrings_examples_run():
    import doctest
    import importlib

    module = importlib.import_module("gradhooks.workflows.kfac")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 10 and result.failed == 0, result

"""grad1 for Linear and Conv2d models against vmap(grad) and a per-example loop."""

import pytest
import torch
from torch import nn

import gradhooks
from gradhooks.models import MLP, LeNet, SimpleCNN
from gradhooks.oracle import loop_grad
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


class EmptyParameters(nn.Module):
    """Parameters with no entries: a Linear to 0 features, and memory slots of which there
    are none (routing-transformer's ``mem_key`` of ``num_mem_kv=0``), concatenated to each
    example's rows by a module without a rule."""

    def __init__(self):
        super().__init__()
        self.a, self.empty = nn.Linear(4, 3), nn.Linear(4, 0)
        self.mem = nn.Parameter(torch.zeros(0, 3))

    def forward(self, x):
        rows = torch.cat([self.a(x)[:, None], self.mem.expand(x.shape[0], 0, 3)], 1)
        return rows.sum(1).pow(2).sum(1) + self.empty(x).sum(1)


def test_empty_parameters_get_empty_grad1():
    """Their grad1 is [batch, *shape], empty; the rule's reshape of its pieces, and the
    check's row maxima of their gradient, could not infer the batch from no entries (a
    RuleError, a RuntimeError from inside gradhooks). A DP step leaves them out."""
    torch.manual_seed(0)
    model = EmptyParameters().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    want = loop_grad(model, lambda out: out.sum(), x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        model(x).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad1.shape == (3, *p.shape), name
        torch.testing.assert_close(p.grad1, want[name], rtol=1e-7, atol=1e-12)
    model.zero_grad()
    norms = torch.cat([want[n].flatten(1) for n in want], 1).norm(dim=1)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        got = gradhooks.dp_sgd_step(h, model(x), max_norm=1.0, noise_multiplier=0.0)
    torch.testing.assert_close(got, norms, rtol=1e-7, atol=1e-12)
    factors = (1.0 / norms).clamp(max=1.0)
    torch.testing.assert_close(
        model.a.weight.grad, torch.einsum("b,b...->...", factors, want["a.weight"]) / 3
    )


class ScaledLinear(nn.Module):
    """A parameter of no dimensions (a learned scale, as local-attention's and
    tab-transformer-pytorch's), used directly by the model."""

    def __init__(self):
        super().__init__()
        self.lin, self.scale = nn.Linear(3, 2), nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return self.lin(x) * self.scale


def test_parameter_of_no_dimensions():
    torch.manual_seed(0)
    model = ScaledLinear().double()
    x = torch.randn(4, 3, dtype=torch.float64)
    want = loop_grad(model, lambda out: out.pow(2).sum(), x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        model(x).pow(2).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad1, want[name], rtol=1e-7, atol=1e-12)


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


def test_complex_linear_grad1_and_what_is_refused():
    """A complex Linear: grad1 is autograd's convention (the gradient with respect to the
    conjugate, ``g ⊗ conj(x)``), against the loop; norms and DP steps, formed for real
    parameters only, are refused with the parameter named."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3, dtype=torch.complex128))
    x = torch.randn(5, 4, dtype=torch.complex128)

    def loss(out):
        return out.abs().pow(2).sum()

    want = loop_grad(m, loss, x)
    with gradhooks.add_hooks(m, loss_reduction="sum"):
        loss(m(x)).backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad1, want[n], rtol=1e-10, atol=1e-12, msg=n)
    gradhooks.clear_grad1(m)
    with pytest.raises(
        gradhooks.ConfigurationError, match="'0.weight' is complex: quantities \\('norms',\\)"
    ):
        gradhooks.add_hooks(m, quantities=("norms",))
    with gradhooks.add_hooks(m, loss_reduction="sum") as h:
        with pytest.raises(
            gradhooks.ConfigurationError, match="dp_sgd_step: '0.weight' is complex"
        ):
            gradhooks.dp_sgd_step(h, m(x).abs().pow(2).sum(1), max_norm=1.0,
                                  noise_multiplier=0.0, method="grad1")  # fmt: skip

"""A module without a rule that returns a function beside its tensors, as hyper-connections'
``branch_input, add_residual = hc(x)`` does: the ``torch.func`` fallback recomputes such a
call one example at a time from the tensors it returns, so a tensor the function holds,
computed in the call from the module's parameters and used after the call, carries gradient
to those parameters that the recomputation never sees. Such a call is refused at the forward
with ``UnsupportedError`` naming the parameters, with the run-time check on or off (with it
off, their ``grad1`` was silently missing that share: hyper-connections' ``dynamic_beta_fn``
got zeros). A function that holds only what does not depend on them (the call's input), and
the same module with its branch called inside, match the per-example loop in float64, in a
training loop of several steps and under bfloat16 autocast."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_untouched, model_state, raised


class Mixer(nn.Module):
    """A gate computed from the input by a weight of its own (no rule: the fallback's), and
    a function that scales a branch's output by it and adds it back to the input; with
    ``branch``, that function is called inside the call. ``holds="input"``: the function
    holds the input alone, the gate applied where it is computed."""

    def __init__(self, branch: nn.Module | None = None, holds: str = "gate"):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4) * 0.5)
        self.branch, self.holds = branch, holds

    def forward(self, x):
        gate = torch.sigmoid(x @ self.w)[..., None]  # [batch, 1]
        if self.holds == "input":
            inp = x * gate

            def add(out):
                return x + out

        else:
            inp = x

            def add(out):
                return x + gate * out

        if self.branch is not None:
            return add(self.branch(inp))
        return inp, add


class Net(nn.Module):
    def __init__(self, inside: bool = False, holds: str = "gate"):
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.ff = nn.Linear(4, 4)
        self.mix = Mixer(self.ff if inside else None, holds)
        self.head = nn.Linear(4, 2)
        self.inside = inside

    def forward(self, x):
        h = self.inp(x)
        if self.inside:
            h = self.mix(h)
        else:
            a, add = self.mix(h)
            h = add(self.ff(a))
        return self.head(torch.tanh(h))


def _batch(step: int, n: int = 5):
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 3, generator=g, dtype=torch.float64), torch.randint(2, (n,), generator=g)


@pytest.mark.parametrize("verify", [True, False], ids=["checked", "unchecked"])
def test_a_returned_function_holding_a_tensor_of_the_parameters_is_refused(verify):
    torch.manual_seed(0)
    model = Net().double()
    x, y = _batch(0)
    before = model_state(model)
    with gradhooks.add_hooks(model, verify=verify):
        err = raised(
            gradhooks.UnsupportedError,
            ["'mix' (Mixer)", "returns a function", "'w'", "@gradhooks.register"],
            lambda: F.cross_entropy(model(x), y).backward(),
        )
    assert "branch" in str(err)
    assert_untouched(model, before)


@pytest.mark.parametrize("case", ["branch inside", "function holds the input"])
def test_the_same_module_matches_the_loop_in_a_training_loop(case):
    torch.manual_seed(1)
    model = (Net(inside=True) if case == "branch inside" else Net(holds="input")).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = _batch(step)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            want = loop_grad(model, F.cross_entropy, x, y)
            for name, p in model.named_parameters():
                torch.testing.assert_close(p.grad1, want[name], msg=f"{case}, {name}")
            opt.step()


def test_the_branch_inside_under_bfloat16_autocast():
    torch.manual_seed(2)
    model = Net(inside=True).double()
    x, y = _batch(0)
    want = loop_grad(model, F.cross_entropy, x, y)
    with gradhooks.add_hooks(model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.cross_entropy(model(x), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad1, want[name], rtol=0.05, atol=0.02, msg=name)


class HyperBlock(nn.Module):
    """hyper-connections' streams around a Linear branch called outside the module."""

    def __init__(self, get):
        super().__init__()
        init, self.expand, self.reduce = get(4, dim=8, add_stream_embed=True)
        self.inp, self.hc, self.ff = nn.Linear(3, 8), init(), nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        a, add = self.hc(self.expand(self.inp(x)))
        return self.head(self.reduce(add(self.ff(a))).mean(1))


@pytest.mark.parametrize("kind", ["hyper-connections", "manifold-constrained"])
def test_hyper_connections_with_the_branch_outside_is_refused_without_the_check(kind):
    """hyper-connections' own modules, as their README calls them with the branch outside:
    refused with verify=False too, naming the mixing weights, nothing written."""
    hc = pytest.importorskip("hyper_connections")
    get = (hc.get_init_and_expand_reduce_stream_functions if kind == "hyper-connections"
           else hc.mc_get_init_and_expand_reduce_stream_functions)  # fmt: skip
    torch.manual_seed(0)
    model = HyperBlock(get).double()
    x = torch.randn(3, 5, 3, dtype=torch.float64)
    with gradhooks.add_hooks(model, verify=False):
        err = raised(gradhooks.UnsupportedError, ["'hc'", "dynamic_beta_fn"],
                     lambda: model(x).sum().backward())  # fmt: skip
    assert "returns a function" in str(err)
    assert not any(hasattr(p, "grad1") for p in model.parameters())

"""A module without a rule whose call lets a tensor of its parameters out other than as a
returned tensor: held by a function it returns, as hyper-connections' ``branch_input,
add_residual = hc(x)`` does, or set on the module (an auxiliary loss kept as
``self.aux_loss``, a list of them, a buffer, a plain object of statistics). The ``torch.func`` fallback recomputes such a call one
example at a time from the tensors it returns, so a gradient that reaches the parameters
through that tensor is never seen by the recomputation. A backward that reaches it is refused
with ``UnsupportedError`` naming the module and the parameters, with the run-time check on or
off (with it off, their ``grad1`` silently missed that share: hyper-connections'
``dynamic_beta_fn`` got zeros), leaving the model untouched. Where no gradient flows through
it (attention weights kept on the module for a look), where the function holds only the
call's input, where a cell called again keeps its earlier calls' outputs, and with the branch
called inside, ``grad1`` matches the per-example loop in
float64, in a training loop of several steps and under bfloat16 autocast."""

from __future__ import annotations

import types

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
            ["'mix' (Mixer)", "a function it returns holds it", "'w'", "@gradhooks.register"],
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


class Gate(nn.Module):
    """A gate without a rule that keeps its logits' squared sum on itself (``kept="loss"``),
    in a list (``"list"``), in a buffer registered empty (``"buffer"``) or on a plain object
    of statistics (``"stats"``), added to the loss by the training loop, or its gate values
    for a look only (``"look"``, never in the loss)."""

    def __init__(self, kept: str):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4) * 0.5)
        self.kept, self.logits = kept, []
        self.stats = types.SimpleNamespace(aux_loss=None)
        self.register_buffer("aux_buffer", None, persistent=False)

    def forward(self, x):
        logits = torch.einsum("bd,de->be", x, self.w)
        gate = torch.sigmoid(logits)
        if self.kept == "loss":
            self.aux_loss = (logits**2).sum()
        elif self.kept == "list":
            self.logits.append((logits**2).sum())
        elif self.kept == "buffer":
            self.aux_buffer = (logits**2).sum()
        elif self.kept == "stats":
            self.stats.aux_loss = (logits**2).sum()
        else:
            self.seen = gate
        return x * gate


class GatedNet(nn.Module):
    def __init__(self, kept: str):
        super().__init__()
        self.inp, self.gate, self.head = nn.Linear(3, 4), Gate(kept), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.gate(self.inp(x)))

    def loss(self, out, y):
        loss = F.cross_entropy(out, y, reduction="sum")
        if self.gate.kept == "loss":
            return loss + 0.1 * self.gate.aux_loss
        if self.gate.kept == "list":
            return loss + 0.1 * self.gate.logits.pop()
        if self.gate.kept == "buffer":
            return loss + 0.1 * self.gate.aux_buffer
        if self.gate.kept == "stats":
            return loss + 0.1 * self.gate.stats.aux_loss
        return loss


@pytest.mark.parametrize("kept", ["loss", "list", "buffer", "stats"])
@pytest.mark.parametrize("verify", [True, False], ids=["checked", "unchecked"])
def test_an_auxiliary_loss_kept_on_the_module_is_refused_at_the_backward(kept, verify):
    torch.manual_seed(3)
    model = GatedNet(kept).double()
    x, y = _batch(0)
    before = model_state(model)
    with gradhooks.add_hooks(model, verify=verify, loss_reduction="sum"):
        out = model(x)
        raised(gradhooks.UnsupportedError, ["'gate' (Gate)", "set on the module", "'w'"],
               lambda: model.loss(out, y).backward())  # fmt: skip
    assert_untouched(model, before)


def test_gate_values_kept_for_a_look_leave_grad1_as_the_loop_gives_it():
    torch.manual_seed(4)
    model = GatedNet("look").double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for step in range(3):
            x, y = _batch(step)
            opt.zero_grad()
            model.loss(model(x), y).backward()
            want = loop_grad(model, model.loss, x, y)
            for name, p in model.named_parameters():
                torch.testing.assert_close(p.grad1, want[name], msg=name)
            opt.step()


class Cell(nn.Module):
    """A recurrent cell without a rule that keeps what each of its calls computes in a list:
    its output (``keeps="outputs"``), or its gate values for a look (``"gates"``)."""

    def __init__(self, keeps: str):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4) * 0.5)
        self.keeps, self.kept = keeps, []

    def forward(self, h):
        out = torch.tanh(torch.einsum("bd,de->be", h, self.w))
        if self.keeps == "gates":
            gate = torch.sigmoid(h @ self.w)
            self.kept.append(gate)
            return out * gate
        self.kept.append(out)
        return out


class Unrolled(nn.Module):
    def __init__(self, keeps: str):
        super().__init__()
        self.inp, self.cell, self.head = nn.Linear(3, 4), Cell(keeps), nn.Linear(4, 2)

    def forward(self, x):
        self.cell.kept.clear()
        h = self.inp(x)
        for _ in range(3):
            h = self.cell(h)
        return self.head(h)


@pytest.mark.parametrize("keeps", ["outputs", "gates"])
@pytest.mark.parametrize("verify", [True, False], ids=["checked", "unchecked"])
def test_a_cell_called_again_keeping_its_earlier_calls_tensors_matches_the_loop(keeps, verify):
    """What the cell's earlier calls kept in its list (their outputs, on the way to the next
    call's input) is not a tensor the later call let out: ``grad1`` matches the loop."""
    torch.manual_seed(5)
    model = Unrolled(keeps).double()
    x, y = _batch(0)
    want = loop_grad(model, F.cross_entropy, x, y)
    with gradhooks.add_hooks(model, verify=verify):
        F.cross_entropy(model(x), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad1, want[name], msg=name)


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
    refused with verify=False too, naming the mixing weights, nothing written (their
    ``dynamic_beta_fn`` got a grad1 of zeros)."""
    hc = pytest.importorskip("hyper_connections")
    get = (hc.get_init_and_expand_reduce_stream_functions if kind == "hyper-connections"
           else hc.mc_get_init_and_expand_reduce_stream_functions)  # fmt: skip
    torch.manual_seed(0)
    model = HyperBlock(get).double()
    x = torch.randn(3, 5, 3, dtype=torch.float64)
    with gradhooks.add_hooks(model, verify=False):
        err = raised(gradhooks.UnsupportedError, ["'hc'", "'dynamic_"],
                     lambda: model(x).sum().backward())  # fmt: skip
    assert "other than as a returned tensor" in str(err)
    assert not any(hasattr(p, "grad1") for p in model.parameters())


@pytest.mark.parametrize("method", ["grad1", "bookkeeping", "ghost"])
@pytest.mark.parametrize("case", ["returned function", "auxiliary loss"])
def test_a_dp_step_through_a_kept_tensor_is_refused_leaving_the_model_untouched(case, method):
    torch.manual_seed(5)
    model = (Net() if case == "returned function" else GatedNet("loss")).double()
    x, y = _batch(0)
    before = model_state(model)
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        per_example = F.cross_entropy(model(x), y, reduction="none")
        if case == "auxiliary loss":
            per_example = per_example + 0.1 * model.gate.aux_loss / len(y)
        raised(gradhooks.UnsupportedError, ["a module without a rule", "'w'"],
               lambda: gradhooks.dp_sgd_step(h, per_example, max_norm=1.0, noise_multiplier=0.0,
                                             method=method))  # fmt: skip
    assert_untouched(model, before)

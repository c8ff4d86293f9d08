"""PyTorch features that touch a hooked model's parameters or its graph: ``functional_call``,
parametrizations in training mode, conversions that swap parameters (``swap_tensors``), nested
tensors and ``torch.compile``. Each gives ``grad1`` equal to the float64 per-example loop, or
is refused with an error naming the module and what to do."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_close, sq

D = torch.float64


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()


def x_of(batch: int = 4) -> torch.Tensor:
    return torch.randn(batch, 3, dtype=D, generator=torch.Generator().manual_seed(1))


def assert_grad1(model: nn.Module, want: dict, what: str) -> None:
    for n, p in model.named_parameters():
        assert hasattr(p, "grad1"), f"{what}: '{n}' has no grad1"
        assert_close(p.grad1, want[n], f"{what}: {n}")


# -- conversions that swap the parameters (swap_tensors) -----------------------------------------


@pytest.fixture
def swapping():
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


CONVERSIONS = {
    ".double()": lambda m: m.double(),
    ".to(float64)": lambda m: m.to(torch.float64),
    ".half().double()": lambda m: m.half().double(),
    ".float() of float32": lambda m: m.float(),  # (swapped too, same dtype and memory)
    ".cpu()": lambda m: m.cpu(),
}


@pytest.mark.parametrize("swap", [True, False], ids=["swap_tensors", "set .data"])
@pytest.mark.parametrize("convert", list(CONVERSIONS), ids=list(CONVERSIONS))
def test_conversion_after_add_hooks(convert, swap):
    """With torch.__future__.set_swap_module_params_on_conversion(True), a conversion puts
    another tensor under each parameter's Python object (torch.utils.swap_tensors), which
    loses the gradient hooks registered on it: before, grad1 was silently left out (the
    backward looked like one for the inputs only). The parameters the user holds get grad1."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
        held = list(model.parameters())
        with gradhooks.add_hooks(model, loss_reduction="sum") as h:
            CONVERSIONS[convert](model)
            x = x_of().to(held[0].dtype)
            for _ in range(2):  # (and again, hooked as they are now)
                h.clear()
                sq(model(x)).backward()
                assert [p is q for p, q in zip(model.parameters(), held)] == [True] * 4
                want = loop_grad(model, sq, x)
                assert_grad1(model, want, convert)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def test_swapped_parameter_hooks_are_added_again_once(swapping):
    """After the swap the parameter is hooked again (a backward hook the user adds after the
    swap fires too), and its gradient is counted once."""
    model = mlp().float()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        model.double()
        x = x_of()
        sq(model(x)).backward()
        fired = []
        model[0].weight.register_hook(fired.append)
        gradhooks.hooks_of(model).clear()
        model.zero_grad()
        sq(model(x)).backward()
    assert fired, "a hook added after the swap never fired"
    assert_close(fired[-1], model[0].weight.grad, "the hook's gradient")
    want = loop_grad(model, sq, x)
    assert_grad1(model, want, "second step")
    assert_close(model[0].weight.grad1.sum(0), model[0].weight.grad, ".grad")


# -- nested tensors -----------------------------------------------------------------------------


def jagged() -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    rows = [torch.randn(n, 3, dtype=D, generator=g) for n in (2, 3, 1)]
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


class Nests(nn.Module):
    """Makes a nested tensor of its dense input inside its forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2).double()

    def forward(self, x):
        nt = torch.nested.as_nested_tensor([x[0, :2], x[1]], layout=torch.jagged)
        return self.lin(nt)


@pytest.mark.parametrize("batch_dim", ["auto", 0, None])
def test_nested_tensor_input_is_refused(batch_dim):
    model = mlp()
    with gradhooks.add_hooks(model, loss_reduction="sum", batch_dim=batch_dim) as h:
        with pytest.raises(ValueError, match=r"'Sequential' \(the model\).*nested.*to_padded"):
            model(jagged())
        with h.paused():  # (runs, without grad1)
            out = model(jagged())
            assert out.is_nested
        x = x_of()  # the handle goes on as before
        sq(model(x)).backward()
    assert_grad1(model, loop_grad(model, sq, x), "after the refusal")


def test_nested_tensor_made_inside_the_model_is_refused():
    model = Nests()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with pytest.raises(ValueError, match=r"'lin' \(Linear\).*nested tensor"):
            model(torch.randn(2, 4, 3, dtype=D))


def test_nested_multihead_attention_is_refused():
    mha = nn.MultiheadAttention(3, 1, batch_first=True).double()
    nt = jagged()
    with gradhooks.add_hooks(mha, loss_reduction="sum"):
        with pytest.raises(ValueError, match=r"'MultiheadAttention' \(the model\).*nested"):
            mha(nt, nt, nt, need_weights=False)


# -- parametrizations in training mode ----------------------------------------------------------

PARAMETRIZATIONS = {
    "spectral_norm": lambda m: nn.utils.parametrizations.spectral_norm(m),
    "orthogonal": lambda m: nn.utils.parametrizations.orthogonal(m),
    "weight_norm": lambda m: nn.utils.parametrizations.weight_norm(m),
}


def per_example_from(model: nn.Module, x: torch.Tensor) -> dict:
    """The float64 loop, each example from a copy of ``model`` as it is now (training mode:
    spectral_norm's power iteration then starts from the same buffers for every example)."""
    rows: dict[str, list] = {n: [] for n, _ in model.named_parameters()}
    for i in range(x.shape[0]):
        one = copy.deepcopy(model)
        sq(one(x[i : i + 1])).backward()
        for n, p in one.named_parameters():
            rows[n].append(p.grad)
    return {n: torch.stack(r) for n, r in rows.items()}


@pytest.mark.parametrize("when", ["before", "after"], ids=["registered before", "after add_hooks"])
@pytest.mark.parametrize("kind", list(PARAMETRIZATIONS))
def test_parametrization_in_training_mode(kind, when):
    """grad1 of parametrizations.weight.original (original0/original1 for weight_norm) equals
    the loop, and the buffers (spectral_norm's _u and _v, advanced once per forward in
    training) are left as a plain step leaves them: the fallback recomputes the
    parametrization from copies of the buffers as its call found them. Before, spectral_norm
    was refused (its recomputation ran the power iteration again, from the advanced buffers,
    and advanced them once more)."""
    model = mlp()
    if when == "before":
        PARAMETRIZATIONS[kind](model[0])
    model.train()
    x = x_of(5)
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        if when == "after":
            PARAMETRIZATIONS[kind](model[0])
        for step in range(2):  # (the buffers advance at each step, as plain training's)
            want = per_example_from(model, x)
            plain = copy.deepcopy(model)
            with h.paused():
                sq(plain(x)).backward()
            h.clear()
            model.zero_grad()
            sq(model(x)).backward()
            assert_grad1(model, want, f"{kind} {when}, step {step}")
            names = {n for n, _ in model.named_parameters()}
            assert {"0.parametrizations.weight.original"} <= names or kind == "weight_norm"
            for (n, b), (_, c) in zip(model.named_buffers(), plain.named_buffers()):
                assert torch.equal(b, c), f"{kind} {when}: buffer {n} differs from a plain step"
            for (n, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
                assert_close(p.grad, q.grad, f"{kind} {when}: .grad of {n}")


class Counts(nn.Module):
    """No rule: counts its calls in a buffer, and scales by a buffer it updates in place."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3, dtype=D) / 3)
        self.register_buffer("calls", torch.zeros((), dtype=D))
        self.register_buffer("scale", torch.ones(3, dtype=D))

    def forward(self, x):
        if self.training:
            self.calls += 1
            self.scale.mul_(0.5)
        return x @ torch.linalg.matrix_exp(self.w * self.scale)


def test_fallback_module_changing_its_buffers():
    """The fallback recomputes from the buffers as the call found them (not those its forward
    left): grad1 right, and the buffers changed once per forward, as without hooks."""
    torch.manual_seed(0)
    model = Counts()
    x = x_of()
    want = per_example_from(model, x)
    plain = copy.deepcopy(model)
    sq(plain(x)).backward()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(x)).backward()
    assert_grad1(model, want, "Counts")
    assert float(model.calls) == 1.0
    for (n, b), (_, c) in zip(model.named_buffers(), plain.named_buffers()):
        assert torch.equal(b, c), f"buffer {n} differs from a plain step"

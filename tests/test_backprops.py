"""``add_hooks(model, keep_backprops=True)``: ``Hooks.activations(module)`` and
``Hooks.backprops(module)`` against autograd-hacks' definition of ``layer.activations`` (the
input its forward hook saw) and ``layer.backprops_list`` (the output-gradient its backward hook
saw, appended at each backward), implemented here on a twin model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks


class AutogradHacks:
    """autograd-hacks' two hooks, recording into this object rather than onto the layers."""

    def __init__(self, model: nn.Module, layers: list[nn.Module]) -> None:
        self.activations: dict[int, torch.Tensor] = {}
        self.backprops: dict[int, list[torch.Tensor]] = {}
        for layer in layers:
            layer.register_forward_hook(self._forward)
            layer.register_full_backward_hook(self._backward)

    def _forward(self, layer, inputs, output):
        self.activations[id(layer)] = inputs[0].detach()

    def _backward(self, layer, grad_input, grad_output):
        self.backprops.setdefault(id(layer), []).append(grad_output[0].detach())


class Twice(nn.Module):
    """A Linear called twice in one forward (autograd-hacks' own hooks see both calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(torch.tanh(self.fc(x)))))


def models():
    torch.manual_seed(0)
    yield "mlp", nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)), (5, 4)
    yield (
        "conv",
        nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 2 * 2, 3)),
        (5, 2, 4, 4),
    )
    yield "called twice", Twice(), (5, 4)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(
    "name, model, shape", list(models()), ids=lambda v: v if isinstance(v, str) else ""
)
def test_activations_and_backprops_are_autograd_hacks(name, model, shape, reduction):
    twin = copy.deepcopy(model)
    layers = [m for m in model.modules() if list(m.parameters(recurse=False))]
    twin_layers = [m for m in twin.modules() if list(m.parameters(recurse=False))]
    hacks = AutogradHacks(twin, twin_layers)
    h = gradhooks.add_hooks(model, loss_reduction=reduction, keep_backprops=True)
    for step in range(2):  # two backwards: one entry more each
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(step))
        y = torch.tensor([0, 1, 2, 0, 1])
        F.cross_entropy(model(x), y, reduction=reduction).backward()
        F.cross_entropy(twin(x), y, reduction=reduction).backward()
        for layer, ref in zip(layers, twin_layers, strict=True):
            assert torch.equal(h.activations(layer), hacks.activations[id(ref)]), name
            got, want = h.backprops(layer), hacks.backprops[id(ref)]
            assert len(got) == len(want) == (step + 1) * (2 if name == "called twice" and
                                                         layer is model.fc else 1)  # fmt: skip
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=0, atol=0)
    h.clear()  # autograd-hacks' clear_backprops
    with pytest.raises(gradhooks.StateError, match="no captured backward"):
        h.backprops(layers[0])
    h.remove()
    assert not any(hasattr(m, "activations") or hasattr(m, "backprops_list")
                   for m in model.modules()), "nothing parked on the modules"  # fmt: skip


def test_backprops_need_keep_backprops_and_a_hooked_module():
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh())
    with gradhooks.add_hooks(model) as h:
        model(torch.randn(2, 4)).sum().backward()
        with pytest.raises(gradhooks.StateError, match="keep_backprops=True"):
            h.activations(model[0])
    with gradhooks.add_hooks(model, keep_backprops=True) as h:
        model(torch.randn(2, 4)).sum().backward()
        with pytest.raises(gradhooks.ConfigurationError, match="not a module this handle hooks"):
            h.backprops(model[1])
        assert h.activations(model[0]).shape == (2, 4)

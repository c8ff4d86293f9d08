"""The rule registry: user rules, duplicates, uncovered parameters, every rule file registered."""

import importlib

import pytest
import torch
from torch import nn

import gradhooks
from gradhooks.rules import RULE_MODULES
from harness import Case, check


class Scale(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x):
        return x * self.scale


def scale_rule(call):
    (x,) = call.inputs
    g = call.grad_output
    per_example = (x * g).reshape(x.shape[0], -1, x.shape[-1]).sum(1)
    return {"scale": gradhooks.Direct(per_example)}


@pytest.fixture
def registry():
    reg = gradhooks.Registry()
    reg._rules.update(gradhooks.REGISTRY._rules)
    return reg


def test_user_rule_is_used_like_a_builtin(registry):
    registry.register(Scale)(scale_rule)
    case = Case(
        "scale", lambda: nn.Sequential(nn.Linear(3, 4), Scale(4)), lambda b: torch.randn(b, 2, 3)
    )
    for reduction in ("mean", "sum"):
        check(case, batch=3, reduction=reduction, registry=registry)
    assert gradhooks.check_rule(Scale(4), torch.randn(5, 4), registry=registry).ok


def test_check_rule_reports_a_wrong_rule(registry):
    def wrong(call):
        return {"scale": gradhooks.Direct(2 * scale_rule(call)["scale"].value)}

    registry.register(Scale)(wrong)
    report = gradhooks.check_rule(
        Scale(4), torch.randn(5, 4), registry=registry, raise_on_mismatch=False
    )
    assert not report.ok and "scale (sum)" in report.failures
    with pytest.raises(AssertionError, match="scale"):
        gradhooks.check_rule(Scale(4), torch.randn(5, 4), registry=registry)


def test_registering_twice_needs_overwrite(registry):
    registry.register(Scale)(scale_rule)
    with pytest.raises(ValueError, match="already registered"):
        registry.register(Scale)(scale_rule)
    registry.register(Scale, overwrite=True)(scale_rule)


def test_uncovered_parameter_is_an_error_naming_the_module():
    model = nn.Sequential(nn.Linear(3, 4), Scale(4))
    with pytest.raises(TypeError, match=r"'1' \(Scale\): scale"):
        gradhooks.add_hooks(model, unsupported="error")
    assert all(not m._forward_hooks for m in model.modules()), "the model must be untouched"


def test_skip_leaves_uncovered_parameters_without_grad1():
    model = nn.Sequential(nn.Linear(3, 4), Scale(4))
    with gradhooks.add_hooks(model, unsupported="skip"):
        model(torch.randn(2, 3)).sum().backward()
    assert model[0].weight.grad1.shape == (2, 4, 3)
    assert not hasattr(model[1].scale, "grad1")


def test_frozen_uncovered_parameters_are_fine():
    model = nn.Sequential(nn.Linear(3, 4), Scale(4))
    model[1].scale.requires_grad_(False)
    with gradhooks.add_hooks(model):
        model(torch.randn(2, 3)).sum().backward()


def test_subclass_overriding_forward_does_not_inherit_the_rule():
    class Doubled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    class Renamed(nn.Linear):
        pass

    assert gradhooks.is_supported(Renamed(2, 2))
    assert not gradhooks.is_supported(Doubled(2, 2))


def test_every_rule_file_registers_a_rule():
    registered = {entry.rule.__module__ for entry in gradhooks.REGISTRY._rules.values()}
    for name in RULE_MODULES:
        module = importlib.import_module(f"gradhooks.rules.{name}")
        assert module.__name__ in registered, f"rules/{name}.py registers no rule"

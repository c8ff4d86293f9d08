"""The rule registry: user rules, duplicates, uncovered parameters, every rule file registered."""

import importlib
import inspect

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
    reg._names.update(gradhooks.REGISTRY._names)
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
    with pytest.raises(gradhooks.CheckFailedError, match="scale"):
        gradhooks.check_rule(Scale(4), torch.randn(5, 4), registry=registry)


def test_registering_twice_needs_overwrite(registry):
    registry.register(Scale)(scale_rule)
    with pytest.raises(gradhooks.ConfigurationError):
        registry.register(Scale)(scale_rule)
    registry.register(Scale, overwrite=True)(scale_rule)


def test_uncovered_parameter_is_an_error_naming_the_module():
    model = nn.Sequential(nn.Linear(3, 4), Scale(4))
    with pytest.raises(gradhooks.UnsupportedModuleError, match=r"'1' \(Scale\): scale"):
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
    entries = [*gradhooks.REGISTRY._rules.values(), *gradhooks.REGISTRY._names.values()]
    registered = {entry.rule.__module__ for entry in entries}
    for name in RULE_MODULES:
        module = importlib.import_module(f"gradhooks.rules.{name}")
        assert module.__name__ in registered, f"rules/{name}.py registers no rule"


def test_owns_backward_needs_grad_from_grad1(registry):
    with pytest.raises(gradhooks.ConfigurationTypeError):
        registry.register(Scale, owns_backward=lambda m: None)(scale_rule)
    with pytest.raises(gradhooks.ConfigurationTypeError):
        registry.register(Scale, grad_from_grad1=lambda m, a: True, owns_backward=1)(scale_rule)
    assert Scale not in registry


def test_detach_without_grads_needs_grad_from_grad1_and_a_function(registry):
    with pytest.raises(gradhooks.ConfigurationTypeError, match="needs grad_from_grad1"):
        registry.register(Scale, detach_without_grads=lambda m, a: True)(scale_rule)
    with pytest.raises(gradhooks.ConfigurationTypeError, match="takes a function"):
        registry.register(Scale, grad_from_grad1=lambda m, a: False, detach_without_grads=True)(
            scale_rule
        )
    assert Scale not in registry


def test_recorded_reaches_the_rule_of_a_call_run_with_grad_mode_off(registry):
    """A rule that owns its backward, with a recording: its context manager is entered around the call's
    forward and left at its end, and what it gave is the rule's call.recorded."""
    seen = {}

    class Recording:
        def __init__(self, module):
            self.module = module

        def __enter__(self):
            seen["entered"] = True
            return self

        def __exit__(self, *exc):
            seen["left"] = True

    def rule(call):
        seen["recorded"] = call.recorded
        (x,) = call.inputs
        call.input_grads.append(call.grad_output * call.module.scale)
        return scale_rule(call)

    registry.register(
        Scale, overwrite=True, grad_from_grad1=lambda m, a: True, owns_backward=Recording,
    )(rule)  # fmt: skip
    model = Scale(3).double()
    x = torch.randn(4, 3, dtype=torch.double, requires_grad=True)
    with gradhooks.add_hooks(model, loss_reduction="sum", registry=registry):
        y = model(x)
        assert seen == {"entered": True, "left": True}
        assert type(y.grad_fn).__name__ == "_JoinBackward"  # run with grad mode off
        (y**2).sum().backward()
    assert isinstance(seen["recorded"], Recording) and seen["recorded"].module is model
    want = 2 * x.detach() * model.scale.detach() ** 2
    torch.testing.assert_close(x.grad, want)
    torch.testing.assert_close(model.scale.grad1, 2 * x.detach() ** 2 * model.scale.detach())


def test_owns_backward_without_input_grads_leaves_them_to_autograd(registry):
    """owns_backward=True, the rule giving its pieces only: the call runs with grad mode off,
    and the input's gradient comes from autograd through the forward run again. Against the
    unhooked module's autograd and a per-example loop, in float64."""
    registry.register(Scale, overwrite=True, grad_from_grad1=lambda m, a: True, owns_backward=True)(
        scale_rule
    )
    model = Scale(3).double()
    x = torch.randn(5, 2, 3, dtype=torch.double)
    plain = x.clone().requires_grad_()
    (model(plain) ** 3).sum().backward()
    want_scale = model.scale.grad.clone()
    want1 = gradhooks.oracle.loop_grad(model, lambda out: (out**3).sum(), x)["scale"]
    model.zero_grad()
    hooked = x.clone().requires_grad_()
    with gradhooks.add_hooks(model, loss_reduction="sum", registry=registry):
        y = model(hooked)
        assert type(y.grad_fn).__name__ == "_JoinBackward"  # run with grad mode off
        (y**3).sum().backward()
    torch.testing.assert_close(hooked.grad, plain.grad)
    torch.testing.assert_close(model.scale.grad, want_scale)
    torch.testing.assert_close(model.scale.grad1, want1)


def test_registry_reads_short_in_add_hooks_signature(registry):
    """The default registry is a default argument of add_hooks: help(add_hooks) shows its repr
    in the signature, which must stay one short line, not every rule."""
    sig = str(inspect.signature(gradhooks.add_hooks))
    n = len(gradhooks.REGISTRY.types()) + len(gradhooks.REGISTRY.names())
    assert f"registry: 'Registry' = Registry(rules for {n} module types)" in sig, sig
    assert len(sig) < 400, f"add_hooks' signature is {len(sig)} characters: {sig}"
    registry.register(Scale)(scale_rule)
    assert repr(registry) == f"Registry(rules for {n + 1} module types)"
    assert repr(gradhooks.Registry()) == "Registry(rules for 0 module types)"


class _OwnPiece(gradhooks.Piece):
    """A piece of a user's own: only ``batch_size`` and ``grad1``."""

    def __init__(self, value):
        self.value = value

    @property
    def batch_size(self):
        return self.value.shape[0]

    def grad1(self, param_shape, scale=1.0):
        return (self.value * scale).reshape(self.batch_size, *param_shape)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_piece_of_your_own_needs_only_batch_size_and_grad1(registry, reduction):
    """Every quantity comes from the base class's defaults: grad1, norms, squared sums and the
    checks of the backward, against the oracles; Scale is called twice (its pieces added)."""
    from gradhooks.oracle import vmap_grad

    registry.register(Scale)(lambda call: {"scale": _OwnPiece(scale_rule(call)["scale"].value)})

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.s = nn.Linear(3, 4), Scale(4)

        def forward(self, x):
            return self.s(torch.tanh(self.s(self.lin(x))))

    torch.manual_seed(0)
    model = Twice().double()
    x = torch.randn(5, 2, 3, dtype=torch.float64)

    def one(out):
        return out.pow(2).sum()

    want = vmap_grad(model, one, x)
    quantities = ("grad1", "norms", "sum_grad_sq")
    hooks = gradhooks.add_hooks(model, reduction, registry=registry, quantities=quantities)
    with hooks as h:
        out = model(x).pow(2).sum()
        (out / 5 if reduction == "mean" else out).backward()
        norms, sums = h.param_norms(), h.sum_grad_sq()
    g = want["s.scale"]
    torch.testing.assert_close(model.s.scale.grad1, g)
    torch.testing.assert_close(norms["s.scale"], g.norm(dim=1))
    torch.testing.assert_close(sums["s.scale"], g.square().sum(0))

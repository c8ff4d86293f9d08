"""Misuse of the public entry points, one by one: each mistake stops with a gradhooks error that
names what was wrong (the function, the argument, the shapes) and what to do, before anything
changed: the model keeps no hook and no attribute of gradhooks', its parameters are as they
were, and it trains without gradhooks afterwards. A mistake that gave a number (a factor taken
as another, a NaN, an empty result read as "nothing to report") is refused as well."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks

HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(n: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_left_alone(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    """No hook of gradhooks' on any module or parameter, no attribute added to a parameter,
    the weights as they were, and a plain SGD step still trains the model."""
    for name, m in model.named_modules():
        for kind in HOOKS:
            assert not getattr(m, kind), f"{name or '<model>'} keeps {kind}"
    for name, p in model.named_parameters():
        assert not p._backward_hooks, f"{name} keeps a tensor hook"
        assert not getattr(p, "_post_accumulate_grad_hooks", None), name
        assert "grad1" not in p.__dict__, f"{name} keeps grad1"
    for k, v in model.state_dict().items():
        assert torch.equal(before[k], v), f"{k} changed"
    x, y = _batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    assert F.cross_entropy(model(x), y) < loss, "the model no longer trains"


def raised(error: type[Exception], says: str, call) -> Exception:
    """``call()`` raises ``error`` whose message contains ``says``."""
    with pytest.raises(error, match=re.escape(says)) as info:
        call()
    assert isinstance(info.value, gradhooks.GradhooksError)
    return info.value


# -- K-FAC --------------------------------------------------------------------------------------


def test_kfac_factors_refuse_a_reduction_they_do_not_know():
    """``h.kfac_factors("avg")`` (and ``kfac(..., reduction="avg")``) took any word but
    ``"mean"`` as ``"sum"``: ``G`` ``batch`` times too large, silently."""
    model, (x, y) = _mlp(), _batch()
    with gradhooks.add_hooks(model, quantities=("kfac",)) as h:
        F.cross_entropy(model(x), y).backward()
        mean = h.kfac_factors("mean")["2.weight"].G
        raised(
            gradhooks.ConfigurationError, "reduction must be 'mean'", lambda: h.kfac_factors("avg")
        )
        assert torch.equal(h.kfac_factors()["2.weight"].G, mean)  # (nothing consumed)
    model.zero_grad()
    before = _snapshot(model)
    raised(
        gradhooks.ConfigurationError,
        "got 'avg'",
        lambda: gradhooks.kfac(model, x, y, reduction="avg"),
    )
    assert_left_alone(model, before)


@pytest.mark.parametrize(
    "make, error, says",
    [
        (lambda m: gradhooks.KFAC(list(m.parameters()), torch.optim.SGD(m.parameters(), lr=0.1)),
         gradhooks.ConfigurationTypeError, "KFAC takes the model (an nn.Module), got list"),
        (lambda m: gradhooks.KFAC(m, torch.optim.SGD(m.parameters(), lr=0.1), fisher="fisher"),
         gradhooks.ConfigurationError, "fisher must be 'mc', 'exact' or 'empirical', got 'fisher'"),
        (lambda m: gradhooks.KFAC(m, torch.optim.SGD(m.parameters(), lr=0.1), loss="nll"),
         gradhooks.ConfigurationError, "loss must be 'cross_entropy', 'mse'"),
        (lambda m: gradhooks.KFAC(m, torch.optim.SGD(_mlp().parameters(), lr=0.1)),
         gradhooks.ConfigurationError, "the optimizer steps no parameter of the model (Sequential)"),
        (lambda m: gradhooks.kfac(nn.Linear(4, 3).requires_grad_(False), _batch()[0]),
         gradhooks.ConfigurationError, "Linear has no trainable parameter"),
    ],
    ids=["parameter-list", "fisher-unknown", "loss-unknown", "optimizer-of-another-model",
         "frozen-model"],
)  # fmt: skip
def test_kfac_arguments_are_checked_when_given(make, error, says):
    """The K-FAC optimizer took a parameter list, an unknown ``fisher`` or ``loss`` and an
    optimizer of another model without a word (the first step then failed inside, or stepped
    nothing of the model); ``kfac`` of a frozen model failed inside ``torch.autograd.grad``."""
    model = _mlp()
    before = _snapshot(model)
    raised(error, says, lambda: make(model))
    assert_left_alone(model, before)


# -- the handle ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "read, quantity",
    [
        (lambda h: h.param_norms(), "norms"),
        (lambda h: h.sum_grad_sq(), "sum_grad_sq"),
        (lambda h: h.grad_variance(), "sum_grad_sq"),
        (lambda h: h.kfac_factors(), "kfac"),
    ],
    ids=["param_norms", "sum_grad_sq", "grad_variance", "kfac_factors"],
)
def test_results_read_before_a_backward_are_refused(read, quantity):
    """Read before the backward (or after ``clear()``) these gave ``{}``, which a loop over
    them takes for "no parameter to report"; ``norms()`` already refused. Now each says that
    no backward was captured; after one, each gives every parameter."""
    model, (x, y) = _mlp(), _batch()
    with gradhooks.add_hooks(model, quantities=(quantity,)) as h:
        raised(gradhooks.StateError, "no backward has been captured", lambda: read(h))
        F.cross_entropy(model(x), y).backward()
        assert read(h)
        h.clear()
        raised(gradhooks.StateError, f"no {quantity!r} to read", lambda: read(h))


def test_rescale_after_remove_is_refused():
    """``h.rescale("sum")`` after ``remove()`` changed the setting and left the ``grad1`` on
    the parameters as it was (what the backward wrote is forgotten at removal): a factor of
    ``batch`` off, silently."""
    model, (x, y) = _mlp(), _batch()
    with gradhooks.add_hooks(model) as h:
        F.cross_entropy(model(x), y, reduction="sum").backward()
    kept = model[0].weight.grad1.clone()
    raised(
        gradhooks.StateError,
        "call rescale (or compute_grad1) before remove()",
        lambda: h.rescale("sum"),
    )
    assert torch.equal(model[0].weight.grad1, kept) and h.loss_reduction == "mean"


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"registry": "default"}, "registry must be a gradhooks.Registry"),
        ({"registry": None}, "got NoneType"),
        ({"quantities": None}, "quantities takes a name or a tuple of names"),
        ({"quantities": 2}, "got int 2"),
        ({"verify": "no"}, "verify takes True or False, got str 'no'"),
        ({"verify": None}, "verify takes True or False, got NoneType None"),
        ({"keep_backprops": "yes"}, "keep_backprops takes True or False"),
    ],
    ids=["registry-str", "registry-none", "quantities-none", "quantities-int", "verify-str",
         "verify-none", "keep-backprops-str"],
)  # fmt: skip
def test_add_hooks_settings_of_the_wrong_type(kwargs, says):
    """A string for a flag was taken by its truth (``verify="no"`` verified); a registry or
    quantities of the wrong type failed inside the planning with an ``AttributeError`` or a
    ``TypeError`` naming neither."""
    model = _mlp()
    before = _snapshot(model)
    raised(gradhooks.ConfigurationTypeError, says, lambda: gradhooks.add_hooks(model, **kwargs))
    assert_left_alone(model, before)


def test_settings_changed_on_the_handle_are_checked():
    """``h.verify``, ``h.registry`` and ``h.quantities`` were set unchecked: ``h.quantities``
    changed the name and not what the hooks compute (``h.norms()`` then said the handle did not
    compute norms, with ``quantities=('norms',)`` in the message)."""
    model, (x, y) = _mlp(), _batch()
    with gradhooks.add_hooks(model) as h:
        raised(
            gradhooks.ConfigurationTypeError,
            "verify takes True or False",
            lambda: setattr(h, "verify", "no"),
        )
        raised(
            gradhooks.ConfigurationTypeError,
            "registry must be",
            lambda: setattr(h, "registry", None),
        )
        raised(
            gradhooks.ConfigurationError,
            "quantities are chosen when the hooks are added",
            lambda: setattr(h, "quantities", ("norms",)),
        )
        h.quantities = "grad1"  # (the same: nothing to change)
        h.verify = False
        assert h.verify is False and h.quantities == ("grad1",)
        F.cross_entropy(model(x), y).backward()
        assert h.check(F.cross_entropy, x, y).ok


@pytest.mark.parametrize(
    "call, where",
    [
        (gradhooks.hooks_of, "hooks_of"),
        (gradhooks.remove_hooks, "remove_hooks"),
        (gradhooks.clear_grad1, "clear_grad1"),
        (gradhooks.compute_grad1, "compute_grad1"),
        (gradhooks.clear_backprops, "clear_backprops"),
        (gradhooks.compute_hess, "compute_hess"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_functions_of_the_model_given_its_parameters(call, where):
    """Given ``model.parameters()`` as a list (or a name) these failed in ``weakref`` ("cannot
    create weak reference to 'list' object"), naming nothing of gradhooks'."""
    model, (x, y) = _mlp(), _batch()
    with gradhooks.add_hooks(model) as h:
        F.cross_entropy(model(x), y).backward()
        raised(
            gradhooks.ConfigurationTypeError,
            f"{where} takes the hooked model (an nn.Module), got list",
            lambda: call(list(model.parameters())),
        )
        raised(gradhooks.ConfigurationTypeError, "got str", lambda: call("model"))
        assert h.active and h.check(F.cross_entropy, x, y).ok

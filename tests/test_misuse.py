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
            f"{where} takes the model (an nn.Module), got list",
            lambda: call(list(model.parameters())),
        )
        raised(gradhooks.ConfigurationTypeError, "got str", lambda: call("model"))
        assert h.active and h.check(F.cross_entropy, x, y).ok


# -- DP-SGD and privacy ---------------------------------------------------------------------------


def _losses(model, n: int = 5):
    x, y = _batch(n)
    return F.cross_entropy(model(x), y, reduction="none")


@pytest.mark.parametrize(
    "call, says",
    [
        (lambda h, m: gradhooks.dp_sgd_step(h, _losses(m), max_norm="1.0", noise_multiplier=1.0),
         "dp_sgd_step: max_norm must be a number, got str '1.0'"),
        (lambda h, m: gradhooks.dp_sgd_step(h, _losses(m), max_norm=None, noise_multiplier=1.0),
         "max_norm must be a number, got NoneType"),
        (lambda h, m: gradhooks.dp_sgd_step(h, _losses(m), max_norm=1.0, noise_multiplier=None),
         "noise_multiplier must be a number, got NoneType"),
        (lambda h, m: gradhooks.dp_sgd_step(h, _losses(m), max_norm=1.0, noise_multiplier=1.0,
                                            expected_batch_size="5"),
         "expected_batch_size must be a number, got str '5'"),
        (lambda h, m: gradhooks.dp_sgd_step(h, "losses", max_norm=1.0, noise_multiplier=1.0),
         "per_example_loss must be a tensor [batch]"),
        (lambda h, m: gradhooks.dp_sgd_step(m, _losses(m), max_norm=1.0, noise_multiplier=1.0),
         "hooks must be the handle of gradhooks.add_hooks(model"),
        (lambda h, m: gradhooks.clipped_sum(None, _losses(m), max_norm=1.0),
         "got NoneType"),
        (lambda h, m: gradhooks.DPOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), h,
                                            max_grad_norm=1.0, noise_multiplier=1.0,
                                            expected_batch_size=5, sample_rate="0.1"),
         "DPOptimizer: sample_rate must be a number, got str '0.1'"),
        (lambda h, m: gradhooks.DPOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), h,
                                            max_grad_norm=1.0, noise_multiplier=1.0,
                                            expected_batch_size=5).backward(None),
         "per_example_loss must be a tensor [batch]"),
    ],
    ids=["max-norm-str", "max-norm-none", "noise-none", "expected-batch-str", "losses-str",
         "model-for-handle", "clipped-sum-none", "dpoptimizer-rate-str", "dpoptimizer-losses-none"],
)  # fmt: skip
def test_dp_step_arguments_of_the_wrong_type(call, says):
    """Each failed deep inside (``'>' not supported between 'Tensor' and 'str'`` in the
    clipping, ``'str' object has no attribute 'dim'``, ``'Sequential' object has no attribute
    'quantities'``), naming neither the argument nor the call."""
    model = _mlp()
    before = _snapshot(model)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        raised(gradhooks.ConfigurationTypeError, says, lambda: call(h, model))
        assert all(p.grad is None for p in model.parameters())
    assert_left_alone(model, before)


def _kfac(**kwargs):
    model = _mlp()
    return gradhooks.KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


@pytest.mark.parametrize(
    "call, says",
    [
        (lambda: gradhooks.PrivacyAccountant().step(noise_multiplier="1.0", sample_rate=0.1),
         "noise_multiplier must be a number, got str '1.0'"),
        (lambda: gradhooks.PrivacyAccountant().step(noise_multiplier=None, sample_rate=0.1),
         "noise_multiplier must be a number, got NoneType"),
        (lambda: gradhooks.PrivacyAccountant().epsilon("1e-5"), "delta must be a number, got str"),
        (lambda: gradhooks.noise_multiplier_for("3", 1e-5, 0.1, 100),
         "noise_multiplier_for: target_epsilon must be a number, got str '3'"),
        (lambda: gradhooks.PoissonSampler(50, "5"),
         "PoissonSampler: expected_batch_size must be a number, got str '5'"),
        (lambda: gradhooks.PoissonSampler(50, 5, generator=0),
         "generator must be a CPU torch.Generator or None, got int"),
        (lambda: _kfac(damping="x"),
         "KFAC: damping must be a number, got str 'x'"),
    ],
    ids=["accountant-noise-str", "accountant-noise-none", "epsilon-delta-str", "nmf-epsilon-str",
         "sampler-batch-str", "sampler-generator-int", "kfac-damping-str"],
)  # fmt: skip
def test_privacy_numbers_of_the_wrong_type(call, says):
    """A string or ``None`` for a number failed in a comparison (``'<' not supported between
    'int' and 'str'``) or in ``generator.device``, naming nothing."""
    raised(gradhooks.ConfigurationTypeError, says, call)


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"delta": "1e-5"}, "make_private: delta must be a number, got str '1e-5'"),
        ({"noise_multiplier": None, "target_epsilon": "3"}, "target_epsilon must be a number"),
        ({"expected_batch_size": "5"}, "expected_batch_size must be a number"),
        ({"model": [nn.Linear(4, 3)]}, "make_private takes the model (an nn.Module), got list"),
    ],
    ids=["delta-str", "epsilon-str", "batch-str", "model-list"],
)
def test_make_private_arguments_of_the_wrong_type(kwargs, says):
    """``make_private(delta="1e-5")`` failed in a comparison; given a list for the model, in
    ``.parameters()``."""
    model = _mlp()
    before = _snapshot(model)
    data = torch.utils.data.TensorDataset(*_batch(50))
    args = dict(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=data,
                delta=1e-5, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=5,
                steps=10)  # fmt: skip
    args.update(kwargs)
    raised(gradhooks.ConfigurationTypeError, says, lambda: gradhooks.make_private(**args))
    assert_left_alone(model, before)


@pytest.mark.parametrize(
    "kwargs, error, says",
    [
        ({"max_norm": 0.0}, gradhooks.ConfigurationError, "max_norm must be > 0 and finite, got 0.0"),
        ({"max_norm": -1.0}, gradhooks.ConfigurationError, "got -1.0"),
        ({"clipping": "per_layer"}, gradhooks.ConfigurationError, "clipping must be one of ('flat', 'automatic'), got 'per_layer'"),
        ({"norms": [0.5, 2.0]}, gradhooks.ConfigurationTypeError, "norms must be a tensor"),
        ({"max_norm": "1"}, gradhooks.ConfigurationTypeError, "max_norm must be a number"),
    ],
    ids=["max-norm-0", "max-norm-negative", "clipping-unknown", "norms-list", "max-norm-str"],
)  # fmt: skip
def test_clip_factors_refuses_what_would_give_wrong_factors(kwargs, error, says):
    """``clip_factors(norms, 0)`` gave factors of 0 (every gradient dropped), a negative bound
    negative factors, and an unknown ``clipping`` was taken as ``"flat"``: numbers, silently."""
    args = {"norms": torch.tensor([0.5, 2.0]), "max_norm": 1.0, "clipping": "flat"}
    args.update(kwargs)
    raised(error, says, lambda: gradhooks.clip_factors(**args))
    assert torch.equal(
        gradhooks.clip_factors(torch.tensor([0.5, 2.0]), 1.0), torch.tensor([1.0, 0.5])
    )


# -- autograd-hacks, checks, Jacobians, rules -----------------------------------------------------


def test_backprop_hess_of_an_empty_batch_is_refused_rather_than_nan():
    """``backprop_hess`` of a batch of 0 ran, and ``compute_hess`` then set every
    ``param.hess`` to NaN (a mean over no example): silently. A detached output, or a string,
    failed in torch or with an ``AttributeError``."""
    model = _mlp()
    before = _snapshot(model)
    with gradhooks.add_hooks(model):
        empty = model(torch.randn(0, 4))
        raised(
            gradhooks.ConfigurationError,
            "holds no example",
            lambda: gradhooks.backprop_hess(empty, "CrossEntropy"),
        )
        raised(
            gradhooks.StateError, "no backprop_hess was run", lambda: gradhooks.compute_hess(model)
        )
        out = model(_batch()[0])
        raised(
            gradhooks.ConfigurationError,
            "no autograd history",
            lambda: gradhooks.backprop_hess(out.detach(), "CrossEntropy"),
        )
        raised(
            gradhooks.ConfigurationTypeError,
            "takes the network's output [batch, classes], got str",
            lambda: gradhooks.backprop_hess("out", "CrossEntropy"),
        )
        gradhooks.backprop_hess(out, "CrossEntropy")
        gradhooks.compute_hess(model)
        assert all(torch.isfinite(p.hess).all() for p in model.parameters())
    for p in model.parameters():
        del p.hess
    model.zero_grad(set_to_none=True)
    assert_left_alone(model, before)


@pytest.mark.parametrize(
    "given, says",
    [(nn.Linear, "got the class Linear"), ("Linear", "got str 'Linear'"), (None, "got NoneType")],
    ids=["class", "name", "none"],
)
def test_is_supported_takes_a_module(given, says):
    """``is_supported(nn.Linear)`` said ``False``: Linear has a rule; it was asked of a class,
    which no rule covers. Now a module instance is asked for."""
    raised(gradhooks.ConfigurationTypeError, says, lambda: gradhooks.is_supported(given))
    assert gradhooks.is_supported(nn.Linear(2, 2)) and not gradhooks.is_supported(nn.ReLU())


@pytest.mark.parametrize(
    "call, says",
    [
        (lambda h, m, x, y: h.check(F.cross_entropy, x.tolist(), y),
         "check(loss_fn, inputs, target): inputs must be the tensor the captured forward took"),
        (lambda h, m, x, y: gradhooks.check_rule(nn.Linear(4, 3), "x"),
         "check_rule: inputs must be a tensor [batch, ...]"),
        (lambda h, m, x, y: gradhooks.jacobians(list(m.parameters()), x),
         "jacobians takes the model (an nn.Module), got list"),
        (lambda h, m, x, y: gradhooks.kfac_precondition(m, [("2.weight", None)], damping=1e-3),
         "kfac_precondition: factors must be {weight name: KFactors}"),
    ],
    ids=["check-inputs-list", "check-rule-inputs-str", "jacobians-parameter-list",
         "kfac-precondition-factors-list"],
)  # fmt: skip
def test_checks_and_curvature_given_the_wrong_type(call, says):
    """Each failed with an ``AttributeError`` (``'list' object has no attribute 'shape'``,
    ``... 'named_parameters'``, ``... 'items'``) naming neither the argument nor the call."""
    model, (x, y) = _mlp(), _batch()
    with gradhooks.add_hooks(model) as h:
        F.cross_entropy(model(x), y).backward()
        raised(gradhooks.ConfigurationTypeError, says, lambda: call(h, model, x, y))
        assert h.check(F.cross_entropy, x, y).ok


@pytest.mark.parametrize("rule", [None, "linear_rule"], ids=["none", "name"])
def test_register_refuses_what_is_not_a_rule(rule):
    """``registry.register(MyLinear)(None)`` stored ``None`` as the rule: hooking then went
    through, and the first backward failed calling it."""
    registry = gradhooks.Registry()

    class MyLinear(nn.Linear):
        def forward(self, x):
            return super().forward(x)

    raised(
        gradhooks.ConfigurationTypeError,
        "decorates a rule, a function rule(call)",
        lambda: registry.register(MyLinear)(rule),
    )
    assert MyLinear not in registry


@pytest.mark.parametrize(
    "option, says",
    [
        ({"on_forward": "check"}, "register(on_forward=...) takes a function or None, got str"),
        ({"grad_from_grad1": True}, "register(grad_from_grad1=...) takes a function or None"),
        ({"taps": 1}, "register(taps=...) takes a function or None, got int"),
        ({"saved": "mean"}, "register(saved=...) takes a function or None"),
        ({"owns_children": "yes"}, "register(owns_children=...) takes True or False, got str"),
        ({"needs_output": "no"}, "register(needs_output=...) takes True or False, got str"),
    ],
    ids=["on-forward-str", "grad-from-grad1-bool", "taps-int", "saved-str", "owns-children-str",
         "needs-output-str"],
)  # fmt: skip
def test_register_refuses_options_of_the_wrong_kind(option, says):
    """An option that is called (``on_forward``, ``grad_from_grad1``, ``taps``, ``saved``) given
    something else was stored, and the first forward or backward of a hooked model failed in
    the engine (``'str' object is not callable``); a string for a flag was taken by its
    truth."""
    registry = gradhooks.Registry()

    class MyLinear(nn.Linear):
        def forward(self, x):
            return super().forward(x)

    rule = gradhooks.REGISTRY.lookup(nn.Linear(2, 2)).rule
    raised(
        gradhooks.ConfigurationTypeError, says, lambda: registry.register(MyLinear, **option)(rule)
    )
    assert MyLinear not in registry


def test_a_private_run_refuses_a_checkpoint_that_is_not_its_own():
    """``private.load_state_dict(model.state_dict())`` failed with ``KeyError: 'plan'``; a
    checkpoint lacking a later key loaded the model and the optimizer first, then failed,
    leaving the run half resumed."""
    model = _mlp()
    data = torch.utils.data.TensorDataset(*_batch(50))
    private = gradhooks.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data, delta=1e-5,
        max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=5, steps=10,
    )  # fmt: skip
    try:
        state = private.state_dict()
        before = _snapshot(model)
        raised(
            gradhooks.ConfigurationError,
            "the checkpoint lacks ['plan'",
            lambda: private.load_state_dict(model.state_dict()),
        )
        changed = {**state, "model": {k: v + 1 for k, v in state["model"].items()}}
        del changed["noise_generator"]
        raised(
            gradhooks.ConfigurationError,
            "lacks ['noise_generator']",
            lambda: private.load_state_dict(changed),
        )
        raised(
            gradhooks.ConfigurationTypeError, "got str", lambda: private.load_state_dict("ckpt.pt")
        )
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        private.load_state_dict(state)
    finally:
        private.close()
    assert_left_alone(model, before)


# -- Hugging Face, memory -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"delta": "1e-5"}, "DPArguments: delta must be a number, got str '1e-5'"),
        ({"target_epsilon": "3"}, "DPArguments: target_epsilon must be a number"),
        ({"noise_multiplier": "1.0"}, "DPArguments: noise_multiplier must be a number"),
        ({"noise_seed": "secret"}, "DPArguments: noise_seed must be an int or None, got str"),
    ],
    ids=["delta-str", "epsilon-str", "noise-str", "seed-str"],
)
def test_dp_arguments_of_the_wrong_type(kwargs, says):
    """Failed in a comparison (``'<' not supported between 'int' and 'str'``); a string seed
    was kept, to fail at the first step in ``torch.Generator.manual_seed``."""
    pytest.importorskip("transformers")
    from gradhooks.workflows.hf import DPArguments

    args = {"max_grad_norm": 1.0, "delta": 1e-5, "target_epsilon": 3.0, **kwargs}
    raised(gradhooks.ConfigurationTypeError, says, lambda: DPArguments(**args))


@pytest.mark.parametrize(
    "logits, labels, says",
    [
        (torch.randn(3, 1), torch.randn(3, 2), "(regression): labels (3, 2) hold 2 values per example"),
        (torch.randn(3, 4), torch.randint(0, 4, (3, 2)), "(single_label_classification): labels (3, 2)"),
        ("logits", torch.zeros(3), "logits must be a tensor, got str"),
    ],
    ids=["regression-broadcast", "single-label-two-per-example", "logits-str"],
)  # fmt: skip
def test_per_example_loss_refuses_labels_of_another_shape(logits, labels, says):
    """One regression output against two labels per example broadcast into a loss over both
    (a number, silently); two class indices per example failed in ``reshape``."""
    pytest.importorskip("transformers")
    from gradhooks.workflows.hf import per_example_loss

    error = (
        gradhooks.ConfigurationTypeError
        if isinstance(logits, str)
        else gradhooks.ConfigurationError
    )
    raised(error, says, lambda: per_example_loss(logits, labels))
    assert per_example_loss(
        torch.randn(3, 2), torch.randn(3, 2), problem_type="regression"
    ).shape == (3,)
    assert per_example_loss(torch.randn(3, 4), torch.randint(0, 4, (3, 1))).shape == (3,)


def test_a_memory_limit_of_true_is_refused():
    """``set_memory_limit(True)`` set a limit of 1 byte (``True`` is the int 1): every later
    backward refused its grad1 as too large."""
    raised(gradhooks.ConfigurationError, "got True", lambda: gradhooks.set_memory_limit(True))
    model, (x, y) = _mlp(), _batch()
    with gradhooks.add_hooks(model) as h:
        F.cross_entropy(model(x), y).backward()
        assert h.check(F.cross_entropy, x, y).ok


# -- flags, tolerances and samples ----------------------------------------------------------------


@pytest.mark.parametrize(
    "call, error, says",
    [
        (lambda m, x, y: gradhooks.kfac(m, x, y, mc_samples=0), gradhooks.ConfigurationError,
         "mc_samples must be a whole number >= 1, got 0"),
        (lambda m, x, y: gradhooks.kfac(m, x, y, mc_samples=2.5), gradhooks.ConfigurationError,
         "got 2.5"),
        (lambda m, x, y: gradhooks.kfac(m, x, y, generator=0), gradhooks.ConfigurationTypeError,
         "generator must be a torch.Generator or None, got int"),
        (lambda m, x, y: gradhooks.kfac(m, x, y, expand="no"), gradhooks.ConfigurationTypeError,
         "expand takes True or False, got str 'no'"),
        (lambda m, x, y: gradhooks.kfac(m, x, y)["2.weight"].inverse("1e-3"),
         gradhooks.ConfigurationTypeError, "damping must be a number, got str '1e-3'"),
        (lambda m, x, y: gradhooks.jacobians(m, x, flatten="yes"), gradhooks.ConfigurationTypeError,
         "jacobians: flatten takes True or False"),
        (lambda m, x, y: gradhooks.check_rule(nn.Linear(4, 3), x, rtol=-1.0),
         gradhooks.ConfigurationError, "check_rule: rtol must be >= 0, got -1.0"),
        (lambda m, x, y: gradhooks.check_rule(nn.Linear(4, 3), x, loss_fn="mse"),
         gradhooks.ConfigurationTypeError, "check_rule: loss_fn must be a function"),
        (lambda m, x, y: gradhooks.tuned(chunk_elements="big").__enter__(),
         gradhooks.ConfigurationTypeError, "gradhooks.tuned(): chunk_elements must be a number"),
    ],
    ids=["kfac-samples-0", "kfac-samples-float", "kfac-generator-int", "kfac-expand-str",
         "inverse-damping-str", "jacobians-flatten-str", "check-rule-rtol-negative",
         "check-rule-loss-str", "tuned-str"],
)  # fmt: skip
def test_samples_flags_and_tolerances_are_checked(call, error, says):
    """``mc_samples=0`` failed in ``torch.stack`` ("expects a non-empty TensorList"), 2.5 in
    ``range``; a string for a flag was taken by its truth (``expand="no"`` expanded,
    ``flatten="yes"``); a negative tolerance failed in ``torch.allclose``, a loss named by a
    string in the oracle (``'str' object is not callable``); a string threshold was set, to
    fail in the next backward's rule."""
    model, (x, y) = _mlp(), _batch()
    before = _snapshot(model)
    raised(error, says, lambda: call(model, x, y))
    assert gradhooks.TUNING.chunk_elements == gradhooks.Tuning().chunk_elements
    assert_left_alone(model, before)


def test_check_refuses_a_string_for_raise_on_error():
    """``h.check(raise_on_error="no")`` raised: the string was taken by its truth."""
    model, (x, y) = _mlp(), _batch()
    with gradhooks.add_hooks(model) as h:
        F.cross_entropy(model(x), y).backward()
        raised(
            gradhooks.ConfigurationTypeError,
            "raise_on_error takes True or False, got str 'no'",
            lambda: h.check(raise_on_error="no"),
        )


def test_an_audit_refuses_coins_that_are_not_coins():
    """``epsilon_lower_bound(scores, included=probabilities)`` took every nonzero value as
    "included" (``0.3`` as ``True``), and audited a run against coins it never tossed; a string
    ε failed in a comparison."""
    from gradhooks.privacy import audit

    scores = torch.arange(8.0)
    raised(
        gradhooks.ConfigurationError,
        "included must hold booleans (or 0 and 1)",
        lambda: audit.epsilon_lower_bound(scores, torch.full((8,), 0.3), guesses=4, delta=1e-5),
    )
    raised(
        gradhooks.ConfigurationTypeError,
        "one_run_p_value: epsilon must be a number, got str",
        lambda: audit.one_run_p_value(8, 4, 3, "1.0", 1e-5),
    )
    coins = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0])
    assert audit.epsilon_lower_bound(
        scores.flip(0), coins, guesses=4, delta=1e-5
    ) == audit.epsilon_lower_bound(scores.flip(0), coins.bool(), guesses=4, delta=1e-5)


# -- distributed ----------------------------------------------------------------------------------


def test_collective_calls_without_a_process_group_stop_before_the_backward():
    """Without ``init_process_group`` these failed at the first all-reduce, in torch, after
    the step's backward had run: the losses' graph freed, the step lost. Now they stop first,
    and the same losses still take a single-process step."""
    from gradhooks import distributed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        pytest.skip("a process group is initialized")
    model = _mlp()
    before = _snapshot(model)
    with gradhooks.add_hooks(model, quantities=("norms", "kfac")) as h:
        losses = _losses(model)
        raised(
            gradhooks.ConfigurationError,
            "call dist.init_process_group(...) on every rank first",
            lambda: distributed.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=1.0),
        )
        assert all(p.grad is None for p in model.parameters())
        raised(
            gradhooks.ConfigurationError,
            "gradhooks.distributed.broadcast_parameters is collective",
            lambda: distributed.broadcast_parameters(model),
        )
        norms = gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=0.0)
        assert norms.shape == (5,) and all(p.grad is not None for p in model.parameters())
        raised(
            gradhooks.ConfigurationError,
            "or use h.kfac_factors() in a single process",
            lambda: distributed.kfac_factors(h),
        )
        raised(
            gradhooks.ConfigurationError,
            "or use gradhooks.kfac in a single process",
            lambda: distributed.kfac(model, _batch()[0]),
        )
    model.zero_grad(set_to_none=True)
    assert_left_alone(model, before)


def test_a_dp_optimizer_needs_its_divisor():
    """``DPOptimizer(expected_batch_size=None)`` was accepted; its first ``step()`` then failed
    in ``div_`` after the backward had filled the buffer."""
    model = _mlp()
    before = _snapshot(model)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        make = lambda: gradhooks.DPOptimizer(  # noqa: E731
            torch.optim.SGD(model.parameters(), lr=0.1), h, max_grad_norm=1.0,
            noise_multiplier=1.0, expected_batch_size=None,
        )  # fmt: skip
        raised(
            gradhooks.ConfigurationTypeError,
            "DPOptimizer: expected_batch_size must be a number, got NoneType",
            make,
        )
    assert_left_alone(model, before)


def test_a_dp_trainer_refuses_a_loss_given_by_name():
    """``DPTrainer(..., per_example_loss="cross_entropy")`` was kept, to fail at the first
    training step (``'str' object is not callable``), after the hooks and the sampler were set
    up; refused at construction now."""
    pytest.importorskip("transformers")
    from gradhooks.workflows.hf import DPArguments, DPTrainer

    dp = DPArguments(max_grad_norm=1.0, delta=1e-5, noise_multiplier=1.0)
    raised(
        gradhooks.ConfigurationTypeError,
        "per_example_loss must be a function (outputs, labels) -> [batch]",
        lambda: DPTrainer(_mlp(), None, dp=dp, per_example_loss="cross_entropy"),
    )


# -- the meta device ------------------------------------------------------------------------------


def test_a_backward_on_the_meta_device_says_to_turn_verification_off():
    """A model on the meta device hooks (it may be materialized later, ``to_empty``), but its
    first verified backward failed inside torch ("Tensor.item() cannot be called on meta
    tensors"). Now it says why and what to do; with ``verify=False`` it gives ``grad1`` of the
    right shapes, on the meta device."""
    with torch.device("meta"):
        model = _mlp()
    x = torch.randn(5, 4, device="meta")
    with gradhooks.add_hooks(model):
        raised(
            gradhooks.UnsupportedInputError,
            "add_hooks(model, verify=False)",
            lambda: model(x).sum().backward(),
        )
    gradhooks.clear_grad1(model)
    with gradhooks.add_hooks(model, verify=False):
        model(x).sum().backward()
    assert [tuple(p.grad1.shape) for p in model.parameters()] == [
        (5, *p.shape) for p in model.parameters()
    ]
    assert all(p.grad1.is_meta for p in model.parameters())
    assert not any(getattr(m, kind) for m in model.modules() for kind in HOOKS)


@pytest.mark.parametrize("option", [{"batch_size": 64}, {"shuffle": True}, {"drop_last": True}])
def test_a_poisson_loader_refuses_options_that_replace_its_batches(option):
    """``poisson_loader(data, 8, batch_size=64)`` failed in ``DataLoader`` ("batch_sampler
    option is mutually exclusive with batch_size, shuffle, sampler, and drop_last"), naming
    neither the loader nor what to pass instead."""
    data = torch.utils.data.TensorDataset(*_batch(50))
    raised(
        gradhooks.ConfigurationError,
        f"poisson_loader: {next(iter(option))} would replace the Poisson batches",
        lambda: gradhooks.poisson_loader(data, 8, **option),
    )
    assert len(gradhooks.poisson_loader(data, 8, num_workers=0)) >= 1


def test_check_of_a_sequence_first_model_says_what_it_cannot_tell():
    """With ``add_hooks(model, batch_dim=1)`` (a sequence-first model, done right),
    ``h.check(loss_fn, x, y)`` compared grad1's 4 examples with the 6 rows of ``x``'s dimension
    0 and raised "pass the inputs of the captured forward": the inputs it was given. Now it
    leaves the reduction unchecked and says why; grad1 itself is the per-example loop's."""
    torch.manual_seed(0)

    class SeqFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x):  # x [time, batch, features]
            return self.fc(x).mean(0)

    model, x, y = (
        SeqFirst().double(),
        torch.randn(6, 4, 3, dtype=torch.float64),
        torch.tensor([0, 1, 1, 0]),
    )
    with gradhooks.add_hooks(model, batch_dim=1) as h:
        F.cross_entropy(model(x), y).backward()
        report = h.check(F.cross_entropy, x, y)
    assert not report.problems and any("dimension 1" in u for u in report.unchecked)
    want = gradhooks.oracle.loop_grad(_BatchFirst(model), F.cross_entropy, (x.transpose(0, 1),), y)
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad1, want[f"model.{name}"]), name


class _BatchFirst(nn.Module):
    """``model`` called with its inputs' dimension 0 moved to 1 (for the per-example loop)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x.transpose(0, 1))

"""Misuse of the public API beyond ``add_hooks`` and ``grad1``: the DP step, its optimizer and
accountant, the quantities and curvature (norms, noise scale, Jacobians, K-FAC), the registry
of rules, and a handle's life. Each mistake, written as a user writes it, stops with the
gradhooks error of its kind, whose message names the call, the module, the parameter, the
shapes or the value at fault, and leaves the model as it was: the same parameters, hooks,
``.grad`` and ``grad1`` (``tests/test_misuse.py`` holds the arguments of the wrong type,
``tests/test_misuse_loops.py`` the mistakes of a training loop)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_untouched, model_state, raised


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(n: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def _losses(model: nn.Module, n: int = 5) -> torch.Tensor:
    x, y = _batch(n)
    return F.cross_entropy(model(x), y, reduction="none")


# -- the DP step ----------------------------------------------------------------------------------


def _step(**kwargs):
    def call(h, model):
        args = {"max_norm": 1.0, "noise_multiplier": 1.0, **kwargs}
        return gradhooks.dp_sgd_step(h, _losses(model), **args)

    return call


def _other_model_groups(h, model):
    groups = [list(_mlp().parameters())]
    return gradhooks.dp_sgd_step(
        h, _losses(model), max_norm=1.0, noise_multiplier=1.0, clipping_groups=groups
    )


@pytest.mark.parametrize(
    "call, says",
    [
        (_step(max_norm=float("nan")), "max_norm must be > 0 and finite, got nan"),
        (_step(noise_multiplier=float("nan")), "noise_multiplier must be >= 0 and finite, got nan"),
        (_step(noise_multiplier=-1.0), "got -1.0"),
        (_step(noise_multiplier=float("inf")), "got inf"),
        (_step(expected_batch_size=0), "expected_batch_size must be > 0 and finite, got 0"),
        (_step(max_norm=[1.0, float("nan")], clipping_groups="layer"),
         "max_norm[1] = nan, the bound of clipping group 1"),
        (_step(max_norm=[1.0, 1.0, 1.0], clipping_groups="layer"),
         "max_norm has 3 bounds but clipping_groups='layer' makes 2 groups"),
        (_other_model_groups, "clipping group 0 holds a parameter of shape (8, 4) that is not the hooked Sequential's"),
        (_step(expected_batch_size=5, reduction="sum"), "contradicts reduction='sum'"),
        (_step(method="ghost", clipping_groups="layer"), "ghost"),
    ],
    ids=["max-norm-nan", "noise-nan", "noise-negative", "noise-inf", "expected-batch-0",
         "group-bound-nan", "bounds-per-group-count", "groups-of-another-model",
         "expected-batch-with-sum", "ghost-with-groups"],
)  # fmt: skip
def test_dp_step_numbers_and_groups_that_cannot_work(call, says):
    """A bound or multiplier that is NaN, negative or infinite, a divisor of 0, bounds that do
    not match the groups, groups of another model, options that contradict each other: each
    refused before the step's backward, naming the value, with no ``.grad`` written."""
    model = _mlp()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        before = model_state(model)
        raised(gradhooks.ConfigurationError, says, lambda: call(h, model))
        assert_untouched(model, before)
        assert gradhooks.dp_sgd_step(
            h, _losses(model), max_norm=1.0, noise_multiplier=0.0
        ).shape == (5,)


@pytest.mark.parametrize(
    "losses, says",
    [
        (lambda m: _losses(m).mean(), "per_example_loss must be [batch], got ()"),
        (lambda m: F.cross_entropy(m(_batch()[0]), _batch()[1], reduction="none")[:3],
         "per_example_loss has 3 entries, but the hooked forward had a batch of 5 examples"),
    ],
    ids=["mean-loss", "fewer-losses-than-examples"],
)  # fmt: skip
def test_dp_step_of_losses_that_are_not_one_per_example(losses, says):
    """The mean loss (``reduction`` left at its default) or losses of some examples only:
    refused, naming the shapes, before any backward."""
    model = _mlp()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        before = model_state(model)
        raised(
            gradhooks.ConfigurationError,
            says,
            lambda: gradhooks.dp_sgd_step(h, losses(model), max_norm=1.0, noise_multiplier=1.0),
        )
        assert_untouched(model, before)


def test_dp_step_twice_for_one_forward():
    """The same losses stepped on twice (a loop that forgot its forward): the second step would
    have found their graph freed, or, kept, stepped on the same batch again; refused, and the
    first step's gradients stay as they were."""
    model = _mlp()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        losses = _losses(model)
        gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=0.0)
        before = model_state(model)
        raised(
            gradhooks.ConfigurationError,
            "these losses were already stepped on",
            lambda: gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=0.0),
        )
        assert_untouched(model, before)


def test_dp_step_with_the_handle_of_another_model():
    """Two hooked models, the step given the other's handle: the losses reach none of its
    parameters, so the step would be noise alone; refused, and neither model is changed."""
    model, other = _mlp(), _mlp()
    with gradhooks.add_hooks(model, quantities=("norms",)), \
            gradhooks.add_hooks(other, quantities=("norms",)) as wrong:  # fmt: skip
        losses = _losses(model)
        before, before_other = model_state(model), model_state(other)
        raised(
            gradhooks.StateError,
            "per_example_loss does not depend on any trainable parameter of the hooked Sequential",
            lambda: gradhooks.dp_sgd_step(wrong, losses, max_norm=1.0, noise_multiplier=1.0),
        )
        assert_untouched(model, before)
        assert_untouched(other, before_other)


def test_dp_step_after_a_backward_of_their_own():
    """``losses.sum().backward()`` and then the step on the same losses: the step's backward
    failed inside torch ("Trying to backward through the graph a second time"), naming
    neither the step nor what to do. Now a ``StateError`` says it; ``.grad`` holds the
    user's own backward as it was, and the next step works."""
    model = _mlp()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        losses = _losses(model)
        losses.sum().backward()
        before = model_state(model)
        raised(
            gradhooks.StateError,
            ["a backward of your own ran on these losses", "no gradient of the step"],
            lambda: gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=1.0),
        )
        assert_untouched(model, before)
        norms = gradhooks.dp_sgd_step(h, _losses(model), max_norm=1.0, noise_multiplier=0.0)
    assert torch.isfinite(norms).all() and norms.shape == (5,)


@pytest.mark.parametrize(
    "bound, says",
    [
        (torch.tensor(0.0), "max_norm must be > 0 and finite, got a tensor () holding 0.0"),
        (torch.tensor(-1.0), "holding -1.0"),
        (torch.tensor([[1.0], [float("nan")]]), "got a tensor (2, 1) holding nan"),
        (torch.tensor([1.0, 2.0, 3.0]), "max_norm of shape (3,) does not broadcast against norms of shape (2,)"),
        (torch.tensor([[1.0], [2.0]]), "max_norm of shape (2, 1) does not broadcast against norms of shape (2,)"),
    ],
    ids=["zero", "negative", "group-nan", "three-bounds-two-norms", "column-against-a-row"],
)  # fmt: skip
def test_clip_factors_given_a_tensor_bound(bound, says):
    """A bound given as a tensor skipped every check: ``tensor(0.)`` gave factors of 0 (the
    noise alone), ``tensor(-1.)`` negative ones (every gradient flipped), a bound per group
    against one row of norms a ``[2, 2]`` matrix of factors, three bounds for two norms a
    torch size error."""
    norms = torch.tensor([0.5, 2.0])
    raised(gradhooks.ConfigurationError, says, lambda: gradhooks.clip_factors(norms, bound))
    assert torch.equal(gradhooks.clip_factors(norms, torch.tensor(1.0)), torch.tensor([1.0, 0.5]))
    grouped = gradhooks.clip_factors(norms.expand(2, 2), torch.tensor([[1.0], [4.0]]))
    assert torch.equal(grouped, torch.tensor([[1.0, 0.5], [1.0, 1.0]]))


# -- the DP optimizer and the accountant ----------------------------------------------------------


def _dp_optimizer(model, h, optimizer=None, **kwargs):
    args = {"max_grad_norm": 1.0, "noise_multiplier": 1.0, "expected_batch_size": 5, **kwargs}
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.1)
    return gradhooks.DPOptimizer(optimizer, h, **args)


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda m, h: _dp_optimizer(m, h, torch.optim.SGD(_mlp().parameters(), lr=0.1)),
         "the optimizer steps a trainable parameter of shape (8, 4) that the hooks do not clip"),
        (lambda m, h: _dp_optimizer(m, h, torch.optim.SGD([*m.parameters(), nn.Parameter(torch.zeros(3))], lr=0.1)),
         "parameter of shape (3,) that the hooks do not clip"),
        (lambda m, h: _dp_optimizer(m, h, sample_rate=1.5, accountant=gradhooks.PrivacyAccountant()),
         "sample_rate must be in (0, 1]"),
        (lambda m, h: _dp_optimizer(m, h, accountant=gradhooks.PrivacyAccountant()),
         "records each step's sampling rate: pass sample_rate="),
        (lambda m, h: _dp_optimizer(m, h, max_grad_norm=float("nan")), "got nan"),
        (lambda m, h: _dp_optimizer(m, h, expected_batch_size=0), "expected_batch_size must be > 0"),
        (lambda m, h: _dp_optimizer(m, h, adaptive_clipping=gradhooks.AdaptiveClipping(target_quantile=1.5)),
         "AdaptiveClipping.target_quantile = 1.5"),
        (lambda m, h: _dp_optimizer(m, h, clipping="automatic", adaptive_clipping=gradhooks.AdaptiveClipping()),
         "clipping='automatic' has none of"),
    ],
    ids=["optimizer-of-another-model", "optimizer-with-a-foreign-parameter", "sample-rate-above-1",
         "accountant-without-sample-rate", "max-norm-nan", "expected-batch-0",
         "adaptive-quantile-above-1", "adaptive-with-automatic-clipping"],
)  # fmt: skip
def test_dp_optimizer_settings_that_cannot_work(make, says):
    """An optimizer over parameters that are not (all) the hooked model's would step them on
    a gradient with neither clipping nor noise; a rate above 1, an accountant without a rate,
    an adaptive bound that cannot adapt: each refused when the optimizer is made."""
    model = _mlp()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        before = model_state(model)
        raised(gradhooks.ConfigurationError, says, lambda: make(model, h))
        assert_untouched(model, before)


def test_dp_optimizer_stepped_without_a_backward_or_twice():
    """``opt.step()`` with no ``opt.backward(losses)`` since the last step (at the start, or a
    second time for one logical batch) would step on the noise alone: refused, the parameters
    as they were."""
    model = _mlp()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = _dp_optimizer(model, h)
        before = model_state(model)
        raised(gradhooks.StateError, "DPOptimizer.step: no backward(per_example_loss)", opt.step)
        assert_untouched(model, before)
        opt.backward(_losses(model))
        assert opt.step()
        before = model_state(model)
        raised(gradhooks.StateError, "no backward(per_example_loss) since the last step", opt.step)
        assert_untouched(model, before)


def test_dp_optimizer_zero_grad_given_a_string_for_discard():
    """``opt.zero_grad(discard="no")`` dropped the physical batches already clipped (the string
    taken by its truth): the step was then of the later batches alone, silently."""
    model = _mlp()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = _dp_optimizer(model, h, noise_multiplier=0.0)
        opt.backward(_losses(model))
        raised(
            gradhooks.ConfigurationTypeError,
            "DPOptimizer.zero_grad: discard takes True or False, got str 'no'",
            lambda: opt.zero_grad(discard="no"),
        )
        assert opt.examples == 5
        before = model_state(model)
        assert opt.step()
    assert not all(torch.equal(before["params"][n], p) for n, p in model.named_parameters())


@pytest.mark.parametrize(
    "call, says",
    [
        (lambda a: a.step(noise_multiplier=1.0, sample_rate=1.5), "sample_rate must be in [0, 1]"),
        (lambda a: a.step(noise_multiplier=float("nan"), sample_rate=0.1), "noise_multiplier must be finite and >= 0, got nan"),
        (lambda a: a.step(noise_multiplier=1.0, sample_rate=0.1, steps=2.5), "steps must be a whole number >= 0, got 2.5"),
        (lambda a: a.epsilon(0.0), "delta must be in (0, 1), got 0.0"),
        (lambda a: a.epsilon(1.0), "got 1.0"),
        (lambda a: gradhooks.noise_multiplier_for(3.0, 0.0, 0.1, 100), "delta must be in (0, 1), got 0.0"),
        (lambda a: gradhooks.noise_multiplier_for(-1.0, 1e-5, 0.1, 100), "target_epsilon must be > 0, got -1.0"),
    ],
    ids=["rate-above-1", "noise-nan", "steps-fraction", "epsilon-delta-0", "epsilon-delta-1",
         "noise-for-delta-0", "noise-for-negative-epsilon"],
)  # fmt: skip
def test_accountant_asked_what_has_no_answer(call, says):
    """Each refused, naming the value, and the accountant keeps what it had recorded."""
    pytest.importorskip("dp_accounting")
    accountant = gradhooks.PrivacyAccountant()
    accountant.step(noise_multiplier=1.0, sample_rate=0.1, steps=10)
    before = accountant.state_dict()
    raised(gradhooks.ConfigurationError, says, lambda: call(accountant))
    assert accountant.state_dict() == before


# -- quantities and curvature ---------------------------------------------------------------------


def test_noise_scale_of_a_single_example():
    """The noise scale's ``tr(Σ)`` divides by ``batch - 1``: refused for one example rather
    than an inf or a NaN."""
    model = _mlp()
    with gradhooks.add_hooks(model, quantities=("sum_grad_sq",)) as h:
        x, y = _batch(1)
        F.cross_entropy(model(x), y).backward()
        raised(gradhooks.StateError, "the last backward had 1 example(s)", h.noise_scale)
        assert set(h.grad_variance()) == {n for n, _ in model.named_parameters()}


def test_kfac_damping_of_inf():
    """``f.inverse(float("inf"))`` and ``kfac_precondition(..., damping=inf)`` preconditioned
    every gradient to 0, silently (the optimizer's own damping already had to be finite)."""
    model, (x, y) = _mlp(), _batch()
    factors = gradhooks.kfac(model, x)
    raised(gradhooks.ConfigurationError, "damping must be > 0 and finite, got inf",
           lambda: factors["0.weight"].inverse(float("inf")))  # fmt: skip
    F.cross_entropy(model(x), y).backward()
    before = model_state(model)
    raised(
        gradhooks.ConfigurationError,
        "got inf",
        lambda: gradhooks.kfac_precondition(model, factors, damping=float("inf")),
    )
    assert_untouched(model, before)


def test_kfac_precondition_with_a_parameter_frozen_since_the_factors():
    """Factors of a weight frozen since: refused, naming it, before any gradient is written
    (the other weights' gradients stay as the backward left them)."""
    model, (x, y) = _mlp(), _batch()
    factors = gradhooks.kfac(model, x)
    model[0].weight.requires_grad_(False)
    F.cross_entropy(model(x), y).backward()
    before = model_state(model)
    raised(
        gradhooks.ConfigurationError,
        "kfac_precondition: '0.weight' has no .grad",
        lambda: gradhooks.kfac_precondition(model, factors, damping=1e-3),
    )
    assert_untouched(model, before)


def test_kfac_inverse_applied_to_a_gradient_of_another_shape():
    """An inverse applied to the weight's gradient without its bias column, or to another
    layer's: refused, naming both shapes."""
    model, (x, _) = _mlp(), _batch()
    inverse = gradhooks.kfac(model, x)["0.weight"].inverse(1e-3)
    for grad in (torch.randn(8, 4), torch.randn(3, 9)):
        raised(
            gradhooks.ConfigurationError,
            [f"a gradient of shape {tuple(grad.shape)}", "factors of a (8, 5) weight matrix"],
            lambda grad=grad: inverse.apply(grad),
        )
    assert inverse.apply(torch.randn(8, 5)).shape == (8, 5)


def test_kfac_of_an_empty_batch():
    """``kfac(model, x[:0])`` gave factors of zeros (the mean over no example), and a gradient
    preconditioned with them came out as the gradient divided by the damping."""
    model, (x, _) = _mlp(), _batch()
    before = model_state(model)
    raised(gradhooks.ConfigurationError, "the model's output (0, 3) holds no example",
           lambda: gradhooks.kfac(model, x[:0]))  # fmt: skip
    assert_untouched(model, before)


def test_kfac_optimizer_given_a_string_for_adaptive():
    """``KFAC(..., adaptive="no")`` adapted the damping (the string taken by its truth), and
    then asked every few steps for a closure the user never meant to give."""
    model = _mlp()
    raised(
        gradhooks.ConfigurationTypeError,
        "KFAC: adaptive takes True or False, got str 'no'",
        lambda: gradhooks.KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1), adaptive="no"),
    )


def test_kfac_optimizer_given_a_checkpoint_that_is_not_its_own():
    """``kfac.load_state_dict(optimizer.state_dict())`` failed with ``KeyError: 'factors'``
    after loading the optimizer part; a string failed in ``__getitem__``. Refused before
    anything is loaded."""
    model, (x, y) = _mlp(), _batch()
    kfac = gradhooks.KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    F.cross_entropy(model(x), y).backward()
    kfac.step(x)
    saved = kfac.state_dict()
    other = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9).state_dict()
    raised(gradhooks.ConfigurationError, "the checkpoint lacks ['optimizer', 'factors', "
           "'damping', 'steps']", lambda: kfac.load_state_dict(other))  # fmt: skip
    raised(gradhooks.ConfigurationTypeError, "got str", lambda: kfac.load_state_dict("kfac.pt"))
    assert kfac.optimizer.param_groups[0]["lr"] == 0.1 and kfac.steps == 1
    kfac.load_state_dict(saved)
    assert kfac.steps == 1 and set(kfac.factors) == {"0.weight", "2.weight"}


@pytest.mark.parametrize(
    "module, inputs, says",
    [
        (nn.ReLU(), torch.randn(3, 4), "check_rule: ReLU has no trainable parameter"),
        (nn.Linear(4, 3).requires_grad_(False), torch.randn(3, 4), "Linear has no trainable parameter"),
        (nn.Linear(4, 3), torch.randn(0, 4), "inputs of shape (0, 4) hold no example"),
    ],
    ids=["no-parameter", "frozen", "empty-batch"],
)  # fmt: skip
def test_check_rule_of_nothing_to_check(module, inputs, says):
    """A layer without trainable parameters failed inside autograd ("element 0 of tensors
    does not require grad"); a batch of 0 passed, every difference 0.0 (a check that could
    not fail)."""
    raised(gradhooks.ConfigurationError, says, lambda: gradhooks.check_rule(module, inputs))


# -- the registry ---------------------------------------------------------------------------------


class MyLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x)


def _registry(rule) -> gradhooks.Registry:
    registry = gradhooks.Registry()
    registry.register(MyLinear)(rule)
    registry.register(nn.Linear)(gradhooks.REGISTRY.lookup(nn.Linear(2, 2)).rule)
    return registry


def _model_with_my_linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(MyLinear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _backward(model: nn.Module) -> None:
    x, y = _batch()
    F.cross_entropy(model(x), y).backward()


def _dp_backward(model: nn.Module, h) -> None:
    gradhooks.dp_sgd_step(h, _losses(model), max_norm=1.0, noise_multiplier=0.0)


def three_by_three(call):
    """A rule for an ``[8, 4]`` weight whose piece is ``[batch, 3, 3]``."""
    g = call.grad_outputs[0]
    return {"weight": gradhooks.Direct(g.new_zeros(g.shape[0], 3, 3)), "bias": gradhooks.Direct(g)}


@pytest.mark.parametrize(
    "quantity, run",
    [("grad1", _backward), ("norms", _backward), ("sum_grad_sq", _backward), ("kfac", _backward),
     ("norms", _dp_backward)],
    ids=["grad1", "norms", "sum_grad_sq", "kfac", "dp-step"],
)  # fmt: skip
def test_a_rule_whose_piece_has_the_wrong_size(quantity, run):
    """A rule giving a ``[batch, 3, 3]`` piece for an ``[8, 4]`` weight: ``grad1`` was refused,
    but the norms, the squared sums and the DP step failed inside torch ("size mismatch, got
    input (32), mat (9x5)"), and K-FAC left the weight out without a word. Now every quantity
    refuses it, naming the rule, the module, the parameter and both sizes."""
    model = _model_with_my_linear()
    before = model_state(model)
    with gradhooks.add_hooks(
        model, registry=_registry(three_by_three), quantities=(quantity,)
    ) as h:
        raised(
            gradhooks.RuleError,
            ["rule three_by_three for '0' (MyLinear)", "piece for 'weight' (Direct)",
             "a gradient of 9 entries", "'weight' has shape (8, 4) (32 entries)"],
            lambda: run(model) if run is _backward else run(model, h),
        )  # fmt: skip
    assert_untouched(model, before)


def no_shared_axis(call):
    """Linear's rule without the shared axis: ``a`` ``[batch, in]``, ``g`` ``[batch, out]``."""
    a, g = call.inputs[0], call.grad_outputs[0]
    return {"weight": gradhooks.Outer(a, g), "bias": gradhooks.Direct(g)}


def test_an_outer_piece_without_its_shared_axis():
    """``Outer(x, g)`` of ``[batch, features]`` tensors has the right size per example, but
    its batch is read as the shared positions too: with ``verify=False`` the norms were
    numbers of the examples summed together, silently. Refused where the piece is made."""
    model = _model_with_my_linear()
    registry = _registry(no_shared_axis)
    with gradhooks.add_hooks(model, registry=registry, quantities=("norms",), verify=False):
        raised(
            gradhooks.RuleError,
            ["rule no_shared_axis for '0' (MyLinear)", "Outer(a=...) of shape (5, 4)",
             "a[:, None]"],
            lambda: _backward(model),
        )  # fmt: skip


@pytest.mark.parametrize(
    "rule, says",
    [
        (lambda call: None, "returned NoneType, not {parameter name: Piece}"),
        (lambda call: [gradhooks.Direct(call.grad_outputs[0])], "returned list"),
        (lambda call: {"weight": call.grad_outputs[0][:, :, None] * call.inputs[0][:, None],
                       "bias": gradhooks.Direct(call.grad_outputs[0])},
         "its piece for 'weight' is a Tensor, not a gradhooks.Piece: wrap a per-example gradient [batch, *(8, 4)]"),
    ],
    ids=["none", "list", "bare-tensor"],
)  # fmt: skip
def test_a_rule_that_returns_no_pieces(rule, says):
    """A rule returning ``None``, a list or a bare tensor failed with an ``AttributeError``
    quoted in the error (``'Tensor' object has no attribute 'in_dtype'``)."""
    model = _model_with_my_linear()
    with gradhooks.add_hooks(model, registry=_registry(rule)):
        raised(gradhooks.RuleError, ["for '0' (MyLinear)", says], lambda: _backward(model))


def test_a_rule_with_the_wrong_signature_is_refused_when_registered():
    """``@register(MyLinear) def rule(module, x, g)`` was accepted, and every backward of a
    hooked model then failed calling it."""
    registry = gradhooks.Registry()

    def rule(module, x, g):
        return {}

    raised(
        gradhooks.ConfigurationTypeError,
        "decorates a rule called as rule(call)",
        lambda: registry.register(MyLinear)(rule),
    )
    assert MyLinear not in registry


def test_registry_lookup_and_unregister_misused():
    """``registry.lookup("Linear")`` failed with an ``AttributeError``, ``lookup(nn.Linear)``
    answered ``None`` as if Linear had no rule; ``unregister`` of a type without a rule was a
    ``KeyError``. The registry is as it was after each."""
    registry = gradhooks.Registry()
    raised(gradhooks.ConfigurationTypeError, "got str 'Linear'",
           lambda: registry.lookup("Linear"))  # fmt: skip
    raised(gradhooks.ConfigurationTypeError, "got the class Linear",
           lambda: gradhooks.REGISTRY.lookup(nn.Linear))  # fmt: skip
    raised(gradhooks.ConfigurationError, "no rule is registered for MyLinear",
           lambda: registry.unregister(MyLinear))  # fmt: skip
    assert registry.types() == [] and gradhooks.REGISTRY.lookup(nn.Linear(2, 2)) is not None


def test_a_builtin_type_registered_again():
    """``@gradhooks.register(nn.Linear)`` a second rule for a built-in type: refused, naming
    the rule in place, which keeps serving."""
    before = gradhooks.REGISTRY.lookup(nn.Linear(2, 2)).rule
    raised(
        gradhooks.ConfigurationError,
        "a rule for Linear is already registered (gradhooks.rules.linear.linear)",
        lambda: gradhooks.register(nn.Linear)(three_by_three),
    )
    assert gradhooks.REGISTRY.lookup(nn.Linear(2, 2)).rule is before


def test_a_wrong_rule_for_a_subclass_shadows_the_builtin_and_is_caught():
    """A rule registered for a subclass that keeps Linear's ``forward`` serves the subclass
    alone (Linear keeps its own); where it is wrong (its input and output-gradient swapped,
    on a square layer: the right shape, transposed values), the first backward's check
    against autograd refuses it, writing no ``grad1``."""

    class Sub(nn.Linear):
        pass

    def swapped(call):
        a, g = call.inputs[0][:, None], call.grad_outputs[0][:, None]
        return {"weight": gradhooks.Outer(g, a), "bias": gradhooks.Direct(g[:, 0])}

    registry = gradhooks.Registry()
    registry.register(nn.Linear)(gradhooks.REGISTRY.lookup(nn.Linear(2, 2)).rule)
    registry.register(Sub)(swapped)
    assert registry.lookup(Sub(2, 2)).rule is swapped
    assert registry.lookup(nn.Linear(2, 2)).rule is not swapped
    torch.manual_seed(0)
    model = nn.Sequential(Sub(4, 4), nn.Tanh(), nn.Linear(4, 3))
    before = model_state(model)
    with gradhooks.add_hooks(model, registry=registry):
        raised(gradhooks.CheckFailedError, "'0.weight'", lambda: _backward(model))
    assert_untouched(model, before)


# -- a handle's life ------------------------------------------------------------------------------


def test_a_handle_reused_as_a_context_manager_after_its_block():
    """``h = add_hooks(model)``, ``with h:`` a step, then ``with h:`` the next: the first block
    removed the hooks, so the second captured nothing and the ``grad1`` of the first step was
    read as the second's, silently. Now the second ``with`` says so."""
    model = _mlp()
    h = gradhooks.add_hooks(model)
    with h:
        _backward(model)
    before = model_state(model)
    raised(gradhooks.StateError, "this handle's hooks were removed", lambda: h.__enter__())
    assert_untouched(model, before)
    with pytest.raises(gradhooks.StateError):
        with h:
            raise AssertionError("the block must not run")


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"batch_dim": "0"}, "batch_dim must be 'auto', an int >= 0 or None, got '0'"),
        ({"batch_dim": 1.0}, "got 1.0"),
        ({"loss_reduction": ("norms",)}, "loss_reduction must be 'mean' or 'sum', got ('norms',)"),
        ({"unsupported": None}, "unsupported must be 'fallback', 'error' or 'skip', got None"),
        ({"quantities": ()}, "quantities must be some of"),
    ],
    ids=["batch-dim-str", "batch-dim-float", "quantities-where-loss-reduction-goes",
         "unsupported-none", "quantities-empty"],
)  # fmt: skip
def test_add_hooks_arguments_of_the_wrong_kind(kwargs, says):
    """Each refused before anything is hooked (``add_hooks(model, ("norms",))`` puts the
    quantities where ``loss_reduction`` goes)."""
    model = _mlp()
    before = model_state(model)
    raised(gradhooks.ConfigurationError, says, lambda: gradhooks.add_hooks(model, **kwargs))
    assert_untouched(model, before)


def test_a_module_list_hooked_instead_of_a_model():
    """An ``nn.ModuleList`` has no forward of its own; its layers called one after the other
    are hooked as a model's are, and give the per-example loop's gradients."""
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)]).double()
    x, y = _batch()
    x = x.double()

    def run(inputs):
        for layer in layers:
            inputs = layer(inputs)
        return inputs

    with gradhooks.add_hooks(layers):
        F.cross_entropy(run(x), y).backward()
    want = loop_grad(nn.Sequential(*layers), F.cross_entropy, (x,), y)
    for name, p in layers.named_parameters():
        assert torch.allclose(p.grad1, want[name]), name

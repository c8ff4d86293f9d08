"""Mistakes in how a model is trained, a seventh set: a ``GradScaler`` whose scale is infinite,
NaN, zero or negative given to the DP step; the optimizer a ``DPOptimizer`` (or a
``make_private`` training) wraps stepped by hand; checkpoints, closures and parameter groups
of the wrong kind; a noise multiplier searched for an infinite ε or with no tolerance; a
Poisson loader over an ``IterableDataset``; K-FAC samplers, damping ranges, factors and
gradients of the wrong kind; ``register_function`` given a rule that is not a function;
flags and counts given as ``True`` or a string; ``check_rule`` given an input without a batch
dimension; the oracles given inputs and targets of different batch sizes; the privacy audit
given fractional counts or NaN. Each gives the documented meaning, compared in float64 with each example's own
gradient by the per-example loop (:func:`gradhooks.oracle.loop_grad`), or stops with the typed
error of its kind, whose message names what was refused, leaving the parameters, ``.grad``,
``grad1``, the hooks and the optimizer's state as they were (``tests/test_misuse.py`` to
``tests/test_misuse_sixth.py`` hold the earlier sets)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_misuse_fifth import assert_all_untouched, clipped_mean, close, full_state, loop
from torch import nn
from torch.utils.data import IterableDataset, TensorDataset

import gradhooks
from gradhooks import audit
from gradhooks.oracle import loop_grad, vmap_grad
from harness import assert_untouched, labelled_batch, mlp, model_state, raised

BOUND = 0.5  # small enough that the examples of labelled_batch are clipped


def losses_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y, reduction="none")


def dp_optimizer(model: nn.Module, h: gradhooks.Hooks, **more) -> gradhooks.DPOptimizer:
    """A DPOptimizer without noise (its ``.grad`` is then the loop's clipped mean) over SGD."""
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    return gradhooks.DPOptimizer(
        sgd, h, max_grad_norm=BOUND, noise_multiplier=0.0, expected_batch_size=5, **more
    )


def assert_clipped_mean(model: nn.Module, want: dict) -> None:
    for name, p in model.named_parameters():
        close(p.grad, clipped_mean(want, BOUND)[name], name)


# -- a GradScaler whose scale no step can use ----------------------------------------------------

SCALES = [math.inf, math.nan, 0.0, -1.0]


def scaled_step(kind: str, model: nn.Module, h, scaler, x, y) -> None:
    if kind == "dp_sgd_step":
        gradhooks.dp_sgd_step(
            h, losses_of(model, x, y), max_norm=BOUND, noise_multiplier=0.0, scaler=scaler
        )
        for p in model.parameters():  # (scaler.step(optimizer) would unscale them)
            p.grad /= scaler.get_scale()
    elif kind == "clipped_sum":
        got = gradhooks.clipped_sum(h, losses_of(model, x, y), max_norm=BOUND, scaler=scaler)
        for p, s in zip(got.params, got.sums, strict=True):
            p.grad = s / len(x)  # (returned unscaled)
    else:
        opt = dp_optimizer(model, h, scaler=scaler)
        opt.backward(losses_of(model, x, y))
        opt.optimizer.step = lambda *a, **k: None  # (the .grad of the step, not its update)
        opt.step()


@pytest.mark.parametrize("kind", ["dp_sgd_step", "clipped_sum", "DPOptimizer"])
@pytest.mark.parametrize("scale", SCALES, ids=["inf", "nan", "zero", "negative"])
def test_a_grad_scaler_whose_scale_is_not_a_finite_positive_number_is_refused(kind, scale):
    """A ``GradScaler(init_scale=inf)`` (or one loaded from a diverged run's checkpoint with
    a scale of inf or NaN) overflowed every scaled gradient: each DP step was skipped and
    ``scaler.update()`` never brought the scale back (``inf · 0.5`` is inf), the model never
    trained, silently; a scale of 0 did the same through NaN, and a negative one gave negative
    norms, so that no example was clipped. Refused at the step, naming the scale, nothing
    changed; a scaler of a finite scale (a power of two: exact) gives the loop's clipped
    mean."""
    model = mlp()
    x, y = labelled_batch(1)
    want = loop(model, x, y)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        before = full_state(model)
        scaler = torch.amp.GradScaler("cpu", init_scale=scale)
        raised(
            gradhooks.ConfigurationError,
            ["GradScaler's scale is", "finite number > 0", "Nothing was changed"],
            lambda: scaled_step(kind, model, h, scaler, x, y),
        )  # fmt: skip
        assert_all_untouched(model, before)
        scaled_step(kind, model, h, torch.amp.GradScaler("cpu", init_scale=2.0**10), x, y)
    assert_clipped_mean(model, want)


# -- the wrapped optimizer stepped by hand -------------------------------------------------------


def test_the_optimizer_a_dp_optimizer_wraps_stepped_by_hand_is_refused():
    """``sgd.step()`` on the optimizer given to ``DPOptimizer`` (the name kept from the loop
    without DP, after a plain ``loss.backward()``): the step moved the model by the unclipped,
    unnoised gradient and the accountant recorded nothing, silently. Refused before the step,
    the model as it was; the DPOptimizer's own step is the loop's clipped mean, and once the
    hooks are removed the optimizer steps freely again."""
    model = mlp()
    x, y = labelled_batch(1)
    want = loop(model, x, y)
    accountant = gradhooks.PrivacyAccountant()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = dp_optimizer(model, h, sample_rate=0.1, accountant=accountant)
        sgd = opt.optimizer
        F.cross_entropy(model(x), y).backward()
        before = model_state(model)
        raised(
            gradhooks.StateError,
            ["SGD.step()", "gradhooks.DPOptimizer", "neither clipped nor noised",
             "dp_optimizer.step()", "did not step"],
            sgd.step,
        )  # fmt: skip
        assert_untouched(model, before)
        assert not sgd.state and accountant.steps == 0
        sgd.zero_grad()
        opt.backward(losses_of(model, x, y))
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert opt.step() and accountant.steps == 1
        assert_clipped_mean(model, want)
        for name, p in model.named_parameters():
            close(p.detach(), weights[name] - 0.1 * clipped_mean(want, BOUND)[name], name)
    stepped = {n: p.detach().clone() for n, p in model.named_parameters()}
    sgd.step()  # (the hooks removed: DP training is over)
    for name, p in model.named_parameters():
        close(p.detach(), stepped[name] - 0.1 * p.grad, name)


def test_the_optimizer_a_private_training_wraps_stepped_by_hand_is_refused():
    """The same under ``make_private``: the optimizer given to it stepped by hand took a
    non-private step, which ``private.batches()`` noticed only at the next batch, after the
    model had moved. Refused at the step; after ``private.close()`` it steps again."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(40, 3, dtype=torch.float64), torch.randint(0, 2, (40,)))
    model = mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    private = gradhooks.make_private(
        model, sgd, data, delta=1e-3, max_grad_norm=1.0, noise_multiplier=1.0, steps=2,
        expected_batch_size=8, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    x, y = next(iter(private.batches()))
    F.cross_entropy(model(x), y).backward()
    before = model_state(model)
    raised(
        gradhooks.StateError,
        ["SGD.step()", "make_private", "private.step()", "did not step"],
        sgd.step,
    )  # fmt: skip
    assert_untouched(model, before)
    assert private.steps_taken == 0 and private.epsilon == 0.0
    private.close()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    sgd.step()
    for name, p in model.named_parameters():
        close(p.detach(), before["params"][name] - 0.1, name)


# -- arguments of the wrong kind -----------------------------------------------------------------


def test_checkpoints_that_are_not_dictionaries_are_refused():
    """``load_state_dict`` given a path or a list instead of the loaded dictionary: an
    ``AttributeError`` from deep inside (``'str' object has no attribute 'get'``). Refused by
    type, the accountant's history and the optimizer's state as they were."""
    accountant = gradhooks.PrivacyAccountant()
    accountant.step(noise_multiplier=1.0, sample_rate=0.1, steps=3)
    for bad in ("ckpt.pt", [("rdp", [])]):
        raised(gradhooks.ConfigurationTypeError, "PrivacyAccountant.load_state_dict",
               lambda bad=bad: accountant.load_state_dict(bad))  # fmt: skip
        assert accountant.history == [(1.0, 0.1, 3)]
    model = mlp()
    x, y = labelled_batch(1)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = dp_optimizer(model, h)
        opt.backward(losses_of(model, x, y))
        opt.step()
        state = opt.state_dict()
        raised(gradhooks.ConfigurationTypeError, "DPOptimizer.load_state_dict",
               lambda: opt.load_state_dict("ckpt.pt"))  # fmt: skip
        assert opt.state_dict() == state


def test_a_dp_optimizer_given_a_closure_or_a_param_group_of_the_wrong_kind():
    """``opt.step(3)`` (a closure that is not a function) failed with ``'int' object is not
    callable``; ``opt.add_param_group(params)`` (the parameters alone, not a dict) with
    ``string indices must be integers``. Both refused by type, the buffer of the backward
    kept: the step after is the loop's clipped mean."""
    model = mlp()
    x, y = labelled_batch(1)
    want = loop(model, x, y)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = dp_optimizer(model, h)
        opt.optimizer.step = lambda *a, **k: None  # (the .grad of the step, not its update)
        opt.backward(losses_of(model, x, y))
        before = model_state(model)
        raised(gradhooks.ConfigurationTypeError, "closure must be a function",
               lambda: opt.step(3))  # fmt: skip
        raised(gradhooks.ConfigurationTypeError, "add_param_group takes a dict with 'params'",
               lambda: opt.add_param_group(list(model.parameters())))  # fmt: skip
        assert_untouched(model, before)
        assert opt.examples == 5 and len(opt.param_groups) == 1
        opt.step()
    assert_clipped_mean(model, want)


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"target_epsilon": math.inf}, "(and finite"),
        ({"tol": 0.0}, "tol is the precision"),
        ({"tol": -1e-4}, "tol is the precision"),
        ({"tol": "1e-4"}, "tol must be a number"),
    ],
    ids=["epsilon-inf", "tol-zero", "tol-negative", "tol-string"],
)
def test_a_noise_multiplier_searched_for_an_infinite_epsilon_or_without_tolerance(kwargs, says):
    """``noise_multiplier_for(math.inf, ...)`` (no budget at all) failed inside
    dp_accounting's search (``brentq raised ValueError``), ``tol=0`` with dp_accounting's own
    ``ValueError``. Refused as gradhooks' errors; with a finite target the σ found spends at
    most it."""
    args = {"target_epsilon": 2.0, "delta": 1e-5, "sample_rate": 0.01, "steps": 100}
    error = gradhooks.ConfigurationError
    if says.endswith("number"):
        error = gradhooks.ConfigurationTypeError
    raised(error, says, lambda: gradhooks.noise_multiplier_for(**{**args, **kwargs}))
    sigma = gradhooks.noise_multiplier_for(**args)
    accountant = gradhooks.PrivacyAccountant()
    accountant.step(noise_multiplier=sigma, sample_rate=0.01, steps=100)
    assert accountant.epsilon(1e-5) <= 2.0


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(TensorDataset(torch.randn(8, 3)))


def test_a_poisson_loader_over_a_stream_or_with_a_collate_that_is_not_a_function():
    """``poisson_loader`` over an ``IterableDataset`` failed with ``object of type ... has no
    len()``; a ``collate_fn`` that is not a function, only when the first batch was drawn
    (``'int' object is not callable``). Both refused when the loader is made."""
    raised(gradhooks.ConfigurationTypeError, ["poisson_loader", "_Stream", "map-style"],
           lambda: gradhooks.poisson_loader(_Stream(), 2))  # fmt: skip
    data = TensorDataset(torch.randn(8, 3))
    raised(gradhooks.ConfigurationTypeError, "collate_fn must be a function",
           lambda: gradhooks.poisson_loader(data, 2, collate_fn=3))  # fmt: skip
    loader = gradhooks.poisson_loader(data, 2, generator=torch.Generator().manual_seed(0))
    rows = torch.cat([x for (x,) in loader])
    assert all(any(torch.equal(r, d) for (d,) in data) for r in rows)


def test_flags_and_counts_given_as_true_or_a_string_are_refused():
    """``True`` is an ``int`` to Python, and ``"no"`` is true: ``register(nn.Linear,
    overwrite="no")`` replaced the built-in Linear rule, silently; ``KFAC(factors_every=True)``,
    ``PoissonSampler(True, 1)``, ``PoissonSampler(..., steps=True)``,
    ``convert_batch_norm(model, True)`` and ``make_private(max_physical_batch_size=True)``
    took ``True`` as 1. Each refused by type (as ``kfac(mc_samples=True)`` and
    ``set_memory_limit(True)`` already were), nothing changed: the built-in rule still gives
    the loop's per-example gradients, the BatchNorm is still there, the model has no hooks."""
    linear = gradhooks.REGISTRY.lookup(nn.Linear(1, 1))
    raised(gradhooks.ConfigurationTypeError, "register(overwrite=...) takes True or False",
           lambda: gradhooks.register(nn.Linear, overwrite="no")(lambda call: {}))  # fmt: skip
    assert gradhooks.REGISTRY.lookup(nn.Linear(1, 1)) is linear
    model = mlp()
    x, y = labelled_batch(1)
    want = loop(model, x, y)
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x), y).backward()
    for name, p in model.named_parameters():
        close(p.grad1, want[name], name)
    raised(gradhooks.ConfigurationTypeError, "factors_every must be a number",
           lambda: gradhooks.KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  factors_every=True))  # fmt: skip
    raised(gradhooks.ConfigurationTypeError, "num_examples must be a number",
           lambda: gradhooks.PoissonSampler(True, 1))  # fmt: skip
    raised(gradhooks.ConfigurationTypeError, "steps must be a number",
           lambda: gradhooks.PoissonSampler(10, 2, steps=True))  # fmt: skip
    net = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6))
    raised(gradhooks.ConfigurationTypeError, "num_groups must be a positive int",
           lambda: gradhooks.convert_batch_norm(net, True))  # fmt: skip
    assert isinstance(net[1], nn.BatchNorm2d)
    data = TensorDataset(torch.randn(40, 3, dtype=torch.float64), torch.randint(0, 2, (40,)))
    before = full_state(model)
    raised(gradhooks.ConfigurationTypeError, "max_physical_batch_size must be a number",
           lambda: gradhooks.make_private(
               model, torch.optim.SGD(model.parameters(), lr=0.1), data, delta=1e-3,
               max_grad_norm=1.0, noise_multiplier=1.0, steps=2, expected_batch_size=8,
               max_physical_batch_size=True))  # fmt: skip
    assert_all_untouched(model, before)


def test_register_function_refuses_a_rule_that_is_not_a_function_and_keeps_the_old_one():
    """``registry.register_function("linear", rule, ...)`` is shared by every registry: given
    a rule that is not a function (or ``params`` that are not ``{name: (position,
    keyword)}``), it replaced the built-in rule of ``F.linear``, and every later tied output
    layer failed inside the hook (``'int' object is not callable``). Refused by type, the
    built-in rule kept: a weight used through ``F.linear`` still gets the loop's gradients."""
    registry = gradhooks.Registry()
    builtin = registry.function("linear")
    for rule, params in [(3, {"weight": (1, "weight")}), (lambda call: {}, "weight"),
                         (lambda call: {}, {"weight": 1})]:  # fmt: skip
        raised(gradhooks.ConfigurationTypeError, "register_function('linear')",
               lambda rule=rule, params=params: registry.register_function(
                   "linear", rule, params))  # fmt: skip
        assert registry.function("linear") == builtin
    model = mlp()
    x, y = labelled_batch(1)

    class Tied(nn.Module):  # (the second layer's weight used outside its call)
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, x):
            return F.linear(torch.tanh(self.net[0](x)), self.net[2].weight, self.net[2].bias)

    tied = Tied()
    want = loop(tied, x, y)
    with gradhooks.add_hooks(tied):
        F.cross_entropy(tied(x), y).backward()
    for name, p in tied.named_parameters():
        close(p.grad1, want[name], name)


# -- K-FAC ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("given", ["sample_target", "output_grads"])
def test_kfac_samplers_that_are_not_functions_are_refused_before_the_forward(given):
    """``kfac(..., sample_target=labels)`` (the labels rather than a function drawing them)
    ran the forward and failed with ``'Tensor' object is not callable``, with the model's
    hooks and buffers to clean up. Refused before anything runs."""
    model = mlp()
    x, y = labelled_batch(1)
    before = full_state(model)
    raised(gradhooks.ConfigurationTypeError, [given, "must be a function"],
           lambda: gradhooks.kfac(model, x, y, **{given: y}))  # fmt: skip
    assert_all_untouched(model, before)


def test_kfac_factors_and_gradients_of_the_wrong_kind():
    """K-FAC factors made by hand (or loaded) with a non-square ``A``, factors whose groups
    differ, or an unknown ``layout`` (taken as ``"in_out"``, silently) are refused when made;
    ``apply`` given something other than a tensor (``'str' object has no attribute 'shape'``)
    and ``KFAC(damping_range=...)`` not a pair (``not enough values to unpack``) by type. The
    inverse of good factors preconditions as ``(kron(G, A) + λI)⁻¹`` in float64."""
    eye = torch.eye(3, dtype=torch.float64)
    raised(gradhooks.ConfigurationTypeError, "A must be a square matrix",
           lambda: gradhooks.KFactors(torch.ones(3, 4), torch.eye(2), False))  # fmt: skip
    raised(gradhooks.ConfigurationTypeError, "G must be a square matrix",
           lambda: gradhooks.KFactors(eye, "G", False))  # fmt: skip
    raised(gradhooks.ConfigurationError, "same groups",
           lambda: gradhooks.KFactors(torch.stack([eye, eye]), torch.eye(2), False))  # fmt: skip
    raised(gradhooks.ConfigurationError, "layout must be 'out_in' or 'in_out'",
           lambda: gradhooks.KFactors(eye, torch.eye(2), False, layout="io"))  # fmt: skip
    model = mlp()
    x, y = labelled_batch(1)
    raised(gradhooks.ConfigurationTypeError, "damping_range must be a pair",
           lambda: gradhooks.KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                  damping_range=1.0))  # fmt: skip
    factors = gradhooks.kfac(model, x, y, fisher="empirical")
    k = factors["0.weight"]
    inverse = k.inverse(0.1)
    raised(gradhooks.ConfigurationTypeError, "apply takes the weight's gradient as a tensor",
           lambda: inverse.apply("grad"))  # fmt: skip
    g = torch.randn(5, 4, dtype=torch.float64)  # (weight [5, 3] and its bias column)
    want = torch.linalg.solve(torch.kron(k.G, k.A) + 0.1 * torch.eye(20, dtype=torch.float64),
                              g.flatten()).view(5, 4)  # fmt: skip
    close(inverse.apply(g), want, "preconditioned")


# -- the checks and the references ----------------------------------------------------------------


def test_check_rule_of_an_input_without_a_batch_dimension_names_the_layer():
    """``check_rule(nn.Linear(3, 2), torch.randn(3))`` (one example without its batch
    dimension) failed with ``mat1 and mat2 shapes cannot be multiplied`` inside vmap, the
    reference's: the rule's own ``UnbatchedInputError`` now comes first; the module given is
    not changed, and with the batch dimension the check passes."""
    layer = nn.Linear(3, 2)
    before = model_state(layer)
    x = torch.randn(3)
    raised(gradhooks.UnbatchedInputError, ["(Linear)", "(3,)", "x.unsqueeze(0)"],
           lambda: gradhooks.check_rule(layer, x))  # fmt: skip
    assert_untouched(layer, before)
    assert gradhooks.check_rule(layer, x.unsqueeze(0)).ok


@pytest.mark.parametrize("oracle", [loop_grad, vmap_grad], ids=["loop", "vmap"])
def test_the_oracles_refuse_inputs_and_targets_of_other_batch_sizes(oracle):
    """``loop_grad(model, loss, (x,), y)`` with ``y`` one row longer than ``x`` (the labels of
    the whole batch with the inputs of a truncated one) returned the gradients of the first
    ``len(x)`` examples, silently, the last label never used; a second input longer than the
    first was cut the same way; ``vmap_grad`` failed inside vmap. Both oracles refuse them,
    naming the shapes, and a model or loss of the wrong type by type; given matching batches
    the two agree."""
    bilinear = nn.Bilinear(3, 4, 2).double()
    x, y = labelled_batch(1)
    z = torch.randn(6, 4, dtype=torch.float64)
    calls = {  # (by what is wrong)
        "longer target": lambda: oracle(mlp(), F.cross_entropy, (x,), torch.cat([y, y[:1]])),
        "longer input": lambda: oracle(bilinear, F.cross_entropy, (x, z), y),
        "no batch in the target": lambda: oracle(mlp(), F.cross_entropy, (x,), y[0]),
    }
    for call in calls.values():
        raised(gradhooks.ConfigurationError, "do not agree", call)
    raised(gradhooks.ConfigurationTypeError, "model must be an nn.Module",
           lambda: oracle(mlp().state_dict(), F.cross_entropy, (x,), y))  # fmt: skip
    raised(gradhooks.ConfigurationTypeError, "loss_fn must be a function",
           lambda: oracle(mlp(), "cross_entropy", (x,), y))  # fmt: skip
    other = vmap_grad if oracle is loop_grad else loop_grad
    got = oracle(bilinear, F.cross_entropy, (x, z[:5]), y)
    for name, g in other(bilinear, F.cross_entropy, (x, z[:5]), y).items():
        close(got[name], g, name)


def test_the_privacy_audit_refuses_fractional_counts_and_nan():
    """``one_run_p_value(10.5, ...)`` returned a p-value of no experiment, ``epsilon=nan``
    a p-value of 1 (NaN compared false with every bound), ``epsilon_lower_bound`` of NaN
    scores a bound from an arbitrary order of the canaries, and ``guesses=2.5`` failed with
    ``slice indices must be integers``. Each refused, naming the value; whole counts give
    the binomial tail (δ = 0: the probability of ``correct`` or more right guesses)."""
    raised(gradhooks.ConfigurationError, "canaries counts canaries: a whole number",
           lambda: audit.one_run_p_value(10.5, 4, 3, 1.0, 0.0))  # fmt: skip
    raised(gradhooks.ConfigurationError, "need epsilon >= 0",
           lambda: audit.one_run_p_value(10, 4, 3, math.nan, 0.0))  # fmt: skip
    scores = torch.randn(20, generator=torch.Generator().manual_seed(0))
    included = torch.arange(20) % 2 == 0
    raised(gradhooks.ConfigurationError, "scores must be finite",
           lambda: audit.epsilon_lower_bound(torch.where(included, scores, math.nan), included,
                                             guesses=4, delta=0.0))  # fmt: skip
    raised(gradhooks.ConfigurationError, "guesses counts canaries",
           lambda: audit.epsilon_lower_bound(scores, included, guesses=2.5, delta=0.0))  # fmt: skip
    q = 1 / (1 + math.exp(-1.0))
    tail = sum(math.comb(4, k) * q**k * (1 - q) ** (4 - k) for k in range(3, 5))
    assert math.isclose(audit.one_run_p_value(10, 4, 3, 1.0, 0.0), tail, rel_tol=1e-9)

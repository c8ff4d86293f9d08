"""Mistakes of DP-SGD and K-FAC users, a fourteenth set: a weight frozen between the forward
and the DP step (found and fixed: the book-keeping step, the default, still clipped each
example by its norm with the frozen weight's gradient in it, unlike the other methods and the
per-example loop, and refused it with per-layer clipping), a weight frozen between two DP steps
without ``zero_grad`` (found and fixed: the optimizer stepped it again on the last step's
gradient at every step after, ``dp_sgd_step`` needing no ``zero_grad``, and a ``DPOptimizer``'s
step too) and unfrozen again; a ``DPOptimizer`` stepped over logical batches without
``zero_grad``, and given by ``add_param_group`` a tensor that is not the model's (its message
named the wrong group and the wrong cause); the bound and the noise given as numpy scalars or
0-d tensors (one that requires grad too); the accountant given the expected batch size for the
sampling rate, fractional steps, or asked before any step; the squared-gradient sums and norms
read after two backwards without ``zero_grad``, or after a forward without its backward;
``model.eval()`` between a dropout forward and its backward; K-FAC factors of a backward run
twice through a kept graph. Each gives the
documented meaning, compared in float64 with each example's own gradient by the per-example
loop (:func:`gradhooks.oracle.loop_grad`) or ``torch.func``, with the noise drawn by hand from
a generator of the same seed, or stops with the typed error of its kind, whose message names
what was refused and what to do, leaving the parameters, ``.grad``, ``grad1``, the hooks and
the optimizer as they were (``tests/test_misuse.py`` to ``tests/test_misuse_thirteenth.py``
hold the earlier sets)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_close, assert_untouched, model_state, one_thread, raised

D = torch.float64
assert one_thread  # (autouse: one intra-op thread for these tiny models)

C, SIGMA = 0.5, 0.7


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(D)


def _batch(seed: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g, dtype=D), torch.randint(3, (n,), generator=g)


def _losses(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y, reduction="none")


def _want(model, x, y, seed: int, groups: str | None = None, sigma: float = SIGMA) -> dict:
    """The DP step by the float64 per-example loop, over the parameters trainable now: per
    parameter (in ``named_parameters()`` order, that of the noise) the clipped sum plus
    ``σ·C`` times the Gaussian drawn by hand, over the batch. ``groups="layer"``: each layer's
    part of an example's gradient clipped to ``C/√K`` (``K`` layers with a trainable
    parameter)."""
    loop = loop_grad(model, F.cross_entropy, x, y)  # (the trainable parameters only)
    layer = {name: name.rsplit(".", 1)[0] for name in loop}
    if groups is None:
        members = {"all": list(loop)}
    else:
        members = {k: [n for n in loop if layer[n] == k] for k in dict.fromkeys(layer.values())}
    bound = C / math.sqrt(len(members))
    factor = {}
    for names in members.values():
        norms = torch.cat([loop[n].flatten(1) for n in names], 1).norm(dim=1)
        for n in names:
            factor[n] = (bound / norms).clamp(max=1.0)
    gen = torch.Generator().manual_seed(seed)
    return {
        n: (torch.einsum("b,b...->...", factor[n], g)
            + sigma * C * torch.randn(g.shape[1:], generator=gen, dtype=D)) / len(x)
        for n, g in loop.items()
    }  # fmt: skip


def _dp_optimizer(model, hooks, inner=None, **kwargs) -> gradhooks.DPOptimizer:
    inner = inner or torch.optim.SGD(model.parameters(), lr=0.1)
    return gradhooks.DPOptimizer(
        inner, hooks, max_grad_norm=C, noise_multiplier=SIGMA, expected_batch_size=4, **kwargs
    )


def _step(how: str, hooks, model, losses, seed: int, opt=None, groups=None) -> None:
    """One DP step of ``losses``, by ``dp_sgd_step`` of a method or by ``opt``, a
    ``DPOptimizer`` (``how="DPOptimizer"``), with the noise of ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    if how == "DPOptimizer":
        opt.generator = gen
        opt.backward(losses)
        opt.step()
        return
    gradhooks.dp_sgd_step(
        hooks, losses, max_norm=C, noise_multiplier=SIGMA, method=how, generator=gen,
        clipping_groups=groups,
    )  # fmt: skip
    if opt is not None:
        opt.step()


# -- found and fixed ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "how, groups",
    [("bookkeeping", None), ("ghost", None), ("grad1", None), ("bookkeeping", "layer"),
     ("grad1", "layer"), ("DPOptimizer", None)],
)  # fmt: skip
def test_a_weight_frozen_between_the_forward_and_the_dp_step_is_left_out_of_the_clipping(
    how, groups
):
    """``requires_grad_(False)`` on a weight after the losses are computed (a schedule that
    freezes it at this step): autograd gives it no gradient, so each example's gradient is
    that of the others, and its clipping factor theirs. The book-keeping step (the default)
    clipped each example by the norm with the frozen weight's gradient in it: a smaller factor
    than the per-example loop's and the other methods', in silence (here up to 0.011 off in a
    gradient of 0.1); with per-layer clipping it refused the step. Every method now clips the
    parameters trainable when the step runs, as the loop does, and leaves the weight's ``.grad``
    ``None``."""
    model = _mlp()
    x, y = _batch(1)
    quantity = "grad1" if how == "grad1" else "norms"
    with gradhooks.add_hooks(model, quantities=(quantity,)) as h:
        opt = _dp_optimizer(model, h) if how == "DPOptimizer" else None
        losses = _losses(model, x, y)
        model[0].weight.requires_grad_(False)
        want = _want(model, x, y, seed=3, groups=groups)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        _step(how, h, model, losses, seed=3, opt=opt, groups=groups)
    assert model[0].weight.grad is None
    assert torch.equal(model[0].weight, before["0.weight"])
    for name, p in model.named_parameters():
        if name != "0.weight":
            assert_close(p.grad, want[name], f"{how}, {groups}: {name}")


@pytest.mark.parametrize("how", ["bookkeeping", "ghost", "grad1", "DPOptimizer"])
def test_a_weight_frozen_between_two_dp_steps_without_zero_grad_stays_where_it_was(how):
    """``dp_sgd_step`` writes ``.grad`` whole at each step, so no ``zero_grad()`` is needed;
    a weight frozen between two steps kept the ``.grad`` the last step wrote, and the
    optimizer (SGD with momentum here) stepped it again on that gradient at every step after:
    a frozen weight that kept moving, in silence (a ``DPOptimizer`` stepped without
    ``zero_grad`` too). The step now sets such a ``.grad`` (its own, unchanged) to ``None``,
    as ``zero_grad()`` would have: the weight stays, the others step on the loop's clipped
    gradients; unfrozen again, it is clipped with the others at the next step."""
    model = _mlp()
    quantity = "grad1" if how == "grad1" else "norms"
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with gradhooks.add_hooks(model, quantities=(quantity,)) as h:
        opt = _dp_optimizer(model, h, inner) if how == "DPOptimizer" else inner
        for step, change in enumerate(["as it is", "frozen", "frozen", "unfrozen"]):
            model[0].weight.requires_grad_(change != "frozen")
            x, y = _batch(10 + step)
            want = _want(model, x, y, seed=step)
            frozen = model[0].weight.detach().clone()
            _step(how, h, model, _losses(model, x, y), seed=step, opt=opt)
            for name, p in model.named_parameters():
                if p.requires_grad:
                    assert_close(p.grad, want[name], f"{how}, step {step} ({change}): {name}")
                else:
                    assert p.grad is None, f"{how}, step {step}: frozen {name} has a .grad"
                    assert torch.equal(p, frozen), f"{how}, step {step}: frozen {name} moved"


def test_a_dp_optimizer_given_a_tensor_not_of_the_model_by_add_param_group():
    """``opt.add_param_group({"params": [extra]})`` with a tensor that is not the hooked
    model's (a new layer not put in the model): refused, as before, but the message named
    ``param_groups[0]`` (the group in a probe of its own) and a parameter replaced by
    ``load_state_dict(assign=True)``; it now names ``add_param_group``, the new group's
    place, the shape and what to do. The optimizer keeps its groups, the model is as it was,
    and the next step is the loop's."""
    model = _mlp()
    x, y = _batch(2)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = _dp_optimizer(model, h)
        before, groups = model_state(model), len(opt.param_groups)
        extra = nn.Parameter(torch.zeros(3, dtype=D))
        raised(
            gradhooks.ConfigurationError,
            ["DPOptimizer.add_param_group", "param_groups[1]", "shape (3,)",
             "not one of the hooked model's (Sequential)", "put it in the model first",
             "Nothing was changed"],
            lambda: opt.add_param_group({"params": [extra], "lr": 0.01}),
        )  # fmt: skip
        assert len(opt.param_groups) == len(opt.optimizer.param_groups) == groups
        assert_untouched(model, before)
        want = _want(model, x, y, seed=5)
        _step("DPOptimizer", h, model, _losses(model, x, y), seed=5, opt=opt)
    for name, p in model.named_parameters():
        assert_close(p.grad, want[name], name)


# -- the right answer, kept --------------------------------------------------------------------


def test_a_dp_optimizer_stepped_over_logical_batches_without_zero_grad():
    """``opt.backward(losses); opt.step()`` batch after batch, ``zero_grad()`` forgotten: each
    step writes its own batch's noised clipped sum, which the last step's ``.grad`` does not
    enter, as the loop gives it at the weights of that step."""
    model = _mlp()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = _dp_optimizer(model, h)
        for step in range(3):
            x, y = _batch(20 + step)
            want = _want(model, x, y, seed=step)
            _step("DPOptimizer", h, model, _losses(model, x, y), seed=step, opt=opt)
            for name, p in model.named_parameters():
                assert_close(p.grad, want[name], f"step {step}: {name}")


@pytest.mark.parametrize(
    "kind",
    [np.float64, np.float32, lambda v: torch.tensor(v, dtype=D),
     lambda v: torch.tensor(v, dtype=D, requires_grad=True)],
    ids=["numpy-float64", "numpy-float32", "tensor", "tensor-requiring-grad"],
)  # fmt: skip
@pytest.mark.parametrize("method", ["bookkeeping", "ghost"])
def test_bound_and_noise_given_as_numpy_scalars_or_tensors_step_as_their_floats(kind, method):
    """``max_norm`` and ``noise_multiplier`` read from a config as numpy scalars, or kept as
    0-d tensors (one that requires grad, a learned σ): the step is that of their values as
    Python floats, bit for bit, and ``.grad`` carries no autograd history."""
    x, y = _batch(3)
    grads = []
    for bound, sigma in [(C, SIGMA), (kind(C), kind(SIGMA))]:
        model = _mlp()
        with gradhooks.add_hooks(model, quantities=("norms",)) as h:
            with warnings.catch_warnings():  # (torch's, on float() of a tensor needing grad)
                warnings.filterwarnings("ignore", "Converting a tensor with requires_grad")
                gradhooks.dp_sgd_step(
                    h, _losses(model, x, y), max_norm=bound, noise_multiplier=sigma,
                    method=method, generator=torch.Generator().manual_seed(7),
                )  # fmt: skip
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[1].items():
        assert g.grad_fn is None and not g.requires_grad, name
        want = grads[0][name]
        if kind is np.float32:  # (float32's values: 0.5 exactly, σ rounded)
            assert_close(g, want, name)
        else:
            assert torch.equal(g, want), name


@pytest.mark.parametrize(
    "kwargs, says",
    [(dict(noise_multiplier=1.0, sample_rate=64), ["sample_rate must be in [0, 1]",
      "expected batch size / number of examples", "got 64"]),
     (dict(noise_multiplier=1.0, sample_rate=0.01, steps=2.5),
      ["steps must be a whole number", "got 2.5"]),
     (dict(noise_multiplier=-1.0, sample_rate=0.01), ["noise_multiplier", "got -1.0"])],
    ids=["expected-batch-size-for-the-rate", "fractional-steps", "negative-noise"],
)  # fmt: skip
def test_an_accountant_stepped_with_numbers_it_cannot_take_records_nothing(kwargs, says):
    """``accountant.step(sample_rate=64)`` (the expected batch size given for the rate), a
    fractional count of steps, a negative σ: refused naming the value and what it should be,
    and the accountant has recorded nothing (its ε is still that of no step, 0)."""
    pytest.importorskip("dp_accounting")
    accountant = gradhooks.PrivacyAccountant()
    raised(gradhooks.ConfigurationError, says, lambda: accountant.step(**kwargs))
    assert accountant.steps == 0 and accountant.epsilon(1e-5) == 0.0


def test_an_accountant_given_numpy_and_tensor_numbers_spends_as_their_floats():
    """σ and the rate as numpy scalars or 0-d tensors (the loader's rate kept as a tensor),
    and whole steps as a float or a numpy integer: the same ε as the Python numbers, and the
    same count of steps."""
    pytest.importorskip("dp_accounting")
    plain = gradhooks.PrivacyAccountant()
    plain.step(noise_multiplier=1.1, sample_rate=0.01, steps=3)
    other = gradhooks.PrivacyAccountant()
    other.step(noise_multiplier=np.float64(1.1), sample_rate=torch.tensor(0.01, dtype=D))
    other.step(noise_multiplier=torch.tensor(1.1, dtype=D), sample_rate=np.float64(0.01),
               steps=np.int64(1))  # fmt: skip
    other.step(noise_multiplier=1.1, sample_rate=0.01, steps=1.0)
    assert other.steps == plain.steps == 3
    assert other.epsilon(1e-5) == pytest.approx(plain.epsilon(1e-5), rel=1e-12)


def test_squared_sums_and_norms_after_two_backwards_without_zero_grad_are_the_seconds():
    """Two batches' backwards, neither ``zero_grad`` nor ``clear`` between: ``grad1`` adds
    the two (as ``.grad`` does), while the squared sums, the variance and the norms are each
    backward's own, as documented: the second batch's, not a sum of squares of the sums."""
    model = _mlp()
    (x1, y1), (x2, y2) = _batch(30), _batch(31)
    first = loop_grad(model, F.cross_entropy, x1, y1)
    second = loop_grad(model, F.cross_entropy, x2, y2)
    with gradhooks.add_hooks(model, quantities=("grad1", "sum_grad_sq", "norms")) as h:
        F.cross_entropy(model(x1), y1).backward()
        F.cross_entropy(model(x2), y2).backward()
        sq, var, norms = h.sum_grad_sq(), h.grad_variance(), h.norms()
    for name, p in model.named_parameters():
        g = second[name]
        assert_close(p.grad1, first[name] + g, f"grad1 of {name}")
        assert_close(sq[name], g.square().sum(0), f"sum_grad_sq of {name}")
        want_var = (g.square().mean(0) - g.mean(0).square()).clamp(min=0)
        assert_close(var[name], want_var, f"grad_variance of {name}")
    assert_close(norms, torch.cat([g.flatten(1) for g in second.values()], 1).norm(dim=1), "norms")


def test_quantities_read_after_a_forward_of_another_batch_without_its_backward():
    """The norms, squared sums and variance read after a forward of another batch size with
    grad on (a validation batch) whose backward never came: they are the last backward's, of
    its batch, as ``grad1`` is; that forward's capture enters none of them."""
    model = _mlp()
    x, y = _batch(32)
    want = loop_grad(model, F.cross_entropy, x, y)
    with gradhooks.add_hooks(model, quantities=("sum_grad_sq", "norms")) as h:
        F.cross_entropy(model(x), y).backward()
        model(_batch(33, n=3)[0])
        sq, var, norms = h.sum_grad_sq(), h.grad_variance(), h.norms()
    for name, g in want.items():
        assert_close(sq[name], g.square().sum(0), f"sum_grad_sq of {name}")
        want_var = (g.square().mean(0) - g.mean(0).square()).clamp(min=0)
        assert_close(var[name], want_var, f"grad_variance of {name}")
    assert_close(norms, torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1), "norms")


def test_eval_between_a_dropout_forward_and_its_backward():
    """``model.eval()`` called between the training forward and its backward (a validation
    hook that toggles the mode): the backward is of the forward that ran, with its dropout
    mask, and so are ``grad1`` and the norms, as ``torch.func`` gives each example's gradient
    under that mask; the mode stays as the user left it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 3)).to(D)
    x, y = _batch(4)
    seen = {}
    model[1].register_forward_hook(lambda m, i, o: seen.update(mask=(o != 0).to(D) / 0.5))
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        out = model(x)
        model.eval()
        F.cross_entropy(out, y).backward()
        norms = h.norms()
    assert not model.training

    def own(params, xi, mi, yi):
        hidden = F.linear(xi, params["0.weight"], params["0.bias"]) * mi
        return F.cross_entropy(F.linear(hidden, params["2.weight"], params["2.bias"]), yi)

    params = {n: p.detach() for n, p in model.named_parameters()}
    want = torch.func.vmap(torch.func.grad(own), in_dims=(None, 0, 0, 0))(
        params, x, seen["mask"], y
    )
    for name, p in model.named_parameters():
        assert_close(p.grad1, want[name], f"grad1 of {name}")
    assert_close(norms, torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1), "norms")


def _hand_factors(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """K-FAC's factors of the two Linears by hand: ``A = Σ ā āᵀ / batch`` (``ā`` the input
    with a ones column), ``G = Σ g gᵀ`` summed over the examples (``g`` each example's own
    output-gradient of its cross-entropy)."""
    w0, b0, w2, b2 = (p.detach() for p in model.parameters())
    z0 = F.linear(x, w0, b0).requires_grad_()
    hidden = torch.tanh(z0)
    out = F.linear(hidden, w2, b2).detach().requires_grad_()
    g_out = torch.autograd.grad(F.cross_entropy(out, y, reduction="sum"), out)[0]
    g_z0 = torch.autograd.grad(hidden, z0, g_out @ w2)[0]
    ones = torch.ones(len(x), 1, dtype=D)
    return {
        name: (torch.cat([a, ones], 1).T @ torch.cat([a, ones], 1) / len(x), g.T @ g)
        for name, a, g in [("0.weight", x, g_z0), ("2.weight", hidden.detach(), g_out)]
    }


def test_kfac_factors_of_a_backward_run_twice_through_a_kept_graph():
    """``loss.backward(retain_graph=True)`` then ``loss.backward()`` again on the same forward
    (a loop that backpropagates twice): ``A`` is the forward's; ``G`` sums the two
    backwards, as documented for several backwards of one forward, so that ``"mean"``
    (divided by the examples of every backward) is one backward's factor and ``"sum"`` twice
    its sum, both as by hand."""
    model = _mlp()
    x, y = _batch(5)
    hand = _hand_factors(model, x, y)
    with gradhooks.add_hooks(model, quantities=("kfac",)) as h:
        loss = F.cross_entropy(model(x), y)
        loss.backward(retain_graph=True)
        loss.backward()
        mean, total = h.kfac_factors("mean"), h.kfac_factors("sum")
    assert set(mean) == set(hand)
    for name, (a, g) in hand.items():
        assert_close(mean[name].A, a, f"A of {name}")
        assert_close(mean[name].G, g / len(x), f"mean G of {name}")
        assert_close(total[name].A, a, f"A of {name}, sum")
        assert_close(total[name].G, 2 * g, f"sum G of {name}")

"""Mistakes in how a model is trained, a ninth set: a backward whose loss reaches none of the
hooked model's captured calls (the outputs detached, or a weight penalty alone) in the middle
of a training loop that reads the norms, the squared-gradient sums or the variance. Such a
backward computes the parameters' gradients, but no per-example one: what the readers hold is
an earlier backward's, which they must not hand out as this one's. They stop with a
``StateError`` that names the parameters until the next backward through the model, whose
quantities match, in float64, each example's own gradient by the per-example loop
(:func:`gradhooks.oracle.loop_grad`); K-FAC's factors, which sum until ``clear()``, stay
readable (``tests/test_misuse.py`` to ``tests/test_misuse_eighth.py`` hold the earlier
sets)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import gradhooks
from gradhooks.errors import StateError
from gradhooks.oracle import loop_grad
from harness import labelled_batch, mlp, raised


def _loss(out, target):
    return nn.functional.cross_entropy(out, target, reduction="sum")


def _penalty(model):
    return sum((p**2).sum() for p in model.parameters())


def _stray_backward(model, x, kind):
    """A backward that computes every parameter's gradient and reaches no captured call."""
    if kind == "detached outputs":
        loss = model(x).detach().sum() + _penalty(model)
    elif kind == "penalty alone":
        loss = _penalty(model)
    else:  # a forward under no_grad, then the penalty
        with torch.no_grad():
            model(x)
        loss = _penalty(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss.backward()
    assert any("no forward call of their modules was captured" in str(w.message) for w in caught)


def _assert_norms_match(h, model, x, y):
    want = loop_grad(model, _loss, x, y)
    got = h.param_norms()
    assert set(got) == set(want)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g.flatten(1).norm(dim=1), msg=name)


def _assert_sums_match(h, model, x, y):
    want = loop_grad(model, _loss, x, y)
    sums, var = h.sum_grad_sq(), h.grad_variance()
    for name, g in want.items():
        torch.testing.assert_close(sums[name], (g**2).sum(0), msg=name)
        torch.testing.assert_close(var[name], g.var(0, unbiased=False).clamp_min(0), msg=name)


@pytest.mark.parametrize("kind", ["detached outputs", "penalty alone", "no_grad forward"])
def test_norms_of_a_backward_that_reached_no_captured_call_are_refused_then_formed_again(kind):
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model, quantities=("norms",), loss_reduction="sum") as h:
        for step in range(3):
            x, y = labelled_batch(step)
            opt.zero_grad()
            _loss(model(x), y).backward()
            _assert_norms_match(h, model, x, y)
            opt.step()
            opt.zero_grad()
            _stray_backward(model, x, kind)
            for reader in (h.param_norms, h.norms, h.norm_forms):
                err = raised(StateError, ["reached none of the model's captured calls"], reader)
                assert "'0.weight'" in str(err) and "'norms'" in str(err)
            opt.step()


@pytest.mark.parametrize("kind", ["detached outputs", "penalty alone"])
def test_squared_sums_and_variance_of_such_a_backward_are_refused_then_formed_again(kind):
    torch.manual_seed(1)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model, quantities=("sum_grad_sq",), loss_reduction="sum") as h:
        for step in range(2):
            x, y = labelled_batch(step)
            opt.zero_grad()
            _loss(model(x), y).backward()
            _assert_sums_match(h, model, x, y)
            opt.step()
            opt.zero_grad()
            _stray_backward(model, x, kind)
            for reader in (h.sum_grad_sq, h.grad_variance, h.noise_scale):
                err = raised(StateError, ["'sum_grad_sq'", "'2.bias'"], reader)
                assert "reached none of the model's captured calls" in str(err)


def test_without_zero_grad_the_stray_backward_leaves_grad1_as_the_captured_sum():
    """grad1 sums the captured backwards (as ``.grad`` sums all): the stray one adds to
    ``.grad`` only, and says so; the quantities of the last backward are refused."""
    torch.manual_seed(2)
    model = mlp()
    x, y = labelled_batch(0)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms"), loss_reduction="sum") as h:
        _loss(model(x), y).backward()
        want = loop_grad(model, _loss, x, y)
        _stray_backward(model, x, "penalty alone")
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad1, want[name], msg=name)
        raised(StateError, ["reached none of the model's captured calls"], h.param_norms)


def test_kfac_factors_still_sum_over_the_captured_backwards():
    torch.manual_seed(3)
    model = mlp()
    x, y = labelled_batch(0)
    with gradhooks.add_hooks(model, quantities=("kfac",), loss_reduction="sum") as h:
        _loss(model(x), y).backward()
        before = {k: (f.A.clone(), f.G.clone()) for k, f in h.kfac_factors().items()}
        _stray_backward(model, x, "penalty alone")
        after = h.kfac_factors()
        assert set(after) == set(before)
        for k, (a, g) in before.items():
            torch.testing.assert_close(after[k].A, a)
            torch.testing.assert_close(after[k].G, g)


def test_under_bfloat16_autocast_the_next_step_is_formed_again():
    torch.manual_seed(4)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = labelled_batch(0)
    with gradhooks.add_hooks(model, quantities=("norms",), loss_reduction="sum") as h:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _loss(model(x), y).backward()
        opt.zero_grad()
        _stray_backward(model, x, "detached outputs")
        raised(StateError, ["reached none of the model's captured calls"], h.param_norms)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _loss(model(x), y).backward()
        want = loop_grad(model, _loss, x, y)  # (float64, the oracle's own precision)
        for name, g in want.items():
            torch.testing.assert_close(
                h.param_norms()[name].double(), g.flatten(1).norm(dim=1), rtol=0.05, atol=0.05
            )


def test_the_quantities_come_in_the_order_of_named_parameters():
    """Keyed by name, in the order ``named_parameters()`` gives (not the order the backward
    reached them, which is the reverse), so that flattening them by position lines up with the
    model's parameters; each matches the loop."""
    torch.manual_seed(5)
    model = mlp()
    x, y = labelled_batch(0)
    names = [n for n, _ in model.named_parameters()]
    with gradhooks.add_hooks(model, quantities=("norms", "sum_grad_sq"), loss_reduction="sum") as h:
        _loss(model(x), y).backward()
        for reader in (h.param_norms, h.norm_forms, h.sum_grad_sq, h.grad_variance):
            assert list(reader()) == names, reader.__name__
        _assert_norms_match(h, model, x, y)
        _assert_sums_match(h, model, x, y)

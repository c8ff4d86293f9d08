"""Mistakes made in a training loop with per-example gradients, each in a few steps of a small
model with its optimizer: hooks added at the wrong time or place, a handle outliving its model,
a DP step given the wrong losses or arguments, a quantity read at the wrong moment, a batch
given in the wrong layout. Each either gives the documented meaning, compared with the float64
per-example loop (``gradhooks.oracle.loop_grad``), or stops with a typed gradhooks error that
says what is wrong and what to do (``tests/test_misuse.py`` holds the mistakes of one call)."""

from __future__ import annotations

import gc
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad

HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _batches(steps: int = 3, n: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(n, 4, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (n,), generator=g),
        )
        for _ in range(steps)
    ]


def _losses(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y, reduction="none")


def assert_grad1_is_the_loop(model: nn.Module, x, y, loss_fn=F.cross_entropy) -> None:
    """Every trainable parameter's ``grad1`` is the float64 per-example loop's gradient."""
    want = loop_grad(model, loss_fn, (x,), y)
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad1, want[name], rtol=1e-9, atol=1e-12, msg=name)


def _loop_norms(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each example's gradient norm over all parameters of a fresh ``_mlp()``, by the loop."""
    want = loop_grad(_mlp(), F.cross_entropy, (x,), y)
    return torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)


def assert_unhooked(model: nn.Module) -> None:
    """No hook of gradhooks' on any module or parameter."""
    for name, m in model.named_modules():
        for kind in HOOKS:
            assert not getattr(m, kind), f"{name or '<model>'} keeps {kind}"
    for name, p in model.named_parameters():
        assert not p._backward_hooks, f"{name} keeps a tensor hook"


def raised(error: type[Exception], says: str, call) -> Exception:
    """``call()`` raises ``error`` (a gradhooks error) whose message contains ``says``."""
    with pytest.raises(error, match=re.escape(says)) as info:
        call()
    assert isinstance(info.value, gradhooks.GradhooksError)
    return info.value


# -- hooks added at the wrong time or place --------------------------------------------------------


def test_hooks_added_under_inference_mode():
    """The hooks added inside the evaluation block (``with torch.inference_mode():`` around
    ``add_hooks``, as around the rest of the set-up) failed inside gradhooks with an
    ``AttributeError`` ("'NoneType' object has no attribute 'next_functions'"). Adding hooks
    computes nothing, so it is as outside the block: the training steps after it get the
    per-example loop's ``grad1``."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.inference_mode():
        h = gradhooks.add_hooks(model)
    for x, y in _batches():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        assert_grad1_is_the_loop(model, x, y)
        opt.step()
        with torch.inference_mode():  # the evaluation between steps is not captured
            model(x)
    h.remove()
    assert_unhooked(model)


def test_hooks_added_under_no_grad_capture_the_steps_after():
    """``add_hooks`` inside ``torch.no_grad()`` (a set-up block that also loads weights): the
    forwards later run with grad enabled, and are captured."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        h = gradhooks.add_hooks(model)
    for x, y in _batches(2):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        assert_grad1_is_the_loop(model, x, y)
        opt.step()
    h.remove()


def test_hooks_on_a_submodule_of_a_hooked_model():
    """Hooking the head again (``add_hooks(model[2])``, to read its norms) while the whole
    model is hooked would count its gradient twice: refused, naming the module and the handle
    to remove, and the model's own handle goes on giving the loop's ``grad1``."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        raised(gradhooks.StateError, "(Linear) is already hooked by another gradhooks handle",
               lambda: gradhooks.add_hooks(model[2], quantities=("norms",)))  # fmt: skip
        for x, y in _batches(2):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1_is_the_loop(model, x, y)
            opt.step()
    assert_unhooked(model)


def test_a_handle_kept_after_its_model_is_gone():
    """A handle kept in a list of runs after its model was replaced by a fresh one, before
    any forward: ``remove()`` and ``clear()`` have nothing to do and do nothing; ``check()``,
    which needs the model, says that it no longer exists instead of failing on a dead
    reference."""
    model = _mlp()
    h = gradhooks.add_hooks(model, quantities=("grad1", "norms"))
    (x, y), *_ = _batches(1)
    del model
    gc.collect()
    raised(gradhooks.StateError, "the hooked model no longer exists",
           lambda: h.check(F.cross_entropy, x, y))  # fmt: skip
    h.clear()
    h.remove()
    h.remove()
    assert not h.active


# -- grad1 read after what the user did to .grad ----------------------------------------------------


def test_grad1_after_del_grad_between_steps():
    """``del p.grad`` (in place of ``zero_grad``) between steps starts that parameter's
    ``grad1`` afresh, as ``.grad``: each step holds its own examples only, not the sum of
    steps."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for x, y in _batches():
            for p in model.parameters():
                del p.grad
            F.cross_entropy(model(x), y).backward()
            assert_grad1_is_the_loop(model, x, y)
            opt.step()


def test_frozen_parameter_has_no_grad1_until_unfrozen():
    """The first layer frozen for a warm-up, then unfrozen: while frozen it has no ``grad1``
    (reading it is an ``AttributeError``, as for a parameter never hooked, never a stale or
    zero one), and from the step it trains it has the loop's."""
    model = _mlp()
    model[0].requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step, (x, y) in enumerate(_batches(3)):
            if step == 2:
                model[0].requires_grad_(True)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            if step < 2:
                assert not hasattr(model[0].weight, "grad1")
            assert_grad1_is_the_loop(model, x, y)
            opt.step()


# -- the DP step given what it should not be ---------------------------------------------------------


def test_a_backward_of_their_own_before_the_dp_step_leaks_nothing():
    """``loss.sum().backward(retain_graph=True)`` (for logging) before ``dp_sgd_step`` on the
    same losses: the step writes ``.grad`` as the clipped sum alone, as without that backward;
    the unclipped gradient is not added to what the optimizer steps on."""
    max_norm = 0.01
    results = []
    for own_backward in (False, True):
        model = _mlp()
        with gradhooks.add_hooks(model, quantities=("norms",)) as h:
            (x, y), *_ = _batches(1)
            losses = _losses(model, x, y)
            if own_backward:
                losses.sum().backward(retain_graph=True)
            norms = gradhooks.dp_sgd_step(h, losses, max_norm=max_norm, noise_multiplier=0.0)
        results.append([p.grad.clone() for p in model.parameters()])
    want = loop_grad(_mlp(), F.cross_entropy, (x,), y)
    factors = (max_norm / norms).clamp(max=1.0)
    for got_plain, got_after, (name, g1) in zip(*results, want.items()):
        clipped = torch.einsum("b,b...->...", factors, g1) / len(x)
        torch.testing.assert_close(got_plain, clipped, msg=name)
        torch.testing.assert_close(got_after, clipped, msg=name)


def test_dp_steps_without_zero_grad_do_not_add_up():
    """No ``optimizer.zero_grad()`` between DP steps: each step's ``.grad`` is its own clipped
    sum (the step writes ``.grad``), never the previous step's added to it, which would step
    twice on the first batch's examples."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        for x, y in _batches(2):
            want = loop_grad(model, F.cross_entropy, (x,), y)
            norms = gradhooks.dp_sgd_step(h, _losses(model, x, y), max_norm=0.05,
                                          noise_multiplier=0.0)  # fmt: skip
            factors = (0.05 / norms).clamp(max=1.0)
            for name, p in model.named_parameters():
                clipped = torch.einsum("b,b...->...", factors, want[name]) / len(x)
                torch.testing.assert_close(p.grad, clipped, msg=name)
            opt.step()


@pytest.mark.parametrize("validation", ["before", "after"])
def test_a_validation_forward_with_grad_on_beside_the_dp_step(validation):
    """A validation batch of another size run through the model without ``torch.no_grad()``,
    before or after the training forward, and before ``dp_sgd_step`` on the training losses:
    the step clips the training batch's own examples (the validation forward's capture does
    not enter it), as the per-example loop does."""
    model = _mlp()
    (x, y), (xv, yv) = _batches(2)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        if validation == "before":
            F.cross_entropy(model(xv[:3]), yv[:3])
        losses = _losses(model, x, y)
        if validation == "after":
            F.cross_entropy(model(xv[:3]), yv[:3])
        norms = gradhooks.dp_sgd_step(h, losses, max_norm=0.05, noise_multiplier=0.0)
    torch.testing.assert_close(norms, _loop_norms(x, y))
    factors = (0.05 / norms).clamp(max=1.0)
    want = loop_grad(_mlp(), F.cross_entropy, (x,), y)
    for name, p in model.named_parameters():
        clipped = torch.einsum("b,b...->...", factors, want[name]) / len(x)
        torch.testing.assert_close(p.grad, clipped, msg=name)


def test_a_nan_loss_in_the_dp_step_is_shown_in_the_norms():
    """One example's loss is NaN (a bad input): as documented, its norm is NaN and the
    others' are the loop's, so ``torch.isfinite(norms)`` tells the loop to skip the step;
    ``.grad`` is NaN as autograd's would be, not a finite number hiding it."""
    model = _mlp()
    (x, y), *_ = _batches(1)
    x = x.clone()
    x[1, 0] = float("nan")
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        norms = gradhooks.dp_sgd_step(h, _losses(model, x, y), max_norm=1.0,
                                      noise_multiplier=0.0)  # fmt: skip
    assert torch.isfinite(norms).tolist() == [True, False, True, True, True]
    torch.testing.assert_close(norms[[0, 2, 3, 4]], _loop_norms(x, y)[[0, 2, 3, 4]])
    assert not torch.isfinite(model[0].weight.grad).all()


def test_a_noise_multiplier_given_as_a_tensor():
    """``noise_multiplier=torch.tensor(1.25)`` (from a schedule kept as tensors) is the number
    it holds: the same ``.grad`` as ``1.25`` from the same generator. A tensor of several
    values is refused, not broadcast over the parameters."""
    grads = []
    for sigma in (1.25, torch.tensor(1.25)):
        model = _mlp()
        (x, y), *_ = _batches(1)
        with gradhooks.add_hooks(model, quantities=("norms",)) as h:
            gradhooks.dp_sgd_step(h, _losses(model, x, y), max_norm=1.0, noise_multiplier=sigma,
                                  generator=torch.Generator().manual_seed(3))  # fmt: skip
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    model = _mlp()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        raised(gradhooks.ConfigurationTypeError, "noise_multiplier must be a number",
               lambda: gradhooks.dp_sgd_step(h, _losses(model, x, y), max_norm=1.0,
                                             noise_multiplier=torch.tensor([1.0, 2.0])))  # fmt: skip
    assert all(p.grad is None for p in model.parameters())


def test_a_dp_step_under_paused_is_refused():
    """``dp_sgd_step`` inside ``with h.paused():`` (left around an evaluation block): its
    backward captures nothing, so nothing could be clipped; refused, naming the parameters,
    with no ``.grad`` written, and the next step outside the block is right."""
    model = _mlp()
    (x, y), *_ = _batches(1)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        with h.paused():
            raised(gradhooks.StateError, "captured no per-example gradient",
                   lambda: gradhooks.dp_sgd_step(h, _losses(model, x, y), max_norm=1.0,
                                                 noise_multiplier=0.0))  # fmt: skip
        assert all(p.grad is None for p in model.parameters())
        norms = gradhooks.dp_sgd_step(h, _losses(model, x, y), max_norm=1.0, noise_multiplier=0.0)
    torch.testing.assert_close(norms, _loop_norms(x, y))


def test_norms_after_a_paused_backward_are_the_last_captured():
    """A validation loss's backward under ``h.paused()`` between a step and the reading of
    ``h.norms()``: the norms are still the captured step's (of its 5 examples), not the
    paused batch's nor empty."""
    model = _mlp()
    (x, y), (xv, yv) = _batches(2)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        F.cross_entropy(model(x), y).backward()
        with h.paused():
            F.cross_entropy(model(xv[:3]), yv[:3]).backward()
        norms = h.norms()
    torch.testing.assert_close(norms, _loop_norms(x, y))


def test_a_dp_optimizer_stepped_after_a_plain_backward_is_refused():
    """Opacus' loop kept with gradhooks' ``DPOptimizer``: ``loss.backward()`` then
    ``opt.step()``, instead of ``opt.backward(losses)``. The gradient is unclipped and
    un-noised; the step refuses it, saying to call ``opt.backward(losses)``, and the weights
    stay as they were."""
    model = _mlp()
    (x, y), *_ = _batches(1)
    before = [p.detach().clone() for p in model.parameters()]
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), h,
                                    max_grad_norm=1.0, noise_multiplier=1.0,
                                    expected_batch_size=5)  # fmt: skip
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        raised(gradhooks.StateError, "Call opt.backward(losses)", opt.step)
        for p, was in zip(model.parameters(), before):
            assert torch.equal(p.detach(), was)
        opt.zero_grad()
        opt.backward(_losses(model, x, y))
        opt.step()
    assert not all(torch.equal(p.detach(), was) for p, was in zip(model.parameters(), before))


def test_check_of_a_handle_without_grad1_says_to_add_it():
    """A summed loss with the default ``loss_reduction="mean"``: with ``grad1`` hooked,
    ``h.check`` names the sum at the first step. A handle of norms alone has no ``grad1`` to
    check, and said "no backward has written grad1 ... run the forward and the backward",
    which the loop had done; it now says the handle computes no ``grad1`` and how to hook it
    for the steps to check."""
    model = _mlp()
    (x, y), *_ = _batches(1)

    def summed(out, target):
        return F.cross_entropy(out, target, reduction="sum")

    with gradhooks.add_hooks(model) as h:
        summed(model(x), y).backward()
        raised(gradhooks.CheckFailedError, "loss_reduction='mean'", lambda: h.check(summed, x, y))
        h.rescale("sum")
        assert h.check(summed, x, y).ok
        assert_grad1_is_the_loop(model, x, y)
    model.zero_grad()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        summed(model(x), y).backward()
        raised(gradhooks.CheckFailedError, "add_hooks(model, quantities=('grad1', 'norms'))",
               lambda: h.check(summed, x, y))  # fmt: skip


# -- the batch in the wrong layout -----------------------------------------------------------------


def _time_major() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 5, 4, generator=g, dtype=torch.float64)  # [time, batch, features]
    return _mlp(), x, torch.randint(0, 3, (5,), generator=g)


def _over_time(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.mean(0), target)


def test_time_major_input_with_the_default_batch_dim_check_names_batch_dim():
    """A time-major batch ``[seq, batch, features]`` with the default ``batch_dim``: grad1
    holds a row per time step. ``h.check`` said only "pass the target of the captured
    forward"; it now names the dimension the target's length matches and ``batch_dim=1``.
    With ``batch_dim=1`` grad1 is the loop's."""
    model, x, y = _time_major()
    with gradhooks.add_hooks(model) as h:
        _over_time(model(x), y).backward()
        assert model[0].weight.grad1.shape[0] == 7
        raised(gradhooks.CheckFailedError, "add_hooks(model, batch_dim=1)",
               lambda: h.check(_over_time, x, y))  # fmt: skip
    model.zero_grad()
    with gradhooks.add_hooks(model, batch_dim=1):
        _over_time(model(x), y).backward()

    class BatchFirst(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, xb):
            return self.inner(xb.transpose(0, 1))

    want = loop_grad(BatchFirst(model), _over_time, (x.transpose(0, 1),), y)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad1, want[f"inner.{name}"], msg=name)


def test_time_major_input_in_the_dp_step_names_batch_dim():
    """The same time-major batch in a DP step: the 5 losses do not match the 7 rows the
    hooks took for examples. The refusal spoke of per-token losses only; it now also says to
    give ``batch_dim=1``, and writes no gradient."""
    model, x, y = _time_major()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        raised(gradhooks.ConfigurationError, "add_hooks(model, batch_dim=1)",
               lambda: gradhooks.dp_sgd_step(
                   h, F.cross_entropy(model(x).mean(0), y, reduction="none"), max_norm=1.0,
                   noise_multiplier=0.0))  # fmt: skip
    assert all(p.grad is None for p in model.parameters())
    assert_unhooked(model)


def test_a_batch_of_one_through_squeeze():
    """A model ending in ``.squeeze()`` (a scalar regression head) given the last batch of one
    example: its output loses the batch dimension, and ``grad1`` is still the loop's, one row."""

    class Regressor(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _mlp()
            self.head = nn.Linear(3, 1).double()

        def forward(self, x):
            return self.head(torch.tanh(self.body(x))).squeeze()

    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 4, generator=g, dtype=torch.float64)
    t = torch.randn(6, generator=g, dtype=torch.float64)
    with gradhooks.add_hooks(model):
        for xb, tb in ((x[:5], t[:5]), (x[5:], t[5:])):
            opt.zero_grad()
            F.mse_loss(model(xb), tb.squeeze()).backward()
            want = loop_grad(model, lambda o, tt: F.mse_loss(o, tt.squeeze()), (xb,), tb)
            for name, p in model.named_parameters():
                assert p.grad1.shape[0] == len(xb)
                torch.testing.assert_close(p.grad1, want[name], msg=name)
            opt.step()


def test_integer_inputs_keep_torch_error_and_leave_the_model_trainable():
    """Token ids fed to a float model (``model(x.long())``) fail in the model's own forward:
    the error is torch's, the same as without hooks (not a gradhooks error that would hide a
    bug of the model), and the model, unhooked, trains."""
    model = _mlp()
    (x, y), *_ = _batches(1)
    with pytest.raises(RuntimeError) as plain:
        model(x.long())
    with gradhooks.add_hooks(model):
        with pytest.raises(RuntimeError) as hooked:
            model(x.long())
    assert type(hooked.value) is type(plain.value) and str(hooked.value) == str(plain.value)
    assert not isinstance(hooked.value, gradhooks.GradhooksError)
    assert_unhooked(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    assert F.cross_entropy(model(x), y) < loss

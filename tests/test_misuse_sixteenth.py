"""Mistakes in a training loop, a sixteenth set: the model changed after ``add_hooks``, between
a forward and its backward or by the user's hooks, the wrong way.

A global forward hook registered after ``add_hooks`` that subtracts the batch's mean from a
layer's output (refused at the forward, naming the layer after it, its input's shape and the
mean, the model left as it was); a weight replaced by a new ``nn.Parameter``, a bias set to
``None``, ``nn.utils.prune`` or ``weight_norm`` applied between a forward and its backward (the
tensors the forward used get the gradient, as autograd's ``.grad``, and the new ones none); a
parameter's ``.data`` set to another shape between them (refused; the message, which blamed the
rule, now names the resize too); an optimizer's step between two backwards of a forward whose
graph saved the weights (torch's error, ``grad1`` left as the first backward's); hooks removed
and added again between a forward and its backward (a warning, and no ``grad1``, the last
step's deleted); a max-norm pre-hook that forgets ``torch.no_grad()`` (torch's error, the
hooks left working); a layer frozen inside its own call by its pre-hook (no ``grad1``, the last
step's deleted); and the DP step and the per-example norms of a model whose pre-hooks write a
max-norm constraint or unfreeze a layer (found and fixed: each example's gradient of those
weights counted twice, so the norms were too large and the DP step, which checks each
example's gradient, refused). Each gives the documented meaning, compared in float64 with each
example's own gradient by the per-example loop (:func:`gradhooks.oracle.loop_grad`), or stops
with the typed error of its kind, whose message names the module or the parameter, the shapes
and the remedy, leaving the parameters, ``.grad``, ``grad1`` and the hooks as they were
(``tests/test_misuse.py`` to ``tests/test_misuse_fifteenth.py`` hold the earlier sets).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.nn.utils.prune as prune
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_close, assert_untouched, model_state, one_thread, raised

D = torch.float64
assert one_thread  # (autouse: one intra-op thread for these tiny models)


class Net(nn.Module):
    """Linear-Tanh-Linear-Tanh-Linear (4 -> 6 -> 6 -> 3) in float64, seeded."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2, self.head = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.to(D)

    def forward(self, x):
        return self.head(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


def _batch(seed: int, n: int = 4):
    g = torch.Generator().manual_seed(500 + seed)
    return torch.randn(n, 4, generator=g, dtype=D), torch.randint(3, (n,), generator=g)


def _loop(model, x, y) -> dict:
    return loop_grad(copy.deepcopy(model), F.cross_entropy, x, y)


def _assert_loop(model, want: dict, what: str) -> None:
    """Every parameter with a ``.grad``: ``grad1`` is the loop's, its mean ``.grad``."""
    for n, p in model.named_parameters():
        if p.grad is not None:
            assert_close(p.grad1, want[n], f"{what}: {n}")
            assert_close(p.grad1.mean(0), p.grad, f"{what}: {n} vs .grad")


def _next_step_as_the_loop(model, what: str) -> None:
    """A step on a new batch after the misuse: ``grad1`` is the loop's again."""
    x, y = _batch(1)
    want = _loop(model, x, y)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    _assert_loop(model, want, what)


def _max_norm(module, args):
    with torch.no_grad():
        module.weight.copy_(torch.renorm(module.weight, 2, 0, 0.5))


def test_a_global_forward_hook_that_centers_the_batch_registered_after_add_hooks():
    """``register_module_forward_hook`` returning ``out - out.mean(0)`` for the first layer,
    registered after a step: the forward stops with ``MixedExamplesError`` naming the layer
    that reads the centered rows, its input's shape and the mean, and leaves the model as the
    step left it; the hook removed, the model trains on, each step the loop's."""
    model = Net()
    with gradhooks.add_hooks(model):
        x, y = _batch(0)
        F.cross_entropy(model(x), y).backward()
        before = model_state(model)
        model.l1.center = True
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda m, a, out: out - out.mean(0) if getattr(m, "center", False) else None
        )
        try:
            raised(
                gradhooks.MixedExamplesError,
                ["'l2' (Linear)", "(4, 6)", "mean in 'l1'", "Keep the examples apart"],
                lambda: F.cross_entropy(model(x), y).backward(),
            )
        finally:
            handle.remove()
        assert_untouched(model, before)
        _next_step_as_the_loop(model, "after the hook")


def test_a_weight_replaced_by_a_new_parameter_between_the_forward_and_its_backward():
    """``model.l2.weight = nn.Parameter(...)`` after the forward: the backward's gradient is
    the old tensor's (its ``.grad`` and ``grad1``, the loop's), the new one has neither; the
    next step trains the new one."""
    model = Net()
    with gradhooks.add_hooks(model):
        x, y = _batch(0)
        want = _loop(model, x, y)
        loss = F.cross_entropy(model(x), y)
        old = model.l2.weight
        model.l2.weight = nn.Parameter(0.5 * old.detach())
        loss.backward()
        assert_close(old.grad1, want["l2.weight"], "the old weight")
        assert_close(old.grad1.mean(0), old.grad, "the old weight vs .grad")
        assert model.l2.weight.grad is None and "grad1" not in model.l2.weight.__dict__
        _assert_loop(model, want, "the others")
        _next_step_as_the_loop(model, "the next step")
        assert "grad1" in model.l2.weight.__dict__


def test_a_bias_set_to_none_between_the_forward_and_its_backward():
    """``model.l2.bias = None`` after the forward: the removed bias gets the forward's
    gradient (``.grad`` and ``grad1``, the loop's); the next step trains without it."""
    model = Net()
    with gradhooks.add_hooks(model):
        x, y = _batch(0)
        want = _loop(model, x, y)
        loss = F.cross_entropy(model(x), y)
        old = model.l2.bias
        model.l2.bias = None
        loss.backward()
        assert_close(old.grad1, want["l2.bias"], "the removed bias")
        assert_close(old.grad1.mean(0), old.grad, "the removed bias vs .grad")
        _next_step_as_the_loop(model, "the next step")


def test_pruning_applied_between_the_forward_and_its_backward():
    """``prune.l1_unstructured`` after the forward: ``weight_orig`` is the tensor the forward
    used, and gets its unmasked gradient (the loop's of the unpruned model); the next step's is
    the masked one."""
    model = Net()
    with gradhooks.add_hooks(model):
        x, y = _batch(0)
        want = _loop(model, x, y)
        loss = F.cross_entropy(model(x), y)
        used = model.l2.weight
        prune.l1_unstructured(model.l2, "weight", amount=0.5)
        assert model.l2.weight_orig is used
        loss.backward()
        assert_close(used.grad1, want["l2.weight"], "weight_orig")
        x, y = _batch(1)
        want = loop_grad(model, F.cross_entropy, x, y)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        _assert_loop(model, want, "the next step")
        assert (model.l2.weight_orig.grad1[:, model.l2.weight_mask == 0] == 0).all()


def test_weight_norm_registered_between_the_forward_and_its_backward():
    """``parametrizations.weight_norm`` after the forward: the old weight, no longer the
    model's, gets the forward's gradient, the new ``original0`` and ``original1`` none; the
    next step gives those the loop's."""
    model = Net()
    with gradhooks.add_hooks(model):
        x, y = _batch(0)
        want = _loop(model, x, y)
        loss = F.cross_entropy(model(x), y)
        old = model.l2.weight
        torch.nn.utils.parametrizations.weight_norm(model.l2)
        loss.backward()
        assert_close(old.grad1, want["l2.weight"], "the old weight")
        originals = model.l2.parametrizations.weight
        for p in (originals.original0, originals.original1):
            assert p.grad is None and "grad1" not in p.__dict__
        _next_step_as_the_loop(model, "the next step")
        assert "grad1" in originals.original0.__dict__


def test_data_set_to_another_shape_between_the_forward_and_its_backward():
    """The head's ``.data`` set to a tensor of another shape (a vocabulary resized) after the
    forward: refused with ``RuleError``, whose message blamed the rule alone and now names the
    resize and the remedy; nothing of gradhooks' is written."""
    model = Net()
    with gradhooks.add_hooks(model):
        x, y = _batch(0)
        loss = F.cross_entropy(model(x), y)
        model.head.weight.data = torch.zeros(4, 6, dtype=D)
        raised(
            gradhooks.RuleError,
            ["'head' (Linear)", "(4, 6)", ".data was set to a tensor of another shape"],
            loss.backward,
        )
        for p in model.parameters():
            assert "grad1" not in p.__dict__


def test_an_optimizer_step_between_two_backwards_of_one_forward_of_a_deep_model():
    """The optimizer steps after the first of two backwards through a retained graph that
    saved the weights: the second stops with torch's in-place error, and ``grad1`` and
    ``.grad`` stay the first backward's (the loop's at the forward's weights)."""
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        x, y = _batch(0)
        want = _loop(model, x, y)
        out = model(x)
        F.cross_entropy(out, y).backward(retain_graph=True)
        optimizer.step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            F.cross_entropy(out, y).backward()
        _assert_loop(model, want, "after the refused second backward")


def test_hooks_removed_and_added_again_between_a_forward_and_its_backward():
    """``h.remove()`` and ``add_hooks`` again after the forward: the backward warns that no
    forward call was captured for it and writes no ``grad1`` (the step before's is gone with
    the first handle); the next step's forward is captured."""
    model = Net()
    h = gradhooks.add_hooks(model)
    x, y = _batch(0)
    F.cross_entropy(model(x), y).backward()
    model.zero_grad()
    x, y = _batch(1)
    loss = F.cross_entropy(model(x), y)
    h.remove()
    with gradhooks.add_hooks(model):
        with pytest.warns(gradhooks.GradhooksWarning, match="no forward call of their modules"):
            loss.backward()
        assert all("grad1" not in p.__dict__ for p in model.parameters())
        x, y = _batch(2)
        want = _loop(model, x, y)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        _assert_loop(model, want, "the next step")


def test_a_max_norm_pre_hook_that_forgets_no_grad():
    """A max-norm pre-hook written without ``torch.no_grad()``: the forward stops with torch's
    own error (an in-place write into a leaf that requires grad), the weights as they were;
    the hook fixed, the model trains, each step the loop's at the constrained weights."""
    model = Net()

    def constraint(module, args):
        module.weight.copy_(torch.renorm(module.weight, 2, 0, 0.5))

    handle = model.l1.register_forward_pre_hook(constraint)
    with gradhooks.add_hooks(model):
        x, y = _batch(0)
        before = model_state(model)
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
            model(x)
        assert_untouched(model, before)
        handle.remove()
        model.l1.register_forward_pre_hook(_max_norm)
        for step in range(2):
            x, y = _batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            _assert_loop(model, want, f"step {step}")


def test_a_layer_frozen_inside_its_own_call_by_its_pre_hook():
    """A pre-hook registered after ``add_hooks`` that sets the middle layer's
    ``requires_grad`` off at step 1 (inside the call, after gradhooks planned it): that step
    gives it no ``.grad`` and no ``grad1`` (step 0's deleted, not left to be read as this
    one's), the others the loop's."""
    model = Net()
    frozen = {"now": False}
    with gradhooks.add_hooks(model):

        def freeze(module, args):
            module.requires_grad_(not frozen["now"])

        model.l2.register_forward_pre_hook(freeze)
        for step in range(3):
            frozen["now"] = step == 1
            x, y = _batch(step)
            reference = copy.deepcopy(model)
            reference.l2.requires_grad_(step != 1)  # (what the hook will set)
            want = loop_grad(reference, F.cross_entropy, x, y)
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            for p in model.l2.parameters():
                assert (p.grad is None) == (step == 1)
                assert ("grad1" in p.__dict__) == (step != 1)
            _assert_loop(model, want, f"step {step}")


@pytest.mark.parametrize("method", ["grad1", "bookkeeping"])
def test_the_dp_step_of_a_model_whose_pre_hook_writes_a_max_norm_constraint(method):
    """The max-norm pre-hook registered before ``add_hooks`` on the first layer: the DP step
    refused (its check of each example's gradient saw the constrained weight's counted twice);
    now the step's ``.grad`` is the loop's clipped mean."""
    model = Net()
    model.l1.register_forward_pre_hook(_max_norm)
    quantity = "grad1" if method == "grad1" else "norms"
    with gradhooks.add_hooks(model, quantities=(quantity,)) as h:
        for step in range(2):
            x, y = _batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            model.zero_grad()
            losses = F.cross_entropy(model(x), y, reduction="none")
            gradhooks.dp_sgd_step(h, losses, max_norm=0.1, noise_multiplier=0.0, method=method)
            norms = torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)
            factor = (0.1 / norms).clamp(max=1.0)
            for n, p in model.named_parameters():
                clipped = torch.einsum("b,b...->...", factor, want[n]) / len(x)
                assert_close(p.grad, clipped, f"step {step}: {n}")


def test_the_norms_of_a_model_whose_pre_hook_unfreezes_a_layer():
    """``quantities=("norms",)`` with a pre-hook, registered before ``add_hooks``, that calls
    ``requires_grad_(True)`` on the first layer's weight: each example's norm counted that
    weight's gradient twice (or was refused at a checked backward); it is the loop's."""
    model = Net()

    def unfreeze(module, args):
        module.weight.requires_grad_(True)

    model.l1.register_forward_pre_hook(unfreeze)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        for step in range(3):
            x, y = _batch(step)
            want = _loop(model, x, y)
            model.zero_grad()
            with warnings.catch_warnings():
                warnings.simplefilter("error", gradhooks.GradhooksWarning)
                F.cross_entropy(model(x), y).backward()
            norms = torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)
            assert_close(h.norms(), norms, f"step {step}")

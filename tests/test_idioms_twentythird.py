"""Training-loop idioms, a twenty-third set: mixed precision, swapped parameters, compilation,
parameters a step does not reach, hooks on parameters and the optimizers' own features, in the
loops the earlier sets do not run.

Each test runs an ordinary loop with one of: a hook on a parameter that scales its gradient (a
layer's own learning rate, a gradient reversal) while the handle computes the per-example norms
or squared sums beside ``grad1``; hooks added around each micro-batch's backward, counting the
backwards their ``grad1`` holds.

Every quantity is compared at every step with each example's own gradient by a per-example loop
in float64 (:func:`gradhooks.oracle.loop_grad`), exactly in float64 or within the rounding of
the precision the loop runs in, or checked to stop with a typed error."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import (
    assert_close,
    labelled_batch,
    one_thread,  # noqa: F401 (autouse in this module)
    raised,
    wide_mlp,
)

D = torch.float64
STEPS = 3


def reference(model: nn.Module) -> nn.Module:
    """A float64 copy of ``model``'s weights now, for the loop."""
    return copy.deepcopy(model).to(D)


# -- a hook on a parameter that scales its gradient, beside the norms ------------------------------


@pytest.mark.parametrize("quantity", ["norms", "sum_grad_sq"])
@pytest.mark.parametrize("factor", [0.1, 0.0, -1.0], ids=["own-lr", "frozen", "reversal"])
def test_a_hook_scaling_a_gradient_beside_the_norms_is_refused(quantity, factor):
    """``grad1`` follows a hook's factor, but the norms and the squared sums are formed from the
    layers' pieces, which do not know it: with them on, the backward is refused, leaving the
    earlier micro-batch's ``grad1``, ``.grad`` and quantities (they were of the unscaled
    gradients, beside a scaled ``grad1``, in silence)."""
    model = wide_mlp()
    with gradhooks.add_hooks(model, quantities=("grad1", quantity)) as h:
        x, y = labelled_batch(0)
        want = loop_grad(reference(model), F.cross_entropy, x, y)
        F.cross_entropy(model(x), y).backward()
        for n, p in model.named_parameters():
            assert_close(p.grad1, want[n], n)
        grad1 = {n: p.grad1.clone() for n, p in model.named_parameters()}
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        kept = h.param_norms() if quantity == "norms" else h.sum_grad_sq()
        model[2].weight.register_hook(lambda g: g * factor)
        x, y = labelled_batch(1)  # (a second micro-batch)
        raised(
            gradhooks.UnsupportedError, ["'2.weight'", "by a factor"],
            lambda: F.cross_entropy(model(x), y).backward(),
        )  # fmt: skip
        now = h.param_norms() if quantity == "norms" else h.sum_grad_sq()
        assert now.keys() == kept.keys()
        for n in kept:
            assert torch.equal(now[n], kept[n]), n
        for n, p in model.named_parameters():
            assert torch.equal(p.grad1, grad1[n]), n
            assert_close(p.grad, grads[n], n)  # (the refused addition subtracted again)


# -- hooks added around each micro-batch's backward -------------------------------------------------


def test_hooks_added_around_each_micro_batch_count_every_backward_they_go_on_from():
    """``with add_hooks(model):`` around each micro-batch's backward: each handle goes on from
    the ``grad1`` the one before left, and ``accumulated`` counts every backward it holds (it
    stopped at 2, the adopted ones counted as one), so that ``grad1 / accumulated`` is each
    example's average over the micro-batches; ``zero_grad`` starts both afresh."""
    model = wide_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        optimizer.zero_grad()
        want = {}
        for k in range(4):
            x, y = labelled_batch(4 * step + k)
            for n, g in loop_grad(reference(model), F.cross_entropy, x, y).items():
                want[n] = want.get(n, 0) + g
            with gradhooks.add_hooks(model) as h:
                F.cross_entropy(model(x), y).backward()
                assert h.accumulated == k + 1
            for n, p in model.named_parameters():
                assert_close(p.grad1, want[n], f"{step}.{k}: {n}")
        optimizer.step()


class _Attention(nn.Module):
    """A projection, self-attention and a head: MultiheadAttention's ``in_proj_bias`` and
    ``out_proj`` are accumulated by autograd before the layer's rule writes their ``grad1``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(3, 8)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h = self.proj(x)
        return self.head(self.attention(h, h, h, need_weights=False)[0].mean(1))


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_a_hook_scaling_the_attentions_gradients_reaches_every_grad1(verify):
    """A smaller learning rate for the attention by hooks on its parameters (``g * 0.1``):
    ``grad1`` follows the factor also where the layer's rule writes it after autograd
    accumulated ``.grad`` (``in_proj_bias``, ``out_proj``: they kept the unscaled gradient, in
    silence, and the check refused the backward as one whose grad1 does not add up)."""
    model = _Attention().to(D)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    factor = {n: 0.1 if n.startswith("attention.") else 1.0 for n, _ in model.named_parameters()}
    with gradhooks.add_hooks(model, verify=verify):
        for n, p in model.named_parameters():
            if factor[n] != 1.0:
                p.register_hook(lambda g: g * 0.1)
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4, 5, 3, dtype=D, generator=g), torch.randint(2, (4,), generator=g)
            want = loop_grad(reference(model), F.cross_entropy, x, y)
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            for n, p in model.named_parameters():
                assert_close(p.grad1, factor[n] * want[n], f"step {step}: {n}")
                assert_close(p.grad1.mean(0), p.grad, f"step {step}: {n}")
            optimizer.step()

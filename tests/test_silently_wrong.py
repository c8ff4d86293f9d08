"""Cases that once gave a number silently wrong, or an error that misled: each now gives the
number of a per-example loop in float64 (:func:`gradhooks.oracle.loop_grad`), or stops with a
typed error that names what it refuses and leaves the model as it was.

- ``torch.func.functional_call(model, tensors, x)`` with leaf tensors of the user's in the
  parameters' slots, the hooks added again around each micro-batch's backward: ``grad1`` of the
  tensors adds up over the micro-batches as their ``.grad`` does, as a parameter's does."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import gradhooks
from gradhooks.oracle import loop_grad
from harness import (
    assert_close,
    labelled_batch,
    one_thread,  # noqa: F401 (autouse in this module)
    wide_mlp,
)

D = torch.float64
MICRO = 3


def _loaded(model, tensors: dict):
    """A copy of ``model`` holding ``tensors`` (detached) in its parameters' slots."""
    reference = copy.deepcopy(model)
    reference.load_state_dict({n: t.detach() for n, t in tensors.items()})
    return reference


# -- functional_call with the user's leaf tensors, hooks added around each micro-batch --------


@pytest.mark.parametrize("then", ["accumulate", "zero_grad"])
def test_functional_call_leaves_accumulate_with_hooks_added_per_micro_batch(then):
    """An ensemble member's leaf tensors through ``functional_call``, ``with add_hooks(model)``
    around each of three micro-batches' backward: each tensor's ``grad1`` is the sum of the
    micro-batches' loop gradients, and ``.grad`` its mean over the rows divided as the loss is
    (the documented rule: ``grad1`` adds up where ``.grad`` still holds what the last hooks'
    backward added). Reset between micro-batches (``t.grad = None``), each starts afresh.
    Before, ``grad1`` held only the last micro-batch's rows while ``.grad`` held the sum."""
    model = wide_mlp(out=3)
    tensors = {n: (p + 0.1).detach().requires_grad_() for n, p in model.named_parameters()}
    reference = _loaded(model, tensors)
    total = {n: torch.zeros(5, *t.shape, dtype=D) for n, t in tensors.items()}
    for k in range(MICRO):
        if then == "zero_grad":
            for t in tensors.values():
                t.grad = None
            total = {n: torch.zeros_like(s) for n, s in total.items()}
        x, y = labelled_batch(40 + k, classes=3)
        want = loop_grad(reference, F.cross_entropy, x, y)
        with gradhooks.add_hooks(model) as h:
            (F.cross_entropy(torch.func.functional_call(model, tensors, (x,)), y) / MICRO).backward()
            held = h.accumulated
        assert held == (k + 1 if then == "accumulate" else 1), f"micro-batch {k}: {held}"
        for n, t in tensors.items():
            total[n] = total[n] + want[n] / MICRO
            assert_close(t.grad1, total[n], f"micro-batch {k}: grad1 of {n}")
            assert_close(t.grad, total[n].mean(0), f"micro-batch {k}: .grad of {n}")
    for n, p in model.named_parameters():
        assert not hasattr(p, "grad1") and p.grad is None, f"the model's own {n} was written"

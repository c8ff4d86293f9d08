"""Training-loop idioms and misuse, a fifth set, each step checked against the float64 oracle.

Each test runs an idiom as training code writes it (accelerate's ``prepare``, ``backward``,
``accumulate`` and ``clip_grad_norm_``; ``AveragedModel``; siamese pairs; a recurrence
unrolled to the input's length; reentrant checkpointing; packed sequences; a ``BatchEncoding``
batch; forward hooks of the user's registered after ``add_hooks``) on a small model, and at
every step compares ``grad1`` (or the DP step) with each example's own gradient by a
per-example loop in float64 (:func:`gradhooks.oracle.loop_grad`, or the loop written out where
an example is not one row of one input), within a stated tolerance under mixed precision; or
checks that a misuse stops with an error that says what went wrong and leaves the model as it
was, or has the documented meaning.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_grad1, mlp

D = torch.float64


def batch(seed: int = 0, n: int = 4, dtype: torch.dtype = D):
    """``n`` examples of 3 features and their labels (2 classes)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g, dtype=dtype), torch.randint(2, (n,), generator=g)


def added(a: dict, b: dict, c: float = 1.0) -> dict:
    return {n: a[n] + c * b[n] for n in b}


# -- forward hooks of the user's ---------------------------------------------------------------


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_a_forward_hook_put_first_after_add_hooks_does_not_hide_the_layers_output(verify):
    """A forward hook registered after ``add_hooks`` with ``prepend=True`` that returns a new
    output (``out * 3``) would run before gradhooks' own, which would then take the
    output-gradient at the new output (a third of the layer's own: a wrong ``grad1``, silent
    without the run-time check). Each forward puts gradhooks' hook first again."""
    model = mlp()
    x, y = batch(0)
    with gradhooks.add_hooks(model, verify=verify):
        handle = model[0].register_forward_hook(lambda m, a, out: out * 3.0, prepend=True)
        with gradhooks.paused():
            want = loop_grad(model, F.cross_entropy, x, y)
        for step in range(3):
            model.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
        handle.remove()

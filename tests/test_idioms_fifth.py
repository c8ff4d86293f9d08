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


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_hooks_added_from_a_forward_hook_while_the_forward_runs(verify):
    """``add_hooks`` called from a forward hook of the first layer (lazily, on the first
    forward): that layer's call ran before the hooks, the next one's after. The backward warns
    that the first layer's call was not captured, as for hooks added after the whole forward,
    and gives it no ``grad1``; the layer after it has its own (with the run-time check too,
    which has no ``grad1`` of the first layer to compare). The next step captures both."""
    model = mlp()
    x, y = batch(0)
    want = loop_grad(model, F.cross_entropy, x, y)
    made = []

    def hook_lazily(module, args, output):
        if not made:
            made.append(gradhooks.add_hooks(model, verify=verify))

    handle = model[0].register_forward_hook(hook_lazily)
    out = model(x)
    with pytest.warns(gradhooks.GradhooksWarning, match="'0.bias', '0.weight' but no forward"):
        F.cross_entropy(out, y).backward()
    assert not hasattr(model[0].weight, "grad1") and not hasattr(model[0].bias, "grad1")
    torch.testing.assert_close(model[2].weight.grad1, want["2.weight"], rtol=1e-7, atol=1e-9)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    assert_grad1(model, want, "the next step")
    handle.remove()
    made[0].remove()


# -- freezing and unfreezing ---------------------------------------------------------------------


def test_a_layer_frozen_between_the_forward_and_the_backward_gets_no_grad1_as_no_grad():
    """``requires_grad_(False)`` after the forward: autograd still computes the layer's
    gradient but leaves ``.grad`` as it was, so ``grad1`` is left as it was too (none after a
    reset, the earlier micro-batch's in an accumulation); the norms cover the parameters that
    get a gradient. Unfrozen again, the layer's next step has its ``grad1``."""
    model = mlp()
    (x, y), (x2, y2) = batch(0), batch(1)
    first, second = (
        loop_grad(model, F.cross_entropy, x, y),
        loop_grad(model, F.cross_entropy, x2, y2),
    )
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        out = model(x)
        model[0].requires_grad_(False)
        F.cross_entropy(out, y).backward()
        assert model[0].weight.grad is None and not hasattr(model[0].weight, "grad1")
        assert_grad1(model, first, "frozen after the forward")
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        want = sum(first[n].flatten(1).square().sum(1) for n in trainable).sqrt()
        torch.testing.assert_close(h.norms(), want)

        model.zero_grad()
        model[0].requires_grad_(True)
        F.cross_entropy(model(x), y).backward()  # a micro-batch, all trainable
        out = model(x2)
        model[0].requires_grad_(False)
        F.cross_entropy(out, y2).backward()  # the next, frozen after its forward
        model[0].requires_grad_(True)
        want = {n: first[n] if n.startswith("0.") else first[n] + second[n] for n in first}
        assert_grad1(model, want, "accumulated, the layer frozen for the second")
        torch.testing.assert_close(model[0].weight.grad1.mean(0), model[0].weight.grad)

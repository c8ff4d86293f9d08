"""Published training loops, an eighth set, each step checked against the float64 oracle.

Each test writes again, on a small model, the idioms of one published loop that the earlier
sets do not run: a DP training loop that unfreezes a layer in the middle of a logical batch
(the physical batches of Opacus' ``BatchMemoryManager`` counted as steps); the FixMatch
reference code's ``interleave`` / ``de_interleave`` of labelled, weakly and strongly augmented
batches in one forward, with pseudo-labels from the detached weak logits; timm's ``DropPath``
(stochastic depth, a per-example mask drawn inside the forward); insightface's ``ArcFace``
margin head given the labels and building their one-hot inside the forward; a center loss
whose centers are trained by their own optimizer; DeepSpeech-style CTC on time-major log
probabilities; a hypernetwork generating each example's weights from its task id; the
original K-FAC code's non-full ``register_backward_hook`` beside the hooks; torchtune's
activation offloading (``saved_tensors_hooks``, ``save_on_cpu``), ``detect_anomaly`` and
``checkpoint_sequential``; the elastic weight consolidation loop (a Fisher from ``grad1`` on
one task, its penalty on the next); a multi-task loop accumulating one task's batch after
another's into one step. Each is compared with each example's own gradient by a per-example
loop in float64 (:func:`gradhooks.oracle.loop_grad`, or the loop written out), or checked to
stop with an error that says what went wrong and leaves the model as it was.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_close, assert_grad1, mlp

D = torch.float64


def batch(seed: int, n: int = 4):
    """``n`` examples of 3 features and their labels (2 classes), float64."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g, dtype=D), torch.randint(2, (n,), generator=g)


def summed_ce(out, y):
    return F.cross_entropy(out, y, reduction="sum")


def snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_unchanged(model: nn.Module, before: list[torch.Tensor], what: str) -> None:
    for p, q in zip(model.parameters(), before, strict=True):
        assert_close(p.detach(), q, f"{what}: a parameter changed")


def rows_of(model: nn.Module, one) -> dict[str, torch.Tensor]:
    """The per-example loop written out: ``one(i)`` runs example ``i``'s forward and backward
    (under ``gradhooks.paused()``); each parameter's gradient (zeros where it got none), row by
    row."""
    params = dict(model.named_parameters())
    got: dict[str, list[torch.Tensor]] = {n: [] for n in params}
    i = 0
    with gradhooks.paused():
        while True:
            for p in params.values():
                p.grad = None
            if not one(i):
                break
            for n, p in params.items():
                got[n].append(torch.zeros_like(p) if p.grad is None else p.grad.clone())
            i += 1
    for p in params.values():
        p.grad = None
    return {n: torch.stack(v) for n, v in got.items()}


# -- DP: a layer unfrozen in the middle of a logical batch ---------------------------------------


def _deep() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(),
        nn.Linear(4, 2),
    ).to(D)  # fmt: skip


@pytest.mark.parametrize("when", ["between physical batches", "before the step"])
def test_dp_optimizer_refuses_a_layer_unfrozen_in_the_middle_of_a_logical_batch(when):
    """A DP fine-tuning loop that unfreezes by the count of physical batches (Opacus'
    ``BatchMemoryManager`` steps are physical): layer 2 joins and its twin, layer 4 (same
    shapes), leaves between the physical batches of one logical batch, or after the last one
    and before ``step()``. The buffer holds clipped sums of the parameters trainable at its
    first backward; before, layer 4's were added to layer 2's gradient without a word (and a
    change of shapes failed inside torch). Refused, naming both layers and their shapes,
    before anything runs: ``.grad``, the parameters and the buffer as they were; after
    ``zero_grad()`` the logical batch runs again and the step is that of its clipped sums."""
    model = _deep()
    model[2].requires_grad_(False)
    with gradhooks.add_hooks(model, quantities=("norms",)) as hooks:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), hooks, max_grad_norm=100.0,
            noise_multiplier=0.0, expected_batch_size=8,
        )  # fmt: skip
        x, y = batch(0)
        opt.backward(F.cross_entropy(model(x), y, reduction="none"))
        model[2].requires_grad_(True)
        model[4].requires_grad_(False)
        before = snapshot(model)
        x2, y2 = batch(1)
        message = (
            r"DPOptimizer\.(backward|step).*trainable now and not then: '2\.weight' \(4, 4\), "
            r"'2\.bias' \(4,\); trainable then and not now: '4\.weight' \(4, 4\), "
            r"'4\.bias' \(4,\).*zero_grad\(\)"
        )
        with pytest.raises(gradhooks.StateError, match=message):
            if when == "between physical batches":
                opt.backward(F.cross_entropy(model(x2), y2, reduction="none"))
            else:
                opt.step()
        assert all(p.grad is None for p in model.parameters())
        assert opt.examples == 4
        assert_unchanged(model, before, "the refused call")
        # run again: the step is the mean of the two batches' gradients (none clipped at 100)
        opt.zero_grad()
        xs, ys = torch.cat([x, x2]), torch.cat([y, y2])
        want = loop_grad(model, F.cross_entropy, xs, ys)
        for xb, yb in ((x, y), (x2, y2)):
            opt.backward(F.cross_entropy(model(xb), yb, reduction="none"))
        sgd = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        for n, p in model.named_parameters():
            if p.requires_grad:
                assert_close(p.grad, want[n].mean(0), f"{n}'s gradient")
                assert_close(p.detach(), sgd[n] - 0.1 * want[n].mean(0), f"{n} stepped")
            else:
                assert p.grad is None and torch.equal(p.detach(), sgd[n]), n

"""Training-loop idioms, a twenty-fourth set: what augmentations, targets and losses do to the
examples, and what a loop does around its steps.

Each test runs several steps of an ordinary loop with one of: manifold mixup within the batch by
``torch.roll`` with a weight drawn for each example, and CutMix of feature maps within the batch
by a mask (refused, the model as it was); mixup with a detached copy of the last batch's hidden
features, shuffled, kept by the model; soft targets (``F.cross_entropy`` given probabilities,
with ``label_smoothing``) from labels flipped at random, into the DP step; a focal loss with
per-class weights into the DP step's three methods; knowledge distillation from a teacher that
still has hooks of its own, frozen and run under ``no_grad``; a triplet loss whose positive is
each example's own augmented view through the model and whose negative comes from a detached
memory bank; the model's and the optimizer's ``state_dict`` saved with the hooks on, training
rewound to them (into the hooked model, and into a new model hooked afresh); a backward stopped
by ``torch.autograd.detect_anomaly`` at a NaN, caught, and training going on; and
``clip_grad_value_`` on the gradients the DP step wrote.

Every quantity is compared at every step with each example's own gradient by a per-example loop
in float64 (:func:`gradhooks.oracle.loop_grad`), or with the DP step's clipped sum of those, or
checked to stop with a typed error that leaves the model as it was."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import (
    assert_close,
    assert_untouched,
    model_state,
    one_thread,  # noqa: F401 (autouse in this module)
    raised,
)

D = torch.float64
STEPS = 3


def batch(seed: int, n: int = 5, classes: int = 3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g, dtype=D), torch.randint(classes, (n,), generator=g)


def mlp(out: int = 3) -> nn.Sequential:
    """Linear, tanh, Linear (4 -> 6 -> ``out``) in float64, seeded."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, out)).to(D)


def reference(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s weights now, for the loop."""
    return copy.deepcopy(model)


def assert_grad1(model: nn.Module, want: dict, what: str) -> None:
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert_close(p.grad1, want[n], f"{what}: {n}")
            assert_close(p.grad1.mean(0), p.grad, f"{what}: {n} (mean)")


def clipped_sum(want: dict, max_norm: float) -> dict:
    """Each example's whole-model gradient clipped to ``max_norm``, summed over the batch."""
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in want.values()]).sum(0).sqrt()
    factor = (max_norm / norms).clamp(max=1.0)
    return {n: torch.einsum("b,b...->...", factor, g) for n, g in want.items()}


# -- mixing within the batch inside the model: refused ----------------------------------------


class MixedWithin(nn.Module):
    """Manifold mixup by ``torch.roll`` (each example's partner the one before it, a weight
    drawn for each example), or CutMix of a conv's feature maps by a box from the rolled batch."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.head = nn.Linear(2 * 5 * 5, 3)

    def forward(self, x, lam):
        h = torch.tanh(self.conv(x))
        if self.how == "manifold":
            lam = lam.view(-1, 1, 1, 1)
            h = lam * h + (1 - lam) * torch.roll(h, 1, 0)
        elif self.how == "cutmix":
            box = torch.zeros(5, 5, dtype=torch.bool)
            box[1:4, 2:5] = True
            h = torch.where(box, torch.roll(h, 1, 0), h)
        return self.head(h.flatten(1))


@pytest.mark.parametrize("how", ["manifold", "cutmix"])
def test_mixing_the_batch_within_the_model_is_refused_and_the_model_kept(how):
    """Mixup of hidden features with ``torch.roll`` of the batch, each example's weight from a
    Beta draw, and CutMix of the feature maps from the rolled batch: each example's loss reaches
    its neighbour's forward, there is no gradient of its own to give. The backward is refused
    (:class:`gradhooks.MixedExamplesError`, naming the head) with the model as it was; an
    unmixed step after it matches the loop."""
    model = MixedWithin(how).to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(model):
        for step in range(2):
            x = torch.randn(4, 1, 5, 5, generator=g, dtype=D)
            y = torch.randint(3, (4,), generator=g)
            lam = torch.distributions.Beta(0.4, 0.4).sample((4,)).to(D)
            opt.zero_grad()
            before = model_state(model)
            raised(
                gradhooks.MixedExamplesError, ["'head'"],
                lambda: F.cross_entropy(model(x, lam), y).backward(),
            )  # fmt: skip
            assert_untouched(model, before)
            model.how = "none"
            want = loop_grad(reference(model), F.cross_entropy, (x, lam), y)
            F.cross_entropy(model(x, lam), y).backward()
            assert_grad1(model, want, f"step {step}, unmixed")
            opt.step()
            model.how = how


# -- mixup with the last batch, detached: per example ------------------------------------------


class MixWithLast(nn.Module):
    """Manifold mixup whose partner is a detached hidden feature of the *last* batch, shuffled:
    ``h = lam * h + (1 - lam) * partner``, the partner given as an input."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x, partner, lam):
        h = torch.tanh(self.a(x))
        lam = lam[:, None]
        return self.b(lam * h + (1 - lam) * partner), h


def test_mixup_with_the_last_batchs_detached_features_matches_the_loop():
    """The partner of example ``i`` is a hidden feature of the last batch (detached, shuffled),
    and its target the mix of the two labels as probabilities: no example reaches another's
    loss, and grad1 is the loop's over steps (the loop given each example's partner and
    weight)."""
    model = MixWithLast().to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    g = torch.Generator().manual_seed(1)
    last_h = torch.zeros(5, 6, dtype=D)
    last_y = torch.zeros(5, 3, dtype=D)

    def loss_fn(out, target):
        return F.cross_entropy(out[0], target)

    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = batch(step)
            perm = torch.randperm(5, generator=g)
            lam = torch.rand(5, generator=g, dtype=D)
            partner = last_h[perm]
            target = lam[:, None] * F.one_hot(y, 3).to(D) + (1 - lam[:, None]) * last_y[perm]
            want = loop_grad(reference(model), loss_fn, (x, partner, lam), target)
            opt.zero_grad()
            out, h = model(x, partner, lam)
            F.cross_entropy(out, target).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()
            last_h, last_y = h.detach(), F.one_hot(y, 3).to(D)


# -- soft targets from noisy labels, into the DP step ------------------------------------------


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_soft_targets_from_noisy_labels_into_the_dp_step(method):
    """Labels flipped at random (a fifth of them), made soft targets, and
    ``F.cross_entropy(out, probabilities, label_smoothing=0.1, reduction="none")`` into the
    DP step (no noise): ``.grad`` is the clipped mean of the loop's gradients; with
    ``"grad1"`` the handle's grad1 is the loop's too."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    quantity = "grad1" if method == "grad1" else "norms"

    def soft(out, probs):
        return F.cross_entropy(out, probs, label_smoothing=0.1, reduction="none")

    with gradhooks.add_hooks(model, quantities=(quantity,)) as h:
        for step in range(STEPS):
            x, y = batch(10 + step)
            flip = torch.rand(5, generator=g) < 0.2
            y = torch.where(flip, torch.randint(3, (5,), generator=g), y)
            probs = 0.8 * F.one_hot(y, 3).to(D) + 0.2 * torch.rand(5, 3, generator=g, dtype=D)
            probs = probs / probs.sum(1, keepdim=True)
            want = loop_grad(reference(model), lambda o, t: soft(o, t).sum(), x, probs)
            opt.zero_grad()
            gradhooks.dp_sgd_step(
                h, soft(model(x), probs), max_norm=0.5, noise_multiplier=0.0, method=method
            )
            for n, s in clipped_sum(want, 0.5).items():
                assert_close(dict(model.named_parameters())[n].grad, s / 5, f"{step}: {n}")
            if method == "grad1":
                for n, p in model.named_parameters():
                    assert_close(p.grad1, want[n], f"{step}: {n} grad1")
            opt.step()


# -- a focal loss with class weights, into the DP step -----------------------------------------


def focal(out, y, gamma: float = 2.0):
    """Each example's focal loss ``-alpha_y (1 - p_y)^gamma log p_y``, alpha per class."""
    alpha = torch.tensor([0.25, 0.5, 0.25], dtype=out.dtype)
    logp = F.log_softmax(out, 1).gather(1, y[:, None]).squeeze(1)
    return -alpha[y] * (1 - logp.exp()).pow(gamma) * logp


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_a_focal_loss_with_class_weights_into_the_dp_step(method):
    """The focal loss of each example (its weight depends on its own probability), with
    per-class ``alpha``, into the DP step: the clipped mean of the loop's gradients."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    quantity = "grad1" if method == "grad1" else "norms"
    with gradhooks.add_hooks(model, quantities=(quantity,)) as h:
        for step in range(STEPS):
            x, y = batch(20 + step)
            want = loop_grad(reference(model), lambda o, t: focal(o, t).sum(), x, y)
            opt.zero_grad()
            gradhooks.dp_sgd_step(
                h, focal(model(x), y), max_norm=0.3, noise_multiplier=0.0, method=method
            )
            for n, s in clipped_sum(want, 0.3).items():
                assert_close(dict(model.named_parameters())[n].grad, s / 5, f"{step}: {n}")
            opt.step()

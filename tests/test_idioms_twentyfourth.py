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
                lambda x=x, lam=lam, y=y: F.cross_entropy(model(x, lam), y).backward(),
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


# -- distillation from a teacher that keeps hooks of its own -----------------------------------


def test_distillation_from_a_frozen_teacher_that_keeps_its_own_hooks():
    """The teacher was trained with hooks of its own and keeps them; frozen
    (``requires_grad_(False)``, ``eval()``) and run under ``no_grad``, it gives the student's
    soft targets, ``KL(teacher || student) * T^2`` (``batchmean``) plus the hard labels' loss.
    The student's grad1 is the loop's at every step, and the teacher's handle writes nothing."""
    teacher, student = mlp(), mlp()
    with torch.no_grad():
        for p in teacher.parameters():
            p.mul_(1.5)
    t = 2.0

    def distill(out, target):
        soft_target, y = target[:, :3], target[:, 3].long()
        kl = F.kl_div(F.log_softmax(out / t, 1), F.log_softmax(soft_target / t, 1),
                      reduction="batchmean", log_target=True)  # fmt: skip
        return kl * t * t + F.cross_entropy(out, y)

    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    with gradhooks.add_hooks(teacher) as ht:
        x, y = batch(30)
        F.cross_entropy(teacher(x), y).backward()  # (the teacher's own training, once)
        teacher.zero_grad()
        gradhooks.clear_grad1(teacher)
        teacher.requires_grad_(False).eval()
        with gradhooks.add_hooks(student):
            for step in range(STEPS):
                x, y = batch(31 + step)
                with torch.no_grad():
                    target = torch.cat([teacher(x), y[:, None].to(D)], 1)
                want = loop_grad(reference(student), distill, x, target)
                opt.zero_grad()
                distill(student(x), target).backward()
                assert_grad1(student, want, f"step {step}")
                opt.step()
        assert ht.accumulated == 0
    for p in teacher.parameters():
        assert p.grad is None and "grad1" not in p.__dict__


# -- a triplet loss: the positive each example's own view, negatives from a memory bank --------


class Views(nn.Module):
    """An embedding of an example and of its augmented view (two forwards of the encoder), the
    triplet loss of each against a negative from a memory bank (detached, given as an input)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = mlp(out=4)

    def forward(self, x, view, negative):
        anchor = F.normalize(self.encoder(x), dim=1)
        positive = F.normalize(self.encoder(view), dim=1)
        return F.triplet_margin_loss(anchor, positive, negative, margin=0.5, reduction="none")


def test_a_triplet_loss_with_own_views_and_memory_bank_negatives_matches_the_loop():
    """Each example's anchor and positive (its own augmented view) go through the encoder, the
    negative is a detached embedding of an earlier batch from a memory bank: each loss is the
    example's own, and grad1 (summed over the encoder's two calls) is the loop's over steps."""
    model = Views()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    bank = F.normalize(torch.randn(16, 4, generator=g, dtype=D), dim=1)

    def mean(out):
        return out.mean()

    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, _ = batch(40 + step)
            view = x + 0.1 * torch.randn(x.shape, generator=g, dtype=D)
            negative = bank[torch.randint(16, (5,), generator=g)]
            want = loop_grad(reference(model), mean, (x, view, negative))
            opt.zero_grad()
            model(x, view, negative).mean().backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()
            with torch.no_grad():
                bank[5 * step : 5 * step + 5] = F.normalize(model.encoder(x), dim=1)


# -- state dicts saved with the hooks on, training rewound to them -----------------------------


@pytest.mark.parametrize("into", ["the-hooked-model", "a-new-model"])
def test_training_rewound_to_saved_state_dicts_repeats_its_grad1(into):
    """The model's and Adam's ``state_dict`` saved (``torch.save`` to a buffer) after two steps
    with the hooks on, two more steps taken, then both loaded back, into the hooked model and
    its optimizer or into a new model hooked afresh: the steps again give the same grad1 as the
    first time, each the loop's, and the saved state holds the model's own keys only."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    first = []
    with gradhooks.add_hooks(model):
        for step in range(4):
            if step == 2:
                saved = io.BytesIO()
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, saved)
            x, y = batch(50 + step)
            want = loop_grad(reference(model), F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            if step >= 2:
                first.append({n: p.grad1.clone() for n, p in model.named_parameters()})
            opt.step()
        saved.seek(0)
        state = torch.load(saved)
        assert set(state["model"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
        if into == "the-hooked-model":
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            rerun(model, opt, first)
    if into == "a-new-model":
        fresh = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(D)
        fresh.load_state_dict(state["model"])
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.05)
        fresh_opt.load_state_dict(state["opt"])
        with gradhooks.add_hooks(fresh):
            rerun(fresh, fresh_opt, first)


def rerun(model, opt, first) -> None:
    for k, step in enumerate((2, 3)):
        x, y = batch(50 + step)
        want = loop_grad(reference(model), F.cross_entropy, x, y)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        assert_grad1(model, want, f"rerun {step}")
        for n, p in model.named_parameters():
            assert_close(p.grad1, first[k][n], f"rerun {step}: {n} as the first time")
        opt.step()


# -- a backward stopped by anomaly detection, caught, and training going on --------------------


class Logged(nn.Module):
    """A body, the square root of its output's magnitude, a head; in ``eval()`` the square root
    written as ``where(h > 0, sqrt(h), 0)``, whose backward gives NaN for a negative entry
    (``0 / sqrt(h)``), though its forward is finite."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp(out=6)
        self.head = nn.Linear(6, 3).to(D)

    def forward(self, x):
        h = self.body(x)
        return self.head(
            torch.sqrt(h.abs() + 1e-3) if self.training else torch.where(h > 0, h.sqrt(), 0)
        )


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
@pytest.mark.filterwarnings("ignore:Error detected in")
@pytest.mark.parametrize("then", ["zero_grad", "accumulate"])
def test_a_backward_stopped_by_detect_anomaly_then_training_goes_on(then):
    """Under ``torch.autograd.detect_anomaly()`` a step whose backward gives NaN in
    ``SqrtBackward0`` stops with torch's ``RuntimeError``, after the head's hooks ran. The loop
    catches it and takes the next batch, with ``zero_grad`` (grad1 and ``.grad`` the loop's of
    that batch) or accumulating on from the batch before (the grad1 the stopped backward wrote
    is taken back as it fails: grad1 is the sum of the two good batches' loop gradients, and so
    is the ``.grad`` of the body, which the stopped backward did not reach)."""
    model = Logged()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model) as h, torch.autograd.detect_anomaly(check_nan=True):
        for step in range(2):
            opt.zero_grad()
            x, y = batch(60 + 3 * step)
            first = loop_grad(reference(model), F.cross_entropy, x, y)
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, first, f"step {step}, before")
            model.eval()  # (the bad forward)
            x, y = batch(61 + 3 * step)
            with pytest.raises(RuntimeError, match="SqrtBackward0"):
                F.cross_entropy(model(x), y).backward()
            model.train()
            assert h.accumulated == 1
            if then == "zero_grad":
                opt.zero_grad()
            x, y = batch(62 + 3 * step)
            want = loop_grad(reference(model), F.cross_entropy, x, y)
            F.cross_entropy(model(x), y).backward()
            if then == "zero_grad":
                assert_grad1(model, want, f"step {step}, after")
            else:
                assert h.accumulated == 2
                for n, p in model.named_parameters():
                    assert_close(p.grad1, first[n] + want[n], f"step {step}: {n}")
                    if n.startswith("body."):
                        assert_close(p.grad, (first[n] + want[n]).mean(0), f"step {step}: {n}")
            opt.step()


# -- clip_grad_value_ on the gradients the DP step wrote ---------------------------------------


@pytest.mark.parametrize("where", ["after-dp_sgd_step", "inner-step-pre-hook"])
def test_clip_grad_value_on_the_dp_steps_gradients(where):
    """A loop that clipped ``.grad`` by value keeps ``clip_grad_value_`` after the DP step wrote
    its gradients (post-processing: the privacy is the DP step's): after ``dp_sgd_step``, or
    as a step pre-hook on the optimizer a :class:`gradhooks.DPOptimizer` wraps (run after it set
    ``.grad``). The step moves each weight by the learning rate times the clamped clipped mean
    of the loop's gradients."""
    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.5)
    value = 0.02
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        if where == "inner-step-pre-hook":
            opt = gradhooks.DPOptimizer(
                inner, h, max_grad_norm=0.5, noise_multiplier=0.0, expected_batch_size=5
            )
            inner.register_step_pre_hook(
                lambda *_: torch.nn.utils.clip_grad_value_(model.parameters(), value)
            )
        for step in range(STEPS):
            x, y = batch(70 + step)
            want = loop_grad(
                reference(model), lambda o, t: F.cross_entropy(o, t, reduction="sum"), x, y
            )
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            losses = F.cross_entropy(model(x), y, reduction="none")
            if where == "after-dp_sgd_step":
                inner.zero_grad()
                gradhooks.dp_sgd_step(h, losses, max_norm=0.5, noise_multiplier=0.0)
                torch.nn.utils.clip_grad_value_(model.parameters(), value)
                inner.step()
            else:
                opt.backward(losses)
                opt.step()
                opt.zero_grad()
            clamped = {n: (s / 5).clamp(-value, value) for n, s in clipped_sum(want, 0.5).items()}
            assert any((s.abs() == value).any() for s in clamped.values())  # (some clamped)
            for n, p in model.named_parameters():
                assert_close(p.detach(), before[n] - 0.5 * clamped[n], f"step {step}: {n}")

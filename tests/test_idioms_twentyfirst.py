"""Training-loop idioms, a twenty-first set: torch's own training machinery in combinations the
earlier sets do not run.

Each test runs several steps of an ordinary loop with one of: ``torch.autograd.backward`` of a
list of losses (two heads' losses in one call); ``loss.backward(inputs=...)`` training one
layer at a time; ``torch.autograd.set_detect_anomaly(True)`` set for the whole run around the
DP step of every method; ``add_param_group`` on a ``DPOptimizer`` when a layer is unfrozen;
``DPOptimizer.zero_grad(set_to_none=False)`` with a head no batch reached; ``OneCycleLR``
cycling Adam's betas through a ``DPOptimizer``; the new-style ``spectral_norm`` and
``weight_norm`` parametrizations into the DP step (its three methods) and under bfloat16
autocast; ``channels_last`` set after ``add_hooks`` into the ghost DP step under bfloat16; a
compiled model's norms and squared sums under bfloat16; adaptive clipping, per-layer clipping
and automatic clipping with a float16 ``GradScaler``; the norms and squared sums of each
micro-batch with the gradients zeroed by ``zero_grad(set_to_none=False)``; an
``inference_mode`` validation between two micro-batches; a second backward through a retained
graph after ``zero_grad``; ``torch.autograd.grad(..., materialize_grads=True)`` with a head
the loss does not use; K-FAC factors under activation checkpointing (both modes), bfloat16
autocast, ``torch.compile`` and micro-batches; and ``allow_mutation_on_saved_tensors``.

Every quantity is compared at every step with each example's own gradient by a per-example loop
in float64 (:func:`gradhooks.oracle.loop_grad`), exactly in float64 or within the rounding of
the precision the loop runs in, or checked to stop with a typed error."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_idioms_eighteenth import BF16, clipped, norms_of, relative_error
from test_kfac import assert_factors, hand_factors
from torch import nn
from torch.autograd.graph import allow_mutation_on_saved_tensors
from torch.nn.utils import parametrizations, parametrize
from torch.utils.checkpoint import checkpoint

import gradhooks
from gradhooks.oracle import loop_grad
from harness import (
    assert_close,
    assert_grad1,
    labelled_batch,
    one_thread,  # noqa: F401 (autouse in this module)
    raised,
    wide_mlp,
)

D = torch.float64
STEPS = 3
FP16 = 1e-2  # float16: 11 bits, a few roundings deep, of the largest entry


def reference(model: nn.Module) -> nn.Module:
    """A float64 copy of ``model``'s weights now, for the loop."""
    return copy.deepcopy(model).to(D)


def assert_near_all(got: dict, want: dict, tol: float, what: str) -> None:
    """Each ``got[name]`` within ``tol`` of ``want[name]``'s largest entry."""
    assert want, what
    for n, w in want.items():
        err = relative_error(got[n], w)
        assert err < tol, f"{what}: {n} off by {err:.2e}"


def assert_step_grad1_and_norms(model: nn.Module, h, want: dict, bf16: bool, step: int) -> None:
    """A step's ``grad1`` and norms against the loop's ``want``: within bfloat16's tolerance
    under autocast, else as float64."""
    if bf16:
        grad1 = {n: p.grad1 for n, p in model.named_parameters()}
        assert_near_all(grad1, want, BF16, f"step {step}")
        assert relative_error(h.norms(), norms_of(want)) < BF16
    else:
        assert_grad1(model, want, f"step {step}")
        assert_close(h.norms(), norms_of(want), f"step {step}: norms")


def grads(model: nn.Module) -> dict:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


class TwoHeads(nn.Module):
    """A trunk (3 -> 6) and two heads, ``a`` (2 classes) and ``b`` (one output); ``heads``
    says which the forward runs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.a, self.b = nn.Linear(3, 6), nn.Linear(6, 2), nn.Linear(6, 1)

    def forward(self, x, heads: str = "ab"):
        h = torch.tanh(self.trunk(x))
        return tuple(getattr(self, k)(h) for k in heads)


class Picked(nn.Module):
    """``model(x, heads)[0]``: one head of :class:`TwoHeads` as a model of its own, for the
    loop."""

    def __init__(self, model: nn.Module, heads: str) -> None:
        super().__init__()
        self.model, self.heads = model, heads

    def forward(self, x):
        return self.model(x, self.heads)[0]


def two_losses(out, y):
    """The two heads' losses: the first's cross-entropy, half the second's square."""
    return F.cross_entropy(out[0], y, reduction="sum"), 0.5 * out[1].pow(2).sum()


def both_losses(out, y):
    """The two heads' losses, summed."""
    return sum(two_losses(out, y))


# -- torch.autograd.backward of a list of losses ------------------------------------------------


@pytest.mark.parametrize("bf16", [False, True], ids=["float64", "bf16"])
def test_autograd_backward_of_a_list_of_the_heads_losses(bf16):
    """``torch.autograd.backward([loss_a, loss_b])``: two heads' losses backpropagated in one
    call, as multi-task loops write it, without adding them first. At each of three SGD
    steps grad1 and the norms are the float64 loop's of each example's sum of the two losses:
    exactly in float64, within bfloat16's rounding under bfloat16 autocast."""
    model = TwoHeads() if bf16 else TwoHeads().to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("grad1", "norms")) as h:
        for step in range(STEPS):
            x, y = labelled_batch(step)
            want = loop_grad(reference(model), both_losses, x, y)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                a, b = model(x.float() if bf16 else x)
            torch.autograd.backward(list(two_losses((a.to(D), b.to(D)), y)))
            assert_step_grad1_and_norms(model, h, want, bf16, step)
            opt.step()


# -- loss.backward(inputs=...) -------------------------------------------------------------------


def test_backward_with_inputs_trains_one_layer_at_a_time():
    """Layer-wise training by ``loss.backward(inputs=layer.parameters())``: each step's
    backward computes the gradients of one layer alone (the first, then the last, in turn),
    though the loss reaches both. grad1 and the norms are that layer's examples' own (the
    float64 loop's), the other layer has none (its ``.grad`` is ``None`` after the
    ``zero_grad``), and the optimizer steps the layer the step trained."""
    model = wide_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for step in range(4):
            layer = model[0] if step % 2 == 0 else model[2]
            names = {f"{0 if step % 2 == 0 else 2}.{n}" for n, _ in layer.named_parameters()}
            x, y = labelled_batch(step)
            want = {n: g for n, g in loop_grad(model, F.cross_entropy, x, y).items() if n in names}
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward(inputs=list(layer.parameters()))
            for n, p in model.named_parameters():
                if n in names:
                    assert_close(p.grad1, want[n], f"step {step}: {n}")
                    assert_close(p.grad1.mean(0), p.grad, f"step {step}: {n} reduced")
                else:
                    assert p.grad is None and not hasattr(p, "grad1"), f"step {step}: {n}"
            assert_close(h.norms(), norms_of(want), f"step {step}: norms")
            opt.step()


def test_backward_with_inputs_of_each_layer_through_one_retained_graph():
    """Two backwards of one loss through a retained graph, ``inputs=`` the first layer's
    parameters, then the last layer's, without a ``zero_grad`` between them: together they
    compute every gradient once, and grad1 is the float64 loop's (each parameter's from the
    one backward that reached it), over three steps."""
    model = wide_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = labelled_batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward(inputs=list(model[0].parameters()), retain_graph=True)
            loss.backward(inputs=list(model[2].parameters()))
            assert_grad1(model, want, f"step {step}")
            opt.step()


# -- set_detect_anomaly for the whole run, around the DP step ------------------------------------


class Gated(nn.Module):
    """``tanh(h * w) * s``: a layer without a rule (the fallback's)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.s = nn.Parameter(torch.full((width,), 0.9))

    def forward(self, h):
        return torch.tanh(h * self.w) * self.s


def gated_mlp() -> nn.Sequential:
    """Linear, :class:`Gated`, Linear (3 -> 6 -> 2) in float64, seeded."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), Gated(6), nn.Linear(6, 2)).to(D)


@pytest.fixture
def anomaly_mode():
    """``torch.autograd.set_detect_anomaly(True)`` for the test, as a debugging run sets it at
    the top of its script (not as a context), and off again after it."""
    torch.autograd.set_detect_anomaly(True)
    try:
        yield
    finally:
        torch.autograd.set_detect_anomaly(False)


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_detect_anomaly_set_for_the_whole_run_around_dp_steps(anomaly_mode, method):
    """``set_detect_anomaly(True)`` at the top of the script, then three DP steps of a model
    with a layer the fallback differentiates: each step's ``.grad`` is the float64 loop's
    clipped mean (no noise), with every method."""
    model = gated_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        for step in range(STEPS):
            x, y = labelled_batch(step)
            want = clipped(loop_grad(model, F.cross_entropy, x, y), 0.5)
            opt.zero_grad()
            losses = F.cross_entropy(model(x), y, reduction="none")
            gradhooks.dp_sgd_step(h, losses, max_norm=0.5, noise_multiplier=0.0, method=method)
            for n, p in model.named_parameters():
                assert_close(p.grad, want[n], f"step {step}: {n}")
            opt.step()


# -- the DPOptimizer's param groups --------------------------------------------------------------


def sgd_step_taken(before: dict, model: nn.Module, lr: dict) -> dict:
    """The gradient an SGD step took, ``(before - after) / lr``, per parameter."""
    return {n: (before[n] - p.detach()) / lr[n] for n, p in model.named_parameters()}


def test_dp_optimizer_add_param_group_when_a_layer_is_unfrozen():
    """Fine-tuning the head alone, then unfreezing the first layer at a logical batch's
    boundary and giving it to the ``DPOptimizer`` by ``add_param_group`` with its own learning
    rate (the wrapped optimizer gets the group too). Each step moves every trainable parameter
    by its learning rate times the float64 loop's clipped mean over the parameters trainable
    then (no noise), and the frozen layer not at all."""
    model = wide_mlp()
    model[0].requires_grad_(False)
    base = torch.optim.SGD(model[2].parameters(), lr=0.1)
    with gradhooks.add_hooks(model) as h:
        opt = gradhooks.DPOptimizer(
            base, h, max_grad_norm=0.5, noise_multiplier=0.0, expected_batch_size=5
        )
        for step in range(4):
            if step == 2:
                model[0].requires_grad_(True)
                opt.add_param_group({"params": list(model[0].parameters()), "lr": 0.05})
                assert len(base.param_groups) == 2
            x, y = labelled_batch(step)
            want = clipped(loop_grad(model, F.cross_entropy, x, y), 0.5)
            opt.backward(F.cross_entropy(model(x), y, reduction="none"))
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
            lr = {n: 0.05 if n.startswith("0.") else 0.1 for n in before}
            taken = sgd_step_taken(before, model, lr)
            for n in before:
                if n in want:
                    assert_close(taken[n], want[n], f"step {step}: {n}")
                else:
                    assert torch.equal(taken[n], torch.zeros_like(taken[n])), (step, n)


def test_dp_optimizer_zero_grad_keeping_zeros_with_a_head_no_batch_reached():
    """A two-task loop whose batches alternate between the heads, the ``DPOptimizer`` zeroed
    by ``zero_grad(set_to_none=False)`` (the gradients kept as zeros): each step moves the
    trunk and the batch's head by the float64 loop's clipped mean, and the other head by
    nothing (its clipped sum is zero, and there is no noise here)."""
    model = TwoHeads().to(D)
    with gradhooks.add_hooks(model) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), h, max_grad_norm=0.5,
            noise_multiplier=0.0, expected_batch_size=5,
        )  # fmt: skip
        for step in range(4):
            head = "ab"[step % 2]
            x, y = labelled_batch(step)
            task = y if head == "a" else torch.zeros(5, dtype=D)

            def loss(out, t, head=head):
                return F.cross_entropy(out, t) if head == "a" else (out - t).pow(2).mean()

            want = {
                n.removeprefix("model."): g
                for n, g in loop_grad(Picked(model, head), loss, x, task).items()
            }
            want = clipped(want, 0.5)
            opt.zero_grad(set_to_none=False)
            out = model(x, head)[0]
            losses = (
                F.cross_entropy(out, y, reduction="none") if head == "a"
                else (out - task[:, None]).pow(2).flatten()
            )  # fmt: skip
            opt.backward(losses)
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt.step()
            taken = sgd_step_taken(before, model, dict.fromkeys(before, 0.1))
            for n, g in taken.items():
                assert_close(g, want.get(n, torch.zeros_like(g)), f"step {step}: {n}")


def test_one_cycle_lr_cycles_adams_betas_through_the_dp_optimizer():
    """``OneCycleLR(cycle_momentum=True)`` given the ``DPOptimizer`` over AdamW: it cycles the
    learning rate and the first of Adam's ``betas`` in the param groups the two share. At
    each step ``.grad`` is the float64 loop's clipped mean (no noise), and the groups follow
    the schedule that the same ``OneCycleLR`` over a plain AdamW follows."""
    model, twin = wide_mlp(), wide_mlp()
    plain = torch.optim.AdamW(twin.parameters(), lr=0.01)
    with gradhooks.add_hooks(model) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.AdamW(model.parameters(), lr=0.01), h, max_grad_norm=0.5,
            noise_multiplier=0.0, expected_batch_size=5,
        )  # fmt: skip
        schedules = [
            torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=5) for o in (opt, plain)
        ]
        held = {}
        opt.register_step_pre_hook(lambda o, a, k: held.update(grads(model)))
        for step in range(4):
            x, y = labelled_batch(step)
            want = clipped(loop_grad(model, F.cross_entropy, x, y), 0.5)
            opt.backward(F.cross_entropy(model(x), y, reduction="none"))
            held.clear()
            opt.step()
            opt.zero_grad()
            assert_near_all(held, want, 1e-12, f"step {step}")
            plain.step()  # (no gradients: the schedule's twin, not trained)
            for s in schedules:
                s.step()
            for ours, theirs in zip(opt.param_groups, plain.param_groups):
                assert ours["lr"] == pytest.approx(theirs["lr"]), step
                assert ours["betas"] == pytest.approx(theirs["betas"]), step
        assert opt.param_groups[0]["betas"][0] != 0.9  # (cycled)


# -- spectral_norm and weight_norm parametrizations ----------------------------------------------


def normed_mlp(dtype=D) -> nn.Sequential:
    """:func:`wide_mlp` with ``parametrizations.spectral_norm`` on the first layer's weight
    (its power iteration advances ``u`` and ``v`` at every forward in training mode) and
    ``parametrizations.weight_norm`` on the last's (``original0``, ``original1``)."""
    model = wide_mlp().to(dtype)
    parametrizations.spectral_norm(model[0])
    parametrizations.weight_norm(model[2])
    return model


def frozen_power_iteration(model: nn.Module) -> nn.Module:
    """A float64 copy of ``model`` in eval mode: its spectral norm uses the ``u`` and ``v``
    that the training forward just left (the weight that forward used), without iterating."""
    return reference(model).eval()


@pytest.mark.parametrize("bf16", [False, True], ids=["float64", "bf16"])
def test_spectral_and_weight_norm_parametrizations_over_steps(bf16):
    """grad1 and the norms of the originals of ``spectral_norm`` and ``weight_norm``
    parametrizations over three Adam steps, the power iteration advancing at each forward: the
    float64 loop's at the weights each forward used, exactly in float64, within bfloat16's
    rounding under bfloat16 autocast."""
    model = normed_mlp(torch.float32 if bf16 else D)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for step in range(STEPS):
            x, y = labelled_batch(step)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = model(x.to(next(model.parameters()).dtype))
            want = loop_grad(frozen_power_iteration(model), F.cross_entropy, x, y)
            assert any("original1" in n for n in want)
            F.cross_entropy(out.to(D), y).backward()
            assert_step_grad1_and_norms(model, h, want, bf16, step)
            opt.step()


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_spectral_and_weight_norm_parametrizations_into_the_dp_step(method):
    """The same parametrized model trained by ``dp_sgd_step``: each step's ``.grad`` of the
    originals is the float64 loop's clipped mean (no noise) at the weights the forward used,
    with every method."""
    model = normed_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        for step in range(STEPS):
            x, y = labelled_batch(step)
            opt.zero_grad()
            losses = F.cross_entropy(model(x), y, reduction="none")
            want = clipped(loop_grad(frozen_power_iteration(model), F.cross_entropy, x, y), 0.5)
            gradhooks.dp_sgd_step(h, losses, max_norm=0.5, noise_multiplier=0.0, method=method)
            for n, p in model.named_parameters():
                assert_close(p.grad, want[n], f"step {step}: {n}")
            opt.step()


# -- channels_last after add_hooks, a compiled model, under bfloat16 -----------------------------


class SmallCNN(nn.Module):
    """Conv (3 -> 4), GroupNorm, Conv (stride 2), Linear: a CNN of 6x6 images, seeded."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1, self.gn = nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4)
        self.c2, self.fc = nn.Conv2d(4, 4, 3, stride=2), nn.Linear(16, 3)

    def forward(self, x):
        h = torch.tanh(self.gn(self.c1(x)))
        return self.fc(torch.tanh(self.c2(h)).flatten(1))


def images(step: int, n: int = 4):
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 3, 6, 6, generator=g), torch.randint(3, (n,), generator=g)


def test_channels_last_set_after_add_hooks_into_the_ghost_step_under_bfloat16():
    """``model.to(memory_format=torch.channels_last)`` after ``add_hooks`` (the convolution
    weights change their layout in place), channels-last images, bfloat16 autocast and the
    ghost DP step: at each of three steps the returned norms and ``.grad`` are the float64
    loop's norms and clipped mean within bfloat16's rounding."""
    model = SmallCNN()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        model.to(memory_format=torch.channels_last)
        assert model.c1.weight.is_contiguous(memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(STEPS):
            x, y = images(step)
            x = x.to(memory_format=torch.channels_last)
            per_example = loop_grad(reference(model), F.cross_entropy, x.to(D), y)
            want = clipped(per_example, 0.5)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            norms = gradhooks.dp_sgd_step(
                h, F.cross_entropy(out.float(), y, reduction="none"), max_norm=0.5,
                noise_multiplier=0.0, method="ghost",
            )  # fmt: skip
            assert relative_error(norms, norms_of(per_example)) < BF16, step
            assert_near_all(grads(model), want, BF16, f"step {step}")
            opt.step()


def test_a_compiled_models_norms_and_squared_sums_under_bfloat16():
    """A model compiled after ``add_hooks`` (``torch.compile``, the eager backend), trained
    under bfloat16 autocast with ``quantities=("norms", "sum_grad_sq")`` alone: at each of
    three steps the norms and each parameter's sum over the examples of its squared gradient
    are the float64 loop's within bfloat16's rounding."""
    model = SmallCNN()
    with gradhooks.add_hooks(model, quantities=("norms", "sum_grad_sq")) as h:
        compiled = torch.compile(model, backend="eager")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(STEPS):
            x, y = images(step)
            want = loop_grad(reference(model), F.cross_entropy, x.to(D), y)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = compiled(x)
            F.cross_entropy(out.float(), y).backward()
            assert relative_error(h.norms(), norms_of(want)) < BF16, step
            squares = {n: g.pow(2).sum(0) for n, g in want.items()}
            assert_near_all(h.sum_grad_sq(), squares, 2 * BF16, f"step {step}")
            assert not any(hasattr(p, "grad1") for p in model.parameters())
            opt.step()


# -- allow_mutation_on_saved_tensors ---------------------------------------------------------------


def test_a_weight_decayed_in_place_between_forward_and_backward_under_allow_mutation():
    """Under ``torch.autograd.graph.allow_mutation_on_saved_tensors()`` autograd keeps a copy
    of a saved tensor that is changed in place, so that a weight decay applied in place
    between the forward and the backward (``p.mul_(0.9)`` under ``no_grad``) leaves the
    backward the forward's. The Linear layers' weights decayed so: grad1 is the float64
    loop's at the weights the forward ran with, over two steps. Then a parameter of the layer
    without a rule, which the fallback computes again at the backward: from the copy of the
    parameters the call kept under the context, the loop's too (it was refused with a
    ``StateError``)."""
    model = gated_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = labelled_batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            with allow_mutation_on_saved_tensors():
                loss = F.cross_entropy(model(x), y)
                decayed = [model[1].w] if step == STEPS - 1 else [
                    *model[0].parameters(), *model[2].parameters()
                ]  # fmt: skip
                with torch.no_grad():
                    for p in decayed:
                        p.mul_(0.9)
                loss.backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


def test_the_batch_changed_in_place_after_the_forward_under_allow_mutation():
    """The batch normalized in place after the forward (for a logging pass) under
    ``allow_mutation_on_saved_tensors()``, over three steps: grad1 is the float64 loop's of the
    batch as the forward saw it. Outside the context the same change is refused with a
    ``StateError``, as autograd refuses it."""
    model = wide_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = labelled_batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            with allow_mutation_on_saved_tensors():
                batch = x.clone()
                loss = F.cross_entropy(model(batch), y)
                batch.div_(batch.norm(dim=1, keepdim=True))
                loss.backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()
        batch = x.clone()
        loss = F.cross_entropy(model(batch), y)
        batch.div_(batch.norm(dim=1, keepdim=True))
        raised(gradhooks.StateError, ["'0'", "version"], loss.backward)


class Encoder(nn.Module):
    """One ``nn.TransformerEncoderLayer`` (width 8, 2 heads, no dropout) on ``[batch, 4, 8]``
    and a Linear head on the positions' mean, seeded, in float64."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.TransformerEncoderLayer(8, 2, 12, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 2)
        self.to(D)

    def forward(self, x):
        return self.head(self.layer(x).mean(1))


def test_a_transformer_layer_decayed_in_place_under_allow_mutation():
    """The Transformer layers' rule runs the layer again at the backward: a step under
    ``allow_mutation_on_saved_tensors()`` whose layer weights were decayed in place between
    the forward and the backward gives the float64 loop's grad1 at the forward's weights, from
    the copy the call kept (it was refused with a ``StateError``), as does a step under the
    context that changed nothing. Outside the context the same change is refused with a
    ``StateError`` naming the parameter and the layer, as autograd refuses it."""
    model = Encoder()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 4, 8, generator=g, dtype=D), torch.randint(2, (4,), generator=g)
    with gradhooks.add_hooks(model):
        want = loop_grad(model, F.cross_entropy, x, y)
        with allow_mutation_on_saved_tensors():
            F.cross_entropy(model(x), y).backward()
        assert_grad1(model, want, "unchanged")
        model.zero_grad()
        with allow_mutation_on_saved_tensors():
            loss = F.cross_entropy(model(x), y)
            with torch.no_grad():
                model.layer.linear1.weight.mul_(0.9)
            loss.backward()
        assert_grad1(model, want, "decayed after the forward")
        model.zero_grad()
        want = loop_grad(model, F.cross_entropy, x, y)
        loss = F.cross_entropy(model(x), y)
        with torch.no_grad():
            model.layer.linear1.weight.mul_(0.9)
        raised(gradhooks.StateError, ["linear1.weight", "'layer'", "inplace"], loss.backward)


# -- adaptive, per-layer and automatic clipping with a float16 GradScaler -------------------------


def dp_run(fp16: bool, physical: int = 1, **settings) -> tuple[list, list]:
    """Four logical batches of 8 through a ``DPOptimizer`` over SGD (noise 1e-7 of the bound:
    none to speak of), each in ``physical`` physical batches, under float16 autocast with a
    ``GradScaler`` (a scale of 2^8 that does not overflow) or in float32 without: the bound
    after each step and the weights at the end."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=10**9)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), h, noise_multiplier=1e-7,
            expected_batch_size=8, generator=torch.Generator().manual_seed(0),
            scaler=scaler if fp16 else None, **settings,
        )  # fmt: skip
        bounds = []
        for step in range(4):
            x, y = labelled_batch(step, n=8)
            for part in torch.arange(8).chunk(physical):
                with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                    out = model(x[part].float())
                opt.backward(F.cross_entropy(out.float(), y[part], reduction="none"))
            opt.step()
            opt.zero_grad()
            bounds.append(torch.tensor(opt.max_grad_norm, dtype=D).norm().item())  # (its total)
        if fp16:
            assert scaler.get_scale() == 2.0**8  # (no step skipped)
    return bounds, [p.detach().to(D) for p in model.parameters()]


@pytest.mark.parametrize(
    "settings",
    [
        dict(max_grad_norm=0.3, adaptive_clipping=gradhooks.AdaptiveClipping(
            target_quantile=0.5, learning_rate=0.5, count_noise=1e-6)),
        dict(max_grad_norm=[0.2, 0.2, 0.2, 0.2], clipping_groups="parameter"),
        dict(max_grad_norm=0.3, clipping_groups="layer", clipping="automatic"),
    ],
    ids=["adaptive", "per-parameter", "per-layer-automatic"],
)  # fmt: skip
def test_clipping_variants_with_a_grad_scaler_clip_the_unscaled_gradients(settings):
    """Adaptive clipping (the bound moved by the count of unclipped examples), Opacus'
    per-layer clipping and automatic clipping per layer, each through a ``DPOptimizer`` given
    a float16 ``GradScaler``, in one physical batch per logical batch or two: the bounds
    follow the same course and the weights end where the float32 run without a scaler ends
    (within float16's rounding), so the norms that clip and count are the unscaled ones."""
    bounds, weights = dp_run(False, **settings)
    for physical in (1, 2):
        got_bounds, got = dp_run(True, physical, **settings)
        assert got_bounds == pytest.approx(bounds, rel=1e-3), physical
        for a, b in zip(got, weights):
            assert relative_error(a, b) < FP16, physical
    if "adaptive_clipping" in settings:
        assert len(set(bounds)) == len(bounds), "the bound must move for the test to tell"


# -- micro-batches, retained graphs and autograd.grad --------------------------------------------


def test_each_micro_batchs_norms_and_squares_with_the_gradients_kept_as_zeros():
    """Gradient accumulation over three micro-batches per step, the gradients zeroed by
    ``zero_grad(set_to_none=False)`` (kept as zeros): after each micro-batch's backward the
    norms and the squared sums are that micro-batch's own (the float64 loop's), while grad1
    adds up the step's micro-batches row by row, as ``.grad`` adds them; over two steps."""
    model = wide_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    quantities = ("grad1", "norms", "sum_grad_sq")
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        for step in range(2):
            opt.zero_grad(set_to_none=False)
            total = None
            for k in range(3):
                x, y = labelled_batch(10 * step + k)
                want = loop_grad(model, F.cross_entropy, x, y)
                want = {n: g / 3 for n, g in want.items()}
                total = want if total is None else {n: total[n] + g for n, g in want.items()}
                (F.cross_entropy(model(x), y) / 3).backward()
                assert_close(h.norms(), norms_of(want), f"step {step}, micro-batch {k}: norms")
                squares = h.sum_grad_sq()
                for n, g in want.items():
                    assert_close(squares[n], g.pow(2).sum(0), f"step {step}, {k}: {n}")
                assert_grad1(model, total, f"step {step}, micro-batch {k}")
            assert h.accumulated == 3
            opt.step()


def test_an_inference_mode_validation_between_two_micro_batches():
    """A validation pass in eval mode under ``inference_mode`` (of another batch size) between
    the two micro-batches of a step, as a loop that validates every N micro-batches does:
    grad1 still adds up the step's two micro-batches (the float64 loop's), over three
    steps."""
    model = wide_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            opt.zero_grad()
            total = None
            for k in range(2):
                x, y = labelled_batch(10 * step + k)
                want = loop_grad(model, F.cross_entropy, x, y)
                total = want if total is None else {n: total[n] + g for n, g in want.items()}
                F.cross_entropy(model(x), y).backward()
                if k == 0:
                    model.eval()
                    with torch.inference_mode():
                        model(torch.randn(7, 3, dtype=D))
                    model.train()
            assert_grad1(model, total, f"step {step}")
            opt.step()


def test_zero_grad_between_two_backwards_through_a_retained_graph():
    """A loss backpropagated with ``retain_graph=True`` (its gradients logged), then
    ``zero_grad()``, then a second loss of the same forward backpropagated: grad1 and the norms
    are the second loss's alone (the float64 loop's), over three steps."""
    model = wide_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)

    def second(out, y):
        return 0.5 * out.pow(2).sum(1).mean() + F.cross_entropy(out, y)

    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for step in range(STEPS):
            x, y = labelled_batch(step)
            want = loop_grad(model, second, x, y)
            out = model(x)
            F.cross_entropy(out, y).backward(retain_graph=True)
            opt.zero_grad()
            second(out, y).backward()
            assert_grad1(model, want, f"step {step}")
            assert_close(h.norms(), norms_of(want), f"step {step}: norms")
            opt.step()


def test_autograd_grad_with_materialized_zeros_for_a_head_the_loss_does_not_use():
    """``torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)`` where
    the loss uses one head of two: the gradients it returns for the other head are zeros it
    made, not a backward's, and that head gets no grad1; the trunk and the used head get the
    float64 loop's, and the loop assigns ``.grad`` and steps, over three steps."""
    model = TwoHeads().to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = labelled_batch(step)
            want = {
                n.removeprefix("model."): g
                for n, g in loop_grad(Picked(model, "a"), F.cross_entropy, x, y).items()
            }
            params = list(model.parameters())
            found = torch.autograd.grad(
                F.cross_entropy(model(x, "a")[0], y), params, allow_unused=True,
                materialize_grads=True,
            )  # fmt: skip
            for (n, p), g in zip(model.named_parameters(), found):
                if not n.startswith("b."):
                    assert_close(p.grad1, want[n], f"step {step}: {n}")
                else:
                    assert not hasattr(p, "grad1") and not g.any(), (step, n)
                p.grad = g
            opt.step()


# -- K-FAC factors under checkpointing, bfloat16, torch.compile and micro-batches ----------------


class Checkpointed(nn.Module):
    """Linear-Tanh-Linear-Tanh (3 -> 6 -> 4) as one block, run through
    ``torch.utils.checkpoint`` (``use_reentrant`` as given; ``None``: not checkpointed), and a
    Linear head (4 -> 2), seeded."""

    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2, self.l3 = nn.Linear(3, 6), nn.Linear(6, 4), nn.Linear(4, 2)
        self.reentrant = reentrant

    def block(self, x):
        return torch.tanh(self.l2(torch.tanh(self.l1(x))))

    def forward(self, x):
        if self.reentrant is None:
            return self.l3(self.block(x))
        return self.l3(checkpoint(self.block, x, use_reentrant=self.reentrant))


def kfac_reference(model: nn.Module, x, y) -> dict:
    """The empirical Fisher's factors (summed cross-entropy) by their definitions, example by
    example, of a float64 copy of ``model`` run without checkpointing."""
    ref = reference(model)
    ref.reentrant = None
    layers = {f"{n}.weight": m for n, m in ref.named_children()}
    return hand_factors(ref, (x.to(D),), {}, y, layers)


@pytest.mark.parametrize("bf16", [False, True], ids=["float64", "bf16"])
@pytest.mark.parametrize(
    "reentrant", [None, True, False], ids=["plain", "reentrant", "non-reentrant"]
)
def test_kfac_factors_under_activation_checkpointing(reentrant, bf16):
    """``quantities=("grad1", "kfac")`` on a model whose two first layers are checkpointed
    (reentrant, with an input that requires grad as reentrant checkpointing needs; or not),
    over three SGD steps with ``zero_grad``: each step's factors are that step's examples'
    (the definitions' in float64, exactly; within bfloat16's rounding under bfloat16
    autocast), and grad1 is the loop's."""
    model = Checkpointed(reentrant) if bf16 else Checkpointed(reentrant).to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("grad1", "kfac")) as h:
        for step in range(STEPS):
            x, y = labelled_batch(step)
            x = x.requires_grad_(reentrant is True)
            want = kfac_reference(model, x.detach(), y)
            per_example = loop_grad(reference(model), F.cross_entropy, x, y)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = model(x.float() if bf16 else x)
            F.cross_entropy(out.to(D), y, reduction="sum").backward()
            got = h.kfac_factors("sum")
            if bf16:
                for n, (a, g) in want.items():
                    assert relative_error(got[n].A, a) < BF16, (step, n)
                    assert relative_error(got[n].G, g) < BF16, (step, n)
                assert_near_all({n: p.grad1 for n, p in model.named_parameters()},
                                per_example, BF16, f"step {step}")  # fmt: skip
            else:
                assert_factors(got, want, f"step {step}")
                assert_grad1(model, per_example, f"step {step}")
            opt.step()


def test_kfac_factors_of_a_compiled_model_over_micro_batches_kept_as_zeros():
    """A compiled model (``torch.compile``, the eager backend) with ``quantities=("kfac",)``,
    two micro-batches per step and ``zero_grad(set_to_none=False)``: after each step's
    micro-batches, ``G`` is the sum of theirs and ``A`` the mean over all their examples (the
    definitions' in float64), and the next step starts them afresh; over three steps."""
    model = Checkpointed(None).to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("kfac",)) as h:
        compiled = torch.compile(model, backend="eager")
        for step in range(STEPS):
            opt.zero_grad(set_to_none=False)
            parts = [labelled_batch(10 * step + k) for k in range(2)]
            each = [kfac_reference(model, x, y) for x, y in parts]
            want = {
                n: ((a + each[1][n][0]) / 2, g + each[1][n][1]) for n, (a, g) in each[0].items()
            }
            for x, y in parts:
                F.cross_entropy(compiled(x), y, reduction="sum").backward()
            assert_factors(h.kfac_factors("sum"), want, f"step {step}")
            opt.step()


class Softplus(nn.Module):
    """``b = softplus(v)``: a positive bias, with its ``right_inverse``."""

    def forward(self, v):
        return F.softplus(v)

    def right_inverse(self, b):
        return torch.log(torch.expm1(b.clamp_min(1e-3)))


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_an_orthogonal_weight_and_a_parametrized_bias_into_the_dp_step(method):
    """``parametrizations.orthogonal`` on a hidden layer's weight (its original mapped to an
    orthogonal matrix by the matrix exponential) and a positive bias by a parametrization of
    a Linear's ``bias`` (softplus): three DP steps, each ``.grad`` of the originals the float64
    loop's clipped mean (no noise), with every method."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2)
    ).to(D)
    parametrizations.orthogonal(model[2])
    parametrize.register_parametrization(model[0], "bias", Softplus())
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        for step in range(STEPS):
            x, y = labelled_batch(step)
            want = clipped(loop_grad(model, F.cross_entropy, x, y), 0.5)
            assert "0.parametrizations.bias.original" in want
            opt.zero_grad()
            losses = F.cross_entropy(model(x), y, reduction="none")
            gradhooks.dp_sgd_step(h, losses, max_norm=0.5, noise_multiplier=0.0, method=method)
            for n, p in model.named_parameters():
                assert_close(p.grad, want[n], f"step {step}: {n}")
            opt.step()


def test_kfac_factors_under_a_float16_grad_scaler_are_of_the_scaled_loss():
    """K-FAC statistics in a float16 loop with a ``GradScaler`` (``scaler.scale(loss)
    .backward()``, ``scaler.step``, ``scaler.update``, a scale that grows every step): ``A`` is
    the definitions' and ``G`` the definitions' times the square of the scale the backward ran
    with (docs/mixed-precision.md), within float16's rounding, over three steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    layers = {"0.weight": model[0], "2.weight": model[2]}
    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("kfac",)) as h:
        for step in range(STEPS):
            x, y = labelled_batch(step)
            ref = reference(model)
            want = hand_factors(ref, (x,), {}, y, {n: ref.get_submodule(n[0]) for n in layers})
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x.float())
            scale = scaler.get_scale()
            scaler.scale(F.cross_entropy(out.float(), y, reduction="sum")).backward()
            got = h.kfac_factors("sum")
            for n, (a, g) in want.items():
                assert relative_error(got[n].A, a) < FP16, (step, n)
                assert relative_error(got[n].G / scale**2, g) < FP16, (step, n)
            scaler.step(opt)
            scaler.update()
        assert scaler.get_scale() > 2.0**10  # (it grew: each step's own scale was used)


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_the_dp_step_under_allow_mutation_with_the_batch_and_weights_changed(method):
    """The DP step taken inside ``allow_mutation_on_saved_tensors()`` after the batch was
    overwritten in place (a buffer reused for the next batch) and the Linear weights decayed in
    place (and restored after the step): each step's ``.grad`` is the float64 loop's clipped
    mean at the batch and weights of the forward (no noise), with every method, over three
    steps."""
    model = wide_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        for step in range(STEPS):
            x, y = labelled_batch(step)
            want = clipped(loop_grad(model, F.cross_entropy, x, y), 0.5)
            opt.zero_grad()
            with allow_mutation_on_saved_tensors():
                buffer = x.clone()
                losses = F.cross_entropy(model(buffer), y, reduction="none")
                buffer.copy_(labelled_batch(step + 100)[0])
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(0.9)
                gradhooks.dp_sgd_step(h, losses, max_norm=0.5, noise_multiplier=0.0, method=method)
            with torch.no_grad():
                for p in model.parameters():
                    p.div_(0.9)
            for n, p in model.named_parameters():
                assert_close(p.grad, want[n], f"step {step}: {n}")
            opt.step()

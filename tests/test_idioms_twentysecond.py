"""Training-loop idioms, a twenty-second set: how gradients are zeroed, observed and steered in
loops the earlier sets do not run.

Each test runs several steps of an ordinary loop with one of: each way people zero the
gradients before an accumulation (the optimizer's, the model's, ``p.grad = None``,
``torch._foreach_zero_``, fresh zeros, the old ``detach_`` and ``zero_``, ``mul_(0)``); an
activation's gradient retained for logging; a hook on the loss, or on its ``grad_fn``, that
scales the gradient; a forward-mode JVP of the hooked model; an optimizer with
``maximize=True`` behind the DP step; a linear warm-up then cosine restarts stepped by
fractional epochs on the ``DPOptimizer``; straight-through Gumbel routing; LoRA written as a
parametrization holding its own parameters (minLoRA's way); a multi-gradient hook over the
parameters; dropout inside a checkpointed block; a float32 model under a float64 default
dtype; test-time adaptation of a batch norm's affine parameters (TENT); a model split at a
detached boundary and each stage backpropagated by hand; steps under ``torch.profiler``'s
schedule; NoisyNet layers whose noise is drawn anew at every step; a complex-valued network;
an LR range test whose model and optimizer are restored; the ``0 * sum(parameters)`` term
that keeps every parameter in the graph; heteroscedastic regression losses; bootstrapped
heads masked per example; parametrized embedding rows and convolution weights; and the
input's gradient taken in the training backward (a saliency map).

Every quantity is compared at every step with each example's own gradient by a per-example loop
in float64 (:func:`gradhooks.oracle.loop_grad`), exactly in float64 or within the rounding of
the precision the loop runs in, or checked to stop with a typed error."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from test_idioms_eighteenth import BF16, clipped, norms_of, relative_error
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.checkpoint import checkpoint

import gradhooks
from gradhooks.oracle import loop_grad
from harness import (
    NormNet,
    assert_close,
    assert_grad1,
    assert_untouched,
    labelled_batch,
    model_state,
    one_thread,  # noqa: F401 (autouse in this module)
    raised,
    wide_mlp,
)

D = torch.float64
STEPS = 3
METHODS = ["grad1", "ghost", "bookkeeping"]


def reference(model: nn.Module) -> nn.Module:
    """A float64 copy of ``model``'s weights now, for the loop."""
    return copy.deepcopy(model).to(D)


def quantities_for(method: str) -> tuple:
    return ("grad1",) if method == "grad1" else ("norms",)


def assert_grads(model: nn.Module, want: dict, what: str, **tol) -> None:
    """Every ``.grad`` named in ``want`` is ``want[name]``; at least one."""
    assert want, what
    for n, p in model.named_parameters():
        if n in want:
            if tol:
                torch.testing.assert_close(p.grad.to(D), want[n], **tol)
            else:
                assert_close(p.grad, want[n], f"{what}: {n}")


def assert_near_all(got: dict, want: dict, tol: float, what: str) -> None:
    """Each ``got[name]`` within ``tol`` of ``want[name]``'s largest entry."""
    assert want, what
    for n, w in want.items():
        err = relative_error(got[n], w)
        assert err < tol, f"{what}: {n} off by {err:.2e}"


def dp_step(h, losses, method: str, bound: float = 0.5):
    return gradhooks.dp_sgd_step(h, losses, max_norm=bound, noise_multiplier=0.0, method=method)


# -- each way of zeroing the gradients --------------------------------------------------------------


def _present(model):
    return [p for p in model.parameters() if p.grad is not None]


def _old_zero_grad(model, opt):
    """torch's ``zero_grad`` before ``set_to_none``: detach the gradient, then zero it."""
    for p in _present(model):
        p.grad.detach_()
        p.grad.zero_()


ZEROINGS = {
    "optimizer": lambda model, opt: opt.zero_grad(),
    "optimizer-keeping-zeros": lambda model, opt: opt.zero_grad(set_to_none=False),
    "model": lambda model, opt: model.zero_grad(),
    "grad-set-to-none": lambda model, opt: [setattr(p, "grad", None) for p in model.parameters()],
    "foreach-zero": lambda model, opt: (
        _present(model) and torch._foreach_zero_([p.grad for p in _present(model)])
    ),
    "fresh-zeros": lambda model, opt: [
        setattr(p, "grad", torch.zeros_like(p)) for p in model.parameters()
    ],
    "detach-then-zero": _old_zero_grad,
    "multiplied-by-zero": lambda model, opt: [p.grad.mul_(0) for p in _present(model)],
}


@pytest.mark.parametrize("zeroing", list(ZEROINGS))
def test_each_way_of_zeroing_the_gradients_before_an_accumulation(zeroing):
    """Two micro-batches of five accumulated into each of three SGD steps, the gradients zeroed
    before each step in one of the ways training scripts do it. grad1 starts afresh at each
    step and adds the second micro-batch's rows to the first's, as ``.grad`` adds: each
    example's row is the float64 loop's gradient of its two losses (each halved, the
    micro-batches' mean), and grad1's mean is ``.grad``."""
    model = wide_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            ZEROINGS[zeroing](model, opt)
            want = None
            for micro in range(2):
                x, y = labelled_batch(10 * step + micro)
                got = loop_grad(model, F.cross_entropy, x, y)
                got = {n: g / 2 for n, g in got.items()}
                want = got if want is None else {n: want[n] + got[n] for n in got}
                (F.cross_entropy(model(x), y) / 2).backward()
            assert_grad1(model, want, f"{zeroing}, step {step}")
            for n, p in model.named_parameters():
                assert_close(p.grad1.mean(0), p.grad, f"{zeroing}, step {step}: {n} reduced")
            opt.step()


# -- an activation's gradient retained for logging --------------------------------------------------


class Logged(nn.Module):
    """:func:`wide_mlp`'s layers, keeping the hidden activation (``self.hidden``), and with
    ``retain`` its gradient by ``retain_grad()`` in the forward, for the loop to log after the
    backward (as saliency and gradient-flow plots do)."""

    def __init__(self, retain: bool) -> None:
        super().__init__()
        self.body, self.retain, self.hidden = wide_mlp(), retain, None

    def forward(self, x):
        h = torch.tanh(self.body[0](x))
        if self.retain and h.requires_grad:
            h.retain_grad()
        self.hidden = h
        return self.body[2](h)


RETAINED = [
    pytest.param("hidden-in-the-forward", False, id="hidden-in-the-forward-float64"),
    pytest.param("hidden-in-the-forward", True, id="hidden-in-the-forward-bf16"),
    pytest.param("logits-after-the-forward", False, id="logits-after-the-forward"),
    pytest.param(
        "hidden-after-the-forward", False, id="hidden-after-the-forward",
        marks=pytest.mark.xfail(
            strict=True,
            reason="the check's own backwards on a verifying backward add to the .grad of an "
            "activation whose retain_grad() was called after the forward: gradhooks sees only "
            "the tensors retained during the forward and the outputs (verify=False avoids it)",
        ),
    ),
]  # fmt: skip


def retained(model: Logged, out, where: str):
    """Asks for the gradient of the activation ``where`` says, and returns that tensor."""
    if where == "logits-after-the-forward":
        out.retain_grad()
        return out
    if where == "hidden-after-the-forward":
        model.hidden.retain_grad()
    return model.hidden


@pytest.mark.parametrize("where, bf16", RETAINED)
def test_a_gradient_retained_on_an_activation_for_logging(where, bf16):
    """``retain_grad()`` on the hidden activation inside the forward, or on the logits after
    it, and that ``.grad`` logged after every backward. Over three Adam steps grad1 and the
    norms are the float64 loop's (within bfloat16's rounding under autocast), and the retained
    ``.grad`` is what the same step gives without gradhooks, though the first backward is one
    that checks the hooks by backwards of its own through the same graph."""
    model = Logged(where == "hidden-in-the-forward")
    model = model.float() if bf16 else model
    twin = copy.deepcopy(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    dtype = next(model.parameters()).dtype
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for step in range(STEPS):
            x, y = labelled_batch(step)
            want = loop_grad(reference(model), F.cross_entropy, x, y)
            twin.load_state_dict(model.state_dict())
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = model(x.to(dtype))
                plain = twin(x.to(dtype))
            logged, expected = retained(model, out, where), retained(twin, plain, where)
            F.cross_entropy(out.to(D), y).backward()
            F.cross_entropy(plain.to(D), y).backward()
            assert logged.grad is not None
            assert torch.equal(logged.grad, expected.grad), step
            if bf16:
                grad1 = {n: p.grad1 for n, p in model.named_parameters()}
                assert_near_all(grad1, want, BF16, f"step {step}")
                assert relative_error(h.norms(), norms_of(want)) < BF16
            else:
                assert_grad1(model, want, f"step {step}")
                assert_close(h.norms(), norms_of(want), f"step {step}: norms")
            opt.step()
            model.hidden = twin.hidden = None  # (logged; a graph's tensor does not deep-copy)


# -- a hook on the loss that scales its gradient ----------------------------------------------------


def scale_the_loss_gradient(loss, how: str, factor: float):
    if how == "tensor-hook":
        loss.register_hook(lambda g: g * factor)
    else:
        loss.grad_fn.register_prehook(lambda grads: tuple(g * factor for g in grads))


@pytest.mark.parametrize("how", ["tensor-hook", "grad-fn-prehook"])
def test_a_hook_on_the_loss_that_scales_its_gradient(how):
    """A static loss scale put on as a hook rather than a product (``loss.register_hook(lambda
    g: g * 4)``, or a pre-hook on ``loss.grad_fn``): the backward starts from 4 instead of 1.
    At each of three steps grad1 is 4 times the float64 loop's, its mean is ``.grad``, and
    the optimizer, given ``.grad / 4`` back by hand, steps as without the scale."""
    model, twin = wide_mlp(), wide_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.2)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = labelled_batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            twin_opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            scale_the_loss_gradient(loss, how, 4.0)
            loss.backward()
            F.cross_entropy(twin(x), y).backward()
            assert_grad1(model, {n: 4 * g for n, g in want.items()}, f"step {step}")
            for n, p in model.named_parameters():
                assert_close(p.grad1.mean(0), p.grad, f"step {step}: {n} reduced")
                p.grad.div_(4)
            opt.step()
            twin_opt.step()
            for p, q in zip(model.parameters(), twin.parameters()):
                assert_close(p.detach(), q.detach(), f"step {step}: weights")


# -- forward-mode AD of the hooked model ------------------------------------------------------------


def jvp_of(model: nn.Module, x, v):
    """The forward-mode JVP of ``model`` at ``x`` along ``v`` (``torch.autograd.forward_ad``)."""
    with fwAD.dual_level():
        out = model(fwAD.make_dual(x, v))
        return fwAD.unpack_dual(out).tangent


@pytest.mark.parametrize("when", ["between-steps", "before-the-backward"])
def test_a_forward_mode_jvp_of_the_hooked_model(when):
    """A directional derivative of the outputs along an input direction, taken by forward-mode
    AD (``fwAD.make_dual``) on the hooked model for a sensitivity log, between two steps or
    between a step's forward and its backward. The JVP is what the model gives without
    gradhooks, and each step's grad1 and norms are the float64 loop's, over three steps."""
    model = wide_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    v = torch.linspace(-1, 1, 15, dtype=D).reshape(5, 3)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for step in range(STEPS):
            x, y = labelled_batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            plain = jvp_of(reference(model), x, v)
            opt.zero_grad()
            if when == "between-steps":
                assert_close(jvp_of(model, x, v), plain, f"step {step}: jvp")
            loss = F.cross_entropy(model(x), y)
            if when == "before-the-backward":
                assert_close(jvp_of(model, x, v), plain, f"step {step}: jvp")
            loss.backward()
            assert_grad1(model, want, f"step {step}")
            assert_close(h.norms(), norms_of(want), f"step {step}: norms")
            opt.step()


# -- an optimizer with maximize=True behind the DP step ---------------------------------------------


@pytest.mark.parametrize("how", ["dp_sgd_step", "DPOptimizer"])
def test_gradient_ascent_by_an_optimizer_with_maximize_through_the_dp_step(how):
    """An adversary trained privately to raise a loss, by an SGD with ``maximize=True`` rather
    than a negated loss. At each of three steps ``.grad`` is the float64 loop's clipped mean
    of the loss's own gradients (no noise), and the step moves every weight up it by the
    learning rate."""
    model = wide_mlp()
    base = torch.optim.SGD(model.parameters(), lr=0.1, maximize=True)
    with gradhooks.add_hooks(model) as h:
        opt = base if how == "dp_sgd_step" else gradhooks.DPOptimizer(
            base, h, max_grad_norm=0.5, noise_multiplier=0.0, expected_batch_size=5
        )  # fmt: skip
        for step in range(STEPS):
            x, y = labelled_batch(step)
            want = clipped(loop_grad(model, F.cross_entropy, x, y), 0.5)
            opt.zero_grad()
            losses = F.cross_entropy(model(x), y, reduction="none")
            if how == "dp_sgd_step":
                dp_step(h, losses, "grad1")
            else:
                opt.backward(losses)
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            if how == "dp_sgd_step":
                assert_grads(model, want, f"step {step}")
            opt.step()
            for n, p in model.named_parameters():
                assert_close((p.detach() - before[n]) / 0.1, want[n], f"step {step}: {n} moved")


# -- a warm-up then cosine restarts on the DPOptimizer ----------------------------------------------


def test_a_linear_warmup_then_cosine_restarts_stepped_by_fractional_epochs_on_the_dp_optimizer():
    """``SequentialLR`` of a ``LinearLR`` warm-up and ``CosineAnnealingWarmRestarts``, the
    restarts stepped within the epoch by a fractional epoch (``step(epoch + i / iters)``, as
    its documentation shows), on a ``DPOptimizer`` over SGD. At each step the weights move by
    the scheduled learning rate times the float64 loop's clipped mean (no noise), and the
    rate follows what the same schedule gives a plain SGD."""
    model, twin = wide_mlp(), wide_mlp()
    plain = torch.optim.SGD(twin.parameters(), lr=0.1)
    with gradhooks.add_hooks(model) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), h, max_grad_norm=0.5,
            noise_multiplier=0.0, expected_batch_size=5,
        )  # fmt: skip
        schedules = []
        for o in (opt, plain):
            warm = torch.optim.lr_scheduler.LinearLR(o, start_factor=0.25, total_iters=2)
            restarts = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=2)
            schedules.append((warm, restarts))
        rates = set()
        for step in range(6):
            x, y = labelled_batch(step)
            want = clipped(loop_grad(model, F.cross_entropy, x, y), 0.5)
            opt.zero_grad()
            opt.backward(F.cross_entropy(model(x), y, reduction="none"))
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            lr = opt.param_groups[0]["lr"]
            rates.add(round(lr, 9))
            assert lr == pytest.approx(plain.param_groups[0]["lr"]), step
            opt.step()
            plain.step()
            for n, p in model.named_parameters():
                assert_close((before[n] - p.detach()) / lr, want[n], f"step {step}: {n}")
            for warm, restarts in schedules:
                if step < 2:
                    warm.step()
                else:
                    restarts.step((step - 2) / 2)  # two iterations per epoch
        assert len(rates) >= 4, rates


# -- straight-through Gumbel routing -----------------------------------------------------------------


class Routed(nn.Module):
    """A trunk, a gate and two experts: each example goes to the expert of the largest of its
    gate logits plus Gumbel noise, hard in the forward and soft in the backward
    (straight-through, ``F.gumbel_softmax(hard=True)`` with the noise drawn outside)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.gate = nn.Linear(3, 6), nn.Linear(6, 2)
        self.experts = nn.ModuleList([nn.Linear(6, 2), nn.Linear(6, 2)])

    def forward(self, x, noise):
        h = torch.tanh(self.trunk(x))
        soft = ((self.gate(h) + noise) / 0.5).softmax(-1)
        hard = F.one_hot(soft.argmax(-1), 2).to(soft.dtype)
        w = hard - soft.detach() + soft
        outs = torch.stack([e(h) for e in self.experts], 1)
        return (w.unsqueeze(-1) * outs).sum(1)


def gumbel(step: int, n: int = 5):
    g = torch.Generator().manual_seed(100 + step)
    u = torch.rand(n, 2, generator=g, dtype=D).clamp(1e-6, 1 - 1e-6)
    return -torch.log(-torch.log(u))


@pytest.mark.parametrize("bf16", [False, True], ids=["float64", "bf16"])
def test_gumbel_straight_through_routing_between_two_experts(bf16):
    """Straight-through Gumbel routing over three AdamW steps: grad1 and the norms of the
    trunk, the gate and both experts are the float64 loop's given the same noise (exactly in
    float64, within bfloat16's rounding under autocast), the gate's through the soft weights
    alone."""
    model = Routed().to(torch.float32 if bf16 else D)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    dtype = next(model.parameters()).dtype
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for step in range(STEPS):
            x, y = labelled_batch(step)
            noise = gumbel(step)
            want = loop_grad(reference(model), F.cross_entropy, (x, noise), y)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = model(x.to(dtype), noise.to(dtype))
            F.cross_entropy(out.to(D), y).backward()
            if bf16:
                grad1 = {n: p.grad1 for n, p in model.named_parameters()}
                assert_near_all(grad1, want, BF16, f"step {step}")
                assert relative_error(h.norms(), norms_of(want)) < BF16
            else:
                assert_grad1(model, want, f"step {step}")
                assert_close(h.norms(), norms_of(want), f"step {step}: norms")
            opt.step()


# -- LoRA written as a parametrization with its own parameters (minLoRA) --------------------------


class LoRA(nn.Module):
    """minLoRA's parametrization: ``W + B @ A * scale``, its ``A`` and ``B`` parameters of the
    parametrization module itself (``parametrizations.weight[0]``), the original frozen."""

    def __init__(self, fan_out: int, fan_in: int, rank: int = 2) -> None:
        super().__init__()
        self.A = nn.Parameter(0.3 * torch.randn(rank, fan_in))
        self.B = nn.Parameter(0.3 * torch.randn(fan_out, rank))
        self.scale = 0.5

    def forward(self, W):
        return W + (self.B @ self.A).to(W.dtype) * self.scale


def lora_mlp() -> nn.Sequential:
    """:func:`wide_mlp` with a :class:`LoRA` parametrization on both weights, every original
    weight frozen (the biases train)."""
    model = wide_mlp()
    torch.manual_seed(1)
    for layer in (model[0], model[2]):
        out, fan_in = layer.weight.shape
        parametrize.register_parametrization(layer, "weight", LoRA(out, fan_in).to(D))
        layer.parametrizations.weight.original.requires_grad_(False)
    return model


def test_a_lora_written_as_a_parametrization_with_its_own_parameters():
    """LoRA as minLoRA adds it, a parametrization whose module holds ``A`` and ``B``: over
    three AdamW steps grad1 and the norms of both layers' ``A``, ``B`` and biases are the
    float64 loop's, and the frozen originals have none."""
    model = lora_mlp()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for step in range(STEPS):
            x, y = labelled_batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            assert any(n.endswith(".A") for n in want)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}", frozen_clean=True)
            assert_close(h.norms(), norms_of(want), f"step {step}: norms")
            opt.step()


@pytest.mark.parametrize("method", METHODS)
def test_a_lora_parametrization_into_the_dp_step(method):
    """The same LoRA parametrization trained by ``dp_sgd_step``: at each of three steps
    ``.grad`` of ``A``, ``B`` and the biases is the float64 loop's clipped mean (no noise),
    with every method."""
    model = lora_mlp()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.2)
    with gradhooks.add_hooks(model, quantities=quantities_for(method)) as h:
        for step in range(STEPS):
            x, y = labelled_batch(step)
            want = clipped(loop_grad(model, F.cross_entropy, x, y), 0.5)
            opt.zero_grad()
            dp_step(h, F.cross_entropy(model(x), y, reduction="none"), method)
            assert_grads(model, want, f"step {step}")
            opt.step()


# -- a multi-gradient hook over the parameters ------------------------------------------------------


def test_a_multi_grad_hook_over_the_parameters_sees_each_backwards_gradients():
    """``torch.autograd.graph.register_multi_grad_hook`` over every parameter (how a logger
    learns that a backward has computed all of them): it fires once per backward with the
    batch gradients that backward computed, and grad1 and the norms are the float64 loop's,
    over three steps of two micro-batches each."""
    model = wide_mlp()
    params = tuple(model.parameters())
    seen = []
    handle = torch.autograd.graph.register_multi_grad_hook(
        params, lambda grads: seen.append([g.clone() for g in grads])
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    try:
        with gradhooks.add_hooks(model, quantities=("grad1", "norms")):
            for step in range(STEPS):
                opt.zero_grad()
                total = None
                for micro in range(2):
                    x, y = labelled_batch(10 * step + micro)
                    want = loop_grad(model, F.cross_entropy, x, y)
                    total = want if total is None else {n: total[n] + want[n] for n in want}
                    seen.clear()
                    F.cross_entropy(model(x), y).backward()
                    assert len(seen) == 1, (step, micro, len(seen))
                    for (n, _), g in zip(model.named_parameters(), seen[0]):
                        assert_close(g, want[n].mean(0), f"step {step}.{micro}: hook's {n}")
                assert_grad1(model, total, f"step {step}")
                opt.step()
    finally:
        handle.remove()


# -- dropout inside a checkpointed block ----------------------------------------------------------------


class Checkpointed(nn.Module):
    """A layer, a checkpointed block (Linear then ``Dropout(0.3)``) and a head. Given ``mask``
    (the dropout's kept entries) it runs without checkpointing and with that mask instead:
    the loop's model for one example."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.fc, self.head = nn.Linear(3, 6), nn.Linear(6, 6), nn.Linear(6, 2)
        self.drop, self.reentrant = nn.Dropout(0.3), reentrant

    def block(self, h):
        return torch.tanh(self.drop(self.fc(h)))

    def forward(self, x, mask=None):
        h = torch.tanh(self.l1(x))
        if mask is not None:
            h = torch.tanh(self.fc(h) * mask / 0.7)
        else:
            h = checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.head(h)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_dropout_inside_a_checkpointed_block_replays_its_mask(reentrant):
    """Activation checkpointing of a block with dropout (``preserve_rng_state``, the default,
    replays the forward's mask when the backward recomputes it), over three Adam steps: grad1
    and the norms are the float64 loop's with each example's mask as the forward drew it (read
    by a forward hook on the dropout, the same at the recomputation)."""
    model = Checkpointed(reentrant).to(D)
    masks = []
    model.drop.register_forward_hook(lambda m, args, out: masks.append(out != 0))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for step in range(STEPS):
            x, y = labelled_batch(step)
            x.requires_grad_(reentrant)  # (reentrant checkpointing needs an input with grad)
            masks.clear()
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            mask = masks[0].to(D)
            want = loop_grad(model, F.cross_entropy, (x.detach(), mask), y)
            loss.backward()
            assert len(masks) == 2 and torch.equal(masks[0], masks[1]), step
            assert 0 < mask.sum() < mask.numel()
            assert_grad1(model, want, f"step {step}")
            assert_close(h.norms(), norms_of(want), f"step {step}: norms")
            opt.step()


# -- a float32 model under a float64 default dtype ----------------------------------------------------


@pytest.fixture
def float64_default():
    """``torch.set_default_dtype(torch.float64)`` for the test, as a scientific script sets it
    at its top, and back after it."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(D)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@pytest.mark.parametrize("method", [None, *METHODS], ids=["grad1-and-norms", *METHODS])
def test_a_float32_model_trained_under_a_float64_default_dtype(float64_default, method):
    """The default dtype set to float64 at the top of the script, the model and its batches in
    float32 all the same: over three steps grad1 (in float32) and the norms, or each DP step's
    ``.grad``, are the float64 loop's within float32's rounding."""
    model = wide_mlp().float()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    quantities = ("grad1", "norms") if method is None else quantities_for(method)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        for step in range(STEPS):
            x, y = labelled_batch(step)
            per_example = loop_grad(reference(model), F.cross_entropy, x, y)
            opt.zero_grad()
            out = model(x.float())
            assert out.dtype == torch.float32
            if method is None:
                F.cross_entropy(out, y).backward()
                grad1 = {n: p.grad1 for n, p in model.named_parameters()}
                assert all(g.dtype == torch.float32 for g in grad1.values())
                assert_near_all(grad1, per_example, 1e-5, f"step {step}")
                assert h.norms().dtype == torch.float32
                assert relative_error(h.norms(), norms_of(per_example)) < 1e-5
            else:
                dp_step(h, F.cross_entropy(out, y, reduction="none"), method)
                got = {n: p.grad for n, p in model.named_parameters()}
                assert all(g.dtype == torch.float32 for g in got.values())
                assert_near_all(got, clipped(per_example, 0.5), 1e-5, f"step {step}")
            opt.step()


# -- test-time adaptation of a batch norm's affine parameters (TENT) ---------------------------------


def entropy(logits):
    """Each example's prediction entropy (TENT's loss), ``[batch]``."""
    logp = logits.log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def tent_model() -> NormNet:
    """:class:`NormNet` with its batch norm's affine parameters alone trainable (TENT)."""
    model = NormNet().to(D)
    model.requires_grad_(False)
    model.bn.requires_grad_(True)
    return model


def test_tent_adapting_a_batch_norm_in_training_mode_is_refused_naming_it():
    """TENT puts the model in training mode so that its batch norm normalizes by the test
    batch's own statistics, and minimizes the entropy of the predictions by the batch norm's
    affine parameters: each example's output then depends on every other, and there is no
    example's own gradient. The forward is refused with a ``MixedExamplesError`` naming the
    batch norm, and the model is left as it was (no ``grad1``, its hooks gone after)."""
    model = tent_model().train()
    before = model_state(model)
    x, _ = labelled_batch(0)
    with gradhooks.add_hooks(model):
        raised(gradhooks.MixedExamplesError, ["'bn'"], lambda: model(x))
    assert_untouched(model, before)


@pytest.mark.parametrize("method", [None, *METHODS], ids=["grad1-and-norms", *METHODS])
def test_tent_with_the_running_statistics_adapts_the_affine_parameters(method):
    """TENT's adaptation with the batch norm kept in eval mode (its running statistics, each
    example normalized alone): over three steps of the entropy's minimization grad1 and the
    norms of the affine parameters, or each DP step's ``.grad``, are the float64 loop's."""
    model = tent_model().eval()
    opt = torch.optim.SGD([model.bn.weight, model.bn.bias], lr=0.5, momentum=0.9)
    quantities = ("grad1", "norms") if method is None else quantities_for(method)

    def mean_entropy(out, target=None):
        return entropy(out).mean()

    with gradhooks.add_hooks(model, quantities=quantities) as h:
        for step in range(STEPS):
            x, _ = labelled_batch(step)
            per_example = loop_grad(model, mean_entropy, x)
            assert set(per_example) == {"bn.weight", "bn.bias"}
            opt.zero_grad()
            if method is None:
                mean_entropy(model(x)).backward()
                assert_grad1(model, per_example, f"step {step}", frozen_clean=True)
                assert_close(h.norms(), norms_of(per_example), f"step {step}: norms")
            else:
                dp_step(h, entropy(model(x)), method)
                assert_grads(model, clipped(per_example, 0.5), f"step {step}")
            opt.step()


# -- a model split at a detached boundary, each stage backpropagated by hand ------------------------


def test_a_model_split_at_a_detached_boundary_each_stage_backwarded_by_hand():
    """Pipeline stages written out by hand: the trunk's output detached into a leaf that
    requires grad, the head's loss backpropagated to it, then the trunk's backward from that
    leaf's ``.grad`` (``h.backward(boundary.grad)``). Over three steps grad1 and the norms of
    both stages are the float64 loop's of the whole model; the norms, of the last backward,
    are each stage's in turn."""
    model = wide_mlp()
    trunk, head = model[:2], model[2:]
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for step in range(STEPS):
            x, y = labelled_batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            hidden = trunk(x)
            boundary = hidden.detach().requires_grad_()
            F.cross_entropy(head(boundary), y).backward()
            stage = {n: g for n, g in want.items() if n.startswith("2.")}
            assert_close(h.norms(), norms_of(stage), f"step {step}: the head's norms")
            hidden.backward(boundary.grad)
            stage = {n: g for n, g in want.items() if n.startswith("0.")}
            assert_close(h.norms(), norms_of(stage), f"step {step}: the trunk's norms")
            assert_grad1(model, want, f"step {step}")
            opt.step()


# -- steps under torch.profiler's schedule ------------------------------------------------------------


@pytest.mark.parametrize("method", [None, "ghost"], ids=["grad1-and-norms", "ghost"])
def test_steps_recorded_by_the_profiler_with_its_schedule(method):
    """Five steps under ``torch.profiler.profile`` with a ``schedule`` (wait, warm-up, two
    active steps), shapes and memory recorded, ``prof.step()`` after each: grad1 and the norms,
    or the ghost DP step's ``.grad``, are the float64 loop's at every step, recorded or not."""
    from torch.profiler import ProfilerActivity, profile, schedule

    model = wide_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    quantities = ("grad1", "norms") if method is None else ("norms",)
    traced = []
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        with profile(
            activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=2),
            record_shapes=True, profile_memory=True,
            on_trace_ready=lambda p: traced.append(len(p.key_averages())),
        ) as prof:  # fmt: skip
            for step in range(5):
                x, y = labelled_batch(step)
                want = loop_grad(model, F.cross_entropy, x, y)
                opt.zero_grad()
                if method is None:
                    F.cross_entropy(model(x), y).backward()
                    assert_grad1(model, want, f"step {step}")
                    assert_close(h.norms(), norms_of(want), f"step {step}: norms")
                else:
                    dp_step(h, F.cross_entropy(model(x), y, reduction="none"), method)
                    assert_grads(model, clipped(want, 0.5), f"step {step}")
                opt.step()
                prof.step()
    assert len(traced) == 1 and traced[0] > 0, traced


# -- NoisyNet layers, their noise drawn anew at every step ------------------------------------------


class NoisyLinear(nn.Module):
    """Rainbow's NoisyNet layer with factorised Gaussian noise: ``weight = mu + sigma * eps``,
    ``eps`` buffers drawn anew by ``reset_noise()``, the mean weights alone in eval mode."""

    def __init__(self, fan_in: int, fan_out: int, sigma0: float = 0.5) -> None:
        super().__init__()
        bound = 1 / math.sqrt(fan_in)
        self.weight_mu = nn.Parameter(torch.empty(fan_out, fan_in).uniform_(-bound, bound))
        self.weight_sigma = nn.Parameter(torch.full((fan_out, fan_in), sigma0 * bound))
        self.bias_mu = nn.Parameter(torch.empty(fan_out).uniform_(-bound, bound))
        self.bias_sigma = nn.Parameter(torch.full((fan_out,), sigma0 * bound))
        self.register_buffer("weight_epsilon", torch.zeros(fan_out, fan_in))
        self.register_buffer("bias_epsilon", torch.zeros(fan_out))

    @staticmethod
    def _scaled(n: int, g: torch.Generator) -> torch.Tensor:
        x = torch.randn(n, generator=g)
        return x.sign() * x.abs().sqrt()

    def reset_noise(self, g: torch.Generator) -> None:
        eps_in = self._scaled(self.weight_mu.shape[1], g)
        eps_out = self._scaled(self.weight_mu.shape[0], g)
        self.weight_epsilon.copy_(torch.outer(eps_out, eps_in))
        self.bias_epsilon.copy_(eps_out)

    def forward(self, x):
        if not self.training:
            return F.linear(x, self.weight_mu, self.bias_mu)
        weight = self.weight_mu + self.weight_sigma * self.weight_epsilon
        return F.linear(x, weight, self.bias_mu + self.bias_sigma * self.bias_epsilon)


def noisy_q_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.ReLU(), NoisyLinear(6, 6), nn.ReLU(),
                         NoisyLinear(6, 2)).to(D)  # fmt: skip


def q_batch(step: int, n: int = 5):
    """States, actions and TD targets of a replay batch."""
    g = torch.Generator().manual_seed(step)
    return (torch.randn(n, 3, generator=g, dtype=D), torch.randint(2, (n,), generator=g),
            torch.randn(n, generator=g, dtype=D))  # fmt: skip


def td_losses(q, action, target):
    """Each transition's Huber loss of its action's Q-value against its target, ``[batch]``."""
    return F.smooth_l1_loss(q.gather(1, action[:, None])[:, 0], target, reduction="none")


def replayed_td(q, replay):
    """The mean TD loss given ``[batch, 2]`` rows of (target, action): the loop's loss."""
    return td_losses(q, replay[:, 1].long(), replay[:, 0]).mean()


def test_noisy_net_layers_resample_their_noise_at_every_step():
    """A Q-network of NoisyNet layers (Rainbow), its noise drawn anew before every step
    (``reset_noise``), a greedy action taken under ``no_grad`` with the mean weights in eval
    mode between steps, the Huber TD loss of the replayed actions and Adam: grad1 and the
    norms of the means and the sigmas are the float64 loop's with the step's noise."""
    model = noisy_q_net()
    g = torch.Generator().manual_seed(7)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for step in range(STEPS):
            model.eval()
            with torch.no_grad():
                model(torch.randn(1, 3, dtype=D)).argmax(1)  # (acting)
            model.train()
            for layer in (model[2], model[4]):
                layer.reset_noise(g)
            s, a, target = q_batch(step)
            want = loop_grad(model, replayed_td, s, torch.stack([target, a.to(D)], 1))
            opt.zero_grad()
            td_losses(model(s), a, target).mean().backward()
            assert_grad1(model, want, f"step {step}")
            assert_close(h.norms(), norms_of(want), f"step {step}: norms")
            opt.step()


@pytest.mark.parametrize("method", METHODS)
def test_noisy_net_layers_into_the_dp_step(method):
    """The NoisyNet Q-network trained privately by ``dp_sgd_step`` on each transition's TD
    loss, its noise drawn anew at every step: ``.grad`` is the float64 loop's clipped mean (no
    noise of the DP step's), with every method."""
    model = noisy_q_net()
    g = torch.Generator().manual_seed(7)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model, quantities=quantities_for(method)) as h:
        for step in range(STEPS):
            for layer in (model[2], model[4]):
                layer.reset_noise(g)
            s, a, target = q_batch(step)
            want = clipped(loop_grad(model, replayed_td, s, torch.stack([target, a.to(D)], 1)), 1)
            opt.zero_grad()
            dp_step(h, td_losses(model(s), a, target), method, bound=1.0)
            assert_grads(model, want, f"step {step}")
            opt.step()


# -- a complex-valued network ------------------------------------------------------------------------


class ComplexNet(nn.Module):
    """A complex convolution, a split-tanh activation and a complex Linear: a model of complex
    signals (radio, MRI), its loss real. ``"1d"``: a Conv1d (2 -> 3 channels) over 4
    positions; ``"transposed"``: a ConvTranspose1d (2 -> 3 channels, stride 2) of them;
    ``"2d"``: a Conv2d (8 -> 2 channels) over 6x6 maps, more positions than output channels
    (the size at which a real convolution's grad1 takes another form on the CPU)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        c = torch.complex128
        if kind == "1d":
            self.conv, self.fc = nn.Conv1d(2, 3, 3, padding=1, dtype=c), nn.Linear(12, 2, dtype=c)
        elif kind == "transposed":
            self.conv = nn.ConvTranspose1d(2, 3, 3, stride=2, dtype=c)
            self.fc = nn.Linear(27, 2, dtype=c)
        else:
            self.conv, self.fc = nn.Conv2d(8, 2, 3, padding=1, dtype=c), nn.Linear(72, 2, dtype=c)

    def forward(self, x):
        h = self.conv(x)
        h = torch.complex(torch.tanh(h.real), torch.tanh(h.imag))
        return self.fc(h.flatten(1))


def complex_loss(out, target):
    """Half the squared distance of the complex outputs to the targets, per example summed."""
    return 0.5 * (out - target).abs().pow(2).sum(1).mean()


@pytest.mark.parametrize("kind", ["1d", "transposed", "2d"])
def test_a_complex_valued_network_trained_with_adam(kind):
    """A complex-valued Conv1d and Linear over three Adam steps (Adam takes complex
    parameters as their real and imaginary parts): grad1 of every complex parameter is the
    float64 loop's in autograd's convention (the conjugate Wirtinger derivative), and its mean
    is ``.grad``."""
    model = ComplexNet(kind)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    shape = (4, 8, 6, 6) if kind == "2d" else (4, 2, 4)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(*shape, generator=g, dtype=torch.complex128)
            target = torch.randn(4, 2, generator=g, dtype=torch.complex128)
            want = loop_grad(model, complex_loss, x, target)
            opt.zero_grad()
            complex_loss(model(x), target).backward()
            assert_grad1(model, want, f"step {step}")
            for n, p in model.named_parameters():
                assert p.grad1.is_complex(), n
                assert_close(p.grad1.mean(0), p.grad, f"step {step}: {n} reduced")
            opt.step()


# -- an LR range test, then the model and the optimizer restored --------------------------------------


def test_an_lr_range_test_then_the_model_and_optimizer_restored():
    """An LR finder's range test (fastai, torch-lr-finder): the states of the model and the
    optimizer saved, a few steps at an exponentially rising rate, then both states loaded back
    and training started at the rate found. After the restore every step's grad1 and norms
    are the float64 loop's, and the weights follow an unhooked twin that never ran the test."""
    model, twin = wide_mlp(), wide_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    twin_opt = torch.optim.Adam(twin.parameters(), lr=1e-4)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
        finder = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=10.0)
        losses = []
        for step in range(4):
            x, y = labelled_batch(50 + step)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            losses.append(loss.item())
            opt.step()
            finder.step()
        model.load_state_dict(saved[0])
        opt.load_state_dict(saved[1])
        for group in (*opt.param_groups, *twin_opt.param_groups):
            group["lr"] = 0.01
        for step in range(STEPS):
            x, y = labelled_batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            twin_opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            F.cross_entropy(twin(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            assert_close(h.norms(), norms_of(want), f"step {step}: norms")
            opt.step()
            twin_opt.step()
            for (n, p), q in zip(model.named_parameters(), twin.parameters()):
                assert_close(p.detach(), q.detach(), f"step {step}: {n}")


# -- 0 * sum(parameters): every parameter kept in the graph -----------------------------------------


class Branchy(nn.Module):
    """A trunk and two heads of which a step uses one: the other would have no gradient, so
    the loop adds ``0 * sum(p.sum() for p in parameters)`` to the loss (what DDP's unused
    parameters push scripts to write)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.heads = nn.Linear(3, 6), nn.ModuleList([nn.Linear(6, 2), nn.Linear(6, 2)])

    def forward(self, x, head: int = 0):
        return self.heads[head](torch.tanh(self.trunk(x)))


def test_zero_times_every_parameter_added_to_keep_unused_heads_in_the_graph():
    """The ``0 * sum(parameters)`` term added to each step's loss, one head used per step: the
    term adds exactly nothing, every parameter gets a ``.grad`` (the float64 loop's mean), and
    over four steps grad1 is the float64 loop's (zero rows for the head the step did not use)
    and its mean ``.grad``; a head that no captured call has reached yet has none, and a
    ``GradhooksWarning`` names it (its gradient came from outside the hooked modules)."""
    model = Branchy().to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    with gradhooks.add_hooks(model):
        for step in range(4):
            head = step % 2
            x, y = labelled_batch(step)
            used = loop_grad(OneHead(model, head), F.cross_entropy, x, y)
            want = {
                n: used[n] if n in used else torch.zeros(5, *p.shape, dtype=D)
                for n, p in model.named_parameters()
            }
            opt.zero_grad()
            dummy = 0 * sum(p.sum() for p in model.parameters())
            with warnings.catch_warnings(record=True) as told:
                warnings.simplefilter("always")
                (F.cross_entropy(model(x, head), y) + dummy).backward()
            told = " ".join(
                str(w.message) for w in told if w.category is gradhooks.GradhooksWarning
            )
            assert all(p.grad is not None for p in model.parameters())
            for n, p in model.named_parameters():
                assert_close(p.grad, want[n].mean(0), f"step {step}: {n}'s .grad")
                if not hasattr(p, "grad1"):  # (never reached by a captured call yet: told so)
                    assert n.startswith(f"heads.{1 - head}.") and f"'{n}'" in told, (step, n)
                    continue
                assert_close(p.grad1, want[n], f"step {step}: {n}")
                assert_close(p.grad1.mean(0), p.grad, f"step {step}: {n} reduced")
            opt.step()


class OneHead(nn.Module):
    """``model(x, head)`` with the model's own parameter names: the loop's model of a step."""

    def __init__(self, model: Branchy, head: int) -> None:
        super().__init__()
        self.trunk, self.heads, self.head = model.trunk, model.heads, head

    def forward(self, x):
        return self.heads[self.head](torch.tanh(self.trunk(x)))


# -- heteroscedastic regression -----------------------------------------------------------------------


def gaussian_nll(out, target):
    """``GaussianNLLLoss`` of the mean and variance (softplus of the second output) heads."""
    var = F.softplus(out[:, 1]) + 1e-3
    return F.gaussian_nll_loss(out[:, 0], target, var, reduction="none")


def poisson_nll(out, target):
    """``PoissonNLLLoss`` of counts, the first output the log-rate."""
    return F.poisson_nll_loss(out[:, 0], target, log_input=True, reduction="none")


def laplace_nll(out, target):
    """``-Normal/Laplace.log_prob`` through ``torch.distributions``: a Laplace likelihood."""
    scale = F.softplus(out[:, 1]) + 1e-3
    return -torch.distributions.Laplace(out[:, 0], scale).log_prob(target)


NLLS = {"gaussian-nll": gaussian_nll, "poisson-nll": poisson_nll, "laplace-log-prob": laplace_nll}


@pytest.mark.parametrize("method", [None, "ghost"], ids=["grad1-and-norms", "ghost"])
@pytest.mark.parametrize("nll", list(NLLS))
def test_heteroscedastic_regression_by_a_likelihood_of_each_example(nll, method):
    """A network predicting a distribution of each target (a mean and a variance, a Poisson
    rate, a Laplace location and scale) trained by the mean negative log-likelihood, over
    three Adam steps: grad1 and the norms, or the ghost DP step's ``.grad``, are the float64
    loop's."""
    model = wide_mlp()
    losses = NLLS[nll]
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    quantities = ("grad1", "norms") if method is None else ("norms",)

    def mean_nll(out, t):
        return losses(out, t).mean()

    with gradhooks.add_hooks(model, quantities=quantities) as h:
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(5, 3, generator=g, dtype=D)
            t = torch.randn(5, generator=g, dtype=D)
            t = t.abs().round() if nll == "poisson-nll" else t
            want = loop_grad(model, mean_nll, x, t)
            opt.zero_grad()
            if method is None:
                mean_nll(model(x), t).backward()
                assert_grad1(model, want, f"step {step}")
                assert_close(h.norms(), norms_of(want), f"step {step}: norms")
            else:
                dp_step(h, losses(model(x), t), method)
                assert_grads(model, clipped(want, 0.5), f"step {step}")
            opt.step()


# -- bootstrapped heads, masked per example --------------------------------------------------------


class Bootstrapped(nn.Module):
    """A shared trunk and ``K`` heads (bootstrapped DQN, deep ensembles on one trunk)."""

    def __init__(self, k: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(3, 6)
        self.heads = nn.ModuleList([nn.Linear(6, 2) for _ in range(k)])

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return torch.stack([head(h) for head in self.heads], 1)  # [batch, K, classes]


def masked_heads(out, target):
    """Each example's cross-entropy of the heads its bootstrap mask gives it, ``[batch]``:
    ``target`` is ``[batch, 1 + K]``, the label then the mask."""
    y, mask = target[:, 0].long(), target[:, 1:]
    per_head = F.cross_entropy(out.transpose(1, 2), y[:, None].expand(-1, out.shape[1]),
                               reduction="none")  # fmt: skip
    return (per_head * mask).sum(1)


@pytest.mark.parametrize("method", [None, *METHODS], ids=["grad1-and-norms", *METHODS])
def test_bootstrapped_heads_each_trained_on_the_examples_its_mask_gives_it(method):
    """Bootstrapped heads: each example's Bernoulli mask says which of three heads learn from
    it, its loss the sum of those heads' losses. Over three steps grad1 and the norms, or each
    DP step's ``.grad``, are the float64 loop's (a head's rows zero for an example masked
    out)."""
    model = Bootstrapped().to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    quantities = ("grad1", "norms") if method is None else quantities_for(method)

    def mean_loss(out, t):
        return masked_heads(out, t).mean()

    with gradhooks.add_hooks(model, quantities=quantities) as h:
        for step in range(STEPS):
            x, y = labelled_batch(step)
            g = torch.Generator().manual_seed(30 + step)
            mask = torch.bernoulli(torch.full((5, 3), 0.5, dtype=D), generator=g)
            target = torch.cat([y[:, None].to(D), mask], 1)
            want = loop_grad(model, mean_loss, x, target)
            opt.zero_grad()
            if method is None:
                mean_loss(model(x), target).backward()
                assert_grad1(model, want, f"step {step}")
                assert_close(h.norms(), norms_of(want), f"step {step}: norms")
            else:
                dp_step(h, masked_heads(model(x), target), method)
                assert_grads(model, clipped(want, 0.5), f"step {step}")
            opt.step()


# -- parametrized embedding rows and convolution weights ---------------------------------------------


class UnitRows(nn.Module):
    """Each row scaled to norm one (normalized embeddings of metric learning)."""

    def forward(self, W):
        return W / W.norm(dim=-1, keepdim=True)


class Standardized(nn.Module):
    """Weight standardization: each output channel's weights to mean 0 and variance 1."""

    def forward(self, W):
        flat = W.flatten(1)
        mean, std = flat.mean(1), flat.std(1, unbiased=False)
        return (W - mean.view(-1, *[1] * (W.dim() - 1))) / (
            std.view(-1, *[1] * (W.dim() - 1)) + 1e-5
        )


class Tokens(nn.Module):
    """An Embedding (8 rows of 4), its rows of unit norm by a parametrization, and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(8, 4), nn.Linear(12, 2)
        parametrize.register_parametrization(self.emb, "weight", UnitRows())

    def forward(self, ids):
        return self.head(self.emb(ids).flatten(1))


class StdConvNet(nn.Module):
    """A Conv2d whose weight a parametrization standardizes (BiT's StdConv as a
    parametrization), GroupNorm and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.gn = nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4)
        self.head = nn.Linear(16, 2)
        parametrize.register_parametrization(self.conv, "weight", Standardized())

    def forward(self, x):
        return self.head(torch.relu(self.gn(self.conv(x))).flatten(1))


def parametrized_batch(kind: str, step: int):
    g = torch.Generator().manual_seed(step)
    y = torch.randint(2, (5,), generator=g)
    if kind == "unit-embedding-rows":
        return torch.randint(8, (5, 3), generator=g), y
    return torch.randn(5, 2, 4, 4, generator=g, dtype=D), y


@pytest.mark.parametrize("method", [None, *METHODS], ids=["grad1-and-norms", *METHODS])
@pytest.mark.parametrize("kind", ["unit-embedding-rows", "standardized-conv-weight"])
def test_parametrized_embedding_rows_and_convolution_weights(kind, method):
    """A parametrization between a layer's weight and its rule: embedding rows normalized to
    unit norm, a convolution's weight standardized per output channel. Over three Adam steps
    grad1 and the norms of the originals, or each DP step's ``.grad``, are the float64
    loop's."""
    model = (Tokens() if kind == "unit-embedding-rows" else StdConvNet()).to(D)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    quantities = ("grad1", "norms") if method is None else quantities_for(method)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        for step in range(STEPS):
            x, y = parametrized_batch(kind, step)
            want = loop_grad(model, F.cross_entropy, x, y)
            assert any(n.endswith("original") for n in want)
            opt.zero_grad()
            if method is None:
                F.cross_entropy(model(x), y).backward()
                assert_grad1(model, want, f"step {step}")
                assert_close(h.norms(), norms_of(want), f"step {step}: norms")
            else:
                dp_step(h, F.cross_entropy(model(x), y, reduction="none"), method)
                assert_grads(model, clipped(want, 0.5), f"step {step}")
            opt.step()


# -- the input's gradient taken in the training backward ----------------------------------------------


def test_a_saliency_map_from_the_inputs_gradient_in_the_training_backward():
    """``x.requires_grad_()`` on each batch so that the training backward also gives the
    input's gradient (a saliency map logged for free): ``x.grad`` is what the same step gives
    without gradhooks, and grad1 and the norms are the float64 loop's, over three steps."""
    model, twin = wide_mlp(), wide_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.2)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for step in range(STEPS):
            x, y = labelled_batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            twin_opt.zero_grad()
            xs, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
            F.cross_entropy(model(xs), y).backward()
            F.cross_entropy(twin(xt), y).backward()
            assert torch.equal(xs.grad, xt.grad), step
            assert_grad1(model, want, f"step {step}")
            assert_close(h.norms(), norms_of(want), f"step {step}: norms")
            opt.step()
            twin_opt.step()


# -- per-example weights put on the losses by a hook, into the DP step ---------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_per_example_weights_put_on_the_losses_by_a_hook_into_the_dp_step(method):
    """Importance weights put on each example's loss by a hook on the losses
    (``losses.register_hook(lambda g: g * w)``) instead of a product, then the DP step: each
    example's gradient is its weight times its own, clipped as such. At each of three steps
    ``.grad`` is the float64 loop's clipped mean of the weighted gradients (no noise)."""
    model = wide_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    with gradhooks.add_hooks(model, quantities=quantities_for(method)) as h:
        for step in range(STEPS):
            x, y = labelled_batch(step)
            w = torch.linspace(0.2, 3.0, 5, dtype=D).roll(step)
            per_example = loop_grad(model, F.cross_entropy, x, y)
            weighted = {n: torch.einsum("b,b...->b...", w, g) for n, g in per_example.items()}
            opt.zero_grad()
            losses = F.cross_entropy(model(x), y, reduction="none")
            losses.register_hook(lambda g, w=w: g * w)
            dp_step(h, losses, method)
            assert_grads(model, clipped(weighted, 0.5), f"step {step}")
            opt.step()

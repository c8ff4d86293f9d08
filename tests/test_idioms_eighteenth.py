"""Training-loop idioms, an eighteenth set: the training machinery of libraries, driving a
hooked model.

Each test runs, over several steps, a piece of a library's own loop machinery that the earlier
sets do not: from torch, the SWA recipe (``SWALR`` after a cosine schedule, ``AveragedModel``
made after ``add_hooks``, ``update_bn`` at the end) around DP steps; a parametrization
registered in the middle of training, on the parameter the optimizer holds and on one it does
not; ``clip_grad_norm_(foreach=True)`` after ``dp_sgd_step``; per-example clipping written as an
optimizer's step pre-hook, and ``grad1`` cleared by its post-hook; a
``load_state_dict`` post-hook that ties weights again after an assigned load; the user's own
full backward hooks beside gradhooks (an observer on the model, a gradient reversal on a layer,
a pre-hook scaling a layer's output-gradient), also in the DP step; ``save_on_cpu`` and
activations kept in bfloat16 by ``saved_tensors_hooks``; ``checkpoint_sequential`` under
bfloat16 autocast into the DP step, reentrant checkpointing of the hooked model itself (its
layers one by one, or its whole call) into the DP step, and of layers whose examples move
between them (refused); ``functional_call`` with ``strict=True`` and tied weights. From PyTorch Lightning: manual
optimization clipping each example by hand after ``self.manual_backward``; automatic
optimization with ``bf16-mixed``, ``accumulate_grad_batches=2`` and ``gradient_clip_val``
together. From PyTorch-Ignite: ``create_supervised_trainer`` with an ``output_transform`` that
reads the norms (and a ``model_fn`` under bfloat16 autocast). From Hugging Face: a ``Trainer``
subclass whose ``compute_loss`` keeps each example's loss and whose ``training_step`` clips each
example's gradient from ``grad1``. Every quantity is compared at every step with each example's
own gradient by a per-example loop in float64 (:func:`gradhooks.oracle.loop_grad`), exactly in
float64 or within bfloat16's rounding where the library runs in it, or checked to stop with a
typed error that names what went wrong."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.nn.utils import parametrize
from torch.optim.swa_utils import SWALR, AveragedModel, update_bn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import (
    NormNet,
    assert_close,
    assert_grad1,
    assert_untouched,
    model_state,
    one_thread,  # noqa: F401 (autouse in this module)
    raised,
)
from harness import labelled_batch as batch
from harness import wide_mlp as mlp

D = torch.float64
STEPS = 3
BF16 = 5e-2  # bfloat16: 8 bits, a few roundings deep, of the largest entry


def norms_of(want: dict) -> torch.Tensor:
    """Each example's gradient norm over every parameter of ``want``."""
    return torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)


def clipped(want: dict, bound: float, divide: float | None = None) -> dict:
    """The sum of ``want``'s rows each clipped to ``bound`` (over every parameter), divided by
    ``divide`` (the batch's size where not given): the DP step's ``.grad`` without noise."""
    factors = (bound / norms_of(want)).clamp(max=1.0)
    n = len(factors) if divide is None else divide
    return {k: torch.einsum("b,b...->...", factors, g) / n for k, g in want.items()}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max|got - want| / max|want|``, in float64."""
    return ((got.to(D) - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def assert_near(got: dict, want: dict, tol: float, what: str) -> None:
    """Each ``got[name]`` within ``tol`` of the largest entry of all of ``want`` (a parameter
    whose gradient is zero by symmetry, an attention key's bias, holds rounding alone)."""
    scale = max(w.abs().max() for w in want.values()).item()
    for n, w in want.items():
        err = (got[n].to(D) - w).abs().max().item() / scale
        assert err < tol, f"{what}: {n} off by {err:.2e} of the largest entry"


def reference(model: nn.Module) -> nn.Module:
    """A float64 copy of ``model``'s weights now, for the loop."""
    return copy.deepcopy(model).to(D)


# -- torch.optim.swa_utils: the SWA recipe around DP steps -------------------------------------


def test_the_swa_recipe_with_swalr_and_update_bn_around_dp_steps():
    """torch's SWA recipe (``torch.optim.swa_utils``' documentation) on a hooked model trained
    by ``dp_sgd_step``: ``CosineAnnealingLR`` until epoch 2, then ``SWALR`` and
    ``AveragedModel.update_parameters`` after each epoch, the ``AveragedModel`` made after
    ``add_hooks`` (a deep copy of the hooked model), and ``update_bn`` over the loader at the
    end. The first step, with the BatchNorm in training mode, is refused (a
    ``MixedExamplesError`` naming it) and leaves the model as it was; with the BatchNorm
    frozen in eval mode, each step's ``.grad`` is the float64 loop's clipped mean, the
    averaged copy holds the mean of the epochs' weights from epoch 2 on, has no grad1, and
    ``update_bn`` (forwards in training mode under ``no_grad``) refreshes its statistics."""
    model = NormNet().to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    loader = [batch(10 * epoch + i) for epoch in range(4) for i in range(2)]
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        swa = AveragedModel(model)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
        swa_sched = SWALR(opt, swa_lr=0.05, anneal_epochs=1)
        x, y = loader[0]
        before = model_state(model)
        raised(
            gradhooks.MixedExamplesError,
            ["'bn'", "BatchNorm1d"],
            lambda: gradhooks.dp_sgd_step(
                h, F.cross_entropy(model(x), y, reduction="none"), max_norm=0.5,
                noise_multiplier=0.0,
            ),
        )  # fmt: skip
        assert_untouched(model, before)
        model.bn.eval()
        averaged = []
        for epoch in range(4):
            for x, y in loader[2 * epoch : 2 * epoch + 2]:
                want = clipped(loop_grad(model, F.cross_entropy, x, y), 0.5)
                opt.zero_grad()
                losses = F.cross_entropy(model(x), y, reduction="none")
                gradhooks.dp_sgd_step(h, losses, max_norm=0.5, noise_multiplier=0.0)
                for n, p in model.named_parameters():
                    assert_close(p.grad, want[n], f"epoch {epoch}: {n}")
                opt.step()
            if epoch >= 2:
                swa.update_parameters(model)
                averaged.append({n: p.detach().clone() for n, p in model.named_parameters()})
                swa_sched.step()
            else:
                cosine.step()
        assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
        for n, p in swa.module.named_parameters():
            assert_close(p, sum(a[n] for a in averaged) / len(averaged), f"averaged {n}")
        update_bn([x for x, _ in loader], swa)
    assert not any(hasattr(p, "grad1") for p in swa.parameters())
    assert swa.module.bn.num_batches_tracked.item() == len(loader)


# -- torch.nn.utils.parametrize: registered in the middle of training ---------------------------


class Halved(nn.Module):
    """``W = 2 V``: a parametrization whose ``right_inverse`` sets ``V = W / 2`` in place."""

    def forward(self, v):
        return 2.0 * v

    def right_inverse(self, w):
        return w / 2.0


class LowRankPlus(nn.Module):
    """``W = A + u vᵀ``: a parametrization of two originals (``original0``, ``original1``) and
    a fixed rank-one direction, whose ``right_inverse`` splits ``W`` into them."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.register_buffer("v", torch.randn(cols, generator=g, dtype=D))
        self.rows = rows

    def forward(self, a, u):
        return a + torch.outer(u, self.v)

    def right_inverse(self, w):
        return w.clone(), torch.zeros(self.rows, dtype=w.dtype)


def test_parametrizations_registered_in_the_middle_of_training():
    """After two Adam steps, a parametrization is registered on the second layer's weight
    (``W = 2 V``: its ``right_inverse`` writes ``V`` into the parameter Adam holds, which
    becomes ``parametrizations.weight.original``) and one of two originals on the first layer's
    weight (new parameters, ``original0`` and ``original1``, given to the optimizer by
    ``add_param_group``). At every step, before and after, grad1 of every parameter the model
    has then is the float64 loop's, and the norms are its examples' norms; the model computes
    the same function at the registration."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    held = model[2].weight
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for step in range(5):
            x, y = batch(step)
            if step == 2:
                out = model(x)
                parametrize.register_parametrization(model[2], "weight", Halved())
                parametrize.register_parametrization(model[0], "weight", LowRankPlus(6, 3))
                assert model[2].parametrizations.weight.original is held
                originals = model[0].parametrizations.weight
                opt.add_param_group({"params": [originals.original0, originals.original1]})
                assert_close(model(x), out, "the function at the registration")
            want = loop_grad(model, F.cross_entropy, x, y)
            assert ("0.parametrizations.weight.original1" in want) == (step >= 2)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            assert_close(h.norms(), norms_of(want), f"step {step}: norms")
            opt.step()


# -- torch.nn.utils.clip_grad_norm_ after the DP step --------------------------------------------


def test_clip_grad_norm_with_foreach_after_the_dp_step():
    """A loop moved to DP that keeps its ``clip_grad_norm_(params, 0.05, foreach=True)`` after
    the step: ``dp_sgd_step`` writes ``.grad`` (each example clipped to 1, the sum divided by
    the batch), and the kept call clips that mean once more, returning its norm. ``.grad`` is
    then the loop's clipped mean scaled to 0.05, the returned norm the clipped mean's, and the
    weights follow it over the steps."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        for step in range(STEPS):
            x, y = batch(step)
            want = clipped(loop_grad(model, F.cross_entropy, x, y), 1.0)
            total = torch.cat([g.flatten() for g in want.values()]).norm()
            opt.zero_grad()
            losses = F.cross_entropy(model(x), y, reduction="none")
            gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=0.0)
            norm = nn.utils.clip_grad_norm_(model.parameters(), 0.05, foreach=True)
            assert_close(norm, total, f"step {step}: the returned norm")
            factor = 0.05 / (total + 1e-6)
            assert factor < 1, "the second clip must act for the test to tell"
            for n, p in model.named_parameters():
                assert_close(p.grad, factor * want[n], f"step {step}: {n}")
            opt.step()


# -- the optimizer's step hooks ----------------------------------------------------------------


def test_per_example_clipping_written_as_an_optimizer_step_pre_hook():
    """A DP step hidden in the optimizer: ``opt.register_step_pre_hook`` replaces each
    parameter's ``.grad`` by the mean of its ``grad1`` rows clipped to 0.1 (the loss summed,
    ``loss_reduction="sum"``), and ``opt.register_step_post_hook`` clears grad1 with
    ``gradhooks.clear_grad1``. Each step moves the weights by the float64 loop's clipped mean,
    grad1 is gone after it, and the next backward starts afresh."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    params = [p for group in opt.param_groups for p in group["params"]]

    def clip_each_example(optimizer, args, kwargs):
        rows = torch.cat([p.grad1.flatten(1) for p in params], 1)
        factors = (0.1 / rows.norm(dim=1)).clamp(max=1.0)
        for p in params:
            p.grad = torch.einsum("b,b...->...", factors, p.grad1) / len(factors)

    opt.register_step_pre_hook(clip_each_example)
    opt.register_step_post_hook(lambda optimizer, args, kwargs: gradhooks.clear_grad1(model))
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for step in range(STEPS):
            x, y = batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt.zero_grad()
            F.cross_entropy(model(x), y, reduction="sum").backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()
            means = clipped(want, 0.1)
            for n, p in model.named_parameters():
                assert_close(before[n] - p.detach(), 0.5 * means[n], f"step {step}: {n}")
                assert not hasattr(p, "grad1"), f"step {step}: {n} kept its grad1"


# -- load_state_dict's post-hook ---------------------------------------------------------------


class TiedLM(nn.Module):
    """An embedding, a hidden layer and an output projection tied to the embedding (one
    parameter, two uses), as language models tie them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mid, self.out = nn.Embedding(7, 4), nn.Linear(4, 4), nn.Linear(4, 7, False)
        self.out.weight = self.emb.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.mid(self.emb(tokens))))


def token_loss(out, target):
    """Cross-entropy summed over the positions of each sequence and over the batch."""
    return F.cross_entropy(out.flatten(0, 1), target.flatten(), reduction="sum")


def test_a_load_state_dict_post_hook_ties_the_weights_again_after_an_assigned_load():
    """A checkpoint loaded with ``load_state_dict(..., assign=True)`` in the middle of training
    (new parameter objects in place of the hooked ones) into a model whose
    ``register_load_state_dict_post_hook`` ties the output projection to the embedding again,
    as Hugging Face's ``tie_weights`` does after a load; the optimizer made anew over the new
    parameters. Before and after, grad1 of the tied weight holds both its uses, as the float64
    loop's, at every step."""
    model = TiedLM().to(D)
    model.register_load_state_dict_post_hook(
        lambda module, keys: setattr(module.out, "weight", module.emb.weight)
    )
    saved = copy.deepcopy(model.state_dict())
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for step in range(4):
            if step == 2:
                old = model.emb.weight
                model.load_state_dict(saved, assign=True)
                assert model.emb.weight is not old and model.out.weight is model.emb.weight
                opt = torch.optim.SGD(model.parameters(), lr=0.5)
            tokens = torch.randint(7, (5, 3), generator=g)
            target = torch.randint(7, (5, 3), generator=g)
            want = loop_grad(model, token_loss, tokens, target)
            opt.zero_grad()
            token_loss(model(tokens), target).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


# -- the user's own full backward hooks beside gradhooks ----------------------------------------


def test_the_users_full_backward_hooks_beside_gradhooks():
    """Three of the user's module hooks, put on before ``add_hooks``: a full backward hook on
    the whole model that counts its calls, a full backward hook on the
    Tanh that returns ``-0.5`` times its input-gradient (DANN's gradient reversal as a hook),
    and a full backward pre-hook on the head that doubles its output-gradient. Each fires once
    per backward, as without gradhooks; grad1 of the head is twice its own gradient, that of
    the first layer ``-0.5 · 2`` times its own (the float64 loop of the model without the
    hooks), and the norms are of those; the DP step (ghost clipping: two backwards through
    the hooks) clips those gradients."""
    model = mlp()
    plain = copy.deepcopy(model)
    fired = {"model": 0, "tanh": 0, "head": 0}

    def observe(module, grad_input, grad_output):
        fired["model"] += 1

    def reverse(module, grad_input, grad_output):
        fired["tanh"] += 1
        return tuple(None if g is None else -0.5 * g for g in grad_input)

    def double(module, grad_output):
        fired["head"] += 1
        return tuple(2.0 * g for g in grad_output)

    model.register_full_backward_hook(observe)
    model[1].register_full_backward_hook(reverse)
    model[2].register_full_backward_pre_hook(double)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scales = {"0.weight": -1.0, "0.bias": -1.0, "2.weight": 2.0, "2.bias": 2.0}
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for step in range(STEPS):
            x, y = batch(step)
            plain.load_state_dict(model.state_dict())
            want = {n: scales[n] * g for n, g in loop_grad(plain, F.cross_entropy, x, y).items()}
            opt.zero_grad()
            F.cross_entropy(model(x.requires_grad_()), y).backward()
            assert fired == {"model": step + 1, "tanh": step + 1, "head": step + 1}, fired
            assert_grad1(model, want, f"step {step}")
            assert_close(h.norms(), norms_of(want), f"step {step}: norms")
            opt.step()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        x, y = batch(STEPS)
        plain.load_state_dict(model.state_dict())
        want = {n: scales[n] * g for n, g in loop_grad(plain, F.cross_entropy, x, y).items()}
        opt.zero_grad()
        losses = F.cross_entropy(model(x.requires_grad_()), y, reduction="none")
        gradhooks.dp_sgd_step(h, losses, max_norm=0.1, noise_multiplier=0.0, method="ghost")
        means = clipped(want, 0.1)
        for n, p in model.named_parameters():
            assert_close(p.grad, means[n], f"the DP step: {n}")


# -- saved tensors offloaded and kept in bfloat16 ------------------------------------------------


def to_bfloat16(t: torch.Tensor):
    """The pack hook of activations kept in bfloat16 (ActNN-style compression, by hand)."""
    return t.dtype, t.to(torch.bfloat16)


def from_bfloat16(packed) -> torch.Tensor:
    dtype, t = packed
    return t.to(dtype)


def deep_net() -> nn.Sequential:
    """A Conv1d-Tanh-Linear stack wide enough that bfloat16's rounding shows in its
    gradients."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv1d(8, 16, 3), nn.Tanh(), nn.Flatten(1), nn.Linear(16 * 14, 64), nn.Tanh(),
        nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10),
    )  # fmt: skip


@pytest.mark.parametrize("how", ["save_on_cpu pinned", "kept in bfloat16"])
def test_saved_tensors_offloaded_or_kept_in_bfloat16_around_the_forward(how):
    """The forward under ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` (nothing to
    move on the CPU, the pinning asked for) or under ``saved_tensors_hooks`` that keep what
    autograd saves in bfloat16 and give it back in float32 (activation compression by hand):
    the second rounds the activations autograd's own backward reads, so ``.grad`` differs from
    the exact gradient by bfloat16's rounding. At every step, with the verifying checks on,
    grad1 and the DP step's clipped mean are the float64 loop's: exactly (float32's rounding)
    when offloaded, within bfloat16's rounding when compressed."""
    model = deep_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    context = (
        (lambda: torch.autograd.graph.save_on_cpu(pin_memory=True))
        if how == "save_on_cpu pinned"
        else (lambda: torch.autograd.graph.saved_tensors_hooks(to_bfloat16, from_bfloat16))
    )
    tol = 1e-4 if how == "save_on_cpu pinned" else BF16
    g = torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for step in range(4):
            x, y = torch.randn(16, 8, 16, generator=g), torch.randint(10, (16,), generator=g)
            want = loop_grad(reference(model), F.cross_entropy, x.to(D), y)
            opt.zero_grad()
            with context():
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            for n, p in model.named_parameters():
                err = relative_error(p.grad1, want[n])
                assert err < tol, f"step {step}: {n} off by {err:.2e}"
            opt.zero_grad()
            with context():
                losses = F.cross_entropy(model(x), y, reduction="none")
            gradhooks.dp_sgd_step(h, losses, max_norm=0.5, noise_multiplier=0.0)
            means = clipped(want, 0.5)
            for n, p in model.named_parameters():
                err = relative_error(p.grad, means[n])
                assert err < tol, f"step {step}: the DP step's {n} off by {err:.2e}"
            opt.step()


# -- checkpoint_sequential under bfloat16 autocast -----------------------------------------------


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpoint_sequential_in_three_segments_under_bfloat16_autocast_into_the_dp_step(
    reentrant,
):
    """``checkpoint_sequential(model, 3, x, use_reentrant=...)`` of a six-layer stack under
    ``torch.autocast("cpu", dtype=torch.bfloat16)``: each segment's forward is run again at the
    backward, under the same autocast (the reentrant one given an input that requires grad).
    At every step grad1 (float32, as ``.grad``) is within bfloat16's rounding of the float64
    loop, and so is the DP step's clipped mean of the same checkpointed forward."""
    from torch.utils.checkpoint import checkpoint_sequential

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2),
        nn.LogSoftmax(-1),
    )  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)

    def forward(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x = x.detach().requires_grad_(reentrant)
            return checkpoint_sequential(model, 3, x, use_reentrant=reentrant).float()

    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for step in range(STEPS):
            x, y = batch(step, n=8)
            x = x.float()
            want = loop_grad(reference(model), F.nll_loss, x.to(D), y)
            opt.zero_grad()
            F.nll_loss(forward(x), y).backward()
            for n, p in model.named_parameters():
                assert p.grad1.dtype == torch.float32, n
                err = relative_error(p.grad1, want[n])
                assert err < BF16, f"step {step}: {n} off by {err:.2e}"
            opt.zero_grad()
            losses = F.nll_loss(forward(x), y, reduction="none")
            gradhooks.dp_sgd_step(h, losses, max_norm=0.3, noise_multiplier=0.0)
            means = clipped(want, 0.3)
            for n, p in model.named_parameters():
                err = relative_error(p.grad, means[n])
                assert err < BF16, f"step {step}: the DP step's {n} off by {err:.2e}"
            opt.step()


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
@pytest.mark.parametrize("how", ["checkpoint_sequential", "checkpoint of the model"])
def test_reentrant_checkpointing_of_the_hooked_model_itself_into_the_dp_step(how, method):
    """``checkpoint_sequential(model, 3, x, use_reentrant=True)`` of the hooked
    ``nn.Sequential`` (which calls its layers one by one, never the model itself) and
    ``checkpoint(model, x, use_reentrant=True)`` (the model's whole call under the
    checkpoint's ``no_grad``): the layers run with grad mode off, outside any forward of the
    model run with it on, and again in the backward. ``torch.autograd.grad`` does not run
    them again (it skips the checkpoint's node, whose inputs are not the parameters), so the
    DP step must take its gradients by a backward; each of three steps' norms and ``.grad``
    are the float64 loop's clipped mean, by every method."""
    from torch.utils.checkpoint import checkpoint, checkpoint_sequential

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        for step in range(STEPS):
            x, y = batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            x = x.requires_grad_()  # (as the reentrant checkpoint needs: no gradient else)
            if how == "checkpoint_sequential":
                out = checkpoint_sequential(model, 3, x, use_reentrant=True)
            else:
                out = checkpoint(model, x, use_reentrant=True)
            losses = F.cross_entropy(out, y, reduction="none")
            norms = gradhooks.dp_sgd_step(
                h, losses, max_norm=0.5, noise_multiplier=0.0, method=method
            )
            assert_close(norms, norms_of(want), f"step {step}: norms")
            means = clipped(want, 0.5)
            for n, p in model.named_parameters():
                assert_close(p.grad, means[n], f"step {step}: {n}")
            opt.step()


class TimeMajor(nn.Module):
    """``[batch, time, features]`` to ``[time, batch, features]``."""

    def forward(self, x):
        return x.transpose(0, 1)


class SumOverTime(nn.Module):
    """The sum over dimension 0, time, of a time-major sequence."""

    def forward(self, x):
        return x.sum(0)


@pytest.mark.parametrize("quantity", ["grad1", "norms"])
@pytest.mark.parametrize("segments", [3, 7])
def test_checkpoint_sequential_of_layers_whose_examples_move_is_refused(segments, quantity):
    """``checkpoint_sequential(model, k, x, use_reentrant=True)`` of a ``Sequential`` that
    turns its ``[batch, time, features]`` input time-major between two Linear layers: the
    layers are called one by one, each taking its batch from dimension 0 of its own input,
    so the second Linear counts the 6 time steps as its examples, the others the 5 sequences
    (the batch is not followed from one layer to the next outside a forward of the model).
    Its pieces come in the checkpoint's backward of its own, inside the loss's: refused all
    the same (a ``BatchNotFoundError``, naming both layers), as without the checkpoint, and
    no grad1 is left; the backward of a forward of the model as a whole, run before, then
    gets the loop's grad1 (or norms)."""
    from torch.utils.checkpoint import checkpoint_sequential

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(3, 4), nn.Tanh(), TimeMajor(), nn.Linear(4, 4), nn.Tanh(), SumOverTime(),
        nn.Linear(4, 2),
    ).to(D)  # fmt: skip
    x, y = torch.randn(5, 6, 3, dtype=D), torch.randint(2, (5,))
    want = loop_grad(model, summed_cross_entropy, x, y)
    with gradhooks.add_hooks(model, quantities=(quantity,), loss_reduction="sum") as h:
        whole = model(x)  # (a forward of the model as a whole, backpropagated after)
        out = checkpoint_sequential(model, segments, x.requires_grad_(), use_reentrant=True)
        raised(
            gradhooks.BatchNotFoundError,
            ["'3' (Linear)", "'6' (Linear)", "5", "6"],
            lambda: F.cross_entropy(out, y, reduction="sum").backward(),
        )
        for n, p in model.named_parameters():
            assert not hasattr(p, "grad1"), n
        if quantity == "norms":
            with pytest.raises(gradhooks.GradhooksError):
                h.norms()
        model.zero_grad()
        F.cross_entropy(whole, y, reduction="sum").backward()
        if quantity == "grad1":
            assert_grad1(model, want, "the model called as a whole")
        else:
            assert_close(h.norms(), norms_of(want), "the model called as a whole: norms")


def summed_cross_entropy(out, target):
    """Cross-entropy summed over the batch."""
    return F.cross_entropy(out, target, reduction="sum")


# -- functional_call with strict=True and tied weights --------------------------------------------


@pytest.mark.parametrize("call", ["torch.func", "stateless"])
def test_functional_call_strict_with_tied_weights(call):
    """``torch.func.functional_call(model, params, args, strict=True, tie_weights=True)`` (and
    ``torch.nn.utils.stateless.functional_call``, its deprecated form, with ``strict=True``) of
    a model whose output projection is tied to its embedding, given every name, the tied one
    included (``named_parameters(remove_duplicate=False)``): grad1 of the tied weight holds
    both uses at every step. Given a dict without one name, ``strict=True`` refuses it before
    the forward (torch's own ``RuntimeError``) and nothing is written."""
    model = TiedLM().to(D)
    if call == "torch.func":
        run = functional_call
    else:
        from torch.nn.utils import stateless

        def run(module, params, args, **kwargs):
            kwargs.pop("tie_weights")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                return stateless.functional_call(module, params, args, **kwargs)

    g = torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for step in range(STEPS):
            tokens = torch.randint(7, (5, 3), generator=g)
            target = torch.randint(7, (5, 3), generator=g)
            want = loop_grad(model, token_loss, tokens, target)
            model.zero_grad()
            params = dict(model.named_parameters(remove_duplicate=False))
            assert "out.weight" in params
            out = run(model, params, (tokens,), strict=True, tie_weights=True)
            token_loss(out, target).backward()
            assert_grad1(model, want, f"step {step}")
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.5 * p.grad
        before = model_state(model)
        params.pop("mid.bias")
        with pytest.raises(RuntimeError, match="mid.bias"):
            run(model, params, (tokens,), strict=True, tie_weights=True)
        assert_untouched(model, before)


# -- PyTorch Lightning -----------------------------------------------------------------------


def lightning():
    """``lightning``, or a skip where it is not installed."""
    return pytest.importorskip("lightning", reason="PyTorch Lightning is not installed")


def small_data(n: int = 24, seed: int = 0) -> torch.utils.data.TensorDataset:
    """``n`` float32 examples of 3 features and their labels of 2 classes."""
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(
        torch.randn(n, 3, generator=g), torch.randint(0, 2, (n,), generator=g)
    )


def fit(module, **kwargs) -> None:
    """One epoch of ``module`` over :func:`small_data` in batches of 6 by a plain CPU
    ``Trainer`` with ``kwargs``."""
    L = lightning()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, max_epochs=1, **kwargs,
    )  # fmt: skip
    with warnings.catch_warnings():
        # (Lightning's advice on the loaders' workers and on inferring the batch's size)
        warnings.filterwarnings("ignore", module="lightning")
        warnings.filterwarnings("ignore", module="pytorch_lightning")
        trainer.fit(module, torch.utils.data.DataLoader(small_data(), batch_size=6))


@pytest.mark.parametrize("precision", ["64-true", "bf16-mixed"])
def test_lightning_manual_optimization_clipping_each_example_after_manual_backward(precision):
    """A ``LightningModule`` with ``automatic_optimization = False`` whose ``training_step``
    runs ``self.manual_backward`` of the summed loss, clips each example's gradient from grad1
    to 0.3 into ``.grad`` (their sum over the batch's size) and steps ``self.optimizers()``.
    Under ``"64-true"`` grad1 and the step's ``.grad`` are the float64 loop's at each step's
    parameters; under ``"bf16-mixed"`` (the step under bfloat16 autocast) within bfloat16's
    rounding."""
    L = lightning()
    seen: list = []

    class ClipEach(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2))
            self.automatic_optimization = False
            self.hooks = gradhooks.add_hooks(self.net, loss_reduction="sum")

        def training_step(self, batch, batch_idx):
            x, y = batch
            opt = self.optimizers()
            opt.zero_grad()
            params = {n: p.detach().clone() for n, p in self.net.named_parameters()}
            loss = F.cross_entropy(self.net(x), y, reduction="sum")
            self.manual_backward(loss)
            rows = torch.cat([p.grad1.flatten(1) for p in self.net.parameters()], 1)
            factors = (0.3 / rows.norm(dim=1)).clamp(max=1.0)
            grad1 = {}
            for n, p in self.net.named_parameters():
                grad1[n] = p.grad1.detach().clone()
                # (pointwise, as autocast leaves it in float32: an einsum would give bfloat16)
                p.grad = (factors.view(-1, *[1] * p.dim()) * p.grad1).sum(0) / len(x)
            grads = {n: p.grad.clone() for n, p in self.net.named_parameters()}
            seen.append((params, (x.clone(), y.clone()), grad1, grads))
            opt.step()

        def configure_optimizers(self):
            return torch.optim.SGD(self.net.parameters(), lr=0.5)

    torch.manual_seed(0)
    module = ClipEach()
    fit(module, precision=precision)
    assert len(seen) == 4
    ref = reference(module.net)
    tol = 1e-9 if precision == "64-true" else BF16
    for k, (params, (x, y), grad1, grads) in enumerate(seen):
        ref.load_state_dict({n: v.to(D) for n, v in params.items()})
        want = loop_grad(ref, F.cross_entropy, x.to(D), y)
        means = clipped(want, 0.3)
        for n in want:
            assert grad1[n].dtype == module.net.get_parameter(n).dtype, n
            err = relative_error(grad1[n], want[n])
            assert err < tol, f"step {k}: {n}'s grad1 off by {err:.2e}"
            err = relative_error(grads[n], means[n])
            assert err < tol, f"step {k}: {n}'s clipped mean off by {err:.2e}"


def test_lightning_bf16_mixed_accumulation_and_clipping_together():
    """Automatic optimization with ``precision="bf16-mixed"``, ``accumulate_grad_batches=2``
    and ``gradient_clip_val=0.05`` at once, ``on_after_backward`` reading grad1 and the
    norms: after the first micro-batch grad1 is half its examples' gradients, after the second
    half the sum of both micro-batches' (row by row, as ``.grad`` adds), the norms are each
    backward's own (half its examples' norms), all within bfloat16's rounding of the float64
    loop at the parameters of the accumulation's start; the clipping that follows the second
    backward leaves grad1 as it was."""
    L = lightning()
    seen: list = []

    class Accumulating(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2))
            self.hooks = gradhooks.add_hooks(self.net, quantities=("grad1", "norms"))

        def training_step(self, batch, batch_idx):
            self.batch = batch
            if batch_idx % 2 == 0:
                self.params = {n: p.detach().clone() for n, p in self.net.named_parameters()}
            x, y = batch
            return F.cross_entropy(self.net(x).float(), y)

        def on_after_backward(self):
            grad1 = {n: p.grad1.clone() for n, p in self.net.named_parameters()}
            x, y = self.batch
            seen.append((self.params, (x.clone(), y.clone()), grad1, self.hooks.norms().clone()))

        def on_before_zero_grad(self, optimizer):
            if seen:  # (after the step: the clipping and the step left grad1 alone)
                for n, p in self.net.named_parameters():
                    assert torch.equal(p.grad1, seen[-1][2][n]), n

        def configure_optimizers(self):
            return torch.optim.SGD(self.net.parameters(), lr=1.0)

    torch.manual_seed(0)
    module = Accumulating()
    fit(module, precision="bf16-mixed", accumulate_grad_batches=2, gradient_clip_val=0.05)
    assert len(seen) == 4
    ref = reference(module.net)
    for k in range(0, 4, 2):
        (p0, (x0, y0), first, n0), (p1, (x1, y1), second, n1) = seen[k], seen[k + 1]
        assert all(torch.equal(p0[n], p1[n]) for n in p0)  # (no step between them)
        ref.load_state_dict({n: v.to(D) for n, v in p0.items()})
        w0 = loop_grad(ref, F.cross_entropy, x0.to(D), y0)
        w1 = loop_grad(ref, F.cross_entropy, x1.to(D), y1)
        for n in w0:
            assert relative_error(first[n], 0.5 * w0[n]) < BF16, f"step {k}: {n}"
            assert relative_error(second[n], 0.5 * (w0[n] + w1[n])) < BF16, f"step {k + 1}: {n}"
        assert relative_error(n0, 0.5 * norms_of(w0)) < BF16, f"step {k}: norms"
        assert relative_error(n1, 0.5 * norms_of(w1)) < BF16, f"step {k + 1}: norms"
    assert module.hooks.accumulated == 2


@pytest.mark.parametrize("precision", ["bf16-true", "16-mixed"])
def test_lightning_half_precisions_read_in_on_after_backward(precision):
    """``precision="bf16-true"`` (the module converted to bfloat16: grad1 in bfloat16, as
    ``.grad``) and ``"16-mixed"`` given as its plugin, ``MixedPrecision("16-mixed", "cpu")``
    (the ``precision=`` flag falls back to bfloat16 on the CPU): float16 autocast, the loss
    scaled by the plugin's ``GradScaler``, so grad1 is of the scaled loss, as ``.grad`` before
    the unscaling. Read in ``on_after_backward``: grad1 divided by the scale in force, and the
    norms, are within float16's and bfloat16's rounding of the float64 loop at each step's
    parameters."""
    L = lightning()
    from lightning.pytorch.plugins.precision import MixedPrecision

    dtypes: set = set()

    seen: list = []

    class Reading(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2))
            self.hooks = gradhooks.add_hooks(self.net, quantities=("grad1", "norms"))

        def training_step(self, batch, batch_idx):
            self.batch = batch
            self.params = {n: p.detach().clone() for n, p in self.net.named_parameters()}
            x, y = batch
            out = self.net(x)
            dtypes.add(out.dtype)
            return F.cross_entropy(out.float(), y)

        def on_after_backward(self):
            scaler = getattr(self.trainer.precision_plugin, "scaler", None)
            scale = 1.0 if scaler is None else float(scaler.get_scale())
            grad1 = {n: p.grad1.clone() for n, p in self.net.named_parameters()}
            seen.append((self.params, self.batch, grad1, self.hooks.norms().clone(), scale))

        def configure_optimizers(self):
            return torch.optim.SGD(self.net.parameters(), lr=0.5)

    torch.manual_seed(0)
    module = Reading()
    if precision == "16-mixed":
        fit(module, plugins=[MixedPrecision("16-mixed", "cpu")])
        assert all(scale > 1 for *_, scale in seen)
    else:
        fit(module, precision=precision)
    assert len(seen) == 4
    assert dtypes == {torch.bfloat16 if precision == "bf16-true" else torch.float16}
    ref = reference(module.net)
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    for k, (params, (x, y), grad1, norms, scale) in enumerate(seen):
        ref.load_state_dict({n: v.to(D) for n, v in params.items()})
        want = loop_grad(ref, F.cross_entropy, x.to(D), y)
        assert all(g.dtype == dtype for g in grad1.values()), f"step {k}"
        assert_near({n: g.to(D) / scale for n, g in grad1.items()}, want, BF16, f"step {k}")
        err = relative_error(norms.to(D) / scale, norms_of(want))
        assert err < BF16, f"step {k}: norms off by {err:.2e}"


# -- PyTorch-Ignite --------------------------------------------------------------------------


@pytest.mark.parametrize("bf16", [False, True], ids=["float64", "bf16-autocast"])
def test_ignite_trainer_whose_output_transform_reads_the_norms(bf16):
    """``create_supervised_trainer`` with ``gradient_accumulation_steps=2`` and an
    ``output_transform`` that returns the loss and ``hooks.norms()`` (after ignite's backward,
    and after its step on every second iteration), read at ``ITERATION_COMPLETED``: each
    iteration's norms are its own backward's (of the loss ignite halves for the accumulation),
    the float64 loop's at the parameters of the accumulation's start. With ``bf16``, a float32
    model run through ``model_fn`` under bfloat16 autocast, within bfloat16's rounding."""
    pytest.importorskip("ignite", reason="PyTorch-Ignite is not installed")
    from ignite.engine import Events, create_supervised_trainer

    model = mlp()
    dtype = torch.float32 if bf16 else D
    model = model.to(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    h = gradhooks.add_hooks(model, quantities=("norms",))

    def model_fn(module, x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = module(x)
        return out.float() if bf16 else out

    engine = create_supervised_trainer(
        model, opt, F.cross_entropy, gradient_accumulation_steps=2, model_fn=model_fn,
        output_transform=lambda x, y, y_pred, loss: (loss.item(), h.norms().clone()),
    )  # fmt: skip
    seen: list = []

    @engine.on(Events.ITERATION_STARTED)
    def keep_params(e):
        if e.state.iteration % 2 == 1:
            e.state.params = {n: p.detach().clone() for n, p in model.named_parameters()}

    @engine.on(Events.ITERATION_COMPLETED)
    def keep_norms(e):
        x, y = e.state.batch
        seen.append((e.state.params, x.clone(), y.clone(), *e.state.output))

    data = [(x.to(dtype), y) for x, y in (batch(step, n=6) for step in range(4))]
    engine.run(data, max_epochs=2)
    assert len(seen) == 8
    tol = BF16 if bf16 else 1e-9
    for k, (params, x, y, loss, norms) in enumerate(seen):
        ref = reference(model)
        ref.load_state_dict({n: v.to(D) for n, v in params.items()})
        want = loop_grad(ref, F.cross_entropy, x.to(D), y)
        err = relative_error(norms, 0.5 * norms_of(want))
        assert err < tol, f"iteration {k}: norms off by {err:.2e}"
        with torch.no_grad():
            assert loss == pytest.approx(F.cross_entropy(ref(x.to(D)), y).item(), rel=tol)
    h.remove()


# -- Hugging Face's Trainer, subclassed ------------------------------------------------------


class Logits(nn.Module):
    """A sequence classifier's logits from its ``input_ids`` and ``attention_mask``, for the
    loop (which slices each positional input by example)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


@pytest.mark.parametrize("bf16", [False, True], ids=["float64", "bf16"])
def test_a_trainer_subclass_clips_each_example_in_its_training_step(tmp_path, bf16):
    """``transformers.Trainer`` subclassed as a DP fine-tuning tutorial does it: the
    ``compute_loss`` override keeps each example's loss (``reduction="none"``) and returns
    their sum, the ``training_step`` override calls Trainer's own (autocast where
    ``bf16=True``, ``accelerator.backward``) and then writes into ``.grad`` each example's
    gradient from grad1 clipped to 0.5, summed and divided by the batch; Trainer's own
    clipping off (``max_grad_norm=0``), plain SGD. A tiny random BERT classifier on padded
    sequences: at each of three steps grad1, the per-example losses and the ``.grad`` the
    optimizer steps with are the float64 loop's at the step's parameters (within bfloat16's
    rounding under ``bf16=True``, the model in float32)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        vocab_size=20, max_position_embeddings=8, num_labels=2, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = transformers.BertForSequenceClassification(config)
    model = model.float() if bf16 else model.to(D)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 20, (12, 8), generator=g)
    lengths = torch.randint(3, 9, (12,), generator=g)
    mask = (torch.arange(8) < lengths[:, None]).long()
    labels = torch.randint(0, 2, (12,), generator=g)
    rows = [
        {"input_ids": ids[i] * mask[i], "attention_mask": mask[i], "labels": labels[i]}
        for i in range(12)
    ]
    seen: list = []

    class ClipEach(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            out = model(**inputs)
            self.losses = F.cross_entropy(out.logits, labels, reduction="none")
            loss = self.losses.sum()
            return (loss, out) if return_outputs else loss

        def training_step(self, model, inputs, num_items_in_batch=None):
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
            kept = {k: v.clone() for k, v in inputs.items()}
            loss = super().training_step(model, inputs, num_items_in_batch)
            trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            norms = torch.cat([p.grad1.flatten(1) for _, p in trained], 1).norm(dim=1)
            factors = (0.5 / norms).clamp(max=1.0)
            grad1 = {n: p.grad1.clone() for n, p in trained}
            for _, p in trained:
                p.grad = (factors.view(-1, *[1] * p.dim()) * p.grad1).sum(0) / len(factors)
            grads = {n: p.grad.clone() for n, p in trained}
            seen.append((params, kept, self.losses.detach().clone(), grad1, grads))
            return loss

    args = transformers.TrainingArguments(
        str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=3, optim="sgd",
        learning_rate=0.5, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
        use_cpu=True, bf16=bf16, report_to=[], save_strategy="no", disable_tqdm=True,
        logging_strategy="no", seed=0,
    )  # fmt: skip
    dtypes = []  # (accelerate hands the logits back in float32: what the head computed in)
    model.classifier.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        ClipEach(model=model, args=args, train_dataset=rows).train()
    assert len(seen) == 3 and set(dtypes) == {torch.bfloat16 if bf16 else D}
    ref = Logits(copy.deepcopy(model).to(D))
    tol = BF16 if bf16 else 1e-9
    for k, (params, inputs, losses, grad1, grads) in enumerate(seen):
        ref.model.load_state_dict({n: v.to(D) for n, v in params.items()})
        x = (inputs["input_ids"], inputs["attention_mask"])
        want = loop_grad(ref, F.cross_entropy, x, inputs["labels"])
        want = {n.removeprefix("model."): g for n, g in want.items()}
        with torch.no_grad():
            own = F.cross_entropy(ref(*x), inputs["labels"], reduction="none")
        assert relative_error(losses, own) < tol, f"step {k}: the losses"
        assert set(grad1) == set(want)
        for n in want:
            assert grad1[n].dtype == model.get_parameter(n).dtype, n
        assert_near(grad1, want, tol, f"step {k}: grad1")
        assert_near(grads, clipped(want, 0.5), tol, f"step {k}: the clipped mean")

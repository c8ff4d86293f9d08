"""Training-loop idioms, a twenty-seventh set: what a loop switches between its steps, and how
it weights, swaps and reaches its parameters.

Each test runs several steps of an ordinary loop (``zero_grad``, a forward, a backward, an
optimizer's step) with one habit the earlier sets do not run: the train and val phases of
torch's fine-tuning tutorial, each forward under ``torch.set_grad_enabled(phase == "train")``;
a backbone run under ``torch.set_grad_enabled(False)`` inside the forward until it is
unfrozen; batches drawn by a ``WeightedRandomSampler`` (an example twice in one batch, the last
batch smaller) with importance weights on the losses, by SGD and into the DP step;
``functional_call`` given a tuple of a parameter dict and a buffer dict (the input's
normalization statistics of each step), and the parameters cast to bfloat16 on the way in (a
mixed-precision policy); LoRA adapters put around the frozen Linears of a hooked model under
bfloat16 autocast; an embedding tied to the output projection, which uses it detached; an
optimizer over the head alone while ``model.zero_grad()`` or nothing resets the body; a second
loss backpropagated to the head alone through the retained graph (``backward(inputs=...)``),
and ``torch.autograd.grad`` of the head alone under bfloat16 autocast, assigned to ``.grad``;
the ``weight_norm`` parametrization under float16 autocast and a ``GradScaler`` with
``unscale_`` and ``clip_grad_norm_``; selective activation checkpointing under bfloat16
autocast; an ``autocast(enabled=False)`` island inside a checkpointed block; a bfloat16
``channels_last`` CNN trained without autocast; full backward hooks of the user's (an
observer, a gradient reversal) registered after ``add_hooks``; hooks added for each epoch of a
``drop_last=False`` loader; a head grown for new classes between steps; ``ReduceLROnPlateau``
stepped on an ``inference_mode`` validation beside a ``LinearLR`` warm-up; two task losses in
one step, each from its own forward and backward; a checkpoint saved in bfloat16 loaded into
the float32 model in the middle of training.

Every ``grad1`` is compared at every step with each example's own gradient by a per-example loop
in float64 (:func:`gradhooks.oracle.loop_grad`, or the loop written out) of the same weights,
exactly in float64, or within the rounding of the precision the step ran in (``5e-2`` of the
largest entry for bfloat16, ``1e-2`` for float16, as ``docs/mixed-precision.md`` states),
divided by the scale where the loss was scaled; and its mean (or sum) with ``.grad``.
"""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
from torch.utils.data import DataLoader, TensorDataset, WeightedRandomSampler

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_close, one_thread  # noqa: F401 (autouse in this module)

D = torch.float64
BF16, FP16 = 5e-2, 1e-2  # the rounding allowed: of the largest entry, per parameter


def bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def batch(step: int, n: int = 4, features: int = 4, classes: int = 3, dtype=D):
    """``n`` examples and their labels, drawn from a generator seeded with ``step``."""
    g = torch.Generator().manual_seed(200 + step)
    x = torch.randn(n, features, generator=g, dtype=D).to(dtype)
    return x, torch.randint(classes, (n,), generator=g)


def ce(out, y):
    return F.cross_entropy(out.float() if out.dtype != D else out, y)


def near(got: torch.Tensor, want: torch.Tensor, rel: float, what: str) -> None:
    """``got`` within ``rel`` of ``want``'s largest entry (and of the same shape)."""
    assert got.shape == want.shape, f"{what}: {tuple(got.shape)} != {tuple(want.shape)}"
    scale = want.abs().max().item()
    err = (got.double() - want.double()).abs().max().item()
    assert err <= rel * max(scale, 1e-12), f"{what}: {err:.3e} off, largest {scale:.3e}"


def loop(model: nn.Module, x, y, loss=ce) -> dict:
    """Each example's own gradient at ``model``'s weights now, by the float64 loop."""
    return loop_grad(copy.deepcopy(model).to(D), loss, x.double(), y)


def assert_step(model, want: dict, what: str, rel: float = 0.0, scale: float = 1.0, mean=True):
    """Every trainable parameter the step reached: ``grad1 / scale`` against ``want`` (exactly
    in float64 where ``rel`` is 0) and ``grad1``'s mean (or sum) against ``.grad``. Returns how
    many were checked."""
    checked = 0
    for n, p in model.named_parameters():
        if not p.requires_grad or p.grad is None:
            continue
        reduced = p.grad1.mean(0) if mean else p.grad1.sum(0)
        if rel:
            near(p.grad1 / scale, want[n], rel, f"{what}: {n}")
            near(reduced, p.grad, rel, f"{what}: {n} reduced vs .grad")
        else:
            assert_close(p.grad1, want[n], f"{what}: {n}")
            assert_close(reduced, p.grad, f"{what}: {n} reduced vs .grad")
        checked += 1
    assert checked, what
    return checked


class Net(nn.Module):
    """A body (Linear-Tanh-Linear-Tanh, 4 -> 8 -> 8) and a head (8 -> ``classes``), float64."""

    def __init__(self, classes: int = 3, dtype=D) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, classes)
        self.to(dtype)

    def forward(self, x):
        return self.head(self.body(x))


# -- what a step reaches --------------------------------------------------------------------------


def test_the_finetuning_tutorials_phases_each_under_set_grad_enabled():
    """torch's fine-tuning tutorial (``train_model``): each epoch runs a ``train`` phase and a
    ``val`` phase, each forward under ``torch.set_grad_enabled(phase == "train")``, with
    ``StepLR`` stepped per epoch. Each train step's ``grad1`` is the loop's; the val phase
    leaves it as the last train step left it."""
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    loaders = {"train": [batch(0), batch(1, n=3)], "val": [batch(9)]}
    with gradhooks.add_hooks(model):
        for epoch in range(2):
            for phase in ("train", "val"):
                model.train(phase == "train")
                for k, (x, y) in enumerate(loaders[phase]):
                    want = loop(model, x, y) if phase == "train" else None
                    if phase == "val":
                        kept = {n: p.grad1.clone() for n, p in model.named_parameters()}
                    optimizer.zero_grad()
                    with torch.set_grad_enabled(phase == "train"):
                        loss = ce(model(x), y)
                        if phase == "train":
                            loss.backward()
                            assert_step(model, want, f"epoch {epoch} step {k}")
                            optimizer.step()
                    if phase == "val":
                        for n, p in model.named_parameters():
                            assert torch.equal(p.grad1, kept[n]), n
            schedule.step()


class Gated(Net):
    """The body run under ``torch.set_grad_enabled(self.tune_body and torch.is_grad_enabled())``
    inside the forward: frozen by the forward, not by ``requires_grad``."""

    tune_body = False

    def forward(self, x):
        with torch.set_grad_enabled(self.tune_body and torch.is_grad_enabled()):
            h = self.body(x)
        return self.head(h)


def test_a_backbone_under_set_grad_enabled_inside_the_forward_until_it_is_tuned():
    """The first two steps run the body without grad inside the forward (the head alone
    learns, the optimizer holds every parameter): the body has no ``.grad`` and no ``grad1``;
    from step 2 it is tuned, each example's own gradient, as the loop of the gated model
    gives it."""
    model = Gated()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with gradhooks.add_hooks(model):
        for step in range(4):
            model.tune_body = step >= 2
            x, y = batch(step)
            want = loop(model, x, y)
            optimizer.zero_grad()
            ce(model(x), y).backward()
            assert assert_step(model, want, f"step {step}") == (2 if step < 2 else 6)
            for p in model.body.parameters():
                assert (p.grad is None) == (step < 2)
                assert ("grad1" in p.__dict__) == (step >= 2)
            optimizer.step()


def test_an_optimizer_over_the_head_alone_with_the_body_reset_by_the_model_or_not():
    """Fine-tuning the head with an optimizer that holds it alone, the body left trainable:
    ``model.zero_grad()`` resets every ``.grad``, and every ``grad1`` is this step's; the
    optimizer's ``zero_grad()`` resets the head's alone, and the body's ``grad1`` adds up over
    the steps, as its ``.grad`` does (the loop's sum), the head's being this step's."""
    for reset in ("model", "optimizer"):
        model = Net()
        optimizer = torch.optim.SGD(model.head.parameters(), lr=0.1)
        summed: dict = {}
        with gradhooks.add_hooks(model):
            for step in range(3):
                x, y = batch(step)
                want = loop(model, x, y)
                (model if reset == "model" else optimizer).zero_grad()
                ce(model(x), y).backward()
                for n, p in model.named_parameters():
                    keep = reset == "optimizer" and n.startswith("body") and n in summed
                    summed[n] = summed[n] + want[n] if keep else want[n]
                    assert_close(p.grad1, summed[n], f"{reset}, step {step}: {n}")
                    assert_close(p.grad1.mean(0), p.grad, f"{reset}, step {step}: {n} .grad")
                optimizer.step()


def test_a_second_loss_backpropagated_to_the_head_alone_through_the_retained_graph():
    """The classification loss's backward keeps the graph; an entropy penalty on the same
    logits is then backpropagated with ``inputs=`` the head's parameters: the body's ``grad1``
    is the first loss's alone, the head's the sum of both, each example's own."""

    def entropy(out, y=None):
        p = out.softmax(-1)
        return -(p * p.log()).sum(-1).mean()

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model) as h:
        for step in range(3):
            x, y = batch(step)
            first, second = loop(model, x, y), loop(model, x, y, lambda o, t: entropy(o))
            optimizer.zero_grad()
            out = model(x)
            ce(out, y).backward(retain_graph=True)
            entropy(out).backward(inputs=list(model.head.parameters()))
            assert h.accumulated == 2
            for n, p in model.named_parameters():
                want = first[n] + second[n] if n.startswith("head") else first[n]
                assert_close(p.grad1, want, f"step {step}: {n}")
                assert_close(p.grad1.mean(0), p.grad, f"step {step}: {n} .grad")
            optimizer.step()


def test_autograd_grad_of_the_head_alone_assigned_to_grad_under_bfloat16():
    """Linear probing written with ``torch.autograd.grad(loss, head_params)`` under bfloat16
    autocast, the gradients assigned to ``.grad`` for the step: the head's ``grad1`` is each
    example's own (within bfloat16's rounding), its mean the gradient assigned; the body,
    which the call did not ask for, has neither."""
    model = Net(dtype=torch.float32)
    optimizer = torch.optim.SGD(model.head.parameters(), lr=0.1)
    head = list(model.head.parameters())
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step, dtype=torch.float32)
            want = loop(model, x, y)
            optimizer.zero_grad()
            with bf16():
                out = model(x)
            grads = torch.autograd.grad(ce(out, y), head)
            for p, g in zip(head, grads):
                p.grad = g
            assert assert_step(model, want, f"step {step}", BF16) == 2
            assert all("grad1" not in p.__dict__ for p in model.body.parameters())
            optimizer.step()


class Tied(nn.Module):
    """A token classifier whose output projection is the embedding's weight, detached: the
    embedding learns through its lookups alone (the projection's use is frozen)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(7, 6)
        self.mix = nn.Linear(6, 6)
        self.bias = nn.Parameter(torch.zeros(7))
        self.to(D)

    def forward(self, tokens):
        h = torch.tanh(self.mix(self.emb(tokens))).mean(1)
        return F.linear(h, self.emb.weight.detach(), self.bias)


def test_an_embedding_tied_to_the_output_projection_that_uses_it_detached():
    """The embedding's ``grad1`` holds the lookups' gradients alone, the projection's use
    being detached; the output bias, used by the model directly, gets its own. Each is the
    loop's, over AdamW steps."""
    model = Tied()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with gradhooks.add_hooks(model):
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            tokens, y = torch.randint(7, (3, 5), generator=g), torch.randint(7, (3,), generator=g)
            want = loop_grad(copy.deepcopy(model), F.cross_entropy, tokens, y)
            optimizer.zero_grad()
            F.cross_entropy(model(tokens), y).backward()
            assert assert_step(model, want, f"step {step}") == 4
            optimizer.step()


# -- weighted and sampled batches -----------------------------------------------------------------


def _sampled(seed: int):
    """A ``DataLoader`` of 10 examples drawn with replacement by a ``WeightedRandomSampler``
    (class 0 drawn 4x as often), ``batch_size=4``, ``drop_last=False`` (batches of 4, 4, 2),
    each example with its index; and every example's importance weight ``1 / (N p_i)``."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(10, 4, generator=g, dtype=D), torch.randint(3, (10,), generator=g)
    weights = torch.where(y == 0, 4.0, 1.0).double()
    p = weights / weights.sum()
    sampler = WeightedRandomSampler(weights, num_samples=10, replacement=True, generator=g)
    data = TensorDataset(x, y, torch.arange(10))
    return DataLoader(data, batch_size=4, sampler=sampler, drop_last=False), 1 / (10 * p)


def _weighted(out, target):
    """The importance-weighted cross-entropy of examples whose target is ``[label, weight]``."""
    return (target[:, 1] * F.cross_entropy(out, target[:, 0].long(), reduction="none")).mean()


def test_weighted_random_sampler_batches_with_importance_weights_on_the_losses():
    """Batches drawn with replacement (an example may come twice in one batch: its rows are
    two examples), the losses weighted by ``1 / (N p_i)`` and averaged, the last batch of 2:
    each row of ``grad1`` is that example's weighted loss's gradient, as the loop gives it."""
    loader, iw = _sampled(3)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sizes, repeated = [], False
    with gradhooks.add_hooks(model):
        for epoch in range(2):
            for x, y, idx in loader:
                sizes.append(len(x))
                repeated |= len(set(idx.tolist())) < len(idx)
                target = torch.stack([y.double(), iw[idx]], 1)
                want = loop_grad(copy.deepcopy(model), _weighted, x, target)
                optimizer.zero_grad()
                _weighted(model(x), target).backward()
                assert_step(model, want, f"epoch {epoch}, batch of {len(x)}")
                optimizer.step()
    assert sizes == [4, 4, 2] * 2 and repeated


def test_weighted_random_sampler_losses_into_the_dp_step():
    """The same importance-weighted losses, each example's own, given to ``dp_sgd_step``: the
    clipped sum is that of the loop's weighted per-example gradients, each clipped to ``C``,
    the noise drawn by hand from a generator of the same seed, over the batch size of 4 (the
    last batch's too: ``expected_batch_size``)."""
    C, sigma = 0.3, 0.5
    loader, iw = _sampled(4)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        for k, (x, y, idx) in enumerate(loader):
            target = torch.stack([y.double(), iw[idx]], 1)
            per = loop_grad(copy.deepcopy(model), _weighted, x, target)
            norms = torch.cat([g.flatten(1) for g in per.values()], 1).norm(dim=1)
            factor = (C / norms).clamp(max=1.0)
            gen = torch.Generator().manual_seed(k)
            want = {
                n: (torch.einsum("b,b...->...", factor, g)
                    + sigma * C * torch.randn(g.shape[1:], generator=gen, dtype=D)) / 4
                for n, g in per.items()
            }  # fmt: skip
            optimizer.zero_grad()
            losses = iw[idx] * F.cross_entropy(model(x), y, reduction="none")
            gradhooks.dp_sgd_step(
                h, losses, max_norm=C, noise_multiplier=sigma, expected_batch_size=4,
                generator=torch.Generator().manual_seed(k),
            )  # fmt: skip
            for n, p in model.named_parameters():
                assert_close(p.grad, want[n], f"batch {k}: {n}")
            optimizer.step()


# -- parameters swapped, wrapped and cast ----------------------------------------------------------


class Normalized(Net):
    """The input standardized by buffers ``mean`` and ``std`` before the body."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(4, dtype=D))
        self.register_buffer("std", torch.ones(4, dtype=D))

    def forward(self, x):
        return super().forward((x - self.mean) / self.std)


def test_functional_call_with_a_tuple_of_parameters_and_buffers():
    """``functional_call(model, (params, buffers), x)``: the model's own parameters and, at
    each step, the normalization statistics of that step's batch as buffers; then an
    exponential moving average of the weights with the same buffers for a validation under
    ``no_grad``, which leaves ``grad1``. Each step's ``grad1`` is the loop's of the model with
    those buffers in place."""
    model = Normalized()
    ema = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step)
            x = 3 * x + 1
            buffers = {"mean": x.mean(0), "std": x.std(0)}
            twin = copy.deepcopy(model)
            twin.mean.copy_(buffers["mean"])
            twin.std.copy_(buffers["std"])
            want = loop_grad(twin, ce, x, y)
            optimizer.zero_grad()
            params = dict(model.named_parameters())
            ce(functional_call(model, (params, buffers), (x,)), y).backward()
            assert_step(model, want, f"step {step}")
            optimizer.step()
            with torch.no_grad():
                for n, p in model.named_parameters():
                    ema[n].lerp_(p, 0.1)
                kept = {n: p.grad1.clone() for n, p in model.named_parameters()}
                functional_call(model, (ema, buffers), (x,))
            for n, p in model.named_parameters():
                assert torch.equal(p.grad1, kept[n])


def test_functional_call_with_the_parameters_cast_to_bfloat16_on_the_way_in():
    """A mixed-precision policy written by hand: float32 master weights, the forward run by
    ``functional_call`` with each cast to bfloat16 (``p.to(torch.bfloat16)``) and the input in
    bfloat16. The gradient flows through the cast to the float32 parameter: its ``grad1``, in
    float32, is each example's own gradient of the bfloat16 forward (within bfloat16's
    rounding), its mean ``.grad``."""
    model = Net(dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step, dtype=torch.bfloat16)
            low = {n: p.to(torch.bfloat16) for n, p in model.named_parameters()}
            twin = copy.deepcopy(model).to(torch.bfloat16)
            want = loop_grad(twin.double(), ce, x.double(), y)
            optimizer.zero_grad()
            ce(functional_call(model, low, (x,)), y).backward()
            assert assert_step(model, want, f"step {step}", BF16) == 6
            assert all(p.grad1.dtype == torch.float32 for p in model.parameters())
            optimizer.step()


class LoRA(nn.Module):
    """A frozen Linear with a trained low-rank update ``(alpha / r) B A``, B zero at first."""

    def __init__(self, base: nn.Linear, r: int = 2, alpha: float = 4.0) -> None:
        super().__init__()
        self.base, self.scale = base, alpha / r
        self.A = nn.Linear(base.in_features, r, bias=False)
        self.B = nn.Linear(r, base.out_features, bias=False)
        nn.init.zeros_(self.B.weight)

    def forward(self, x):
        return self.base(x) + self.scale * self.B(self.A(x))


def test_lora_adapters_put_around_the_frozen_linears_after_add_hooks_under_bfloat16():
    """The hooked model frozen by ``model.requires_grad_(False)``, then each Linear of its body
    replaced by a ``LoRA`` wrapper (new trainable ``A`` and ``B``), trained by AdamW under
    bfloat16 autocast: the adapters' ``grad1`` is each example's own (``B``'s zero start makes
    ``A``'s first gradient zero: checked from the second step on), the frozen weights have
    none."""
    model = Net(dtype=torch.float32)
    with gradhooks.add_hooks(model):
        model.requires_grad_(False)
        torch.manual_seed(1)
        for i in (0, 2):
            model.body[i] = LoRA(model.body[i])
        trained = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=5e-2)
        for step in range(3):
            x, y = batch(step, dtype=torch.float32)
            want = loop(model, x, y)
            optimizer.zero_grad()
            with bf16():
                out = model(x)
            ce(out, y).backward()
            for n, p in model.named_parameters():
                if not p.requires_grad:
                    assert "grad1" not in p.__dict__, n
                elif want[n].abs().max() > 0:
                    near(p.grad1, want[n], BF16, f"step {step}: {n}")
                    near(p.grad1.mean(0), p.grad, BF16, f"step {step}: {n} .grad")
                else:
                    assert step == 0 and not p.grad1.any(), n
            optimizer.step()


def test_weight_norm_under_float16_and_a_grad_scaler_with_unscale_and_clip():
    """``parametrizations.weight_norm`` on both layers of the body, float16 autocast, a
    ``GradScaler``; ``unscale_`` then ``clip_grad_norm_`` before ``scaler.step``: the
    originals' (``original0``, ``original1``) ``grad1`` divided by the scale the backward ran
    with is each example's own (within float16's rounding), and its mean the ``.grad`` before
    ``unscale_``."""
    model = Net(dtype=torch.float32)
    for i in (0, 2):
        torch.nn.utils.parametrizations.weight_norm(model.body[i])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step, dtype=torch.float32)
            want = loop(model, x, y)
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            scale = scaler.get_scale()
            scaler.scale(ce(out, y)).backward()
            assert assert_step(model, want, f"step {step}", FP16, scale) == 8
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(optimizer)
            scaler.update()


class Selective(Net):
    """The body's two layers in one block checkpointed selectively (torchtitan's policy: the
    matrix products saved, the rest recomputed)."""

    def forward(self, x):
        def policy(ctx, op, *args, **kwargs):
            saved = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
            save = torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE
            return save if op in saved else torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

        context = functools.partial(create_selective_checkpoint_contexts, policy)
        h = checkpoint(self.body, x, use_reentrant=False, context_fn=context)
        return self.head(h)


def test_selective_activation_checkpointing_under_bfloat16_autocast():
    """The selectively checkpointed body under bfloat16 autocast over AdamW steps: ``grad1`` of
    every layer is each example's own within bfloat16's rounding (the recomputation runs
    under the forward's autocast), its mean ``.grad``."""
    model = Selective(dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step, dtype=torch.float32)
            want = loop(model, x, y)
            optimizer.zero_grad()
            with bf16():
                out = model(x)
            ce(out, y).backward()
            assert assert_step(model, want, f"step {step}", BF16) == 6
            optimizer.step()


class Island(Net):
    """The body's second layer under ``torch.autocast("cpu", enabled=False)`` in float32 (a
    numerically sensitive part), inside a block checkpointed with ``use_reentrant``."""

    reentrant = False

    def block(self, h):
        h = torch.tanh(self.body[0](h))
        with torch.autocast("cpu", enabled=False):
            return torch.tanh(self.body[2](h.to(self.body[2].weight.dtype)))

    def forward(self, x):
        h = checkpoint(self.block, x, use_reentrant=self.reentrant)
        return self.head(h)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_an_autocast_disabled_island_inside_a_checkpointed_block(reentrant):
    """The island's layer runs in float32, the others in bfloat16, in the forward and in the
    recomputation alike: every ``grad1`` is each example's own within bfloat16's rounding (the
    input requires grad for the reentrant form to recompute)."""
    model = Island(dtype=torch.float32)
    model.reentrant = reentrant
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step, dtype=torch.float32)
            x.requires_grad_(reentrant)
            want = loop(model, x, y)
            optimizer.zero_grad()
            with bf16():
                out = model(x)
            ce(out, y).backward()
            assert assert_step(model, want, f"step {step}", BF16) == 6
            optimizer.step()


def test_a_bfloat16_channels_last_cnn_trained_without_autocast():
    """A CNN cast whole by ``model.to(torch.bfloat16, memory_format=torch.channels_last)``,
    fed bfloat16 channels_last images, stepped by SGD in bfloat16 (no master weights, no
    autocast): ``grad1`` in bfloat16, each example's own gradient within bfloat16's rounding
    (the float64 loop of the same bfloat16 weights and images), its mean ``.grad``."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.Tanh(), nn.Conv2d(4, 4, 3, padding=1), nn.Tanh(), nn.Flatten(),
        nn.Linear(4 * 4 * 4, 3),
    ).to(torch.bfloat16, memory_format=torch.channels_last)  # fmt: skip
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradhooks.add_hooks(model):
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(3, 2, 6, 6, generator=g).to(torch.bfloat16)
            x = x.contiguous(memory_format=torch.channels_last)
            y = torch.randint(3, (3,), generator=g)
            want = loop_grad(copy.deepcopy(model).double(), F.cross_entropy, x.double(), y)
            optimizer.zero_grad()
            ce(model(x), y).backward()
            assert assert_step(model, want, f"step {step}", BF16) == 6
            assert all(p.grad1.dtype == torch.bfloat16 for p in model.parameters())
            optimizer.step()


# -- the user's hooks, the loader's epochs, the head's classes -------------------------------------


def test_full_backward_hooks_of_the_users_registered_after_add_hooks():
    """Full backward hooks registered on the body's second layer after ``add_hooks``: one that
    records the output-gradients' norms, one that also reverses and halves the gradient to the
    layer's input (DANN's reversal, a factor that gradhooks follows): every ``grad1`` is the
    loop's of the same model with the same hook; the hook saw one gradient per step."""
    for kind in ("observe", "reverse"):
        model = Net()
        seen: list = []

        def hook(module, grad_input, grad_output, kind=kind, seen=seen):
            seen.append(grad_output[0].norm(dim=1))
            return (-0.5 * grad_input[0],) if kind == "reverse" else None

        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with gradhooks.add_hooks(model):
            model.body[2].register_full_backward_hook(hook)
            for step in range(3):
                x, y = batch(step)
                want = loop(model, x, y)  # (the deep copy keeps the hook)
                seen.clear()
                optimizer.zero_grad()
                ce(model(x), y).backward()
                assert len(seen) == 1 and seen[0].shape == (4,), kind
                assert_step(model, want, f"{kind}, step {step}")
                optimizer.step()


def test_hooks_added_for_each_epoch_of_a_drop_last_false_loader():
    """``with gradhooks.add_hooks(model):`` around each epoch of a shuffled ``DataLoader`` of
    10 examples in batches of 4 (``drop_last=False``: 4, 4, 2), ``zero_grad(set_to_none=False)``
    before each step, the model evaluated under ``inference_mode`` between the epochs without
    hooks: each step's ``grad1`` is the loop's, also at each epoch's first step, whose zeroed
    ``.grad`` starts it afresh, and the last batch's rows are its two examples."""
    g = torch.Generator().manual_seed(5)
    data = TensorDataset(
        torch.randn(10, 4, generator=g, dtype=D), torch.randint(3, (10,), generator=g)
    )
    loader = DataLoader(data, batch_size=4, shuffle=True, drop_last=False, generator=g)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for epoch in range(2):
        with gradhooks.add_hooks(model) as h:
            for k, (x, y) in enumerate(loader):
                want = loop(model, x, y)
                optimizer.zero_grad(set_to_none=False)
                ce(model(x), y).backward()
                assert h.accumulated == 1
                assert_step(model, want, f"epoch {epoch}, batch {k} of {len(x)}")
                optimizer.step()
        assert all(p.grad1.shape[0] == 2 for p in model.parameters())
        model.eval()
        with torch.inference_mode():
            model(data.tensors[0])
        model.train()


def test_a_head_grown_for_new_classes_between_steps():
    """Class-incremental training: after two steps on 3 classes the head is replaced by one of
    5 whose first rows are the old head's, and a new optimizer is made: ``grad1`` of the new
    head is ``[batch, 5, 8]``, each example's own; the old head's parameters keep the last
    ``grad1`` they got."""
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(4):
            if step == 2:
                old = model.head
                new = nn.Linear(8, 5).to(D)
                with torch.no_grad():
                    new.weight[:3].copy_(old.weight)
                    new.bias[:3].copy_(old.bias)
                model.head = new
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                kept = old.weight.grad1.clone()
            x, y = batch(step, classes=3 if step < 2 else 5)
            want = loop(model, x, y)
            optimizer.zero_grad()
            ce(model(x), y).backward()
            assert_step(model, want, f"step {step}")
            assert model.head.weight.grad1.shape == (4, 3 if step < 2 else 5, 8)
            optimizer.step()
    assert torch.equal(old.weight.grad1, kept)


def test_reduce_lr_on_plateau_on_an_inference_mode_validation_beside_a_warmup():
    """A ``LinearLR`` warm-up stepped every step and ``ReduceLROnPlateau`` stepped on a
    validation loss computed under ``inference_mode`` in ``eval()`` after each step (a
    ``Dropout`` in the head's path, off in eval): the learning rates move, and each step's
    ``grad1`` is the loop's (dropout of probability 0 in training, so the loop is
    deterministic)."""
    model = nn.Sequential(Net(), nn.Dropout(0.0)).to(D)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=2)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
    xv, yv = batch(50, n=6)
    lrs = []
    with gradhooks.add_hooks(model):
        for step in range(4):
            model.train()
            x, y = batch(step)
            want = loop(model, x, y)
            optimizer.zero_grad()
            ce(model(x), y).backward()
            assert_step(model, want, f"step {step}")
            optimizer.step()
            warmup.step()
            model.eval()
            with torch.inference_mode():
                val = ce(model(xv), yv).item()
            plateau.step(val + step)  # (a loss that rises: the plateau lowers the rate)
            lrs.append(optimizer.param_groups[0]["lr"])
    assert len(set(lrs)) > 1 and math.isfinite(lrs[-1])


class TwoHeads(Net):
    """The body and two task heads: ``task`` picks the head the forward returns."""

    def __init__(self) -> None:
        super().__init__()
        self.other = nn.Linear(8, 2).to(D)
        self.task = 0

    def forward(self, x):
        h = self.body(x)
        return self.head(h) if self.task == 0 else self.other(h)


def test_two_task_losses_each_from_its_own_forward_and_backward_in_one_step():
    """Two tasks on the same batch, each its own forward and backward (no retained graph),
    then one optimizer step: the body's ``grad1`` is the sum of both tasks' per-example
    gradients, as its ``.grad`` is, each head's its own task's (the loop gives the head a task
    does not use zeros); ``accumulated`` counts 2."""
    model = TwoHeads()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model) as h:
        for step in range(3):
            x, y = batch(step)
            y2 = y % 2
            model.task = 0
            first = loop(model, x, y)
            model.task = 1
            second = loop(model, x, y2)
            optimizer.zero_grad()
            for task, target in ((0, y), (1, y2)):
                model.task = task
                ce(model(x), target).backward()
            assert h.accumulated == 2
            for n, p in model.named_parameters():
                assert_close(p.grad1, first[n] + second[n], f"step {step}: {n}")
                assert_close(p.grad1.mean(0), p.grad, f"step {step}: {n} .grad")
            optimizer.step()


def test_a_bfloat16_checkpoint_loaded_into_the_float32_model_mid_training():
    """A ``state_dict`` saved in bfloat16 (a half-size checkpoint) loaded into the float32
    model after the second step, the optimizer's moments reset by a new AdamW: the weights are
    the checkpoint's rounded values in float32, and each step's ``grad1`` is the float64 loop's
    of those weights, within float32's rounding."""
    model = Net(dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    saved = {k: v.to(torch.bfloat16) for k, v in copy.deepcopy(model.state_dict()).items()}
    with gradhooks.add_hooks(model):
        for step in range(4):
            if step == 2:
                model.load_state_dict(saved)
                for k, v in model.state_dict().items():
                    assert v.dtype == torch.float32 and torch.equal(v, saved[k].float()), k
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            x, y = batch(step, dtype=torch.float32)
            want = loop(model, x, y)
            optimizer.zero_grad()
            ce(model(x), y).backward()
            assert assert_step(model, want, f"step {step}", 1e-5) == 6
            optimizer.step()

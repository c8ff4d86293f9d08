"""Training-loop idioms, a twenty-sixth set: the loop's habits under mixed precision.

Each test runs several steps of an ordinary loop (``zero_grad``, a forward under
``torch.autocast("cpu", dtype=torch.bfloat16)`` or float16 with a ``torch.amp.GradScaler``, a
backward, an optimizer's step) with one habit the earlier sets run in float32 or float64 alone:
an auxiliary head used every other step with ``zero_grad(set_to_none=False)``; a layer frozen
then unfrozen and handed to the optimizer by ``add_param_group`` under a learning-rate schedule;
a block checkpointed by ``torch.utils.checkpoint`` (``use_reentrant`` ``False`` and ``True``);
a target computed by the same layers under ``torch.no_grad()`` inside the forward; two losses
and two backwards through a retained graph; a hook on a parameter scaling its gradient; an
exponential moving average of the weights swapped in by ``torch.func.functional_call`` for a
validation, and two layers' weights swapped by it for a training step; a compiled loss; a model
cast to bfloat16 whose float32 master weights are stepped in a
``register_post_accumulate_grad_hook``, or stepped through a ``GradScaler``; epochs of a
``DataLoader`` with ``drop_last=False`` whose last batch is one example, validated in
``eval()`` under ``inference_mode``; ``AveragedModel`` updated each step; per-example clipping
then ``clip_grad_norm_`` under a cosine schedule; micro-batches of unequal sizes read and
cleared one by one, and a head reached by the second micro-batch alone after
``zero_grad(set_to_none=False)``; a compiled model whose auxiliary head comes and goes;
``requires_grad_`` toggled, a head replaced, and ``load_state_dict`` of an earlier snapshot
between steps; a ``channels_last`` CNN; and, under a ``GradScaler``, the two retained
backwards, a step the scaler skips, per-example clipping after ``unscale_`` and the DP step of
a checkpointed block.

Every ``grad1`` is compared at every step with each example's own gradient by a per-example
loop in float64 (:func:`gradhooks.oracle.loop_grad`) of the same weights, within the rounding
of the precision the step ran in (``5e-2`` of the largest entry for bfloat16, ``1e-2`` for
float16, as ``docs/mixed-precision.md`` states), divided by the scale where the loss was
scaled; and its mean with ``.grad``, which autograd computed in the same precision.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

import gradhooks
from gradhooks.oracle import loop_grad
from harness import one_thread  # noqa: F401 (autouse in this module)

D = torch.float64
BF16, FP16 = 5e-2, 1e-2  # the rounding allowed: of the largest entry, per parameter
STEPS = 3


def bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def fp16():
    return torch.autocast("cpu", dtype=torch.float16)


def batch(step: int, n: int = 4, features: int = 4, classes: int = 3):
    """``n`` float32 examples and their labels, drawn from a generator seeded with ``step``."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, features, generator=g), torch.randint(classes, (n,), generator=g)


def ce(out, y):
    return F.cross_entropy(out.float(), y)


def near(got: torch.Tensor, want: torch.Tensor, rel: float, what: str) -> None:
    """``got`` within ``rel`` of ``want``'s largest entry (and of the same shape)."""
    assert got.shape == want.shape, f"{what}: {tuple(got.shape)} != {tuple(want.shape)}"
    scale = want.abs().max().item()
    err = (got.double() - want.double()).abs().max().item()
    assert err <= rel * max(scale, 1e-12), f"{what}: {err:.3e} off, largest {scale:.3e}"


def reference(model: nn.Module) -> nn.Module:
    """A float64 copy of ``model``'s weights now, for the loop."""
    return copy.deepcopy(model).to(D)


def loop(model: nn.Module, x, y, loss=ce, **kwargs) -> dict:
    """Each example's own gradient at ``model``'s weights now, by the float64 loop."""
    inputs = tuple(t.double() for t in x) if isinstance(x, tuple) else (x.double(),)
    return loop_grad(reference(model), loss, inputs, y, **kwargs)


def assert_step(model, want: dict, rel: float, what: str, scale: float = 1.0, mean=True):
    """Every trainable parameter the step reached: ``grad1 / scale`` against the loop, and
    ``grad1``'s mean (or sum) against ``.grad``. Returns how many were checked."""
    checked = 0
    for n, p in model.named_parameters():
        if not p.requires_grad or p.grad is None:
            continue
        near(p.grad1 / scale, want[n], rel, f"{what}: {n}")
        reduced = p.grad1.mean(0) if mean else p.grad1.sum(0)
        near(reduced, p.grad, rel, f"{what}: {n} reduced vs .grad")
        checked += 1
    assert checked, what
    return checked


class Net(nn.Module):
    """Linear-Tanh-Linear-Tanh (4 -> 8 -> 8) and a head (8 -> 3); with ``aux``, a second head
    (8 -> 3) used where the step asks for it."""

    def __init__(self, aux: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)
        self.aux = nn.Linear(8, 3) if aux else None
        self.use_aux = False

    def forward(self, x):
        h = self.body(x)
        out = self.head(h)
        return out + 0.5 * self.aux(h) if self.use_aux else out


class Checkpointed(Net):
    """The body's second layer run by ``checkpoint(..., use_reentrant=reentrant)``."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant

    def forward(self, x):
        h = torch.tanh(self.body[0](x))
        h = checkpoint(lambda t: torch.tanh(self.body[2](t)), h, use_reentrant=self.reentrant)
        return self.head(h)


def bf16_step(step, model, optimizer, x, y, loss=ce, backward=None, set_to_none=True) -> None:
    """The set's step before the optimizer's: the float64 loop's gradients of ``loss`` on
    ``(x, y)``, ``zero_grad``, the forward under bfloat16 autocast, the backward of
    ``backward`` (``loss`` by default; a compiled twin), and every ``grad1`` against the loop."""
    want = loop(model, x, y, loss)
    optimizer.zero_grad(set_to_none=set_to_none)
    with bf16():
        out = model(x)
    (backward or loss)(out, y).backward()
    assert_step(model, want, BF16, f"step {step}")


# -- parameters a step does not reach -----------------------------------------------------------


def test_an_auxiliary_head_every_other_step_with_zero_grad_keeping_zeros_under_bfloat16():
    """The auxiliary head is used on odd steps only and ``zero_grad(set_to_none=False)`` keeps
    zeros: on the steps without it, its ``grad1`` is zeros, as its ``.grad`` is, one row per
    example of this step's batch; on the steps with it, each example's own gradient."""
    model = Net(aux=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with gradhooks.add_hooks(model):
        for step in range(4):
            model.use_aux = step % 2 == 1
            x, y = batch(step, n=3 + step % 2)
            bf16_step(step, model, optimizer, x, y, set_to_none=False)
            if not model.use_aux:
                for p in model.aux.parameters():
                    if step == 0:  # (never reached yet: no .grad, no grad1)
                        assert p.grad is None and "grad1" not in p.__dict__
                        continue
                    assert p.grad1.shape == (len(x), *p.shape)
                    assert not p.grad1.any() and not p.grad.any()
            optimizer.step()


def test_a_layer_frozen_then_unfrozen_into_the_optimizer_under_a_schedule_in_bfloat16():
    """The body is frozen for two steps (the head alone in the optimizer, ``StepLR``), then
    unfrozen and given to the optimizer by ``add_param_group``: while frozen it has no
    ``grad1``; from the step it is trainable, each example's own gradient."""
    model = Net()
    model.body.requires_grad_(False)
    optimizer = torch.optim.SGD(model.head.parameters(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    with gradhooks.add_hooks(model):
        for step in range(4):
            if step == 2:
                model.body.requires_grad_(True)
                optimizer.add_param_group({"params": list(model.body.parameters()), "lr": 0.05})
            x, y = batch(step)
            want = loop(model, x, y)
            optimizer.zero_grad()
            with bf16():
                out = model(x)
            ce(out, y).backward()
            checked = assert_step(model, want, BF16, f"step {step}")
            assert checked == (2 if step < 2 else 6)
            for p in model.body.parameters():
                assert (p.grad is None) == (step < 2)
                assert ("grad1" in p.__dict__) == (step >= 2)
            optimizer.step()
            schedule.step()


def test_requires_grad_toggled_on_the_head_between_steps_under_bfloat16():
    """``model.head.requires_grad_(False)`` on odd steps (the trunk alone learns), set back on
    even ones: the frozen head's ``grad1`` is dropped with its ``.grad`` by ``zero_grad`` and
    not written again until it trains; the others' are each example's own."""
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(4):
            model.head.requires_grad_(step % 2 == 0)
            x, y = batch(step)
            bf16_step(step, model, optimizer, x, y)
            for p in model.head.parameters():
                assert ("grad1" in p.__dict__) == (step % 2 == 0), step
            optimizer.step()


def test_a_head_replaced_between_steps_and_added_to_the_optimizer_under_bfloat16():
    """``model.head = nn.Linear(8, 3)`` after two steps (a new task), its parameters handed to
    the optimizer by ``add_param_group``: the new head is captured from its first step on;
    the old one, out of the model but still in the optimizer, loses its ``grad1`` with the
    ``.grad`` that ``zero_grad`` resets, and gets no new one."""
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with gradhooks.add_hooks(model):
        for step in range(4):
            if step == 2:
                old = model.head
                assert old.weight.grad1.shape == (4, 3, 8)
                model.head = nn.Linear(8, 3)
                optimizer.add_param_group({"params": list(model.head.parameters())})
            x, y = batch(step)
            bf16_step(step, model, optimizer, x, y)
            optimizer.step()
        assert old.weight.grad is None and "grad1" not in old.weight.__dict__


def test_load_state_dict_of_an_earlier_snapshot_between_steps_repeats_its_grad1_in_bfloat16():
    """The model's and the optimizer's ``state_dict`` saved after the first step, two more
    steps, then both loaded back: the next step on the first step's batch gives the same
    ``grad1`` as the step after the save did (the same weights, the same batch), and each is
    each example's own gradient."""
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(k):
        x, y = batch(k)
        want = loop(model, x, y)
        optimizer.zero_grad()
        with bf16():
            out = model(x)
        ce(out, y).backward()
        assert_step(model, want, BF16, f"step {k}")
        got = {n: p.grad1.clone() for n, p in model.named_parameters()}
        optimizer.step()
        return got

    with gradhooks.add_hooks(model):
        step(0)
        saved = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
        first = step(1)
        step(2)
        model.load_state_dict(saved[0])
        optimizer.load_state_dict(saved[1])
        again = step(1)
    for n in first:
        assert torch.equal(again[n], first[n]), n


# -- the forward's own habits -------------------------------------------------------------------


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpointed_block_under_bfloat16_autocast(reentrant):
    """The body's second layer run by ``checkpoint(..., use_reentrant=...)`` inside the
    autocast: its forward runs again in the backward (under the autocast the checkpoint
    kept), and every ``grad1`` is each example's own gradient at every step."""

    model = Checkpointed(reentrant)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = batch(step)
            bf16_step(step, model, optimizer, x, y)
            optimizer.step()


def test_a_target_from_the_same_layers_under_no_grad_inside_the_forward_in_bfloat16():
    """A self-distillation target: the forward runs the body on a second view under
    ``torch.no_grad()`` and returns both; the loss pulls the first view's features toward the
    detached second's. The ``no_grad`` calls of the same layers are not captured, and
    ``grad1`` is each example's own gradient of its two-term loss."""

    class Distil(Net):
        def forward(self, x):
            with torch.no_grad():
                target = self.body(x.flip(1))
            h = self.body(x)
            return self.head(h), h, target

    def loss(out, y):
        logits, h, target = out
        return (
            F.cross_entropy(logits.float(), y) + (h.float() - target.float()).pow(2).sum(1).mean()
        )

    model = Distil()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = batch(step)
            bf16_step(step, model, optimizer, x, y, loss=loss)
            optimizer.step()


def test_two_losses_and_two_backwards_through_a_retained_graph_in_bfloat16():
    """The classification loss backpropagated with ``retain_graph=True``, then an auxiliary
    head's loss through the same graph: ``grad1`` adds the second backward to the first, row
    by row as ``.grad`` does, each example's own gradient of the two losses' sum."""
    model = Net(aux=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model) as hooks:
        for step in range(STEPS):
            x, y = batch(step)
            want = _two_loss_loop(model, x, y)
            optimizer.zero_grad()
            with bf16():
                h = model.body(x)
                first = F.cross_entropy(model.head(h).float(), y)
                second = 0.3 * F.cross_entropy(model.aux(h).float(), (y + 1) % 3)
            first.backward(retain_graph=True)
            assert hooks.accumulated == 1
            second.backward()
            assert hooks.accumulated == 2
            assert_step(model, want, BF16, f"step {step}")
            optimizer.step()


def _two_loss_loop(model: Net, x, y) -> dict:
    """Each example's own gradient of the head's loss plus 0.3 times the auxiliary head's loss
    of the label after it, by the float64 loop."""

    class Both(nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, xb):
            h = self.net.body(xb)
            return torch.cat([self.net.head(h), self.net.aux(h)], 1)

    def loss(out, t):
        return F.cross_entropy(out[:, :3], t) + 0.3 * F.cross_entropy(out[:, 3:], (t + 1) % 3)

    got = loop_grad(Both(reference(model)), loss, (x.double(),), y)
    return {n.removeprefix("net."): g for n, g in got.items()}


def test_a_hook_on_a_parameter_that_scales_its_gradient_under_bfloat16():
    """A layer's own learning rate by ``p.register_hook(lambda g: 0.25 * g)`` on the body's
    first layer: ``grad1`` follows the hook's factor (``.grad`` does), the other layers' are
    each example's own gradient."""
    model = Net()
    for p in model.body[0].parameters():
        p.register_hook(lambda g: 0.25 * g)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = batch(step)
            want = loop(model, x, y)
            for n in ("body.0.weight", "body.0.bias"):
                want[n] = 0.25 * want[n]
            optimizer.zero_grad()
            with bf16():
                out = model(x)
            ce(out, y).backward()
            assert_step(model, want, BF16, f"step {step}")
            optimizer.step()


def test_an_ema_swapped_in_by_functional_call_for_validation_between_steps_in_bfloat16():
    """An exponential moving average of the weights kept as a dict of tensors, run by
    ``functional_call(model, ema, x)`` under ``inference_mode`` after every step: the
    validation forward captures nothing and leaves ``grad1`` as the step left it, and the next
    step's is each example's own."""
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = {n: p.detach().clone() for n, p in model.named_parameters()}
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = batch(step)
            bf16_step(step, model, optimizer, x, y)
            kept = {n: p.grad1.clone() for n, p in model.named_parameters()}
            optimizer.step()
            with torch.no_grad():
                for n, p in model.named_parameters():
                    ema[n].lerp_(p, 0.1)
            model.eval()
            with torch.inference_mode(), bf16():
                val = functional_call(model, ema, (batch(50)[0],))
            model.train()
            with torch.no_grad():
                plain = reference(model)
                plain.load_state_dict({n: t.double() for n, t in ema.items()}, strict=False)
                torch.testing.assert_close(
                    val.double(), plain(batch(50)[0].double()), rtol=0, atol=5e-2
                )
            for n, p in model.named_parameters():
                assert torch.equal(p.grad1, kept[n]), n


class Swapped(nn.Module):
    """Two layers of the same shape between an input layer and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.a, self.b, self.head = (
            nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3),
        )  # fmt: skip

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.head(torch.tanh(self.b(torch.tanh(self.a(h)))))


def test_two_layers_weights_swapped_by_functional_call_for_a_training_step():
    """``functional_call(model, {"a.weight": model.b.weight, "b.weight": model.a.weight}, x)``
    on odd steps (a layer-order augmentation): each weight's ``grad1`` is its own gradient
    from the slot it ran in, as the loop of the same call gives, in float64."""
    model = Swapped().to(D)
    swap = {"a.weight": model.b.weight, "b.weight": model.a.weight}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def run(m, xb, swapped):
        mapping = {"a.weight": m.b.weight, "b.weight": m.a.weight}
        return functional_call(m, mapping, (xb,)) if swapped else m(xb)

    with gradhooks.add_hooks(model):
        for step in range(4):
            swapped = step % 2 == 1
            x, y = batch(step)
            x = x.double()
            ref = reference(model)
            want = {n: [] for n, _ in ref.named_parameters()}
            for i in range(len(x)):
                ref.zero_grad()
                F.cross_entropy(run(ref, x[i : i + 1], swapped), y[i : i + 1]).backward()
                for n, p in ref.named_parameters():
                    want[n].append(p.grad.clone())
            optimizer.zero_grad()
            out = functional_call(model, swap, (x,)) if swapped else model(x)
            F.cross_entropy(out, y).backward()
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.grad1, torch.stack(want[n]), rtol=1e-7, atol=1e-9)
                torch.testing.assert_close(p.grad1.mean(0), p.grad, rtol=1e-7, atol=1e-9)
            optimizer.step()


def test_a_compiled_loss_under_bfloat16_autocast():
    """The loss compiled by ``torch.compile`` (label smoothing, the logits cast to float32
    inside it), the model not: ``grad1`` is each example's own gradient of the smoothed loss
    at every step."""

    def smoothed(out, y):
        return F.cross_entropy(out.float(), y, label_smoothing=0.1)

    compiled = torch.compile(smoothed, backend="eager")
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = batch(step)
            bf16_step(step, model, optimizer, x, y, loss=smoothed, backward=compiled)
            optimizer.step()


def test_a_channels_last_cnn_under_bfloat16_autocast_validated_between_steps():
    """A Conv2d-GroupNorm-Conv2d net converted to ``channels_last`` and fed channels_last
    images under bfloat16 autocast, a validation in ``eval()`` under ``inference_mode`` between
    steps: every ``grad1`` is each example's own gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(), nn.Conv2d(4, 4, 3),
        nn.Tanh(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3),
    ).to(memory_format=torch.channels_last)  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(3, 2, 5, 5, generator=g).to(memory_format=torch.channels_last)
            y = torch.randint(3, (3,), generator=g)
            bf16_step(step, model, optimizer, x, y)
            optimizer.step()
            model.eval()
            with torch.inference_mode(), bf16():
                model(x)
            model.train()


# -- precision of the weights themselves --------------------------------------------------------


def test_a_bfloat16_model_whose_float32_master_weights_step_in_a_post_accumulate_hook():
    """The model cast by ``.to(torch.bfloat16)``, float32 master copies stepped by SGD in each
    parameter's ``register_post_accumulate_grad_hook`` (the gradient copied to the master,
    ``p.grad = None``, the master's new value copied back): after each backward ``grad1`` is
    in bfloat16 and each example's own gradient at the weights the forward ran with; the next
    step's forward starts it afresh."""
    model = Net().to(torch.bfloat16)
    masters = {p: p.detach().float().requires_grad_() for p in model.parameters()}
    optimizer = torch.optim.SGD(list(masters.values()), lr=0.1)

    def step_master(p):
        master = masters[p]
        master.grad = p.grad.float()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            p.copy_(master)
        p.grad = None

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_master)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = batch(step)
            ref = reference(model)
            want = loop_grad(ref, ce, (x.bfloat16().double(),), y)
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            ce(model(x.bfloat16()), y).backward()
            for n, p in model.named_parameters():
                assert p.grad is None and p.grad1.dtype == torch.bfloat16
                near(p.grad1, want[n], BF16, f"step {step}: {n}")
                assert not torch.equal(p.detach(), before[n]), f"{n} did not step"


def test_drop_last_false_epochs_whose_last_batch_is_one_example_validated_in_eval():
    """Two epochs of a shuffled ``DataLoader`` over 7 examples in batches of 3 with
    ``drop_last=False`` (3, 3, 1) under bfloat16 autocast, each epoch validated in ``eval()``
    under ``inference_mode``: every step's ``grad1`` has its batch's rows, the last one row."""
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(7, 4, generator=g), torch.arange(7) % 3)
    loader = torch.utils.data.DataLoader(
        data, batch_size=3, shuffle=True, drop_last=False,
        generator=torch.Generator().manual_seed(1),
    )  # fmt: skip
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sizes = []
    with gradhooks.add_hooks(model):
        for epoch in range(2):
            model.train()
            for x, y in loader:
                want = loop(model, x, y)
                optimizer.zero_grad()
                with bf16():
                    out = model(x)
                ce(out, y).backward()
                assert_step(model, want, BF16, f"epoch {epoch}, batch of {len(x)}")
                sizes.append(model.head.weight.grad1.shape[0])
                optimizer.step()
            model.eval()
            with torch.inference_mode(), bf16():
                model(data.tensors[0])
    assert sizes == [3, 3, 1, 3, 3, 1]


def test_averaged_model_updated_each_step_beside_the_hooked_model_in_bfloat16():
    """``AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))`` made after
    ``add_hooks`` and updated after every step, evaluated under bfloat16 autocast: the average
    holds no ``grad1`` and no hooks of gradhooks, the hooked model's ``grad1`` is each
    example's own gradient at every step, and the average is the EMA of the weights."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        mine = {n: p.detach().clone() for n, p in model.named_parameters()}
        for step in range(STEPS):
            x, y = batch(step)
            bf16_step(step, model, optimizer, x, y)
            optimizer.step()
            ema.update_parameters(model)
            for n, p in model.named_parameters():
                mine[n] = mine[n] * 0.9 + p.detach() * 0.1 if step else p.detach().clone()
            with torch.no_grad(), bf16():
                ema(x)
        for n, p in ema.module.named_parameters():
            assert "grad1" not in p.__dict__, n
            torch.testing.assert_close(p.detach(), mine[n], rtol=1e-6, atol=1e-7)


def test_per_example_clipping_then_clip_grad_norm_under_a_cosine_schedule_in_bfloat16():
    """Each example's ``grad1`` clipped to norm 0.5 over the whole model, their mean written to
    ``.grad``, then ``clip_grad_norm_(..., 0.1)`` on it and a step under
    ``CosineAnnealingLR``: ``.grad`` is the loop's clipped mean clipped again, at every
    step."""
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = batch(step)
            want = loop(model, x, y)
            wnorm = torch.cat([want[n].flatten(1) for n in names], 1).norm(dim=1)
            wfac = (0.5 / (wnorm + 1e-6)).clamp(max=1)
            wgrad = [(want[n] * wfac.view(-1, *[1] * (want[n].dim() - 1))).mean(0) for n in names]
            wtotal = torch.cat([g.flatten() for g in wgrad]).norm()
            wgrad = [g * min(1.0, 0.1 / (wtotal.item() + 1e-6)) for g in wgrad]
            optimizer.zero_grad()
            with bf16():
                out = model(x)
            ce(out, y).backward()
            norm = torch.cat([p.grad1.flatten(1) for p in params], 1).norm(dim=1)
            factor = (0.5 / (norm + 1e-6)).clamp(max=1)
            for p in params:
                p.grad = (p.grad1 * factor.view(-1, *[1] * p.dim())).mean(0)
            torch.nn.utils.clip_grad_norm_(params, 0.1)
            for n, p, w in zip(names, params, wgrad, strict=True):
                near(p.grad, w, BF16, f"step {step}: {n}")
            optimizer.step()
            schedule.step()


def test_micro_batches_of_unequal_sizes_read_and_cleared_one_by_one_in_bfloat16():
    """An accumulation over micro-batches of 3, 2 and 1 examples (the last smaller), each loss
    divided by the step's 6 examples: after each backward ``grad1`` is that micro-batch's rows
    of its examples' own gradients over 6, read, then ``hooks.clear()`` before the next;
    ``.grad`` adds up to the sum of all the rows read."""
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model, loss_reduction="sum") as hooks:
        for step in range(2):
            optimizer.zero_grad()
            total = {n: 0 for n, _ in model.named_parameters()}
            for k, size in enumerate((3, 2, 1)):
                x, y = batch(10 * step + k, n=size)
                want = {n: g / 6 for n, g in loop(model, x, y).items()}
                with bf16():
                    out = model(x)
                (F.cross_entropy(out.float(), y, reduction="sum") / 6).backward()
                for n, p in model.named_parameters():
                    near(p.grad1, want[n], BF16, f"step {step}, micro-batch {k}: {n}")
                    total[n] = total[n] + p.grad1.sum(0)
                hooks.clear()
            for n, p in model.named_parameters():
                near(total[n], p.grad, BF16, f"step {step}: {n} rows vs .grad")
            optimizer.step()


def test_a_head_reached_by_the_second_micro_batch_alone_with_zeros_kept_in_bfloat16():
    """``zero_grad(set_to_none=False)`` before an accumulation of two micro-batches, the
    auxiliary head used by the second alone: after the step, its ``grad1`` is the second
    micro-batch's rows (the first added zeros, as to its ``.grad``), the others' the sum of
    both, each over the two micro-batches."""
    model = Net(aux=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(3):
            optimizer.zero_grad(set_to_none=False)
            want = {}
            for k in range(2):
                model.use_aux = k == 1
                x, y = batch(10 * step + k)
                for n, g in loop(model, x, y).items():
                    want[n] = want.get(n, 0) + g / 2
                with bf16():
                    out = model(x)
                (ce(out, y) / 2).backward()
            for n, p in model.named_parameters():
                near(p.grad1, want[n], BF16, f"step {step}: {n}")
            optimizer.step()


def test_a_compiled_model_whose_auxiliary_head_comes_and_goes_under_bfloat16():
    """``torch.compile(model)`` called under bfloat16 autocast, the auxiliary head used on odd
    steps (a flag the compiled code guards on): every step's ``grad1`` is each example's own
    gradient, the head's only where it was used."""
    model = Net(aux=True)
    compiled = torch.compile(model, backend="eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(4):
            model.use_aux = step % 2 == 1
            x, y = batch(step)
            want = loop(model, x, y)
            optimizer.zero_grad()
            with bf16():
                out = compiled(x)
            ce(out, y).backward()
            assert_step(model, want, BF16, f"step {step}")
            for p in model.aux.parameters():
                assert ("grad1" in p.__dict__) == model.use_aux
            optimizer.step()


# -- float16 with a GradScaler ------------------------------------------------------------------


def test_two_retained_backwards_of_scaled_losses_then_unscale_and_clip_in_float16():
    """``scaler.scale(first).backward(retain_graph=True)`` then ``scaler.scale(second)
    .backward()``, ``unscale_``, ``clip_grad_norm_``, ``scaler.step``: ``grad1`` divided by
    the scale the backwards ran with is each example's own gradient of the two losses' sum,
    and is left unscaled and unclipped by ``unscale_`` and the clip."""
    model = Net(aux=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = batch(step)
            want = _two_loss_loop(model, x, y)
            optimizer.zero_grad()
            with fp16():
                h = model.body(x)
                first = F.cross_entropy(model.head(h).float(), y)
                second = 0.3 * F.cross_entropy(model.aux(h).float(), (y + 1) % 3)
            scale = scaler.get_scale()
            scaler.scale(first).backward(retain_graph=True)
            scaler.scale(second).backward()
            kept = {n: p.grad1.clone() for n, p in model.named_parameters()}
            assert_step(model, want, FP16, f"step {step}", scale=scale)
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            for n, p in model.named_parameters():
                assert torch.equal(p.grad1, kept[n]), n
            scaler.step(optimizer)
            scaler.update()


def test_a_step_the_scaler_skips_with_an_auxiliary_head_every_other_step_keeping_zeros():
    """A first scale of ``2**40`` overflows float16 and the scaler skips the step (``grad1``
    holds non-finite rows there as ``.grad`` does), then lowers the scale; the auxiliary head
    is used on odd steps with ``zero_grad(set_to_none=False)``: every finite step's
    ``grad1 / scale`` is each example's own gradient, the unused head's zeros."""
    model = Net(aux=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, backoff_factor=2.0**-30)
    skipped = 0
    with gradhooks.add_hooks(model):
        for step in range(4):
            model.use_aux = step % 2 == 1
            x, y = batch(step)
            want = loop(model, x, y)
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            optimizer.zero_grad(set_to_none=False)
            with fp16():
                out = model(x)
            scale = scaler.get_scale()
            scaler.scale(ce(out, y)).backward()
            finite = all(p.grad.isfinite().all() for p in model.parameters())
            if finite:
                assert_step(model, want, FP16, f"step {step}", scale=scale)
            else:
                skipped += 1
                assert not all(p.grad1.isfinite().all() for p in model.parameters())
            if not model.use_aux and step:
                assert all(not p.grad1.any() for p in model.aux.parameters())
            scaler.step(optimizer)
            scaler.update()
            moved = any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
            assert moved == finite, step
    assert skipped == 1


def test_per_example_clipping_after_unscale_written_to_grad_for_the_scalers_step():
    """Each example's ``grad1 / scale`` clipped to norm 1 and their mean written to ``.grad``
    after ``scaler.unscale_`` (which recorded that nothing overflowed), ``scaler.step`` then
    steps on it: the step is the loop's clipped mean, at every step."""
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=1)
    names = [n for n, _ in model.named_parameters()]
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = batch(step)
            want = loop(model, x, y)
            wnorm = torch.cat([want[n].flatten(1) for n in names], 1).norm(dim=1)
            wfac = (1.0 / (wnorm + 1e-6)).clamp(max=1)
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            optimizer.zero_grad()
            with fp16():
                out = model(x)
            scale = scaler.get_scale()
            scaler.scale(ce(out, y)).backward()
            scaler.unscale_(optimizer)
            own = {n: p.grad1 / scale for n, p in model.named_parameters()}
            norm = torch.cat([own[n].flatten(1) for n in names], 1).norm(dim=1)
            factor = (1.0 / (norm + 1e-6)).clamp(max=1)
            for n, p in model.named_parameters():
                p.grad = (own[n] * factor.view(-1, *[1] * p.dim())).mean(0)
            scaler.step(optimizer)
            scaler.update()
            for n, p in model.named_parameters():
                wgrad = (want[n] * wfac.view(-1, *[1] * p.dim())).mean(0)
                near((before[n] - p.detach()) / 0.5, wgrad, FP16, f"step {step}: {n}")
        assert scaler.get_scale() == 2.0**12 * 2**STEPS  # (no step overflowed)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_the_dp_step_with_a_scaler_through_a_checkpointed_block_in_float16(reentrant):
    """``dp_sgd_step(..., scaler=scaler)`` of a model whose middle layer runs under
    ``checkpoint`` in float16 autocast, without noise: ``.grad`` is the scale times the
    loop's sum of each example's gradient clipped to norm 1, over the batch; the scaler's
    step unscales it."""

    model = Checkpointed(reentrant)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    names = [n for n, _ in model.named_parameters()]
    hooks = gradhooks.add_hooks(model, quantities=("norms",))
    try:
        for step in range(STEPS):
            x, y = batch(step)
            want = loop(model, x, y)
            wnorm = torch.cat([want[n].flatten(1) for n in names], 1).norm(dim=1)
            wfac = (1.0 / wnorm).clamp(max=1)
            optimizer.zero_grad()
            with fp16():
                out = model(x)
            losses = F.cross_entropy(out.float(), y, reduction="none")
            scale = scaler.get_scale()
            gradhooks.dp_sgd_step(hooks, losses, max_norm=1.0, noise_multiplier=0.0, scaler=scaler)
            for n, p in model.named_parameters():
                if n in names:
                    wsum = (want[n] * wfac.view(-1, *[1] * p.dim())).sum(0) / len(x)
                    near(p.grad / scale, wsum, FP16, f"step {step}: {n}")
            scaler.step(optimizer)
            scaler.update()
    finally:
        hooks.remove()
    assert math.isfinite(scaler.get_scale())


def test_a_bfloat16_model_trained_through_a_grad_scaler():
    """A model cast to bfloat16 stepped through a ``GradScaler`` (kept from a float16 recipe):
    ``grad1`` is in bfloat16, and divided by the scale the backward ran with it is each
    example's own gradient; ``unscale_`` divides ``.grad`` alone."""
    model = Net().to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**6)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = batch(step)
            want = loop_grad(reference(model), ce, (x.bfloat16().double(),), y)
            optimizer.zero_grad()
            scale = scaler.get_scale()
            scaler.scale(ce(model(x.bfloat16()), y)).backward()
            scaler.unscale_(optimizer)
            for n, p in model.named_parameters():
                assert p.grad1.dtype == torch.bfloat16
                near(p.grad1 / scale, want[n], BF16, f"step {step}: {n}")
                near((p.grad1 / scale).mean(0), p.grad, BF16, f"step {step}: {n} vs .grad")
            scaler.step(optimizer)
            scaler.update()

"""Training-loop idioms, a seventeenth set: how people train on GPUs, reproduced on the CPU.

Each test writes again, on a small model and over several steps (``zero_grad``, an optimizer's
step), a habit of GPU training code that the earlier sets do not run: a loss scaled by hand by a
static factor (apex's ``static_loss_scale``) and the gradients divided back; a model kept in
float16 with float32 master weights and a dynamic loss scale by hand (apex's O2, fairseq's
``--fp16``), where an example's gradient that fits in float16 must not be lost to the mean's
scale; fused (``fused=True``) optimizers stepped through a ``GradScaler``, which hands them the
scale and the overflow flag instead of unscaling ``.grad``, with a step skipped, in a plain loop
and in the DP optimizer; nanoGPT's weight-decay groups with ``OneCycleLR`` and
``clip_grad_value_`` after ``unscale_``; an AMP loop run with AMP switched off by its flag;
autocast of two dtypes nested (a float16 head inside a bfloat16 body); float32 matrix products
lowered to bfloat16 (``torch.set_float32_matmul_precision("medium")`` and oneDNN's
``fp32_precision``), where the checks must allow bfloat16's rounding; the ``torch.backends``
switches and deterministic mode; a GPU-style epoch (a ``DataLoader`` with ``pin_memory``,
``non_blocking`` copies, a last batch of another size, a validation loop in ``eval()`` under
``inference_mode`` between steps); a part of the model frozen and unfrozen between the DP
optimizer's steps; an EMA of the hooked model kept by ``torch._foreach_lerp_`` beside a fused
AdamW. Each is compared with each example's own gradient by a per-example loop in float64
(:func:`gradhooks.oracle.loop_grad`), within the rounding of the precision the model ran in
(float16: ``1e-2`` of the largest entry; bfloat16: ``5e-2``), or checked to stop with a typed
error that names what went wrong."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.engine.records import float32_products
from gradhooks.oracle import loop_grad
from harness import MixedBackward, assert_close, assert_grad1
from harness import labelled_batch as batch
from harness import wide_mlp as mlp

D = torch.float64
STEPS = 3
FP16 = 1e-2  # float16 autocast: 11 bits of the forward's products, of the largest entry
BF16 = 5e-2  # bfloat16: 8 bits


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max|got - want| / max|want|``, in float64."""
    return ((got.to(D) - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def assert_rows(model: nn.Module, want: dict, tol: float, what: str, scale: float = 1.0) -> None:
    """Every trainable parameter's ``grad1 / scale`` within ``tol`` of ``want``'s largest
    entry (at least one compared)."""
    checked = 0
    for n, p in model.named_parameters():
        if p.requires_grad:
            err = relative_error(p.grad1.to(D) / scale, want[n])
            assert err < tol, f"{what}: {n} off by {err:.2e} of its largest entry"
            checked += 1
    assert checked, what


def norms_of(want: dict) -> torch.Tensor:
    """Each example's gradient norm over every parameter of ``want``."""
    return torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)


def float32_model() -> nn.Sequential:
    """The idiom sets' model (3 -> 6 -> 2, Tanh) in float32."""
    return mlp().float()


def reference(model: nn.Module) -> nn.Module:
    """A float64 copy of ``model``'s weights now, for the loop."""
    return copy.deepcopy(model).to(D)


# -- loss scaling ----------------------------------------------------------------------------


def test_a_loss_scaled_by_hand_by_a_static_factor_and_divided_back():
    """apex's ``static_loss_scale`` (and Megatron's ``--loss-scale``) by hand: float16 autocast,
    ``(loss * 1024).backward()``, every ``.grad`` divided by 1024 before the step. grad1 and
    the norms are the scaled loss's, as ``.grad`` is before the division: ``grad1 / 1024`` is
    each example's gradient within float16's rounding, and the division of ``.grad`` leaves
    grad1 alone (its mean is 1024 times ``.grad`` after it)."""
    model = float32_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scale = 1024.0
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for step in range(STEPS):
            x, y = batch(step)
            x = x.float()
            want = loop_grad(reference(model), F.cross_entropy, x.to(D), y)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            (F.cross_entropy(out.float(), y) * scale).backward()
            for p in model.parameters():
                p.grad.div_(scale)
            assert_rows(model, want, FP16, f"step {step}", scale)
            torch.testing.assert_close(h.norms().to(D) / scale, norms_of(want), rtol=FP16, atol=0)
            for n, p in model.named_parameters():
                err = relative_error(p.grad1.mean(0) / scale, p.grad.to(D))
                assert err < FP16, f"step {step}: {n}'s grad1 is not 1024 times .grad"
            opt.step()


def test_a_float16_model_with_float32_master_weights_and_a_dynamic_loss_scale_by_hand():
    """apex's O2 and fairseq's ``--fp16`` by hand: the model itself in float16, float32 master
    copies that the optimizer steps, the loss times ``S`` backpropagated, an overflow found in
    ``.grad`` halving ``S`` and skipping the step, ``S`` grown fourfold after each clean step,
    the gradients copied into the masters divided by ``S`` and the weights copied back.
    grad1 is in float16 and of the scaled loss: at each step taken, an entry is ``S`` times
    the example's own gradient within float16's rounding wherever that fits in float16, and
    Inf where it does not (the example's own gradient can pass float16's range where the
    batch's mean, in ``.grad``, does not); nothing of a skipped step stays in the next."""
    master = float32_model()
    model = copy.deepcopy(master).half()
    opt = torch.optim.SGD(master.parameters(), lr=0.1)
    top = torch.finfo(torch.float16).max
    scale, taken, skipped = 2.0**14, 0, 0
    with gradhooks.add_hooks(model):
        for step in range(6):
            x, y = batch(step, n=8)
            want = loop_grad(reference(model), F.cross_entropy, x.half().to(D), y)
            model.zero_grad()
            (F.cross_entropy(model(x.half()).float(), y) * scale).backward()
            if not all(torch.isfinite(p.grad).all() for p in model.parameters()):
                scale, skipped = scale / 2, skipped + 1
                continue
            taken += 1
            for n, p in model.named_parameters():
                assert p.grad1.dtype == torch.float16, n
                scaled = want[n] * scale
                fits = scaled.abs() < 0.99 * top
                got = p.grad1.to(D)
                assert torch.isinf(got[scaled.abs() > 1.01 * top]).all(), f"step {step}: {n}"
                if fits.any():
                    err = relative_error(got[fits], scaled[fits])
                    assert err < FP16, f"step {step}: {n} off by {err:.2e} where it fits"
            for m, p in zip(master.parameters(), model.parameters()):
                m.grad = p.grad.float() / scale
            opt.step()
            with torch.no_grad():
                for m, p in zip(master.parameters(), model.parameters()):
                    p.copy_(m)
            scale *= 4
    assert taken >= 2 and skipped >= 1, (taken, skipped)


def test_a_float16_example_gradient_that_fits_is_not_lost_to_the_mean_scale():
    """The case behind the loop above, without random draws: a float16 Linear whose every
    prediction is confidently wrong, the loss's mean over 8 examples times ``S = 2**16``. Each
    output-gradient is about ``-S/8``, and the weight's per-example gradient, times inputs of
    0.25, about ``-S/4``: it fits in float16, though the output-gradient times the batch
    (``-S``) does not, and grad1 is the float64 loop's within float16's rounding; a second
    backward of the batch adds to it (``-S/2``, as ``.grad`` adds). The bias's own gradient,
    about ``-S``, does not fit, and is Inf, as the value is."""
    model = nn.Linear(4, 2).half()
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[8.0, 8.0, 8.0, 8.0], [-8.0, -8.0, -8.0, -8.0]]))
        model.bias.zero_()
    x, y = torch.full((8, 4), 0.25, dtype=torch.float16), torch.ones(8, dtype=torch.long)
    scale = 2.0**16
    want = loop_grad(reference(model), F.cross_entropy, x.to(D), y)
    with gradhooks.add_hooks(model):
        for times in (1, 2):
            (F.cross_entropy(model(x).float(), y) * scale).backward()
            assert torch.isfinite(model.weight.grad).all()
            err = relative_error(model.weight.grad1, times * want["weight"] * scale)
            assert err < FP16, f"backward {times}: off by {err:.2e}"
            assert torch.isinf(model.bias.grad1).all()
    gradhooks.clear_grad1(model)


# -- fused optimizers ------------------------------------------------------------------------


@pytest.mark.parametrize("kind, set_to_none", [("SGD", False), ("AdamW", True)])
def test_a_fused_optimizer_stepped_through_the_grad_scaler_with_a_step_skipped(kind, set_to_none):
    """``torch.optim.AdamW(fused=True)`` (or SGD) under a float16 ``GradScaler``: the scaler
    does not unscale ``.grad`` for a fused optimizer but hands it the scale and the overflow
    flag. A first scale of ``2**40`` overflows: the step is skipped (the weights and the
    optimizer's step count stay), the scale is lowered until it fits; at every finite step
    ``grad1 / S`` is each example's gradient within float16's rounding, and the weights follow
    a float64 run of the same optimizer on ``.grad`` (so nothing of a skipped step leaks,
    whether ``zero_grad`` leaves the skipped step's Inf ``.grad`` zeroed or ``None``)."""
    model = float32_model()
    ref = reference(model)
    make = getattr(torch.optim, kind)
    opts = {"lr": 0.05, "weight_decay": 0.01}
    opt = make(model.parameters(), fused=True, **opts)
    ref_opt = make(ref.parameters(), foreach=False, **opts)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, backoff_factor=2.0**-8)
    skipped = taken = 0
    with gradhooks.add_hooks(model):
        for step in range(6):
            x, y = batch(step)
            x = x.float()
            want = loop_grad(reference(model), F.cross_entropy, x.to(D), y)
            before = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad(set_to_none=set_to_none)
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            scale = scaler.get_scale()
            scaler.scale(F.cross_entropy(out.float(), y)).backward()
            finite = all(torch.isfinite(p.grad1).all() for p in model.parameters())
            scaler.step(opt)
            scaler.update()
            if not finite:
                skipped += 1
                assert scaler.get_scale() < scale, f"step {step}"
                for p, q in zip(model.parameters(), before):
                    assert torch.equal(p, q), f"step {step}: a skipped step moved a weight"
                continue
            taken += 1
            assert_rows(model, want, FP16, f"step {step}", scale)
            ref_opt.zero_grad()
            for r, g in zip(ref.parameters(), want.values()):
                r.grad = g.mean(0)
            ref_opt.step()
            for (n, p), r in zip(model.named_parameters(), ref.parameters()):
                err = relative_error(p.detach(), r.detach())
                assert err < 1e-2, f"step {step}: {n} off the float64 run by {err:.2e}"
    assert skipped and taken >= 3, (skipped, taken)
    if kind == "AdamW":
        for p in model.parameters():
            assert int(opt.state[p]["step"]) == taken


def test_the_dp_optimizer_over_a_fused_adamw_through_the_scaler_skips_and_steps():
    """``DPOptimizer`` wrapping ``AdamW(fused=True)`` with a ``GradScaler`` (no noise, for the
    comparison): the overflowing first step is skipped by the fused kernel (no weight moves,
    no step counted), and each later step is the float64 loop's clipped mean through a float64
    AdamW, within float16's rounding."""
    model = float32_model()
    ref = reference(model)
    opts = {"lr": 0.05, "weight_decay": 0.01}
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, backoff_factor=2.0**-30)
    ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **opts)
    bound = 0.5
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.AdamW(model.parameters(), fused=True, **opts), h,
            max_grad_norm=bound, noise_multiplier=0.0, expected_batch_size=5, scaler=scaler,
        )  # fmt: skip
        taken = 0
        for step in range(5):
            x, y = batch(step)
            x = x.float()
            want = loop_grad(reference(model), F.cross_entropy, x.to(D), y)
            before = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            opt.backward(F.cross_entropy(out.float(), y, reduction="none"))
            if not opt.step():
                assert step == 0, f"step {step} skipped"
                for p, q in zip(model.parameters(), before):
                    assert torch.equal(p, q), "a skipped step moved a weight"
                continue
            taken += 1
            factors = (bound / norms_of(want)).clamp(max=1.0)
            ref_opt.zero_grad()
            for r, g in zip(ref.parameters(), want.values()):
                r.grad = (factors.view(-1, *[1] * (g.dim() - 1)) * g).sum(0) / 5
            ref_opt.step()
            for (n, p), r in zip(model.named_parameters(), ref.parameters()):
                err = relative_error(p.detach(), r.detach())
                assert err < 1e-2, f"step {step}: {n} off the float64 run by {err:.2e}"
    assert taken == 4
    for p in model.parameters():
        assert int(opt.optimizer.state[p]["step"]) == taken


@pytest.mark.parametrize("dp", [False, True], ids=["plain", "dp"])
def test_an_amp_loop_run_with_amp_switched_off_by_its_flag(dp):
    """The AMP loop of the PyTorch recipe written once with ``use_amp`` (``GradScaler("cpu",
    enabled=use_amp)``, ``autocast(enabled=use_amp)``) and run with it off: ``scaler.scale``
    hands the loss back, ``get_scale()`` is 1, and grad1 (or the DP optimizer's step, given
    the disabled scaler) is the float32 loop's exactly."""
    use_amp = False
    model = float32_model()
    scaler = torch.amp.GradScaler("cpu", enabled=use_amp)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    hooks = gradhooks.add_hooks(model, quantities=("grad1", "norms"))
    opt = inner
    if dp:
        opt = gradhooks.DPOptimizer(
            inner, hooks, max_grad_norm=0.1, noise_multiplier=0.0, expected_batch_size=5,
            scaler=scaler,
        )  # fmt: skip
    for step in range(STEPS):
        x, y = batch(step)
        x = x.float()
        want = loop_grad(reference(model), F.cross_entropy, x.to(D), y)
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=use_amp):
            out = model(x)
        assert out.dtype == torch.float32 and scaler.get_scale() == 1.0
        if dp:
            opt.backward(F.cross_entropy(out, y, reduction="none"))
            assert opt.step()
            factors = (0.1 / norms_of(want)).clamp(max=1.0)
            for (n, p), q in zip(model.named_parameters(), before):
                clipped = (factors.view(-1, *[1] * p.dim()) * want[n]).sum(0) / 5
                assert relative_error(p.grad, clipped) < 1e-5, f"step {step}: {n}"
                assert not torch.equal(p, q), f"step {step}: {n} did not move"
            continue
        scaler.scale(F.cross_entropy(out, y)).backward()
        assert_rows(model, want, 1e-5, f"step {step}")
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    hooks.remove()


def decay_groups(model: nn.Module) -> list[dict]:
    """nanoGPT's ``configure_optimizers``: weight decay on the matrices, none on the biases."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def test_decay_groups_one_cycle_and_clip_grad_value_after_unscale():
    """nanoGPT's optimizer groups (decay on matrices only) in a fused AdamW, ``OneCycleLR``
    stepped per batch, float16 autocast under a ``GradScaler``, ``scaler.unscale_`` then
    ``clip_grad_value_``: grad1 stays ``S`` times each example's unclipped gradient (the
    clipping and the unscaling act on ``.grad``), and the weights follow a float64 run of the
    same groups, schedule and clipping on the loop's mean within float16's rounding."""
    model = float32_model()
    ref = reference(model)
    opt = torch.optim.AdamW(decay_groups(model), lr=0.01, fused=True)
    ref_opt = torch.optim.AdamW(decay_groups(ref), lr=0.01, foreach=False)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS)
    ref_sched = torch.optim.lr_scheduler.OneCycleLR(ref_opt, max_lr=0.05, total_steps=STEPS)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    clipped = 0
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = batch(step)
            x = x.float()
            want = loop_grad(reference(model), F.cross_entropy, x.to(D), y)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            scale = scaler.get_scale()
            scaler.scale(F.cross_entropy(out.float(), y)).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.02)
            bound = torch.tensor(0.02)  # (clamped entries hold exactly float32's 0.02)
            clipped += sum(int((p.grad.abs() == bound).sum()) for p in model.parameters())
            assert_rows(model, want, FP16, f"step {step}", scale)
            scaler.step(opt)
            scaler.update()
            sched.step()
            ref_opt.zero_grad()
            for r, g in zip(ref.parameters(), want.values()):
                r.grad = g.mean(0)
            torch.nn.utils.clip_grad_value_(ref.parameters(), 0.02)
            ref_opt.step()
            ref_sched.step()
            for (n, p), r in zip(model.named_parameters(), ref.parameters()):
                err = relative_error(p.detach(), r.detach())
                assert err < 1e-2, f"step {step}: {n} off the float64 run by {err:.2e}"
    assert clipped, "clip_grad_value_ clipped nothing"


# -- autocast --------------------------------------------------------------------------------


class BodyAndHead(nn.Module):
    """A body under the caller's autocast and a head under a float16 autocast of its own
    (a GPU recipe's loss head kept out of bfloat16)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh())
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        h = self.body(x)
        with torch.autocast("cpu", dtype=torch.float16):
            return self.head(h)


def test_autocast_of_two_dtypes_nested_a_float16_head_in_a_bfloat16_body():
    """bfloat16 autocast around the forward, float16 autocast around the head inside it: the
    body's layers run in bfloat16, the head's in float16; grad1 (float32, as ``.grad``) is
    within bfloat16's rounding of the float64 loop at every step, the head's within float16's,
    and the verifying probe raises no false alarm at either."""
    model = BodyAndHead()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for step in range(STEPS):
            x, y = batch(step)
            x = x.float()
            want = loop_grad(reference(model), F.cross_entropy, x.to(D), y)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            assert out.dtype == torch.float16
            F.cross_entropy(out.float(), y).backward()
            for n, p in model.named_parameters():
                assert p.grad1.dtype == torch.float32, n
            assert_rows(model, want, BF16, f"step {step}")
            head = {n: g for n, g in want.items() if n.startswith("head")}
            for n, g in head.items():
                err = relative_error(model.get_parameter(n).grad1, g)
                assert err < BF16, f"step {step}: {n} off by {err:.2e}"
            torch.testing.assert_close(h.norms().to(D), norms_of(want), rtol=BF16, atol=0)
            opt.step()


# -- float32 products in bfloat16 ------------------------------------------------------------


def lowered(how: str):
    """A context in which float32 products may run in bfloat16, set as training scripts set it
    (the legacy switch, or oneDNN's own for its matrix products and convolutions), and put
    back after."""

    class Lowered:
        def __enter__(self):
            if how == "medium":
                self.old = torch.get_float32_matmul_precision()
                torch.set_float32_matmul_precision("medium")
            else:
                onednn = torch.backends.mkldnn
                self.old = (onednn.matmul.fp32_precision, onednn.conv.fp32_precision)
                onednn.matmul.fp32_precision = onednn.conv.fp32_precision = "bf16"

        def __exit__(self, *exc):
            if how == "medium":
                torch.set_float32_matmul_precision(self.old)
            else:
                onednn = torch.backends.mkldnn
                onednn.matmul.fp32_precision, onednn.conv.fp32_precision = self.old

    return Lowered()


def conv_model() -> nn.Sequential:
    """A Conv1d-Tanh-Linear stack wide enough that bfloat16 products round visibly."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv1d(8, 16, 3), nn.Tanh(), nn.Flatten(1), nn.Linear(16 * 14, 64), nn.Tanh(),
        nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10),
    )  # fmt: skip


@pytest.mark.parametrize("how", ["medium", "mkldnn-bf16"])
def test_float32_products_lowered_to_bfloat16_are_checked_within_bfloat16s_rounding(how):
    """``torch.set_float32_matmul_precision("medium")`` (Lightning's advice, nanoGPT's and
    timm's scripts) or oneDNN's ``matmul`` and ``conv`` ``fp32_precision = "bf16"``: where the
    processor has bfloat16 products, the CPU runs float32 matrix products (and convolutions)
    in bfloat16. The verifying probe, ``Hooks.check`` and the DP step's check compare two such
    computations, which then differ by bfloat16's rounding, not float32's: no false alarm
    (float32's tolerance refuses the first backward, a ``CheckFailedError`` on a convolution's
    bias), and grad1 and the DP step's clipped mean are within bfloat16's rounding of the
    float64 loop. On a processor without them nothing is lowered and this holds too."""
    model = conv_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    with lowered(how), gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for step in range(2):
            x, y = torch.randn(16, 8, 16, generator=g), torch.randint(10, (16,), generator=g)
            want = loop_grad(reference(model), F.cross_entropy, x.to(D), y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_rows(model, want, BF16, f"step {step}")
            assert h.check(F.cross_entropy, x, y).ok, f"step {step}"
            opt.zero_grad()
            losses = F.cross_entropy(model(x), y, reduction="none")
            gradhooks.dp_sgd_step(h, losses, max_norm=0.5, noise_multiplier=0.0)
            factors = (0.5 / norms_of(want)).clamp(max=1.0)
            for n, p in model.named_parameters():
                clipped = (factors.view(-1, *[1] * p.dim()) * want[n]).sum(0) / len(y)
                err = relative_error(p.grad, clipped)
                assert err < BF16, f"step {step}: the DP step's {n} off by {err:.2e}"
            opt.step()


@pytest.mark.parametrize("how", ["medium", "mkldnn-bf16"])
def test_the_lowered_products_are_read_at_each_forward_on_any_processor(how):
    """What the checks read of the setting, whatever the processor: bfloat16 inside the
    context, nothing once it is put back (and nothing at "high", TF32, which the CPU ignores
    and float32's tolerance already covers on a GPU)."""
    assert float32_products() is None
    with lowered(how):
        assert float32_products() is torch.bfloat16
    assert float32_products() is None
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        assert float32_products() is None
    finally:
        torch.set_float32_matmul_precision(old)


def test_a_mixing_of_the_examples_is_still_refused_with_products_in_bfloat16():
    """The allowance for bfloat16's rounding is not a blind spot for what the probe is for: a
    model that mixes the examples (a custom ``autograd.Function`` whose backward adds the next
    example's gradient) is still refused under ``set_float32_matmul_precision("medium")``,
    and no grad1 is written."""

    class Mixing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

        def forward(self, x):
            return self.b(MixedBackward.apply(torch.tanh(self.a(x))))

    model = Mixing()
    x, y = torch.randn(8, 16), torch.randint(4, (8,))
    with lowered("medium"), gradhooks.add_hooks(model):
        with pytest.raises(gradhooks.CheckFailedError, match=r"'a\.(weight|bias)'"):
            F.cross_entropy(model(x), y).backward()
    for n, p in model.named_parameters():
        assert not hasattr(p, "grad1"), n


# -- host-side switches ----------------------------------------------------------------------


class Switch:
    """One of the process-wide switches a GPU training script sets at its top, entered and
    put back."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self):
        b = torch.backends
        if self.name == "deterministic":
            self.old = torch.are_deterministic_algorithms_enabled()
            torch.use_deterministic_algorithms(True)
        # (by the backends' flags() context managers, as torch's own tests set them: a
        # process that imported torch's testing helpers refuses an assignment)
        elif self.name == "mkldnn-off":
            self.flags = b.mkldnn.flags(enabled=False)
            self.flags.__enter__()
        elif self.name == "opt-einsum-off":
            self.flags = b.opt_einsum.flags(enabled=False)
            self.flags.__enter__()
        elif self.name == "cudnn-benchmark":
            self.flags = b.cudnn.flags(enabled=b.cudnn.enabled, benchmark=True, deterministic=True)
            self.flags.__enter__()
            self.old = b.cuda.matmul.allow_tf32
            b.cuda.matmul.allow_tf32 = True
        elif self.name == "flush-denormal":
            self.old = torch.set_flush_denormal(True)
        return self

    def __exit__(self, *exc):
        b = torch.backends
        if self.name == "deterministic":
            torch.use_deterministic_algorithms(self.old)
        elif self.name in ("mkldnn-off", "opt-einsum-off"):
            self.flags.__exit__(*exc)
        elif self.name == "cudnn-benchmark":
            b.cuda.matmul.allow_tf32 = self.old
            self.flags.__exit__(*exc)
        elif self.name == "flush-denormal":
            torch.set_flush_denormal(False)


class Mixed(nn.Module):
    """An embedding, a convolution and a Linear head: the layers whose kernels the switches
    choose among (index_add / scatter, oneDNN or the native convolution, einsum paths)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 6)
        self.conv = nn.Conv1d(6, 8, 3, padding=1)
        self.head = nn.Linear(8 * 7, 3)

    def forward(self, tokens):
        h = torch.tanh(self.conv(self.emb(tokens).transpose(1, 2)))
        return self.head(h.flatten(1))


SWITCHES = ["deterministic", "mkldnn-off", "opt-einsum-off", "cudnn-benchmark", "flush-denormal"]


@pytest.mark.parametrize("name", SWITCHES)
def test_host_side_switches_set_at_the_top_of_a_training_script(name):
    """``torch.use_deterministic_algorithms(True)``, oneDNN switched off, ``opt_einsum``
    switched off, cuDNN's ``benchmark`` / ``deterministic`` and TF32 (no-ops on the CPU, set by
    every GPU script), denormals flushed: an embedding, a convolution and a head trained by
    SGD and by the DP step, grad1 and the DP step's clipped sum equal to the float64 loop's at
    every step."""
    model = Mixed().to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Switch(name), gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            tokens, y = torch.randint(11, (5, 7), generator=g), torch.randint(3, (5,), generator=g)
            want = loop_grad(model, F.cross_entropy, tokens, y)
            opt.zero_grad()
            F.cross_entropy(model(tokens), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.zero_grad()
            losses = F.cross_entropy(model(tokens), y, reduction="none")
            gradhooks.dp_sgd_step(h, losses, max_norm=0.1, noise_multiplier=0.0)
            factors = (0.1 / norms_of(want)).clamp(max=1.0)
            for n, p in model.named_parameters():
                clipped = (factors.view(-1, *[1] * (p.dim())) * want[n]).sum(0) / 5
                assert_close(p.grad, clipped, f"step {step}: DP {n}")
            opt.step()


# -- a GPU-style epoch -----------------------------------------------------------------------


def test_a_gpu_style_epoch_pinned_non_blocking_and_validated_under_inference_mode():
    """The ImageNet example's loop on the CPU: a ``DataLoader`` with ``pin_memory=True`` (a
    warning and no pinning without an accelerator) and a last batch of another size, each batch
    moved by ``.to(device, non_blocking=True)``, ``zero_grad(set_to_none=True)``, and after
    each step a validation loop in ``eval()`` under ``torch.inference_mode()`` with the hooks
    left on: every step's grad1 and norms are its batch's own, the validation writes nothing,
    and ``train()`` resumes."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(13, 3, generator=g, dtype=D), torch.randint(2, (13,), generator=g)
    data = torch.utils.data.TensorDataset(xs, ys)
    with pytest.warns(UserWarning, match="pin_memory"):
        loader = list(torch.utils.data.DataLoader(data, batch_size=5, pin_memory=True))
    assert [len(b[0]) for b in loader] == [5, 5, 3]
    device = torch.device("cpu")
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        for step, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            model.train()
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            want = loop_grad(model, F.cross_entropy, x, y)
            assert_grad1(model, want, f"step {step}")
            assert_close(h.norms(), norms_of(want), f"step {step}: norms")
            opt.step()
            kept = {n: p.grad1.clone() for n, p in model.named_parameters()}
            model.eval()
            with torch.inference_mode():
                for vx, _ in loader:
                    model(vx.to(device, non_blocking=True))
            for n, p in model.named_parameters():
                assert torch.equal(p.grad1, kept[n]), f"step {step}: validation changed {n}"
    assert model.training is False


# -- a part of the model frozen between DP steps -----------------------------------------------


def test_a_part_frozen_and_unfrozen_between_the_dp_optimizers_steps():
    """Gradual unfreezing under DP (ULMFiT's habit; Opacus users freeze a backbone): the first
    layer's ``requires_grad_(False)`` before the second step, ``True`` again before the fourth,
    with ``DPOptimizer`` over every parameter (``foreach`` SGD, ``zero_grad(set_to_none=False)``).
    A frozen step clips each example over the trainable layers alone, writes the frozen layer
    no gradient (its zeros stay, it does not move) and noises nothing of it; every step is the
    float64 loop's clipped mean of the parameters then trainable."""
    model = mlp()
    opt = gradhooks.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, foreach=True), gradhooks.add_hooks(model),
        max_grad_norm=0.1, noise_multiplier=0.0, expected_batch_size=5,
    )  # fmt: skip
    first = model[0]
    for step in range(5):
        first.requires_grad_(step not in (1, 2))
        x, y = batch(step)
        opt.zero_grad(set_to_none=False)
        losses = F.cross_entropy(model(x), y, reduction="none")
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        want = loop_grad(model, F.cross_entropy, x, y)
        want = {n: g for n, g in want.items() if n in trainable}
        factors = (0.1 / norms_of(want)).clamp(max=1.0)
        expected = {
            n: (factors.view(-1, *[1] * p.dim()) * want[n]).sum(0) / 5 for n, p in trainable.items()
        }
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.backward(losses)
        assert opt.step()
        for n, p in model.named_parameters():
            if n in trainable:
                assert_close(before[n] - p.detach(), 0.1 * expected[n], f"step {step}: {n}")
            else:
                assert torch.equal(p, before[n]), f"step {step}: frozen {n} moved"
                assert p.grad is not None and not p.grad.any(), f"step {step}: frozen {n}"
    gradhooks.remove_hooks(model)


# -- an EMA kept in the loop -----------------------------------------------------------------


def test_an_ema_kept_by_foreach_lerp_beside_a_fused_adamw():
    """The EMA of modern GPU loops (timm's ``ModelEmaV3``, Lightning callbacks) kept by
    ``torch._foreach_lerp_`` on a plain copy after a ``fused=True`` AdamW step: the copy is
    not hooked and gets no grad1; its evaluation forward between steps writes nothing on the
    hooked model; the hooked model's grad1 is its batch's own at every step."""
    model = float32_model()
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    with gradhooks.add_hooks(model):
        for step in range(STEPS):
            x, y = batch(step)
            x = x.float()
            want = loop_grad(reference(model), F.cross_entropy, x.to(D), y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}", rtol=1e-4, atol=1e-6)
            opt.step()
            with torch.no_grad():
                torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 0.1)
            kept = {n: p.grad1.clone() for n, p in model.named_parameters()}
            ema(x).sum()
            for n, p in model.named_parameters():
                assert torch.equal(p.grad1, kept[n]), f"step {step}: {n}"
    for n, p in ema.named_parameters():
        assert not hasattr(p, "grad1"), n

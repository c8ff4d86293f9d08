"""Training-loop idioms, a seventeenth set: how people train on GPUs, reproduced on the CPU.

Each test writes again, on a small model and over several steps (``zero_grad``, an optimizer's
step), a habit of GPU training code that the earlier sets do not run: a loss scaled by hand by a
static factor (apex's ``static_loss_scale``) and the gradients divided back; a model kept in
float16 with float32 master weights and a dynamic loss scale by hand (apex's O2, fairseq's
``--fp16``), where an example's gradient that fits in float16 must not be lost to the mean's
scale; fused (``fused=True``) optimizers stepped through a ``GradScaler``, which hands them the
scale and the overflow flag instead of unscaling ``.grad``, with a step skipped, in a plain loop
and in the DP optimizer; an AMP loop run with AMP switched off by its flag; autocast of two
dtypes nested (a float16 head inside a bfloat16 body); float32 matrix products lowered to
bfloat16 (``torch.set_float32_matmul_precision("medium")`` and oneDNN's ``fp32_precision``),
where the checks must allow bfloat16's rounding; the ``torch.backends`` switches and
deterministic mode; a GPU-style epoch (a ``DataLoader`` with ``pin_memory``, ``non_blocking``
copies, a last batch of another size, a validation loop in ``eval()`` under ``inference_mode``
between steps); a part of the model frozen and unfrozen between the DP optimizer's steps; an
EMA of the hooked model kept by ``torch._foreach_lerp_`` beside a fused AdamW. Each is compared
with each example's own gradient by a per-example loop in float64
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
from harness import MixedBackward
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
    0.5, about ``-S/2``: it fits in float16, though the output-gradient times the batch
    (``-S``) does not, and grad1 is the float64 loop's within float16's rounding. The bias's
    own gradient, about ``-S``, does not fit, and is Inf, as the value is."""
    model = nn.Linear(4, 2).half()
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[4.0, 4.0, 4.0, 4.0], [-4.0, -4.0, -4.0, -4.0]]))
        model.bias.zero_()
    x, y = torch.full((8, 4), 0.5, dtype=torch.float16), torch.ones(8, dtype=torch.long)
    scale = 2.0**16
    want = loop_grad(reference(model), F.cross_entropy, x.to(D), y)
    with gradhooks.add_hooks(model):
        (F.cross_entropy(model(x).float(), y) * scale).backward()
    assert torch.isfinite(model.weight.grad).all()
    assert relative_error(model.weight.grad1, want["weight"] * scale) < FP16
    assert torch.isinf(model.bias.grad1).all()
    gradhooks.clear_grad1(model)


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
        for step in range(STEPS):
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

"""Training-loop idioms, a seventeenth set: how people train on GPUs, reproduced on the CPU.

Each test writes again, on a small model and over several steps (``zero_grad``, an optimizer's
step), a habit of GPU training code that the earlier sets do not run: a loss scaled by hand by a
static factor (apex's ``static_loss_scale``) and the gradients divided back; fused
(``fused=True``) optimizers stepped through a ``GradScaler``, which hands them the scale and
the overflow flag instead of unscaling ``.grad``, with a step skipped, in a plain loop and in
the DP optimizer; autocast of two dtypes nested (a float16 head inside a bfloat16 body);
float32 matrix products lowered to bfloat16 (``torch.set_float32_matmul_precision("medium")``
and oneDNN's ``fp32_precision``), where the checks must allow bfloat16's rounding; the
``torch.backends`` switches and deterministic mode; a GPU-style epoch (a ``DataLoader`` with
``pin_memory``, ``non_blocking`` copies, a last batch of another size, a validation loop in
``eval()`` under ``inference_mode`` between steps); a part of the model frozen and unfrozen
between the DP optimizer's steps; an EMA of the hooked model kept by ``torch._foreach_lerp_``
in a fused loop. Each is compared with each example's own gradient by a per-example loop in
float64 (:func:`gradhooks.oracle.loop_grad`), within the rounding of the precision the model
ran in (float16: ``1e-2`` of the largest entry; bfloat16: ``5e-2``), or checked to stop with a
typed error that names what went wrong."""

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
    timm's scripts) or oneDNN's ``matmul`` and ``conv`` ``fp32_precision = "bf16"``: where the processor
    has bfloat16 products, the CPU runs float32 matrix products (and convolutions) in bfloat16.
    The verifying probe and ``Hooks.check`` compare two such computations, which then differ
    by bfloat16's rounding, not float32's: no false alarm (it refused the first backward with
    a ``CheckFailedError`` on a convolution's bias), and grad1 and the DP step's clipped mean
    are within bfloat16's rounding of the float64 loop. On a processor without them nothing is
    lowered and this holds too."""
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

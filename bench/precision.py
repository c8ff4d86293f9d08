"""grad1's accuracy under each precision, against the float64 per-example loop.

    python -m bench.precision            # the table of docs/mixed-precision.md
    python -m bench.precision --seeds 5  # the largest error over 5 seeds

For each model (an MLP, a small CNN, a tiny GPT-2) and precision (float32; CPU autocast to
bfloat16 and to float16 with float32 parameters; bfloat16 parameters without autocast), one
sum-reduced backward with hooks, and the relative error of the whole model's ``grad1``,
``max|grad1 - ref| / max|ref|`` over every parameter together, where ``ref`` is
:func:`gradhooks.oracle.loop_grad` of the same weights (the bfloat16 ones, for bfloat16
parameters) in float64; in parentheses, the same error of autograd's own batch gradient
(``.grad`` of the model without hooks, against the loop's sum), which the forward's precision
sets alike. The unit of each format is beside it: float32 ``2⁻²⁴ ≈ 6e-8``,
float16 ``2⁻¹¹ ≈ 5e-4``, bfloat16 ``2⁻⁸ ≈ 4e-3`` (machine epsilon; rounding is half of it).
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gradhooks
from gradhooks.oracle import loop_grad

PRECISIONS = {
    # name: (parameter dtype, autocast dtype or None)
    "float32": (torch.float32, None),
    "bf16 autocast": (torch.float32, torch.bfloat16),
    "fp16 autocast": (torch.float32, torch.float16),
    "bf16 parameters": (torch.bfloat16, None),
}


class _CNN(nn.Module):
    """Two 3x3 convolutions (3 to 8 to 16 channels) on 16x16 images, a GroupNorm, a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 16, 3, stride=2)
        self.norm, self.fc = nn.GroupNorm(4, 16), nn.Linear(16 * 7 * 7, 10)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(self.c2(F.relu(self.c1(x))))
        return self.fc(F.relu(h).flatten(1))


class _LM(nn.Module):
    """A Hugging Face model called with token ids, logits out."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(input_ids=x).logits


def _gpt2() -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256,
                                  n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0)  # fmt: skip
    return _LM(transformers.GPT2LMHeadModel(cfg)).eval()


def _cross_entropy(out: Tensor, y: Tensor) -> Tensor:
    """Summed over the examples (and a language model's positions)."""
    return F.cross_entropy(out.float().flatten(0, -2), y.flatten(), reduction="sum")


def _models(batch: int, gen: torch.Generator) -> dict:
    """name: (model factory, inputs, targets)."""
    return {
        "MLP": (
            lambda: nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10)),
            torch.randn(batch, 32, generator=gen),
            torch.randint(10, (batch,), generator=gen),
        ),
        "CNN": (
            _CNN,
            torch.randn(batch, 3, 16, 16, generator=gen),
            torch.randint(10, (batch,), generator=gen),
        ),
        "tiny GPT-2": (
            _gpt2,
            torch.randint(256, (batch, 16), generator=gen),
            torch.randint(256, (batch, 16), generator=gen),
        ),
    }


def relative_error(model: nn.Module, ref: dict[str, Tensor]) -> float:
    """``max|grad1 - ref| / max|ref|`` over every parameter together."""
    diff = max(float((p.grad1.double() - ref[n]).abs().max()) for n, p in model.named_parameters())
    return diff / max(float(r.abs().max()) for r in ref.values())


def measure(
    make, x: Tensor, y: Tensor, param_dtype, autocast_dtype, seed: int
) -> tuple[float, float]:
    """The relative errors of ``grad1`` and, for comparison, of autograd's own batch gradient
    (``.grad`` of the model without hooks, against the loop's sum)."""
    torch.manual_seed(seed)
    model = make().to(param_dtype)
    if x.is_floating_point():
        x = x.to(param_dtype)
    ref = loop_grad(copy.deepcopy(model).double(), _cross_entropy, x.double()
                    if x.is_floating_point() else x, y)  # fmt: skip
    plain = copy.deepcopy(model)
    autocast = torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16,
                              enabled=autocast_dtype is not None)  # fmt: skip
    with autocast:
        out = plain(x)
    _cross_entropy(out, y).backward()
    grads = dict(plain.named_parameters())
    diff = max(float((grads[n].grad.double() - r.sum(0)).abs().max()) for n, r in ref.items())
    batch_error = diff / max(float(r.sum(0).abs().max()) for r in ref.values())
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with autocast:
            out = model(x)
        _cross_entropy(out, y).backward()
    for p in model.parameters():
        assert p.grad1.dtype == param_dtype
    return relative_error(model, ref), batch_error


def table(batch: int = 8, seeds: int = 1) -> list[str]:
    rows = ["| model | " + " | ".join(PRECISIONS) + " |", "| --- |" + " ---: |" * len(PRECISIONS)]
    gen = torch.Generator().manual_seed(0)
    for name, (make, x, y) in _models(batch, gen).items():
        cells = []
        for param_dtype, autocast_dtype in PRECISIONS.values():
            errors = [measure(make, x, y, param_dtype, autocast_dtype, s) for s in range(seeds)]
            worst = max(e for e, _ in errors), max(b for _, b in errors)
            cells.append(f"{worst[0]:.1e} ({worst[1]:.1e})")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=1, help="the largest error over seeds")
    args = parser.parse_args(argv)
    print("\n".join(table(args.batch, args.seeds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

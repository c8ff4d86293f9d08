"""``python -m gradhooks``: the per-sample-gradients tutorial's scenario, three ways.

SimpleCNN on a batch of MNIST-shaped images (CUDA when present, else CPU): per-example gradients
by gradhooks' hooks, by ``torch.func`` ``vmap(grad)`` and by a per-example loop (one forward and
backward per example). Each method is timed in float32 (the median of ``--repeats`` runs), then
the hooks' ``grad1`` is checked against both references in float64, on the same weights and
data: the methods agree when the largest difference is at most ``1e-10`` of the largest
gradient.

Why float64: in float32 a batch of one is rounded differently from the whole batch (other
kernels), and where an example's max-pool has two inputs within rounding of each other, the
loop's forward can pick the other one. That example's gradient then differs by up to a few
thousandths of the largest gradient, with every method right. In float64 rounding is about
``1e-16``, and the methods differ by about ``1e-15``.

Exit status: 0 when the methods agree, 1 when they do not.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gradhooks
from gradhooks.models import SimpleCNN
from gradhooks.oracle import loop_grad, vmap_grad

# The largest difference allowed in float64, relative to the largest gradient
TOLERANCE = 1e-10


def parser() -> argparse.ArgumentParser:
    description = __doc__.split("\n", 2)[2].replace("``", "")
    p = argparse.ArgumentParser(
        prog="python -m gradhooks",
        description=f"The per-sample-gradients tutorial's scenario, three ways.\n\n{description}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--batch", type=int, default=64, help="examples in the batch (default: %(default)s)"
    )
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where to run: cpu, cuda, cuda:1, ... (default here: %(default)s)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed float32 runs of the hooks and of vmap(grad), after one untimed run; "
        "the median is shown (default: %(default)s)",
    )
    p.add_argument(
        "--loop-repeats",
        type=int,
        default=1,
        help="timed float32 runs of the per-example loop, the slowest method "
        "(default: %(default)s)",
    )
    return p


def hooks_grad1(model: nn.Module, data: Tensor, targets: Tensor) -> dict[str, Tensor]:
    """The hooks' per-example gradients of the mean cross-entropy, ``{name: [batch, *shape]}``."""
    with gradhooks.add_hooks(model, loss_reduction="mean"):
        F.cross_entropy(model(data), targets).backward()
    return {n: p.grad1 for n, p in model.named_parameters()}


def _timed(fn, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _largest_difference(got: dict[str, Tensor], want: dict[str, Tensor]) -> tuple[float, float]:
    """The largest absolute difference over every parameter, and it over the largest gradient."""
    diff = max((got[n] - want[n]).abs().max().item() for n in want)
    scale = max(want[n].abs().max().item() for n in want)
    return diff, diff / scale if scale else diff


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = SimpleCNN().to(device)
    data = torch.randn(args.batch, 1, 28, 28, device=device)
    targets = torch.randint(10, (args.batch,), device=device)
    names = [n for n, _ in model.named_parameters()]
    floats = sum(p.numel() for p in model.parameters()) * args.batch

    print(f"gradhooks {gradhooks.__version__}, torch {torch.__version__}, device {device}")
    print(f"SimpleCNN, batch {args.batch}: per-example gradients of {len(names)} parameters")
    print(f"({floats:,} floats per batch)\n")

    # Time, float32. Each row is printed when measured (the loop takes a while)
    runs = lambda n: f"{n} run{'s' if n != 1 else ''}"
    print(f"Time, float32 (median of {runs(args.repeats)}; the loop: {runs(args.loop_repeats)}):")
    print(f"| {'method':<16} | {'time (ms)':>10} | {'vs hooks':>8} |")
    print(f"| {'-' * 16} | {'-' * 10}:| {'-' * 8}:|", flush=True)

    def row(method: str, t: float) -> None:
        print(f"| {method:<16} | {t * 1e3:>10.2f} | {t / t_hooks:>7.2f}x |", flush=True)

    # The hooks as in a training loop: added once, each step starting a fresh grad1 (whose
    # memory the backward reuses when nothing else holds it)
    with gradhooks.add_hooks(model, loss_reduction="mean") as hooks:

        def by_hooks():
            model.zero_grad(set_to_none=True)
            hooks.clear()
            F.cross_entropy(model(data), targets).backward()

        by_hooks()  # untimed first run
        t_hooks = _timed(by_hooks, args.repeats, device)
    gradhooks.clear_grad1(model)
    model.zero_grad(set_to_none=True)
    row("gradhooks hooks", t_hooks)
    by_vmap = lambda: vmap_grad(model, F.cross_entropy, data, targets)
    by_vmap()  # untimed first run
    row("vmap(grad)", _timed(by_vmap, args.repeats, device))
    by_loop = lambda: loop_grad(model, F.cross_entropy, data, targets)
    row("per-example loop", _timed(by_loop, args.loop_repeats, device))

    # Agreement, float64: the same weights and data
    print(
        f"\nAgreement, float64 (the same weights and data): the hooks' grad1 against each "
        f"reference,\nlargest difference over all {len(names)} parameters and {args.batch} "
        f"examples; tolerance {TOLERANCE:.0e} of the largest gradient:",
        flush=True,
    )
    model, data = model.double(), data.double()
    hooked = hooks_grad1(model, data, targets)
    vmapped = vmap_grad(model, F.cross_entropy, data, targets)
    looped = loop_grad(model, F.cross_entropy, data, targets)
    d_vmap, r_vmap = _largest_difference(hooked, vmapped)
    d_loop, r_loop = _largest_difference(hooked, looped)
    print(f"| {'reference':<16} | {'max |diff|':>10} | {'of largest':>10} |")
    print(f"| {'-' * 16} | {'-' * 10}:| {'-' * 10}:|")
    for method, d, r in [("vmap(grad)", d_vmap, r_vmap), ("per-example loop", d_loop, r_loop)]:
        print(f"| {method:<16} | {d:>10.1e} | {r:>10.1e} |")
    print()
    worst = max(r_vmap, r_loop)
    if worst <= TOLERANCE:
        print(
            f"agree: in float64 the hooks' grad1 equals vmap(grad)'s and the loop's to "
            f"{worst:.1e} of the largest gradient (tolerance {TOLERANCE:.0e})"
        )
        return 0
    print(
        f"DISAGREE: in float64 the hooks' grad1 differs from vmap(grad)'s by {r_vmap:.1e} and "
        f"from the loop's by {r_loop:.1e} of the largest gradient (tolerance {TOLERANCE:.0e})"
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())

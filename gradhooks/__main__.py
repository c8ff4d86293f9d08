"""``python -m gradhooks``: the per-sample-gradients tutorial's scenario, three ways.

SimpleCNN, a batch of 64 MNIST-shaped images (CUDA when present, else CPU): per-example
gradients by gradhooks' hooks, by ``torch.func`` ``vmap(grad)`` and by a per-example loop. Prints
whether they agree (largest absolute difference, relative to the largest gradient) and the time
each takes, as a small table. Exits with status 1 if they disagree.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import gradhooks
from gradhooks.models import SimpleCNN
from gradhooks.oracle import loop_grad, vmap_grad


def _timed(fn, repeats: int, device: torch.device):
    times, result = [], None
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return result, statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gradhooks", description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per method (median)")
    parser.add_argument("--loop-repeats", type=int, default=1, help="timed runs of the slow loop")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    torch.manual_seed(0)
    model = SimpleCNN().to(device)
    data = torch.randn(args.batch, 1, 28, 28, device=device)
    targets = torch.randint(10, (args.batch,), device=device)
    names = [n for n, _ in model.named_parameters()]

    hooks = gradhooks.add_hooks(model, loss_reduction="mean")

    def by_hooks():
        # As in a training loop: hooks added once; each step starts a fresh grad1 (whose
        # memory the backward reuses when nothing else holds it).
        model.zero_grad(set_to_none=True)
        hooks.clear()
        F.cross_entropy(model(data), targets).backward()

    def by_vmap():
        return vmap_grad(model, F.cross_entropy, data, targets)

    def by_loop():
        return loop_grad(model, F.cross_entropy, data, targets)

    by_hooks(), by_vmap()  # warm-up
    _, t_hooks = _timed(by_hooks, args.repeats, device)
    hooks.remove()
    hooked = {n: p.grad1 for n, p in model.named_parameters()}
    vmapped, t_vmap = _timed(by_vmap, args.repeats, device)
    looped, t_loop = _timed(by_loop, args.loop_repeats, device)

    def worst(other):
        diff = max((hooked[n] - other[n]).abs().max().item() for n in names)
        scale = max(other[n].abs().max().item() for n in names)
        return diff, diff / scale

    d_vmap, r_vmap = worst(vmapped)
    d_loop, r_loop = worst(looped)
    tol = 1e-4 if data.dtype == torch.float32 else 1e-10
    ok = r_vmap < tol and r_loop < tol

    print(f"gradhooks {gradhooks.__version__}, torch {torch.__version__}, device {device}")
    print(f"SimpleCNN, batch {args.batch}: per-example gradients of {len(names)} parameters")
    print(f"({sum(p.numel() for p in model.parameters()) * args.batch:,} floats per batch)\n")
    print(f"| {'method':<18} | {'time (ms)':>10} | {'vs hooks':>8} | {'max |diff| vs hooks':>20} |")
    print(f"| {'-' * 18} | {'-' * 10}:| {'-' * 8}:| {'-' * 20}:|")
    print(f"| {'gradhooks hooks':<18} | {t_hooks * 1e3:>10.2f} | {1.0:>7.2f}x | {'':>20} |")
    print(
        f"| {'vmap(grad)':<18} | {t_vmap * 1e3:>10.2f} | {t_vmap / t_hooks:>7.2f}x | {d_vmap:>20.2e} |"
    )
    print(
        f"| {'per-example loop':<18} | {t_loop * 1e3:>10.2f} | {t_loop / t_hooks:>7.2f}x | {d_loop:>20.2e} |"
    )
    print()
    if ok:
        print(f"agree: largest difference is {max(r_vmap, r_loop):.1e} of the largest gradient")
        return 0
    print(f"DISAGREE: relative differences {r_vmap:.1e} (vmap), {r_loop:.1e} (loop) > {tol:.0e}")
    return 1


if __name__ == "__main__":
    sys.exit(main())

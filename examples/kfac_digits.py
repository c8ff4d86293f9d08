"""K-FAC (``gradhooks.KFAC``) against SGD and Adam on scikit-learn's bundled digits (8x8 images,
10 classes; no download).

    pip install torch==2.13.0 -e ".[examples]"
    python examples/kfac_digits.py [--epochs 5] [--out kfac_digits.png]

Every run trains the same network from the same start on the same batches. SGD and Adam run at
several learning rates each, and the best of each is compared (picked on the test set: that
favours them). K-FAC wraps SGD: every ``--every`` steps new Kronecker factors are estimated
(``gradhooks.kfac``: a separate forward, and a backward of labels sampled from the model, for
the Fisher), averaged into running factors and inverted; every step each weight's gradient (its
bias's as the last column) becomes ``(kron(G, A) + damping·I)⁻¹ grad`` before SGD steps.

Prints a line per epoch (every run's test accuracy), then K-FAC's gain over the best SGD and the
best Adam, and writes the training curves to ``--out``: the training loss against steps and
against wall time (K-FAC's steps cost more: its factors and their inverses), and the test
accuracy per epoch.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dp_sgd_digits import accuracy, load_digits_tensors, make_net  # noqa: E402

import gradhooks  # noqa: E402

SGD_LEARNING_RATES = (0.1, 0.3, 1.0)
ADAM_LEARNING_RATES = (1e-3, 3e-3, 1e-2)
KFAC_LEARNING_RATE, DAMPING = 0.05, 0.03


@dataclasses.dataclass
class Curve:
    """``loss``/``seconds``: per step, the batch's training loss and the wall time of the run's
    steps so far; ``accuracy``: per epoch (index 0: before training), the test accuracy."""

    loss: list[float] = dataclasses.field(default_factory=list)
    seconds: list[float] = dataclasses.field(default_factory=list)
    accuracy: list[float] = dataclasses.field(default_factory=list)

    def epoch_loss(self, steps_per_epoch: int) -> float:
        """The mean training loss over the last epoch."""
        last = self.loss[-steps_per_epoch:]
        return sum(last) / len(last)


def train(
    method: str, epochs: int, lr: float, every: int = 10, batch: int = 64, seed: int = 0
) -> Iterator[Curve]:
    """Trains with ``method`` ("SGD", "Adam" or "K-FAC"), yielding the curve so far after each
    epoch (and once before the first)."""
    torch.manual_seed(seed)
    (xtr, ytr), (xte, yte) = load_digits_tensors(seed)
    net = make_net()
    gen = torch.Generator().manual_seed(seed + 1)
    if method == "Adam":
        opt = torch.optim.Adam(net.parameters(), lr=lr)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=lr)
    if method == "K-FAC":
        opt = gradhooks.KFAC(
            net, opt, damping=DAMPING, decay=0.9, factors_every=every, inverse_every=every,
            generator=torch.Generator().manual_seed(seed + 2),
        )  # fmt: skip
    curve = Curve()
    curve.accuracy.append(accuracy(net, xte, yte))
    yield curve
    elapsed = 0.0  # the run's own steps: the runs are interleaved epoch by epoch
    for _ in range(epochs):
        perm = torch.randperm(len(ytr), generator=gen)
        for i in range(0, len(ytr) - batch + 1, batch):
            start = time.perf_counter()
            idx = perm[i : i + batch]
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(net(xtr[idx]), ytr[idx])
            loss.backward()
            if method == "K-FAC":
                opt.step(xtr[idx])
            else:
                opt.step()
            curve.loss.append(loss.item())
            elapsed += time.perf_counter() - start
            curve.seconds.append(elapsed)
        curve.accuracy.append(accuracy(net, xte, yte))
        yield curve


def plot(curves: dict[str, Curve], best: tuple[str, ...], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # a file, no window
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for label, curve in curves.items():
        style = {"linewidth": 2.0} if label in best else {"alpha": 0.35, "linewidth": 1.0}
        axes[0].plot(range(1, len(curve.loss) + 1), curve.loss, label=label, **style)
        axes[1].plot(curve.seconds, curve.loss, label=label, **style)
        axes[2].plot(range(len(curve.accuracy)), curve.accuracy, marker="o", label=label, **style)
    axes[0].set(xlabel="step", ylabel="training loss (batch)", yscale="log")
    axes[1].set(xlabel="wall time (s)", ylabel="training loss (batch)", yscale="log")
    axes[2].set(xlabel="epoch", ylabel="test accuracy", ylim=(0, 1))
    axes[0].legend(fontsize="small")
    fig.suptitle("K-FAC (gradhooks.KFAC around SGD) against SGD and Adam on scikit-learn's digits")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Curve]:
    parser = argparse.ArgumentParser(
        description=__doc__.replace("``", ""), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=5, help="passes over the training set")
    parser.add_argument(
        "--every", type=int, default=10, help="steps between K-FAC factor estimates"
    )
    parser.add_argument(
        "--out", default="kfac_digits.png", help="where to write the plot (default: %(default)s)"
    )
    args = parser.parse_args(argv)

    runs = {f"SGD, lr {lr}": train("SGD", args.epochs, lr) for lr in SGD_LEARNING_RATES}
    runs |= {f"Adam, lr {lr}": train("Adam", args.epochs, lr) for lr in ADAM_LEARNING_RATES}
    runs["K-FAC"] = train("K-FAC", args.epochs, KFAC_LEARNING_RATE, every=args.every)
    print(f"test accuracy per epoch; K-FAC: SGD lr {KFAC_LEARNING_RATE}, damping {DAMPING}")
    for epoch in range(args.epochs + 1):
        curves = {label: next(run) for label, run in runs.items()}
        row = ", ".join(f"{label} {c.accuracy[-1]:.3f}" for label, c in curves.items())
        print(f"epoch {epoch:>2}/{args.epochs}: {row}", flush=True)

    kfac = curves["K-FAC"]
    steps = len(kfac.loss) // args.epochs
    print(f"\nafter {args.epochs} epochs, test accuracy, training loss and wall time:")
    print(
        f"  K-FAC: {kfac.accuracy[-1]:.3f}, {kfac.epoch_loss(steps):.3f}, {kfac.seconds[-1]:.2f} s"
    )
    best = ["K-FAC"]
    for name, rates in [("SGD", SGD_LEARNING_RATES), ("Adam", ADAM_LEARNING_RATES)]:
        runs_of = {label: c for label, c in curves.items() if label.startswith(name)}
        label = max(runs_of, key=lambda label: runs_of[label].accuracy[-1])
        base = runs_of[label]
        best.append(label)
        print(
            f"  {name}: {base.accuracy[-1]:.3f}, {base.epoch_loss(steps):.3f}, "
            f"{base.seconds[-1]:.2f} s (lr {label.split('lr ')[1]}, the best of "
            f"{', '.join(map(str, rates))} on the test set)"
        )
        gain = 100 * (kfac.accuracy[-1] - base.accuracy[-1])
        ratio = base.epoch_loss(steps) / kfac.epoch_loss(steps)
        loss = f"{ratio:.1f}x lower" if ratio >= 1 else f"{1 / ratio:.1f}x higher"
        print(
            f"K-FAC's gain over the best {name}: {gain:+.1f} percentage points of test "
            f"accuracy; its training loss is {loss}"
        )
    plot(curves, tuple(best), args.out)
    print(f"training curves: {os.path.abspath(args.out)}")
    return curves


if __name__ == "__main__":
    main()

"""K-FAC against plain SGD on scikit-learn's bundled digits (8x8 images, 10 classes; no
download).

    pip install torch==2.13.0 -e ".[examples]"
    python examples/kfac_digits.py [--epochs 5] [--out kfac_digits.png]

Both optimizers train the same network from the same start on the same batches. SGD runs at
several learning rates and the best is compared (picked on the test set: that favours SGD).
K-FAC: every ``--every`` steps the Kronecker factors are estimated with ``gradhooks.kfac`` (a
separate forward and a backward of labels sampled from the model: the Fisher), kept as a running
average and inverted once (``KFactors.inverse``); every step ``gradhooks.kfac_precondition``
replaces each weight's gradient, its bias's as the last column, by
``(kron(G, A) + damping·I)⁻¹ grad`` before the SGD step.

Prints a line per epoch (every run's test accuracy), then K-FAC's gain over the best SGD, and
writes the training curves (training loss and test accuracy per epoch) to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dp_sgd_digits import accuracy, load_digits_tensors, make_net  # noqa: E402

import gradhooks  # noqa: E402

SGD_LEARNING_RATES = (0.1, 0.3, 1.0)
KFAC_LEARNING_RATE, DAMPING = 0.05, 0.03


class KFACPreconditioner:
    """Keeps a running average of the K-FAC factors of ``net`` and its damped inverse."""

    def __init__(self, net: nn.Module, damping: float = DAMPING, decay: float = 0.9) -> None:
        self.net, self.damping, self.decay = net, damping, decay
        self.factors: dict[str, gradhooks.KFactors] = {}
        self.inverses: dict[str, gradhooks.KFactorsInverse] = {}

    def update(self, x: torch.Tensor, generator: torch.Generator) -> None:
        """New factors from the batch ``x`` (MC Fisher), averaged in, inverted once."""
        for name, new in gradhooks.kfac(self.net, x, fisher="mc", generator=generator).items():
            old = self.factors.get(name)
            if old is not None:
                new = dataclasses.replace(
                    new,
                    A=self.decay * old.A + (1 - self.decay) * new.A,
                    G=self.decay * old.G + (1 - self.decay) * new.G,
                )
            self.factors[name] = new
        self.inverses = {n: f.inverse(self.damping) for n, f in self.factors.items()}

    def precondition(self) -> None:
        """Every weight's (and bias's) ``.grad`` becomes ``(kron(G, A) + damping·I)⁻¹ grad``."""
        gradhooks.kfac_precondition(self.net, self.inverses)


@dataclasses.dataclass
class Curve:
    """Per epoch (index 0: before training): mean training loss, test accuracy."""

    loss: list[float] = dataclasses.field(default_factory=list)
    accuracy: list[float] = dataclasses.field(default_factory=list)


def train(
    kfac: bool, epochs: int, lr: float, every: int = 10, batch: int = 64, seed: int = 0
) -> Iterator[Curve]:
    """Trains, yielding the curve so far after each epoch (and once before the first)."""
    torch.manual_seed(seed)
    (xtr, ytr), (xte, yte) = load_digits_tensors(seed)
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed + 1)
    pre = KFACPreconditioner(net) if kfac else None
    curve = Curve()
    with torch.no_grad():
        curve.loss.append(F.cross_entropy(net(xtr), ytr).item())
    curve.accuracy.append(accuracy(net, xte, yte))
    yield curve
    step = 0
    for _ in range(epochs):
        perm = torch.randperm(len(ytr), generator=gen)
        losses = []
        for i in range(0, len(ytr) - batch + 1, batch):
            idx = perm[i : i + batch]
            if pre is not None and step % every == 0:
                pre.update(xtr[idx], gen)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(net(xtr[idx]), ytr[idx])
            loss.backward()
            if pre is not None:
                pre.precondition()
            opt.step()
            losses.append(loss.item())
            step += 1
        curve.loss.append(sum(losses) / len(losses))
        curve.accuracy.append(accuracy(net, xte, yte))
        yield curve


def plot(curves: dict[str, Curve], best_sgd: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # a file, no window
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for label, curve in curves.items():
        style = {"linewidth": 2.5} if label in (best_sgd, "K-FAC") else {"alpha": 0.5}
        epochs = range(len(curve.loss))
        left.plot(epochs, curve.loss, marker="o", label=label, **style)
        right.plot(epochs, curve.accuracy, marker="o", label=label, **style)
    left.set(xlabel="epoch", ylabel="training loss (mean over the epoch)", yscale="log")
    right.set(xlabel="epoch", ylabel="test accuracy", ylim=(0, 1))
    left.legend()
    fig.suptitle("K-FAC (gradhooks.kfac_precondition) against SGD on scikit-learn's digits")
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

    runs = {f"SGD, lr {lr}": train(False, args.epochs, lr) for lr in SGD_LEARNING_RATES}
    runs["K-FAC"] = train(True, args.epochs, KFAC_LEARNING_RATE, every=args.every)
    print(f"test accuracy per epoch; K-FAC: lr {KFAC_LEARNING_RATE}, damping {DAMPING}")
    for epoch in range(args.epochs + 1):
        curves = {label: next(run) for label, run in runs.items()}
        row = ", ".join(f"{label} {c.accuracy[-1]:.3f}" for label, c in curves.items())
        print(f"epoch {epoch:>2}/{args.epochs}: {row}", flush=True)

    sgd = {label: c for label, c in curves.items() if label.startswith("SGD")}
    best = max(sgd, key=lambda label: sgd[label].accuracy[-1])
    kfac, base = curves["K-FAC"], sgd[best]
    lr_list = ", ".join(map(str, SGD_LEARNING_RATES))
    print(f"\nafter {args.epochs} epochs, test accuracy and training loss:")
    print(f"  K-FAC: {kfac.accuracy[-1]:.3f}, {kfac.loss[-1]:.3f}")
    best_lr = best.removeprefix("SGD, lr ")
    print(
        f"  SGD:   {base.accuracy[-1]:.3f}, {base.loss[-1]:.3f} (lr {best_lr}, the best of "
        f"{lr_list} on the test set)"
    )
    gain = 100 * (kfac.accuracy[-1] - base.accuracy[-1])
    ratio = base.loss[-1] / kfac.loss[-1]
    loss = f"{ratio:.1f}x lower" if ratio >= 1 else f"{1 / ratio:.1f}x higher"
    print(
        f"K-FAC's gain over the best SGD: {gain:+.1f} percentage points of test accuracy; "
        f"its training loss is {loss}"
    )
    reached = next((e for e, a in enumerate(kfac.accuracy) if a >= base.accuracy[-1]), None)
    if reached is not None:
        print(
            f"K-FAC reached the best SGD's final accuracy after {reached} of {args.epochs} epochs"
        )
    plot(curves, best, args.out)
    print(f"training curves: {os.path.abspath(args.out)}")
    return curves


if __name__ == "__main__":
    main()

"""DP-SGD on scikit-learn's bundled digits (8x8 images, 10 classes; no download), against
non-private training of the same network, with the privacy spent and a plot.

    pip install torch==2.13.0 -e ".[examples,dp]"
    python examples/dp_sgd_digits.py [--epochs 30] [--out dp_sgd_digits.png] [--quick]

The private run is one ``gradhooks.make_private(...)``: it owns the whole mechanism, so that
nothing in the loop can be wired wrong. Its batches come from ``private.batches()``, Poisson
sampled (each training example in each batch with probability batch / n_train, what the
privacy analysis assumes); ``private.backward(losses)`` clips each example's gradient (by
per-example norms: no per-example gradient is formed), ``private.step()`` adds the Gaussian
noise once, divides by the *expected* batch size and records the step in its accountant, and
``private.epsilon`` is the ε spent so far at δ = 1e-5 (Google's dp-accounting, the ``dp``
extra; without it the run says so and goes on without ε). The non-private run draws its
batches by Poisson sampling too (gradhooks.PoissonSampler) and averages over each batch. A line
per epoch gives the mean training loss, the test accuracy and ε; the plot (``--out``) shows the
private run's test accuracy against ε beside the non-private run's, and both against the
epochs.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import gradhooks

DELTA = 1e-5
DELTA_TEXT = "1e-5"


def load_digits_tensors(seed: int = 0):
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise SystemExit(
            'this example needs scikit-learn (its bundled digits): pip install "gradhooks[examples]"'
        ) from e

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0  # [n, 1, 8, 8]
    y = torch.tensor(data.target)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = x[perm], y[perm]
    n_train = int(0.8 * len(y))
    return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


def make_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2),  # 16x4x4
        nn.Flatten(), nn.Linear(16 * 4 * 4, 32), nn.Tanh(), nn.Linear(32, 10),
    )  # fmt: skip


def accuracy(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (net(x).argmax(1) == y).float().mean().item()


def accountant_available() -> str | None:
    """None if ε can be computed, else why not (the error that names the extra)."""
    try:
        gradhooks.PrivacyAccountant().epsilon(DELTA)
    except ImportError as e:
        return str(e)
    return None


@dataclass
class Run:
    """One training run, epoch by epoch (``epsilon`` empty when not private or not computed)."""

    private: bool
    loss: list[float] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    epsilon: list[float] = field(default_factory=list)
    steps: int = 0
    sample_rate: float = 0.0


def train(
    private: bool, epochs: int = 30, batch: int = 64, lr: float = 0.5, max_norm: float = 1.0,
    noise_multiplier: float = 1.0, seed: int = 0, with_epsilon: bool = False, log=None,
) -> Run:  # fmt: skip
    """Train on Poisson batches of ``batch`` examples in expectation; ``log(line)`` after each
    epoch (``round(n_train / batch)`` steps). With ``with_epsilon`` (needs the dp extra) the
    private run's ε is recorded too."""
    torch.manual_seed(seed)
    (xtr, ytr), (xte, yte) = load_digits_tensors(seed)
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    run = Run(private=private)

    def end_epoch(epoch: int, total: float, seen: int, epsilon: float | None) -> None:
        run.loss.append(total / max(seen, 1))
        run.accuracy.append(accuracy(net, xte, yte))
        line = (
            f"{'DP-SGD' if private else 'non-private':>11}  epoch {epoch:3d}/{epochs}  "
            f"loss {run.loss[-1]:.3f}  test accuracy {run.accuracy[-1]:.3f}"
        )
        if epsilon is not None:
            run.epsilon.append(epsilon)
            line += f"  ε {epsilon:.2f}"
        if log is not None:
            log(line)

    if not private:
        sampler = gradhooks.PoissonSampler(
            len(ytr), batch, generator=torch.Generator().manual_seed(seed + 1)
        )
        run.sample_rate = sampler.sample_rate
        for epoch in range(1, epochs + 1):
            total, seen = 0.0, 0
            for idx in sampler:
                if len(idx) == 0:
                    continue
                opt.zero_grad(set_to_none=True)
                losses = F.cross_entropy(net(xtr[idx]), ytr[idx], reduction="none")
                losses.mean().backward()
                opt.step()
                run.steps += 1
                total, seen = total + losses.sum().item(), seen + len(idx)
            end_epoch(epoch, total, seen, None)
        return run

    # the private run: make_private owns the batches, the clipping, the noise, the division
    # by the expected batch size, the accountant and the budget (epochs * round(n / batch)
    # steps); the generator seeds the batches and the noise (in earnest: leave it out, and
    # the seeds come from the OS's entropy)
    private_run = gradhooks.make_private(
        net, opt, TensorDataset(xtr, ytr), noise_multiplier=noise_multiplier, delta=DELTA,
        epochs=epochs, expected_batch_size=batch, max_grad_norm=max_norm,
        generator=torch.Generator().manual_seed(seed + 1),
    )  # fmt: skip
    run.sample_rate = private_run.sample_rate
    per_epoch = private_run.steps // epochs
    total, seen = 0.0, 0
    with private_run:  # (close(): the hooks off the model at the end)
        for xb, yb in private_run.batches():  # an empty batch too: its step is the noise alone
            losses = F.cross_entropy(net(xb), yb, reduction="none")
            private_run.backward(losses)
            private_run.step()  # (one physical batch per logical one: a step each time)
            total, seen = total + losses.sum().item(), seen + len(yb)
            if private_run.steps_taken % per_epoch == 0:
                epsilon = private_run.epsilon if with_epsilon else None
                end_epoch(private_run.steps_taken // per_epoch, total, seen, epsilon)
                total, seen = 0.0, 0
        run.steps = private_run.steps_taken
    return run


def plot(private: Run, plain: Run, out: str, args) -> str | None:
    """Write the figure to ``out``; None, or why no figure was written."""
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 'matplotlib is not installed: pip install "gradhooks[examples]"'
    epochs = range(1, len(private.accuracy) + 1)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    if private.epsilon:
        left.plot(
            private.epsilon, private.accuracy, "o-", ms=3, label="DP-SGD (one point per epoch)"
        )
        left.axhline(
            plain.accuracy[-1], color="k", ls="--", lw=1,
            label=f"non-private, after {len(plain.accuracy)} epochs (ε = ∞)",
        )  # fmt: skip
        for epoch in (1, 5, 10, 20, 30, 50, 100):
            if epoch <= len(private.epsilon):
                xy = (private.epsilon[epoch - 1], private.accuracy[epoch - 1])
                left.annotate(f"epoch {epoch}", xy, xytext=(4, -12), textcoords="offset points",
                              fontsize=8, color="C0")  # fmt: skip
        left.set_xlabel(f"ε spent (δ = {DELTA_TEXT}, RDP accountant)")
        left.set_xlim(left=0)
        left.legend(loc="lower right")
    else:
        why = 'ε not computed:\ndp-accounting is not installed\n(pip install "gradhooks[dp]")'
        left.text(0.5, 0.5, why, ha="center", va="center", transform=left.transAxes)
        left.set_xticks([])
    left.set_ylabel("test accuracy")
    left.set_title("test accuracy against the privacy spent")
    right.plot(epochs, private.accuracy, "o-", ms=3, label="DP-SGD")
    right.plot(range(1, len(plain.accuracy) + 1), plain.accuracy, "s-", ms=3, color="k",
               label="non-private")  # fmt: skip
    right.set_xlabel("epoch")
    right.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    right.set_ylabel("test accuracy")
    right.set_title("accuracy per epoch")
    right.legend(loc="lower right")
    for ax in (left, right):
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"digits, {private.steps} DP-SGD steps: Poisson batches ({args.batch} examples "
        f"expected, q = {private.sample_rate:.3f}), clip {args.max_norm}, noise multiplier "
        f"{args.noise_multiplier}"
    )
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return None


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64, help="expected batch size")
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--out", default="dp_sgd_digits.png", help="the plot (PNG)")
    parser.add_argument("--quick", action="store_true", help="2 epochs each (a smoke test)")
    args = parser.parse_args(argv)
    epochs = 2 if args.quick else args.epochs
    why_no_epsilon = accountant_available()
    if why_no_epsilon is not None:
        print(f"ε will not be computed: {why_no_epsilon}")
    log = lambda line: print(line, flush=True)
    start = time.perf_counter()
    plain = train(private=False, epochs=epochs, batch=args.batch, lr=0.1, log=log)
    private = train(
        private=True, epochs=epochs, batch=args.batch, max_norm=args.max_norm,
        noise_multiplier=args.noise_multiplier, with_epsilon=why_no_epsilon is None, log=log,
    )  # fmt: skip
    print(f"non-private test accuracy: {plain.accuracy[-1]:.3f}")
    eps = (
        f"ε = {private.epsilon[-1]:.2f} at δ = {DELTA_TEXT}"
        if private.epsilon
        else 'ε not computed: pip install "gradhooks[dp]"'
    )
    print(
        f"DP-SGD test accuracy:      {private.accuracy[-1]:.3f}  ({eps}; noise multiplier "
        f"{args.noise_multiplier}, clip {args.max_norm}, {private.steps} steps, sampling rate "
        f"{private.sample_rate:.4f})"
    )
    why_no_plot = plot(private, plain, args.out, args)
    print(f"plot: {args.out}" if why_no_plot is None else f"no plot: {why_no_plot}")
    print(f"took {time.perf_counter() - start:.0f} s")
    return {
        "plain": plain.accuracy[-1],
        "dp": private.accuracy[-1],
        "epsilon": private.epsilon[-1] if private.epsilon else None,
        "plot": None if why_no_plot else args.out,
    }


if __name__ == "__main__":
    main()

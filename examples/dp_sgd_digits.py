"""DP-SGD on scikit-learn's bundled digits (8x8 images, 10 classes; no download), against
non-private training of the same network.

    pip install scikit-learn
    python examples/dp_sgd_digits.py [--ghost] [--epochs 30]

Per-example clipping and noise by gradhooks.dp_sgd_step; privacy accounting (epsilon) is out of
scope: feed noise_multiplier, the sampling rate batch/len(train) and the number of steps to an
accountant such as Opacus' RDPAccountant (printed at the end when Opacus is installed).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import gradhooks


def load_digits_tensors(seed: int = 0):
    from sklearn.datasets import load_digits

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


def train(
    private: bool, epochs: int = 30, batch: int = 64, lr: float = 0.5, max_norm: float = 1.0,
    noise_multiplier: float = 1.0, ghost: bool = False, seed: int = 0,
):  # fmt: skip
    torch.manual_seed(seed)
    (xtr, ytr), (xte, yte) = load_digits_tensors(seed)
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.0)
    gen = torch.Generator().manual_seed(seed + 1)
    hooks = (
        gradhooks.add_hooks(net, quantities=("norms",) if ghost else ("grad1",))
        if private
        else None
    )
    steps = 0
    for _ in range(epochs):
        perm = torch.randperm(len(ytr), generator=gen)
        for i in range(0, len(ytr) - batch + 1, batch):
            idx = perm[i : i + batch]
            opt.zero_grad(set_to_none=True)
            losses = F.cross_entropy(net(xtr[idx]), ytr[idx], reduction="none")
            if private:
                gradhooks.dp_sgd_step(
                    hooks, losses, max_norm=max_norm, noise_multiplier=noise_multiplier,
                    generator=gen, reduction="mean",
                )  # fmt: skip
            else:
                losses.mean().backward()
            opt.step()
            steps += 1
    if hooks is not None:
        hooks.remove()
    return accuracy(net, xte, yte), steps, batch / len(ytr)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--ghost", action="store_true", help="ghost clipping (never forms grad1)")
    args = parser.parse_args(argv)
    plain_acc, _, _ = train(private=False, epochs=args.epochs, lr=0.1)
    dp_acc, steps, rate = train(
        private=True, epochs=args.epochs, ghost=args.ghost, max_norm=args.max_norm,
        noise_multiplier=args.noise_multiplier,
    )  # fmt: skip
    print(f"non-private test accuracy: {plain_acc:.3f}")
    print(f"DP-SGD test accuracy:      {dp_acc:.3f}  (noise {args.noise_multiplier}, "
          f"clip {args.max_norm}, {steps} steps, sampling rate {rate:.4f})")  # fmt: skip
    try:
        from opacus.accountants import RDPAccountant

        acc = RDPAccountant()
        acc.history = [(args.noise_multiplier, rate, steps)]
        print(f"epsilon at delta=1e-5 (Opacus RDP accountant): {acc.get_epsilon(1e-5):.2f}")
    except ImportError:
        pass
    return {"plain": plain_acc, "dp": dp_acc}


if __name__ == "__main__":
    main()

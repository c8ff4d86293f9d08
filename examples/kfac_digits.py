"""A K-FAC-preconditioned optimizer on scikit-learn's bundled digits (no download), against
plain SGD at the best of a few learning rates.

    pip install scikit-learn
    python examples/kfac_digits.py [--epochs 2]

Every ``--every`` steps the Kronecker factors are re-estimated with gradhooks.kfac (a separate
forward and a backward of labels sampled from the model: the Fisher), kept as a running average;
each step preconditions every weight's (bias-augmented) gradient by
``(G + λI)⁻¹ · grad · (A + λI)⁻¹`` before an SGD step.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dp_sgd_digits import accuracy, load_digits_tensors, make_net  # noqa: E402

import gradhooks  # noqa: E402


class KFACPreconditioner:
    """Replaces ``p.grad`` of every weight (and its bias) by the K-FAC natural gradient."""

    def __init__(self, net: nn.Module, damping: float = 0.1, decay: float = 0.9) -> None:
        self.net, self.damping, self.decay = net, damping, decay
        self.factors: dict[str, gradhooks.KFactors] = {}
        self.params = dict(net.named_parameters())

    def update(self, x: torch.Tensor, generator: torch.Generator) -> None:
        new = gradhooks.kfac(self.net, x, fisher="mc", generator=generator)
        for name, f in new.items():
            old = self.factors.get(name)
            if old is not None:
                f = gradhooks.KFactors(
                    self.decay * old.A + (1 - self.decay) * f.A,
                    self.decay * old.G + (1 - self.decay) * f.G, f.bias,
                )  # fmt: skip
            self.factors[name] = f

    def precondition(self) -> None:
        for name, f in self.factors.items():
            w = self.params[name]
            b = self.params.get(name.rsplit(".", 1)[0] + ".bias") if f.bias else None
            grad = w.grad.reshape(w.shape[0], -1)  # [out, in * kernel]
            if b is not None:
                grad = torch.cat([grad, b.grad[:, None]], 1)
            eye_a = torch.eye(f.A.shape[-1])
            eye_g = torch.eye(f.G.shape[-1])
            nat = torch.linalg.solve(f.G + self.damping * eye_g, grad)
            nat = torch.linalg.solve(f.A + self.damping * eye_a, nat.T).T
            if b is not None:
                b.grad.copy_(nat[:, -1])
                nat = nat[:, :-1]
            w.grad.copy_(nat.reshape(w.shape))


def train(kfac: bool, epochs: int, lr: float, every: int = 10, batch: int = 64, seed: int = 0):
    torch.manual_seed(seed)
    (xtr, ytr), (xte, yte) = load_digits_tensors(seed)
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed + 1)
    pre = KFACPreconditioner(net) if kfac else None
    step = 0
    for _ in range(epochs):
        perm = torch.randperm(len(ytr), generator=gen)
        for i in range(0, len(ytr) - batch + 1, batch):
            idx = perm[i : i + batch]
            if pre is not None and step % every == 0:
                pre.update(xtr[idx], gen)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(xtr[idx]), ytr[idx]).backward()
            if pre is not None:
                pre.precondition()
            opt.step()
            step += 1
    return accuracy(net, xte, yte)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)
    sgd = {lr: train(kfac=False, epochs=args.epochs, lr=lr) for lr in (0.1, 0.3, 1.0)}
    best = max(sgd, key=sgd.get)
    kfac = train(kfac=True, epochs=args.epochs, lr=0.05)
    print(
        f"SGD   test accuracy after {args.epochs} epochs: {sgd[best]:.3f} (best of lr {list(sgd)}: {best})"
    )
    print(f"K-FAC test accuracy after {args.epochs} epochs: {kfac:.3f} (lr 0.05, damping 0.1)")
    sgd = sgd[best]
    return {"sgd": sgd, "kfac": kfac}


if __name__ == "__main__":
    main()

"""The models every quantity (norms, DP-SGD, K-FAC, squared sums, Jacobians) is tested on.

One list, keyed by the layer type each case exercises: when a rule for a new layer type is
registered, add a case for it here (``test_every_registered_layer_has_a_quantity_case`` fails
until then) and every quantity is tested on it.
"""

from __future__ import annotations

import torch
from torch import nn

from harness import Case, cross_entropy_sum


class Reused(nn.Module):
    """One Linear called twice in a forward (cross terms between the calls)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(torch.tanh(self.fc(x)))))


class ReusedSeq(nn.Module):
    """A Linear reused on a sequence: Gram-form cross terms with several shared positions."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):  # [batch, 3, 8]
        return self.head(torch.tanh(self.fc(torch.tanh(self.fc(x)))).mean(1))


class Tied(nn.Module):
    """A weight shared by two modules (cross terms between users)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(5, 3)
        self.mid = nn.Linear(3, 5)
        self.dec = nn.Linear(5, 3)
        self.dec.weight = self.enc.weight

    def forward(self, x):
        return self.dec(torch.tanh(self.mid(torch.tanh(self.enc(x)))))


class SmallConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 3, stride=2, groups=2)
        self.fc = nn.Linear(4 * 2 * 2, 3)

    def forward(self, x):  # [batch, 2, 6, 6]
        h = torch.tanh(self.conv2(torch.tanh(self.conv1(x))))
        return self.fc(h.flatten(1))


def _seq(*layers):
    return lambda: nn.Sequential(*layers)


# {layer type: cases}; every case's output is [batch, outputs] (Jacobians, K-FAC need that)
CASES_BY_LAYER: dict[type, list[Case]] = {
    nn.Linear: [
        Case(
            "mlp",
            lambda: nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)),
            lambda b: torch.randn(b, 6),
        ),
        Case(
            "mlp_ce",
            lambda: nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)),
            lambda b: torch.randn(b, 6),
            lambda b: torch.randint(3, (b,)),
            cross_entropy_sum,
        ),
        Case(
            "linear_seq_gram",
            lambda: nn.Sequential(nn.Linear(8, 8), nn.Flatten()),
            lambda b: torch.randn(b, 2, 8),
        ),
        Case(
            "linear_seq_materialize",
            lambda: nn.Sequential(nn.Linear(5, 3), nn.Flatten()),
            lambda b: torch.randn(b, 6, 5),
        ),
        Case("reused_linear", Reused, lambda b: torch.randn(b, 4)),
        Case("reused_linear_seq", ReusedSeq, lambda b: torch.randn(b, 3, 8)),
        Case("tied_linear", Tied, lambda b: torch.randn(b, 5)),
    ],  # fmt: skip
    nn.Conv2d: [
        Case(
            "conv_net",
            SmallConvNet,
            lambda b: torch.randn(b, 2, 6, 6),
            lambda b: torch.randint(3, (b,)),
            cross_entropy_sum,
        ),
        Case(
            "conv_gram", _seq(nn.Conv2d(3, 8, 3), nn.Flatten()), lambda b: torch.randn(b, 3, 4, 4)
        ),
        Case(
            "reused_conv",
            _seq(*[nn.Conv2d(2, 2, 3, padding=1)] * 2, nn.Flatten()),
            lambda b: torch.randn(b, 2, 3, 3),
        ),
    ],  # fmt: skip
    nn.Conv1d: [
        Case(
            "conv1d",
            _seq(nn.Conv1d(2, 3, 2, dilation=2), nn.Flatten()),
            lambda b: torch.randn(b, 2, 5),
        ),
    ],
    nn.Conv3d: [
        Case(
            "conv3d", _seq(nn.Conv3d(1, 2, 2), nn.Flatten()), lambda b: torch.randn(b, 1, 3, 3, 2)
        ),
    ],
}

CASES = [case for cases in CASES_BY_LAYER.values() for case in cases]

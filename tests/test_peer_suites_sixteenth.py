"""A sixteenth set of the cases that other projects check in their own test suites, written in
gradhooks' terms and compared with float64 references (per-example loops of autograd and
:mod:`gradhooks.oracle`).

Found and fixed: a module's own parameters given to ``F.linear`` in its ``forward`` on a
sequence, whose output the next line changes in place (``result += ...``), had no ``grad1`` (a
warning said no forward was captured, and the DP step refused them): the output of ``F.linear``
on ``[batch, seq, in]`` is a view, and an in-place change drops a view's gradient hooks.
gradhooks now hooks that output as it hooks a layer's, as a tensor of its own.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_grad1, one_thread, seeded  # noqa: F401

D = torch.float64


class LinearPlusInPlace(nn.Module):
    """The engine case behind loralib's layer: parameters of the module itself in
    ``F.linear`` (its ``forward`` hooked as the Linear rule's call), whose output on a
    sequence is a view, changed in place by the next line."""

    def __init__(self, change):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(3))
        self.other = nn.Parameter(torch.randn(3, 4))
        self.change = change

    def forward(self, x):
        out = F.linear(x, self.weight, self.bias)
        return self.change(out, x @ self.other.T)


def add_(out, d):
    out += d
    return out


def mul_(out, d):
    out *= d
    return out


def tanh_(out, d):
    return out.tanh_() + d


def slice_mul_(out, d):
    out[..., :2] *= 3
    return out + d


@pytest.mark.parametrize(
    "change", [add_, mul_, tanh_, slice_mul_], ids=["add_", "mul_", "tanh_", "slice_mul_"]
)
@pytest.mark.parametrize("shape", [(5, 4), (5, 6, 4)], ids=["flat", "sequence"])
def test_f_linear_output_changed_in_place(shape, change):
    """A parameter's ``F.linear`` whose output the forward changes in place (``+=``, ``*=``,
    ``tanh_``, ``*=`` on a slice of it): on ``[batch, in]`` and on ``[batch, 6, in]``, whose
    output is a view, every parameter's ``grad1`` is the loop's (on the sequence the weight's
    and bias's were missing, with a warning, and the DP step refused them)."""
    model = seeded(lambda: LinearPlusInPlace(change)).double()
    x = torch.randn(*shape, dtype=D)
    want = loop_grad(model, lambda out: out.square().sum(), x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        model(x).square().sum().backward()
    assert_grad1(model, want, f"{change.__name__} on {shape}")

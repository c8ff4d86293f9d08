"""Vision models of timm, vit-pytorch and x-transformers through ``bench.timm_sweep``, and the
fixes the sweep led to.

Each model is made small, in float64 and training mode without dropout or drop-path; its
``grad1`` must equal, parameter by parameter, each example's own gradient by a loop of batches
of one (``rtol=1e-7``; ``1e-4`` where the model computes in float32 inside, which the sweep
measures and says). With BatchNorm layers in training mode (``train``), the examples are
coupled and gradhooks must refuse; with them in eval mode (``bn-eval``), it must match.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from tests.harness import Case, check, cross_entropy_sum

timm_sweep = pytest.importorskip("bench.timm_sweep")


def _library(name: str):
    try:
        if name == "timm":
            return timm_sweep.import_timm()
        return timm_sweep.import_vision(name)
    except ImportError as e:
        pytest.skip(f"{name} is not installed: {e}")
    except Exception as e:  # noqa: BLE001 (a build whose C extensions do not load here)
        pytest.skip(f"{name} does not import with this torch: {type(e).__name__}: {e}")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        yield


# -- recurrent cells on rows that fold the examples with tokens ----------------------------------


class GatedResidual(nn.Module):
    """x-transformers' ``GRUGating``: a recurrent cell run on every token at once, the tokens
    folded into its rows (``[(batch tokens), features]``)."""

    def __init__(self, cell: nn.Module):
        super().__init__()
        self.cell = cell

    def forward(self, x, residual):
        rows = x.flatten(0, 1), residual.flatten(0, 1)
        state = (rows[1], rows[1]) if isinstance(self.cell, nn.LSTMCell) else rows[1]
        out = self.cell(rows[0], state)
        return (out[0] if isinstance(out, tuple) else out).reshape_as(x)


class Gated(nn.Module):
    def __init__(self, cell, dim: int = 8, depth: int = 2):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.gates = nn.ModuleList(GatedResidual(cell(dim, dim)) for _ in range(depth))
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        for lin, gate in zip(self.lins, self.gates):
            x = gate(torch.tanh(lin(x)), x)
        return self.head(x.mean(1))


@pytest.mark.parametrize(
    "cell, reduction",
    [(nn.GRUCell, "mean"), (nn.LSTMCell, "sum"), (nn.RNNCell, "sum")],
    ids=["GRUCell", "LSTMCell", "RNNCell"],
)
def test_recurrent_cell_on_folded_rows_matches_the_loop(cell, reduction):
    """A cell's outputs keep its input's rows: the second gated layer reads the examples from
    them (the tracker lost them at the first cell, and refused the second)."""
    case = Case(
        f"gated {cell.__name__}",
        lambda: Gated(cell),
        lambda n: torch.randn(n, 4, 8),
        lambda n: torch.arange(n) % 3,
        cross_entropy_sum,
    )
    check(case, batch=3, reduction=reduction)

"""Vision models of timm, vit-pytorch and x-transformers through ``bench.timm_sweep``, and the
fixes the sweep led to.

Each model is made small, in float64 and training mode without dropout or drop-path; its
``grad1`` must equal, parameter by parameter, each example's own gradient by a loop of batches
of one (``rtol=1e-7``; ``1e-4`` where the model computes in float32 inside, which the sweep
measures and says). With BatchNorm layers in training mode (``train``), the examples are
coupled and gradhooks must refuse; with them in eval mode (``bn-eval``), it must match.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

from harness import Case, check, cross_entropy_sum

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


# -- a fallback on rows in both layouts at once ----------------------------------------------------

CHANNELS_LAST_ROWS = """
import torch, gradhooks
import torch.nn.functional as F
from torch import nn
from gradhooks.oracle import loop_grad

class GroupNorm1NoBias(nn.GroupNorm):  # (timm's metaformer: a forward of its own, no rule)
    def __init__(self, channels):
        super().__init__(1, channels)
        self.bias = None

    def forward(self, x):
        return F.group_norm(x, 1, self.weight, None, self.eps)

class Head(nn.Module):  # a pooled [batch, 1, 1, features] made channels-first by a permute
    def __init__(self):
        super().__init__()
        self.lin, self.norm, self.out = nn.Linear(4, 8), GroupNorm1NoBias(8), nn.Linear(8, 3)

    def forward(self, x):
        return self.out(self.norm(self.lin(x).permute(0, 3, 1, 2)).flatten(1))

torch.manual_seed(0)
model = Head().double()
x, y = torch.randn(3, 1, 1, 4, dtype=torch.float64), torch.tensor([0, 2, 1])
loss = lambda out, y: F.cross_entropy(out, y, reduction="sum")
want = loop_grad(model, loss, x, y)
with gradhooks.add_hooks(model, loss_reduction="sum"):
    loss(model(x), y).backward()
print(max(float((p.grad1 - want[n]).abs().max()) for n, p in model.named_parameters()))
"""


def test_fallback_on_rows_of_a_channels_last_batch_runs():
    """The fallback's loop runs each example's row of ``[batch, C, 1, 1]`` in channels-last
    strides, which is both layouts at once: torch's group_norm backward read it wrong, to a
    segmentation fault (in a child process here, so that it cannot end the tests)."""
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    done = subprocess.run([sys.executable, "-c", CHANNELS_LAST_ROWS], capture_output=True,
                          text=True, timeout=300, cwd=root)  # fmt: skip
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert float(done.stdout.split()[-1]) < 1e-12


# -- the sweep's reference -----------------------------------------------------------------------


class TokensAfterBatchNorm(nn.Module):
    """LeViT's stem: BatchNorm (eval mode) whose output becomes tokens by a transpose."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(3).eval()
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        return self.head(self.bn(x).flatten(2).transpose(1, 2).mean(1))


def test_reference_is_vmap_where_the_loop_of_batches_of_one_is_wrong():
    """torch's BatchNorm backward in eval mode is wrong for a batch of one whose
    output-gradient has the strides the transpose gives it (not for the batch): the loop of
    batches of one does not sum to the batched gradient, vmap(grad) does, and the sweep
    compares grad1 with vmap(grad) instead of calling a right grad1 a mismatch."""
    torch.manual_seed(0)
    model = TokensAfterBatchNorm().double()
    x, y = torch.randn(3, 3, 2, 2, dtype=torch.float64), torch.tensor([0, 2, 1])
    params = list(model.named_parameters())
    loop = timm_sweep.loop_grad(model, timm_sweep.summed_loss, x, y)
    vmap = timm_sweep.vmap_grad(model, timm_sweep.summed_loss, x, y)
    res = timm_sweep.SweepResult("test")
    assert timm_sweep.hooked_backward(
        res, model, lambda: timm_sweep.summed_loss(model(x), y), "sum"
    )
    want = timm_sweep._reference(res, model, params, loop, x, y)
    assert want is not loop and "vmap(grad)" in res.detail
    timm_sweep.compare(res, params, want, timm_sweep.RTOL)
    assert res.outcome == "match", res.detail
    assert not torch.allclose(loop["bn.bias"], vmap["bn.bias"])  # (the loop is the wrong one)


# -- timm ---------------------------------------------------------------------------------------


@pytest.fixture
def one_thread():
    """One thread, as the sweep runs: tiny models gain nothing from more, and lose much on a
    shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# (model, the kwargs that make it small, mode): one per family, each of a kind the others are
# not. ``train`` for models without BatchNorm; ``bn-eval`` (BatchNorm frozen) for those with.
TIMM = [
    ("test_resnet", {}, "bn-eval"),  # residual blocks, max pooling
    ("test_efficientnet", {}, "bn-eval"),  # depthwise convolutions, squeeze-excitation, SiLU
    ("mobilenetv3_small_050", {}, "bn-eval"),  # hard-swish, hard-sigmoid gates
    ("test_convnext", {}, "train"),  # LayerNorm over channels, layer scale
    ("test_vit", {}, "train"),  # class token, fused qkv
    ("test_byobnet", {}, "bn-eval"),  # bring-your-own blocks
    ("test_nfnet", {}, "train"),  # scaled weight standardization, no normalization layer
    ("test_coatnet", {}, "bn-eval"),  # MBConv and relative-position attention
    ("test_mambaout", {}, "train"),  # gated convolutions
    ("test_vit_relpos", {}, "train"),  # relative position biases
    ("regnetx_002", {}, "bn-eval"),  # grouped convolutions
    ("mobilevit_xxs", {}, "bn-eval"),  # convolutions unfolded into patches for attention
    ("edgenext_xx_small", {}, "train"),  # split depthwise-transposed attention
    (
        "swin_tiny_patch4_window7_224",
        dict(embed_dim=16, depths=(1, 1), num_heads=(2, 2), window_size=4),
        "train",
    ),  # shifted windows
    ("levit_128s", dict(depth=(1, 1, 1)), "bn-eval"),  # BatchNorm1d in linear layers
    ("pvt_v2_b0", dict(depths=(1, 1, 1, 1)), "train"),  # spatial-reduction attention
    ("vit_tiny_patch16_dinov3_qkvb", dict(depth=2), "train"),  # eva: rotary, registers
]


@pytest.mark.parametrize("name, kw, mode", TIMM, ids=[m[0] for m in TIMM])
def test_timm_model_matches_the_loop(name, kw, mode, one_thread):
    _library("timm")
    res = timm_sweep.check(name, mode, limit=0, **kw)
    assert res.outcome == "match", (res.outcome, res.detail)
    assert res.params > 0 and not res.warnings


def test_timm_batchnorm_in_train_mode_is_refused(one_thread):
    """BatchNorm normalising by the batch couples the examples: no per-example gradient."""
    _library("timm")
    res = timm_sweep.check("test_resnet", "train", limit=0)
    assert res.outcome == "refused", (res.outcome, res.detail)
    assert res.detail.startswith("MixedExamplesError") and "BatchNorm2d" in res.detail


def test_sweep_runs_and_writes_its_table(tmp_path, capsys):
    _library("timm")
    threads = torch.get_num_threads()
    try:
        assert timm_sweep.main(["--models", "test_resnet,test_vit", "--out", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(threads)
    data = json.loads((tmp_path / "timm-sweep.json").read_text())
    rows = {(r["model"], r["task"]): r["outcome"] for r in data["results"]}
    assert rows == {
        ("test_resnet", "train"): "refused",
        ("test_resnet", "bn-eval"): "match",
        ("test_vit", "train"): "match",
    }
    assert data["counts"]["train"] == {
        "match": 1, "refused": 1, "mismatch": 0, "crash": 0, "skipped": 0
    }  # fmt: skip
    table = (tmp_path / "timm-sweep.md").read_text()
    assert "| resnet | test_resnet | bn-eval |" in table
    assert "train: 1 match, 1 refused" in capsys.readouterr().out


# -- vit-pytorch and x-transformers -------------------------------------------------------------


@pytest.mark.parametrize(
    "library, name",
    [("vit-pytorch", "SimpleViT"), ("vit-pytorch", "CvT"), ("vit-pytorch", "LeViT"),
     ("vit-pytorch", "XCiT"), ("x-transformers", "rotary+gated"),
     ("x-transformers", "residual+sandwich")],
)  # fmt: skip
def test_other_library_matches_the_loop(library, name, one_thread):
    _library(library.replace("-", "_"))
    res = timm_sweep._modes(lambda mode: timm_sweep.check_other(library, name, mode, limit=0))
    want = ["refused", "match"] if len(res) == 2 else ["match"]
    assert [r.outcome for r in res] == want, [(r.outcome, r.detail) for r in res]


def test_sweep_counts_a_segmentation_fault_as_one_models_crash():
    """Each model runs in a forked child: one that ends by a signal is a crash, and the sweep
    goes on."""
    import os
    import signal

    def dies(mode):
        os.kill(os.getpid(), signal.SIGSEGV)

    (res,) = timm_sweep._modes(dies, isolated=True)
    assert (res.outcome, res.detail) == ("crash", "the process ended by signal SIGSEGV")
    ok = timm_sweep._modes(lambda mode: timm_sweep.SweepResult("f", mode, "m", "match"), True)
    assert [(r.task, r.outcome) for r in ok] == [("train", "match")]

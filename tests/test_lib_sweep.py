"""Models of pure-Python libraries (x-transformers, diffusers, perceiver-pytorch, ...) against
the per-example loop, through ``bench.lib_sweep``: each built as its users build it, tiny, in
float64 and training mode (dropout 0), whose ``grad1`` must equal, parameter by parameter,
each example's own gradient by a loop of batches of one (``rtol=1e-7``). A model whose library
is not installed is skipped. Also the layers these libraries use in ways the other tests do
not (recurrent cells on rows folded from batch and time), in plain torch."""

from __future__ import annotations

import importlib.util
import json
import warnings

import pytest
import torch
from einops import rearrange
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import Case, check, corrupting

lib_sweep = pytest.importorskip("bench.lib_sweep")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


def _needs(name: str):
    library = lib_sweep.CASES[name].library
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is not installed")


def _swept(name: str):
    _needs(name)
    res = lib_sweep.check(name, limit=0)
    if res.outcome == "skipped":
        pytest.skip(res.detail)
    return res


# -- recurrent cells on folded rows -------------------------------------------------------------


class GatedResidual(nn.Module):
    """x-transformers' ``GRUGating``: a cell over every position, batch and time folded into
    the cell's rows (``b n d -> (b n) d``), after a Linear, twice: the second cell's input is
    the first's output."""

    def __init__(self, cell: type[nn.RNNCellBase]):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.first, self.second = cell(4, 4), cell(4, 4)

    def _cell(self, cell, x, state):
        rows = rearrange(x, "b n d -> (b n) d")
        h = rearrange(state, "b n d -> (b n) d")
        out = cell(rows, (h, h) if isinstance(cell, nn.LSTMCell) else h)
        return (out[0] if isinstance(out, tuple) else out).reshape_as(x)

    def forward(self, x):
        y = self._cell(self.first, self.lin(x), x)
        return self._cell(self.second, self.lin(y), y)


@pytest.mark.parametrize("cell", [nn.GRUCell, nn.LSTMCell, nn.RNNCell], ids=lambda c: c.__name__)
def test_recurrent_cell_on_folded_rows_matches_the_loop(cell):
    """The output of a cell keeps its rows' layout: the next layer finds the batch in it."""
    check(
        Case(f"folded-{cell.__name__}", lambda: GatedResidual(cell), lambda b: torch.randn(b, 5, 4))
    )


class FoldedWithInitialState(nn.Module):
    """A cell on folded rows whose state holds no example: zeros made for the rows, and a
    learned initial state expanded to them."""

    def __init__(self):
        super().__init__()
        self.lin, self.cell = nn.Linear(4, 4), nn.GRUCell(4, 4)
        self.h0 = nn.Parameter(torch.randn(4))

    def forward(self, x):
        rows = rearrange(self.lin(x), "b n d -> (b n) d")
        zeros = torch.zeros(rows.shape[0], 4, dtype=x.dtype)
        learned = self.h0.expand(rows.shape[0], 4)
        return (self.cell(rows, zeros) + self.cell(rows, learned)).reshape_as(x)


def test_recurrent_cell_on_folded_rows_with_a_state_of_no_example():
    """The rule's input comes regrouped ``[batch, time, in]``, its state as given: the same
    for every row, it is broadcast to them. (Against the loop only: under vmap the zeros would
    be made for one example's rows.)"""
    torch.manual_seed(0)
    model = FoldedWithInitialState().double()
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    want = loop_grad(model, lambda out: out.pow(2).sum(), x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        model(x).pow(2).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad1, want[name], rtol=1e-7, atol=1e-9, msg=name)


def test_recurrent_cell_with_a_state_from_other_rows_is_refused():
    """A state whose rows are not the input's (the batch reversed): no layout is claimed."""

    class Crossed(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.cell = nn.Linear(4, 4), nn.GRUCell(4, 4)

        def forward(self, x):
            h = self.cell(x, x.flip(0))
            return self.lin(h)

    model = Crossed().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(gradhooks.GradhooksError), gradhooks.add_hooks(model):
        model(x).sum().backward()


@pytest.mark.parametrize("cell", [nn.GRUCell, nn.LSTMCell, nn.RNNCell], ids=lambda c: c.__name__)
def test_recurrent_cell_on_folded_rows_under_bf16_autocast(cell):
    """The cells' own rule: the fallback, recomputing a cell one example at a time, found that
    under bfloat16 autocast (bfloat16 matmuls, a float32 output) a batch and one example round
    apart by more than float32's tolerance, and refused (MixedExamplesError)."""
    torch.manual_seed(0)
    model = GatedResidual(cell)
    x = torch.randn(3, 5, 4)
    want = loop_grad(model.double(), lambda out: out.pow(2).sum(), x.double())
    model.float()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        out.float().pow(2).sum().backward()
    for name, p in model.named_parameters():
        err = (p.grad1.double() - want[name]).abs().max() / want[name].abs().max()
        assert err < lib_sweep.sweep.BF16_TOL, (name, float(err))


# -- models of the libraries --------------------------------------------------------------------

# One model per kind, each of a kind the hand-written tests do not build.
MODELS = [
    "xt-rotary",  # x-transformers: rotary positions
    "xt-alibi",  # ALiBi biases
    "xt-gate-residual",  # GRU gating of the residual (a GRUCell over batch * time rows)
    "xt-memory-tokens",  # memory tokens concatenated to every example
    "xt-continuous",  # ContinuousTransformerWrapper, a regression
    "xt-hyper-connections",  # parameters used in a method of a residual besides its forward
    "xt-xtransformer",  # encoder-decoder, tied token embeddings
    "perceiver",  # cross-attention to Fourier-encoded pixels, latents shared by the batch
    "performer-lm",  # FAVOR+ random features (a buffer)
    "mlp-mixer",  # token-mixing Linear across patches
    "rotary-embedding-xpos",  # learned rotary frequencies, xpos scales
    "unet2d",  # diffusers: DDPM loss, a timestep per example, GroupNorm, attention
    "dit",  # adaptive LayerNorm from timestep and class embeddings
    "tab-ft-transformer",  # tabular: categorical and numeric tokens, hyper-connections
    "rtdl-ft-linformer",  # a Linear along the tokens (Linformer key compression)
    "linformer-lm",  # parameters used directly in an einsum along the sequence
    "reformer-lm",  # LSH attention, reversible layers recomputed in the backward
    "mamba-pscan",  # a selective scan in an autograd.Function of its own
    "vq-vae-ema",  # an EMA codebook updated in the forward, the library's commitment loss
    "zuko-nsf",  # a normalizing flow: rational-quadratic splines, searchsorted
    "kan",  # pykan: B-spline activations on every edge
    "neural-ode-rk4",  # torchdiffeq, fixed steps
    "conformer-causal",  # depthwise convolutions without BatchNorm
    "routing-lm",  # k-means routing; memory slots of no entries (num_mem_kv=0)
    "e3nn-tensor-product",  # equivariant tensor products of generated code
    "soft-moe",  # experts moved to their device (module.to) in every forward
    "monai-unetr",  # InstanceNorm, a ViT encoder's tokens to a convolutional decoder
    "ddpm-unet",  # GaussianDiffusion.p_losses, the batch's loss returned by the library
    "kornia-stn",  # affine warps predicted per example (grid sampling)
    "pyg-dense-gcn",  # graphs padded to one size, dense adjacency and node mask
    "ncps-ltc",  # liquid time-constant cells, a sparse wiring mask
    "tcn",  # weight_norm parametrizations, causal dilated convolutions
    "normflows-realnvp-module",  # ActNorm's log-determinant added in place into log_q
    "pkm",  # product keys: top-k, an EmbeddingBag with per-sample weights
    "mega-lm",  # attention weights by torch.special.erf, a T5 position bias added after
    "spikingjelly-plif",  # multi-step layers on time and batch folded, learned time constants
    "neural-sde",  # torchsde: diffusion and drift networks, a Brownian path given per example
]


@pytest.mark.parametrize("name", MODELS)
def test_library_model_matches_the_loop(name):
    assert_swept_match(name)


def assert_swept_match(name: str) -> None:
    """The sweep's model ``name`` matches the loop, with trainable parameters, without warnings."""
    res = _swept(name)
    assert res.outcome == "match", (res.outcome, res.detail)
    assert res.params > 0 and not res.warnings


@pytest.mark.parametrize(
    "name, error",
    [
        ("conformer", gradhooks.MixedExamplesError),  # BatchNorm1d in training mode
        ("rtdl-resnet", gradhooks.MixedExamplesError),  # (its batch of one cannot even run)
        ("nystromformer", gradhooks.MixedExamplesError),  # the pseudo-inverse's max over the batch
        ("neural-ode-dopri5", gradhooks.MixedExamplesError),  # steps chosen by the batch's error
        ("neural-ode-adjoint", gradhooks.UnsupportedError),  # gradients by a nested backward
        ("axial-image-transformer", gradhooks.BatchNotFoundError),  # folded rows, rerun
        ("pyg-gcn", gradhooks.MixedExamplesError),  # graphs' nodes concatenated: no batch
        ("normflows-nsf", gradhooks.UnsupportedInputError),  # a log-determinant of no example
        ("geoopt-poincare", gradhooks.UnsupportedError),  # the batch met in TorchScript
        ("arcface-loss", gradhooks.UnsupportedInputError),  # the batch's mean, in the module
    ],
)
def test_library_model_refused(name, error):
    """Models whose examples meet (a statistic of the batch, a step size chosen for all of
    them) or whose gradients gradhooks cannot split by example: refused, by gradhooks' own
    error, naming the layer, never a grad1."""
    assert_swept_refused(name, error)


def assert_swept_refused(name: str, error: type) -> None:
    """The sweep's model ``name`` refused by ``error``, naming the layer or parameters."""
    res = _swept(name)
    assert res.outcome == "refused", (res.outcome, res.detail)
    assert res.detail.startswith(error.__name__ + ":"), res.detail
    assert "'" in res.detail  # (the layer or parameters, named)


@pytest.mark.parametrize(
    "name, setting",
    [
        ("mlp-mixer", "training"),
        ("dit", "bf16-autocast"),
        ("perceiver", "dp-step"),
        ("mamba-pscan", "bf16-autocast"),  # the parallel scan's own autograd.Function
        ("mamba-pscan", "dp-step"),
    ],
)
def test_library_model_in_another_setting(name, setting):
    """3 SGD steps (grad1 of each against the loop), bfloat16 autocast (against the float64
    loop, relative error at most 5e-2), a DP step (p.grad against the loop's clipped sum)."""
    assert_setting_match(name, setting)


def assert_setting_match(name: str, setting: str) -> None:
    """The sweep's model ``name`` matches in ``setting`` (:func:`bench.lib_sweep.check_setting`)."""
    _needs(name)
    res = lib_sweep.check_setting(name, setting, limit=0)
    assert res.outcome == "match", (res.outcome, res.detail)


@pytest.mark.parametrize("name", ["mlp-mixer", "vq-vae-ema"], ids=["loss", "batch loss"])
def test_sweep_reports_a_wrong_grad1_as_mismatch(monkeypatch, name):
    """Under the sweep's own loss, and for a model that returns the batch's loss itself (the
    VQ-VAE's commitment loss)."""
    _needs(name)
    monkeypatch.setattr(lib_sweep.gradhooks, "add_hooks", corrupting(gradhooks.add_hooks))
    res = lib_sweep.check(name, limit=0)
    assert res.outcome == "mismatch"
    assert res.parameter and res.max_rel_error > 1e-3


def test_float32_inside_is_rounding_of_the_mean(monkeypatch):
    """tab-transformer-pytorch's hyper-connections cast the float64 activations to float32:
    averaged over the batch, each example's gradient passes through float32 scaled by
    1/batch, and a parameter whose gradient is near zero (8e-8 of the largest) differs from
    the loop's by float32 rounding. Summed, there is no such scale: gradhooks then equals
    the loop within the float64 floor (1e-12 of the largest entry)."""
    _needs("tab-transformer")
    ex = lib_sweep.build("tab-transformer")
    assert lib_sweep._low_precision(ex) == {"float32"}
    ex.reduction = "sum"
    want = lib_sweep.own_gradients(ex)
    with gradhooks.add_hooks(ex.model, loss_reduction="sum"):
        lib_sweep.total_loss(ex).backward()
    res = lib_sweep.Result("tab-transformer")
    lib_sweep.compare(res, ex, want, lib_sweep.RTOL, zero=1e-12)
    assert res.outcome == "match", res.detail


def test_sweep_runs_and_writes_its_table(tmp_path, capsys):
    for name in ("mlp-mixer", "rotary-embedding"):
        _needs(name)
    assert lib_sweep.main(["--models", "mlp-mixer,rotary-embedding", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "lib-sweep.json").read_text())
    assert data["counts"] == {"match": 2, "refused": 0, "mismatch": 0, "crash": 0, "skipped": 0}
    table = (tmp_path / "lib-sweep.md").read_text()
    assert "| mlp-mixer | mlp-mixer-pytorch | Sequential |" in table
    assert "2 match" in capsys.readouterr().out

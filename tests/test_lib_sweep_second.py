"""More models of pure-Python libraries against the per-example loop, through
``bench.lib_sweep`` (tabular embeddings and ensembles, audio filterbanks and spectrograms,
mixtures of experts, FLASH, RetNet, Charformer, S5, SRU, vit-pytorch's video, 1D and packed
models), as ``tests/test_lib_sweep.py`` runs the first ones; and, in plain torch, the idioms
of theirs that gradhooks once refused: a one-hot of a width computed across the batch, cut to
a constant width (mixture-of-experts gates), and each example's parts joined and the examples
padded to one length (NaViT's packing)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_lib_sweep import (  # noqa: F401 (_quiet: a fixture, used by name)
    _quiet,
    assert_setting_match,
    assert_swept_match,
    assert_swept_refused,
)
from torch import nn
from torch.nn.utils.rnn import pad_sequence

import gradhooks
from gradhooks.oracle import loop_grad


def _matches_loop(model: nn.Module, *inputs: torch.Tensor) -> None:
    """``grad1`` of every parameter with a gradient equals the loop's, summed loss."""
    want = loop_grad(model, lambda out: out.pow(2).sum(), inputs)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        model(*inputs).pow(2).sum().backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad1, want[name], rtol=1e-7, atol=1e-10, msg=name)


# -- a one-hot of a width computed across the batch -----------------------------------------------


def safe_one_hot(index: torch.Tensor, width: int) -> torch.Tensor:
    """mixture-of-experts' and st-moe-pytorch's ``safe_one_hot``: a one-hot as wide as the
    batch's largest index needs (a 0-dim tensor where that is more than ``width``), cut to
    ``width``; an index past it gives a row of zeros (a token over an expert's capacity)."""
    widest = index.max() + 1
    return F.one_hot(index, max(widest + 1, width))[..., :width]


class CapacityGate(nn.Module):
    """Each token's top gate weighting its slot, a one-hot of its chosen expert, of
    ``width`` slots; ``cut=False`` keeps the one-hot as wide as the batch made it."""

    def __init__(self, width: int, cut: bool = True):
        super().__init__()
        self.gate, self.out = nn.Linear(4, 3), nn.Linear(4, 2)
        self.width, self.cut = width, cut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, index = self.gate(x).softmax(-1).max(-1)
        if self.cut:
            slots = safe_one_hot(index, self.width)
        else:
            slots = F.one_hot(index, max(index.max() + 2, self.width))
        return self.out(torch.einsum("bnd,bnc->bcd", x, weight[..., None] * slots))


@pytest.mark.parametrize("width", [2, 5], ids=["batch-width-cut", "constant-width"])
def test_one_hot_cut_to_a_constant_width_matches_the_loop(width):
    """Width 2: the one-hot is made as wide as the batch's largest index (+2), a number
    computed across the examples, and cut to 2: each entry is ``index == j`` whatever that
    width was; it was refused (MixedExamplesError) as a mask computed across the batch."""
    torch.manual_seed(0)
    _matches_loop(CapacityGate(width).double(), torch.randn(3, 5, 4, dtype=torch.float64))


def test_one_hot_of_the_batch_width_uncut_is_refused():
    """Uncut, its width is the batch's: an example alone would get fewer slots."""
    torch.manual_seed(0)
    model = CapacityGate(2, cut=False).double()
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    with pytest.raises(gradhooks.MixedExamplesError), gradhooks.add_hooks(model):
        model(x).sum().backward()


# -- each example's parts joined, the examples padded to one length -------------------------------


class PackedExamples(nn.Module):
    """Each example's sequence joined from two of its parts (the second cut to a length given
    per example), the sequences padded to the longest (``pad_sequence``), attention with a
    padding mask, a masked mean; ``crossed`` joins parts of two different examples."""

    def __init__(self, crossed: bool = False):
        super().__init__()
        self.embed, self.head = nn.Linear(4, 8), nn.Linear(8, 2)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.crossed = crossed

    def forward(self, first, second, length):
        others = second.flip(0) if self.crossed else second
        seqs = [torch.cat([a, b[: int(n)]]) for a, b, n in zip(first, others, length)]
        lengths = torch.tensor([len(s) for s in seqs])
        x = self.embed(pad_sequence(seqs, batch_first=True))
        pad = torch.arange(x.shape[1])[None] >= lengths[:, None]
        h, _ = self.attn(x, x, x, key_padding_mask=pad)
        return self.head(h.masked_fill(pad[..., None], 0).sum(1) / lengths[:, None])


def _packed_inputs():
    torch.manual_seed(0)
    first = torch.randn(3, 5, 4, dtype=torch.float64)
    return first, torch.randn(3, 6, 4, dtype=torch.float64), torch.tensor([6, 2, 4])


def test_parts_of_each_example_padded_to_one_length_match_the_loop():
    """Before, the join of an example's own parts (``torch.cat`` of two of its tensors) and
    ``pad_sequence`` of the examples were taken as mixing them (MixedExamplesError)."""
    torch.manual_seed(0)
    _matches_loop(PackedExamples().double(), *_packed_inputs())


def test_parts_of_two_examples_joined_are_refused():
    model = PackedExamples(crossed=True).double()
    with pytest.raises(gradhooks.MixedExamplesError), gradhooks.add_hooks(model):
        model(*_packed_inputs()).sum().backward()


# -- models of the libraries --------------------------------------------------------------------

# One per library or kind, the quicker ones: bench.lib_sweep runs them all (FLASH, RetNet,
# Charformer, SRU, vit-pytorch's ViViT, PatchMerger, ... too).
MODELS = [
    "rtdl-piecewise-linear",  # rtdl_num_embeddings: piecewise-linear encodings of quantile bins
    "tabm",  # TabM: k members of one batch-ensembled MLP, each example k times
    "tabm-packed",  # k MLPs' weights batched (LinearEnsemble)
    "asteroid-param-sinc",  # sinc filters of learned bands, a synthesis filterbank
    "nnaudio-mel",  # trainable STFT kernels and mel filters
    "moe-top2-task-loss",  # top-2 gating, capacity by the safe one-hot
    "st-moe",  # ST-MoE with its balance and router z-losses, returned by the model
]


@pytest.mark.parametrize("name", MODELS)
def test_library_model_matches_the_loop(name):
    assert_swept_match(name)


@pytest.mark.parametrize(
    "name, error",
    [
        # the batch met inside torch.vmap in the model's forward
        ("s5-block", gradhooks.UnsupportedError),
        # a module of parameters of its own (position tables indexed) given a list of examples
        ("navit", gradhooks.MixedExamplesError),
    ],
)
def test_library_model_refused(name, error):
    assert_swept_refused(name, error)


@pytest.mark.parametrize(
    "name, setting",
    [
        ("tabm", "training"),
        ("tabm-packed", "bf16-autocast"),
        ("st-moe", "bf16-autocast"),
        ("asteroid-free", "dp-step"),
        ("rtdl-periodic", "dp-step"),
    ],
)
def test_library_model_in_another_setting(name, setting):
    """3 SGD steps, bfloat16 autocast (against the float64 loop, at 5e-2), a DP step."""
    assert_setting_match(name, setting)

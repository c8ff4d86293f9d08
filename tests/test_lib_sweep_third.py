"""Models of more pure-Python libraries against the per-example loop, through
``bench.lib_sweep``, as ``tests/test_lib_sweep.py`` runs the first ones: hierarchical and agent
attention, hyper-connections' residual streams (and their Sinkhorn-projected kind), a
Mogrifier LSTM, FrEIA's invertible networks, vit-pytorch's looped and U-shaped ViTs; and
those refused, each by gradhooks' own error naming the layer (BatchNorm in training mode,
a log-determinant of no example, NaViT's list of images taken out of the batch one by one).
A model whose library is not installed is skipped."""

from __future__ import annotations

import pytest
from test_lib_sweep import (  # noqa: F401 (_quiet: a fixture, used by name)
    _quiet,
    assert_setting_match,
    assert_swept_match,
    assert_swept_refused,
)

import gradhooks

# The quicker ones of each library: bench.lib_sweep runs them all (H-Transformer-1D's
# bidirectional and causal kinds, Jumbo ViT, RegionViT too).
MODELS = [
    "h-transformer-1d-reversible",  # hierarchical attention, reversible layers
    "agent-transformer",  # agent tokens: a parameter repeated for the batch, attended to
    "hyper-connections",  # residual streams mixed by input-dependent weights
    "hyper-connections-mhc",  # the streams' mixing projected by Sinkhorn iterations
    "mogrifier-lstm",  # input and state modulating each other before an LSTMCell step
    "freia-all-in-one",  # affine couplings, a learned ActNorm, a log-determinant per example
    "simple-uvit",  # long skips between blocks, register tokens
    "looped-vit",  # blocks looped over, a loss at every loop
]


@pytest.mark.parametrize("name", MODELS)
def test_library_model_matches_the_loop(name):
    assert_swept_match(name)


@pytest.mark.parametrize(
    "name, error",
    [
        ("efficientnet", gradhooks.MixedExamplesError),  # BatchNorm2d in training mode
        ("botnet", gradhooks.MixedExamplesError),  # the same, between attention bottlenecks
        # ActNorm's log-determinant, the same row for every example: no example in it
        ("freia-glow", gradhooks.UnsupportedInputError),
        # each example's images taken out of the batch alone and packed into one sequence
        ("navit", gradhooks.MixedExamplesError),
    ],
)
def test_library_model_refused(name, error):
    assert_swept_refused(name, error)


@pytest.mark.parametrize(
    "name, setting",
    [("hyper-connections", "bf16-autocast"), ("mogrifier-lstm", "training")],
)
def test_library_model_in_another_setting(name, setting):
    """bfloat16 autocast (against the float64 loop, at 5e-2), 3 SGD steps."""
    assert_setting_match(name, setting)


def test_batch_mapped_by_vmap_in_the_forward_is_refused_naming_it():
    """s5-pytorch maps its recurrence over the batch with torch.vmap inside its forward:
    gradhooks cannot follow the examples through it, and its refusal names that cause and
    what to do instead."""
    lib_sweep = pytest.importorskip("bench.lib_sweep")
    pytest.importorskip("s5")
    ex = lib_sweep.build("s5-block")
    with pytest.raises(gradhooks.UnsupportedError, match=r"torch\.vmap") as caught:
        with gradhooks.add_hooks(ex.model, loss_reduction=ex.reduction):
            lib_sweep.total_loss(ex).backward()
    assert "'layer.s5.seq.Lambda'" in str(caught.value)

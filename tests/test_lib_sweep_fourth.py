"""Models of more pure-Python libraries against the per-example loop, through
``bench.lib_sweep``, as ``tests/test_lib_sweep.py`` runs the first ones: TimeSformer's divided
space-time attention, the Recurrent Memory Transformer's memories carried across segments,
simple-hierarchical-transformer's pooled streams, BS-RoFormer's and Mel-Band RoFormer's
complex spectrograms (``torch.stft`` of a batch of signals, band-split, and ``istft`` back),
neuraloperator's Fourier neural operators (complex spectral weights, a Tucker-factorized
kind), xLSTM's matrix and scalar memories; and those refused, each by gradhooks' own error
(mixture-of-attention's tokens routed to experts by an index, the Recurrent Memory
Transformer's loss of the batch computed inside, Titans' memory trained inside the forward
by ``torch.func``, with the run-time check on or off). A model whose library is not
installed is skipped."""

from __future__ import annotations

import pytest
from test_lib_sweep import (  # noqa: F401 (_quiet: a fixture, used by name)
    _quiet,
    assert_swept_match,
    assert_swept_refused,
)

import gradhooks

MODELS = [
    "timesformer",  # divided space-time attention, rotary
    "rmt",  # memories read and written across two segments
    "rmt-xl",  # the segment before's keys and values as memories
    "hierarchical-transformer",  # tokens pooled to coarser streams
    "bs-roformer",  # complex STFT of a batch of signals, band-split, axial attention
    "mel-band-roformer",  # overlapping mel bands gathered and scattered back
    "fno",  # spectral convolutions: complex weights over an rfft
    "tfno",  # the spectral weights as a Tucker factorization
    "xlstm-lm",  # an mLSTM and an sLSTM block
]


@pytest.mark.parametrize("name", MODELS)
def test_library_model_matches_the_loop(name):
    assert_swept_match(name)


@pytest.mark.parametrize(
    "name, error",
    [
        ("mixture-of-attention", gradhooks.UnsupportedError),  # tokens routed by an index
        ("rmt-loss", gradhooks.UnsupportedInputError),  # the batch's loss, inside the model
        ("titans-neural-memory", gradhooks.UnsupportedError),  # torch.func grads in forward
    ],
)
def test_library_model_refused(name, error):
    """Refused by gradhooks' own error, naming the layer, never a grad1 given."""
    assert_swept_refused(name, error)


def test_parameters_that_enter_a_torch_func_transform_are_refused_without_the_check():
    """Titans' memory parameters, repeated over the batch, meet the examples inside
    ``vmap(grad(...))`` in its forward, which the batch tracker cannot see into: with
    ``verify=False`` (no run-time check to find that their grad1 does not add up) the backward
    is refused all the same, naming them and the transform, nothing written (their grad1 was
    off by 30% to 99% of the loop's)."""
    lib_sweep = pytest.importorskip("bench.lib_sweep")
    pytest.importorskip("titans_pytorch")
    ex = lib_sweep.build("titans-neural-memory")
    with pytest.raises(gradhooks.UnsupportedError, match=r"torch\.func transform") as caught:
        with gradhooks.add_hooks(ex.model, loss_reduction=ex.reduction, verify=False):
            lib_sweep.total_loss(ex).backward()
    assert "'encoder.memory_model_parameters." in str(caught.value)
    assert not any(hasattr(p, "grad1") for p in ex.model.parameters())

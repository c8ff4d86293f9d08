"""A fifth round of pure-Python libraries' models against the per-example loop, through
``bench.lib_sweep``: memory-efficient-attention-pytorch's reversible layers (blocks recomputed
inside a custom autograd.Function's backward) and its flash attention written in torch,
ring-attention-pytorch's bucketed flash attention, Hamburger's matrix decomposition (steps
under no_grad, the last one differentiated), involution's per-pixel kernels,
CrossTransformer's support images of each example encoded in one batch, Fastformer under
padding masks and the Set Transformer's induced points; and those refused, each by
gradhooks' own error (the E(n)-equivariant transformer's neighbours gathered by einx from the
flattened batch, the Hierarchical Reasoning Model's steps under no_grad through a layer
without a rule). A model whose library is not installed is skipped."""

from __future__ import annotations

import pytest
from test_lib_sweep import (  # noqa: F401 (_quiet: a fixture, used by name)
    _quiet,
    assert_swept_match,
    assert_swept_refused,
)

import gradhooks

MODELS = [
    "mea-reversible",  # reversible layers: blocks recomputed in a custom backward
    "mea-flash",  # flash attention in torch, its own autograd.Function
    "ring-flash",  # bucketed flash attention, one process
    "hamburger",  # NMF: steps under no_grad, the last one differentiated
    "involution",  # kernels generated per pixel
    "cross-transformer",  # each example's support images encoded in one batch
    "fast-transformer",  # additive attention, padding masks of different lengths
    "isab",  # learned inducing points
]


@pytest.mark.parametrize("name", MODELS)
def test_library_model_matches_the_loop(name):
    assert_swept_match(name)


@pytest.mark.parametrize(
    "name, error",
    [
        ("en-transformer", gradhooks.MixedExamplesError),  # neighbours gathered by einx.get_at
        ("hrm", gradhooks.UnsupportedError),  # a norm's gain used under no_grad
    ],
)
def test_library_model_refused(name, error):
    """Refused by gradhooks' own error, naming the layer, never a grad1 given."""
    assert_swept_refused(name, error)

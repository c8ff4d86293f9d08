"""A fifth round of pure-Python libraries' models against the per-example loop, through
``bench.lib_sweep``: memory-efficient-attention-pytorch's reversible layers (blocks recomputed
inside a custom autograd.Function's backward) and its flash attention written in torch,
ring-attention-pytorch's bucketed flash attention, Hamburger's matrix decomposition (steps
under no_grad, the last one differentiated), involution's per-pixel kernels,
CrossTransformer's support images of each example encoded in one batch, Fastformer under
padding masks and the Set Transformer's induced points; and those refused, each by
gradhooks' own error (the E(n)-equivariant transformer's neighbours gathered by einx from the
flattened batch, the Hierarchical Reasoning Model's steps under no_grad through a layer
without a rule, Titans' hyper-connections called with the branch outside, refused with
verify=False too). Tensors let out of calls without a rule: x-transformers' four residual
streams with a mix for each of queries, keys and values, a residual FSQ and ST-MoE's block of
feedforwards around its experts match. A model whose library is not installed is skipped."""

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
    "xt-hyper-connections-views",  # 4 streams, queries, keys and values each from a mix
    "residual-fsq",  # two finite scalar quantizers on scaled residuals
    "st-moe-block",  # feedforwards around the experts, the losses returned
]


@pytest.mark.parametrize("name", MODELS)
def test_library_model_matches_the_loop(name):
    assert_swept_match(name)


@pytest.mark.parametrize(
    "name, error",
    [
        ("en-transformer", gradhooks.MixedExamplesError),  # neighbours gathered by einx.get_at
        ("hrm", gradhooks.UnsupportedError),  # a norm's gain used under no_grad
        ("titans-mac", gradhooks.UnsupportedError),  # a residual function returned by the call
    ],
)
def test_library_model_refused(name, error):
    """Refused by gradhooks' own error, naming the layer, never a grad1 given."""
    assert_swept_refused(name, error)


def test_a_returned_residual_function_is_refused_without_the_check():
    """Titans' MemoryAsContextTransformer calls hyper-connections with the branch outside
    (``attn_in, add_residual = attn_hyper_conn(x)``): ``add_residual`` holds the beta the call
    computed from its ``dynamic_beta_fn``, which the fallback's recomputation never sees. With
    ``verify=False`` too the backward is refused, naming the module and the parameter, nothing
    written."""
    lib_sweep = pytest.importorskip("bench.lib_sweep")
    pytest.importorskip("titans_pytorch")
    ex = lib_sweep.build("titans-mac")
    with pytest.raises(gradhooks.UnsupportedError, match="other than as a returned") as caught:
        with gradhooks.add_hooks(ex.model, loss_reduction=ex.reduction, verify=False):
            lib_sweep.total_loss(ex).backward()
    assert "'dynamic_beta_fn'" in str(caught.value)
    assert not any(hasattr(p, "grad1") for p in ex.model.parameters())

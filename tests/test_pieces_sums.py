"""Weighted batch sums and dtype changes of the Outer and Direct pieces (float64), against the
per-example gradients their definitions give (``Σ_shared gᵀ a`` per example, formed here by
einsum): what the book-keeping DP step adds per call."""

from __future__ import annotations

import pytest
import torch

from gradhooks import pieces as P
from harness import assert_close

# (batch, shared, in, out): one shared position (an MLP's Linear), several (a sequence)
SHAPES = [(5, 1, 3, 4), (4, 6, 2, 3), (1, 3, 4, 1), (3, 1, 1, 5)]


def _tensors(batch, shared, n_in, n_out, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(batch, shared, n_in, generator=gen, dtype=torch.float64)
    g = torch.randn(batch, shared, n_out, generator=gen, dtype=torch.float64)
    w = torch.rand(batch, generator=gen, dtype=torch.float64)
    return a, g, w


def _weighted_sum(g1: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.einsum("b,b...->...", w, g1)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-s{}-i{}-o{}".format(*s))
def test_outer_weighted_batch_sums_against_the_definition(shape):
    batch, shared, n_in, n_out = shape
    a, g, w = _tensors(*shape)
    for piece, g1 in (
        (P.Outer(a, g), torch.einsum("bso,bsi->boi", g, a)),  # a weight [out, in]
        (P.Outer(None, g), g.sum(1)),  # its bias [out]
    ):
        param_shape = g1.shape[1:]
        assert_close(piece.grad1(param_shape), g1, "grad1")
        assert_close(piece.batch_sum(param_shape, w), _weighted_sum(g1, w), "weighted sum")
        assert_close(piece.batch_sum(param_shape), g1.sum(0), "sum")
        out = torch.ones(param_shape, dtype=torch.float64)
        piece.add_batch_sum(out, w)
        assert_close(out, 1 + _weighted_sum(g1, w), "weighted sum added")


@pytest.mark.parametrize("rows_shape", [(4, 3), (4, 2, 3), (1, 5)], ids=str)
def test_direct_weighted_batch_sums_against_its_rows(rows_shape):
    gen = torch.Generator().manual_seed(1)
    v = torch.randn(rows_shape, generator=gen, dtype=torch.float64)
    w = torch.rand(rows_shape[0], generator=gen, dtype=torch.float64)
    piece = P.Direct(v)
    shape = torch.Size(rows_shape[1:])
    assert_close(piece.batch_sum(shape, w), _weighted_sum(v, w), "weighted sum")
    out = torch.zeros(shape, dtype=torch.float64)
    piece.add_batch_sum(out, w)
    assert_close(out, _weighted_sum(v, w), "weighted sum added")


def test_in_dtype_keeps_a_piece_of_its_dtype_and_casts_another():
    a, g, _ = _tensors(3, 2, 4, 5)
    weight = torch.einsum("bso,bsi->boi", g, a)
    cases = [  # (piece, its grad1 by definition)
        (P.Outer(a, g), weight),
        (P.Outer(None, g), g.sum(1)),
        (P.Direct(g[:, 0]), g[:, 0]),
        (P.Outer(a.float(), g), weight),  # (an input of another precision than the gradient)
    ]
    for piece, _ in cases[:3]:
        assert piece.in_dtype(torch.float64) is piece
    mixed = cases[3][0].in_dtype(torch.float64)
    assert mixed.a.dtype == mixed.g.dtype == torch.float64
    for piece, g1 in cases:
        cast = piece.in_dtype(torch.float32)
        assert cast is not piece
        got = cast.grad1(g1.shape[1:])
        assert got.dtype == torch.float32
        diff = (got.double() - g1).abs().max().item()
        assert diff <= 1e-5 * (1 + g1.abs().max().item()), f"{type(piece).__name__}: {diff:.2e}"
    ints = P.Direct(torch.arange(6).view(3, 2))  # (not floating: as it is)
    assert ints.in_dtype(torch.float32) is ints

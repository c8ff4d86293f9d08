"""The tracker's table of operations, read from torch's own metadata where that serves.

``tracking_table.json`` is a frozen copy of the table as it was written by hand, by torch
function name: the handler of each of its 681 names (the handler's function, and what a
handler made by a factory was made with), the elementwise names, and those that follow rows
picked by an index. Taking the in-place operations from the aten schemas' alias annotations,
and more elementwise ones from ``torch.Tag.pointwise``, must leave every one of these
decisions as it was, with the internal (``gradhooks._torch``, ``op_schema``) and without it;
the tags only add names the table did not have.
"""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import pytest
import torch

from gradhooks import _torch
from gradhooks.tracking import UNKNOWN, Layout, Tracker
from gradhooks.tracking.ops import HANDLERS, handler_for, owner_aware
from gradhooks.tracking.ops.common import is_inplace
from gradhooks.tracking.ops.nn import PER_ROW
from gradhooks.tracking.ops.pointwise import is_pointwise

FROZEN = json.loads((Path(__file__).with_name("tracking_table.json")).read_text())
# decisions changed on purpose since, each a handler the OpInfo sweep found wrong (the tests in
# tests/test_tracking_ops.py say why): the frozen handler, and the start of the new one's
# description (``None``: no handler now)
_PER_EXAMPLE = [n for n, h in FROZEN["handlers"].items() if h == "samplewise"]
CHANGED = {
    **dict.fromkeys(_PER_EXAMPLE, "per_example("),  # (unbatched inputs, weights with examples)
    "pixel_shuffle": "pixel_shuffle",  # (a layout among the leading dimensions)
    "pixel_unshuffle": "pixel_shuffle",
    "squeeze_": "squeeze_in_place",  # (the shape before is gone by the time it is read)
    "unsqueeze_": "unsqueeze_in_place",
    "resize_": None,
    "masked_scatter": "masked_scatter",  # (a source's entries taken in turn: not elementwise)
    "masked_scatter_": "masked_scatter",
    "masked_scatter__": None,  # (no such function)
    "linear": "needs_batch:linear",  # (a batch of one squeezed into the features it contracts)
    "bilinear": "needs_batch:linear",
    "layer_norm": "needs_batch:layer_norm",
    "rms_norm": "needs_batch:layer_norm",
    # (rows picked by an index and put back in the batch's order: the batch's own layout,
    # tests/test_fuzz_ops.py)
    "cat": "needs_batch:cat",
    "concat": "needs_batch:cat",
    "concatenate": "needs_batch:cat",
    # (the examples rolled along the batch, each row still one example's, rolled back in
    # order: tests/test_tracking_reorders.py)
    "roll": "needs_batch:roll",
    # (a batch in a matrix's rows or columns mixed by a function of the whole matrix; addbmm
    # sums its batch of products: tests/test_peer_suites_seventh.py, the op database's ops
    # that mix the examples)
    **dict.fromkeys(
        ("inverse", "cholesky", "det", "logdet", "slogdet", "matrix_exp", "trace"), "whole_matrices"
    ),
    "addbmm": "addbmm",
    # (the examples of prepend= and append= followed too: tests/test_fuzz_regressions.py)
    "diff": "diff",
    # (one example's rows repeated, or its row expanded, as Segment Anything's decoder repeats
    # an image per prompt: tests/test_examples_regrown.py)
    **dict.fromkeys(("expand", "expand_as", "broadcast_to", "expand_copy"), "needs_batch:expand"),
    "repeat_interleave": "needs_batch:repeat_interleave",
}
# handlers added since for operations the table lacked (tests/test_real_loops.py and
# tests/test_idioms_fifth.py say why; the recurrent cells: tests/test_timm_sweep.py and
# tests/test_lib_sweep.py, a gated residual that folds tokens into rows; the similarity and the
# distance of two tensors broadcast: tests/test_idioms_eleventh.py, prototypes; torch.special's
# aliases, untagged: tests/test_tracking_ops.py, Mega's special.erf)
SPECIAL = {
    "special_" + n
    for n in (
        "erf erfc erfinv expm1 exp2 log1p sinc round ndtr logit psi digamma gammaln i0 xlogy "
        "polygamma multigammaln gammainc gammaincc softmax log_softmax logsumexp"
    ).split()
}
# ops of torch's op database that mix a batch the fallback took for a smaller one, or for
# examples of their own (tests/test_peer_suites_seventh.py: tensordot, the ops that mix the
# examples): products, statistics of pairs, whole-matrix functions, transforms
MIXING_ADDED = {
    "tensordot", "cov", "corrcoef", "pdist", "dist", "renorm", "renorm_", "linalg_matrix_norm",
    "pinverse", "linalg_inv", "linalg_inv_ex", "linalg_det", "linalg_slogdet", "linalg_cholesky",
    "linalg_cholesky_ex", "linalg_matrix_exp", "linalg_pinv", "linalg_cond",
    "linalg_matrix_power", "linalg_matrix_rank", "linalg_eigvalsh", "linalg_svdvals",
    "fft_hfft2", "fft_ihfft2", "fft_hfftn", "fft_ihfftn",
}  # fmt: skip
# short-time Fourier transforms of a batch of signals, and their inverse (BS-RoFormer's
# spectrograms: tests/test_lib_sweep_fourth.py)
STFT_ADDED = {"stft", "istft"}
# counts over the batch (a histogram of it as long as the batch was presumed its rows), and
# searches among boundaries that may hold the examples (tests/test_tracking_ops.py)
COUNTS_ADDED = {"histc", "histogram", "histogramdd", "bincount", "bucketize", "searchsorted"}
ADDED = {"fused_moving_avg_obs_fake_quant", "quantile", "nanquantile", "gru_cell", "lstm_cell",
         "rnn_tanh_cell", "rnn_relu_cell", "cosine_similarity", "pairwise_distance",
         "polygamma", "polygamma_", *SPECIAL, *MIXING_ADDED, *COUNTS_ADDED, *STFT_ADDED}  # fmt: skip
# names that follow rows picked by an index since (attention along the rows of one example
# alone, a varlen batch's sequences: tests/test_idioms_ninth.py, flash_attention_2; the
# operations in which each row of the batch runs alone, convolutions, pooling, attention,
# recurrent layers: a layer on a cut of the batch, tests/test_moe.py; one example's rows
# repeated: tests/test_examples_regrown.py)
OWNER_AWARE_ADDED = {"scaled_dot_product_attention", "repeat_interleave"} | PER_ROW
# elementwise aten operators torch tags as such that the hand-written table lacked
TAGGED = ["special_i1", "lcm", "signbit", "nextafter", "special_zeta", "igamma", "ldexp_"]


def describe(handler) -> str:
    """A handler as text: its function's name (without a leading underscore), and the values a
    handler made by a factory holds (``dim_op(-1, 'dim', 2)``)."""
    fn = getattr(handler, "fn", None)
    if fn is not None and not isinstance(handler, types.FunctionType):
        return "needs_batch:" + describe(fn)
    name = handler.__qualname__.split(".<locals>")[0].lstrip("_")
    cells = [
        describe(c.cell_contents) if callable(c.cell_contents) else repr(c.cell_contents)
        for c in handler.__closure__ or ()
    ]
    return name + (f"({', '.join(cells)})" if cells else "")


# Python's methods that the rule took for in-place operators by their names, changed on
# purpose since: int(t) and operator.index(t) read a value (tests/test_fixed_rows.py)
_READS_NOW = frozenset({"__int__", "__index__", "__iter__", "__init__"})


def _frozen_inplace(name: str) -> bool:
    """The hand-written rule for in-place operations, as it was: a name that ends in ``_``,
    Python's in-place operators, ``__setitem__``."""
    return (
        name == "__setitem__"
        or bool(re.match(r"^[a-z][a-z0-9_]*_$", name))
        or (name.startswith("__i") and name.endswith("__") and name not in ("__invert__",))
    )


def _public_names() -> list[str]:
    """The names of the table, and those of the public functions of torch's namespaces and
    Tensor's methods (Python's operators among them)."""
    spaces = [torch, torch.Tensor, torch.nn.functional, torch.special, torch.linalg, torch.fft]
    found = set(FROZEN["handlers"])
    for space in spaces:
        for n in dir(space):
            obj = getattr(space, n, None)
            name = n if space is torch.Tensor else getattr(obj, "__name__", n)
            if callable(obj) and isinstance(name, str) and _public(name):
                found.add(name)
    return sorted(found)


def _public(name: str) -> bool:
    return not name.startswith("_") or (name.startswith("__") and name.endswith("__"))


def _schema(off: bool):
    return _torch.disabled("op_schema") if off else _nothing()


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _expected(name: str, got: str | None) -> bool:
    if name not in CHANGED:
        return got == FROZEN["handlers"][name]
    want = CHANGED[name]
    return got is None if want is None else got is not None and got.startswith(want)


@pytest.mark.parametrize("off", [False, True], ids=["internal", "fallback"])
def test_every_name_keeps_its_handler(off):
    gone = {n for n, h in CHANGED.items() if h is None}
    assert set(HANDLERS) == (set(FROZEN["handlers"]) - gone) | ADDED
    assert set(CHANGED) <= set(FROZEN["handlers"])
    with _schema(off):
        got = {n: handler_for(n) for n in FROZEN["handlers"]}
    got = {n: None if h is None else describe(h) for n, h in got.items()}
    wrong = {n: (FROZEN["handlers"][n], h) for n, h in got.items() if not _expected(n, h)}
    assert not wrong, wrong


@pytest.mark.parametrize("off", [False, True], ids=["internal", "fallback"])
def test_elementwise_and_owner_aware_names_are_kept(off):
    scatter = {"masked_scatter", "masked_scatter_", "masked_scatter__"}
    pointwise = set(FROZEN["pointwise"]) - scatter
    aware = (set(FROZEN["owner_aware"]) - scatter) | OWNER_AWARE_ADDED
    with _schema(off):
        for n in FROZEN["handlers"]:
            assert is_pointwise(n) == (n in pointwise), n
            assert owner_aware(n) == (n in aware), n


@pytest.mark.parametrize("off", [False, True], ids=["internal", "fallback"])
def test_in_place_from_the_schema_as_by_the_name(off):
    """For every public torch function (and every name of the table), the schema's alias
    annotations say what the name said; only aten's private operators differ, where the name
    rule missed them."""
    names = _public_names()
    assert len(names) > 1200
    with _schema(off):
        wrong = [n for n in names if is_inplace(n) != (_frozen_inplace(n) and n not in _READS_NOW)]
        assert not wrong, wrong
        assert is_inplace("add_") and is_inplace("__iadd__") and is_inplace("__setitem__")
        assert not is_inplace("retain_grad")  # (annotated as writing, but changes no value)
        assert is_inplace("_add_relu_") is (not off)


def test_the_tags_add_elementwise_names():
    """Names torch tags ``pointwise`` that the table lacked get the elementwise handler; without
    the internal they are unknown, as before."""
    for n in TAGGED:
        assert n not in FROZEN["handlers"]
        assert describe(handler_for(n)) == "pointwise", n
        assert owner_aware(n), n
        with _torch.disabled("op_schema"):
            assert handler_for(n) is None and not is_pointwise(n), n
    extra = [
        n
        for n in _public_names()
        if n not in FROZEN["handlers"] and n not in ADDED and is_pointwise(n)
    ]
    assert all(_torch.tagged(n, "pointwise") for n in extra), extra


def _followed(fn, x, layout: Layout) -> Layout | None:
    tracker = Tracker(x.shape[layout.dim], {})
    tracker.set_layout(x, layout)
    with tracker:
        out = fn(x)
    return tracker.layout(out[0] if isinstance(out, tuple) else out)


@pytest.mark.parametrize(
    "fn",
    [
        torch.special.i1,
        torch.signbit,
        lambda x: torch.nextafter(x, torch.zeros(x.shape[-1], dtype=x.dtype)),
        lambda x: torch.lcm(x.long(), torch.tensor(6)),
        lambda x: x.abs().add(1).igamma(x.abs().add(1)),
    ],
    ids=["special.i1", "signbit", "nextafter(x, row)", "lcm(x, 0-d)", "igamma(x, x)"],
)
def test_a_tagged_elementwise_operation_keeps_the_layout(fn):
    """``[T, B, F]`` with the examples on dimension 1: an elementwise operation torch tags as
    such keeps them there (unknown without the internal, as before the tags were read)."""
    x = torch.randn(4, 3, 5, dtype=torch.float64)
    assert _followed(fn, x, Layout(1)) == Layout(1)
    with _torch.disabled("op_schema"):
        assert _followed(fn, x, Layout(1)) is UNKNOWN

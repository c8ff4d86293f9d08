"""Conv1d/Conv3d sweeps (the Conv2d sweep is in test_conv.py) and ConvTranspose1d/2d/3d."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_conv import _valid, conv_cases
from torch import nn

import gradhooks
from harness import Case, check

TRANSPOSE = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}


@pytest.mark.parametrize("dims", [1, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@settings(max_examples=12)
@given(data=st.data(), batch=st.sampled_from([1, 3]))
def test_conv1d_conv3d_sweep(dims, reduction, data, batch):
    case = data.draw(conv_cases(dims))
    if _valid(case):
        check(case, batch=batch, reduction=reduction)


@st.composite
def transpose_cases(draw, dims):
    groups = draw(st.sampled_from([1, 2]))
    in_ch = groups * draw(st.integers(1, 2))
    out_ch = groups * draw(st.integers(1, 2))
    per_dim = lambda s: st.tuples(*[s] * dims)  # noqa: E731
    kernel = draw(per_dim(st.integers(1, 3)))
    stride = draw(per_dim(st.integers(1, 3)))
    dilation = draw(per_dim(st.integers(1, 2)))
    padding = draw(per_dim(st.integers(0, 2)))
    # torch: output_padding < max(stride, dilation) in every dimension
    output_padding = tuple(
        draw(st.integers(0, max(s, d) - 1)) for s, d in zip(stride, dilation, strict=True)
    )
    bias = draw(st.booleans())
    size = draw(st.integers(2, 4)) if dims < 3 else draw(st.integers(2, 3))
    kwargs = dict(
        kernel_size=kernel,
        stride=stride,
        padding=padding,
        dilation=dilation,
        output_padding=output_padding,
        groups=groups,
        bias=bias,
    )
    return Case(
        f"convtranspose{dims}d({in_ch}, {out_ch}, {kwargs})",
        lambda: TRANSPOSE[dims](in_ch, out_ch, **kwargs),
        lambda b: torch.randn(b, in_ch, *(size,) * dims),
    )


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@settings(max_examples=12)
@given(data=st.data(), batch=st.sampled_from([1, 3]))
def test_conv_transpose_sweep(dims, reduction, data, batch):
    case = data.draw(transpose_cases(dims))
    if _valid(case) and case.model()(case.inputs(1)).numel():
        check(case, batch=batch, reduction=reduction)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(kernel_size=3, stride=2, padding=1, output_padding=1),
        dict(kernel_size=2, stride=1, dilation=3, output_padding=2),  # output_padding >= stride
        dict(kernel_size=(3, 2), stride=(2, 3), padding=(1, 0), groups=2, bias=False),
        dict(kernel_size=4, stride=2, padding=1, groups=4),  # depthwise
    ],
    ids=str,
)
@pytest.mark.parametrize("batch", [0, 1, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_conv_transpose2d_named(kwargs, batch, reduction):
    case = Case(
        f"convtranspose2d{kwargs}",
        lambda: nn.ConvTranspose2d(4, 8, **kwargs),
        lambda b: torch.randn(b, 4, 4, 3),
    )
    check(case, batch=batch, reduction=reduction)


class Upsample(nn.Module):
    """A ConvTranspose2d called with ``output_size`` (which picks the output padding)."""

    def __init__(self, size):
        super().__init__()
        self.up = nn.ConvTranspose2d(3, 2, 3, stride=3, padding=1)
        self.size = size

    def forward(self, x):
        return self.up(x, output_size=self.size)


@pytest.mark.parametrize("size", [(7, 8), (9, 9)], ids=str)
def test_conv_transpose_output_size(size):
    case = Case(f"output_size={size}", lambda: Upsample(size), lambda b: torch.randn(b, 3, 3, 3))
    check(case, batch=3, reduction="sum")


def test_conv_transpose_check_rule():
    for dims, module in TRANSPOSE.items():
        m = module(2, 4, 3, stride=2, padding=1, output_padding=1, groups=2)
        assert gradhooks.check_rule(m, torch.randn(3, 2, *(3,) * dims)).ok


def test_conv_transpose_unbatched_input_is_an_error():
    m = nn.ConvTranspose1d(2, 3, 2)
    with gradhooks.add_hooks(m), pytest.raises(ValueError, match="without a batch dimension"):
        m(torch.randn(2, 5)).sum().backward()

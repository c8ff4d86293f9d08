"""nn.ConvTranspose1d / 2d / 3d: stride, padding, output_padding, dilation, groups, bias.

A transposed convolution is the adjoint of the convolution with the same stride, padding and
dilation: input position ``q`` and kernel offset ``k`` write to output position
``q * stride - padding + k * dilation``. So the weight ``[in, out/groups, *kernel]`` sees, at
every *input* position ``q``, the column of output-gradient values those writes landed on: the
im2col of ``g`` with the layer's (stride, padding, dilation), one column per input position.
Per example and group,

    grad1[b, i, o, k] = Σ_q x[b, i, q] · cols(g)[b, (o, k), q]

an :class:`Outer` with ``a`` = the columns of ``g`` (``[batch, groups, positions, out/G * K]``),
``g`` = the input (``[batch, groups, positions, in/G]``), ``shared`` = input positions; its
``[batch, groups, in/G, out/G * K]`` result is the weight's row-major layout.

``output_padding`` (or ``output_size``) only adds output positions past the last one an input
position reaches at offset 0; the im2col may then yield extra trailing columns, which are cut to
the input's spatial size. Bias: ``g`` summed over output positions.

K-FAC sees the layer the other way round (:meth:`TransposedConvWeight.kfac_view`), as the
literature does (BackPACK's KFAC for transposed convolutions; KFC's for convolutions): the
weight as the matrix ``[groups, out/G, in/G · K]`` (its first two axes swapped per group), ``g``
the output-gradient at every *output* position and ``a`` the input patch that position reads,
``patches[b, (i, k), p] = x[b, i, q]`` where ``q · stride - padding + k · dilation = p`` (zero
where no ``q`` is): ``y[b, o, p] = Σ_{i,k} W[i, o, k] · patches[b, (i, k), p]`` (+ bias). The
patches are the transposed convolution of ``x`` with a one-hot kernel (as BackPACK unfolds
it), formed only when K-FAC asks; the bias is the column of ones of those patches.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from ..errors import UnbatchedInputError, describe_module
from ..pieces import Outer, Piece, cast
from .conv import im2col
from .registry import Call, register

_ConvT = nn.ConvTranspose1d | nn.ConvTranspose2d | nn.ConvTranspose3d
_CONV_TRANSPOSE = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def input_patches(module: _ConvT, x: Tensor, out_spatial) -> Tensor:
    """``[batch, in * prod(kernel), *out_spatial]``: at every output position, the input value
    each kernel offset of each input channel adds there (zero where none), channels ordered
    ``(group, in/groups, kernel)``. A transposed convolution of ``x`` with a one-hot kernel
    ``[in, in/groups · K, *kernel]`` (exact: each output is one input value or zero), whose
    ``output_padding`` gives the call's own output size."""
    nd = len(module.kernel_size)
    kernel, groups = math.prod(module.kernel_size), module.groups
    per_group = module.in_channels // groups
    eye = torch.eye(per_group * kernel, dtype=x.dtype, device=x.device)
    # one_hot[i, (i', k'), k] = [i = i'][k = k'] within a group
    one_hot = eye.view(per_group, kernel, per_group * kernel).transpose(1, 2)
    one_hot = one_hot.reshape(per_group, per_group * kernel, *module.kernel_size)
    one_hot = one_hot.repeat(groups, *[1] * (nd + 1))
    padding = [
        size - ((n - 1) * s - 2 * p + d * (k - 1) + 1)
        for size, n, s, p, d, k in zip(
            out_spatial, x.shape[2:], module.stride, module.padding, module.dilation,
            module.kernel_size, strict=True,
        )
    ]  # fmt: skip
    return _CONV_TRANSPOSE[nd](
        x, one_hot, None, module.stride, module.padding, padding, groups, module.dilation
    )


class TransposedConvWeight(Outer):
    """A transposed convolution weight's :class:`Outer` piece for ``grad1``: ``a`` the columns
    of the output-gradient ``[batch, groups, in positions, out/G · K]``, ``g`` the input
    ``[batch, groups, in positions, in/G]`` (the weight's own ``[in, out/G, *kernel]``
    layout). Its :meth:`kfac_view` is the layer as K-FAC reads it (see the module)."""

    def __init__(self, module: _ConvT, x: Tensor, grad_output: Tensor) -> None:
        self.module, self.x, self.grad_output = module, x, grad_output
        cols = output_grad_columns(module, grad_output, x.shape[2:])
        groups = module.groups
        a = rearrange(cols, "batch (groups col) ... -> batch groups (...) col", groups=groups)
        # (the weight's gradient is xᴴ cols(g): a complex input conjugated, as Linear's)
        xc = x.conj() if x.is_complex() else x
        xg = rearrange(xc, "batch (groups inp) ... -> batch groups (...) inp", groups=groups)
        super().__init__(a, xg)

    def __repr__(self) -> str:
        return (
            f"TransposedConvWeight(x={tuple(self.x.shape)}, "
            f"grad_output={tuple(self.grad_output.shape)})"
        )

    # (folded or owned, the piece would lose the call it reads: formed from grad1 instead,
    # with no Kronecker factors)
    merged = Piece.merged
    owned = Piece.owned

    def select(self, rows: slice) -> TransposedConvWeight:
        return TransposedConvWeight(self.module, self.x[rows], self.grad_output[rows])

    def in_dtype(self, dtype: torch.dtype) -> Piece:
        x, go = cast(self.x, dtype), cast(self.grad_output, dtype)
        if x is self.x and go is self.grad_output:
            return self
        return TransposedConvWeight(self.module, x, go)

    def kfac_view(self) -> Outer:
        """``a`` the input patches of every output position ``[batch, groups, out positions,
        in/G · K]`` (formed when read), ``g`` the output-gradient ``[batch, groups, out
        positions, out/G]``; the weight's matrix is ``"in_out"``."""
        return _PatchesView(self.module, self.x, self.grad_output)


class _PatchesView(Outer):
    """:meth:`TransposedConvWeight.kfac_view`."""

    matrix_layout = "in_out"

    def __init__(self, module: _ConvT, x: Tensor, grad_output: Tensor) -> None:
        self.module, self.x = module, x
        g = rearrange(
            grad_output, "batch (groups out) ... -> batch groups (...) out", groups=module.groups
        )
        # (the dataclass's __init__ would set ``a``, hiding the property that forms it)
        self.g, self._spatial = g, grad_output.shape[2:]

    @functools.cached_property
    def a(self) -> Tensor:  # type: ignore[override]
        patches = input_patches(self.module, self.x, self._spatial)
        return rearrange(
            patches, "batch (groups col) ... -> batch groups (...) col", groups=self.module.groups
        )

    @property
    def has_input(self) -> bool:
        return True

    @property
    def in_features(self) -> int:
        m = self.module
        return m.in_channels // m.groups * math.prod(m.kernel_size)


def output_grad_columns(
    module: nn.ConvTranspose1d | nn.ConvTranspose2d | nn.ConvTranspose3d, g: Tensor, spatial
) -> Tensor:
    """``[batch, out * prod(kernel), *spatial]``: the output-gradient each input position's
    kernel offsets wrote to, for input spatial size ``spatial``."""
    cols = im2col(g, module.kernel_size, module.stride, module.dilation, module.padding)
    # The number of columns per dimension, as a convolution of g would produce.
    counts = [
        (size + 2 * p - d * (k - 1) - 1) // s + 1
        for size, p, d, k, s in zip(
            g.shape[2:],
            module.padding,
            module.dilation,
            module.kernel_size,
            module.stride,
            strict=True,
        )
    ]
    cols = cols.reshape(*cols.shape[:2], *counts)
    return cols[(slice(None), slice(None), *(slice(0, n) for n in spatial))]


@register(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
def conv_transpose(call: Call) -> dict[str, Outer]:
    """Weight ``[in, out/groups, *kernel]``: :class:`Outer` over input positions; bias ``[out]``:
    ``g`` summed over output positions. Rules never scale: the engine applies mean/sum."""
    module = call.module
    x = call.inputs[0]
    if x.dim() == len(module.kernel_size) + 1:
        raise UnbatchedInputError(
            f"{describe_module(call.name, module)} got an input of shape {tuple(x.shape)} "
            "without a batch dimension: per-example gradients need [batch, channels, *spatial]"
        )
    g = call.grad_output
    bias_g = rearrange(g, "batch out ... -> batch (...) out")
    return {"weight": TransposedConvWeight(module, x, g), "bias": Outer(None, bias_g)}

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
"""

from __future__ import annotations

from einops import rearrange
from torch import Tensor, nn

from ..errors import UnbatchedInputError, describe_module
from ..pieces import Outer
from .conv import im2col
from .registry import Call, register


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
    cols = output_grad_columns(module, g, x.shape[2:])
    groups = module.groups
    a = rearrange(cols, "batch (groups col) ... -> batch groups (...) col", groups=groups)
    xg = rearrange(x, "batch (groups inp) ... -> batch groups (...) inp", groups=groups)
    bias_g = rearrange(g, "batch out ... -> batch (...) out")
    return {"weight": Outer(a, xg), "bias": Outer(None, bias_g)}

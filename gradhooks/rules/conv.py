"""nn.Conv1d / Conv2d / Conv3d, every hyper-parameter, through im2col.

The weight ``[out, in/groups, *kernel]`` sees, at every output position, a column of
``in/groups * prod(kernel)`` input values (im2col). Per example and group, its gradient is
``Σ_positions g ⊗ column``: an :class:`Outer` with ``shared`` = output positions.
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from ..pieces import Outer
from ..registry import Call, register


def im2col(
    x: Tensor,
    kernel: tuple[int, ...],
    stride: tuple[int, ...],
    dilation: tuple[int, ...],
    padding: tuple[int, ...],
) -> Tensor:
    """Columns of a convolution's input: ``[batch, channels * prod(kernel), positions]``, rows
    ordered (channel, kernel offsets), positions row-major, as ``F.unfold`` orders them."""
    nd = len(kernel)
    if nd == 2:
        return F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)
    if nd == 1:
        cols = F.unfold(
            x.unsqueeze(-2), (1, *kernel), dilation=(1, *dilation), padding=(0, *padding),
            stride=(1, *stride),
        )
        return cols
    # N-d: a strided view per spatial dimension, then one copy.
    x = F.pad(x, [p for p in reversed(padding) for _ in range(2)])
    for d in range(nd):
        span = dilation[d] * (kernel[d] - 1) + 1
        x = x.unfold(2 + d, span, stride[d])  # appends a window axis
    window = (slice(None),) * (2 + nd) + tuple(slice(None, None, dil) for dil in dilation)
    x = x[window]  # [batch, channels, *positions, *kernel]
    perm = [0, 1, *range(2 + nd, 2 + 2 * nd), *range(2, 2 + nd)]
    batch, channels, positions = x.shape[0], x.shape[1], math.prod(x.shape[2 : 2 + nd])
    return x.permute(perm).reshape(batch, channels * math.prod(kernel), positions)


def conv_input_columns(module: nn.modules.conv._ConvNd, x: Tensor) -> Tensor:
    """``module``'s input as its weight sees it: ``[batch, channels * prod(kernel), positions]``
    with the module's own padding (string padding, non-zero padding modes) applied."""
    padding = module.padding
    if isinstance(padding, str) or module.padding_mode != "zeros":
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, module._reversed_padding_repeated_twice, mode=mode)
        padding = (0,) * len(module.kernel_size)
    return im2col(x, module.kernel_size, module.stride, module.dilation, padding)


@register(nn.Conv1d, nn.Conv2d, nn.Conv3d)
def conv(call: Call) -> dict[str, Outer]:
    module = call.module
    (x,) = call.inputs
    unbatched = x.dim() == len(module.kernel_size) + 1
    if unbatched:
        raise ValueError(
            f"'{call.name}' ({type(module).__qualname__}) got an input of shape {tuple(x.shape)} "
            "without a batch dimension: per-example gradients need [batch, channels, *spatial]"
        )
    cols = conv_input_columns(module, x)
    a = rearrange(cols, "batch (groups col) pos -> batch groups pos col", groups=module.groups)
    g = rearrange(
        call.grad_output, "batch (groups out) ... -> batch groups (...) out", groups=module.groups
    )
    bias_g = rearrange(call.grad_output, "batch out ... -> batch (...) out")
    return {"weight": Outer(a, g), "bias": Outer(None, bias_g)}

"""nn.Conv1d / Conv2d / Conv3d, every hyper-parameter, through im2col.

The weight ``[out, in/groups, *kernel]`` sees, at every output position, a column of
``in/groups * prod(kernel)`` input values (im2col). Per example and group, its gradient is
``Σ_positions g ⊗ column``: an :class:`Outer` with ``shared`` = output positions
(:class:`ConvWeight`, which computes ``grad1`` without the columns where that is faster).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from .. import _torch, devices
from ..errors import UnbatchedInputError, describe_module
from ..pieces import Outer, Piece, cast
from ..tuning import TUNING
from .linear import unused_grad_macs
from .registry import Call, register

# the layers of this rule (annotations)
_Conv = nn.Conv1d | nn.Conv2d | nn.Conv3d


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
    # a strided view per spatial dimension, then one copy (2-4x faster than F.unfold on CPU)
    if any(padding):
        x = F.pad(x, [p for p in reversed(padding) for _ in range(2)])
    for d in range(nd):
        span = dilation[d] * (kernel[d] - 1) + 1
        x = x.unfold(2 + d, span, stride[d])  # appends a window axis
    window = (slice(None),) * (2 + nd) + tuple(slice(None, None, dil) for dil in dilation)
    x = x[window]  # [batch, channels, *positions, *kernel]
    perm = [0, 1, *range(2 + nd, 2 + 2 * nd), *range(2, 2 + nd)]
    batch, channels, positions = x.shape[0], x.shape[1], math.prod(x.shape[2 : 2 + nd])
    return x.permute(perm).reshape(batch, channels * math.prod(kernel), positions)


def _explicit_padding(module: _Conv, x: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """``x`` and the zero padding still to apply: string padding and non-zero padding modes
    are applied to ``x`` here (as the module does)."""
    padding = module.padding
    if isinstance(padding, str) or module.padding_mode != "zeros":
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, _torch.conv_padding(module), mode=mode)
        padding = (0,) * len(module.kernel_size)
    return x, tuple(padding)


def conv_input_columns(module: _Conv, x: Tensor) -> Tensor:
    """``module``'s input as its weight sees it: ``[batch, channels * prod(kernel), positions]``
    with the module's own padding (string padding, non-zero padding modes) applied."""
    x, padding = _explicit_padding(module, x)
    return im2col(x, module.kernel_size, module.stride, module.dilation, padding)


class ConvWeight(Outer):
    """A convolution weight's :class:`Outer` piece, ``a`` = im2col columns
    ``[batch, groups, positions, in/groups * prod(kernel)]``, ``g`` = output-gradient
    ``[batch, groups, positions, out/groups]``.

    The columns are only built when something asks for ``a``. ``grad1`` is, where that was
    measured faster (CPU, more output positions than output channels: 2-8x on 3x3
    convolutions over 16x16 and larger maps), one convolution backward with the batch folded
    into the groups, which never forms the columns; otherwise columns and a batched matmul.
    Per-example Jacobians (:meth:`jacobian_into`) are, where the positions outnumber the
    output channels of all outputs, one such convolution backward with the outputs and output
    channels of one example in its group; otherwise columns and a matmul (the generic path).
    Where that convolution backward runs, it also gives the call's :class:`ConvBias` its sums.
    """

    def __init__(
        self,
        module: _Conv,
        x: Tensor,
        grad_output: Tensor,
        bias: ConvBias | None = None,
    ) -> None:
        self.module, self.x, self.grad_output = module, x, grad_output
        self.g = rearrange(
            grad_output, "batch (groups out) ... -> batch groups (...) out", groups=module.groups
        )
        # the same call's bias piece: the grouped convolution backward, which reads the
        # output-gradient anyway, gives it its per-example sums too
        self.bias = bias

    @functools.cached_property
    def a(self) -> Tensor:  # type: ignore[override]
        cols = conv_input_columns(self.module, self.x)
        if cols.is_complex():
            cols = cols.conj()  # (the weight's gradient is xᴴ g, as Linear's)
        groups = self.module.groups
        return rearrange(cols, "batch (groups col) pos -> batch groups pos col", groups=groups)

    def __repr__(self) -> str:
        return f"ConvWeight(x={tuple(self.x.shape)}, grad_output={tuple(self.grad_output.shape)})"

    @property
    def has_input(self) -> bool:
        return True

    @property
    def in_features(self) -> int:
        m = self.module
        return m.in_channels // m.groups * math.prod(m.kernel_size)

    # (folded, the piece would lose the call it reads: formed from grad1 instead)
    merged = Piece.merged

    def in_dtype(self, dtype: torch.dtype) -> Piece:
        """The input and output-gradient in ``dtype`` (autocast: the float32 input beside a
        bfloat16 output-gradient), without the bias's shortcut (whose sums would be of the
        other precision)."""
        x, go = cast(self.x, dtype), cast(self.grad_output, dtype)
        if x is self.x and go is self.grad_output:
            return self
        return ConvWeight(self.module, x, go)

    # Measured at 2 threads (batch 64, ResNet18GN's and CifarCNN's layers): a convolution's
    # grad1 in cache-sized slices (a few examples per convolution or im2col and matmul) is up to
    # 2x slower than in slices of ~``TUNING.chunk_elements``.
    cache_slices = False

    @property
    def transient(self) -> int:
        """The grouped form's one convolution reads the example's input and output-gradient and
        writes its gradient (the columns are never formed); the other form, the columns."""
        if self._grouped_form():
            return self.x[0].numel() + self.grad_output[0].numel() + self.module.weight.numel()
        return super().transient

    def select(self, rows: slice) -> ConvWeight:
        return ConvWeight(self.module, self.x[rows], self.grad_output[rows])

    def _grouped_form(self) -> bool:
        # Measured on CPU at batch 64 (3x3 kernels): the grouped form is 2-4x faster with 8 to
        # 64 input channels over 16x16 and 32x32 maps, but 1.2-1.6x slower than the columns
        # with up to 6 (a network's stem: under 64 columns), where the grouped convolution has
        # too little work per group.
        positions = math.prod(self.grad_output.shape[2:])
        return (
            devices.cpu_trade_offs(self.x)
            and not self.x.is_complex()  # (torch's CPU convolution backward is real only)
            and self.x.shape[0] > 0
            and positions > self.module.out_channels
            and self.in_features >= TUNING.conv_grouped_min_columns
        )

    def _grad1_grouped(self, scale: float, with_bias: bool = False) -> tuple[Tensor, Tensor | None]:
        """``[batch * out, in/groups, *kernel]``: example ``b``'s weight gradient is group
        ``b`` of the weight gradient of a convolution with ``batch * groups`` groups over the
        batch laid side by side in the channels. ``with_bias``: also ``[batch * out]``, the
        bias gradient of that convolution, which is each example's output-gradient summed over
        positions (else ``None``); both scaled."""
        m = self.module
        x, padding = _explicit_padding(m, self.x)
        g = self.grad_output
        batch = x.shape[0]
        weight_shape = (batch * m.out_channels, m.in_channels // m.groups, *m.kernel_size)
        # scale the smallest of the two operands and the result (the result in place)
        scale_result = scale != 1.0 and math.prod(weight_shape) < min(g.numel(), x.numel())
        scaled_g = False
        if scale != 1.0 and not scale_result:
            if g.numel() <= x.numel():
                g, scaled_g = g * scale, True
            else:
                x = x * scale
        _, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
            g.reshape(1, batch * m.out_channels, *g.shape[2:]),
            x.reshape(1, batch * m.in_channels, *x.shape[2:]),
            x.new_empty(weight_shape),  # only its shape is read (an expanded one is copied)
            [batch * m.out_channels] if with_bias else None, m.stride, padding, m.dilation,
            False, (0,) * len(padding), batch * m.groups, (False, True, with_bias),
        )  # fmt: skip
        if scale_result:
            grad_weight.mul_(scale)
        if with_bias and scale != 1.0 and not scaled_g:
            grad_bias.mul_(scale)
        return grad_weight, grad_bias

    def jacobian_into(self, into: Tensor, scale: float, first: bool) -> bool:
        """:meth:`grouped_jacobian_into` where it applies, else :meth:`Outer.jacobian_into`."""
        return self.grouped_jacobian_into(into, scale, first) or super().jacobian_into(
            into, scale, first
        )

    def grouped_jacobian_into(self, into: Tensor, scale: float, first: bool) -> bool:
        """Under ``vmap`` over the outputs (:func:`gradhooks.jacobians`): the output-gradient is
        batched, ``[outputs, batch, out, *spatial]``, the input is not. Write the Jacobian,
        ``into`` ``[outputs, batch, *param_shape]``, by one convolution backward with ``batch``
        groups of ``outputs * out`` output channels each (example ``b``'s input channels are
        shared by all its outputs), never forming the columns. False elsewhere (not on CPU,
        input batched too, no more output positions than output channels times outputs: there
        the columns and a matmul were measured faster)."""
        m = self.module
        if not devices.cpu_trade_offs(self.x) or _torch.is_batched(self.x):
            return False
        go = _torch.unbatched(self.grad_output)
        if go is None:
            return False
        if go.dim() != self.x.dim() + 1 or go.shape[1] != self.x.shape[0] or go.shape[1] == 0:
            return False
        outputs, batch = go.shape[:2]
        if math.prod(go.shape[3:]) <= outputs * m.out_channels:
            # The generic path multiplies [outputs * out, positions] by the columns per example:
            # measured faster (up to 2.5x) unless the positions outnumber those rows.
            return False
        x, padding = _explicit_padding(m, self.x)
        # [batch, outputs, out, *spatial]: example b's rows of every output side by side
        g = go.transpose(0, 1).reshape(1, batch * outputs * m.out_channels, *go.shape[3:])
        if m.groups == 1:
            groups, weight_rows = batch, batch * outputs * m.out_channels
        else:
            # groups inside an example: channels (group, outputs, out/group) per example
            groups = batch * m.groups
            g = rearrange(
                go,
                "outputs batch (groups out) ... -> 1 (batch groups outputs out) ...",
                groups=m.groups,
            )
            weight_rows = batch * outputs * m.out_channels
        weight_shape = (weight_rows, m.in_channels // m.groups, *m.kernel_size)
        with_bias = self.bias is not None
        _, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
            g, x.reshape(1, batch * m.in_channels, *x.shape[2:]),
            x.new_empty(weight_shape),  # only its shape is read (an expanded one is copied)
            [weight_rows] if with_bias else None, m.stride, padding, m.dilation, False,
            (0,) * len(padding), groups, (False, True, with_bias),
        )  # fmt: skip
        if m.groups == 1:
            value = grad_weight.view(batch, outputs, *into.shape[2:])
        else:
            value = rearrange(
                grad_weight.view(batch, m.groups, outputs, m.out_channels // m.groups, -1),
                "batch groups outputs out k -> batch outputs (groups out) k",
            ).reshape(batch, outputs, *into.shape[2:])
        if with_bias:  # each example's and output's output-gradient summed over positions
            sums = rearrange(
                grad_bias,
                "(batch groups outputs out) -> batch outputs (groups out)",
                batch=batch, groups=m.groups, outputs=outputs,
            )  # fmt: skip
            self.bias.computed = (sums * scale if scale != 1.0 else sums, scale, "jacobian")
        target = into.transpose(0, 1)  # [batch, outputs, *param_shape]
        if scale != 1.0:
            value = value * scale
        if first:
            target.copy_(value)
        else:
            target.add_(value)
        return True

    def _geometry(self) -> tuple:
        m = self.module
        return (
            m.kernel_size, m.stride, m.dilation, m.groups, m.padding, m.padding_mode,
            self.x.shape[1:], self.grad_output.shape[2:],
        )  # fmt: skip

    def input_gram(self, other: Outer) -> Tensor:
        """``a aᵀ`` of this piece and ``other``: :meth:`positions_gram` where it applies, else
        from the columns."""
        gram = self.positions_gram(other)
        return super().input_gram(other) if gram is None else gram

    def positions_gram(self, other: Outer) -> Tensor | None:
        """``a aᵀ`` of this piece and ``other`` (a call of a convolution of the same geometry on
        inputs of the same shape), ``[batch, groups, positions, positions]``, without the
        columns: where the (padded) input has fewer positions ``P`` than ``T · prod(kernel)``
        (``T`` output positions). Column ``s`` holds the input at ``s · stride + k · dilation``
        for every kernel offset ``k``, so

            (a aᵀ)[s, t] = Σ_k X[s · stride + k · dilation, t · stride + k · dilation],

        with ``X`` the ``[P, P]`` Gram of the padded input's positions over its channels: one
        matmul of ``P² · channels`` and ``prod(kernel)`` strided sums, instead of
        ``T² · channels · prod(kernel)``. ``None`` elsewhere."""
        if not isinstance(other, ConvWeight) or other._geometry() != self._geometry():
            return None
        if not self._positions_form():
            return None
        return self._gram_from_positions(other)

    def _padded_positions(self) -> int:
        pads = _torch.conv_padding(self.module)[::-1]  # (right, left) per axis
        return math.prod(
            size + pads[2 * d] + pads[2 * d + 1] for d, size in enumerate(self.x.shape[2:])
        )

    def _positions_form(self) -> bool:
        """Whether :meth:`positions_gram` applies to ``self`` and a call like it."""
        positions, outputs = self._padded_positions(), math.prod(self.grad_output.shape[2:])
        return positions * positions < outputs * outputs * math.prod(self.module.kernel_size)

    @property
    def gram_macs(self) -> int:
        """:attr:`Outer.gram_macs`, with the input's Gram over its positions where
        :meth:`positions_gram` applies: ``P² · in/groups`` for the input side."""
        if not self._positions_form():
            return super().gram_macs
        m = self.module
        positions, outputs = self._padded_positions(), math.prod(self.grad_output.shape[2:])
        return m.groups * positions * positions * (m.in_channels // m.groups) + (
            outputs * outputs * m.out_channels
        )

    @property
    def grad1_extra_macs(self) -> int:
        """Columns that repeat the input (a kernel of more than one offset, not the grouped
        form): the product with them, at batch 64 on a 2-core CPU, took about twice the time
        of the batch gradient's convolution backward (3x3, 64 channels over 8x8: 2.0 ms against
        0.9, columns included), so it counts once more."""
        m = self.module
        if self._grouped_form() or math.prod(m.kernel_size) == 1:
            return 0
        positions = math.prod(self.grad_output.shape[2:])
        return positions * self.in_features * m.out_channels

    def _gram_from_positions(self, other: ConvWeight) -> Tensor:
        """:meth:`positions_gram`, whatever the sizes."""
        m = self.module
        x = self._padded()
        spatial, out = x.shape[2:], self.grad_output.shape[2:]
        positions, outputs = math.prod(spatial), math.prod(out)
        xq = x if other is self else other._padded()
        batch, groups = x.shape[0], m.groups
        channels = m.in_channels // groups
        xp = x.reshape(batch, groups, channels, positions)
        xq = xq.reshape(batch, groups, channels, positions)
        total = (xp.transpose(-1, -2) @ xq).view(batch, groups, *spatial, *spatial)
        # The sum over kernel offsets is separable: one spatial axis at a time (its offsets, in
        # both copies of the axis), each pass on what the ones before left (3x3 on 8x8 maps:
        # 6 strided sums on shrinking views instead of 9 on the whole, about 2.7x faster).
        nd = len(spatial)
        for axis, (size, d, s, n) in enumerate(zip(m.kernel_size, m.dilation, m.stride, out)):
            summed = None
            for k in range(size):
                # the input positions of offset k at every output position, on this axis
                at = [slice(None)] * (2 + 2 * nd)
                at[2 + axis] = at[2 + nd + axis] = slice(k * d, k * d + s * (n - 1) + 1, s)
                part = total[tuple(at)]
                summed = part.clone() if summed is None else summed.add_(part)
            total = summed
        return total.reshape(batch, groups, outputs, outputs)

    def _padded(self) -> Tensor:
        """The input with all of the module's padding applied: ``[batch, in, *padded]``."""
        x, padding = _explicit_padding(self.module, self.x)
        if any(padding):
            x = F.pad(x, [p for p in reversed(padding) for _ in range(2)])
        return x

    def batch_sum(self, param_shape: torch.Size, weights: Tensor | None = None) -> Tensor:
        """``Σ_b weights[b] grad1[b]`` (:meth:`gradhooks.pieces.Piece.batch_sum`): the weight gradient
        of one convolution backward with each example's output-gradient times its weight,
        as autograd computes the batch gradient (no columns)."""
        m = self.module
        x, padding = _explicit_padding(m, self.x)
        g = self.grad_output
        if weights is not None:
            g = g * weights.to(g.dtype).view(-1, *[1] * (g.dim() - 1))
        _, grad_weight, _ = torch.ops.aten.convolution_backward(
            g, x, x.new_empty(m.weight.shape), None, m.stride, padding, m.dilation,
            False, (0,) * len(padding), m.groups, (False, True, False),
        )  # fmt: skip
        return grad_weight.reshape(param_shape)

    @property
    def call_rows(self) -> int | None:
        """The grouped form: examples per convolution, about ``TUNING.conv_grouped_call_elements``
        elements read and written (:attr:`transient`) in one call."""
        if not self._grouped_form():
            return None
        return max(1, TUNING.conv_grouped_call_elements // max(self.transient, 1))

    def grad1(self, param_shape: torch.Size, scale: float = 1.0) -> Tensor:
        rows = self.call_rows
        if rows is None:
            return super().grad1(param_shape, scale)
        if rows >= self.batch_size:
            with_bias = self.bias is not None
            grad_weight, grad_bias = self._grad1_grouped(scale, with_bias)
            if with_bias:
                self.bias.computed = (grad_bias.view(self.batch_size, -1), scale, "grad1")
            return grad_weight.reshape(self.batch_size, *param_shape)
        out = self.x.new_empty(self.batch_size, *param_shape)
        self.grad1_into(out, scale)
        return out

    def grad1_into(self, out: Tensor, scale: float = 1.0, accumulate: bool = False) -> None:
        rows = self.call_rows
        if rows is None:
            return super().grad1_into(out, scale, accumulate)
        batch = self.batch_size
        with_bias = self.bias is not None
        sums = out.new_empty(batch, self.module.out_channels) if with_bias else None
        for start in range(0, batch, rows):
            part = self if rows >= batch else self.select(slice(start, start + rows))
            target = out[start : start + rows]
            # the scale is applied by the write into ``out``, which happens anyway
            grad_weight, grad_bias = part._grad1_grouped(1.0, with_bias)
            grad_weight = grad_weight.view(target.shape)
            if accumulate:
                target.add_(grad_weight, alpha=scale)
            elif scale != 1.0:
                torch.mul(grad_weight, scale, out=target)
            else:
                target.copy_(grad_weight)
            if with_bias:
                torch.mul(grad_bias.view(-1, sums.shape[1]), scale, out=sums[start : start + rows])
        if with_bias:
            self.bias.computed = (sums, scale, "grad1")


class ConvBias(Outer):
    """A convolution bias's :class:`Outer` piece (``a`` is ``None``: per example, the
    output-gradient summed over positions). Where the same call's :class:`ConvWeight` ran its
    grouped convolution backward first, that gave these sums too (its bias gradient, one per
    example and channel, while it read the output-gradient anyway): they are taken from there
    instead of reading the output-gradient again (CifarCNN's Jacobians about 4-8% faster, its
    grad1 about 1%)."""

    merged = Piece.merged  # (the weight's sums are for this call as it is)

    def in_dtype(self, dtype: torch.dtype) -> Piece:
        g = cast(self.g, dtype)
        return self if g is self.g else ConvBias(g)

    def __init__(self, g: Tensor) -> None:
        super().__init__(None, g)
        # (sums [batch, out] or [batch, outputs, out], their scale, for which path), set by the
        # weight's piece
        self.computed: tuple[Tensor, float, str] | None = None

    def _take(self, scale: float, path: str) -> Tensor | None:
        computed, self.computed = self.computed, None
        if computed is None or computed[1] != scale or computed[2] != path:
            return None
        return computed[0]

    def grad1_into(self, out: Tensor, scale: float = 1.0, accumulate: bool = False) -> None:
        sums = self._take(scale, "grad1")
        if sums is None or sums.dtype != out.dtype or sums.numel() != out.numel():
            return super().grad1_into(out, scale, accumulate)
        if accumulate:
            out.add_(sums.view(out.shape))
        else:
            out.copy_(sums.view(out.shape))

    def jacobian_into(self, into: Tensor, scale: float, first: bool) -> bool:
        """:func:`gradhooks.jacobians`, ``into`` ``[outputs, batch, out]``: the sums the weight's
        convolution gave, else :meth:`Outer.jacobian_into`."""
        sums = self._take(scale, "jacobian")
        if sums is None or sums.shape != into.transpose(0, 1).shape:
            return super().jacobian_into(into, scale, first)
        target = into.transpose(0, 1)
        if first:
            target.copy_(sums)
        else:
            target.add_(sums)
        return True


def many_positions(module: _Conv, args: tuple) -> bool:
    """Whether a convolution call's batch gradient is better taken as the sum of its
    ``grad1``: on CPU, with at least ``TUNING.sum_grad1_positions`` output positions per
    example (as :func:`gradhooks.rules.linear.many_positions`)."""
    x = args[0] if args else None
    nd = len(module.kernel_size)
    if not isinstance(x, Tensor) or not devices.cpu_trade_offs(x) or x.dim() != nd + 2:
        return False
    return _out_positions(module, x) >= TUNING.sum_grad1_positions


def large_product(module: _Conv, args: tuple) -> bool:
    """Whether a convolution call's batch gradient, where the backward wants none, is costly
    enough not to form (as :func:`gradhooks.rules.linear.large_product`): batch x output
    positions x weight entries multiply-adds."""
    x = args[0] if args else None
    if not isinstance(x, Tensor) or x.dim() != len(module.kernel_size) + 2:
        return False
    macs = x.shape[0] * _out_positions(module, x) * module.weight.numel()
    return macs >= unused_grad_macs(x)


def _out_positions(module: _Conv, x: Tensor) -> int:
    """The output positions of one example of a call on ``x`` (``[batch, channels, *spatial]``)."""
    nd = len(module.kernel_size)
    if isinstance(module.padding, str):
        padding = (0,) * nd if module.padding == "valid" else None
    else:
        padding = module.padding
    if padding is None:  # "same"
        positions = math.prod(x.shape[2:])
    else:
        positions = math.prod(
            (size + 2 * p - d * (k - 1) - 1) // s + 1
            for size, p, d, k, s in zip(
                x.shape[2:], padding, module.dilation, module.kernel_size, module.stride
            )
        )
    return positions


@register(
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    grad_from_grad1=many_positions,
    detach_without_grads=large_product,
)
def conv(call: Call) -> dict[str, Outer]:
    module = call.module
    (x,) = call.inputs
    unbatched = x.dim() == len(module.kernel_size) + 1
    if unbatched:
        raise UnbatchedInputError(
            f"{describe_module(call.name, module)} got an input of shape {tuple(x.shape)} "
            "without a batch dimension: per-example gradients need [batch, channels, *spatial]"
        )
    bias = ConvBias(rearrange(call.grad_output, "batch out ... -> batch (...) out"))
    trained = module.bias is not None and module.bias.requires_grad
    weight = ConvWeight(module, x, call.grad_output, bias if trained else None)
    return {"weight": weight, "bias": bias}

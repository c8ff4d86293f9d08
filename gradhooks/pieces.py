"""The canonical pieces a rule returns, and the per-example quantities computed from them.

A rule turns one call of its layer into one *piece* per trainable parameter. Every quantity
(``grad1`` today; norms, K-FAC factors and squared sums build on the same pieces) is computed
here, once, for every layer; no quantity is written per layer.

Layout: ``[batch, *groups, shared, features]``.

- ``batch``: the examples. Each example's gradient is computed on its own.
- ``groups``: optional; independent blocks of one parameter (the groups of a grouped
  convolution). Most layers have none.
- ``shared``: positions that share the weight within one example (tokens of a sequence,
  pixels of a convolution's output). The per-example gradient sums over them.
- ``features``: the layer's input features (``in``) or output features (``out``).

Scaling: the output-gradients a rule receives are those of the loss the user backpropagated.
The engine passes ``scale`` so that the result is the gradient of each example's *own* loss:
``scale = batch`` for a mean-reduced loss, ``1`` for a sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Piece", "Outer", "Direct"]


class Piece:
    """One parameter's contribution from one call of a layer."""

    @property
    def batch_size(self) -> int:
        raise NotImplementedError

    def grad1(self, param_shape: torch.Size, scale: float = 1.0) -> Tensor:
        """Per-example gradient, shape ``[batch, *param_shape]``, multiplied by ``scale``."""
        raise NotImplementedError


@dataclass
class Outer(Piece):
    """A gradient that is a sum of outer products: ``grad1[b] = Σ_shared g[b, s]ᵀ a[b, s]``.

    ``a``: ``[batch, *groups, shared, in]``, the layer's input as the weight sees it (Linear:
    the input; Conv: its im2col columns). ``None`` stands for a column of ones, which is what a
    bias sees: then ``grad1[b] = Σ_shared g[b, s]``.

    ``g``: ``[batch, *groups, shared, out]``, the gradient of the loss with respect to the
    layer's output at those positions.

    The result ``[batch, *groups, out, in]`` is reshaped to the parameter's shape, so the
    parameter must be laid out as ``[*groups, out, in]`` in row-major order (true of
    ``Linear.weight`` and of ``Conv.weight`` as ``[groups * out, in * kernel]``).
    """

    a: Tensor | None
    g: Tensor

    @property
    def batch_size(self) -> int:
        return self.g.shape[0]

    def grad1(self, param_shape: torch.Size, scale: float = 1.0) -> Tensor:
        batch = self.batch_size
        g = self.g
        if self.a is None:
            out = g.sum(-2)
            return _scaled(out, scale).reshape(batch, *param_shape)
        a = self.a
        result_numel = g.shape[-1] * a.shape[-1]
        if scale != 1.0 and g.shape[-2] * g.shape[-1] <= result_numel:
            g, scale = g * scale, 1.0  # scale the smaller operand
        if g.shape[-2] == 1:
            # One shared position: a broadcast multiply writes each float once; faster than
            # einsum/bmm with an inner dimension of one.
            out = g[..., 0, :, None] * a[..., 0, None, :]
        else:
            out = torch.matmul(g.transpose(-1, -2), a)
        return _scaled(out, scale).reshape(batch, *param_shape)


@dataclass
class Direct(Piece):
    """A rule that computes the per-example gradient itself: ``grad1`` is
    ``[batch, *param_shape]`` (elementwise layers, embeddings, the ``torch.func`` fallback)."""

    value: Tensor

    @property
    def batch_size(self) -> int:
        return self.value.shape[0]

    def grad1(self, param_shape: torch.Size, scale: float = 1.0) -> Tensor:
        return _scaled(self.value, scale).reshape(self.batch_size, *param_shape)


def _scaled(t: Tensor, scale: float) -> Tensor:
    return t if scale == 1.0 else t * scale

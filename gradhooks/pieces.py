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

    def grad1_into(self, out: Tensor, scale: float = 1.0, accumulate: bool = False) -> None:
        """Write ``grad1(out.shape[1:], scale)`` into ``out`` (contiguous), or add it to ``out``
        if ``accumulate``. Pieces that can write in place without a temporary override this."""
        g1 = self.grad1(out.shape[1:], scale)
        if accumulate:
            out.add_(g1.reshape(out.shape))
        else:
            out.copy_(g1.reshape(out.shape))


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

    @property
    def has_input(self) -> bool:
        """False for a bias (``a is None``). Subclasses that build ``a`` on demand answer
        without building it."""
        return self.a is not None

    @property
    def in_features(self) -> int:
        """The size of ``a``'s last axis (0 for a bias), without building ``a``."""
        return 0 if self.a is None else self.a.shape[-1]

    def select(self, rows: slice) -> Outer:
        """The same piece restricted to the examples ``rows``."""
        return Outer(None if self.a is None else self.a[rows], self.g[rows])

    def grad1(self, param_shape: torch.Size, scale: float = 1.0) -> Tensor:
        g, a = self.g, self.g if self.a is None else self.a
        differentiable = torch.is_grad_enabled() and (g.requires_grad or a.requires_grad)
        if differentiable or torch._C._functorch.peek_interpreter_stack() is not None:
            # A create_graph backward (grad1 gets a graph: no out= writes), or inside vmap (the
            # Jacobians batch the backward over outputs: no in-place writes into a buffer that
            # is not batched like the operands).
            if self.a is None:
                out = g.sum(-2)
            else:
                out = torch.matmul(g.transpose(-1, -2), a)
            return (out * scale if scale != 1.0 else out).reshape(self.batch_size, *param_shape)
        out = g.new_empty((self.batch_size, *param_shape), dtype=torch.result_type(g, a))
        self.grad1_into(out, scale)
        return out

    def grad1_into(self, out: Tensor, scale: float = 1.0, accumulate: bool = False) -> None:
        a, g = self.a, self.g
        if out.dtype != torch.result_type(g, g if a is None else a) or not out.is_contiguous():
            return super().grad1_into(out, scale, accumulate)
        shared, n_out = g.shape[-2], g.shape[-1]
        if a is None:  # a bias: sum over shared positions
            result = out.view(*g.shape[:-2], n_out)
            if accumulate:
                result.add_(g.sum(-2), alpha=scale)
            else:
                torch.sum(g, -2, out=result)
                if scale != 1.0:
                    result.mul_(scale)
            return
        # Every float of the result is written once, straight into ``out``: the mean scale is
        # folded into the smaller operand (or into the matmul's alpha), accumulation into the
        # matmul's beta.
        n_in = a.shape[-1]
        result = out.view(-1, n_out, n_in)  # [batch * groups, out, in]
        if shared == 1:
            # One shared position: a broadcast multiply, faster than a matmul with an inner
            # dimension of one.
            g, a = g.reshape(-1, n_out, 1), a.reshape(-1, 1, n_in)
            if scale != 1.0:
                if n_out <= n_in:
                    g = g * scale
                else:
                    a = a * scale
            if accumulate:
                result.addcmul_(g, a)
            else:
                torch.mul(g, a, out=result)
        else:
            g_t = g.reshape(-1, shared, n_out).transpose(1, 2)  # [batch * groups, out, shared]
            a = a.reshape(-1, shared, n_in)
            result.baddbmm_(g_t, a, beta=1.0 if accumulate else 0.0, alpha=scale)


@dataclass
class Direct(Piece):
    """A rule that computes the per-example gradient itself: ``grad1`` is
    ``[batch, *param_shape]`` (elementwise layers, embeddings, the ``torch.func`` fallback)."""

    value: Tensor

    @property
    def batch_size(self) -> int:
        return self.value.shape[0]

    def select(self, rows: slice) -> Direct:
        """The same piece restricted to the examples ``rows``."""
        return Direct(self.value[rows])

    def grad1(self, param_shape: torch.Size, scale: float = 1.0) -> Tensor:
        return _scaled(self.value, scale).reshape(self.batch_size, *param_shape)


def _scaled(t: Tensor, scale: float) -> Tensor:
    return t if scale == 1.0 else t * scale


# -- quantities other than grad1 (norms, squared sums, variance, batch slices) -----------------
# Added as separate functions so that ``Outer.grad1`` / ``Direct.grad1`` stay as they are. All
# results are *unscaled* (``scale = 1``): the caller multiplies by the engine's scale.


def select(piece: Piece, rows: slice) -> Piece:
    """The same piece restricted to the examples ``rows`` (a slice of the batch)."""
    if isinstance(piece, Outer | Direct):
        return piece.select(rows)
    raise TypeError(f"unknown piece type {type(piece).__qualname__}")


def gram_is_cheaper(p: Piece, q: Piece) -> bool:
    """Whether the per-example inner product of two :class:`Outer` pieces should use the Gram
    form ``⟨a_p a_qᵀ, g_p g_qᵀ⟩`` (two ``[shared_p, shared_q]`` matrices per example and group)
    rather than materialize ``[out, in]`` per example: ``2·T_p·T_q < in·out`` (Li et al. 2022).
    Bias pieces (``a is None``) are always cheap: they reduce over ``shared`` first."""
    if not (isinstance(p, Outer) and isinstance(q, Outer)):
        return False
    if p.has_input != q.has_input:
        return False
    if not p.has_input:
        return p.g.shape[-1] == q.g.shape[-1]
    if p.in_features != q.in_features or p.g.shape[-1] != q.g.shape[-1]:
        return False
    return 2 * p.g.shape[-2] * q.g.shape[-2] < p.in_features * p.g.shape[-1]


def inner(p: Piece, q: Piece, param_shape: torch.Size) -> Tensor:
    """Per-example inner product ``⟨grad1_p[b], grad1_q[b]⟩`` of two pieces of one parameter
    (unscaled), shape ``[batch]``. ``p is q`` gives the squared norm.

    :class:`Outer` with one shared position: ``(a_p·a_q)(g_p·g_q)`` (Goodfellow). Several shared
    positions: the Gram form ``Σ_{s,t} (a_p[s]·a_q[t]) (g_p[s]·g_q[t])`` when
    :func:`gram_is_cheaper`, else both gradients are materialized (one parameter at a time)."""
    if gram_is_cheaper(p, q):
        assert isinstance(p, Outer) and isinstance(q, Outer)
        if not p.has_input:  # bias: Σ_shared g, then a dot product
            return (p.g.sum(-2) * q.g.sum(-2)).flatten(1).sum(1)
        # letters: b batch, s/t shared positions of p/q, i in, o out; '...' the groups
        aa = torch.einsum("b...si,b...ti->b...st", p.a, q.a)
        gg = torch.einsum("b...so,b...to->b...st", p.g, q.g)
        return (aa * gg).flatten(1).sum(1)
    gp = p.grad1(param_shape).flatten(1)
    gq = gp if q is p else q.grad1(param_shape).flatten(1)
    return (gp * gq).sum(1)


def sum_sq(piece: Piece, param_shape: torch.Size) -> Tensor | None:
    """``Σ_b grad1[b]²`` (unscaled), shape ``param_shape``, without materializing ``grad1`` where
    the piece allows it (one shared position: ``(g²)ᵀ(a²)``; bias pieces); ``None`` where it would
    have to be materialized (the caller then does it a slice of the batch at a time)."""
    if isinstance(piece, Outer):
        if not piece.has_input:
            return (piece.g.sum(-2) ** 2).sum(0).reshape(param_shape)
        if piece.g.shape[-2] == 1:
            g2, a2 = piece.g[..., 0, :] ** 2, piece.a[..., 0, :] ** 2
            return torch.einsum("b...o,b...i->...oi", g2, a2).reshape(param_shape)
        return None
    if isinstance(piece, Direct):
        return (piece.value**2).sum(0).reshape(param_shape)
    return None


def batch_sum(piece: Piece, param_shape: torch.Size) -> Tensor:
    """``Σ_b grad1[b]`` (unscaled), shape ``param_shape``, never materializing ``grad1``."""
    if isinstance(piece, Outer):
        if not piece.has_input:
            return piece.g.sum((0, -2)).reshape(param_shape)
        return torch.einsum("b...so,b...si->...oi", piece.g, piece.a).reshape(param_shape)
    if isinstance(piece, Direct):
        return piece.value.sum(0).reshape(param_shape)
    raise TypeError(f"unknown piece type {type(piece).__qualname__}")

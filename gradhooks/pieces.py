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

import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from einops import rearrange
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from . import _torch, devices
from .errors import RuleError
from .tuning import TUNING

__all__ = ["Piece", "Outer", "Direct", "Rows", "accumulation_dtype"]


class Piece:
    """One parameter's contribution from one call of a layer.

    ``sums_to_grad``: the per-example gradients add up to the call's share of ``.grad`` (false
    only where a layer defines them otherwise: an Embedding that scales by each example's own
    counts, ``scale_grad_by_freq``); the engine's check of ``grad1`` against ``.grad`` skips
    the parameter otherwise.

    ``rounded_terms``: how many terms of the call's share of ``.grad`` autograd's own kernels
    round in a half precision (bfloat16, float16): a sum rounded term by term (torch's
    LayerNorm on a CPU), or terms each rounded before a float32 sum (an RNN's time steps under
    autocast, where the rule computes in float32); 0: one rounding of the whole, as torch's
    matrix products and reductions do. Set by the rule of such a layer; the engine's checks
    against autograd allow that many units of the half precision
    (:func:`gradhooks.engine.verify.rounding_tolerance`), relative to :meth:`terms_scale`.

    ``input_scale``: where autograd's computation rounded an :class:`Outer`'s input ``a`` in a
    half precision relative to terms it was formed from rather than to each entry (a
    recurrent state, formed from gate pre-activations), the size of those terms: its
    :meth:`terms_scale` takes each ``|a|`` as at least that; 0: each entry's own."""

    sums_to_grad: ClassVar[bool] = True
    rounded_terms: ClassVar[int] = 0
    input_scale: ClassVar[float] = 0.0

    @property
    def batch_size(self) -> int:
        raise NotImplementedError

    def grad1(self, param_shape: torch.Size, scale: float = 1.0) -> Tensor:
        """Per-example gradient, shape ``[batch, *param_shape]``, multiplied by ``scale``."""
        raise NotImplementedError

    @property
    def example_elements(self) -> int | None:
        """How many entries one example's gradient has, from the piece's shapes alone (the
        parameter's ``numel()`` for a piece of it); ``None`` where only forming ``grad1`` would
        tell."""
        return None

    def grad1_into(self, out: Tensor, scale: float = 1.0, accumulate: bool = False) -> None:
        """Write ``grad1(out.shape[1:], scale)`` into ``out`` (contiguous), or add it to ``out``
        if ``accumulate``. Pieces that can write in place without a temporary override this."""
        g1 = self.grad1(out.shape[1:], scale)
        if accumulate:
            out.add_(g1.reshape(out.shape))
        else:
            out.copy_(g1.reshape(out.shape))

    # -- what the quantities read; each default works from grad1, a piece overrides what it
    # can do cheaper. Results are unscaled (scale 1) unless a ``scale`` is taken.

    # Whether forming grad1 a cache-sized slice of the batch at a time pays (see
    # gradhooks.quantities.collector._materialized).
    cache_slices: ClassVar[bool] = True

    @property
    def call_rows(self) -> int | None:
        """The most examples whose ``grad1`` this piece forms in one call (more are formed in
        parts and copied together); ``None``: no limit."""
        return None

    @property
    def transient(self) -> int:
        """Elements one example needs while its ``grad1`` is formed, besides the result."""
        return 0

    @property
    def kept_elements(self) -> float:
        """The elements this piece keeps for a batch sum formed later (``inf``: too many to
        keep it rather than the sum)."""
        return math.inf

    # Whether :meth:`add_batch_sum` adds into a few rows of the parameter alone (an
    # embedding's looked-up rows), in place: the piece is then smaller than its sum, which
    # is better formed straight in the gradient's own tensor than in a tensor of its own.
    adds_rows: ClassVar[bool] = False

    def select(self, rows: slice) -> Piece:
        """The same piece restricted to the examples ``rows`` (a slice of the batch). Here the
        rows of ``grad1``, formed when asked for."""
        return _RowsOf(self, rows)

    def batch_sum(self, param_shape: torch.Size, weights: Tensor | None = None) -> Tensor:
        """``Σ_b grad1[b]``, or ``Σ_b weights[b] grad1[b]`` (``weights`` ``[batch]``), shape
        ``param_shape``. Here from ``grad1``; the built-in pieces never form it."""
        g1 = self.grad1(param_shape)
        if weights is not None:
            g1 = g1 * weights.to(g1.dtype).view(-1, *[1] * (g1.dim() - 1))
        return g1.sum(0)

    def terms_scale(self, param_shape: torch.Size) -> Tensor:
        """The largest entry of the sum of the magnitudes of the terms the batch sum adds
        (``[]``): the scale of the rounding of a sum that autograd's kernels round term by term
        (:attr:`rounded_terms`; where the terms cancel, it is of the terms, not of what is
        left). Here the examples' ``grad1`` are the terms."""
        total = self.grad1(param_shape).abs().sum(0)
        return total.max() if total.numel() else total.new_zeros(())

    def add_batch_sum(self, out: Tensor, weights: Tensor | None = None) -> None:
        """``out += batch_sum(out.shape, weights)`` in ``out``'s dtype (a contiguous tensor of
        the parameter's shape: a gradient being built). Pieces that can add in place, without
        a temporary of the parameter's size, override this."""
        out.add_(self.batch_sum(out.shape, weights).to(out.dtype))

    def sum_sq(self, param_shape: torch.Size) -> Tensor | None:
        """``Σ_b grad1[b]²``, shape ``param_shape``, where the piece forms it without
        materializing ``grad1``; ``None`` otherwise (the caller then forms ``grad1`` a slice of
        the batch at a time)."""
        return None

    def sq_norm(
        self, param_shape: torch.Size, scale: float, with_sum: bool = False
    ) -> tuple[Tensor, str, Tensor | None] | None:
        """``‖scale · grad1[b]‖²``, ``[batch]``, where this piece alone forms it with no
        product, with its form (see :meth:`gradhooks.Hooks.norm_forms`) and, where ``grad1``
        was formed on the way, its batch sum (``with_sum``: wanted; a piece whose batch sum
        then costs more than forming ``grad1`` a slice at a time gives ``None``). ``None``:
        the general path."""
        return None

    def merged(self, param_shape: torch.Size, outer: int, batch: int, inner: int) -> Piece:
        """A piece whose rows are ``outer · batch · inner`` parts of examples (a layer that saw
        the batch folded with windows, heads or time: row ``(a · batch + b) · inner + c`` is
        part of example ``b``) as one with ``batch`` rows, each the sum of its example's parts.
        Here formed per part and summed."""
        if outer == 1 and inner == 1:
            return self
        g1 = self.grad1(param_shape)
        return Direct(g1.unflatten(0, (outer, batch, inner)).sum((0, 2)))

    def owned(self, param_shape: torch.Size, owners: Tensor, batch: int) -> Piece:
        """A piece whose row ``r`` is part of example ``owners[r]`` (a layer that saw rows
        picked from the batch by an index: the tokens routed to an expert) as one with
        ``batch`` rows, each the sum of its example's parts (zero for an example with none).
        Here formed per row and summed."""
        g1 = self.grad1(param_shape)
        out = g1.new_zeros((batch, *g1.shape[1:]))
        return Direct(out.index_add_(0, owners.to(g1.device), g1))

    def in_dtype(self, dtype: torch.dtype) -> Piece:
        """This piece with its floating tensors in ``dtype``. A layer that ran in another
        precision than its parameter (autocast: a bfloat16 output-gradient beside the float32
        input the layer was handed; FSDP2's mixed precision; bfloat16 parameters under
        autocast with a float32 input) gives tensors of mixed precision: the engine brings them
        to the parameter's dtype before ``grad1`` is formed, and to at least float32 before
        norms, squared sums and K-FAC factors (:func:`accumulation_dtype`). Here: as it is."""
        return self

    def jacobian_into(self, into: Tensor, scale: float, first: bool) -> bool:
        """Under ``vmap`` over the outputs (:func:`gradhooks.jacobians`), write the Jacobian
        ``[outputs, batch, *param_shape]`` into ``into`` (zeroing it first if ``first``, else
        adding), where this piece has a form of its own; False: the generic path."""
        return False

    def kfac_view(self) -> Outer | None:
        """The :class:`Outer` whose ``a`` and ``g`` K-FAC's Kronecker factors are formed from
        (:mod:`gradhooks.quantities.kfac`): ``g`` over the rows of the parameter as a matrix,
        its outputs, ``a`` over its columns, what each output position reads, laid out as
        :attr:`Outer.matrix_layout` says; ``None``: no Kronecker factors (here)."""
        return None


class _RowsOf(Piece):
    """:meth:`Piece.select`'s default: examples ``rows`` of ``piece``."""

    def __init__(self, piece: Piece, rows: slice) -> None:
        self.piece, self.rows = piece, rows

    @property
    def batch_size(self) -> int:
        return len(range(*self.rows.indices(self.piece.batch_size)))

    def grad1(self, param_shape: torch.Size, scale: float = 1.0) -> Tensor:
        return self.piece.grad1(param_shape, scale)[self.rows]

    @property
    def example_elements(self) -> int | None:
        return self.piece.example_elements

    def in_dtype(self, dtype: torch.dtype) -> Piece:
        return _RowsOf(self.piece.in_dtype(dtype), self.rows)


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

    ``inputs_in_g``: the layer's input is ``g`` and its output-gradient ``a`` (a weight
    ``[in, out]`` used as ``torch.addmm(b, x, W)``, Hugging Face's ``Conv1D``: ``grad1[b] =
    Σ_s x[b, s]ᵀ g[b, s]``); only K-FAC reads it (the input's second moment is taken once per
    forward, the output-gradient's summed over every backward of it).

    ``seen``: ``None`` where every ``(batch, shared)`` position is one the layer saw; else a
    ``[batch, shared]`` (or, where the groups differ, ``[batch, *groups, shared]``) bool mask of
    those it saw, the others being padding that the layout added (an example's rows of an
    expert, :meth:`owned`, padded to the most rows of one example; a packed sequence's steps
    past its end; the shorter of an attention's query and key): their ``g`` is zero (they add
    nothing to ``grad1``), and K-FAC's factors count only the positions seen
    (:mod:`gradhooks.quantities.kfac`).
    """

    a: Tensor | None
    g: Tensor
    seen: Tensor | None = None
    inputs_in_g: bool = False

    # How the parameter lies in the matrix ``[*groups, out, in]`` of ``grad1``'s rows and
    # columns: ``"out_in"``, row-major as is; ``"in_out"``, its first two axes swapped per group
    # (a transposed convolution's ``[in, out/groups, *kernel]``, seen by K-FAC as ``[groups,
    # out/groups, in/groups · prod(kernel)]``: :func:`gradhooks.quantities.kfac.weight_matrix`)
    matrix_layout: ClassVar[str] = "out_in"

    def __post_init__(self) -> None:
        # (a [batch, out] output-gradient reads its batch as the shared positions too: every
        # quantity but grad1, which cannot reshape, would sum over the examples)
        if self.g.dim() >= 3 and (self.a is None or self.a.dim() >= 3):
            return  # (the usual: asked once per piece of every call)
        for what, t in (("a", self.a), ("g", self.g)):
            if t is not None and t.dim() < 3:
                raise RuleError(
                    f"Outer({what}=...) of shape {tuple(t.shape)}: a and g are [batch, *groups, "
                    f"shared, features], at least 3 dimensions; a layer that sees one position "
                    f"per example gives {what}[:, None] ([batch, 1, features])"
                )

    def kfac_view(self) -> Outer | None:
        """The piece itself (a bias's, with no input: ``None``)."""
        return self if self.has_input else None

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

    @property
    def example_elements(self) -> int | None:
        """``groups · out · in`` (``groups · out`` for a bias)."""
        width = self.in_features if self.has_input else 1
        return math.prod(self.g.shape[1:-2]) * self.g.shape[-1] * width

    @property
    def gram_macs(self) -> int:
        """Multiply-adds of the Gram form of one example's squared norm (both ``[shared,
        shared]`` Grams, every group): ``groups · T² · (in + out)``."""
        shared, groups = self.g.shape[-2], math.prod(self.g.shape[1:-2])
        return groups * shared * shared * (self.in_features + self.g.shape[-1])

    @property
    def grad1_extra_macs(self) -> int:
        """Multiply-adds that forming one example's ``grad1`` costs beyond its share of the
        batch gradient's product (which costs the same): none here, ``a`` is the layer's
        input; a convolution's duplicated columns cost more."""
        return 0

    @property
    def transient(self) -> int:
        """Elements one example needs while its ``grad1`` is formed, besides the result: the
        columns ``[*groups, shared, in]`` (none for a bias)."""
        if not self.has_input:
            return 0
        return math.prod(self.g.shape[1:-1]) * self.in_features

    def select(self, rows: slice) -> Outer:
        if rows == _ALL:  # (a piece of its own on the same tensors: nothing to slice)
            return Outer(self.a, self.g, self.seen, self.inputs_in_g)
        seen = None if self.seen is None else self.seen[rows]
        return Outer(None if self.a is None else self.a[rows], self.g[rows], seen, self.inputs_in_g)

    @property
    def kept_elements(self) -> float:
        """A Linear on ``[batch, features]`` (one shared position) keeps ``a`` and ``g``: its
        batch sum is one product."""
        if self.has_input and self.g.shape[-2] == 1:
            return self.a.numel() + self.g.numel()
        return math.inf

    def input_gram(self, other: Outer) -> Tensor:
        """``a_self a_otherᵀ`` per example and group, ``[batch, *groups, shared_self,
        shared_other]`` (a convolution's may form it without its columns)."""
        return batched_nt(self.a, other.a)

    def batch_sum(self, param_shape: torch.Size, weights: Tensor | None = None) -> Tensor:
        """One product over the batch and the shared positions (the weights scale the smaller
        of ``a`` and ``g``): the cost of the batch gradient autograd computes."""
        g, a = self.g, self.a
        if a is None and weights is not None and g.dim() == 3 and type(g) is Tensor:
            # a bias weighted by example: its per-example sums, then one product with the
            # weights (as add_batch_sum)
            rows = g[:, 0] if g.shape[1] == 1 else g.sum(1)  # [batch, out]
            w = weights if weights.dtype is g.dtype else weights.to(g.dtype)
            return _shaped(w @ rows, param_shape)
        if a is None:
            return _weighted(g, weights).sum((0, -2)).reshape(param_shape)
        if a.numel() < g.numel():
            a = _weighted(a, weights)
        else:
            g = _weighted(g, weights)
        if g.dim() == 3:  # no groups: one matmul over (batch, shared)
            flat = g.reshape(-1, g.shape[-1]).T @ a.reshape(-1, a.shape[-1])
            return _shaped(flat, param_shape)
        return torch.einsum("b...so,b...si->...oi", g, a).reshape(param_shape)

    def terms_scale(self, param_shape: torch.Size) -> Tensor:
        """The terms are those of every example and shared position, ``g[b, s]ᵀ a[b, s]``:
        ``Σ_{b, s} |g[b, s]|ᵀ |a[b, s]|`` (``|a|`` at least :attr:`input_scale`), one product
        as the batch sum's."""
        a = self.a.abs() if self.has_input else None
        if a is not None and self.input_scale:
            a = a.clamp_min_(self.input_scale)
        total = Outer(a, self.g.abs()).batch_sum(param_shape)
        return total.max() if total.numel() else total.new_zeros(())

    def add_batch_sum(self, out: Tensor, weights: Tensor | None = None) -> None:
        """No groups: one ``addmm_`` into ``out`` (the product accumulates in place); a bias
        weighted by example: one ``addmv_`` of its per-example sums."""
        g, a = self.g, self.a
        if (a is None and weights is not None and g.dim() == 3 and out.is_contiguous()
                and _same(out, g)):  # fmt: skip
            rows = g[:, 0] if g.shape[1] == 1 else g.sum(1)  # [batch, out]
            w = weights if weights.dtype is g.dtype else weights.to(g.dtype)
            out.view(-1).addmv_(rows.T, w)
            return
        if a is None or g.dim() != 3 or not out.is_contiguous() or not _same(out, g, a):
            return super().add_batch_sum(out, weights)
        if a.numel() < g.numel():
            a = _weighted(a, weights)
        else:
            g = _weighted(g, weights)
        flat = out.view(g.shape[-1], a.shape[-1])
        flat.addmm_(g.reshape(-1, g.shape[-1]).T, a.reshape(-1, a.shape[-1]))

    def sum_sq(self, param_shape: torch.Size) -> Tensor | None:
        """A bias: ``Σ_b (Σ_s g)²``; one shared position: ``(g²)ᵀ(a²)``."""
        if not self.has_input:
            return (self.g.sum(-2) ** 2).sum(0).reshape(param_shape)
        if self.g.shape[-2] == 1:
            g2, a2 = self.g[..., 0, :] ** 2, self.a[..., 0, :] ** 2
            return torch.einsum("b...o,b...i->...oi", g2, a2).reshape(param_shape)
        return None

    def sq_norm(
        self, param_shape: torch.Size, scale: float, with_sum: bool = False
    ) -> tuple[Tensor, str, Tensor | None] | None:
        """One shared position: ``‖g aᵀ‖ = ‖g‖ ‖a‖`` (Goodfellow); a bias: the norm of ``Σ_s g``
        (``grad1`` itself, not formed where its sum is not wanted)."""
        g = self.g
        if not self.has_input:
            if with_sum:
                return _from_grad1(self.grad1(param_shape, scale), param_shape, with_sum)
            rows = g if g.shape[-2] == 1 else g.sum(-2)  # (a shared axis of one: in the norm)
            return _sq_row_norms(rows, scale), "direct", None
        if g.shape[-2] != 1 or with_sum:
            return None
        if g.dim() == 3:  # (no groups: a norm of each, over the example's whole piece)
            norm = torch.linalg.vector_norm(self.a, dim=(1, 2)) * torch.linalg.vector_norm(
                g, dim=(1, 2)
            )
            return _scaled(norm, scale).square(), "outer", None
        sq = self.a.square().sum(-1) * g.square().sum(-1)  # [batch, *groups, 1]
        return sq.flatten(1).sum(1) * scale**2, "outer", None

    def merged(self, param_shape: torch.Size, outer: int, batch: int, inner: int) -> Piece:
        """The parts become shared positions."""
        if outer == 1 and inner == 1:
            return self

        def fold(t: Tensor) -> Tensor:  # [o*B*i, *groups, S, f] -> [B, *groups, o*i*S, f]
            t = t.unflatten(0, (outer, batch, inner)).movedim(1, 0)  # [B, o, i, *groups, S, f]
            groups = t.dim() - 5
            t = t.permute(0, *range(3, 3 + groups), 1, 2, t.dim() - 2, t.dim() - 1)
            return t.reshape(batch, *t.shape[1 : 1 + groups], -1, t.shape[-1])

        seen = None if self.seen is None else fold(self.seen[..., None])[..., 0]
        return Outer(None if self.a is None else fold(self.a), fold(self.g), seen, self.inputs_in_g)

    def owned(self, param_shape: torch.Size, owners: Tensor, batch: int) -> Piece:
        """The rows become shared positions of their examples: ``[rows, *groups, S, f]`` as
        ``[batch, *groups, most · S, f]``, each example's rows first and zeros after them (a
        zero row adds nothing to a sum of outer products), ``most`` the most rows of one
        example."""
        owners = owners.to(self.g.device)
        counts = torch.bincount(owners, minlength=batch)
        most = int(counts.max()) if counts.numel() else 0
        if most == 0:  # (no rows: a zero gradient for every example)
            return Direct(self.g.new_zeros((batch, *param_shape)))
        order = torch.argsort(owners, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        sorted_owners = owners[order]
        slot = torch.arange(owners.numel(), device=owners.device) - starts[sorted_owners]

        def fold(t: Tensor) -> Tensor:  # [R, *groups, S, f] -> [B, *groups, most*S, f]
            out = t.new_zeros((batch, most, *t.shape[1:]))
            out[sorted_owners, slot] = t[order]
            out = out.movedim(1, -3)  # [B, *groups, most, S, f]
            return out.reshape(batch, *t.shape[1:-2], most * t.shape[-2], t.shape[-1])

        # the positions seen: each example's rows (and of those, the ones their own mask kept)
        rows = self.g.new_ones(self.g.shape[0], self.g.shape[-2], 1, dtype=torch.bool)
        if self.seen is not None:
            rows = self.seen[..., None].to(self.g.device)
        seen = fold(rows)[..., 0]
        return Outer(None if self.a is None else fold(self.a), fold(self.g), seen, self.inputs_in_g)

    def in_dtype(self, dtype: torch.dtype) -> Piece:
        g, a = self.g, self.a
        if g.dtype is dtype and (a is None or a.dtype is dtype):
            return self  # (the usual: asked once per piece of every call)
        if not (_other(g, dtype) or _other(a, dtype)):
            return self
        return Outer(
            None if a is None else cast(a, dtype), cast(g, dtype), self.seen, self.inputs_in_g
        )

    def jacobian_into(self, into: Tensor, scale: float, first: bool) -> bool:
        """Where ``g`` is batched over the outputs (and ``a`` not): ``g ⊗ a`` straight into the
        result (no intermediate copy of the largest tensor)."""
        if _torch.is_batched(self.a):
            return False
        g = _torch.unbatched(self.g)
        if g is None:
            return False
        if scale != 1.0:
            g = g * scale
        outputs, batch = into.shape[:2]
        groups = g.shape[2:-2]  # [outputs, batch, *groups, shared, out]
        try:
            if self.a is None:
                target = into.view(outputs, batch, *groups, g.shape[-1])
            else:
                target = into.view(outputs, batch, *groups, g.shape[-1], self.a.shape[-1])
        except RuntimeError:
            return False
        if self.a is None:
            value = g.sum(-2)
        elif g.shape[-2] == 1:
            value = None
            prod = (g[..., 0, :, None], self.a[..., 0, None, :].unsqueeze(0))
            if first:
                torch.mul(*prod, out=target)
            else:
                target.add_(prod[0] * prod[1])
        elif (
            math.prod(groups) == 1
            and g.stride(-1) == 1
            and not into.transpose(0, 1).is_contiguous()
        ):
            # The flattened result (an example's outputs lie P apart, not one [outputs * out, in]
            # matrix) of a Linear over positions (g contiguous in out): one product per output,
            # [out, shared] @ [shared, in] per example, straight into that output's block, with no
            # stacking of g and no copy of the product (EmbedBlock's Jacobians about 6% faster).
            # A convolution's g (contiguous in positions) keeps the stacked product below: one
            # product per output was slower there.
            shared, n_out, n_in = g.shape[-2], g.shape[-1], self.a.shape[-1]
            a = self.a.reshape(batch, shared, n_in)
            for o in range(outputs):
                g_o = g[o].reshape(batch, shared, n_out).transpose(1, 2)
                block = target[o].view(batch, n_out, n_in)
                if first:
                    torch.bmm(g_o, a, out=block)
                else:
                    block.baddbmm_(g_o, a)
            return True
        else:
            # One product per example (and group) with every output's rows stacked,
            # [outputs * out, shared] @ [shared, in], rather than one per output (which repeats
            # ``a`` for every output and multiplies matrices of only ``out`` rows). The stacking
            # copies ``g`` keeping its contiguous axis last (``out`` for a Linear, ``shared`` for a
            # convolution's output-gradient).
            if g.stride(-1) == 1:
                rows = rearrange(
                    g, "outputs batch ... shared out -> batch ... shared (outputs out)"
                )
                rows = rows.transpose(-1, -2)
            else:
                rows = rearrange(
                    g, "outputs batch ... shared out -> batch ... (outputs out) shared"
                )
            per_example = into.transpose(0, 1)  # [batch, outputs, *groups, out, in]
            if math.prod(groups) == 1 and per_example.is_contiguous():
                # the product's [batch, (outputs out), in] is the result's own layout: written
                # straight into it, no copy
                n_rows, n_in = outputs * g.shape[-1], self.a.shape[-1]
                rows = rows.reshape(batch, n_rows, g.shape[-2])
                result = per_example.view(batch, n_rows, n_in)
                a = self.a.reshape(batch, g.shape[-2], n_in)
                if first:
                    torch.bmm(rows, a, out=result)
                else:
                    result.baddbmm_(rows, a)
                return True
            value = rearrange(
                torch.matmul(rows, self.a),
                "batch ... (outputs out) inp -> outputs batch ... out inp",
                outputs=outputs,
            )
        if value is not None:
            if first:
                target.copy_(value)
            else:
                target.add_(value)
        return True

    def grad1(self, param_shape: torch.Size, scale: float = 1.0) -> Tensor:
        g, a = self.g, self.g if self.a is None else self.a
        differentiable = torch.is_grad_enabled() and (g.requires_grad or a.requires_grad)
        if differentiable or _torch.in_transform(g, a):
            # A create_graph backward (grad1 gets a graph: no out= writes), or inside vmap (the
            # Jacobians batch the backward over outputs: no in-place writes into a buffer that
            # is not batched like the operands).
            if self.a is None:
                out = g.sum(-2)
            else:
                out = torch.matmul(g.transpose(-1, -2), a)
            return (out * scale if scale != 1.0 else out).reshape(self.batch_size, *param_shape)
        out = g.new_empty((self.batch_size, *param_shape), dtype=_result_dtype(g, a))
        self.grad1_into(out, scale)
        return out

    def grad1_into(self, out: Tensor, scale: float = 1.0, accumulate: bool = False) -> None:
        a, g = self.a, self.g
        if out.dtype != _result_dtype(g, g if a is None else a) or not out.is_contiguous():
            return super().grad1_into(out, scale, accumulate)
        shared, n_out = g.shape[-2], g.shape[-1]
        if a is None:  # a bias: sum over shared positions
            shape = (*g.shape[:-2], n_out)
            result = out if out.shape == shape else out.view(shape)  # (no view of the same)
            # (one shared position: the sum is the rows themselves, one kernel fewer)
            rows = g.reshape(result.shape) if shared == 1 else g.sum(-2) if accumulate else None
            if accumulate:
                result.add_(rows, alpha=scale)
            elif rows is not None and scale != 1.0:
                torch.mul(rows, as_scale(scale, rows), out=result)
            elif rows is not None:
                result.copy_(rows)
            else:
                torch.sum(g, -2, out=result)
                if scale != 1.0:
                    result.mul_(scale)
            return
        # Every float of the result is written once, straight into ``out``: the mean scale is
        # folded into the smaller operand (or into the matmul's alpha), accumulation into the
        # matmul's beta.
        n_in = a.shape[-1]
        result = out  # [batch * groups, out, in] (no view of the same shape)
        if out.dim() != 3 or out.shape[1] != n_out or out.shape[2] != n_in:
            result = out.view(-1, n_out, n_in)
        if shared == 1:
            # One shared position: a broadcast multiply, faster than a matmul with an inner
            # dimension of one.
            g = g.reshape(-1, n_out, 1)
            if a.dim() != 3 or a.shape[1] != 1:  # (else [batch, 1, in] already)
                a = a.reshape(-1, 1, n_in)
            # (float16's range ends at 65504: an operand times the scale, the batch under a
            # mean, may pass it where the product, what grad1 holds, does not; there the
            # product is scaled, in one more pass)
            late = scale != 1.0 and g.dtype == torch.float16
            if scale != 1.0 and not late:
                if n_out <= n_in:
                    g = g * as_scale(scale, g)
                else:
                    a = a * as_scale(scale, a)
            if accumulate:
                result.addcmul_(g, a, value=scale if late else 1.0)
            else:
                torch.mul(g, a, out=result)
                if late:
                    result.mul_(as_scale(scale, result))
        elif n_in <= TUNING.narrow_in_features < n_out and devices.cpu_trade_offs(out):
            # (a narrow input, TUNING.narrow_in_features: the transposed product, copied)
            t = torch.bmm(a.reshape(-1, shared, n_in).transpose(1, 2), g.reshape(-1, shared, n_out))
            if accumulate:
                result.add_(t.transpose(1, 2), alpha=scale)
            else:
                result.copy_(t.transpose(1, 2))
                if scale != 1.0:
                    result.mul_(scale)
        else:
            g_t = _stacked(g, shared, n_out).transpose(1, 2)  # [batch * groups, out, shared]
            a = _stacked(a, shared, n_in)
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
        return Direct(self.value if rows == _ALL else self.value[rows])

    @property
    def example_elements(self) -> int | None:
        return math.prod(self.value.shape[1:])

    def grad1(self, param_shape: torch.Size, scale: float = 1.0) -> Tensor:
        return _shaped(_scaled(self.value, scale), (self.batch_size, *param_shape))

    def grad1_into(self, out: Tensor, scale: float = 1.0, accumulate: bool = False) -> None:
        """Written: the value times the scale straight into ``out`` (one operation, no
        temporary)."""
        v = self.value
        if accumulate or not _same(out, v):
            return super().grad1_into(out, scale, accumulate)
        v = _shaped(v, out.shape)
        if scale == 1.0:
            out.copy_(v)
        else:
            torch.mul(v, as_scale(scale, v), out=out)

    def batch_sum(self, param_shape: torch.Size, weights: Tensor | None = None) -> Tensor:
        """Weighted by example: one product of the weights and the rows (no weighted copy of
        the rows)."""
        v = self.value
        if weights is None or v.dim() < 2 or type(v) is not Tensor:
            return _weighted(v, weights).sum(0).reshape(param_shape)
        w = weights if weights.dtype is v.dtype else weights.to(v.dtype)
        rows = v if v.dim() == 2 else v.reshape(v.shape[0], -1)  # [batch, entries]
        return _shaped(w @ rows, param_shape)

    def add_batch_sum(self, out: Tensor, weights: Tensor | None = None) -> None:
        """Weighted by example: one ``addmv_`` of the rows into ``out``."""
        v = self.value
        if weights is None or not out.is_contiguous() or not _same(out, v):
            return super().add_batch_sum(out, weights)
        w = weights if weights.dtype is v.dtype else weights.to(v.dtype)
        out.view(-1).addmv_(v.reshape(v.shape[0], -1).T, w)

    def sum_sq(self, param_shape: torch.Size) -> Tensor | None:
        return (self.value**2).sum(0).reshape(param_shape)

    def sq_norm(
        self, param_shape: torch.Size, scale: float, with_sum: bool = False
    ) -> tuple[Tensor, str, Tensor | None] | None:
        """The rows' norms (``grad1`` itself: not reshaped and scaled first where its sum is
        not wanted)."""
        v = self.value
        if with_sum or v.dim() < 2:
            return _from_grad1(self.grad1(param_shape, scale), param_shape, with_sum)
        return _sq_row_norms(v, scale), "direct", None

    def in_dtype(self, dtype: torch.dtype) -> Piece:
        v = self.value
        return self if v.dtype is dtype or not _other(v, dtype) else Direct(cast(v, dtype))


@dataclass
class Rows(Piece):
    """A gradient that adds vectors into rows of a ``[num_rows, dim]`` parameter (an embedding
    table): ``grad1[b, n] = Σ_{entries e with example[e] = b and index[e] = n} g[e]``.

    A sparse (coordinate) layout: ``example``, ``index``: ``[entries]`` (int64), ``g``:
    ``[entries, dim]``; ``batch`` the number of examples (entries of every example may be
    absent), ``num_rows`` the parameter's first dimension. Entries the parameter does not get a
    gradient from (``padding_idx``) are left out by the rule (or have ``g = 0``).
    ``positions``: set when every example has exactly that many entries, in order
    (``example[e] = e // positions``: an Embedding's ``[batch, positions]`` lookups), which
    lets inner products with an :class:`Outer` piece of a tied weight batch over examples.

    ``grad1`` is one scatter-add into ``[batch * num_rows, dim]``; norms and squared sums are
    computed on the rows the examples touched (at most ``entries``), never on
    ``[batch, num_rows, dim]``: see :func:`rows_compact`.

    An ``index`` outside ``[0, num_rows)`` or an ``example`` outside ``[0, batch)`` (which
    the scatter would add into another example's rows) is refused with a
    :class:`~gradhooks.RuleError` where the piece is made, on the CPU; on a GPU, where the
    check would wait for the device, it is not read back: :func:`gradhooks.check_rule` finds
    it.
    """

    example: Tensor
    index: Tensor
    g: Tensor
    batch: int
    num_rows: int
    positions: int | None = None

    def __post_init__(self) -> None:
        # (an index past num_rows would land in the next example's rows of grad1, silently:
        # checked where reading it back costs no wait, on the CPU; gradhooks.check_rule
        # finds it anywhere)
        for what, t, bound in (("index", self.index, self.num_rows),
                               ("example", self.example, self.batch)):  # fmt: skip
            if not t.numel() or not devices.reads_are_free(t) or _torch.in_transform(t):
                continue
            lo, hi = int(t.min()), int(t.max())
            if lo < 0 or hi >= bound:
                bad = lo if lo < 0 else hi
                raise RuleError(
                    f"Rows({what}=...) holds {bad}, outside [0, {bound - 1}]: {what} is each "
                    f"entry's {'row of the parameter' if what == 'index' else 'example'}, less "
                    f"than {'num_rows' if what == 'index' else 'batch'}={bound} (Rows(example, "
                    f"index, g, batch={self.batch}, num_rows={self.num_rows}); g of shape "
                    f"{tuple(self.g.shape)}): check the rule with gradhooks.check_rule"
                )

    @classmethod
    def checked_before(
        cls, example: Tensor, index: Tensor, g: Tensor, batch: int, num_rows: int,
        positions: int | None = None,
    ) -> Rows:  # fmt: skip
        """A piece as the constructor makes it, without its range check (two reductions read
        back, about 14 µs): for gradhooks' own rules, whose indices are those torch's lookup
        took, and for a piece remade from one that was checked."""
        piece = cls.__new__(cls)
        piece.__dict__.update(
            example=example, index=index, g=g, batch=batch, num_rows=num_rows, positions=positions
        )
        return piece

    @property
    def batch_size(self) -> int:
        return self.batch

    @property
    def example_elements(self) -> int | None:
        return self.num_rows * self.g.shape[-1]

    def keys(self) -> Tensor:
        """``example * num_rows + index``: the entry's row in ``grad1.view(-1, dim)`` (one
        ``add`` with ``alpha``: exact, in integers)."""
        return torch.add(self.index, self.example, alpha=self.num_rows)

    @property
    def kept_elements(self) -> float:
        """One scatter of its lookups' gradients gives the batch sum."""
        return self.g.numel() + 2 * self.index.numel()

    adds_rows: ClassVar[bool] = True

    def batch_sum(self, param_shape: torch.Size, weights: Tensor | None = None) -> Tensor:
        g = self.g if weights is None else self.g * weights.to(self.g.dtype)[self.example, None]
        out = self.g.new_zeros(self.num_rows, self.g.shape[-1])
        return out.index_add_(0, self.index, g).reshape(param_shape)

    def add_batch_sum(self, out: Tensor, weights: Tensor | None = None) -> None:
        """One ``index_add_`` of the rows looked up into ``out``: the other rows are not
        touched (no table of zeros, no second pass over the table)."""
        if not out.is_contiguous() or not _same(out, self.g):
            return super().add_batch_sum(out, weights)
        g = self.g if weights is None else self.g * weights.to(self.g.dtype)[self.example, None]
        out.view(self.num_rows, g.shape[-1]).index_add_(0, self.index, g)

    def sum_sq(self, param_shape: torch.Size) -> Tensor | None:
        return rows_sum_sq([(self, 1.0)], param_shape)

    def sq_norm(
        self, param_shape: torch.Size, scale: float, with_sum: bool = False
    ) -> tuple[Tensor, str, Tensor | None] | None:
        """Each lookup's ``‖g_e‖²``, except that the lookups of an example that hit the same row
        are summed first (``‖Σ_e g_e‖²``). Where lookups mostly hit distinct rows (see
        ``TUNING.rows_counted_min_lookups``), only those of shared rows (counted by ``bincount`` over
        ``example * num_rows + index``) are compacted; else :func:`rows_sq_norm` compacts all
        of them. (Its batch sum is one scatter: left to :meth:`batch_sum`.)"""
        keys = self.keys()  # [lookups]
        lookups, table = keys.numel(), self.batch * self.num_rows
        shared = None
        if (
            lookups >= TUNING.rows_counted_min_lookups
            and 2 * table <= lookups * self.g.shape[-1]
            and devices.reads_are_free(keys)  # (the count decides)
        ):
            shared = torch.bincount(keys, minlength=table)[keys] > 1  # [lookups]
            if int(shared.sum()) > TUNING.rows_counted_max_shared * lookups:
                shared = None
        if shared is None:  # (the scale on the [batch] result: fewer multiplications)
            return rows_sq_norm([(self, 1.0)]) * scale**2, "rows", None
        sq = torch.linalg.vector_norm(self.g, dim=-1).square()  # [lookups]
        out = sq.new_zeros(self.batch).index_add_(0, self.example, sq.masked_fill(shared, 0))
        if bool(shared.any()):
            rows, inverse = torch.unique(keys[shared], return_inverse=True)
            summed = self.g.new_zeros(rows.numel(), self.g.shape[-1])
            summed.index_add_(0, inverse, self.g[shared])
            norms = torch.linalg.vector_norm(summed, dim=-1).square()
            out.index_add_(0, rows // self.num_rows, norms)
        return out * scale**2, "rows", None

    def merged(self, param_shape: torch.Size, outer: int, batch: int, inner: int) -> Piece:
        """The entries are renumbered to their examples."""
        if outer == 1 and inner == 1:
            return self
        example = torch.div(self.example, inner, rounding_mode="floor") % batch
        positions = self.positions * inner if self.positions is not None and outer == 1 else None
        return Rows.checked_before(example, self.index, self.g, batch, self.num_rows, positions)

    def owned(self, param_shape: torch.Size, owners: Tensor, batch: int) -> Piece:
        """The entries are renumbered to their rows' examples."""
        example = owners.to(self.example.device)[self.example]
        return Rows.checked_before(example, self.index, self.g, batch, self.num_rows)

    def in_dtype(self, dtype: torch.dtype) -> Piece:
        if not _other(self.g, dtype):
            return self
        return Rows.checked_before(self.example, self.index, cast(self.g, dtype), self.batch, self.num_rows,
                    self.positions)  # fmt: skip

    def select(self, rows: slice) -> Rows:
        """(A slice with step 1.) Where every example's entries lie together in order
        (:attr:`positions`), or the slice takes them all, a slice of the entries: no mask,
        whose number of entries a device would have to count for the host."""
        start, stop, _ = rows.indices(self.batch)
        stop = max(start, stop)
        if start == 0 and stop == self.batch:
            return Rows.checked_before(self.example, self.index, self.g, self.batch, self.num_rows,
                        self.positions)  # fmt: skip
        if self.positions is not None:
            entries = slice(start * self.positions, stop * self.positions)
            return Rows.checked_before(self.example[entries] - start, self.index[entries], self.g[entries],
                        stop - start, self.num_rows, self.positions)  # fmt: skip
        keep = (self.example >= start) & (self.example < stop)
        return Rows.checked_before(
            self.example[keep] - start,
            self.index[keep],
            self.g[keep],
            stop - start,
            self.num_rows,
            self.positions,
        )

    def grad1(self, param_shape: torch.Size, scale: float = 1.0) -> Tensor:
        g = _scaled(self.g, scale)
        differentiable = torch.is_grad_enabled() and g.requires_grad
        if differentiable or _torch.in_transform(g):
            out = g.new_zeros(self.batch * self.num_rows, g.shape[-1])
            out = out.index_add(0, self.keys(), g)
            return out.reshape(self.batch, *param_shape)
        out = g.new_empty((self.batch, *param_shape))
        self.grad1_into(out, scale)
        return out

    def grad1_into(self, out: Tensor, scale: float = 1.0, accumulate: bool = False) -> None:
        """One scatter-add into ``out``, zeroed first unless ``accumulate``: where ``out`` is
        a reused ``grad1`` that an earlier call left as it was, only in the rows that call
        wrote (:func:`_rows_written`; zeroing all of an embedding's ``grad1`` costs more than
        the scatter), else everywhere."""
        if out.dtype != self.g.dtype or not out.is_contiguous():
            return super().grad1_into(out, scale, accumulate)
        flat = out.view(self.batch * self.num_rows, self.g.shape[-1])
        keys = self.keys()
        if not accumulate and _every_row_once_in_order(keys, flat.shape[0]):
            # each example looks up every row once, in order (learned positions over the full
            # context): grad1 is the entries themselves, no zeroing and no scatter
            if scale != 1.0:
                torch.mul(self.g, scale, out=flat)
            else:
                flat.copy_(self.g)
            _record_rows(out, None)
            return
        written = _rows_written(out)
        if not accumulate:
            if written is None:
                flat.zero_()
            else:
                flat.index_fill_(0, written, 0)
            written = keys
        elif written is not None and written.numel() + keys.numel() <= flat.shape[0]:
            written = torch.cat([written, keys])
        else:  # unknown, or more entries than rows (zeroing all of it is then cheaper)
            written = None
        # the scale on the entries: index_add_'s alpha is slower (single-threaded on CPU)
        flat.index_add_(0, keys, _scaled(self.g, scale))
        _record_rows(out, written)

    def jacobian_into(self, into: Tensor, scale: float, first: bool) -> bool:
        """Under ``vmap`` over the outputs (:func:`gradhooks.jacobians`): ``g`` is batched,
        ``[outputs, entries, dim]``, ``example`` and ``index`` are not. Write the Jacobian,
        ``into`` ``[outputs, batch, num_rows, dim]`` (any strides), by zeroing it (if
        ``first``) and one accumulating scatter of every entry's ``[outputs, dim]`` block; the
        generic path would build ``grad1`` batched (a zero-filled copy per call) and copy it.
        Returns False where that path must be used (``g`` not batched over the outputs)."""
        g = _torch.unbatched(self.g)
        if g is None or any(_torch.is_batched(t) for t in (self.example, self.index)):
            return False
        if g.dim() != 3 or into.dim() != 4:
            return False
        target = into.permute(1, 2, 0, 3)  # [batch, num_rows, outputs, dim], a view
        if first:
            target.zero_()
        values = _scaled(g, scale).transpose(0, 1)  # [entries, outputs, dim]
        target.index_put_((self.example, self.index), values, accumulate=True)
        return True


def rows_compact(pieces: list[tuple[Rows, float]]) -> tuple[Tensor, list[Tensor]]:
    """The rows that the (scaled) :class:`Rows` pieces of one parameter touch, per example:
    ``(keys, values)`` with ``keys`` ``[rows]`` the distinct ``example * num_rows + index`` and
    ``values[j]`` ``[rows, dim]`` piece ``j``'s (scaled) gradient in those rows. Every row of
    ``grad1`` not in ``keys`` is zero, so norms, inner products and squared sums of ``grad1``
    are those of the compact rows: ``O(entries · dim)``, never ``batch · num_rows · dim``.

    Off the CPU, where ``torch.unique`` would wait for the device to count the distinct rows,
    there is a slot per entry: the distinct rows first, then rows of zeros under key 0, which
    add nothing wherever they are summed (no shape depends on the values)."""
    keys = [p.keys() for p, _ in pieces]
    every = keys[0] if len(keys) == 1 else torch.cat(keys)
    if devices.reads_are_free(every):
        unique, inverse = torch.unique(every, return_inverse=True)
        rows = unique.numel()
    else:
        rows = every.numel()
        ordered, order = torch.sort(every)
        new = torch.ones_like(ordered, dtype=torch.bool)
        if rows > 1:
            torch.ne(ordered[1:], ordered[:-1], out=new[1:])
        slot = torch.cumsum(new, 0) - 1  # each sorted entry's distinct row
        inverse = torch.empty_like(slot).scatter_(0, order, slot)
        unique = torch.zeros_like(every).scatter_(0, slot, ordered)
    values, start = [], 0
    for (p, s), k in zip(pieces, keys, strict=True):
        inv = inverse[start : start + k.numel()]
        start += k.numel()
        # the scale after the scatter: index_add_'s alpha is slower (single-threaded on CPU)
        value = p.g.new_zeros(rows, p.g.shape[-1]).index_add_(0, inv, p.g)
        values.append(value if s == 1.0 else value.mul_(s))
    return unique, values


def _same(out: Tensor, *ts: Tensor) -> bool:
    """Whether ``ts`` are plain tensors of ``out``'s dtype and device."""
    return type(out) is Tensor and all(
        type(t) is Tensor and t.dtype == out.dtype and t.device == out.device for t in ts
    )


# the slice of every example (``select(_ALL)``: the piece over the whole batch)
_ALL = slice(None)


def _scaled(t: Tensor, scale: float) -> Tensor:
    return t if scale == 1.0 else t * as_scale(scale, t)


# the scales multiplied by, as 0-dim float64 tensors on the CPU, by value (see as_scale)
_SCALES: dict[float, Tensor] = {}


def as_scale(scale: float, t: Tensor) -> Tensor | float:
    """``scale``, to multiply ``t`` by, as a 0-dim float64 tensor on the CPU made once per
    value, where ``t`` is on the CPU or a CUDA device (else the number itself): torch
    multiplies by it with the same result as by the Python number (a 0-dim tensor changes
    neither the result's dtype nor its device, and its value is rounded to the result's dtype
    as a number's is) in about half the host time (a Python number is wrapped into a tensor
    anew at each call). Made outside inference mode, so that autograd may save it."""
    if not (t.is_cpu or t.is_cuda):
        return scale
    found = _SCALES.get(scale)
    if found is None:
        with torch.inference_mode(False):
            found = torch.tensor(scale, dtype=torch.float64)
        if len(_SCALES) < 256:
            _SCALES[scale] = found
    return found


def _shaped(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``t.reshape(shape)``, or ``t`` itself where it has that shape (no view of the same
    shape: each view is an operation through torch's dispatcher)."""
    return t if t.shape == shape else t.reshape(shape)


def _stacked(t: Tensor, shared: int, features: int) -> Tensor:
    """``t`` ``[batch, *groups, shared, features]`` as ``[batch · groups, shared, features]``
    (itself where it has no groups)."""
    if t.dim() == 3 and t.shape[1] == shared and t.shape[2] == features:
        return t
    return t.reshape(-1, shared, features)


def _weighted(t: Tensor, weights: Tensor | None) -> Tensor:
    """``t`` ``[batch, ...]`` with example ``b``'s rows times ``weights[b]``."""
    if weights is None:
        return t
    w = weights.view(-1, *[1] * (t.dim() - 1))
    return t * (w if w.dtype is t.dtype else w.to(t.dtype))


def _sq_row_norms(rows: Tensor, scale: float) -> Tensor:
    """``‖scale · rows[b]‖²`` for each example ``b`` of ``rows`` ``[batch, ...]`` (two or more
    dimensions), ``[batch]``: one norm over each example's entries, scaled after."""
    norm = torch.linalg.vector_norm(rows, dim=tuple(range(1, rows.dim())))
    return _scaled(norm, scale).square()


def _from_grad1(
    g1: Tensor, param_shape: torch.Size, with_sum: bool
) -> tuple[Tensor, str, Tensor | None]:
    """The squared norms of ``grad1`` at hand, and its batch sum (``with_sum``)."""
    rows = flat_rows(g1)
    total = rows.sum(0).reshape(param_shape) if with_sum else None
    return torch.linalg.vector_norm(rows, dim=1).square(), "direct", total


def _result_dtype(g: Tensor, a: Tensor) -> torch.dtype:
    """``torch.result_type(g, a)``, without the call through torch's dispatcher where both
    have one dtype (a product's operands, nearly always)."""
    return g.dtype if a.dtype is g.dtype else torch.result_type(g, a)


def _other(t: Tensor | None, dtype: torch.dtype) -> bool:
    """``t`` is a real floating tensor of another dtype than ``dtype`` (a floating one)."""
    return t is not None and t.is_floating_point() and dtype.is_floating_point and t.dtype != dtype


def cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype`` where it is of another floating dtype (indices, complex: as they are)."""
    return t.to(dtype) if _other(t, dtype) else t


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which norms, squared sums and K-FAC factors of a parameter of ``dtype`` are
    formed: float32, or the parameter's own where it is wider (float64). A sum of squares over
    a whole parameter in bfloat16 or float16 would lose the norm's low digits (bfloat16 keeps
    8 bits) or overflow (float16 above 65504); in float32 it costs one conversion of the
    pieces."""
    if dtype is torch.float32 or dtype is torch.float64 or not dtype.is_floating_point:
        return dtype  # (without a call through torch's dispatcher, for the usual two)
    return torch.promote_types(dtype, torch.float32)


# A buffer Rows.grad1_into wrote -> (its version counter then, the rows written). Keyed by the
# tensor object (not by value), dropped when it is freed.
_ROWS_WRITTEN: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _every_row_once_in_order(keys: Tensor, rows: int) -> bool:
    """``keys`` is ``0, 1, ..., rows - 1`` (asked where reading the answer back is free)."""
    return (
        keys.numel() == rows
        and devices.reads_are_free(keys)
        and torch.equal(keys, torch.arange(rows, device=keys.device))
    )


def _rows_written(out: Tensor) -> Tensor | None:
    """The rows of ``out`` (as ``[-1, dim]``) outside which it is zero, as the last
    :meth:`Rows.grad1_into` into it recorded them, if ``out`` has not been written since (its
    version counter, which its views share and every in-place change bumps, is as that call
    left it); else ``None``. Writes that autograd does not see either (through ``.data`` or a
    NumPy array of ``grad1``) are not seen."""
    record = _ROWS_WRITTEN.get(out)
    if record is None or out.is_inference():
        return None
    version, rows = record
    return rows if version == _torch.version(out) else None


def _record_rows(out: Tensor, rows: Tensor | None) -> None:
    """Record for :func:`_rows_written` that ``out`` is zero outside ``rows`` (``None``:
    unknown)."""
    if out.is_inference() or rows is None:
        _ROWS_WRITTEN.pop(out, None)
    else:
        _ROWS_WRITTEN[out] = (_torch.version(out), rows)


# -- products of two pieces of one parameter (a reused module, a tied weight) -------------------
# All results are *unscaled* (``scale = 1``): the caller multiplies by the engine's scale.


def gram_is_cheaper(p: Piece, q: Piece) -> bool:
    """Whether the per-example inner product of two :class:`Outer` pieces should use the Gram
    form ``⟨a_p a_qᵀ, g_p g_qᵀ⟩`` (two ``[shared_p, shared_q]`` matrices per example and group)
    rather than materialize ``[out, in]`` per example, by multiply-adds per example: the Gram
    form costs ``T_p·T_q·(in + out)`` (:attr:`Outer.gram_macs` for one piece), materializing
    ``(T_p + T_q)·in·out`` (``T·in·out`` and a pass over the result for one piece, plus what a
    convolution's duplicated columns cost). So a Linear over ``T`` positions takes the Gram form
    while ``T < in·out / (in + out)``: GPT-2's output layer (256 to 50,257) up to ``T = 254``.
    Bias pieces (``a is None``) are always cheap: they reduce over ``shared`` first."""
    if not (isinstance(p, Outer) and isinstance(q, Outer)):
        return False
    if p.has_input != q.has_input:
        return False
    if not p.has_input:
        return p.g.shape[-1] == q.g.shape[-1]
    if p.in_features != q.in_features or p.g.shape[-1] != q.g.shape[-1]:
        return False
    area = p.in_features * p.g.shape[-1]
    if p is q:
        groups, shared = math.prod(p.g.shape[1:-2]), p.g.shape[-2]
        return p.gram_macs < groups * (shared + TUNING.pass_macs) * area + p.grad1_extra_macs
    tp, tq = p.g.shape[-2], q.g.shape[-2]
    return tp * tq * (p.in_features + p.g.shape[-1]) < (tp + tq + TUNING.pass_macs) * area


def inner(p: Piece, q: Piece, param_shape: torch.Size) -> Tensor:
    """Per-example inner product ``⟨grad1_p[b], grad1_q[b]⟩`` of two pieces of one parameter
    (unscaled), shape ``[batch]``. ``p is q`` gives the squared norm.

    :class:`Outer` with one shared position: ``(a_p·a_q)(g_p·g_q)`` (Goodfellow). Several shared
    positions: the Gram form ``Σ_{s,t} (a_p[s]·a_q[t]) (g_p[s]·g_q[t])`` when
    :func:`gram_is_cheaper`, else both gradients are materialized (one parameter at a time)."""
    if gram_is_cheaper(p, q):
        assert isinstance(p, Outer) and isinstance(q, Outer)
        if not p.has_input:  # bias: Σ_shared g, then a dot product
            both = p.g.sum(-2) * q.g.sum(-2)
            return both.sum(tuple(range(1, both.dim())))
        # letters: b batch, s/t shared positions of p/q, i in, o out; '...' the groups
        aa = p.input_gram(q)
        gg = batched_nt(p.g, q.g)
        return (aa * gg).sum(tuple(range(1, aa.dim())))
    gp = p.grad1(param_shape)
    gp = flat_rows(gp)
    gq = gp if q is p else flat_rows(q.grad1(param_shape))
    return (gp * gq).sum(1)


def gram_sq_norm(p: Piece, param_shape: torch.Size) -> tuple[Tensor, Tensor | None]:
    """``inner(p, p)`` (unscaled), and, where that takes the Gram form of an input's outer
    product, the scale of its rounding, ``[batch]``: ``Σ_s ‖a[s]‖·‖g[s]‖`` over the example's
    shared positions (and groups), read from the two Grams' diagonals. Each Gram entry rounds
    relative to ``‖a[s]‖·‖a[t]‖`` (``‖g[s]‖·‖g[t]‖``), so the squared norm is off by about
    ``eps · scale²`` however small it is: where the positions' gradients cancel (a norm far
    below ``scale``) the Gram form keeps fewer digits than ``grad1`` formed, whose entries
    round relative to ``scale``. ``None``: not the Gram form of an input (exact as ``grad1``)."""
    if not (gram_is_cheaper(p, p) and p.has_input):
        return inner(p, p, param_shape), None
    assert isinstance(p, Outer)
    # (the diagonal of the product of the Grams is the product of their diagonals)
    both = p.input_gram(p) * batched_nt(p.g, p.g)  # [batch, *groups, shared, shared]
    sq = both.sum(tuple(range(1, both.dim())))
    diagonal = both.diagonal(dim1=-2, dim2=-1)  # [batch, *groups, shared]
    return sq, diagonal.clamp_min(0).sqrt().sum(tuple(range(1, diagonal.dim())))


def rows_sq_norm(pieces: list[tuple[Rows, float]]) -> Tensor:
    """``‖Σ_j scale_j grad1_j[b]‖²`` for :class:`Rows` pieces of one parameter, ``[batch]``."""
    keys, values = rows_compact(pieces)
    total = values[0] if len(values) == 1 else torch.stack(values).sum(0)
    batch = pieces[0][0].batch
    out = total.new_zeros(batch)
    sq = torch.linalg.vector_norm(total, dim=1).square()
    return out.index_add_(0, keys // pieces[0][0].num_rows, sq)


def rows_sum_sq(pieces: list[tuple[Rows, float]], param_shape: torch.Size) -> Tensor:
    """``Σ_b (Σ_j scale_j grad1_j[b])²`` for :class:`Rows` pieces of one parameter."""
    keys, values = rows_compact(pieces)
    total = values[0] if len(values) == 1 else torch.stack(values).sum(0)
    out = total.new_zeros(pieces[0][0].num_rows, total.shape[-1])
    return out.index_add_(0, keys % pieces[0][0].num_rows, total.pow(2)).reshape(param_shape)


def rows_outer_inner(p: Rows, q: Outer) -> Tensor | None:
    """Per-example ``⟨grad1_p[b], grad1_q[b]⟩`` of a :class:`Rows` piece and a
    :class:`Outer` piece of the same ``[num_rows, dim]`` weight (an embedding tied to an
    output Linear), without materializing either: with ``q``'s ``a`` ``[batch, shared, dim]``
    and ``g`` ``[batch, shared, num_rows]``,

        ⟨Σ_e onehot(index_e) g_eᵀ, Σ_t g_q[t] a[t]ᵀ⟩ = Σ_e Σ_t g_q[t, index_e] (a[t] · g_e)

    (``O(batch · positions · shared · dim)``). ``None`` where this does not apply (``q`` has
    groups or no input, ``p`` has no fixed ``positions``): the caller then materializes."""
    if p.positions is None or not q.has_input or q.g.dim() != 3 or q.g.shape[-1] != p.num_rows:
        return None
    dim = p.g.shape[-1]
    if q.in_features != dim or 2 * p.positions * q.g.shape[1] >= p.num_rows * dim:
        return None  # materializing [num_rows, dim] per example is cheaper
    a, gq = q.a, q.g  # [batch, shared, dim], [batch, shared, rows]
    # letters: b batch, t shared position of q, s position of p, d dim
    gp = p.g.reshape(p.batch, p.positions, dim)
    idx = p.index.reshape(p.batch, 1, p.positions).expand(-1, gq.shape[1], -1)
    ag = torch.bmm(a, gp.transpose(1, 2))
    return (ag * gq.gather(2, idx)).flatten(1).sum(1)


def batched_nt(x: Tensor, y: Tensor) -> Tensor:
    """``x yᵀ`` per leading index: ``[..., s, i]`` and ``[..., t, i]`` give ``[..., s, t]``.
    One ``bmm`` (``einsum`` reaches the same product through a dozen views and permutes, each
    a pass through torch's dispatcher: host time a GPU pays at every call)."""
    if x.dim() == 3:
        return torch.bmm(x, y.transpose(1, 2))
    lead = x.shape[:-2]
    out = torch.bmm(x.reshape(-1, *x.shape[-2:]), y.reshape(-1, *y.shape[-2:]).transpose(1, 2))
    return out.view(*lead, x.shape[-2], y.shape[-2])


def flat_rows(t: Tensor) -> Tensor:
    """``t`` ``[batch, *shape]`` as ``[batch, numel of shape]`` (a 0-d parameter's ``grad1`` is
    ``[batch]``; an empty batch keeps its row length)."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


def example_weights(batch: int, exact: bool = False) -> Tensor:
    """``[batch]`` float64 weights in ``[1, 2)``, all different (the fractional parts of
    multiples of the golden ratio): the checks compare ``Σ_i weights[i] · grad1[i]`` with the
    gradient autograd gives the examples' losses (or output rows) weighted alike, which sees an
    error in any example's ``grad1`` (a sum, all weights 1, would not see examples that
    cancel).

    ``exact``: powers of two instead, ``1``, ``2`` or ``4`` (by the same fractional parts, in
    thirds): multiplying by one rounds nothing, so a backward that rounds in a half precision
    (bfloat16, float16) carries each example's weighted rows as exactly the weight times its
    unweighted ones, through every layer, and the two sides of a check differ by the rounding
    of the final products alone, not by one rounding per layer."""
    frac = torch.remainder(torch.arange(1, batch + 1, dtype=torch.float64) * 0.6180339887, 1.0)
    if exact:
        return torch.exp2(torch.floor(3 * frac))
    return 1.0 + frac


class CallPieces(NamedTuple):
    """One call's pieces as a backward keeps them for later (a DP step's clipped sums, the
    check of the norms): ``pieces`` and the ``params`` they are of, by the same names, and the
    ``scale`` their batch sums are multiplied by (the batch size under a mean loss)."""

    pieces: dict[str, Piece]
    params: dict[str, Tensor]
    scale: float


def weighted_sums(kept: list[CallPieces], weights: Tensor) -> dict[int, Tensor | None]:
    """Per parameter id, ``Σ_b weights[b] grad1[b]`` (scaled) over a backward's calls, each
    kept as ``(pieces, params, scale)`` (:meth:`Piece.batch_sum` per piece, summed); ``None`` for a
    parameter whose layer counts its examples otherwise (bags of another number). All at
    once: :func:`uses_by_parameter` and :func:`weighted_sum` form one parameter's at a time."""
    return {pid: weighted_sum(uses, weights) for pid, uses in uses_by_parameter(kept).items()}


class PieceUse(NamedTuple):
    """One kept call's piece of a parameter (:func:`uses_by_parameter`)."""

    piece: Piece
    param: Tensor
    scale: float


def uses_by_parameter(kept: list[CallPieces]) -> dict[int, list[PieceUse]]:
    """A backward's kept calls (:class:`CallPieces`) by parameter id: the pieces of each, in
    the order of the calls."""
    uses: dict[int, list[PieceUse]] = {}
    for pieces, params, scale in kept:
        for name, p in params.items():
            uses.setdefault(id(p), []).append(PieceUse(pieces[name], p, scale))
    return uses


def weighted_rows(uses: list[PieceUse], weights: Tensor) -> Tensor | None:
    """:func:`weighted_sum` of a ``[num_rows, dim]`` parameter whose pieces are all
    :class:`Rows` (an embedding's), as a sparse COO tensor of the rows looked up alone
    (coalesced, one sparse dimension: as :func:`gradhooks.engine.compare.hold` holds a
    gradient), never a table of the parameter's size; ``None`` where the pieces are not all
    :class:`Rows` of such a parameter, or count their examples otherwise."""
    if not uses or any(use.piece.batch_size != weights.shape[0] for use in uses):
        return None
    p = uses[0].param
    if not all(type(use.piece) is Rows for use in uses) or p.dim() != 2:
        return None
    if any(use.piece.num_rows != p.shape[0] or use.piece.g.shape[-1] != p.shape[1]
           for use in uses):  # fmt: skip
        return None
    w = weights.to(p.device)
    index, values = [], []
    for piece, _, scale in uses:
        rows = piece.in_dtype(p.dtype)
        value = rows.g * w.to(rows.g.dtype)[rows.example, None]
        index.append(rows.index)
        values.append(value * scale if scale != 1.0 else value)
    index = index[0] if len(index) == 1 else torch.cat(index)
    value = values[0] if len(values) == 1 else torch.cat(values)
    unique, inverse = torch.unique(index, return_inverse=True)
    summed = value.new_zeros(unique.numel(), p.shape[1]).index_add_(0, inverse, value)
    return torch.sparse_coo_tensor(
        unique[None], summed, p.shape, is_coalesced=True, check_invariants=False
    )


def weighted_sum(uses: list[PieceUse], weights: Tensor) -> Tensor | None:
    """``Σ_b weights[b] grad1[b]`` (scaled) of one parameter from its pieces
    (:func:`uses_by_parameter`), of its shape; ``None`` where a piece counts its examples
    otherwise (bags of another number than ``weights``)."""
    if not uses or any(use.piece.batch_size != weights.shape[0] for use in uses):
        return None
    p, scale = uses[0].param, uses[0].scale
    w = weights.to(p.device)
    # (in the parameter's precision, as the norms are: pieces of a bfloat16 forward)
    if any(use.scale != scale for use in uses):
        return sum(piece.in_dtype(p.dtype).batch_sum(p.shape, w) * s for piece, p, s in uses)
    # (one tensor of the parameter's size, the pieces added into it in place)
    found = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
    for piece, _, _ in uses:
        piece.in_dtype(p.dtype).add_batch_sum(found, w)
    return found.mul_(scale) if scale != 1 else found

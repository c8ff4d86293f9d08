"""K-FAC Kronecker factors of one weight, and their accumulation from the pieces of backwards.

The conventions (``expand`` / ``reduce``, the bias augmentation, the mean and sum reductions) are
those of :mod:`gradhooks.workflows.kfac`, which computes the factors of a model in one call.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from .. import _torch
from ..errors import (
    ConfigurationError,
    ConfigurationTypeError,
    GradhooksWarning,
    UnsupportedError,
    require_number,
)
from ..pieces import Outer
from ..tuning import TUNING

__all__ = [
    "KFactors", "KFactorsInverse", "KfacAccumulator", "second_moment", "symmetric_eigh",
    "weight_matrix", "weight_from_matrix",
]  # fmt: skip


@dataclass
class KFactors:
    """Kronecker factors of one weight: ``torch.kron(G, A)`` approximates its curvature.

    ``A``: ``[*groups, in(+1), in(+1)]``; ``G``: ``[*groups, out, out]`` (a groups axis of
    size one, e.g. a Conv with ``groups=1``, is dropped); ``bias``: whether
    ``A`` is bias-augmented (then the weight is ``cat([W, b[..., None]], -1)``);
    ``bias_name``: the name of that bias parameter (``None`` without one).

    The weight as a matrix is its parameter reshaped to ``[*groups, out, in]``, row-major: a
    Linear's ``[out, in]`` as is, a convolution's ``[out, in/groups, *kernel]`` as
    ``[groups, out/groups, in/groups · prod(kernel)]``; ``torch.kron(G, A)`` approximates the
    curvature of that matrix (bias column appended) flattened, per group. A weight used as
    ``torch.addmm(b, x, W)`` with ``W`` ``[in, out]`` (Hugging Face's ``Conv1D``) is that
    matrix as it is: ``G`` ``[in, in]`` over its rows (from the inputs, summed like an
    output-gradient's), ``A`` ``[out, out]`` over its columns (from the output-gradients,
    averaged like an input's), and no bias column (the bias lies along the columns).

    ``layout``: ``"out_in"`` (the above); ``"in_out"`` for a weight whose first two axes are
    its inputs and outputs (a transposed convolution's ``[in, out/groups, *kernel]``): the
    matrix is ``[groups, out/groups, in/groups · prod(kernel)]``, those axes swapped per group,
    so that ``G`` is over the output channels and ``A`` over the input patch each output
    position reads (:func:`weight_matrix`)."""

    A: Tensor
    G: Tensor
    bias: bool
    bias_name: str | None = None
    layout: str = "out_in"

    def __post_init__(self) -> None:
        # (factors made by hand, or loaded: a wrong one would fail deep in an eigendecomposition
        # or, with an unknown layout, be applied as "in_out" silently)
        for name, f in (("A", self.A), ("G", self.G)):
            if not isinstance(f, Tensor) or f.dim() < 2 or f.shape[-1] != f.shape[-2]:
                what = tuple(f.shape) if isinstance(f, Tensor) else type(f).__qualname__
                raise ConfigurationTypeError(
                    f"KFactors: {name} must be a square matrix (or a stack of them) as a tensor "
                    f"[*groups, n, n], got {what}"
                )
        if self.A.shape[:-2] != self.G.shape[:-2]:
            raise ConfigurationError(
                f"KFactors: A {tuple(self.A.shape)} and G {tuple(self.G.shape)} must have the "
                "same groups in front of their matrices"
            )
        if self.layout not in ("out_in", "in_out"):
            raise ConfigurationError(
                f"KFactors: layout must be 'out_in' or 'in_out', got {self.layout!r}"
            )

    def inverse(self, damping: float, eigenvalues: Tensor | None = None) -> KFactorsInverse:
        """``(kron(G, A) + damping·I)⁻¹``, ready to apply to gradients (eigendecompositions of
        ``A`` and ``G``, computed here once). ``damping > 0``, added to the Kronecker product
        itself.

        ``eigenvalues``: the eigenvalue-corrected K-FAC (EK-FAC, George et al. 2018) in place
        of K-FAC: ``[*groups, out, in(+1)]``, the curvature's diagonal in the Kronecker
        eigenbasis (:func:`gradhooks.ekfac_eigenvalues`), used instead of ``λ_G λ_Aᵀ``:
        ``(Q_G ⊗ Q_A) (diag(eigenvalues) + damping·I)⁻¹ (Q_G ⊗ Q_A)ᵀ``."""
        require_number("damping", damping)
        if not 0 < damping < math.inf:  # (inf: every gradient preconditioned to 0)
            raise ConfigurationError(
                f"damping must be > 0 and finite, got {damping!r}: K-FAC factors are often "
                "singular (fewer examples than features, a ReLU's dead units)"
            )
        eig_a, q_a = symmetric_eigh(self.A)
        eig_g, q_g = symmetric_eigh(self.G)
        # (G ⊗ A + λI)⁻¹ = (Q_G ⊗ Q_A) (Λ_G ⊗ Λ_A + λI)⁻¹ (Q_G ⊗ Q_A)ᵀ; rounding can leave a
        # PSD factor's eigenvalues slightly negative: clamped
        if eigenvalues is None:
            diagonal = eig_g.clamp(min=0)[..., :, None] * eig_a.clamp(min=0)[..., None, :]
        else:
            diagonal = self._corrected(eigenvalues, eig_g, eig_a)
        scale = 1 / (diagonal + damping)
        return KFactorsInverse(q_a, q_g, scale, self.bias, self.bias_name, damping, self.layout)

    def matrix(self, weight: Tensor, bias: Tensor | None = None, batch_dims: int = 0) -> Tensor:
        """A gradient of the weight (and of its bias, where the factors are bias-augmented) as
        the matrix ``[*groups, out, in(+1)]`` the factors are of, the bias's as the last
        column; with ``batch_dims`` leading dimensions kept (``grad1``: 1), ``[*batch, *groups,
        out, in(+1)]``."""
        return factors_matrix(self, weight, bias, batch_dims)

    def eigenbasis(self) -> tuple[Tensor, Tensor]:
        """``(Q_G, Q_A)``: the eigenvectors of ``G`` and ``A`` (columns), as :meth:`inverse`
        takes them, in which :func:`gradhooks.ekfac_eigenvalues` measures the curvature."""
        return symmetric_eigh(self.G)[1], symmetric_eigh(self.A)[1]

    def _corrected(self, eigenvalues: Any, eig_g: Tensor, eig_a: Tensor) -> Tensor:
        shape = (*eig_g.shape, eig_a.shape[-1])
        if not isinstance(eigenvalues, Tensor):
            raise ConfigurationTypeError(
                f"KFactors.inverse: eigenvalues must be a tensor {shape} (ekfac_eigenvalues), "
                f"got {type(eigenvalues).__qualname__}"
            )
        if tuple(eigenvalues.shape) != shape:
            raise ConfigurationError(
                f"KFactors.inverse: eigenvalues of shape {tuple(eigenvalues.shape)} given to "
                f"factors of a {shape} weight matrix ([*groups, out, in"
                f"{' + 1 (bias column)' if self.bias else ''}]): eigenvalues of other factors"
            )
        if not bool(torch.isfinite(eigenvalues).all()) or bool((eigenvalues < 0).any()):
            raise ConfigurationError(
                "KFactors.inverse: eigenvalues must be finite and >= 0 (squares' means), got "
                f"values from {eigenvalues.min().item():g} to {eigenvalues.max().item():g}"
            )
        return eigenvalues.to(eig_g.dtype)


def symmetric_eigh(m: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.linalg.eigh(m)``, in float64 where it fails in a lower precision: LAPACK's
    float32 solver fails to converge on some matrices with many repeated eigenvalues (a
    factor of fewer examples than features: its zero eigenvalues; a softmax's Hessian at
    equal probabilities), depending on the processor's kernels; in float64 it converges."""
    try:
        return torch.linalg.eigh(m)
    except torch.linalg.LinAlgError:
        if m.dtype == torch.float64:
            raise
        values, vectors = torch.linalg.eigh(m.double())
        return values.to(m.dtype), vectors.to(m.dtype)


@dataclass
class KFactorsInverse:
    """``(kron(G, A) + damping·I)⁻¹`` of one weight, as :meth:`KFactors.inverse` returns it:
    the eigenvectors ``Q_A`` (``[*groups, in(+1), in(+1)]``) and ``Q_G`` (``[*groups, out,
    out]``) and ``scale = 1 / (λ_G λ_Aᵀ + damping)`` (``[*groups, out, in(+1)]``)."""

    Q_A: Tensor
    Q_G: Tensor
    scale: Tensor
    bias: bool
    bias_name: str | None
    damping: float
    layout: str = "out_in"

    def matrix(self, weight: Tensor, bias: Tensor | None = None, batch_dims: int = 0) -> Tensor:
        """A gradient of the weight (and of its bias, where the factors are bias-augmented) as
        the matrix ``[*groups, out, in(+1)]`` the factors are of, the bias's as the last
        column; with ``batch_dims`` leading dimensions kept (``grad1``: 1), ``[*batch, *groups,
        out, in(+1)]``."""
        return factors_matrix(self, weight, bias, batch_dims)

    def apply(self, grad: Tensor) -> Tensor:
        """``(kron(G, A) + damping·I)⁻¹ vec(grad)``, shaped as ``grad``: the weight's gradient
        as a matrix ``[*groups, out, in(+1)]`` (bias column appended when ``bias``; see
        :class:`KFactors`), or a stack of them, ``[..., *groups, out, in(+1)]`` (each example's
        gradient, for influence scores), each preconditioned alone."""
        if not isinstance(grad, Tensor):
            raise ConfigurationTypeError(
                f"K-FAC: apply takes the weight's gradient as a tensor [*groups, out, in], got "
                f"{type(grad).__qualname__}"
            )
        if grad.shape[grad.dim() - self.scale.dim() :] != self.scale.shape:
            raise ConfigurationError(
                f"K-FAC: a gradient of shape {tuple(grad.shape)} given to factors of a "
                f"{tuple(self.scale.shape)} weight matrix ([*groups, out, in"
                f"{' + 1 (bias column)' if self.bias else ''}]): reshape the weight's gradient "
                "to [*groups, out, in], e.g. grad.flatten(1) for a convolution"
                + (", and append the bias's as a column" if self.bias else "")
            )
        rotated = self.Q_G.mT @ grad.to(self.scale.dtype) @ self.Q_A
        return (self.Q_G @ (rotated * self.scale) @ self.Q_A.mT).to(grad.dtype)


def factors_matrix(
    f: KFactors | KFactorsInverse, weight: Tensor, bias: Tensor | None, batch_dims: int = 0
) -> Tensor:
    """:meth:`KFactors.matrix`: ``weight`` (``[*batch, *shape]``) as ``[*batch, *groups, out,
    in]``, ``bias`` (``[*batch, *bias_shape]``) appended as a column where given."""
    g = f.G if isinstance(f, KFactors) else f.Q_G
    groups, rows = tuple(g.shape[:-2]), g.shape[-1]
    if f.bias and bias is None:
        raise ConfigurationError(
            f"K-FAC: the factors cover a bias column ({f.bias_name!r}): give its gradient too"
        )
    batch = tuple(weight.shape[:batch_dims])
    flat = weight.reshape(-1, *weight.shape[batch_dims:]) if batch_dims else weight[None]
    if f.layout == "out_in":
        m = flat.reshape(flat.shape[0], *groups, rows, -1)
    else:
        kernel = math.prod(flat.shape[3:])  # (weight_matrix's "in_out", example by example)
        swapped = flat.reshape(flat.shape[0], math.prod(groups), -1, rows, kernel).transpose(2, 3)
        m = swapped.reshape(flat.shape[0], *groups, rows, -1)
    if f.bias:
        m = torch.cat([m, bias.reshape(flat.shape[0], *groups, rows, 1).to(m.dtype)], -1)
    return m.reshape(*batch, *m.shape[1:])


def weight_matrix(t: Tensor, groups: tuple[int, ...], rows: int, layout: str) -> Tensor:
    """A weight ``t`` (or its gradient, or a step) as the matrix ``[*groups, rows, cols]`` its
    factors are of (:class:`KFactors`): ``"out_in"``, ``t`` reshaped; ``"in_out"``, ``t``
    ``[groups · in/groups, rows, *kernel]`` with its first two axes swapped per group."""
    if layout == "out_in":
        return t.reshape(*groups, rows, -1)
    kernel = math.prod(t.shape[2:])
    swapped = t.reshape(math.prod(groups), -1, rows, kernel).transpose(1, 2)
    return swapped.reshape(*groups, rows, -1)


def weight_from_matrix(m: Tensor, shape: torch.Size, layout: str) -> Tensor:
    """The inverse of :func:`weight_matrix`: the matrix ``m`` as a tensor of the weight's
    ``shape``."""
    if layout == "out_in":
        return m.reshape(shape)
    kernel = math.prod(shape[2:])
    rows = m.shape[-2]
    return m.reshape(-1, rows, m.shape[-1] // kernel, kernel).transpose(1, 2).reshape(shape)


class KfacAccumulator:
    """Sums ``a aᵀ`` and ``g gᵀ`` of every ``Outer`` piece (with a non-``None`` ``a``)."""

    def __init__(self, names: dict[int, str] | None = None) -> None:
        self.names = names or {}  # id(param) -> its name (the first, for a tied weight)
        self.expand = True
        self.bias = True
        self.capture_a = True  # False: later backwards of the same forward add to G only
        # [batch, positions], bool: the positions whose inputs count in A (kfac(mask=...): a
        # tokenizer's attention mask), for the layers that see that many positions per example
        self.mask: Tensor | None = None
        self.masked: set[str] = set()  # the weights the mask applied to
        # the modules without a rule (the fallback's), by qualified name: their matrix-like
        # weights get no factors, and are listed (``unfactored``); set by the hooks' planning
        self.without_rule: frozenset[str] = frozenset()
        self.clear()

    def clear(self) -> None:
        self._a: dict[str, Tensor] = {}
        self._g: dict[str, Tensor] = {}
        self._n_a: dict[str, int] = {}
        self._n_g: dict[str, int] = {}
        self._biased: dict[str, bool] = {}
        self._bias_name: dict[str, str | None] = {}  # key -> the bias its A covers
        self._layout: dict[str, str] = {}  # key -> Outer.matrix_layout of its pieces
        self._batch_now: dict[str, int] = {}
        # key -> the batch size of every backward summed into G (-1 where they differ)
        self._g_batch: dict[str, int] = {}
        self._other: dict[str, str] = {}  # key -> a call whose piece gives no factors
        self._unfactored: dict[str, str] = {}  # key -> the call of a matrix-like weight without
        self._inputs_in_g: set[str] = set()  # keys of weights [in, out] (Outer.inputs_in_g)
        self.capture_a = True

    def restart(self, keys) -> None:
        """Forget what was summed for these weights (by name): their next backward starts
        afresh."""
        for key in keys:
            for sums in (self._a, self._g, self._n_a, self._n_g, self._biased, self._bias_name,
                         self._layout, self._batch_now, self._g_batch, self._other,
                         self._unfactored):  # fmt: skip
                sums.pop(key, None)
            self._inputs_in_g.discard(key)

    def add(self, module_name: str, call_pieces: dict, params: dict, scale: float) -> None:
        bias_pieces = [
            n for n, pc in call_pieces.items()
            if n in params and isinstance(pc, Outer) and not pc.has_input
        ]  # fmt: skip
        for pname, p in params.items():
            key = self.names.get(id(p), f"{module_name}.{pname}" if module_name else pname)
            piece = call_pieces[pname].kfac_view()
            if piece is None:
                # no Kronecker factors from this use (a bias, an embedding's rows, a norm's
                # scale); a weight tied to a Linear gets factors of that use only: said
                kind = type(call_pieces[pname]).__name__
                self._other.setdefault(key, f"'{module_name}' ({kind})")
                if module_name in self.without_rule and _matrix_like(p):
                    self._unfactored.setdefault(
                        key, f"'{key}' {tuple(p.shape)} (module '{module_name}')"
                    )
                continue
            # the bias is a column of the weight as a matrix [out, in] only where it lies
            # along its rows: not for torch.addmm(b, x, W) with W [in, out] (GPT-2's Conv1D),
            # whose bias lies along the columns, the output-gradient being the piece's a; its
            # factors then cover the weight alone
            bias_g = call_pieces[bias_pieces[0]].g if len(bias_pieces) == 1 else None
            biased = self.bias and bias_g is not None and bias_g is not piece.a
            layout = piece.matrix_layout
            if self._layout.setdefault(key, layout) != layout:
                raise UnsupportedError(
                    f"K-FAC: weight '{key}' is used by modules that lay it out differently "
                    f"({self._layout[key]!r}, and {layout!r} in '{module_name}': a weight tied "
                    "between a convolution and its transpose): no one pair of Kronecker factors "
                    "covers both uses; untie them for K-FAC"
                )
            if self._biased.get(key, biased) != biased:
                raise UnsupportedError(
                    f"K-FAC: weight '{key}' is used by modules with and without a bias (tied "
                    f"weights; this call: '{module_name}'), so no one bias-augmented factor fits "
                    "both: use bias=False"
                )
            mask = self.mask
            if (
                mask is not None
                and piece.a.shape[0] == mask.shape[0]
                and (piece.a.shape[-2] == mask.shape[1])
            ):
                self.masked.add(key)
            else:
                mask = None
            if piece.inputs_in_g:
                # a weight [in, out] (torch.addmm(b, x, W)): G is over its inputs, the piece's
                # g, read once per forward as any input is; A over its output-gradients, the
                # piece's a, summed over every backward of the forward as G is elsewhere
                self._inputs_in_g.add(key)
                biased = False  # (its bias lies along the columns: no column of A)
                if self.capture_a:
                    self._g[key] = second_moment(
                        self._g_rows(piece.g, piece.a, mask), into=self._g.get(key),
                        alpha=scale**2,
                    )  # fmt: skip
                physical = _torch.unbatched(piece.a)
                columns = [piece.a] if physical is None else physical.unbind(0)
                for column in columns:
                    a, count = _positions_seen(Outer(column, piece.g, piece.seen), self.expand,
                                               mask)  # fmt: skip
                    self._a[key] = second_moment(a, into=self._a.get(key), real_rows=count)
                if not self.capture_a:
                    continue
                batch = columns[0].shape[0]
            else:
                g = self._g_rows(piece.g, piece.a, mask)
                self._g[key] = second_moment(g, into=self._g.get(key), alpha=scale**2)
                if not self.capture_a:
                    continue  # (a later backward of the same forward: the input is not read,
                    # a convolution's columns never formed again)
                a, count = _positions_seen(piece, self.expand, mask)
                batch = piece.a.shape[0]
                self._a[key] = second_moment(
                    a, augment=biased, into=self._a.get(key), real_rows=count
                )
            self._n_a[key] = self._n_a.get(key, 0) + count
            self._biased[key] = biased
            self._batch_now[key] = batch
            if biased:
                (b,) = bias_pieces
                name = self.names.get(id(params[b]), f"{module_name}.{b}" if module_name else b)
                if self._bias_name.setdefault(key, name) != name:
                    self._bias_name[key] = None  # a weight tied across calls with other biases

    def _g_rows(self, g: Tensor, a: Tensor | None, mask: Tensor | None) -> Tensor:
        """The rows of ``g`` (``[batch, *groups, shared, out]``, or vmapped over several
        backwards) whose second moment is ``G``: the padding's out where ``mask`` applies to
        the piece (zero already for an output-gradient the loss leaves out, not for the
        inputs of a weight ``[in, out]``, whose ``g`` they are); each example's sum over its
        positions where reduced; several backwards' as more rows."""
        physical = _torch.unbatched(g)
        if physical is not None:  # vmapped over output-gradients (kfac()):
            # each column is one more backward of the same examples
            g = physical
        if mask is not None:
            lead = 0 if physical is None else 1
            groups = g.dim() - lead - 3
            seen = mask.to(g.device).view(mask.shape[0], *[1] * groups, mask.shape[1], 1)
            g = g * seen.to(g.dtype)
        if physical is not None:
            g = g.flatten(0, 1)
        if not self.expand:
            g = g.sum(-2, keepdim=True)
        return g

    def average_samples(self, samples: int) -> None:
        """Divide the output-gradients' factor of every weight by ``samples``, the backwards
        of sampled output-gradients summed into it (``kfac(fisher="mc", mc_samples=...)``):
        ``G``, or ``A`` for a weight ``[in, out]`` whose ``A`` is over them."""
        for key in self._g:
            if key in self._inputs_in_g:
                self._a[key] = self._a[key] / samples
            else:
                self._g[key] = self._g[key] / samples

    def end_backward(self) -> None:
        """G is normalized by examples, not by calls: count each example once per forward."""
        for key, batch in self._batch_now.items():
            self._n_g[key] = self._n_g.get(key, 0) + batch
            self._g_batch[key] = batch if self._g_batch.get(key, batch) == batch else -1
        self._batch_now = {}

    def mixed_batches(self) -> list[str]:
        """The weights whose ``G`` sums backwards of batches of different sizes."""
        return [key for key, batch in self._g_batch.items() if batch < 0]

    def rescale(self, factor: Callable[[int], float]) -> None:
        """Multiply each weight's ``G`` by ``factor(batch)²``, ``batch`` the size of the
        batches it sums (one size: :meth:`mixed_batches` lists the others): the output-gradients
        scaled by ``factor`` after the fact (:meth:`gradhooks.Hooks.rescale`)."""
        for key, batch in self._g_batch.items():
            if key in self._g and batch >= 0:
                self._g[key] = self._g[key] * factor(batch) ** 2

    @property
    def unfactored(self) -> dict[str, str]:
        """The weights of layers without a rule (a ``Bilinear``, your own module whose
        forward is not a Linear's or a convolution's), with at least two axes of size > 1,
        that got no factors, by name, each with the call that used it: the fallback gives
        their dense per-example gradient, not the inputs and output-gradients K-FAC is formed
        from. Not listed: the layers whose rule has no factors by construction (a norm's
        scale, an embedding's table, the biases), and the model's own parameters used in its
        forward outside its layers (a positional embedding), which the fallback of the model
        itself covers."""
        return {k: v for k, v in self._unfactored.items() if k not in self._a}

    def factors(
        self, reduction: Literal["mean", "sum"] = "mean", last: bool = False
    ) -> dict[str, KFactors]:
        """``last``: the sums are divided in place (nothing reads them again): no second copy
        of each factor (for a Linear over many features, ``A`` takes hundreds of MiB).

        ``reduction`` other than ``"mean"`` or ``"sum"`` is refused (taken as ``"sum"``, it
        gave ``G`` ``batch`` times too large).

        Warns (:class:`~gradhooks.errors.GradhooksWarning`) where a weight is left out
        (:attr:`unfactored`) or covered by one use only (a tied weight)."""
        if reduction not in ("mean", "sum"):
            raise ConfigurationError(
                f"K-FAC factors: reduction must be 'mean' (G divided by the examples) or 'sum', "
                f"got {reduction!r}"
            )
        missing = self.unfactored
        if missing:
            warnings.warn(
                f"gradhooks K-FAC: no Kronecker factors for {'; '.join(missing.values())}: a "
                "layer without a rule, whose dense per-example gradient (the fallback's) is not "
                "the inputs and output-gradients K-FAC is formed from, so the factors leave it "
                "out and preconditioning keeps its own gradient; register a rule that returns an "
                "Outer piece for it (docs/extending.md) to have its factors",
                GradhooksWarning,
                stacklevel=3,
            )
        partial = {k: self._other[k] for k in self._a if k in self._other}
        if partial:
            uses = "; ".join(f"'{k}' also used by {v}" for k, v in partial.items())
            warnings.warn(
                f"gradhooks K-FAC: the factors of {', '.join(map(repr, partial))} cover only "
                f"their uses as a Linear or convolution weight ({uses}, whose gradient has no "
                "Kronecker factors): the curvature of a tied weight's other uses is left out",
                GradhooksWarning,
                stacklevel=3,
            )
        out = {}
        for key, aa in self._a.items():
            gg = self._g[key]
            if reduction == "mean":
                n_g = max(self._n_g[key], 1)
                gg = gg.div_(n_g) if last else gg / n_g
            elif not last:
                gg = gg.clone()  # the next backward adds to the sum in place
            n_a = self._n_a[key]  # an int, or per group where the groups count differently
            if isinstance(n_a, Tensor):
                n_a = n_a.clamp(min=1).to(aa.device, aa.dtype).view(*aa.shape[:-2], 1, 1)
            else:
                n_a = max(n_a, 1)
            aa = aa.div_(n_a) if last else aa / n_a
            if aa.dim() == 3 and aa.shape[0] == 1:  # one group (Conv with groups=1): no axis
                aa, gg = aa[0], gg[0]
            layout = self._layout.get(key, "out_in")
            out[key] = KFactors(aa, gg, self._biased[key], self._bias_name.get(key), layout)
        return out


def _matrix_like(p: Tensor) -> bool:
    """Whether a parameter has at least two axes of size > 1 (a weight K-FAC would cover,
    not a scale or a bias)."""
    return sum(size > 1 for size in p.shape) >= 2


def _positions_seen(
    piece: Outer, expand: bool, mask: Tensor | None = None
) -> tuple[Tensor, int | Tensor]:
    """The inputs whose second moment is ``A`` (``[batch, *groups, shared', in]``) and how many
    positions (or, reduced, examples) they count: an ``int``, or per group (``[prod(groups)]``,
    int64) where the groups count differently. Where the piece marks padding
    (:attr:`Outer.seen`: an expert's rows padded to the most of one example, a packed
    sequence's steps past its end), or ``mask`` (``[batch, shared]``, bool) leaves positions
    out (a sequence's padding), only the positions seen count: ``expand``, their inputs
    (the padding zeroed) over their number; reduced, each example's mean over its own
    positions, over the examples with any (the others' rows zero)."""
    a, seen = piece.a, piece.seen
    if mask is not None:
        mask = mask.to(a.device)
        if seen is None:
            seen = mask
        elif seen.dim() == 2:
            seen = seen.to(a.device, torch.bool) & mask
        else:  # (per group: [batch, *groups, shared])
            per_group = mask.view(mask.shape[0], *[1] * (seen.dim() - 2), -1)
            seen = seen.to(a.device, torch.bool) & per_group
    batch, shared, groups = a.shape[0], a.shape[-2], a.shape[1:-2]
    if seen is None:
        if not expand:
            return a.mean(-2, keepdim=True), batch
        return a, batch * shared
    seen = seen.to(a.device)
    if seen.dim() == 2:  # (the same for every group)
        seen = seen.view(batch, *[1] * len(groups), shared).expand(batch, *groups, shared)
    a = a * seen[..., None].to(a.dtype)  # (an owned fold's padding is zero already; a rule's may
    # not be: a packed RNN's carried state)
    if expand:
        counts = seen.sum((0, -1))  # [*groups]
    else:
        per_example = seen.sum(-1)  # [batch, *groups]
        a = a.sum(-2, keepdim=True) / per_example.clamp(min=1)[..., None, None].to(a.dtype)
        counts = (per_example > 0).sum(0)
    counts = counts.reshape(-1).cpu()
    if bool((counts == counts[0]).all()):
        return a, int(counts[0])
    return a, counts


def second_moment(
    t: Tensor,
    augment: bool = False,
    into: Tensor | None = None,
    alpha: float = 1.0,
    real_rows: int | Tensor | None = None,
) -> Tensor:
    """``alpha · Σ_{b,s} t tᵀ`` of ``t`` ``[batch, *groups, shared, n]``: ``[*groups, n, n]``,
    added to ``into`` (the sum so far, ours to write) if given; with ``augment``, of ``t`` with
    a column of ones appended (``[*groups, n + 1, n + 1]``: the last row and column ``Σ t`` and
    the count, ``batch · shared`` unless ``real_rows`` says how many of the rows are real, the
    others zero padding; per group, ``[prod(groups)]``, where they differ), written around the
    product rather than appended to ``t`` (a copy of it).

    Without groups: one product over all ``(batch, shared)`` rows where they lie contiguous
    (a Linear's input) or are few per example (then copied into that order: each example's
    product would be mostly output); otherwise (a convolution's columns, whose positions are
    contiguous) one product per example, read in place: at once where the ``batch`` products
    are small, else accumulated one by one (measured on a 2-core CPU: up to 2.7x faster than
    one product over copied rows)."""
    batch, shared, n = t.shape[0], t.shape[-2], t.shape[-1]
    groups = t.shape[1:-2]
    count = math.prod(groups)
    width = n + 1 if augment else n
    if into is None:
        out, beta = t.new_empty(count, width, width), 0.0
    else:
        out, beta = into.view(count, width, width), 1.0
    core = out[:, :n, :n]
    flat = t.reshape(batch, count, shared, n)
    if count > 1:  # one product per group over all its rows
        rows = flat.transpose(0, 1).reshape(count, batch * shared, n)
        core.baddbmm_(rows.transpose(1, 2), rows, beta=beta, alpha=alpha)
    elif flat.stride(-1) == 1 or 4 * shared < n:
        rows = flat.reshape(batch * shared, n)
        core[0].addmm_(rows.T, rows, beta=beta, alpha=alpha)
    elif batch * n * n <= TUNING.kfac_products_at_once:
        per_example = flat[:, 0]
        total = torch.bmm(per_example.transpose(1, 2), per_example).sum(0)
        if beta:
            core[0].add_(total, alpha=alpha)
        else:
            torch.mul(total, alpha, out=core[0])
    else:
        if not beta:
            core[0].zero_()
        for x in flat[:, 0]:
            core[0].addmm_(x.T, x, alpha=alpha)
    if augment:  # the ones column: Σ t and the count, added to what is there (or to zeros)
        if not beta:
            out[:, n].zero_()
            out[:, :n, n].zero_()
        sums = flat.sum((0, 2)).mul_(alpha)  # [count, n]
        out[:, :n, n] += sums
        out[:, n, :n] += sums
        rows = batch * shared if real_rows is None else real_rows
        if isinstance(rows, Tensor):
            rows = rows.to(out.device, out.dtype)
        out[:, n, n] += alpha * rows
    return out.view(*groups, width, width)

"""K-FAC Kronecker factors from the same :class:`~gradhooks.pieces.Outer` pieces, for every layer.

For a parameter whose piece is ``Outer(a, g)`` (``a``: ``[batch, *groups, shared, in]``, ``g``:
``[batch, *groups, shared, out]``; more exactly, whose piece's
:meth:`~gradhooks.pieces.Piece.kfac_view` is: a transposed convolution's is over its output
positions and input patches, ``"in_out"``), the weight ``W`` (``[*groups, out, in]``) gets

- ``A``: ``[*groups, in, in]`` (``in + 1`` when bias-augmented), the input second moment,
- ``G``: ``[*groups, out, out]``, the output-gradient second moment,

so that ``torch.kron(G, A)`` approximates the curvature of ``W.flatten()`` (row-major
``[out, in]``; per group). Conventions (Eschenhagen et al. 2023, "Kronecker-factored
approximate curvature for modern neural network architectures"):

- ``g`` is each example's *own* output gradient (the engine's scale is applied, as for
  ``grad1``), so the factors do not depend on the loss reduction used in the backward.
- ``expand`` (default; KFC of Grosse & Martens 2016 for convolutions): the shared positions
  (tokens, pixels, the calls of a reused module) act as extra examples:
  ``A = Σ_{b,s} a aᵀ / (batch · shared)``, ``G = Σ_{b,s} g gᵀ``.
- ``reduce``: positions are reduced first, ``ā_b = mean_s a``, ``ḡ_b = Σ_s g``:
  ``A = Σ_b ā āᵀ / batch``, ``G = Σ_b ḡ ḡᵀ``. A module called several times per forward
  is reduced call by call, over each call's own positions; its ``C`` calls then count as
  ``C`` rows of each example, as under ``expand``: ``A = Σ_{b,c} ā āᵀ / (batch · C)``,
  ``G = Σ_{b,c} ḡ ḡᵀ``.
- A layer that sees a different number of positions per example (the tokens routed to an
  expert of a mixture) counts the positions it saw: ``A`` divides by their number (expand), or
  by the number of examples with any, each reduced to the mean of its own (reduce); ``G``
  still divides by the batch under ``"mean"`` (an example that sent none adds a zero
  curvature).
- ``reduction="sum"`` keeps ``G`` a sum over examples (``kron(G, A)`` approximates the sum of
  per-example curvatures, e.g. ``Σ_b grad1[b] grad1[b]ᵀ``); ``"mean"`` divides ``G`` by the
  number of examples (the mean curvature).
- ``bias=True`` appends a column of ones to ``a`` when the module has a bias whose piece is
  ``Outer(None, ·)``: ``A`` then covers ``cat([W, b[..., None]], -1)`` (per group).
- Which curvature ``G`` estimates depends on the backward: the user's loss gives the empirical
  Fisher; :func:`kfac` backpropagates sampled labels (``"mc"``, the Fisher) or the columns of the
  loss Hessian's square root (``"exact"``, the generalized Gauss-Newton) in a separate backward.
  Over several backwards of one forward ``G`` sums and ``A`` is taken once.

:meth:`KFactors.inverse` and :func:`kfac_precondition` turn the factors into a preconditioned
gradient, ``(kron(G, A) + damping·I)⁻¹ vec(grad)``, exactly (not the factored
``(G + √damping·I) ⊗ (A + √damping·I)``), from the eigendecompositions of ``A`` and ``G``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _torch
from ..engine.api import engine_of
from ..engine.handle import add_hooks, hooks_of
from ..errors import (
    ConfigurationError,
    ConfigurationTypeError,
    NumericalError,
    StateError,
    UnsupportedError,
)
from ..quantities.kfac import (
    KfacAccumulator,
    KFactors,
    KFactorsInverse,
    symmetric_eigh,
    weight_from_matrix,
)
from ..tuning import TUNING
from .jacobian import Inputs, checked_output, hooked_forward, model_inputs, recording

__all__ = [
    "KFactors", "KFactorsInverse", "KfacAccumulator", "ekfac_eigenvalues", "kfac",
    "kfac_precondition",
]  # fmt: skip


Fisher = Literal["mc", "exact", "empirical"]
LossName = Literal["cross_entropy", "mse"]
# Your own loss: the loss of a batch of one, loss(output[i:i+1], target[i:i+1]) (or without the
# target), as in gradhooks.oracle
LossFn = Callable[..., Tensor]
# sample_target and output_grads: called with the detached output and kfac()'s generator
Sampler = Callable[[Tensor, "torch.Generator | None"], Tensor]


def kfac(
    model: nn.Module,
    inputs: Inputs,
    target: Tensor | None = None,
    *,
    kwargs: Mapping[str, Any] | None = None,
    fisher: Fisher = "mc",
    loss: LossName | LossFn = "cross_entropy",
    reduction: Literal["mean", "sum"] = "mean",
    expand: bool = True,
    bias: bool = True,
    mc_samples: int = 1,
    generator: torch.Generator | None = None,
    sample_target: Sampler | None = None,
    output_grads: Sampler | None = None,
    mask: Tensor | None = None,
) -> dict[str, KFactors]:
    """K-FAC factors of every weight of ``model`` from one forward, ``model(*inputs, **kwargs)``.

    Conventions (those of the module :mod:`gradhooks.workflows.kfac`, Eschenhagen et al. 2023), for a
    weight whose layer sees inputs ``a`` ``[batch, shared, in]`` and output-gradients ``g``
    ``[batch, shared, out]`` (``shared``: a sequence's positions, a convolution's pixels, the
    calls of a reused module; 1 for a Linear on ``[batch, in]``):

    - ``g`` is each example's *own* output-gradient, so the factors do not depend on how a loss
      would reduce over the batch;
    - ``expand=True`` (KFC): the shared positions act as extra examples, ``A = Σ_{b,s} a aᵀ /
      (batch · shared)``, ``G = Σ_{b,s} g gᵀ``; ``expand=False`` (reduce): ``ā_b = mean_s a``,
      ``ḡ_b = Σ_s g``, ``A = Σ_b ā āᵀ / batch``, ``G = Σ_b ḡ ḡᵀ`` (over the positions of one
      call: a reused module's calls are reduced one by one, and count as rows, as expanded);
    - ``reduction="mean"`` divides ``G`` by ``batch`` (``kron(G, A)`` approximates the mean of
      the examples' curvatures), ``"sum"`` keeps the sum; ``A`` is always a mean;
    - ``bias=True`` appends a ones column to ``a`` where the layer has a bias: ``A`` is then
      ``[in + 1, in + 1]`` and covers ``cat([W, b[:, None]], 1)``.

    Args:
        model: a model whose layers have rules; its output one tensor ``[batch, classes]``, or
            ``[batch, ..., classes]`` (a language model's ``[batch, seq, vocab]``: each
            example's loss is the sum over its positions; ``"mc"`` and ``"empirical"`` only),
            row ``b`` example ``b``'s (a Hugging Face model's ``ModelOutput``: wrap the model in
            a module that returns ``.logits``). An output without the batch on dimension 0 (a
            scalar, ``model(x).sum(0)``) or that mixes the examples is refused with an error.
        inputs: the model's input ``[batch, ...]``, or a tuple of its positional inputs
            (``(x, y)`` for ``model(x, y)``); the batch is dimension 0 of the first tensor
            among them (then among ``kwargs``), as for :func:`gradhooks.add_hooks`.
        kwargs: the model's keyword inputs (``{"attention_mask": mask}``), per example
            ``[batch, ...]`` or shared.
        target: labels ``[batch, ...]`` (``cross_entropy``; ``-100``, ``F.cross_entropy``'s
            ``ignore_index``, marks a position without a loss, for every ``fisher``: no label
            is sampled there, nor its Hessian's columns taken) or the output's shape (``mse``),
            or what your ``loss`` takes; needed for ``fisher="empirical"`` with a named loss.
        fisher: which backward feeds ``G``: ``"mc"`` backpropagates labels sampled from the
            model's predictive distribution (``mc_samples`` backwards; for ``mse``, Gaussian
            noise: the "random vectors at the output" of the forum thread), giving the Fisher;
            ``"exact"`` backpropagates the ``classes`` columns of the square root of the loss
            Hessian (the GGN; exact K-FAC for a deep linear network); ``"empirical"`` the loss
            with the true ``target``.
        loss: ``"cross_entropy"`` (``F.cross_entropy`` per example), ``"mse"``
            (``F.mse_loss(..., reduction="sum")`` per example: Hessian ``2·I``), or your own: a
            function ``loss(output, target)`` (``loss(output)`` when ``target`` is ``None``)
            giving the loss of a batch of one, so that example ``i``'s own loss is
            ``loss(output[i:i+1], target[i:i+1])`` (summed if not a scalar), as in
            :mod:`gradhooks.oracle`; ``F.cross_entropy`` itself is one. It is evaluated per
            example with ``torch.func`` (``vmap``), so it is made of torch operations. What each
            ``fisher`` takes from it: ``"empirical"``, its gradient with respect to the output
            at ``target``; ``"mc"``, its gradient at targets drawn by ``sample_target`` (which
            you give: only you know the distribution your loss is the negative
            log-likelihood of); ``"exact"``, the columns of the square root of its Hessian with
            respect to each example's output (``torch.func``, per example; refused where that
            Hessian has a negative eigenvalue, a loss not convex in the output, whose GGN has
            no square root).
        reduction, expand, bias: conventions of :mod:`gradhooks.workflows.kfac`.
        mc_samples: backwards of sampled output-gradients for ``"mc"``, averaged.
        generator: a ``torch.Generator`` for reproducible ``"mc"`` sampling (also handed to
            ``sample_target`` and ``output_grads``).
        sample_target: for ``"mc"``, ``sample_target(output, generator)`` draws targets from
            the model's predictive distribution given its detached ``output``, in the layout
            ``loss`` takes (e.g. ``torch.multinomial(output.softmax(-1), 1, generator=g)[:,
            0]`` for ``F.cross_entropy``); ``G`` is of the loss's per-example gradients at
            them. With a named loss it replaces the built-in sampling.
        output_grads: for ``"mc"``, your own sampled output-gradients instead of a loss:
            ``output_grads(output, generator)`` returns a tensor of the output's shape whose
            slice ``i`` is example ``i``'s own sampled gradient with respect to its output
            (``loss`` is not used).
        mask: ``[batch, positions]``, true (or 1) at each example's real positions and false
            (0) at its padding (a tokenizer's ``attention_mask``): for every layer that sees
            ``positions`` positions per example (a Linear on ``[batch, positions,
            features]``), ``A`` counts the real positions alone, ``Σ a aᵀ`` over them over
            their number (reduced: each example's mean over its own), as a batch of the
            sequences unpadded would give it; the layers that see another number of positions
            (a pooled head) are as without it, and a mask that fits no layer is refused. ``G``
            leaves the padding's rows out too: its output-gradients, zero anyway where the
            loss leaves them out (labels of ``-100``) and attention does not read them, and
            the padding's inputs of a weight used as ``torch.addmm(b, x, W)`` (Hugging Face's
            ``Conv1D``), whose ``G`` is over its inputs.

    Returns:
        ``{param_name: KFactors}`` for every parameter with an ``Outer`` piece (weights), with
        ``A`` ``[*groups, in(+1), in(+1)]`` and ``G`` ``[*groups, out, out]``: a Linear's
        ``[in + 1, in + 1]`` (bias-augmented) and ``[out, out]``; a convolution's ``in`` is
        ``in_channels/groups · prod(kernel)``; a transposed convolution's ``G`` is over its
        output channels and ``A`` over ``in_channels/groups · prod(kernel)`` (``f.layout ==
        "in_out"``: its weight with the first two axes swapped). A weight also used outside a
        Linear or convolution (tied to an Embedding) gets the factors of its Kronecker-factored
        uses and a :class:`~gradhooks.GradhooksWarning` naming the others.

    Example::

        >>> import torch, gradhooks
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> f = gradhooks.kfac(net, torch.randn(16, 4), fisher="exact")
        >>> f["0.weight"].A.shape, f["0.weight"].G.shape       # bias-augmented: 4 + 1
        (torch.Size([5, 5]), torch.Size([8, 8]))
        >>> smooth = lambda out, y: torch.nn.functional.cross_entropy(out, y, label_smoothing=0.1)
        >>> f = gradhooks.kfac(net, torch.randn(16, 4), torch.randint(3, (16,)),
        ...                    fisher="empirical", loss=smooth)
        >>> class Masked(torch.nn.Module):  # several inputs and keyword arguments
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.fc = torch.nn.Linear(4, 3)
        ...     def forward(self, x, y, scale=1.0):
        ...         return scale * self.fc(x * y)
        >>> x, y = torch.randn(16, 4), torch.randn(16, 4)
        >>> f = gradhooks.kfac(Masked(), (x, y), kwargs={"scale": 2.0}, fisher="exact")
        >>> f["fc.weight"].A.shape
        torch.Size([5, 5])
    """
    if reduction not in ("mean", "sum"):
        raise ConfigurationError(f"kfac(): reduction must be 'mean' or 'sum', got {reduction!r}")
    acc = _accumulate(
        model, inputs, target, fisher, loss, expand, bias, mc_samples, generator,
        sample_target, output_grads, kwargs, mask=mask,
    )  # fmt: skip
    return acc.factors(reduction, last=True)


def kfac_precondition(
    model: nn.Module,
    factors: Mapping[str, KFactors | KFactorsInverse],
    damping: float | None = None,
) -> None:
    """Precondition the gradients in place: every weight's ``.grad`` in ``factors`` (and its
    bias's, where the factors are bias-augmented) becomes ``(kron(G, A) + damping·I)⁻¹
    vec(grad)``, the damped K-FAC natural gradient, ready for an optimizer step.

    The weight's gradient is taken as the matrix ``[*groups, out, in]`` (a convolution's
    ``[out, in · prod(kernel)]``, a transposed convolution's ``[in, out, *kernel]`` with its
    first two axes swapped: ``f.layout``, :func:`~gradhooks.quantities.kfac.weight_matrix`),
    with the bias's gradient appended as a column when ``f.bias`` (``cat([W, b[:, None]],
    1)``); see :class:`KFactors`. Parameters without factors keep their gradient.

    Args:
        model: the model of the factors (names as in its ``named_parameters()``), after a
            backward.
        factors: ``{weight name: KFactors}`` (:func:`kfac`, :meth:`Hooks.kfac_factors`), with
            ``damping``; or ``{weight name: f.inverse(damping)}``, to reuse the
            eigendecompositions over several steps, without.
        damping: ``> 0``, added to ``kron(G, A)``.

    Example::

        >>> import torch, gradhooks
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> x, y = torch.randn(16, 4), torch.randint(3, (16,))
        >>> factors = gradhooks.kfac(net, x, fisher="mc")
        >>> torch.nn.functional.cross_entropy(net(x), y).backward()
        >>> gradhooks.kfac_precondition(net, factors, damping=1e-3)  # then optimizer.step()
    """
    _check_model(model, "kfac_precondition")
    if not isinstance(factors, Mapping):
        raise ConfigurationTypeError(
            f"kfac_precondition: factors must be {{weight name: KFactors}} (gradhooks.kfac, "
            f"h.kfac_factors()), got {type(factors).__qualname__}"
        )
    params = dict(model.named_parameters())
    done = []
    for name, f in factors.items():
        if isinstance(f, KFactors):
            if damping is None:
                raise ConfigurationError(
                    f"kfac_precondition: KFactors of '{name}' and no damping: give damping=..., "
                    "or factors inverted once with f.inverse(damping)"
                )
            f = f.inverse(damping)
        elif damping is not None:
            raise ConfigurationError(
                f"kfac_precondition: the factors of '{name}' are already inverted with damping "
                f"{f.damping}; leave damping out (or pass the KFactors themselves)"
            )
        weight = _with_grad(params, name, name)
        bias = _with_grad(params, f.bias_name, name) if f.bias else None
        if f.bias and bias is None:
            raise ConfigurationError(
                f"kfac_precondition: the factors of '{name}' cover a bias column but name no "
                "bias parameter (KFactors made by hand, or a weight tied across modules with "
                "different biases): give KFactors(..., bias_name=...), or factors from "
                "kfac(..., bias=False)"
            )
        *groups, rows, cols = f.scale.shape
        width = cols - f.bias
        shapes = f"weight {tuple(weight.shape)}" + (
            f", bias {tuple(bias.shape)}" if bias is not None else ""
        )
        if weight.numel() != math.prod(groups) * rows * width or (
            bias is not None and bias.numel() != math.prod(groups) * rows
        ):
            raise ConfigurationError(
                f"kfac_precondition: the factors of '{name}' are of a {tuple(f.scale.shape)} "
                f"weight matrix ([*groups, out, in{' + 1 (bias)' if f.bias else ''}]), which "
                f"does not fit the parameters ({shapes}): factors of another model, or a "
                "layer whose weight is not [out, in, ...]"
            )
        grad = f.matrix(weight.grad, None if bias is None else bias.grad)
        done.append((weight, bias, f.apply(grad), width, f.layout))
    for weight, bias, natural, width, layout in done:  # (written once every weight is checked)
        weight.grad.copy_(weight_from_matrix(natural[..., :width], weight.shape, layout))
        if bias is not None:
            bias.grad.copy_(natural[..., width].reshape(bias.shape))


def ekfac_eigenvalues(
    model: nn.Module,
    factors: Mapping[str, KFactors],
    reduction: Literal["mean", "sum"] = "mean",
) -> dict[str, Tensor]:
    """The eigenvalue-corrected K-FAC (EK-FAC; George et al. 2018, "Fast approximate natural
    gradient descent in a Kronecker-factored eigenbasis"): for every weight in ``factors``, the
    diagonal of the per-example gradients' second moment in the eigenbasis of its K-FAC
    factors, from the ``grad1`` of the last backward.

    With ``Q_G``, ``Q_A`` the eigenvectors of ``G`` and ``A`` (:meth:`KFactors.eigenbasis`) and
    ``M_b`` example ``b``'s gradient of the weight as a matrix ``[*groups, out, in(+1)]`` (its
    bias's as the last column where the factors are bias-augmented), the eigenvalues are
    ``Σ_b (Q_Gᵀ M_b Q_A)² / batch`` (``reduction="mean"``; ``"sum"`` keeps the sum), entry by
    entry: the diagonal of ``(Q_G ⊗ Q_A)ᵀ (Σ_b vec(M_b) vec(M_b)ᵀ / batch) (Q_G ⊗ Q_A)``, where
    K-FAC takes ``λ_G λ_Aᵀ``. They are as exact as the curvature ``grad1`` samples: the Fisher
    for ``grad1`` of labels drawn from the model's predictions, the empirical Fisher for those of
    the true labels. ``grad1[b]`` is example ``b``'s own gradient, whatever the loss's reduction,
    and for a sequence the sum over its positions: each example's gradient is one sample
    (K-FAC's ``expand`` counts positions as samples in its factors; the eigenbasis is theirs).

    Args:
        model: the hooked model, after a backward that wrote ``grad1`` (``add_hooks(model)``)
            for every weight in ``factors`` and its bias.
        factors: ``{weight name: KFactors}`` (:func:`kfac`, :meth:`Hooks.kfac_factors`).
        reduction: ``"mean"`` (over the batch; as :func:`kfac`'s default) or ``"sum"``.

    Returns:
        ``{weight name: eigenvalues}``, each ``[*groups, out, in(+1)]`` in the factors' dtype,
        for ``factors[name].inverse(damping, eigenvalues=...)``, which preconditions by
        ``(Q_G ⊗ Q_A)(diag(eigenvalues) + damping·I)⁻¹(Q_G ⊗ Q_A)ᵀ`` (:func:`kfac_precondition`
        takes the inverses).

    Example::

        >>> import torch, gradhooks
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> x, y = torch.randn(16, 4), torch.randint(3, (16,))
        >>> factors = gradhooks.kfac(net, x, fisher="mc")
        >>> with gradhooks.add_hooks(net):
        ...     torch.nn.functional.cross_entropy(net(x), y).backward()
        ...     eigenvalues = gradhooks.ekfac_eigenvalues(net, factors)
        >>> eigenvalues["2.weight"].shape  # [out, in + 1]: the bias column
        torch.Size([3, 9])
        >>> inverses = {n: f.inverse(1e-3, eigenvalues=eigenvalues[n]) for n, f in factors.items()}
        >>> gradhooks.kfac_precondition(net, inverses)  # then optimizer.step()
    """
    _check_model(model, "ekfac_eigenvalues")
    if not isinstance(factors, Mapping):
        raise ConfigurationTypeError(
            f"ekfac_eigenvalues: factors must be {{weight name: KFactors}} (gradhooks.kfac, "
            f"h.kfac_factors()), got {type(factors).__qualname__}"
        )
    if reduction not in ("mean", "sum"):
        raise ConfigurationError(
            f"ekfac_eigenvalues: reduction must be 'mean' or 'sum', got {reduction!r}"
        )
    params = dict(model.named_parameters())
    found = []
    for name, f in factors.items():
        if not isinstance(f, KFactors):
            raise ConfigurationTypeError(
                f"ekfac_eigenvalues: the factors of '{name}' must be KFactors (not inverted: "
                f"the eigenvalues replace the inverse's), got {type(f).__qualname__}"
            )
        weight = _with_grad1(params, name, name)
        bias = _with_grad1(params, f.bias_name, name) if f.bias else None
        if f.bias and bias is None:
            raise ConfigurationError(
                f"ekfac_eigenvalues: the factors of '{name}' cover a bias column but name no "
                "bias parameter: give KFactors(..., bias_name=...), or factors from "
                "kfac(..., bias=False)"
            )
        g1w = weight.grad1
        g1b = None if bias is None else bias.grad1
        groups, rows, cols = f.G.shape[:-2], f.G.shape[-1], f.A.shape[-1]
        if (
            g1w.shape[1:] != weight.shape
            or math.prod(weight.shape) != math.prod(groups) * rows * (cols - f.bias)
            or (g1b is not None and (g1b.shape[0] != g1w.shape[0] or g1b.shape[1:] != bias.shape))
            or (bias is not None and bias.numel() != math.prod(groups) * rows)
        ):
            shapes = f"weight {tuple(weight.shape)}, grad1 {tuple(g1w.shape)}" + (
                f", bias {tuple(bias.shape)}, its grad1 {tuple(g1b.shape)}"
                if bias is not None and g1b is not None
                else ""
            )
            raise ConfigurationError(
                f"ekfac_eigenvalues: the factors of '{name}' are of a {(*groups, rows, cols)} "
                f"weight matrix ([*groups, out, in{' + 1 (bias)' if f.bias else ''}]), which "
                f"does not fit the parameters ({shapes}): factors of another model, or grad1 "
                "of a backward whose batches differ"
            )
        found.append((name, f, g1w, g1b))
    out = {}
    for name, f, g1w, g1b in found:
        q_g, q_a = f.eigenbasis()
        batch = g1w.shape[0]
        if batch == 0:
            raise ConfigurationError(
                f"ekfac_eigenvalues: grad1 of '{name}' holds no example "
                f"{tuple(g1w.shape)}: give a backward of at least one"
            )
        dtype = f.G.dtype
        per_example = f.matrix(g1w.to(dtype), None if g1b is None else g1b.to(dtype), 1)
        rotated = q_g.mT @ per_example @ q_a  # [batch, *groups, out, in(+1)]
        eigenvalues = rotated.square().sum(0)
        out[name] = eigenvalues / batch if reduction == "mean" else eigenvalues
    return out


def _with_grad1(params: dict[str, nn.Parameter], name: str | None, of: str) -> Tensor | None:
    """The parameter ``name`` (of the factors of ``of``); it must have a ``grad1``."""
    if name is None:
        return None
    p = params.get(name)
    if p is None:
        raise ConfigurationError(
            f"ekfac_eigenvalues: the factors of '{of}' refer to a parameter '{name}' that the "
            "model does not have: factors of another model (a DistributedDataParallel "
            "wrapper's names start with 'module.')"
        )
    g1 = getattr(p, "grad1", None)
    if not isinstance(g1, Tensor):
        raise ConfigurationError(
            f"ekfac_eigenvalues: '{name}' (shape {tuple(p.shape)}) has no grad1: run a backward "
            "under gradhooks.add_hooks(model) (quantities with 'grad1', the default) first"
        )
    return p


def _with_grad(params: dict[str, nn.Parameter], name: str | None, of: str) -> Tensor | None:
    """The parameter ``name`` (of the factors of ``of``); it must have a ``.grad``."""
    if name is None:
        return None
    p = params.get(name)
    if p is None:
        raise ConfigurationError(
            f"kfac_precondition: the factors of '{of}' refer to a parameter '{name}' that the "
            "model does not have: factors of another model (a DistributedDataParallel "
            "wrapper's names start with 'module.')"
        )
    if p.grad is None:
        raise ConfigurationError(
            f"kfac_precondition: '{name}' has no .grad: run the loss's backward first"
        )
    return p


def _accumulate(
    model: nn.Module, inputs: Inputs, target: Tensor | None, fisher: Fisher,
    loss: LossName | LossFn, expand: bool, bias: bool, mc_samples: int,
    generator: torch.Generator | None, sample_target: Sampler | None = None,
    output_grads: Sampler | None = None, kwargs: Mapping[str, Any] | None = None,
    shard: bool = False, mask: Tensor | None = None,
) -> KfacAccumulator:  # fmt: skip
    """The sums and counts behind :func:`kfac`'s factors (the distributed version reduces them
    across ranks before dividing: ``shard``, one rank's examples, which may be none)."""
    _check_arguments(fisher, loss, target, sample_target, output_grads)
    check_sampling(mc_samples, generator, expand, bias)
    _check_model(model, "kfac()")
    _check_unhooked(model)
    args, kwargs = model_inputs(inputs, kwargs, "kfac")

    with recording(), add_hooks(model, loss_reduction="sum", quantities=("kfac", "_vmapped")) as h:
        acc = engine_of(h).results("kfac").kfac
        acc.expand, acc.bias = expand, bias
        run = hooked_forward(h, model, args, kwargs)
        out = checked_output(run, model, "kfac", "[batch, classes] or [batch, ..., classes]")
        acc.mask = _checked_mask(mask, out)
        reached = run.reached
        if out.dim() < 2:
            raise ConfigurationError(
                f"kfac() expects a [batch, classes] or [batch, ..., classes] model output, got "
                f"{tuple(out.shape)}; for other outputs use add_hooks(model, "
                "quantities=('kfac',)), your own backward(s), and h.kfac_factors()"
            )
        if out.shape[0] == 0 and not shard:  # (the factors of no example: 0, G's mean 0 / 0)
            raise ConfigurationError(
                f"kfac(): the model's output {tuple(out.shape)} holds no example: its factors "
                "would be zero, and the gradient preconditioned with them the gradient / "
                "damping. Give a batch of at least one example"
            )
        if isinstance(target, Tensor) and (target.dim() == 0 or target.shape[0] != out.shape[0]):
            raise ConfigurationError(
                f"kfac(): target has shape {tuple(target.shape)}, but the model's output "
                f"{tuple(out.shape)} has a batch of {out.shape[0]}: give one target per example "
                "(labels [batch, ...] for cross_entropy, the output's shape for mse)"
            )
        if isinstance(target, Tensor) and loss == "mse" and target.shape != out.shape:
            raise ConfigurationError(
                f"kfac(loss='mse'): target has shape {tuple(target.shape)}, the model's output "
                f"{tuple(out.shape)}: the squared error takes a target of the output's shape"
            )
        if (
            isinstance(target, Tensor)
            and loss == "cross_entropy"
            and (target.is_floating_point() or target.shape != out.shape[:-1])
        ):
            raise ConfigurationError(
                f"kfac(loss='cross_entropy'): target has shape {tuple(target.shape)} "
                f"({target.dtype}), the model's output {tuple(out.shape)}: the named loss takes "
                "the classes on the output's last dimension and one integer label per row, a "
                f"target of shape {tuple(out.shape[:-1])}. For classes on dimension 1 (a "
                "[batch, classes, positions] output) or probabilities as targets, pass the "
                "loss as a function, loss=lambda out, y: F.cross_entropy(out, y, "
                "reduction='sum') (summed over positions, as the named loss is)"
            )
        if isinstance(target, Tensor) and loss == "cross_entropy" and fisher == "empirical":
            _check_labels(target, out)
        if fisher == "exact" and out.dim() > 2:
            raise ConfigurationError(
                f"kfac(fisher='exact') on a model output of shape {tuple(out.shape)}: the exact "
                "GGN of a loss over several positions needs one backward per class and "
                f"position ({math.prod(out.shape[1:])} here), and one backward per class would "
                "add terms between positions; use fisher='mc' (one sampled label per position: "
                "unbiased for the Fisher) or 'empirical'"
            )
        # The backwards are taken with respect to the hooked calls' outputs (their hooks then
        # see their output-gradients): no parameter's batch gradient is ever formed, but for
        # a parameter also used outside its module's call (whose uses are collected when its
        # gradient is complete)
        direct = [p for p in model.parameters() if id(p) in run.direct]
        wrt = (reached + direct) or [p for p in model.parameters() if p.requires_grad]
        vectors = _output_vectors(
            out.detach(), target, fisher, loss, mc_samples, generator, sample_target, output_grads
        )
        # Several backwards (one per class for "exact") run batched under vmap, in chunks of
        # about ``TUNING.kfac_vmap_elements`` output-gradient elements of the hooked calls: all at once on
        # small layers (an MLP's: 1.4x faster), one at a time where a backward writes
        # activation-sized gradients (a CNN's: batched, fresh buffers made it 1.6x slower)
        chunk = max(1, TUNING.kfac_vmap_elements // max(reached.numel, 1))
        # (one at a time also where the tracker forms per-example shares, a layer called on
        # positions alone or a parameter used outside its module's call, and under autocast,
        # where torch's vmapped backward of a LayerNorm fails on the mixed dtypes)
        batched = _torch.batched_backwards() and not run.sources and not run.autocast
        if len(vectors) == 1 or chunk == 1 or not batched:
            for i, v in enumerate(vectors):
                torch.autograd.grad(
                    out, wrt, v, retain_graph=i < len(vectors) - 1, allow_unused=True
                )
                acc.capture_a = False
        else:

            def backward(v: Tensor) -> Tensor:
                torch.autograd.grad(out, wrt, v, retain_graph=True, allow_unused=True)
                acc.capture_a = False
                return v  # (the hooks accumulate the factors; vmap wants a tensor back)

            with _torch.own_transform():
                torch.func.vmap(backward, chunk_size=chunk)(torch.stack(vectors))
        if fisher == "mc" and mc_samples > 1:
            acc.average_samples(mc_samples)
        if acc.mask is not None and not acc.masked:
            raise ConfigurationError(
                f"kfac(): mask has shape {tuple(acc.mask.shape)}, but no layer sees "
                f"{acc.mask.shape[1]} positions per example (a Linear on [batch, "
                f"{acc.mask.shape[1]}, features]): it would leave every factor as without it. "
                "Give the mask of the positions the layers see, or none"
            )
        return acc


def _checked_mask(mask: Any, out: Tensor) -> Tensor | None:
    """:func:`kfac`'s ``mask``, as a bool tensor ``[batch, positions]`` on the output's
    device; refused where it is no such thing for the output's batch."""
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise ConfigurationTypeError(
            f"kfac(): mask must be a tensor [batch, positions], got {type(mask).__qualname__}"
        )
    if mask.dim() != 2 or mask.shape[0] != out.shape[0]:
        raise ConfigurationError(
            f"kfac(): mask has shape {tuple(mask.shape)}, the model's output "
            f"{tuple(out.shape)}: give one row per example, [{out.shape[0]}, positions], true "
            "(or 1) at its real positions and false (0) at its padding"
        )
    if mask.dtype is not torch.bool:
        if mask.is_complex() or bool(((mask != 0) & (mask != 1)).any()):
            raise ConfigurationError(
                f"kfac(): mask must be bool or hold 0s and 1s (an attention_mask), got "
                f"{mask.dtype} with other values"
            )
        mask = mask != 0
    return mask.to(out.device)


def _check_model(model: Any, where: str) -> None:
    """Refuse what is not a model with a trainable parameter (a parameter list, a frozen
    model: its factors' backward would have nothing to differentiate)."""
    if not isinstance(model, nn.Module):
        raise ConfigurationTypeError(
            f"{where} takes the model (an nn.Module), got {type(model).__qualname__}"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigurationError(
            f"{where}: {type(model).__qualname__} has no trainable parameter (all frozen, or "
            "none): there is no weight to factor; unfreeze the layers to precondition"
        )


def _check_unhooked(model: nn.Module) -> None:
    """Refuse a model hooked by the user's ``add_hooks``: the factors' forward and backward
    take hooks of their own, which would come on top of those."""
    try:
        h = hooks_of(model)
    except ConfigurationError:
        return
    raise StateError(
        f"kfac() (which KFAC.step calls for new factors): {type(model).__qualname__} is hooked "
        f"by gradhooks.add_hooks ({h!r}), and the factors are computed by a forward and a "
        "backward with hooks of their own, which would come on top of those. Call it where "
        "the model is not hooked (outside the `with gradhooks.add_hooks(...)` block, or after "
        "h.remove()); or, to keep grad1 and K-FAC in one loop, take the factors of your own "
        "backward from your handle: add_hooks(model, quantities=('grad1', 'kfac')), the "
        "backward, factors = h.kfac_factors() (the empirical Fisher), "
        "gradhooks.kfac_precondition(model, factors, damping=...), the optimizer's step, "
        "h.clear(). Nothing was changed."
    )


def check_fisher_and_loss(fisher: Fisher, loss: LossName | LossFn) -> None:
    """Refuse a Fisher or a loss that :func:`kfac` does not know."""
    if fisher not in ("mc", "exact", "empirical"):
        raise ConfigurationError(f"fisher must be 'mc', 'exact' or 'empirical', got {fisher!r}")
    if not callable(loss) and loss not in _LOSSES:
        raise ConfigurationError(
            f"loss must be 'cross_entropy', 'mse' or a function loss(output, target) of a "
            f"batch of one, got {loss!r}"
        )


def check_sampling(mc_samples: Any, generator: Any, expand: Any, bias: Any) -> None:
    """Refuse a number of samples that is not a whole number >= 1 (0 failed in torch.stack), a
    generator that is not one, and a string for a flag (taken by its truth)."""
    if isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 1:
        raise ConfigurationError(f"mc_samples must be a whole number >= 1, got {mc_samples!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ConfigurationTypeError(
            f"generator must be a torch.Generator or None, got {type(generator).__qualname__}"
        )
    for name, flag in (("expand", expand), ("bias", bias)):
        if not isinstance(flag, bool):
            raise ConfigurationTypeError(
                f"{name} takes True or False, got {type(flag).__qualname__} {flag!r}"
            )


def _check_arguments(
    fisher: Fisher, loss: LossName | LossFn, target: Tensor | None,
    sample_target: Sampler | None, output_grads: Sampler | None,
) -> None:  # fmt: skip
    """Refuse what cannot work before the forward runs."""
    check_fisher_and_loss(fisher, loss)
    if sample_target is not None and output_grads is not None:
        raise ConfigurationError(
            "kfac(): give sample_target (targets whose loss gradients are backpropagated) or "
            "output_grads (the gradients themselves), not both"
        )
    for name, fn in (("sample_target", sample_target), ("output_grads", output_grads)):
        if fn is not None and not callable(fn):  # (else called at the backward: a TypeError)
            raise ConfigurationTypeError(
                f"kfac(): {name} must be a function (output, generator) -> tensor, or None; "
                f"got {type(fn).__qualname__}"
            )
    given = "sample_target" if sample_target is not None else "output_grads"
    if (sample_target is not None or output_grads is not None) and fisher != "mc":
        raise ConfigurationError(
            f"kfac(fisher={fisher!r}, {given}=...): {given} samples the Fisher; use it with "
            "fisher='mc'"
        )
    if callable(loss) and fisher == "mc" and sample_target is None and output_grads is None:
        raise ConfigurationError(
            f"kfac(fisher='mc', loss={_name(loss)}): sampling needs the distribution the loss "
            "is the negative log-likelihood of, which a function does not tell: give "
            "sample_target=lambda output, generator: <targets drawn from it>, or your own "
            "sampled output-gradients with output_grads=...; or use fisher='exact' (the GGN, "
            "from the loss's Hessian) or 'empirical'"
        )
    if fisher == "empirical" and not callable(loss) and target is None:
        raise ConfigurationError("fisher='empirical' needs the target")


def _check_labels(target: Tensor, out: Tensor) -> None:
    """Refuse a label that is no class of the output (a dataset of more classes than the
    model's head, labels counted from 1) and not ``-100`` (``F.cross_entropy``'s ignored
    label), as ``F.cross_entropy`` refuses it: one value read back, as ``F.one_hot``'s own
    check of the range reads two."""
    classes = out.shape[-1]
    bad = ((target < 0) | (target >= classes)) & (target != _IGNORE_INDEX)
    if bool(bad.any()):
        where = tuple(bad.nonzero()[0].tolist())
        raise ConfigurationError(
            f"kfac(fisher='empirical', loss='cross_entropy'): target{list(where)} is "
            f"{int(target[where])}, but the model's output {tuple(out.shape)} has {classes} "
            f"classes: labels are in [0, {classes - 1}] (or -100 for a position without a "
            "loss). Check the labels against the model's head"
        )


def _name(loss: LossFn) -> str:
    return getattr(loss, "__qualname__", None) or repr(loss)


def _output_vectors(
    out: Tensor, target: Tensor | None, fisher: Fisher, loss: LossName | LossFn, samples: int,
    generator: torch.Generator | None, sample_target: Sampler | None = None,
    output_grads: Sampler | None = None,
) -> list[Tensor]:  # fmt: skip
    """The gradients with respect to the output that each backward propagates, shaped as
    ``out``: row ``i`` is example ``i``'s own. With the named cross-entropy and ``target``, a
    row (position) labelled ``-100`` has no loss, and none of its output-gradients: sampled
    (``"mc"``) or the Hessian's (``"exact"``) as the true label's (``"empirical"``)."""
    vectors = _unmasked_output_vectors(
        out, target, fisher, loss, samples, generator, sample_target, output_grads
    )
    if loss == "cross_entropy" and isinstance(target, Tensor) and output_grads is None:
        kept = target != _IGNORE_INDEX
        if not bool(kept.all()):
            kept = kept.unsqueeze(-1).to(out.dtype)
            return [v * kept for v in vectors]
    return vectors


def _unmasked_output_vectors(
    out: Tensor, target: Tensor | None, fisher: Fisher, loss: LossName | LossFn, samples: int,
    generator: torch.Generator | None, sample_target: Sampler | None = None,
    output_grads: Sampler | None = None,
) -> list[Tensor]:  # fmt: skip
    """:func:`_output_vectors` of every row, whatever its label."""
    if output_grads is not None:
        return [_checked(output_grads(out, generator), out) for _ in range(samples)]
    if sample_target is not None:
        loss_fn = _LOSSES[loss] if isinstance(loss, str) else loss
        return [_loss_grads(loss_fn, out, sample_target(out, generator)) for _ in range(samples)]
    if callable(loss):
        if fisher == "empirical":
            return [_loss_grads(loss, out, target)]
        return _hessian_root_columns(loss, out, target)
    if fisher == "empirical":
        if loss == "cross_entropy":  # (F.cross_entropy's: a label of -100 adds nothing)
            # (a label of -100 matches no class: its row of labels is zero, and kept drops it)
            kept = target != _IGNORE_INDEX
            classes = torch.arange(out.shape[-1], device=target.device)
            labels = (target.unsqueeze(-1) == classes).to(out.dtype)
            return [(torch.softmax(out, -1) - labels) * kept.unsqueeze(-1)]
        return [2 * (out - target)]
    if fisher == "mc":
        vs = []
        for _ in range(samples):
            if loss == "cross_entropy":  # one label per example (and position)
                probs = torch.softmax(out, -1)
                flat = probs.reshape(-1, out.shape[-1])
                y = _sampled_labels(flat, generator, out).view(out.shape[:-1])
                vs.append(probs - F.one_hot(y, out.shape[-1]).to(out.dtype))
            else:  # y ~ N(out, I/2), the distribution whose NLL is the squared error
                noise = torch.randn(out.shape, generator=generator, dtype=out.dtype)
                vs.append(noise.to(out.device) * 2**0.5)
        return vs
    classes = out.shape[-1]
    eye = torch.eye(classes, dtype=out.dtype, device=out.device)
    if loss == "mse":
        return [2**0.5 * eye[c].expand_as(out) for c in range(classes)]
    # diag(p) - p pᵀ = Σ_c √p_c (e_c - p) (√p_c (e_c - p))ᵀ
    probs = torch.softmax(out, -1)
    return [probs[:, c : c + 1].sqrt() * (eye[c] - probs) for c in range(classes)]


def _sampled_labels(probs: Tensor, generator: torch.Generator | None, out: Tensor) -> Tensor:
    """One label per row of ``probs`` ``[rows, classes]``, drawn from it (fisher="mc")."""
    try:
        return torch.multinomial(probs, 1, generator=generator)[:, 0]
    except RuntimeError:  # (torch's: the probabilities of a NaN or inf output)
        if bool(probs.isfinite().all()):
            raise
        rows = (~out.isfinite()).flatten(1).any(1).nonzero()[:, 0].tolist()
        raise NumericalError(
            f"kfac(fisher='mc'): the model's output {tuple(out.shape)} holds NaN or inf for "
            f"examples {rows[:8]}{' ...' if len(rows) > 8 else ''}, and no label can be drawn "
            "from their softmax: check those examples' inputs (or the model, if it diverged), "
            "and drop them before the forward"
        ) from None


# F.cross_entropy's default ignore_index: the positions so labelled have no loss (padding)
_IGNORE_INDEX = -100

# The named losses as functions of a batch of one (each example's loss summed over its
# positions), for sample_target
_LOSSES: dict[str, LossFn] = {
    "cross_entropy": lambda out, y: F.cross_entropy(
        out.flatten(0, -2), y.flatten(), reduction="sum"
    ),
    "mse": lambda out, y: F.mse_loss(out, y, reduction="sum"),
}


def _checked(v: Tensor, out: Tensor) -> Tensor:
    if not isinstance(v, Tensor) or v.shape != out.shape:
        got = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
        raise ConfigurationError(
            f"kfac(output_grads=...) returned {got}; it must return a tensor of the model "
            f"output's shape {tuple(out.shape)}, slice i example i's own output-gradient"
        )
    return v.to(out.dtype)


def _per_example(transform, loss: LossFn, out: Tensor, target: Tensor | None) -> Tensor:
    """``vmap(transform(one example's loss))`` over the output (and target)."""

    def one(o: Tensor, t: Tensor | None) -> Tensor:
        o = o.unsqueeze(0)
        return (loss(o) if t is None else loss(o, t.unsqueeze(0))).sum()

    try:
        return torch.func.vmap(transform(one), in_dims=(0, None if target is None else 0))(
            out, target
        )
    except (RuntimeError, TypeError, ValueError, IndexError) as e:
        raise UnsupportedError(
            f"kfac(loss={_name(loss)}): the loss could not be evaluated per example with "
            f"torch.func ({type(e).__name__}: {e}). It is called on a batch of one, "
            f"loss(output[i:i+1]{', target[i:i+1]' if target is not None else ''}) with output "
            f"{tuple(out.shape)}, under vmap: write it in torch operations (no .item(), no "
            "Python branch on a tensor's value)"
        ) from e


def _loss_grads(loss: LossFn, out: Tensor, target: Tensor | None) -> Tensor:
    """Each example's own loss gradient with respect to its output, shaped as ``out``."""
    return _per_example(torch.func.grad, loss, out, target)


def _hessian_root_columns(loss: LossFn, out: Tensor, target: Tensor | None) -> list[Tensor]:
    """Columns ``v_c`` (each ``[batch, classes]``) with ``Σ_c v_c v_cᵀ`` each example's loss
    Hessian with respect to its output: its eigenvectors scaled by the eigenvalues' roots."""
    # (reverse over reverse: more losses' operations have it than forward-mode derivatives)
    hessian = lambda f: torch.func.jacrev(torch.func.grad(f))
    hess = _per_example(hessian, loss, out, target)  # [batch, classes, classes]
    eig, vec = symmetric_eigh((hess + hess.mT) / 2)
    # Rounding leaves eigenvalues of about eps times the terms the Hessian is computed from,
    # which can be far larger than the Hessian itself (a saturated softmax's, about 1e-14 in
    # float64, from probabilities of about 1): negative ones are refused only beyond that,
    # with the loss's scale taken as at least one, and clamped to zero
    largest = eig.abs().amax(-1)
    scale = largest.max().clamp(min=1)
    negative = eig < -100 * out.shape[-1] * torch.finfo(eig.dtype).eps * scale
    if negative.any():
        b, c = negative.nonzero()[0].tolist()
        raise ConfigurationError(
            f"kfac(fisher='exact', loss={_name(loss)}): the loss's Hessian with respect to the "
            f"output of example {b} has a negative eigenvalue ({eig[b, c].item():.3g}; largest "
            f"magnitude {largest[b].item():.3g}): the loss is not convex in the output, so "
            "its generalized Gauss-Newton has no square root to backpropagate; use "
            "fisher='mc' (with sample_target=...) or 'empirical'"
        )
    roots = vec * eig.clamp(min=0).sqrt()[:, None, :]
    return [roots[..., c] for c in range(out.shape[-1])]

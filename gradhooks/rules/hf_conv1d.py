"""Hugging Face's ``Conv1D`` (GPT-2, GPT-1 and other ``transformers`` models): a Linear whose
weight is stored transposed, ``y = x W + b`` on ``[batch, *, in]``, ``W``: ``[in, out]``; its
forward is ``torch.addmm(b, x.view(-1, in), W)`` viewed back to ``[batch, *, out]``.

Per example, over the ``*`` positions ``s`` (which share the weight):

    grad1[b] = Σ_s x[b, s]ᵀ g[b, s]     ([in, out]),     bias: Σ_s g[b, s]

the same :class:`~gradhooks.pieces.Outer` pieces as ``torch.addmm``'s rule
(:func:`gradhooks.rules.linear.addmm`, which covers the same product used outside a module), so
norms, squared sums, K-FAC factors and the sums a DP step needs are formed as for a Linear.
Rules never scale: the engine applies mean/sum.

Registered by name: gradhooks does not import ``transformers``; the rule covers the class
``transformers.pytorch_utils.Conv1D`` once ``transformers`` is imported (and a subclass that
keeps its ``forward``), never another class called ``Conv1D``.
"""

from __future__ import annotations

from ..pieces import Piece
from .linear import addmm, large_product, many_positions
from .registry import Call, register

#: The class this rule covers, by name (``__module__`` and ``__qualname__``).
CONV1D = "transformers.pytorch_utils.Conv1D"


@register(
    CONV1D,
    grad_from_grad1=many_positions,
    detach_without_grads=large_product,
    batch_dim="positions",
)
def conv1d(call: Call) -> dict[str, Piece]:
    """``x``: ``[batch, *, in]``, ``g``: ``[batch, *, out]``; the ``*`` positions are the
    pieces' ``shared`` axis. ``weight`` ``[in, out]``: an :class:`~gradhooks.pieces.Outer` whose
    rows (its ``g``) are the input and whose columns (its ``a``) the output-gradient; ``bias``: a
    :class:`~gradhooks.pieces.Direct`, ``Σ_s g``."""
    return addmm(call)

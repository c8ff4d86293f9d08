"""microsoft/LoRA's ``loralib`` layers ``Linear`` and ``MergedLinear``: an ``nn.Linear`` (its
weight usually frozen) plus a low-rank update of the input after LoRA's dropout,

    y = x Wᵀ + b + scaling · pad(B (A dropout(x)))

``A`` = ``lora_A`` ``[k·r, in]``, ``B`` = ``lora_B`` ``[k·o, r]``: ``MergedLinear`` splits its
output into ``len(enable_lora)`` equal parts of ``o`` features and updates the ``k`` enabled
ones (``pad`` puts them in place, zeros elsewhere), each by its own rank-``r`` pair (a grouped
product); ``Linear`` is one part, all of it. ``fan_in_fan_out`` stores ``W`` as ``[in, out]``.

Per example, over the ``*`` positions ``s`` of ``x`` ``[batch, *, in]``, with ``g`` the
output-gradient, ``g_j`` its part ``j`` times ``scaling`` and ``d = dropout(x)``:

    lora_B[j] = Σ_s g_j[s]ᵀ (A_j d[s])         lora_A[j] = Σ_s (g_j[s] B_j)ᵀ d[s]

(:class:`~gradhooks.pieces.Outer` pieces, ``weight`` and ``bias`` as a Linear's). The dropout
draws its mask in the forward, which no recomputation can replay: the rule reads the dropped
input ``d`` the forward multiplied by ``A`` off that product's autograd node (``saved``), in
the precision the product ran in. Where it cannot (dropout in training mode under activation
checkpointing, whose saved tensors are not kept), the call is refused.

Registered by name: gradhooks does not import ``loralib``; the rule covers its classes once
``loralib`` is imported, never another class of the same name. Its ``Embedding`` (no dropout)
and ``Conv2d`` (whose forward does not use its dropout) go through the fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .. import _torch
from ..errors import UnsupportedError, describe_module
from ..pieces import Outer, Piece
from .linear import _positions
from .registry import Call, register

#: The classes this rule covers, by name (``__module__`` and ``__qualname__``).
LINEAR = "loralib.layers.Linear"
MERGED_LINEAR = "loralib.layers.MergedLinear"

# how many autograd nodes of the call's output the search for LoRA's product looks through
_SEARCH = 256


@dataclass(frozen=True)
class Dropped:
    """The input after LoRA's dropout as the forward used it (``None``: no dropout ran, the
    input itself)."""

    value: Tensor | None


def _drops(module: nn.Module) -> bool:
    """Whether LoRA's dropout has a rate above 0 (a mask in training mode)."""
    dropout = getattr(module, "lora_dropout", None)
    return isinstance(dropout, nn.Dropout) and dropout.p > 0


def _dropout(module: nn.Module) -> nn.Dropout | None:
    """LoRA's dropout where it draws a mask now (training mode, ``p > 0``), else ``None``."""
    return module.lora_dropout if _drops(module) and module.lora_dropout.training else None


def _reaches(node, params: set[int]) -> bool:
    """Whether the autograd node ``node`` leads to the gradient of one of ``params`` (ids)."""
    queue, seen = [node], {id(node)}
    while queue and len(seen) < _SEARCH:
        node = queue.pop(0)
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) in params:
            return True
        for nxt, _ in node.next_functions:
            if nxt is not None and id(nxt) not in seen:
                seen.add(id(nxt))
                queue.append(nxt)
    return False


def dropped_input(module: nn.Module, args: tuple, kwargs: dict, output) -> Dropped | None:
    """The rule's ``saved``: the dropped input, read off the product of the forward that
    multiplies it by ``lora_A`` (or by the update ``B A`` it makes of it): the matrix product
    among the output's autograd nodes whose other factor comes from ``lora_A`` or ``lora_B``;
    its saved first factor is ``dropout(x)`` with the positions flattened. ``None`` where it
    cannot be read."""
    if _dropout(module) is None:
        return Dropped(None)
    if _torch.saved_tensor_hooks_active():  # (reading it would run the forward again)
        return None
    x = args[0] if args else None
    start = getattr(output, "grad_fn", None)
    if not isinstance(x, Tensor) or start is None:
        return None
    params = {id(p) for n, p in module.named_parameters() if n in ("lora_A", "lora_B")}
    queue, seen = [start], {id(start)}
    while queue and len(seen) < _SEARCH:
        node = queue.pop(0)
        kind = type(node).__name__
        if kind in ("MmBackward0", "AddmmBackward0"):
            first, other = ("self", 0) if kind == "MmBackward0" else ("mat1", 1)
            edges = [e for e, _ in node.next_functions[other : other + 2]]
            # (the product whose second factor comes from LoRA's parameters and whose first
            # does not: not B's product with A's output, in loralib's Linear)
            if (
                edges[1] is not None
                and _reaches(edges[1], params)
                and (edges[0] is None or not _reaches(edges[0], params))
            ):
                value = _torch.saved(node, first)
                if value is None or value.numel() != x.numel():
                    return None
                return Dropped(value.detach().reshape(x.shape))
        for nxt, _ in node.next_functions:
            if nxt is not None and id(nxt) not in seen:
                seen.add(id(nxt))
                queue.append(nxt)
    return None


def _parts(module: nn.Module) -> tuple[Tensor, int]:
    """The output features LoRA updates (a bool mask ``[out]``) and how many parts ``k``."""
    enable = getattr(module, "enable_lora", None)
    if enable is None:  # (Linear: one part, every feature)
        return torch.ones(module.out_features, dtype=torch.bool), 1
    return module.lora_ind, sum(bool(e) for e in enable)


@register(LINEAR, MERGED_LINEAR, saved=dropped_input)
def lora_linear(call: Call) -> dict[str, Piece | None]:
    """``x``: ``[batch, *, in]``, ``g``: ``[batch, *, out]``; the ``*`` positions are the
    pieces' ``shared`` axis."""
    m = call.module
    x = _positions(call.inputs[0])
    g = _positions(call.grad_output)
    pieces: dict[str, Piece | None] = {
        "weight": Outer(g, x, inputs_in_g=True) if m.fan_in_fan_out else Outer(x, g),
        "bias": Outer(None, g),
    }
    if not (m.r > 0 and hasattr(m, "lora_A")) or getattr(m, "merged", False):
        return pieces
    dropped = call.saved
    if not isinstance(dropped, Dropped) and not (call.training and _drops(m)):
        dropped = Dropped(None)  # (no mask was drawn: the input itself)
    if not isinstance(dropped, Dropped):
        raise UnsupportedError(
            f"{describe_module(call.name, m)}: its LoRA dropout (p={m.lora_dropout.p}) draws "
            "a mask in the forward, and the dropped input it multiplied by lora_A could not be "
            "read off the forward's graph (activation checkpointing does not keep it), so no "
            "per-example gradient of lora_A and lora_B can be formed. Run this layer outside "
            "checkpointing, or set lora_dropout=0 (or call model.eval())"
        )
    a_, b_ = call.parameter("lora_A"), call.parameter("lora_B")
    dtype = a_.dtype
    d = x if dropped.value is None else _positions(dropped.value)
    d, x, g = d.to(dtype), x.to(dtype), g.to(dtype)
    index, k = _parts(m)
    batch, shared = g.shape[:2]
    r, o = a_.shape[0] // k, b_.shape[0] // k  # (each part's rank and outputs)
    # each enabled part's output-gradient, times scaling: [batch, k, shared, o]
    g_lora = (g[..., index.to(g.device)] * m.scaling).view(batch, shared, k, o).transpose(1, 2)
    after_a = (d @ a_.T).view(batch, shared, k, r).transpose(1, 2)  # [batch, k, shared, r]
    b_parts = b_.view(k, o, r)
    # the gradient of A d per part: [batch, shared, k·r]
    g_after = torch.einsum("bkso,kor->bskr", g_lora, b_parts).reshape(batch, shared, k * r)
    pieces["lora_A"] = Outer(d, g_after)
    pieces["lora_B"] = Outer(after_a, g_lora)
    return pieces

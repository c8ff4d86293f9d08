"""nn.TransformerEncoderLayer / nn.TransformerDecoderLayer, both layouts, through their parts.

With ``batch_first=False`` (torch's default) the layer's Linear and LayerNorm parts see
``[seq, batch, features]``; their rules read dimension 0 as the batch, which would be wrong. So
this rule owns the whole layer: it reruns the layer's forward on the captured inputs, records
every call of a part (``self_attn``, ``multihead_attn``, ``linear1``, ``norm1``, ...) and its
output-gradient (one ``torch.autograd.grad`` from the layer's output-gradient), puts the
position-wise parts' tensors batch first, and hands each call to that part's own rule. The pieces
are the parts' own (:class:`Outer` for the Linear maps and attention projections), under the
layer's parameter names (``linear1.weight``, ``self_attn.in_proj_weight``, ...). The attention
(``nn.MultiheadAttention``) knows its own layout and gets its call as it was. A call that ran
with other tensors in place of the layer's parameters (``torch.func.functional_call``) is rerun
with them, the same way, and its parts' calls are handed them.

Scaling: none here; the engine scales for mean-reduced losses. Dropout (``dropout > 0`` in
training mode) cannot be replayed: an error at the forward (construct the layer with
``dropout=0``, or call ``eval()``); so is an attention part that is not an
``nn.MultiheadAttention``. Parts are looked up in the handle's registry (``call.registry``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import functional_call

from .._torch import tree_flatten, tree_map
from ..autocast import autocast_as
from ..engine.pause import paused
from ..engine.records import detach_tree
from ..errors import UnsupportedError, describe_module
from ..pieces import Direct, Piece
from .fallback import FALLBACK
from .registry import REGISTRY, Call, batch_first, register


def _batch_first(tree):
    return tree_map(
        lambda t: t.transpose(0, 1) if isinstance(t, Tensor) and t.dim() > 2 else t, tree
    )


def refuse_dropout(layer: nn.Module, name: str) -> None:
    """At the forward (and again in the rule, in the modes of the forward): dropout in
    training mode draws masks the rerun cannot replay. At the forward, since a loop may change
    the rates before the backward (dropout annealed from step to step)."""
    dropouts = [n for n, m in layer.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
    if layer.training and dropouts:
        raise UnsupportedError(
            f"{describe_module(name, layer)} is in training mode with dropout > 0 "
            f"({', '.join(dropouts)}): its random masks cannot be replayed, so per-example "
            "gradients of this layer cannot be computed. Construct it with dropout=0, or call "
            ".eval()."
        )


def refuse_custom_attention(layer: nn.Module, name: str) -> None:
    """At the forward: an attention part that is not an ``nn.MultiheadAttention`` running its
    own forward (Opacus' ``ModuleValidator.fix`` swaps in its ``DPMultiheadAttention``, with
    Linear submodules and a layout of its own; a subclass overriding ``forward`` has no rule).
    This rule hands each part to its own rule in the layout torch's parts have, and a part
    without one to the fallback with its own parameters only: the custom attention's
    submodules would be left without gradients, or read in the wrong layout."""
    for part in ("self_attn", "multihead_attn"):
        attn = getattr(layer, part, None)
        if attn is None or type(attn).forward is nn.MultiheadAttention.forward:
            continue
        what = (
            "with a forward of its own"
            if isinstance(attn, nn.MultiheadAttention)
            else "not an nn.MultiheadAttention"
        )
        raise UnsupportedError(
            f"{describe_module(name, layer)}: its attention part '{part}' is a "
            f"{type(attn).__qualname__}, {what}. This layer's rule "
            "reruns it and hands each part to its own rule in the layout of torch's parts, "
            "which another attention module (its own submodules and layout) does not "
            "follow. gradhooks computes nn.MultiheadAttention's per-example gradients "
            "itself: keep it (Opacus' ModuleValidator.fix swaps it for DPMultiheadAttention, "
            "which gradhooks does not need), or give the layer a forward of its own, "
            f"class Layer({type(layer).__qualname__}): def forward(self, *args, **kwargs): "
            "return super().forward(*args, **kwargs), whose parts are then hooked one by "
            "one."
        )


def _refuse_at_forward(layer: nn.Module, name: str) -> None:
    refuse_custom_attention(layer, name)
    refuse_dropout(layer, name)


@register(
    nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, owns_children=True,
    batch_dim=lambda layer: batch_first(layer.self_attn), on_forward=_refuse_at_forward,
)  # fmt: skip
def transformer_layer(call: Call) -> dict[str, Piece]:
    # rerun, and its parts' rules run, in the modes of the forward (a loop may have switched
    # the model between train() and eval() before the backward)
    with call.modes_at_forward():
        return _transformer_layer(call)


def _transformer_layer(call: Call) -> dict[str, Piece]:
    layer = call.module
    where = describe_module(call.name, layer)
    refuse_dropout(layer, call.name)
    # A create_graph backward: the parts' calls keep the graph of the rerun (through the
    # parameters too), and so do their pieces.
    create_graph = torch.is_grad_enabled()
    keep = (lambda tree: tree) if create_graph else detach_tree  # noqa: E731
    registry = call.registry if call.registry is not None else REGISTRY
    names = {m: n for n, m in layer.named_children()}
    records: list[tuple[str, nn.Module, tuple, dict, object]] = []

    def record(module, args, kwargs, output):
        records.append((names[module], module, args, kwargs, output))

    own = dict(layer.named_parameters(remove_duplicate=False))
    # (the tensors the call ran with, each refused where changed in place since the forward:
    # the rerun would compute with other values)
    ran = {n: call.parameter(n) for n in call.params or {}}
    replaced = {n: t for n, t in ran.items() if own.get(n) is not t}
    handles = [m.register_forward_hook(record, with_kwargs=True) for m in names]
    try:
        # under the autocast the forward ran under: the parts' output-gradients are then
        # autograd's own, rounded as they were
        with torch.enable_grad(), paused(), autocast_as(call.autocast):
            if replaced:  # with the tensors the call ran with, as it ran
                output = functional_call(layer, replaced, call.inputs, call.kwargs)
            else:
                output = layer.forward(*call.inputs, **call.kwargs)
    finally:
        for h in handles:
            h.remove()
    leaves = [
        [t for t in tree_flatten(out)[0] if isinstance(t, Tensor) and t.requires_grad]
        for *_, out in records
    ]
    flat = [t for ts in leaves for t in ts]
    grads = (
        iter(
            torch.autograd.grad(
                output, flat, call.grad_output, allow_unused=True, create_graph=create_graph
            )
        )
        if flat
        else iter(())
    )

    # A parameter tied between parts appears once, under its first name, among the layer's
    # parameters (the engine's); each part's piece for it is added under that name.
    first_name = {
        id(p): n for n, p in reversed(list(layer.named_parameters(remove_duplicate=False)))
    }
    pieces: dict[str, Piece] = {}
    called: set[str] = set()
    for (name, module, args, kwargs, out), ts in zip(records, leaves, strict=True):
        entry = registry.lookup(module)
        recurse = entry is not None and entry.owns_children
        params = {n: p for n, p in module.named_parameters(recurse=recurse) if p.requires_grad}
        part_grads = [torch.zeros_like(t) if (g := next(grads)) is None else g for t in ts]
        if not params:  # nothing to compute (all frozen: maybe no gradient reached it either)
            continue
        if entry is None:
            entry = FALLBACK  # a part without a rule: torch.func, as for any module
        if name in called:
            raise UnsupportedError(f"{where}: part '{name}' was called twice; not supported")
        called.add(name)
        out_leaves = tree_flatten(out)[0]
        full: list[Tensor | None] = [None] * len(out_leaves)
        it = iter(part_grads)
        for i, t in enumerate(out_leaves):
            if isinstance(t, Tensor) and t.requires_grad:
                full[i] = next(it)
        prefix = f"{name}."
        part = Call(
            module=module,
            inputs=keep(args),
            kwargs=keep(kwargs),
            output=keep(out) if entry.needs_output else None,
            grad_outputs=tuple(full),
            name=f"{call.name}.{name}" if call.name else name,
            registry=registry,
            params={n[len(prefix) :]: t for n, t in replaced.items() if n.startswith(prefix)},
        )
        if not layer.self_attn.batch_first and not isinstance(module, nn.MultiheadAttention):
            # A position-wise part: [seq, batch, ...] -> [batch, seq, ...].
            part = Call(
                module=module,
                inputs=_batch_first(part.inputs),
                kwargs=_batch_first(part.kwargs),
                output=_batch_first(part.output),
                grad_outputs=_batch_first(part.grad_outputs),
                name=part.name,
                registry=registry,
                params=part.params,
            )
        for pname, piece in entry.rule(part).items():
            if pname in params:
                key = first_name[id(params[pname])]
                pieces[key] = (
                    piece if key not in pieces else _added(pieces[key], piece, params[pname])
                )
    return pieces


def _added(p: Piece, q: Piece, param: Tensor) -> Piece:
    """One piece for a parameter two parts use: the sum of their per-example gradients."""
    return Direct(p.grad1(param.shape) + q.grad1(param.shape))

"""Per-example Jacobians of every output with respect to every parameter, from the hooks.

One forward on the batch; then one backward of the identity over the outputs, batched with
``torch.func.vmap`` (``vmap`` over the ``outputs`` one-hot output-gradients; one backward per
output where gradhooks cannot read vmap's batched tensors, see ``gradhooks._torch``). In that
backward every hooked call sees a batch of output-gradients, its rule makes its pieces once (a
convolution's im2col is computed once, not once per output), and the pieces' ``grad1`` *is* the
Jacobian: ``J[b, c] = ∂ out[b, c] / ∂ p``. Every layer with a rule is covered; reused modules and
tied weights are summed as for ``grad1``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from . import _torch
from .engine import add_hooks
from .forward import output_edges
from .registry import REGISTRY, Registry

__all__ = ["jacobians"]


def jacobians(
    model: nn.Module,
    inputs: Tensor,
    *,
    flatten: bool = False,
    registry: Registry = REGISTRY,
) -> dict[str, Tensor] | Tensor:
    """Per-example Jacobians of ``model``'s output with respect to its trainable parameters.

    Args:
        model: a model whose examples are independent (no batch statistics), not hooked.
        inputs: ``[batch, ...]``. The output may have any shape ``[batch, *out]``; its
            ``outputs = prod(out)`` entries are flattened row-major.
        flatten: return one ``[batch, outputs, P]`` tensor, parameters concatenated in
            ``named_parameters()`` order, each flattened row-major (as the ``torch.func``
            ``vmap(jacrev)`` recipe concatenates them).

    Returns:
        ``{name: [batch, outputs, *p.shape]}`` with ``J[name][b, c] = ∂ out[b, c] / ∂ p``, or
        the flattened tensor. No loss is involved, so there is no mean/sum scaling.

    Example::

        >>> import torch, gradhooks
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        >>> J = gradhooks.jacobians(net, torch.randn(5, 4))
        >>> J["0.weight"].shape
        torch.Size([5, 3, 8, 4])
        >>> gradhooks.jacobians(net, torch.randn(5, 4), flatten=True).shape   # P = 32+8+24+3
        torch.Size([5, 3, 67])
    """
    batch = inputs.shape[0]
    named: dict[str, nn.Parameter] = {}
    for name, p in model.named_parameters():
        if p.requires_grad and all(q is not p for q in named.values()):
            named[name] = p
    params = list(named.values())
    with add_hooks(model, loss_reduction="sum", registry=registry, quantities=("_jacobian",)) as h:
        # The backward is taken with respect to the hooked calls' outputs (and the parameters
        # no hooked module covers), not the parameters: autograd then never forms the
        # parameters' own gradients (batched over the outputs, for a convolution the largest
        # part of the work), which the hooks' pieces replace.
        covered = {id(q) for t in h._targets for q in t.params.values()}
        with output_edges(h) as reached:
            out = model(inputs)
        wrt = reached + [p for p in params if id(p) not in covered]
        outputs = math.prod(out.shape[1:])
        # the results, allocated once; the backward writes each parameter's block in place
        total = sum(p.numel() for p in params)
        flat = out.new_empty(batch, outputs, total) if flatten else None
        result, offset = {}, 0
        for name, p in named.items():
            if flat is not None:
                block = flat[:, :, offset : offset + p.numel()].unflatten(-1, p.shape)
                offset += p.numel()
            else:
                block = p.new_empty(batch, outputs, *p.shape)
            result[name] = h._collector.jacobian[id(p)] = block
        if batch and outputs and wrt:
            eye = torch.eye(outputs, dtype=out.dtype, device=out.device)
            # [outputs, batch, *out]: output-gradient c is one-hot at output c for every example
            vs = eye[:, None, :].expand(outputs, batch, outputs).reshape(outputs, *out.shape)

            def backward(v: Tensor):
                torch.autograd.grad(out, wrt, v, retain_graph=True, allow_unused=True)
                return v  # the results are written by the hooks; vmap wants a tensor back

            if _torch.batched_backwards():
                with _torch.own_transform():
                    torch.func.vmap(backward)(vs)
            else:  # one output at a time, each added into its column
                for block in result.values():
                    block.zero_()
                collector = h._collector
                try:
                    for c in range(outputs):
                        collector.jacobian_column = c
                        backward(vs[c])
                finally:
                    collector.jacobian_column = None
        for p in params:  # reached by no output: the Jacobian is zero
            if id(p) not in h._collector.jacobian_written:
                h._collector.jacobian[id(p)].zero_()
    return flat if flat is not None else result

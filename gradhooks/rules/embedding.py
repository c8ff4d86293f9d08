"""nn.Embedding and nn.EmbeddingBag: the weight rows an example looked up get its gradients.

A lookup is a one-hot row times the weight, so the per-example gradient is an outer product of
one-hot rows with the output-gradient. The rules return a :class:`Rows` piece (which rows get
which output-gradient vectors): ``grad1`` is one scatter-add into
``[batch, num_embeddings, embedding_dim]``, and norms / squared sums are computed on the rows
each example touched, without ``grad1``. ``EmbeddingBag(mode="max")`` returns a :class:`Direct`
piece. Rules never scale: the engine applies mean/sum.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..errors import ConfigurationError, UnbatchedInputError, UnsupportedError, describe_module
from ..pieces import Direct, Rows
from .registry import Call, register


def sums_to_grad(module: nn.Module, args: tuple) -> bool:
    """Whether a lookup's batch gradient is taken from its pieces (one ``index_add_`` of the rows
    looked up) rather than from autograd: always, but where ``.grad`` is not their sum
    (``scale_grad_by_freq``: torch counts the rows over the whole batch) or is sparse
    (``sparse=True``). Then autograd never forms the dense gradient of the table where it is
    not wanted: the book-keeping DP step, which uses the pieces alone (a table of a vocabulary's
    rows: 31 MiB for BERT's 30,522 x 256)."""
    return not (module.scale_grad_by_freq or module.sparse)


@register(nn.Embedding, batch_dim="positions", grad_from_grad1=sums_to_grad)
def embedding(call: Call) -> dict[str, Rows]:
    """``input``: ``[batch, *]`` indices, ``g``: ``[batch, *, dim]``; per example,
    ``grad1[b, n] = Σ_{positions p with input[b, p] = n} g[b, p]``.

    ``padding_idx``: that row gets no gradient (as in torch). ``scale_grad_by_freq``: each row's
    gradient is divided by how often the row occurs *in that example* (torch divides by the
    count in the whole batch; per example, the batch is the example), so ``grad1.sum(0)`` is
    then not ``weight.grad``. ``sparse``: ``grad1`` is dense all the same. ``max_norm``: the
    forward's in-place renormalization does not change the gradient.
    """
    m: nn.Embedding = call.module
    idx = call.inputs[0]
    if idx.dim() == 0:
        raise UnbatchedInputError(
            f"{describe_module(call.name, m)} got a 0-d input: per-example gradients need indices "
            "[batch, *]"
        )
    batch, dim = idx.shape[0], m.embedding_dim
    if idx.dim() != 2:
        idx = idx.reshape(batch, math.prod(idx.shape[1:]))
    g = call.grad_output
    if g.shape != (*idx.shape, dim):  # (no view of the same shape)
        g = g.reshape(*idx.shape, dim)
    if m.padding_idx is not None:
        g = g.masked_fill((idx == m.padding_idx)[..., None], 0)
    if m.scale_grad_by_freq:
        counts = torch.zeros(batch, m.weight.shape[0], dtype=g.dtype, device=g.device)
        counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=g.dtype))
        g = g / counts.gather(1, idx)[..., None]
    positions = idx.shape[1]
    example = torch.arange(batch, device=idx.device).repeat_interleave(positions)
    piece = Rows.checked_before(
        example, idx.reshape(-1), g.reshape(-1, dim), batch, m.weight.shape[0], positions
    )
    if m.scale_grad_by_freq:
        piece.sums_to_grad = False  # (each example's own counts: not the batch's)
    return {"weight": piece}


def bags(m: nn.EmbeddingBag, idx: Tensor, offsets: Tensor | None):
    """Flatten the bags: ``(bag, index, valid)`` per entry (1-D each) and the number of bags.

    2-D input ``[bags, length]``: one bag per row. 1-D input with ``offsets``: bag ``b`` holds
    ``input[offsets[b] : offsets[b + 1]]`` (the last bag runs to the end, or to the last offset
    with ``include_last_offset``). ``valid`` drops ``padding_idx`` entries.
    """
    if idx.dim() == 2:
        num_bags, length = idx.shape
        bag = torch.arange(num_bags, device=idx.device).repeat_interleave(length)
        idx = idx.reshape(-1)
        valid = torch.ones_like(idx, dtype=torch.bool)
    else:
        num_bags = offsets.numel() - 1 if m.include_last_offset else offsets.numel()
        starts = offsets[:num_bags]
        end = (
            offsets[num_bags : num_bags + 1]
            if m.include_last_offset
            else offsets.new_tensor([idx.numel()])
        )
        ends = torch.cat([offsets[1:num_bags], end])
        pos = torch.arange(idx.numel(), device=idx.device)
        bag = (torch.bucketize(pos, starts, right=True) - 1).clamp(min=0)
        valid = (pos >= starts[bag]) & (pos < ends[bag]) if num_bags else pos < 0
    if m.padding_idx is not None:
        valid = valid & (idx != m.padding_idx)
    return bag, idx, valid, num_bags


@register(nn.EmbeddingBag)
def embedding_bag(call: Call) -> dict[str, Direct | Rows]:
    """One example per bag: ``input`` ``[bags, length]``, or 1-D with ``offsets`` (then
    ``batch`` = the number of bags); ``g``: ``[bags, dim]``.

    ``sum``: ``grad1[b, n] = Σ_{entries e of bag b with index n} w_e · g[b]`` (``w`` the
    ``per_sample_weights``, else 1); ``mean``: ``w_e = 1 / |bag b|``; ``max``: ``g[b, d]`` goes
    to the row that held the maximum of dimension ``d``. ``padding_idx`` entries are left out,
    as in torch; an empty bag has a zero gradient.
    """
    m: nn.EmbeddingBag = call.module
    args = dict(zip(("input", "offsets", "per_sample_weights"), call.inputs, strict=False))
    args.update(call.kwargs)
    idx, offsets, weights = args["input"], args.get("offsets"), args.get("per_sample_weights")
    if m.scale_grad_by_freq:
        raise UnsupportedError(
            f"{describe_module(call.name, m)} has scale_grad_by_freq=True, which gradhooks does "
            "not support: torch scales by how often a row occurs in the whole batch, which is no "
            "per-example gradient. Use scale_grad_by_freq=False, or unsupported='skip'."
        )
    if idx.dim() == 1 and offsets is None:
        raise ConfigurationError(f"{describe_module(call.name, m)}: a 1-D input needs offsets")
    g = call.grad_output  # [bags, dim]
    bag, flat, valid, num_bags = bags(m, idx, offsets)
    dim = m.embedding_dim
    if m.mode == "max":
        value = g.new_zeros(num_bags, m.weight.shape[0], dim)
        # The entry holding each dimension's maximum, per bag: [bags, length] padded with -inf.
        valid_bag, valid_idx = bag[valid], flat[valid]
        counts = torch.bincount(valid_bag, minlength=num_bags)
        length = int(counts.max()) if num_bags and valid_bag.numel() else 0
        slot = (
            torch.arange(valid_bag.numel(), device=g.device)
            - (torch.cumsum(counts, 0) - counts)[valid_bag]
        )
        rows = g.new_full((num_bags, length, dim), -math.inf)
        # (the weight the call ran with: functional_call may have replaced it for the call)
        weight = call.parameter("weight").detach()
        rows[valid_bag, slot] = weight[valid_idx].to(g.dtype)
        index = torch.zeros(num_bags, length, dtype=flat.dtype, device=g.device)
        index[valid_bag, slot] = valid_idx
        if length:
            winner = index.gather(1, rows.argmax(1))  # [bags, dim]
            nonempty = (counts > 0)[:, None].expand(-1, dim)
            b = torch.arange(num_bags, device=g.device)[:, None].expand(-1, dim)
            d = torch.arange(dim, device=g.device)[None, :].expand(num_bags, -1)
            value.index_put_(
                (b[nonempty], winner[nonempty], d[nonempty]), g[nonempty], accumulate=True
            )
        return {"weight": Direct(value)}
    coef = valid.to(g.dtype)
    if weights is not None:
        coef = coef * weights.reshape(-1).to(g.dtype)
    if m.mode == "mean":
        counts = torch.zeros(num_bags, dtype=g.dtype, device=g.device).index_add_(
            0, bag, valid.to(g.dtype)
        )
        coef = coef / counts[bag].clamp(min=1)
    bag, flat, coef = bag[valid], flat[valid], coef[valid]
    return {
        "weight": Rows.checked_before(
            bag, flat, coef[:, None] * g[bag], num_bags, m.weight.shape[0]
        )
    }

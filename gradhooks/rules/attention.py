"""nn.MultiheadAttention as shipped by torch: recompute the attention, differentiate, and split.

Per example, MultiheadAttention is::

    q = query Wqᵀ + bq      k = key Wkᵀ + bk      v = value Wvᵀ + bv        (in-projection)
    k, v += [bias_k], [bias_v] (add_bias_kv);  += [0] (add_zero_attn)      (extra key/value slots)
    ctx = softmax(q kᵀ / √head_dim + masks) v, per head                     (attention)
    out = ctx Woᵀ + bo                                                      (out_proj)

Every weight is a Linear map applied at every position, so its per-example gradient is an
:class:`Outer` of what it sees and the gradient of the loss with respect to what it produces:

- ``out_proj.weight``: ``Outer(ctx, grad_output)``; ``out_proj.bias``: ``Outer(None, grad_output)``
  (the module uses ``out_proj``'s parameters without calling it, so this rule owns them).
- ``in_proj_weight`` ``[3E, E]``: one group per projection, ``Outer(stack(query, key, value),
  stack(∂q, ∂k, ∂v))`` with ``groups = 3``; when the query and key lengths differ, the shorter
  sequence is padded with zero positions (which add nothing to a sum of outer products), marked
  as such (``Outer.seen``: K-FAC counts each projection's own positions).
- ``q_proj_weight`` / ``k_proj_weight`` / ``v_proj_weight`` (``kdim``/``vdim`` != ``embed_dim``):
  one ``Outer`` each; ``in_proj_bias`` ``[3E]``: ``Outer(None, ·)`` of the same groups.
- ``bias_k`` / ``bias_v`` ``[1, 1, E]``: one key/value slot per example: ``Direct``.

``∂q, ∂k, ∂v`` (per position, per example) come from recomputing the attention in explicit torch
ops from the captured inputs, mirroring ``F.multi_head_attention_forward`` (masks, ``is_causal``,
``bias_k``/``bias_v``, ``add_zero_attn``, ``need_weights``, ``average_attn_weights``), and one
``torch.autograd.grad`` with the gradients of both outputs (the attention output and, when the
loss uses them, the returned attention weights). No example sees another, so these are the
per-example gradients. Scaling: none here; the engine scales for mean-reduced losses.

Dropout inside the attention (``dropout > 0`` in training mode) draws a random mask this rule
cannot reproduce: the forward raises instead (use ``dropout=0`` or ``eval()``).
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from .. import _torch, devices
from ..errors import UnbatchedInputError, UnsupportedError, describe_module
from ..pieces import Direct, Outer, Piece, cast
from ..tuning import TUNING
from .registry import Call, batch_first, register

_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


def _float_mask(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A bool mask (True = masked) as an additive float mask; a float mask in ``dtype``, the
    recomputation's (one made in bfloat16 for the forward's activations under autocast holds
    the same values in float32, and ``scaled_dot_product_attention`` takes no other)."""
    if mask is None:
        return None
    if mask.is_floating_point():
        return cast(mask, dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, -math.inf)


def _attention(
    m: nn.MultiheadAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias_k: Tensor | None,
    bias_v: Tensor | None,
    args: dict,
    need_probs: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """The attention between the projections, batch first, as ``F.multi_head_attention_forward``
    computes it.

    ``q``: ``[batch, tgt, E]``, ``k``/``v``: ``[batch, src, E]``, ``bias_k``/``bias_v``:
    ``[batch, 1, E]`` (one copy per example). Returns ``ctx`` ``[batch, tgt, E]`` (the input
    of ``out_proj``) and the attention probabilities ``[batch, heads, tgt, src']`` (``src'``:
    with the bias_k and zero-attention slots), or ``None`` unless ``need_probs``: then the
    attention is torch's fused ``scaled_dot_product_attention`` (as in the module's own forward),
    much cheaper to run and backpropagate than the explicit softmax.
    """
    heads = m.num_heads
    batch, tgt = q.shape[:2]
    kpm = _float_mask(args["key_padding_mask"], q.dtype)
    attn_mask = _float_mask(args["attn_mask"], q.dtype)
    # torch hands is_causal to scaled_dot_product_attention (and ignores attn_mask) only here.
    causal = args["is_causal"] and kpm is None and not args["need_weights"]
    if causal:
        attn_mask = None
    elif attn_mask is not None:
        attn_mask = (
            attn_mask[None, None]
            if attn_mask.dim() == 2
            else rearrange(attn_mask, "(batch heads) tgt src -> batch heads tgt src", heads=heads)
        )
    if kpm is not None:
        kpm = rearrange(kpm, "batch src -> batch 1 1 src")

    def extra_slot(k: Tensor, v: Tensor, k_new: Tensor, v_new: Tensor):
        pad = lambda t: None if t is None else F.pad(t, (0, 1))  # noqa: E731
        return torch.cat([k, k_new], 1), torch.cat([v, v_new], 1), pad(attn_mask), pad(kpm)

    if bias_k is not None:
        k, v, attn_mask, kpm = extra_slot(k, v, bias_k, bias_v)
    if m.add_zero_attn:
        zero = k.new_zeros(batch, 1, k.shape[-1])
        k, v, attn_mask, kpm = extra_slot(k, v, zero, zero)
    q, k, v = (
        rearrange(t, "batch seq (heads dim) -> batch heads seq dim", heads=heads) for t in (q, k, v)
    )
    if not need_probs:
        mask = attn_mask if kpm is None else kpm if attn_mask is None else attn_mask + kpm
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        return rearrange(ctx, "batch heads tgt dim -> batch tgt (heads dim)"), None
    scores = q @ k.transpose(-1, -2) / math.sqrt(m.head_dim)
    if causal:  # scaled_dot_product_attention's causal mask: lower-left triangle, top aligned
        allowed = torch.ones(tgt, k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~allowed, -math.inf)
    for mask in (attn_mask, kpm):
        if mask is not None:
            scores = scores + mask
    probs = scores.softmax(-1)
    ctx = rearrange(probs @ v, "batch heads tgt dim -> batch tgt (heads dim)")
    return ctx, probs


def _same(a: Tensor, b: Tensor) -> bool:
    """``a`` and ``b`` are one tensor (the call's inputs are handed on as detached views)."""
    if a is b:
        return True
    try:
        return (
            a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype
        )  # fmt: skip
    except RuntimeError:  # (a tensor of a torch.func transform has no data pointer)
        return False


def _stacked(xs: list[Tensor]) -> Tensor:
    """``[batch, seq_i, f]`` tensors as ``[batch, len(xs), max seq, f]``, zero-padded."""
    longest = max(x.shape[1] for x in xs)
    return torch.stack([F.pad(x, (0, 0, 0, longest - x.shape[1])) for x in xs], 1)


def _lengths(xs: list[Tensor]) -> Tensor | None:
    """The positions of :func:`_stacked` that are not padding, ``[batch, len(xs), max seq]``
    (bool; :attr:`gradhooks.pieces.Outer.seen`); ``None`` where the lengths are equal."""
    sizes = [x.shape[1] for x in xs]
    if len(set(sizes)) == 1:
        return None
    steps = torch.arange(max(sizes), device=xs[0].device)
    seen = steps < torch.tensor(sizes, device=xs[0].device)[:, None]  # [len(xs), max seq]
    return seen.expand(xs[0].shape[0], *seen.shape)


class _Projections:
    """Taps of a self-attention call (``query is key is value``, packed ``in_proj_weight``):
    ``nodes``: the autograd node of the in-projection (whose output-gradient is ``∂[q, k, v]``
    at every position); ``ctx``: the attention output that ``out_proj`` multiplied, as the
    out-projection's node saved it. Both ``[seq * batch, ·]``, rows in ``(seq, batch)`` order
    (``F.multi_head_attention_forward`` works sequence-first)."""

    def __init__(self, node, ctx: Tensor) -> None:
        self.nodes = [node]
        self.ctx = ctx


def _packed(m: nn.MultiheadAttention) -> bool:
    """Whether query, key and value share one ``in_proj_weight`` (``[3E, E]``): torch
    registers it as ``None`` where they have projections of their own (``q_proj_weight``...),
    as its private ``_qkv_same_embed_dim`` says."""
    return m.in_proj_weight is not None


def _weight_of(node) -> Tensor | None:
    """The parameter an ``AccumulateGrad`` node (directly or through a transpose) feeds."""
    if node is not None and type(node).__name__ == "TBackward0":
        node = node.next_functions[0][0]
    return getattr(node, "variable", None)


_PRODUCTS = ("AddmmBackward0", "MmBackward0", "BmmBackward0")


def _multiplies_by(node, w: Tensor) -> bool:
    """Whether ``node`` is a matrix product whose right operand is ``w`` (transposed, or
    expanded over a batch): a Linear map by a weight that does not require grad (run detached,
    see :func:`self_attention_positions`), which autograd's graph does not otherwise show."""
    if type(node).__name__ not in _PRODUCTS:
        return False
    right = _torch.saved(node, "mat2")
    return right is not None and right.data_ptr() == w.data_ptr() and right.shape[-2:] == w.T.shape


def _left_operand(node) -> Tensor | None:
    """The left operand ``[rows, E]`` an ``addmm`` / ``mm`` node saved (a Linear's input)."""
    name = {"AddmmBackward0": "mat1", "MmBackward0": "self"}.get(type(node).__name__)
    return None if name is None else _torch.saved(node, name)


def projection_taps(
    m: nn.MultiheadAttention, args: tuple, kwargs: dict, output: tuple
) -> _Projections | None:
    """The taps of a stock self-attention call (see :class:`_Projections`), found in the
    graph of its output; ``None`` (the rule then recomputes the attention) for other calls or
    where torch's graph does not have the expected shape."""
    # query, key, value as passed, positionally or by name (the forward ran: they bind);
    # not Signature.bind, which costs more than the rest of this function
    query, key, value = (
        args[i] if i < len(args) else kwargs.get(name)
        for i, name in enumerate(("query", "key", "value"))
    )
    if (
        not isinstance(query, Tensor)
        or query.dim() != 3
        or key is not query
        or value is not query
        or not _packed(m)
        or m.bias_k is not None
        or not m.in_proj_weight.requires_grad
        or not m.out_proj.weight.requires_grad
        or not isinstance(output, tuple)
        or output[0].grad_fn is None
    ):
        return None
    wanted = {id(m.in_proj_weight): "in", id(m.out_proj.weight): "out"}
    found: dict[str, object] = {}
    seen, todo = set(), [output[0].grad_fn]
    while todo and len(found) < 2:  # the call's own graph: a few dozen nodes
        node = todo.pop()
        if node is None or node in seen or type(node).__name__ == "AccumulateGrad":
            continue
        seen.add(node)
        if "in" not in found and _multiplies_by(node, m.in_proj_weight):
            found["in"] = node  # the call ran with in_proj_weight detached
        for nxt, _ in node.next_functions:
            w = _weight_of(nxt) if type(node).__name__ != "TBackward0" else None
            if w is not None and id(w) in wanted:
                found.setdefault(wanted[id(w)], node)
            todo.append(nxt)
    if len(found) < 2:
        return None
    ctx = _left_operand(found["out"])
    batch, seq = (query.shape[0], query.shape[1]) if m.batch_first else query.shape[1::-1]
    if ctx is None or ctx.shape != (seq * batch, m.embed_dim):
        return None
    return _Projections(found["in"], ctx.detach())


def _tapped_pieces(call: Call, query: Tensor, g_out: Tensor | None) -> dict[str, Piece] | None:
    """The pieces from the taps (:func:`projection_taps`): ``in_proj_weight`` is
    ``Outer(query, ∂[q, k, v])``, ``out_proj.weight`` ``Outer(ctx, grad_output)``; ``query``
    and ``g_out`` batch first. ``None`` where the tapped gradient is not the expected one."""
    m: nn.MultiheadAttention = call.module
    (g_proj,) = call.tap_grads[0][:1]
    batch, seq = query.shape[:2]
    if g_proj is None or g_proj.numel() != seq * batch * 3 * m.embed_dim:
        return None
    g_proj = g_proj.reshape(seq, batch, 3 * m.embed_dim).transpose(0, 1)
    ctx = call.taps.ctx.reshape(seq, batch, m.embed_dim).transpose(0, 1)
    if g_out is None:
        g_out = query.new_zeros(batch, seq, m.embed_dim)
    pieces: dict[str, Piece] = {
        "in_proj_weight": Outer(query, g_proj),
        "out_proj.weight": Outer(ctx, g_out),
    }
    if m.in_proj_bias is not None:
        pieces["in_proj_bias"] = Outer(None, g_proj)
    if m.out_proj.bias is not None:
        pieces["out_proj.bias"] = Outer(None, g_out)
    return pieces


def self_attention_positions(m: nn.MultiheadAttention, args: tuple) -> bool:
    """``grad_from_grad1``: the call runs with ``in_proj_weight`` and ``in_proj_bias``
    detached (autograd then does not compute their batch gradient, which the sum of ``grad1``
    gives) for the calls whose taps the rule uses: a self-attention call (``query``, ``key``,
    ``value`` passed positionally, one tensor) on CPU with as many positions per example as
    :func:`gradhooks.rules.linear.many_positions` asks of a Linear. ``out_proj`` stays
    attached: its input, which the rule needs, is saved only for its own weight gradient."""
    if len(args) < 3 or not isinstance(args[0], Tensor) or args[0].dim() != 3:
        return False
    query = args[0]
    return (
        args[1] is query
        and args[2] is query
        and devices.cpu_trade_offs(query)
        and _packed(m)
        and m.bias_k is None
        and not (m.training and m.dropout > 0)
        and query.shape[1 if m.batch_first else 0] >= TUNING.sum_grad1_positions
    )


def refuse_dropout(m: nn.MultiheadAttention, name: str, training: bool | None = None) -> None:
    """At the forward (a loop may change the rate before the backward: dropout annealed from
    step to step), and again in the rule, ``training`` the mode the call ran in: dropout in
    training mode draws a mask inside torch's attention that the rule cannot replay."""
    if (m.training if training is None else training) and m.dropout > 0:
        raise UnsupportedError(
            f"{describe_module(name, m)} has dropout={m.dropout} inside the attention and is in "
            "training mode: its random mask is drawn inside torch's attention and cannot be "
            "reproduced, so per-example gradients of this layer cannot be computed. Construct "
            "it with dropout=0 (nn.TransformerEncoderLayer/DecoderLayer pass their dropout to "
            "it), or call .eval()."
        )


@register(
    nn.MultiheadAttention,
    on_forward=refuse_dropout,
    owns_children=True,
    taps=projection_taps,
    grad_from_grad1=self_attention_positions,
    batch_dim=batch_first,
)
def multihead_attention(call: Call) -> dict[str, Piece]:
    m: nn.MultiheadAttention = call.module
    args = _SIGNATURE.bind(m, *call.inputs, **call.kwargs)
    args.apply_defaults()
    args = args.arguments
    query, key, value = args["query"], args["key"], args["value"]
    where = describe_module(call.name, m)
    if query.dim() != 3:
        raise UnbatchedInputError(
            f"{where} got an unbatched query of shape {tuple(query.shape)}: per-example "
            "gradients need a batch dimension ([batch, seq, E] with batch_first=True, "
            "[seq, batch, E] otherwise)"
        )
    refuse_dropout(m, call.name, call.training)  # (the mode it ran in: a loop may switch it)
    # self-attention: one input for the three projections (as the taps' pieces take it)
    one_input = _same(query, key) and _same(query, value)
    if not m.batch_first:  # [seq, batch, E] -> [batch, seq, E]
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    g_out = call.grad_outputs[0]
    g_probs = call.grad_outputs[1] if len(call.grad_outputs) > 1 else None
    if g_out is not None and not m.batch_first:
        g_out = g_out.transpose(0, 1)
    # A create_graph backward: the pieces get the graph of the recomputation, through the
    # parameters too (the taps' tensors were computed with the in-projection detached).
    create_graph = torch.is_grad_enabled()
    if call.taps is not None and call.tap_grads and not create_graph:
        pieces = _tapped_pieces(call, query, g_out)
        if pieces is not None:
            return pieces
    own = (lambda t: t) if create_graph else Tensor.detach  # noqa: E731
    w = call.parameter  # (what the call ran with: functional_call may have replaced them)
    # recomputed in the parameters' dtype: under autocast the call ran in a lower precision,
    # and its inputs (a previous layer's output) and output-gradients may be bfloat16
    dtype = w("out_proj.weight").dtype
    query, key, value, g_out, g_probs = (
        None if t is None else cast(t, dtype) for t in (query, key, value, g_out, g_probs)
    )

    if _packed(m):
        w_q, w_k, w_v = own(w("in_proj_weight")).chunk(3)
    else:
        w_q, w_k, w_v = (own(w(f"{n}_proj_weight")) for n in "qkv")
    b_q = b_k = b_v = None
    if m.in_proj_bias is not None:
        b_q, b_k, b_v = own(w("in_proj_bias")).chunk(3)
    inputs = [query, key, value]
    with torch.enable_grad():
        projections = [
            _probed(F.linear(x, w, b), create_graph)
            for x, w, b in zip(inputs, (w_q, w_k, w_v), (b_q, b_k, b_v), strict=True)
        ]
        biases_kv = []
        if m.bias_k is not None:
            batch = query.shape[0]
            biases_kv = [
                _probed(own(b).reshape(1, 1, -1).expand(batch, 1, -1), create_graph)
                for b in (w("bias_k"), w("bias_v"))
            ]
        values = [v for v, _ in projections + biases_kv]
        # (the explicit softmax in a create_graph backward: torch's fused attention has no
        # double backward on CPU)
        ctx, probs = _attention(
            m, *values[:3], *(values[3:] or (None, None)), args,
            need_probs=g_probs is not None or create_graph,
        )  # fmt: skip
        outputs, grads = [], []
        if g_out is not None:
            outputs.append(ctx)
            grads.append(g_out @ own(w("out_proj.weight")))
        if g_probs is not None:
            outputs.append(probs.mean(1) if args["average_attn_weights"] else probs)
            grads.append(g_probs)
        leaves = [probe for _, probe in projections + biases_kv]
        if outputs:
            leaf_grads = torch.autograd.grad(
                outputs, leaves, grads, allow_unused=True, create_graph=create_graph
            )
            leaf_grads = [
                torch.zeros_like(t) if g is None else g
                for t, g in zip(leaves, leaf_grads, strict=True)
            ]
        else:
            leaf_grads = [torch.zeros_like(t) for t in leaves]
    g_qkv = leaf_grads[:3]

    pieces: dict[str, Piece] = {}
    if g_out is None:
        g_out = query.new_zeros(*query.shape[:2], m.embed_dim)
    pieces["out_proj.weight"] = Outer(own(ctx), g_out)
    if m.out_proj.bias is not None:
        pieces["out_proj.bias"] = Outer(None, g_out)
    if _packed(m) and one_input:  # [q k v] = x W_inᵀ: one product over 3E outputs
        pieces["in_proj_weight"] = Outer(query, torch.cat(g_qkv, -1))
    elif _packed(m):
        pieces["in_proj_weight"] = Outer(_stacked(inputs), _stacked(g_qkv), _lengths(inputs))
    else:
        for name, x, g in zip(("q", "k", "v"), inputs, g_qkv, strict=True):
            pieces[f"{name}_proj_weight"] = Outer(x, g)
    if m.in_proj_bias is not None:
        pieces["in_proj_bias"] = Outer(None, _stacked(g_qkv))
    if biases_kv:
        pieces["bias_k"] = Direct(leaf_grads[3])
        pieces["bias_v"] = Direct(leaf_grads[4])
    return pieces


def _probed(t: Tensor, keep_graph: bool = False) -> tuple[Tensor, Tensor]:
    """``(t + probe, probe)`` with ``probe`` a zero leaf that requires grad: the gradient with
    respect to the probe is the gradient with respect to ``t``. (A probe rather than
    ``t.requires_grad_()``, which torch.func transforms forbid: the Jacobians vmap the backward.)
    ``t`` is detached unless ``keep_graph`` (a create_graph backward: the gradient is then
    differentiable through what ``t`` was computed from)."""
    probe = torch.zeros(t.shape, dtype=t.dtype, device=t.device, requires_grad=True)
    return (t if keep_graph else t.detach()) + probe, probe

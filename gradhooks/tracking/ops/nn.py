"""The functional nn operations: convolutions, pooling, attention, recurrent layers,
embeddings, normalizations, losses."""

from __future__ import annotations

import re

from torch import Tensor

from ..layout import CONTRACTED, MIXED, PACKED, UNKNOWN, Layout
from .common import (
    HANDLERS,
    Handler,
    NeedsBatch,
    arg,
    first_tensor,
    handles,
    out_tensors,
    single_input,
    tensor_args,
)


@handles("im2col", "col2im")
def _patches(args, kwargs, out, layout_of):
    """``F.unfold`` / ``F.fold``: ``[N, C, *spatial]`` to and from ``[N, C·k, L]``, each
    example's own along dimension 0 (also folded with others there)."""
    t, lay = single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN or lay.dim != 0:
        return UNKNOWN
    return lay


def _one_example(lay: Layout, out, batch: int) -> Layout:
    """The layout of the output of an operation across the dimension that holds the examples
    (a Linear's features, a LayerNorm's normalized dimensions): with one example (a batch of
    one whose batch dimension was squeezed away: ``pool(h).squeeze()`` of ``[1, C, 1, 1]`` is
    ``[C]``) it is that example's whole, on a dimension 0 of its own; with more, every
    output entry is computed from every example's: :data:`CONTRACTED`."""
    o = first_tensor(out)
    if batch == 1 and lay.owners is None and o is not None and o.dim() >= 1:
        return Layout(0, 1, o.shape[0])
    return CONTRACTED


def _linear(args, kwargs, out, layout_of, batch):
    """``F.linear(x, w)`` contracts ``x``'s last dimension: a layout on another dimension
    stays; one on the last, :func:`_one_example`."""
    x = args[0]
    o = first_tensor(out)
    w = arg(args, kwargs, 1, "weight")
    if o is None or (isinstance(w, Tensor) and layout_of(w) is not None):
        return UNKNOWN
    lay = layout_of(x)
    if lay is None or lay is UNKNOWN:
        return UNKNOWN
    return _one_example(lay, out, batch) if lay.dim == x.dim() - 1 else lay


HANDLERS["linear"] = HANDLERS["bilinear"] = NeedsBatch(_linear)


@handles("scaled_dot_product_attention")
def _sdpa(args, kwargs, out, layout_of):
    o = first_tensor(out)
    if o is None:
        return UNKNOWN
    found = None
    names = ("query", "key", "value", "attn_mask")
    for i, name in enumerate(names):
        t = arg(args, kwargs, i, name)
        lay = layout_of(t) if isinstance(t, Tensor) else None
        if lay is None:
            continue
        if lay is UNKNOWN or lay.dim > t.dim() - 2:
            return UNKNOWN
        if lay.dim == t.dim() - 2:
            return _sdpa_alone(args, kwargs, o, layout_of)
        where = lay.at(lay.dim + o.dim() - t.dim())
        if found not in (None, where):
            return UNKNOWN
        found = where
    return found


def _sdpa_alone(args, kwargs, o: Tensor, layout_of) -> Layout:
    """Attention along the dimension of rows picked from the batch (the unpadded tokens of one
    sequence, ``q[start:stop]`` of a varlen batch): followed where the query, the key and the
    value each hold rows of one and the same example along their sequences, and the mask none
    (each example attends to itself alone, its rows stay the query's)."""
    one, query = None, None
    for i, name in enumerate(("query", "key", "value", "attn_mask")):
        t = arg(args, kwargs, i, name)
        lay = layout_of(t) if isinstance(t, Tensor) else None
        if lay is None:
            if name == "query":
                return UNKNOWN
            continue
        if name == "attn_mask" or lay.owners is None or lay.dim != t.dim() - 2:
            return UNKNOWN
        rows = lay.owners.rows
        if rows.numel() == 0 or not bool((rows == rows[0]).all()):
            return UNKNOWN
        if one is None:
            one = rows[0]
        elif bool(rows[0] != one):
            return UNKNOWN
        if name == "query":
            query = lay
    return query.at(o.dim() - 2)


@handles("multi_head_attention_forward")
def _mha(args, kwargs, out, layout_of):
    """``nn.MultiheadAttention``'s functional form: sequence-first ``[L, N, E]`` (or unbatched
    ``[L, E]``); the output ``[L, N, E]`` and the weights ``[N, (H,) L, S]``. Each of the ``N``
    rows attends alone, so the examples are where the query, the key or the value holds them
    (the others batch-free: learned queries expanded to the batch, DETR's object queries and
    a Perceiver's latents, attending to each example's features)."""
    found = None
    for i, name in enumerate(("query", "key", "value")):
        t = arg(args, kwargs, i, name)
        lay = layout_of(t) if isinstance(t, Tensor) else None
        if lay is None:
            continue
        if lay is UNKNOWN or t.dim() != 3 or lay.dim != 1 or found not in (None, lay):
            return UNKNOWN
        found = lay
    if found is None:
        return UNKNOWN
    outs = [o for o in (out if isinstance(out, tuple | list) else (out,)) if isinstance(o, Tensor)]
    return [found] + [found.at(0) for _ in outs[1:]]


@handles("lstm", "gru", "rnn_tanh", "rnn_relu")
def _rnn(args, kwargs, out, layout_of):
    """torch's fused recurrent layers: padded ``(input, hx, params, ..., batch_first)`` or
    packed ``(data, batch_sizes, hx, params, ...)``; outputs ``(output, h_n[, c_n])``, the
    states ``[layers * dirs, batch, hidden]``."""
    x = args[0]
    lay = layout_of(x)
    outs = out_tensors(out)
    if not outs:
        return UNKNOWN
    packed = isinstance(args[1], Tensor) and isinstance(args[3], list | tuple)
    if packed:
        if lay is not PACKED:
            return UNKNOWN
        # the states are in the packed order (longest first), which the module's forward
        # undoes with an index_select along the batch where the sequences were not sorted
        return [PACKED] + [UNKNOWN for _ in outs[1:]]
    batch_first = bool(args[-1])
    if lay is None and x.dim() == 3:
        # a batch-free input (a decoder's first step: the start token's embedding) run from
        # each example's state: the examples are where the states hold them
        hx = args[1] if isinstance(args[1], list | tuple) else (args[1],)
        found = {layout_of(h) for h in hx if isinstance(h, Tensor)} - {None}
        if len(found) == 1 and next(iter(found)).dim == 1:
            lay = next(iter(found)).at(0 if batch_first else 1)
    if lay is None:
        return UNKNOWN
    if lay is UNKNOWN or lay.dim != (0 if batch_first else 1):
        return UNKNOWN
    # (each row of the batch dimension runs alone: the examples stay where they were, also
    # folded with other rows, [batch * rows, time, features], as in Sequencer2d)
    return [lay] + [lay.at(1) for _ in outs[1:]]


@handles("gru_cell", "lstm_cell", "rnn_tanh_cell", "rnn_relu_cell")
def _rnn_cell(args, kwargs, out, layout_of):
    """torch's recurrent cells (``nn.GRUCell``, ``nn.LSTMCell``, ``nn.RNNCell``): ``(input,
    hx, w_ih, w_hh[, b_ih, b_hh])``, ``input`` ``[rows, in]`` and the state ``[rows, hidden]``
    (a pair for the LSTM's); each row runs alone, so the outputs (``h'``, or ``(h', c')``) keep
    the rows' layout, also rows folded with other dimensions (``[batch * time, in]``, as in
    x-transformers' GRU gating)."""
    if len(args) < 2 or kwargs:
        return UNKNOWN
    hx = args[1] if isinstance(args[1], tuple | list) else (args[1],)
    rows = [args[0], *(h for h in hx if isinstance(h, Tensor))]
    if any(layout_of(w) is not None for w in tensor_args(args[2:], {})):
        return UNKNOWN  # (a weight holding examples)
    found = None
    for t in rows:
        lay = layout_of(t)
        if lay is None:
            continue
        if lay is UNKNOWN or t.dim() != 2 or lay.dim != 0 or found not in (None, lay):
            return UNKNOWN  # (an unbatched cell, or input and state of other layouts)
        found = lay
    if found is None:
        return None
    outs = out_tensors(out)
    return found if len(outs) == 1 else [found for _ in outs]


@handles("_pack_padded_sequence")
def _pack(args, kwargs, out, layout_of):
    x, batch_first = args[0], bool(arg(args, kwargs, 2, "batch_first"))
    lay = layout_of(x)
    if lay is None or lay is UNKNOWN or lay.dim != (0 if batch_first else 1) or not lay.plain:
        return UNKNOWN
    return [PACKED, None]


@handles("_pad_packed_sequence")
def _unpack(args, kwargs, out, layout_of):
    if layout_of(args[0]) is not PACKED:
        return UNKNOWN
    return [Layout(0 if bool(arg(args, kwargs, 2, "batch_first")) else 1), None]


# operations that work on each example's own slice along dimension 0 ([N, C, ...]): convolutions,
# pooling, resampling, per-example normalizations
_SAMPLEWISE = """conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d
    convolution max_pool1d max_pool2d max_pool3d max_pool1d_with_indices max_pool2d_with_indices
    max_pool3d_with_indices avg_pool1d avg_pool2d avg_pool3d adaptive_avg_pool1d
    adaptive_avg_pool2d adaptive_avg_pool3d adaptive_max_pool1d adaptive_max_pool2d
    adaptive_max_pool3d adaptive_max_pool1d_with_indices adaptive_max_pool2d_with_indices
    lp_pool1d lp_pool2d lp_pool3d interpolate upsample upsample_nearest upsample_bilinear
    channel_shuffle native_channel_shuffle group_norm
    instance_norm local_response_norm grid_sample affine_grid fractional_max_pool2d
    fractional_max_pool3d max_unpool1d max_unpool2d max_unpool3d embedding_bag""".split()


# the number of dimensions of a batched input ``[N, C, *spatial]``: an unbatched one (``[C,
# *spatial]``, which F.conv2d and the pooling functions also take) has its channels on dimension
# 0, not the examples; ``None``: the operation takes batched inputs only
def _batched_dims(name: str) -> int | None:
    if name == "embedding_bag":
        return 2  # ([bags, indices]; a flat input with offsets has bags of any examples)
    found = re.search(r"([123])d(_|$)", name)
    return int(found.group(1)) + 2 if found else None


# the argument besides the input that holds the same examples (position, name)
_ALONG = {
    "grid_sample": (1, "grid"),
    "max_unpool1d": (1, "indices"),
    "max_unpool2d": (1, "indices"),
    "max_unpool3d": (1, "indices"),
    "embedding_bag": (8, "per_sample_weights"),
}


def _per_example(name: str) -> Handler:
    """An operation on each example's own slice along dimension 0 of its input: the layout of
    the input (or of :data:`_ALONG`'s argument), where it is on dimension 0 of a batched input
    and no other argument (a convolution's weight) holds examples."""
    batched, along = _batched_dims(name), _ALONG.get(name)

    def handler(args, kwargs, out, layout_of):
        x = arg(args, kwargs, 0, "input")
        second = arg(args, kwargs, *along) if along is not None else None
        found = None
        for t in tensor_args(args, kwargs):
            lay = layout_of(t)
            if lay is None:
                continue
            if t is not x and t is not second:
                return UNKNOWN  # (a weight that depends on the examples)
            if lay is UNKNOWN or lay.dim != 0 or found not in (None, lay):
                return UNKNOWN
            found = lay
        if found is not None and batched is not None and x.dim() != batched:
            return UNKNOWN  # (unbatched: the channels on dimension 0)
        return found

    return handler


for _n in _SAMPLEWISE:
    HANDLERS[_n] = _per_example(_n)

# the operations above in which each row of the batch runs alone: rows picked from the batch by
# an index (a layer called on ``x[:k]``, or on the tokens routed to it) are followed through them;
# a batch norm's rows too, where it normalizes by its running statistics (its handler refuses
# it in training: TabNet's ghost batch norm, over chunks of the batch, mixes each chunk's rows)
PER_ROW = frozenset(_SAMPLEWISE) | {
    "multi_head_attention_forward", "lstm", "gru", "rnn_tanh", "rnn_relu",
    "gru_cell", "lstm_cell", "rnn_tanh_cell", "rnn_relu_cell", "batch_norm",
}  # fmt: skip
_in_eval = _per_example("batch_norm")


@handles("pixel_shuffle", "pixel_unshuffle")
def _pixel_shuffle(args, kwargs, out, layout_of):
    """``[*, C, H, W]``: a layout among the leading dimensions stays."""
    t, lay = single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN or t is not arg(args, kwargs, 0, "input"):
        return UNKNOWN
    return lay if lay.dim < t.dim() - 3 else UNKNOWN


@handles("pad")
def _pad(args, kwargs, out, layout_of):
    """``F.pad`` pads the last ``len(pad) // 2`` dimensions."""
    t, lay = single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN:
        return UNKNOWN
    pad = list(arg(args, kwargs, 1, "pad"))
    j = t.dim() - 1 - lay.dim  # (pad lists the last dimension first)
    if 2 * j + 1 < len(pad) and (pad[2 * j] or pad[2 * j + 1]):
        return MIXED  # the batch dimension itself padded (or cropped): as cat with other rows
    return lay


# what a refusal adds to the name of an operation that mixes the examples, where its name
# alone does not say what to do
MIXES_AS = {
    "batch_norm": " (in train mode: a BatchNorm's statistics of the batch, with or without "
    "parameters, frozen or not, which every layer after it reads; put it in eval mode, or "
    "replace it: gradhooks.convert_batch_norm(model))",
}


@handles("batch_norm")
def _batch_norm(args, kwargs, out, layout_of):
    training = arg(args, kwargs, 5, "training", False)
    return MIXED if training else _in_eval(args[:1], {}, out, layout_of)


def _layer_norm(args, kwargs, out, layout_of, batch):
    """``F.layer_norm`` / ``F.rms_norm`` over ``x``'s last dimensions: a layout before them
    stays; one among them, :func:`_one_example`."""
    x = args[0]
    shape = arg(args, kwargs, 1, "normalized_shape")
    lay = layout_of(x)
    for w in tensor_args(args[2:], {k: v for k, v in kwargs.items() if k != "input"}):
        if layout_of(w) is not None:
            return UNKNOWN
    if lay is None or lay is UNKNOWN:
        return UNKNOWN
    k = 1 if isinstance(shape, int) else len(shape)
    return _one_example(lay, out, batch) if lay.dim >= x.dim() - k else lay


HANDLERS["layer_norm"] = HANDLERS["rms_norm"] = NeedsBatch(_layer_norm)


@handles("embedding", "one_hot")
def _embedding(args, kwargs, out, layout_of):
    idx = args[0]
    lay = layout_of(idx)
    w = arg(args, kwargs, 1, "weight")
    if isinstance(w, Tensor) and layout_of(w) is not None:
        return UNKNOWN
    return UNKNOWN if lay is None or lay is UNKNOWN else lay


@handles("fused_moving_avg_obs_fake_quant")
def _observed_fake_quant(args, kwargs, out, layout_of):
    """Quantization-aware training's ``FakeQuantize``: with its observer on, the range it
    quantizes with is first updated from the batch's min and max, so that every example's
    output depends on the others (``model.apply(torch.ao.quantization.disable_observer)``
    freezes it); off, elementwise."""
    x, observer_on = args[0], arg(args, kwargs, 1, "observer_on")
    lay = layout_of(x)
    if lay is None or lay is UNKNOWN:
        return lay
    return MIXED if isinstance(observer_on, Tensor) and bool(observer_on.any()) else lay


@handles("cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
          "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div",
          "poisson_nll_loss", "gaussian_nll_loss", "soft_margin_loss", "multilabel_margin_loss",
          "multilabel_soft_margin_loss", "hinge_embedding_loss", "margin_ranking_loss",
          "cosine_embedding_loss", "triplet_margin_loss", "multi_margin_loss")  # fmt: skip
def _loss(args, kwargs, out, layout_of):
    o = first_tensor(out)
    reduction = kwargs.get("reduction", "mean")
    if o is None or reduction != "none":
        return MIXED  # a reduction over the batch: the loss itself
    found = None
    for t in tensor_args(args, kwargs):
        lay = layout_of(t)
        if lay is None:
            continue
        if lay is UNKNOWN or lay.dim != 0:
            return UNKNOWN
        found = lay
    return found

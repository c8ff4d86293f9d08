"""A tenth set of the cases that other projects check in their own test suites, written in
gradhooks' terms and compared with float64 references (``torch.func`` ``vmap(grad)`` and
per-example loops). The first nine sets are :mod:`test_peer_suites`,
:mod:`test_peer_suites_more`, :mod:`test_peer_suites_third` to :mod:`test_peer_suites_ninth`;
this one adds:

- Opacus' per-layer hypothesis sweeps (``opacus/tests/grad_samples/conv2d_test.py``,
  ``conv3d_test.py``, ``group_norm_test.py``, ``layer_norm_test.py``, ``rms_norm_test.py``,
  ``instance_norm{1,2,3}d_test.py``, ``embedding_test.py``, ``sequence_bias_test.py``,
  ``dp_multihead_attention_test.py``, ``dp_rnn_test.py``) over the hyper-parameters they draw,
  under ``mean`` and ``sum`` losses, batch-first and time-major, empty batches included; its
  own layers (``opacus.layers.DPMultiheadAttention``, ``SequenceBias``, ``DPLSTM`` /
  ``DPGRU`` / ``DPRNN``) as they are, and those layers on the ``PackedSequence`` its
  ``_gen_packed_data`` makes (refused: their cells are handed the packed data);
- the same layer families under bfloat16 autocast, against the float64 oracle, and their
  per-example norms, squared sums and variance asked without ``grad1`` (BackPACK's
  ``BatchL2Grad``, ``SumGradSquared``, ``Variance``);
- a noiseless clipped step against Opacus' own ``GradSampleModule`` and ``DPOptimizer``
  (``noise_multiplier=0``), by every gradhooks method.

``grad1[i]`` is always the gradient of example ``i``'s own loss (the loss of a batch of one).
Every comparison is in float64 at the harness's ``rtol=1e-7, atol=1e-9`` unless a test says
otherwise.
"""

from __future__ import annotations

import copy

import hypothesis
import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gradhooks
from gradhooks.oracle import loop_grad, vmap_grad
from harness import assert_close, seeded

D = torch.float64
SWEEP = hypothesis.settings(max_examples=8, deadline=None)


def wavy(out, target=None) -> Tensor:
    """A loss that sums over the batch and is not symmetric in the outputs (a normalized
    layer's plain sum of squares has no gradient for its scale)."""
    return (out.sin() + 0.5 * out**2).sum()


class BatchFirst(nn.Module):
    """``inner`` of a time-major layer (``[time, batch, ...]`` in and out) seen batch-first,
    for the oracle (which maps dimension 0); ``first`` picks a tuple output's first part."""

    def __init__(self, inner: nn.Module, first: bool = False):
        super().__init__()
        self.inner, self.first = inner, first

    def forward(self, *xs):
        out = self.inner(*(x.transpose(0, 1) for x in xs))
        return (out[0] if self.first else out).transpose(0, 1)


class First(nn.Module):
    """``inner``'s first output (a recurrent layer's or an attention's)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *xs):
        return self.inner(*xs)[0]


def sweep_check(
    module: nn.Module, x, reduction: str, batch_dim: int = 0, what: str = "", loop: bool = False
):
    """``module`` (float64) on ``x`` (a tensor or a tuple; its examples on ``batch_dim``)
    hooked with ``loss_reduction=reduction``: every trainable parameter's ``grad1`` is
    ``vmap(grad)``'s of the :func:`wavy` loss (and the per-example loop's, with ``loop``), and
    reduces to ``.grad``; an empty batch gives an empty ``grad1``. Opacus'
    ``GradSampleHooks_test.run_test``, whose reference is a loop over micro-batches."""
    module = module.double()
    xs = x if isinstance(x, tuple) else (x,)
    batch = xs[0].shape[batch_dim]
    if batch:
        seen = module if batch_dim == 0 else BatchFirst(module)
        firsts = tuple(t.transpose(0, batch_dim) for t in xs)
        inputs = firsts if len(firsts) > 1 else firsts[0]
        want = vmap_grad(seen, wavy, inputs)
        if loop:
            for n, w in loop_grad(seen, wavy, inputs).items():
                assert_close(w, want[n], f"{what}: loop vs vmap, {n}")
        if seen is not module:
            want = {n.removeprefix("inner."): w for n, w in want.items()}
    with gradhooks.add_hooks(module, loss_reduction=reduction, batch_dim=batch_dim):
        loss = wavy(module(*xs))
        (loss / max(batch, 1) if reduction == "mean" else loss).backward()
    checked = 0
    for n, p in module.named_parameters():
        assert p.grad1.shape == (batch, *p.shape), f"{what} {n}: {tuple(p.grad1.shape)}"
        if batch:
            assert_close(p.grad1, want[n], f"{what} ({reduction}): {n}")
            reduced = p.grad1.mean(0) if reduction == "mean" else p.grad1.sum(0)
            assert_close(reduced, p.grad, f"{what}: grad1 reduced vs .grad, {n}")
        checked += 1
    assert checked, what


def expander(c: int) -> int:
    return 2 * c


def shrinker(c: int) -> int:
    return max(1, c // 2)


# == Opacus: tests/grad_samples/conv2d_test.py, conv3d_test.py ====================================


@SWEEP
@hypothesis.given(
    n=st.integers(0, 3),
    c=st.sampled_from([1, 3, 4]),
    h=st.integers(10, 12),
    w=st.integers(10, 12),
    mapper=st.sampled_from([expander, shrinker]),
    kernel_size=st.integers(2, 4),
    stride=st.integers(1, 2),
    padding=st.sampled_from([0, 2, "same", "valid"]),
    dilation=st.integers(1, 3),
    groups=st.sampled_from([1, 2, 4]),
    reduction=st.sampled_from(["mean", "sum"]),
)
def test_opacus_conv2d_by_hypothesis(
    n, c, h, w, mapper, kernel_size, stride, padding, dilation, groups, reduction
):
    """Opacus ``Conv2d_test.test_conv2d``: batch 0 to 3, channels 1, 3 or 4 grown or shrunk,
    kernel 2 to 4, stride 1 or 2, padding 0, 2, "same" (asymmetric with an even kernel) or
    "valid", dilation 1 to 3, the groups that divide both channel counts."""
    out_channels = mapper(c)
    hypothesis.assume(not (padding == "same" and stride != 1))
    hypothesis.assume(c % groups == 0 and out_channels % groups == 0)
    conv = seeded(
        lambda: nn.Conv2d(c, out_channels, kernel_size, stride, padding, dilation, groups)
    )
    x = seeded(lambda: torch.randn(n, c, h, w, dtype=D), 1)
    sweep_check(conv, x, reduction, what="conv2d")


def test_opacus_conv2d_asymmetric_dilation_and_kernel_size():
    """Opacus ``Conv2d_test.test_asymetric_dilation_and_kernel_size``: a (3, 1) kernel dilated
    (3, 1), without bias, on a ``[1, 1, 8, 1]`` input (an output two rows high, one wide): the
    one example's ``grad1`` is ``.grad``, both the loop's."""
    conv = seeded(lambda: nn.Conv2d(1, 1, kernel_size=(3, 1), dilation=(3, 1), bias=False))
    x = seeded(lambda: torch.randn(1, 1, 8, 1, dtype=D), 1)
    sweep_check(conv, x, "sum", what="asymmetric", loop=True)
    assert_close(conv.weight.grad1[0], conv.weight.grad, "one example: grad1 vs .grad")


@SWEEP
@hypothesis.given(
    n=st.integers(0, 3),
    c=st.sampled_from([1, 3, 4]),
    d=st.integers(3, 5),
    hw=st.integers(6, 7),
    mapper=st.sampled_from([expander, shrinker]),
    kernel_size=st.sampled_from([2, 3, (1, 2, 3)]),
    stride=st.sampled_from([1, 2, (1, 2, 3)]),
    padding=st.sampled_from([0, 2, (1, 2, 3), "same", "valid"]),
    dilation=st.sampled_from([1, (1, 2, 2)]),
    groups=st.sampled_from([1, 2, 4]),
    reduction=st.sampled_from(["mean", "sum"]),
)
def test_opacus_conv3d_by_hypothesis(
    n, c, d, hw, mapper, kernel_size, stride, padding, dilation, groups, reduction
):
    """Opacus ``Conv3d_test.test_conv3d``: per-dimension kernels, strides, paddings and
    dilations as tuples, "same" and "valid", groups, batch 0 to 3."""
    out_channels = mapper(c)
    hypothesis.assume(not (padding == "same" and stride != 1))
    hypothesis.assume(c % groups == 0 and out_channels % groups == 0)
    conv = seeded(
        lambda: nn.Conv3d(c, out_channels, kernel_size, stride, padding, dilation, groups)
    )
    x = seeded(lambda: torch.randn(n, c, d, hw, hw, dtype=D), 1)
    sweep_check(conv, x, reduction, what="conv3d")


# == Opacus: group_norm_test.py, layer_norm_test.py, rms_norm_test.py, instance_norm*_test.py ======


@SWEEP
@hypothesis.given(
    n=st.integers(0, 3),
    c=st.integers(1, 8),
    h=st.integers(5, 7),
    w=st.integers(4, 6),
    groups=st.sampled_from([1, 4, "C"]),
    reduction=st.sampled_from(["mean", "sum"]),
)
def test_opacus_group_norm_by_hypothesis(n, c, h, w, groups, reduction):
    """Opacus ``GroupNorm_test.test_3d_input_groups``: one group, four, or one per channel
    (instance-norm-like), over 1 to 8 channels, batch 0 to 3."""
    groups = c if groups == "C" else groups
    hypothesis.assume(c % groups == 0)
    norm = seeded(lambda: nn.GroupNorm(groups, c, affine=True))
    nn.init.uniform_(norm.weight, 0.5, 1.5)
    nn.init.uniform_(norm.bias, -0.5, 0.5)
    x = seeded(lambda: torch.randn(n, c, h, w, dtype=D), 1)
    sweep_check(norm, x, reduction, what=f"GroupNorm({groups}, {c})")


def norm_shapes(n, z, h, w, input_dim, norm_dim):
    """Opacus' ``get_x_shape_and_norm_shape``: the input shape and the trailing dimensions
    normalized."""
    x_shape = {2: [n, w], 3: [n, z, w], 4: [n, z, h, w]}[input_dim]
    return x_shape[input_dim - norm_dim :], x_shape


@SWEEP
@hypothesis.given(
    kind=st.sampled_from([nn.LayerNorm, nn.RMSNorm]),
    n=st.integers(1, 3),
    z=st.integers(1, 3),
    h=st.integers(1, 3),
    w=st.integers(5, 7),
    input_dim=st.integers(2, 4),
    norm_dim=st.integers(1, 3),
    reduction=st.sampled_from(["mean", "sum"]),
)
def test_opacus_layer_and_rms_norm_by_hypothesis(kind, n, z, h, w, input_dim, norm_dim, reduction):
    """Opacus ``LayerNorm_test.test_input_norm`` and ``RMSNorm_test.test_input_norm``: inputs
    of 2 to 4 dimensions, 1 to 3 trailing dimensions normalized (all of an example's when they
    are as many as its own), sizes of one included."""
    hypothesis.assume(norm_dim < input_dim)
    normalized, x_shape = norm_shapes(n, z, h, w, input_dim, norm_dim)
    norm = seeded(lambda: kind(normalized, elementwise_affine=True))
    for p in norm.parameters():
        nn.init.uniform_(p, 0.5, 1.5)
    x = seeded(lambda: torch.randn(*x_shape, dtype=D), 1)
    sweep_check(norm, x, reduction, what=f"{kind.__name__}({normalized}) on {x_shape}")


INSTANCE = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}


@SWEEP
@hypothesis.given(
    dims=st.sampled_from([1, 2, 3]),
    n=st.integers(1, 3),
    c=st.integers(1, 3),
    size=st.integers(4, 6),
    reduction=st.sampled_from(["mean", "sum"]),
)
def test_opacus_instance_norm_by_hypothesis(dims, n, c, size, reduction):
    """Opacus ``InstanceNorm{1,2,3}d_test``: ``affine=True`` without running statistics, 1 to
    3 channels, batch 1 to 3."""
    norm = seeded(lambda: INSTANCE[dims](c, affine=True, track_running_stats=False))
    nn.init.uniform_(norm.weight, 0.5, 1.5)
    x = seeded(lambda: torch.randn(n, c, *[size + k for k in range(dims)], dtype=D), 1)
    sweep_check(norm, x, reduction, what=f"InstanceNorm{dims}d({c})")


# == Opacus: embedding_test.py, sequence_bias_test.py ==============================================


@SWEEP
@hypothesis.given(
    n=st.integers(0, 3),
    t=st.integers(1, 4),
    q=st.integers(1, 3),
    r=st.integers(1, 2),
    v=st.integers(2, 12),
    dim=st.integers(2, 4),
    batch_first=st.booleans(),
    reduction=st.sampled_from(["mean", "sum"]),
)
def test_opacus_embedding_across_dims_by_hypothesis(n, t, q, r, v, dim, batch_first, reduction):
    """Opacus ``Embedding_test.test_input_across_dims``: index tensors of 2 to 4 dimensions,
    batch-first or time-major (the examples on dimension 1, ``batch_dim=1``), vocabularies of
    2 to 12 (indices repeat within an example and across examples), batch 0 to 3."""
    size = {2: [n, t], 3: [n, t, q], 4: [n, t, q, r]}[dim]
    emb = seeded(lambda: nn.Embedding(v, 5))
    idx = seeded(lambda: torch.randint(0, v, size), 1)
    if not batch_first:
        idx = idx.transpose(0, 1)
    sweep_check(emb, idx, reduction, batch_dim=0 if batch_first else 1, what=f"embedding {size}")


def opacus_layers():
    return pytest.importorskip("opacus.layers", reason="needs opacus")


@SWEEP
@hypothesis.given(
    n=st.integers(0, 3),
    t=st.integers(2, 6),
    d=st.integers(2, 5),
    batch_first=st.booleans(),
    reduction=st.sampled_from(["mean", "sum"]),
)
def test_opacus_sequence_bias_layer_by_hypothesis(n, t, d, batch_first, reduction):
    """Opacus ``SequenceBias_test.test_batch_second``: Opacus' own ``SequenceBias`` (a learned
    vector repeated over the batch and appended to each sequence), batch-first or time-major,
    batch 0 to 3; gradhooks has no rule for it and takes it through its fallback."""
    layer = seeded(lambda: opacus_layers().SequenceBias(d, batch_first=batch_first))
    x = seeded(lambda: torch.randn(n, t, d, dtype=D), 1)
    if not batch_first:
        x = x.transpose(0, 1)
    sweep_check(
        layer, x, reduction, batch_dim=0 if batch_first else 1, what="SequenceBias", loop=True
    )


# == Opacus: dp_multihead_attention_test.py, dp_rnn_test.py, with Opacus' own layers ================


@SWEEP
@hypothesis.given(
    n=st.integers(1, 3),
    t=st.integers(3, 6),
    heads=st.sampled_from([1, 2]),
    bias=st.booleans(),
    add_bias_kv=st.booleans(),
    add_zero_attn=st.booleans(),
    kv_dim=st.booleans(),
    reduction=st.sampled_from(["mean", "sum"]),
)
def test_opacus_dp_multihead_attention_layer_by_hypothesis(
    n, t, heads, bias, add_bias_kv, add_zero_attn, kv_dim, reduction
):
    """Opacus ``MultiHeadAttention_test.test_multihead_attention`` on Opacus' own
    ``DPMultiheadAttention`` (time-major ``[T, batch, 4]``, ``batch_dim=1``): with and without
    bias, ``add_bias_kv`` (its ``SequenceBias`` modules), ``add_zero_attn``, ``kdim`` /
    ``vdim`` given."""
    kdim = 4 if kv_dim else None
    attn = seeded(
        lambda: opacus_layers().DPMultiheadAttention(
            4, heads, bias=bias, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn,
            dropout=0.0, kdim=kdim, vdim=kdim,
        )
    )  # fmt: skip
    q, k, v = (seeded(lambda: torch.randn(t, n, 4, dtype=D), s) for s in (1, 2, 3))
    sweep_check(
        First(attn), (q, k, v), reduction, batch_dim=1, what="DPMultiheadAttention", loop=True
    )


DP_RNNS = ["DPRNN", "DPGRU", "DPLSTM"]


@SWEEP
@hypothesis.given(
    kind=st.sampled_from(DP_RNNS),
    n=st.integers(1, 3),
    t=st.integers(1, 3),
    d=st.integers(4, 5),
    hidden=st.integers(5, 6),
    num_layers=st.sampled_from([1, 2]),
    bias=st.booleans(),
    batch_first=st.booleans(),
    bidirectional=st.booleans(),
    reduction=st.sampled_from(["mean", "sum"]),
)
def test_opacus_dp_rnn_layers_by_hypothesis(
    kind, n, t, d, hidden, num_layers, bias, batch_first, bidirectional, reduction
):
    """Opacus ``RNN_test.test_rnn`` (padded inputs) on Opacus' own ``DPRNN`` / ``DPGRU`` /
    ``DPLSTM``: one or two layers, one or two directions, with and without bias, batch-first
    or time-major, sequences of one step, batches of one."""
    rnn = seeded(
        lambda: getattr(opacus_layers(), kind)(
            d, hidden, num_layers=num_layers, batch_first=batch_first, bias=bias,
            bidirectional=bidirectional,
        )
    )  # fmt: skip
    x = seeded(lambda: torch.randn(n, t, d, dtype=D), 1)
    if not batch_first:
        x = x.transpose(0, 1)
    sweep_check(First(rnn), x, reduction, batch_dim=0 if batch_first else 1, what=kind, loop=True)


@pytest.mark.parametrize("sorted_", [True, False], ids=["sorted", "unsorted"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "time-major"])
@pytest.mark.parametrize("kind", DP_RNNS)
def test_opacus_dp_rnn_layers_on_packed_sequences_are_refused(kind, batch_first, sorted_):
    """Opacus ``RNN_test.test_rnn`` with ``using_packed_sequences``: its own layers split the
    packed data by time step and hand each cell the rows of that step (a different number
    at each, in the packed order), which no rule can tell apart by example. Refused at the
    forward with :class:`gradhooks.UnsupportedError` naming the cell and the
    ``PackedSequence``, nothing written (torch's own recurrent layers take the same packed
    sequence: :mod:`test_peer_suites_more`)."""
    from opacus.utils.packed_sequences import _gen_packed_data

    rnn = seeded(lambda: getattr(opacus_layers(), kind)(4, 5, batch_first=batch_first)).double()
    torch.manual_seed(1)
    x = _gen_packed_data(3, 3, 4, batch_first, sorted_)
    x = nn.utils.rnn.PackedSequence(x.data.double(), x.batch_sizes, x.sorted_indices,
                                    x.unsorted_indices)  # fmt: skip
    with gradhooks.add_hooks(rnn, loss_reduction="sum"):
        with pytest.raises(
            gradhooks.UnsupportedError, match=r"'l0\.ih' \(RNNLinear\).*PackedSequence"
        ):
            rnn(x)
    for n, p in rnn.named_parameters():
        assert p.grad is None and not hasattr(p, "grad1"), n


class ZeroKeyAttention(nn.Module):
    """The attention of Opacus' ``DPMultiheadAttention`` with ``add_zero_attn``, written out:
    time-major ``[T, batch, 4]``, the heads folded into the batch dimension
    (``view(T, batch·heads, 2)``), a zero key joined to every sequence of keys."""

    def __init__(self, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        t, b, e = x.shape
        q = self.q(x).view(t, b * self.heads, e // self.heads).transpose(0, 1)
        k = self.k(x).view(t, b * self.heads, e // self.heads).transpose(0, 1)
        k = torch.cat([k, k.new_zeros(k.shape[0], 1, k.shape[2])], dim=1)
        attended = torch.bmm(torch.bmm(q, k.transpose(1, 2)).softmax(-1), k)
        return self.out(attended.transpose(0, 1).reshape(t, b, e))


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("opacus_layer", [False, True], ids=["written-out", "opacus-layer"])
def test_attention_with_a_zero_key_in_a_batch_of_one(opacus_layer, n):
    """The case Opacus' sweep draws with ``N=1`` (a batch of one), two heads and
    ``add_zero_attn``: the heads folded with the one example's dimension put it on the time
    dimension, and the zero key joined along it; ``grad1`` is the loop's (it was refused as a
    batch not found), as for larger batches."""
    if opacus_layer:
        attn = First(seeded(lambda: opacus_layers().DPMultiheadAttention(4, 2, add_zero_attn=True)))
        x = tuple(seeded(lambda: torch.randn(3, n, 4, dtype=D), s) for s in (1, 2, 3))
    else:
        attn = seeded(ZeroKeyAttention)
        x = seeded(lambda: torch.randn(3, n, 4, dtype=D), 1)
    sweep_check(attn, x, "sum", batch_dim=1, what="zero key", loop=True)


# == the same layer families under bfloat16 autocast ===============================================


def _time_major_embedding():
    return nn.Sequential(nn.Embedding(9, 6), nn.Linear(6, 3))


def _dp_attention():
    return First(opacus_layers().DPMultiheadAttention(4, 2, add_bias_kv=True, add_zero_attn=True))


def _dp_lstm():
    return First(opacus_layers().DPLSTM(4, 5, num_layers=2, bidirectional=True))


def _ints(*shape):
    return lambda: torch.randint(0, 9, shape)


def _floats(*shape):
    return lambda: torch.randn(*shape, dtype=D)


# (id, model factory, input factory, batch_dim)
AUTOCAST = [
    ("conv2d-same-even-kernel-groups", lambda: nn.Conv2d(4, 8, 2, padding="same", dilation=3,
                                                          groups=2), _floats(3, 4, 9, 9), 0),
    ("conv3d-tuples", lambda: nn.Conv3d(2, 4, (1, 2, 3), (1, 2, 3), (1, 2, 3), (1, 2, 2)),
     _floats(3, 2, 3, 7, 7), 0),
    ("conv-group-norm-per-channel", lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(4, 4)),
     _floats(3, 2, 6, 5), 0),
    ("linear-layer-norm-three-dims", lambda: nn.Sequential(nn.Linear(5, 5), nn.LayerNorm([2, 3, 5])),
     _floats(3, 2, 3, 5), 0),
    ("linear-rms-norm-two-dims", lambda: nn.Sequential(nn.Linear(5, 5), nn.RMSNorm([3, 5])),
     _floats(3, 2, 3, 5), 0),
    ("conv-instance-norm3d", lambda: nn.Sequential(nn.Conv3d(2, 3, 2), nn.InstanceNorm3d(3, affine=True)),
     _floats(3, 2, 4, 5, 4), 0),
    ("embedding-time-major", _time_major_embedding, _ints(4, 3, 2), 1),
    ("opacus-dp-attention", _dp_attention, lambda: tuple(_floats(5, 3, 4)() for _ in range(3)), 1),
    ("opacus-dp-lstm", _dp_lstm, _floats(4, 3, 4), 1),
]  # fmt: skip


@pytest.mark.parametrize(
    "factory,inputs,batch_dim", [a[1:] for a in AUTOCAST], ids=[a[0] for a in AUTOCAST]
)
def test_opacus_layer_families_under_bf16_autocast(factory, inputs, batch_dim):
    """A layer setting of each sweep above in a float32 model run under CPU bfloat16 autocast:
    ``grad1`` within bfloat16's rounding (3e-2 of the model's largest entry) of the float64
    oracle's, the per-example norms within 3e-2 relative, ``.grad`` within the batch's sum of
    those."""
    if factory in (_dp_attention, _dp_lstm):
        opacus_layers()
    model = seeded(factory).double()
    x = seeded(inputs, 1)
    xs = x if isinstance(x, tuple) else (x,)
    seen = model if batch_dim == 0 else BatchFirst(model)
    firsts = tuple(t.transpose(0, batch_dim) for t in xs)
    want = vmap_grad(seen, wavy, firsts if len(firsts) > 1 else firsts[0])
    if seen is not model:
        want = {n.removeprefix("inner."): w for n, w in want.items()}
    low = copy.deepcopy(model).float()
    low_xs = tuple(t.float() if t.is_floating_point() else t for t in xs)
    with gradhooks.add_hooks(low, loss_reduction="sum", batch_dim=batch_dim,
                             quantities=("grad1", "norms")) as h:  # fmt: skip
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = low(*low_xs)
        wavy(out.float()).backward()
        norms = h.param_norms()
    scale = max(w.abs().max() for w in want.values())  # (a bias before a norm: ~0 gradient)
    for n, p in low.named_parameters():
        torch.testing.assert_close(p.grad1.double() / scale, want[n] / scale, rtol=0, atol=3e-2,
                                   msg=lambda m, n=n: f"{n}: {m}")  # fmt: skip
        torch.testing.assert_close(norms[n].double(), want[n].flatten(1).norm(dim=1), rtol=3e-2,
                                   atol=1e-3 * scale.item())  # fmt: skip
        torch.testing.assert_close(p.grad.double() / scale, want[n].sum(0) / scale, rtol=0,
                                   atol=3e-2 * len(want[n]))  # fmt: skip


# == Opacus: its own GradSampleModule and DPOptimizer, noiseless, clipping =========================


class ConvGroupNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.norm = nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4)
        self.head = nn.Linear(4 * 5 * 5, 3)

    def forward(self, x):
        return self.head(F.relu(self.norm(self.conv(x))).flatten(1))


class EmbeddingLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.lstm = opacus_layers().DPLSTM(4, 5, batch_first=True)
        self.head = nn.Linear(5, 3)

    def forward(self, idx):
        return self.head(self.lstm(self.emb(idx))[0][:, -1])


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = opacus_layers().DPMultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.attn(x, x, x)[0].mean(1))


def _norm_mlp():
    return nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3))


def _bag_instance_norm():
    return nn.Sequential(nn.Conv1d(2, 3, 2), nn.InstanceNorm1d(3, affine=True), nn.Flatten(),
                         nn.Linear(3 * 5, 3))  # fmt: skip


# (id, model factory, input factory)
DP_MODELS = [
    ("conv-group-norm", ConvGroupNorm, lambda: torch.randn(6, 1, 5, 5, dtype=D)),
    ("embedding-dp-lstm", EmbeddingLSTM, lambda: torch.randint(0, 10, (6, 4))),
    ("dp-self-attention", SelfAttention, lambda: torch.randn(6, 3, 4, dtype=D)),
    ("linear-layer-norm", _norm_mlp, lambda: torch.randn(6, 4, dtype=D)),
    ("conv1d-instance-norm", _bag_instance_norm, lambda: torch.randn(6, 2, 6, dtype=D)),
]


def opacus_clipped_mean(model: nn.Module, x, y, max_norm: float) -> dict[str, Tensor]:
    """``p.grad`` after Opacus' ``DPOptimizer.pre_step`` (clip, noise of σ = 0, divide by the
    expected batch size) on a ``GradSampleModule`` of a copy of ``model``, mean loss."""
    opacus = pytest.importorskip("opacus")
    from opacus.optimizers import DPOptimizer

    theirs = copy.deepcopy(model)
    wrapped = opacus.GradSampleModule(theirs, loss_reduction="mean")
    opt = DPOptimizer(
        torch.optim.SGD(theirs.parameters(), lr=0.1), noise_multiplier=0.0,
        max_grad_norm=max_norm, expected_batch_size=len(y), loss_reduction="mean",
    )  # fmt: skip
    opt.zero_grad()
    F.cross_entropy(wrapped(x), y).backward()
    opt.pre_step()
    grads = {n: p.grad.detach().clone() for n, p in theirs.named_parameters()}
    wrapped._close()
    return grads


@pytest.fixture
def cudnn_flags_settable():
    """Opacus' embedding grad sampler sets ``torch.backends.cudnn.deterministic``, which torch's
    own testing modules, once another test file imported them into this process, forbid:
    the test then skips, saying so (it runs alone, and where those modules were not
    imported)."""
    if torch.backends.flags_frozen():
        pytest.skip(
            "torch's testing modules froze torch.backends' flags in this process, and Opacus' "
            "grad sampler sets torch.backends.cudnn.deterministic"
        )


@pytest.mark.usefixtures("cudnn_flags_settable")
@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
@pytest.mark.parametrize(
    "factory,inputs", [m[1:] for m in DP_MODELS], ids=[m[0] for m in DP_MODELS]
)
def test_opacus_own_dp_optimizer_step_equals_the_noiseless_dp_step(factory, inputs, method):
    """Opacus' own ``GradSampleModule`` + ``DPOptimizer`` (``noise_multiplier=0``, clipping to
    the median per-example norm, so that some examples are clipped and some not) and
    ``gradhooks.dp_sgd_step`` by every method write the same ``.grad``: both the clipped mean
    of the float64 loop's gradients (gradhooks at the harness's tolerance; Opacus, which
    divides by ``norm + 1e-6``, within 1e-5 of the largest entry)."""
    if factory in (EmbeddingLSTM, SelfAttention):
        opacus_layers()
    model = seeded(factory).double()
    x = seeded(inputs, 1)
    y = seeded(lambda: torch.randint(0, 3, (6,)), 2)
    per_example = vmap_grad(model, lambda out, t: F.cross_entropy(out, t, reduction="sum"), x, y)
    norms = torch.cat([g.flatten(1) for g in per_example.values()], 1).norm(dim=1)
    max_norm = norms.median().item()
    assert (norms > max_norm).any() and (norms <= max_norm).any()
    factor = (max_norm / norms).clamp(max=1.0)
    want = {n: torch.einsum("b,b...->...", factor, g) / 6 for n, g in per_example.items()}
    theirs = opacus_clipped_mean(model, x, y, max_norm)
    scale = max(w.abs().max().item() for w in want.values())
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        gradhooks.dp_sgd_step(h, F.cross_entropy(model(x), y, reduction="none"),
                              max_norm=max_norm, noise_multiplier=0.0, method=method)  # fmt: skip
    for n, p in model.named_parameters():
        assert_close(p.grad, want[n], f"{method}: {n} vs the loop")
        torch.testing.assert_close(p.grad, theirs[n], rtol=1e-5, atol=1e-5 * scale,
                                   msg=lambda m, n=n: f"{method}: {n} vs Opacus: {m}")  # fmt: skip


@pytest.mark.parametrize(
    "factory,inputs,batch_dim", [a[1:] for a in AUTOCAST], ids=[a[0] for a in AUTOCAST]
)
def test_quantities_of_the_swept_layer_families_without_grad1(factory, inputs, batch_dim):
    """BackPACK's ``BatchL2Grad``, ``SumGradSquared`` and ``Variance`` of the same layer
    settings in float64, asked without ``grad1`` (``quantities=("norms", "sum_grad_sq")``):
    each example's norm, the squared sums and the population variance of the loop's
    per-example gradients; no ``grad1`` is formed."""
    if factory in (_dp_attention, _dp_lstm):
        opacus_layers()
    model = seeded(factory).double()
    xs = seeded(inputs, 1)
    xs = xs if isinstance(xs, tuple) else (xs,)
    seen = model if batch_dim == 0 else BatchFirst(model)
    firsts = tuple(t.transpose(0, batch_dim) for t in xs)
    want = loop_grad(seen, wavy, firsts if len(firsts) > 1 else firsts[0])
    if seen is not model:
        want = {n.removeprefix("inner."): w for n, w in want.items()}
    with gradhooks.add_hooks(
        model, loss_reduction="sum", batch_dim=batch_dim, quantities=("norms", "sum_grad_sq")
    ) as h:
        wavy(model(*xs)).backward()
        norms, sums, variance = h.param_norms(), h.sum_grad_sq(), h.grad_variance()
    for n, p in model.named_parameters():
        assert not hasattr(p, "grad1"), n
        w = want[n]
        assert_close(norms[n], w.flatten(1).norm(dim=1), f"norms of {n}")
        assert_close(sums[n], w.pow(2).sum(0), f"squared sums of {n}")
        assert_close(variance[n], w.var(0, unbiased=False), f"variance of {n}")

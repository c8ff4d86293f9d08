"""A fourteenth set of the cases that other projects check in their own test suites, written in
gradhooks' terms and compared with float64 references (per-example loops of autograd and
:mod:`gradhooks.oracle`). The first thirteen sets are :mod:`test_peer_suites`,
:mod:`test_peer_suites_more`, :mod:`test_peer_suites_third` to
:mod:`test_peer_suites_thirteenth`; this one adds TensorFlow Privacy's tests
(``tensorflow/privacy``: ``tensorflow_privacy/privacy/fast_gradient_clipping/``,
``keras_models/``, ``optimizers/``), their Keras layers re-expressed in torch, each case's
per-example norms (gradhooks' ``("norms",)``, never forming ``grad1``), ``grad1`` and DP
steps against the loop, and jax-privacy's clipped gradients:

- ``registry_functions/dense_test.py``, ``clip_grads_test.py`` (``CustomLayerTest``): a Dense
  layer (plain, with a sigmoid, its ``DoubleDense`` of two nested Dense layers) in its one- and
  two-layer models and its two-tower model (two inputs), under Keras' mean squared error and
  its ``test_loss_fn`` (``3.14 · Σ w (x - y)²``), with per-example loss weights, the norms of
  micro-batches (``num_microbatches``: the mean loss of consecutive examples is the unit) and
  of the first layer's variables alone (``partial``), on its batches of a zero example, a
  ``range`` example and both;
- ``registry_functions/einsum_dense_test.py``: Keras' ``EinsumDense`` (``torch.einsum`` of the
  input and a kernel, a bias over chosen output axes) for its 26 equations (cases C1 to C3:
  no ellipsis, a leading and a trailing one), with and without a sigmoid;
- ``registry_functions/layer_normalization_test.py``: Keras' ``LayerNormalization`` over each
  of its 14 sets of axes of rank-2 to rank-4 inputs (``axis=[1, 3]`` too), as Keras computes
  it (a scale and offset broadcast over the other axes) and as torch writes it (the axes moved
  last, then ``nn.LayerNorm``);
- ``registry_functions/nlp_position_embedding_test.py``: tf-models' ``PositionEmbedding``
  (the first rows of a table, broadcast to the input's shape along ``seq_axis``) added to the
  input, as models use it; returned alone, as the peer's test model does, refused (broadcast
  to ``x.shape``, given as numbers, its rows are tied to no example), and expanded by
  ``expand_as(x)`` (rows the examples' by construction) a false refusal, kept as a strict
  xfail;
- ``registry_functions/embedding_test.py``, ``nlp_on_device_embedding_test.py``: its
  bag-of-words models (embeddings summed per example, then a Dense layer, or weighted by a
  fixed table first), tf-models' ``OnDeviceEmbedding`` (by a gather or a one-hot matmul, with
  ``scale_factor``), and its ragged batches (an empty example among them) as an
  ``nn.EmbeddingBag`` cut by ``offsets`` and as padded ids under a mask;
- ``registry_functions/multi_head_attention_test.py``: Keras' ``MultiHeadAttention`` (its
  seven settings: a separate key, no bias, attention dropout, ``output_shape``, one head, a
  random attention mask), alone with ``EinsumDense`` projections as Keras builds it, and
  followed by a Dense layer with ``nn.Linear`` projections as torch code writes it (its
  kernels held by the attention layer itself, with dropout in its forward: refused, the
  fallback unable to draw the batch's masks again);
- ``clip_grads_test.py``: ``compute_clip_weights`` (zero norms included), the clipped gradient
  of its two-layer model for batches of 1, 2 and 10, three bounds and the ``sum`` and
  ``sum_over_batch_size`` reductions, and its ``SharedLayerTest`` (one Dense layer on 1, 2 or
  10 inputs, on one input repeated, on slices of one input), whose norms TensorFlow Privacy
  only bounds from above and gradhooks gives exactly;
- ``noise_utils_test.py``: the noise's standard deviation, ``C·σ`` for a summed loss and
  ``C·σ/batch`` for a mean one; ``gradient_clipping_utils_test.py``: a model's inputs and
  outputs packed in tuples, lists and dicts;
- ``keras_models/dp_keras_model_test.py``: ``DPSequential``'s step on one example by bounds
  that clip or not, its micro-batches as gradhooks' examples (the batch viewed as
  ``[micro-batches, size, ...]``) against the peer's expected gradients, the noise's
  deviation per micro-batch count, and an L2 regularizer (in each example's loss: refused;
  its gradient added after the step: the peer's weights);
- ``optimizers/clip_and_aggregate_gradients_test.py``: its six examples that read an
  embedding's rows and their own row of a variable, summed in 1, 2, 3 or 6 units, clipped and
  aggregated by ``mean`` or ``sum``, the embedding dense and sparse, a variable no loss
  reaches;
- ``optimizers/dp_optimizer_keras_test.py``: two variables clipped together per micro-batch
  through ``DPOptimizer``, large-batch emulation (nothing moves until a logical batch of 1,
  2 or 4 physical batches ends, then SGD's, Adam's or Adagrad's step on its mean loss), and
  its embedding model whose pooler reaches no loss (its gradient 0, noise alone), with the
  peer's softmax over one unit (every gradient and norm 0);
- jax-privacy (``jax_privacy/experimental/gradient_clipping_test.py``): its clipped sum of a
  quadratic loss in float64, float32, bfloat16 and float16 with the norms returned, padding
  examples, users of several examples each (``keep_batch_dim=False``) and a random draw in
  the loss.

``grad1[i]`` is always the gradient of example ``i``'s own loss (the loss of a batch of one).
Every comparison is in float64 at the harness's ``rtol=1e-7, atol=1e-9`` unless a test says
otherwise.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_close, assert_grad1, flat_grads

D = torch.float64


# == the shared recipe: common_test_utils.py =====================================================


def reshape_and_sum(t: Tensor) -> Tensor:
    """``common_test_utils.reshape_and_sum``: ``[batch, 1]``, the sum over every other axis."""
    return t.reshape(t.shape[0], -1).sum(-1, keepdim=True)


def mse_loss(out: Tensor, w: Tensor) -> Tensor:
    """Keras' ``MeanSquaredError(reduction=NONE)`` against ``ones_like(out)`` (the target
    ``get_computed_and_true_norms_from_model`` sets), weighted by ``w``: ``[batch]``."""
    return (out - 1).square().mean(-1) * w


def pi_loss(out: Tensor, w: Tensor) -> Tensor:
    """``common_test_utils.test_loss_fn``: ``3.14 · Σ w (x - y)²`` over the last axis."""
    return 3.14 * (w[:, None] * (out - 1).square()).sum(1)


def nd_test_batches(n: int) -> list[tuple[Tensor, Tensor]]:
    """``get_nd_test_batches(n)``: a zero example, a ``range(n)`` example and both, with their
    loss weights ``[1]``, ``[2]`` and ``[0.5, 0.5]``."""
    x0, x1 = torch.zeros(1, n, dtype=D), torch.arange(n, dtype=D)[None]
    return [
        (x0, torch.tensor([1.0], dtype=D)),
        (x1, torch.tensor([2.0], dtype=D)),
        (torch.cat([x0, x1]), torch.tensor([0.5, 0.5], dtype=D)),
    ]


def range_batch(batch: int, dims) -> Tensor:
    """Each test's ``tf.reshape(tf.range(batch · prod(dims)), [batch, *dims])``."""
    return torch.arange(batch * math.prod(dims), dtype=D).reshape(batch, *dims)


def as_args(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def check_norms(
    model: nn.Module,
    x,
    loss=mse_loss,
    target: Tensor | None = None,
    microbatches: int | None = None,
    partial: list[str] | None = None,
    what: str = "",
) -> dict[str, Tensor]:
    """``get_computed_and_true_norms_from_model``: the per-example norms by gradhooks'
    ``("norms",)`` (never forming ``grad1``) and ``grad1``, against the per-example loop;
    ``partial``, the names of the first layer's parameters, whose norms alone TensorFlow
    Privacy computes with ``partial=True``; ``microbatches``, the norms of the gradients of
    ``num_microbatches`` consecutive groups' mean losses (its micro-batches, each one unit).
    ``loss(out, target)`` gives ``[batch]``; ``target`` is each example's (the loss weights by
    default, all 1)."""
    args = as_args(x)
    batch = args[0].shape[0]
    w = torch.ones(batch, dtype=D) if target is None else target
    want = loop_grad(model, lambda out, wi: loss(out, wi).sum(), args, w)
    want_norms = flat_grads(want).norm(dim=1)

    model.zero_grad()
    with gradhooks.add_hooks(model, quantities=("norms",), loss_reduction="sum") as h:
        loss(model(*args), w).sum().backward()
        assert_close(h.norms(), want_norms, f"{what}: norms")
        if partial:
            got = torch.stack([h.param_norms()[n] for n in partial]).norm(dim=0)
            assert_close(got, flat_grads({n: want[n] for n in partial}).norm(dim=1), what)

    model.zero_grad()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        loss(model(*args), w).sum().backward()
    assert_grad1(model, want, f"{what}: grad1")
    g1 = {n: p.grad1 for n, p in model.named_parameters() if p.requires_grad}
    gradhooks.clear_grad1(model)

    if microbatches:
        # the true norms as ``compute_true_gradient_norms`` forms them: the Jacobian of the
        # micro-batches' mean losses, taken on the batched graph
        params = [p for p in model.parameters() if p.requires_grad]
        units = loss(model(*args), w).reshape(microbatches, -1).mean(1)
        rows = [
            torch.cat([g.flatten() for g in torch.autograd.grad(u, params, retain_graph=True)])
            for u in units
        ]
        true = torch.stack(rows).norm(dim=1)
        got = flat_grads(
            {n: g.reshape(microbatches, -1, *g.shape[1:]).mean(1) for n, g in g1.items()}
        )
        assert_close(got.norm(dim=1), true, f"{what}: {microbatches} micro-batches")
    return want


# == registry_functions/dense_test.py, clip_grads_test.py (CustomLayerTest) =====================


class DoubleDense(nn.Module):
    """``clip_grads_test.DoubleDense``: two Dense layers nested in one layer."""

    def __init__(self, a: int, units: int):
        super().__init__()
        self.dense1, self.dense2 = nn.Linear(a, units), nn.Linear(units, 1)

    def forward(self, x):
        return self.dense2(self.dense1(x))


DENSE_LAYERS = {
    "pure_dense": lambda a, b: nn.Linear(a, b),
    "sigmoid_dense": lambda a, b: nn.Sequential(nn.Linear(a, b), nn.Sigmoid()),
    "double_dense": DoubleDense,
}


class Func1(nn.Module):
    """``make_one_layer_functional_model``: the layer, then ``reshape_and_sum``."""

    def __init__(self, layer):
        super().__init__()
        self.layer1 = layer

    def forward(self, x):
        return reshape_and_sum(self.layer1(x))


class Func2(nn.Module):
    """``make_two_layer_functional_model``: the layer, a Dense(1), ``reshape_and_sum``."""

    def __init__(self, layer, width: int):
        super().__init__()
        self.layer1, self.dense = layer, nn.Linear(width, 1)

    def forward(self, x):
        return reshape_and_sum(self.dense(self.layer1(x)))


class Tower2(nn.Module):
    """``make_two_tower_model``: a layer on each of two inputs, added, a Dense(1)."""

    def __init__(self, make, a: int, b: int):
        super().__init__()
        self.layer1, self.layer2, self.dense = make(a, b), make(a, b), nn.Linear(b, 1)

    def forward(self, x1, x2):
        return reshape_and_sum(self.dense(self.layer1(x1) + self.layer2(x2)))


def dense_model(model_name: str, layer_name: str) -> nn.Module:
    make, a, b = DENSE_LAYERS[layer_name], 4, 2
    width = 1 if layer_name == "double_dense" else b
    if model_name == "func1":
        return Func1(make(a, b))
    if model_name == "func2":
        return Func2(make(a, b), width)
    return Tower2(make, a, b) if layer_name != "double_dense" else None


@pytest.mark.parametrize(
    "model_name,layer_name",
    [
        (m, layer)
        for m in ("func1", "func2", "tower2")
        for layer in DENSE_LAYERS
        if not (m == "tower2" and layer == "double_dense")
    ],
)
def test_dense_norms_on_various_models(model_name, layer_name):
    """dense_test.py ``test_gradient_norms_on_various_models`` (and ``CustomLayerTest`` for
    ``DoubleDense``): each batch of ``get_nd_test_batches(4)``, both losses, weighted or not,
    the first layer's norms alone (``partial``) and micro-batches of 1 and 2."""
    torch.manual_seed(0)
    model = dense_model(model_name, layer_name).double()
    first = [n for n, _ in model.named_parameters() if n.startswith("layer1.")]
    for x, w in nd_test_batches(4):
        for loss in (mse_loss, pi_loss):
            for weights in (None, w):
                for mb in (None, 1, 2):
                    if mb and x.shape[0] % mb:
                        continue
                    check_norms(
                        model,
                        (x, x) if model_name == "tower2" else x,
                        loss,
                        weights,
                        mb,
                        first,
                        f"{model_name}/{layer_name}/{loss.__name__}/batch {x.shape[0]}",
                    )


# == registry_functions/einsum_dense_test.py ====================================================


class EinsumDense(nn.Module):
    """Keras' ``EinsumDense(equation, output_shape, bias_axes, activation)``: ``einsum(equation,
    x, kernel)``, plus a bias over the output axes ``bias_axes`` names (shaped from the first
    of them to the last output axis, 1 where an axis is not named, so that it broadcasts),
    then the activation. The kernel's axes take their sizes from the input, or from
    ``output_dims``, the output's last axes (Keras' ``_analyze_einsum_string``)."""

    def __init__(self, equation: str, input_dims, output_dims, bias_axes, activation=None):
        super().__init__()
        self.equation, self.activation = equation, activation
        ins, rest = equation.split(",")
        kernel, outs = rest.split("->")
        elided = 1 + len(input_dims) - len(ins.replace("...", ""))
        fill = "ABCDEFGH"[:elided]
        ins, outs = ins.replace("...", fill), outs.replace("...", fill)
        sizes = dict(zip(ins, [0, *input_dims]))  # (the batch's size is not a kernel's)
        sizes.update(zip(outs[len(outs) - len(output_dims) :], output_dims))
        self.kernel = nn.Parameter(torch.randn(*[sizes[c] for c in kernel]))
        self.bias = None
        if bias_axes:
            first = min(outs.index(c) for c in bias_axes)
            shape = [sizes[c] if c in bias_axes else 1 for c in outs[first:]]
            self.bias = nn.Parameter(torch.randn(*shape))

    def forward(self, x):
        y = torch.einsum(self.equation, x, self.kernel)
        if self.bias is not None:
            y = y + self.bias
        return torch.sigmoid(y) if self.activation == "sigmoid" else y


# (equation, input_dims, output_dims, bias_axes): get_einsum_parameter_tuples()
EINSUM_CASES = {
    "C1": [
        ("ab,bc->ac", [2], [3], None),
        ("ab,bc->ac", [2], [3], "c"),
        ("abc,cd->abd", [2, 3], [2, 4], None),
        ("abc,cd->abd", [2, 3], [2, 4], "b"),
        ("abc,cd->abd", [2, 3], [2, 4], "d"),
        ("abc,cd->abd", [2, 3], [2, 4], "bd"),
        ("abc,cef->abef", [2, 3], [2, 4, 5], None),
        ("abc,cef->abef", [2, 3], [2, 4, 5], "bf"),
    ],
    "C2": [
        ("...b,bc->...c", [2, 3], [4], None),
        ("...b,bc->...c", [2, 3], [4], "c"),
        ("...ab,bc->...ac", [2, 3], [2, 4], None),
        ("...ab,bc->...ac", [2, 4], [2, 4], "c"),
        ("...abc,cd->...abd", [2, 3, 4], [2, 3, 5], None),
        ("...abc,cd->...abd", [2, 3, 4], [2, 3, 5], "b"),
        ("...abc,cd->...abd", [2, 3, 4], [2, 3, 5], "d"),
        ("...abc,cd->...abd", [2, 3, 4], [2, 3, 5], "bd"),
        ("...abc,cef->...abef", [2, 3, 4], [2, 3, 5, 6], None),
        ("...abc,cef->...abef", [2, 3, 4], [2, 3, 5, 6], "bf"),
    ],
    "C3": [
        ("ab...,bc->ac...", [2, 3], [4, 3], None),
        ("ab...,bc->ac...", [2, 3], [4, 3], "c"),
        ("abc...,cd->abd...", [2, 3, 4], [2, 5, 4], None),
        ("abc...,cd->abd...", [2, 3, 4], [2, 5, 4], "b"),
        ("abc...,cd->abd...", [2, 3, 4], [2, 5, 4], "d"),
        ("abc...,cd->abd...", [2, 3, 4], [2, 5, 4], "bd"),
        ("abc...,cef->abef...", [2, 3, 4], [2, 5, 6, 4], None),
        ("abc...,cef->abef...", [2, 3, 4], [2, 5, 6, 4], "bf"),
    ],
}


@pytest.mark.parametrize("family", list(EINSUM_CASES))
def test_einsum_dense_norms(family):
    """einsum_dense_test.py ``test_gradient_norms_on_various_models``: each equation of the
    case, ``pure_einsum`` and ``sigmoid_einsum`` (both for the first two, then in turn), a
    batch of 4 ``range`` examples (scaled to keep the sigmoid off its flat tails),
    micro-batches of 2."""
    for i, (equation, input_dims, output_dims, bias_axes) in enumerate(EINSUM_CASES[family]):
        activations = (None, "sigmoid") if i < 2 else ((None, "sigmoid")[i % 2],)
        for activation in activations:
            torch.manual_seed(0)
            layer = EinsumDense(equation, input_dims, output_dims, bias_axes, activation)
            model = Func1(layer).double()
            x = range_batch(4, input_dims) / (4 * math.prod(input_dims))
            check_norms(model, x, microbatches=2, what=f"{equation} {bias_axes} {activation}")


# == registry_functions/layer_normalization_test.py =============================================


class KerasLayerNorm(nn.Module):
    """Keras' ``LayerNormalization(axis=axes)``: the mean and variance over ``axes`` (of the
    batched input), a scale and an offset of shape ``[input.shape[a] for a in axes]``
    broadcast over the other axes, ``epsilon=1e-3``."""

    def __init__(self, input_dims, axes):
        super().__init__()
        rank = 1 + len(input_dims)
        self.axes = [a % rank for a in ([axes] if isinstance(axes, int) else axes)]
        shape = [1] * rank
        for a in self.axes:
            shape[a] = input_dims[a - 1]
        self.shape = shape[1:]
        n = math.prod(self.shape)
        self.gamma = nn.Parameter(1 + 0.1 * torch.randn(n))
        self.beta = nn.Parameter(0.1 * torch.randn(n))

    def forward(self, x):
        mean = x.mean(self.axes, keepdim=True)
        var = x.var(self.axes, keepdim=True, unbiased=False)
        y = (x - mean) * torch.rsqrt(var + 1e-3)
        return y * self.gamma.view(self.shape) + self.beta.view(self.shape)


class MovedLayerNorm(nn.Module):
    """The same normalization as torch code writes it: the normalized axes moved last, then
    ``nn.LayerNorm`` over them (its weight ``[sizes of the axes]``), moved back."""

    def __init__(self, input_dims, axes):
        super().__init__()
        rank = 1 + len(input_dims)
        self.axes = [a % rank for a in ([axes] if isinstance(axes, int) else axes)]
        self.norm = nn.LayerNorm([input_dims[a - 1] for a in self.axes], eps=1e-3)
        with torch.no_grad():
            self.norm.weight.add_(0.1 * torch.randn_like(self.norm.weight))
            self.norm.bias.add_(0.1 * torch.randn_like(self.norm.bias))

    def forward(self, x):
        last = list(range(x.dim() - len(self.axes), x.dim()))
        return self.norm(x.movedim(self.axes, last)).movedim(last, self.axes)


LAYER_NORM_CASES = {  # get_layer_norm_parameter_tuples(): (input_dims, axes)
    "rank2": [([3], -1), ([3], [1])],
    "rank3": [([3, 4], -1), ([3, 4], [1]), ([3, 4], [2]), ([3, 4], [1, 2])],
    "rank4": [
        ([3, 4, 5], -1),
        ([3, 4, 5], [1]),
        ([3, 4, 5], [2]),
        ([3, 4, 5], [3]),
        ([3, 4, 5], [1, 2]),
        ([3, 4, 5], [1, 3]),
        ([3, 4, 5], [2, 3]),
        ([3, 4, 5], [1, 2, 3]),
    ],
}


@pytest.mark.parametrize("layer", [KerasLayerNorm, MovedLayerNorm], ids=lambda c: c.__name__)
@pytest.mark.parametrize("rank", list(LAYER_NORM_CASES))
def test_layer_norm_over_axes(rank, layer):
    """layer_normalization_test.py: each set of axes, a batch of 6 ``range`` examples, its
    one-layer model, micro-batches of 2; both ways of writing it give the same gradients."""
    for input_dims, axes in LAYER_NORM_CASES[rank]:
        torch.manual_seed(0)
        model = Func1(layer(input_dims, axes)).double()
        x = range_batch(6, input_dims)
        check_norms(model, x, microbatches=2, what=f"{input_dims} axis={axes}")


# == registry_functions/nlp_position_embedding_test.py ==========================================


class PositionEmbedding(nn.Module):
    """tf-models' ``nlp.layers.PositionEmbedding(max_length, seq_axis)``: the table's first
    ``input.shape[seq_axis]`` rows, reshaped to 1 on every axis but ``seq_axis`` and the last,
    broadcast to the input's shape (``how="shape"``, as tf-models writes it: the output reads
    only the input's shape, given as numbers; ``"expand_as"``: ``rows.expand_as(x)``)."""

    def __init__(self, max_length: int, width: int, seq_axis: int, how: str = "shape"):
        super().__init__()
        self.seq_axis, self.how = seq_axis, how
        self.position_embeddings = nn.Parameter(torch.randn(max_length, width))

    def forward(self, x):
        length = x.shape[self.seq_axis]
        shape = [1] * x.dim()
        shape[self.seq_axis], shape[-1] = length, x.shape[-1]
        rows = self.position_embeddings[:length].reshape(shape)
        return rows.expand_as(x) if self.how == "expand_as" else torch.broadcast_to(rows, x.shape)


class Added(nn.Module):
    """The position embedding as models use it (tf-models' BERT encoder adds it to the word
    embeddings): ``x + layer(x)``, then ``reshape_and_sum``."""

    def __init__(self, layer):
        super().__init__()
        self.layer1 = layer

    def forward(self, x):
        return reshape_and_sum(x + self.layer1(x))


POSITION_CASES = [  # get_nlp_position_embedding_inputs(): (input_dims, max_length, seq_axis)
    ([3, 2], 6, 1),
    ([3, 2], 3, 1),
    ([4, 3, 2], 8, 1),
    ([4, 3, 2], 4, 1),
    ([4, 3, 2], 6, 2),
    ([4, 3, 2], 3, 2),
]


def test_position_embedding_norms():
    """nlp_position_embedding_test.py: each setting, a batch of 6, micro-batches of 2, the
    layer's output added to the input; the rows past the length get none."""
    for input_dims, max_length, seq_axis in POSITION_CASES:
        torch.manual_seed(0)
        model = Added(PositionEmbedding(max_length, input_dims[-1], seq_axis)).double()
        want = check_norms(model, range_batch(6, input_dims), microbatches=2, what="position")
        g = want["layer1.position_embeddings"]
        assert not g[:, input_dims[seq_axis - 1] :].any()


def test_position_embedding_alone_is_refused():
    """tf-models' model as its test builds it: the embedding's output is the model's (through
    ``reshape_and_sum``), broadcast to ``x.shape`` given as numbers, so nothing ties its rows
    to the examples (the same numbers could be a batch's or a table's): refused, naming the
    layer and the remedy (the position embedding added to per-example values, as above)."""
    torch.manual_seed(0)
    model = Func1(PositionEmbedding(6, 2, 1)).double()
    x = range_batch(6, [3, 2])
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with pytest.raises(gradhooks.BatchNotFoundError) as info:
            mse_loss(model(x), torch.ones(6, dtype=D)).sum().backward()
    said = str(info.value)
    assert "'layer1' (PositionEmbedding)" in said and "(6, 3, 2)" in said
    assert "Compute that term from per-example outputs" in said


@pytest.mark.xfail(
    strict=True,
    raises=gradhooks.BatchNotFoundError,
    reason="rows.expand_as(x), returned without meeting the batch, takes x's shape only: the "
    "tracker follows it as batch-free, though its rows are the examples' by construction",
)
def test_position_embedding_expanded_as_the_input():
    """The same model with ``rows.expand_as(x)``: the batched input gives the expansion its
    rows, so each row is its example's, as a batch of one gives it (the loop)."""
    torch.manual_seed(0)
    model = Func1(PositionEmbedding(6, 2, 1, how="expand_as")).double()
    check_norms(model, range_batch(6, [3, 2]), microbatches=2, what="expand_as")


# == registry_functions/embedding_test.py, nlp_on_device_embedding_test.py ======================


class OnDeviceEmbedding(nn.Module):
    """tf-models' ``nlp.layers.OnDeviceEmbedding(vocab_size, width, scale_factor,
    use_one_hot)``: a gather of the table's rows (or the ids' one-hot matrix times the
    table), times ``scale_factor`` when given."""

    def __init__(self, vocab: int, width: int, scale_factor=None, use_one_hot=False):
        super().__init__()
        self.embeddings = nn.Parameter(torch.randn(vocab, width))
        self.scale_factor, self.use_one_hot = scale_factor, use_one_hot

    def forward(self, ids):
        if self.use_one_hot:
            flat = F.one_hot(ids.reshape(-1), self.embeddings.shape[0]).to(self.embeddings)
            emb = (flat @ self.embeddings).reshape(*ids.shape, -1)
        else:
            emb = self.embeddings[ids]
        return emb * self.scale_factor if self.scale_factor else emb


class Bow(nn.Module):
    """``make_bow_model`` / ``make_dense_bow_model`` / ``make_weighted_bow_model``: each
    example's embeddings summed over every axis to ``[batch, 1]``, then a Dense(1) (``bow2``),
    or weighted first by a fixed ``range`` table of the example's shape (``weighted_bow1``)."""

    def __init__(self, kind: str, emb: nn.Module, input_dims, width: int):
        super().__init__()
        self.kind, self.emb = kind, emb
        self.dense = nn.Linear(1, 1) if kind != "bow1" else None
        shape = [*input_dims, width]
        self.register_buffer("feature_weights", torch.arange(math.prod(shape)).reshape(shape))

    def forward(self, ids):
        e = self.emb(ids)
        if self.kind == "weighted_bow1":
            e = e * self.feature_weights
        out = reshape_and_sum(e)
        return self.dense(out) if self.dense is not None else out


EMBEDDING_INPUTS = [
    [[0, 1]],
    [[0, 1], [1, 1], [0, 0]],
    [[[0, 1]]],
    [[[0, 1]], [[1, 1]], [[0, 0]]],
]


@pytest.mark.parametrize("kind", ["bow1", "bow2", "weighted_bow1"])
def test_bow_embedding_norms(kind):
    """embedding_test.py and nlp_on_device_embedding_test.py: each dense batch of ids (2-d and
    3-d, batches of 1 and 3), ``nn.Embedding`` and ``OnDeviceEmbedding`` (gathered and by
    one-hot matmul; ``scale_factor`` None, 0.5 and 1, not every pairing), the embedding's norms alone
    (``partial``)."""
    for data in EMBEDDING_INPUTS:
        ids = torch.tensor(data)
        for make in (
            lambda: nn.Embedding(10, 2),
            *[
                lambda s=s, h=h: OnDeviceEmbedding(10, 2, s, h)
                for s, h in ((None, False), (None, True), (0.5, False), (1.0, True))
            ],
        ):
            torch.manual_seed(0)
            emb = make()
            model = Bow(kind, emb, list(ids.shape[1:]), 2).double()
            first = [n for n, _ in model.named_parameters() if n.startswith("emb.")]
            check_norms(model, ids, partial=first, what=f"{kind} {type(emb).__name__} {data}")


RAGGED = [[0], [1], [], [0, 0], [0, 1], [1, 0], [1, 1], [0, 1]]


class RaggedBow(nn.Module):
    """``make_dense_bow_model`` on a ragged batch, as torch holds one: the ids of every
    example in one flat tensor, cut by ``offsets`` (``nn.EmbeddingBag(mode="sum")``; an empty
    example's bag is zeros), then a Dense(1)."""

    def __init__(self):
        super().__init__()
        self.emb, self.dense = nn.EmbeddingBag(10, 2, mode="sum"), nn.Linear(1, 1)

    def forward(self, flat, offsets):
        return self.dense(reshape_and_sum(self.emb(flat, offsets)))


class PaddedBow(nn.Module):
    """The same batch padded to its longest example and masked: the padded positions'
    embeddings multiplied by 0."""

    def __init__(self):
        super().__init__()
        self.emb, self.dense = nn.Embedding(10, 2), nn.Linear(1, 1)

    def forward(self, ids, mask):
        return self.dense(reshape_and_sum(self.emb(ids) * mask[..., None]))


def test_ragged_bow_as_padded_ids():
    """embedding_test.py's ragged batches (the 7 and 8 examples, one of them empty), padded
    and masked: norms, ``grad1`` and micro-batches of 2 against the loop (an empty example's
    embedding gradient is zero)."""
    for rows in (RAGGED[:7], RAGGED):
        torch.manual_seed(0)
        model = PaddedBow().double()
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows], dtype=D)
        want = check_norms(
            model, (ids, mask), microbatches=2 if len(rows) % 2 == 0 else None, what="padded"
        )
        assert want["emb.weight"][2].abs().max() == 0


def test_ragged_bow_as_embedding_bag():
    """The same ragged batch as torch's ``EmbeddingBag`` takes it, the bags cut by
    ``offsets``: each bag is one example."""
    torch.manual_seed(0)
    model = RaggedBow().double()
    flat = torch.tensor([i for r in RAGGED for i in r])
    offsets = torch.tensor([0, *torch.tensor([len(r) for r in RAGGED]).cumsum(0)[:-1].tolist()])
    bags = [torch.tensor(r, dtype=torch.long) for r in RAGGED]
    w = torch.ones(len(RAGGED), dtype=D)
    want = {}
    for i, bag in enumerate(bags):  # the loop: each bag alone, offsets [0]
        model.zero_grad()
        mse_loss(model(bag, torch.tensor([0])), w[i : i + 1]).sum().backward()
        for n, p in model.named_parameters():
            want.setdefault(n, []).append(p.grad.clone())
    want = {n: torch.stack(g) for n, g in want.items()}
    model.zero_grad()
    with gradhooks.add_hooks(model, quantities=("norms",), loss_reduction="sum") as h:
        mse_loss(model(flat, offsets), w).sum().backward()
        assert_close(h.norms(), flat_grads(want).norm(dim=1), "bag norms")
    model.zero_grad()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        mse_loss(model(flat, offsets), w).sum().backward()
    assert_grad1(model, want, "bags")


# == registry_functions/multi_head_attention_test.py ============================================


class KerasMultiHeadAttention(nn.Module):
    """Keras' ``MultiHeadAttention(num_heads, key_dim, value_dim, dropout, use_bias,
    output_shape)``: projections of the query, key and value to ``[batch, length, heads,
    dim]``, the query scaled by ``1/√key_dim``, scores ``einsum("aecd,abcd->acbe")``, a
    softmax where the attention mask's ``False`` entries get ``-1e9`` added, dropout on the
    probabilities, ``einsum("acbe,aecd->abcd")`` with the values, and an output projection
    from ``[heads, value_dim]`` to ``output_shape`` (the query's width by default). With
    ``dense="einsum"`` each projection is an ``EinsumDense`` sublayer as Keras builds it
    (``"abc,cde->abde"`` with bias axes ``"de"``, ``"abcd,cde->abe"`` with ``"e"``); with
    ``"linear"``, an ``nn.Linear`` whose output is viewed as ``[heads, dim]``, as torch code
    writes it."""

    def __init__(self, q_dims, v_dims, heads, key_dim, value_dim, dropout, use_bias, out, dense):
        super().__init__()
        (tq, q_dim), (tv, v_dim) = q_dims, v_dims
        self.heads, self.key_dim, self.dense = heads, key_dim, dense
        bias = "de" if use_bias else None
        if dense == "einsum":
            self.query_dense = EinsumDense("abc,cde->abde", q_dims, [tq, heads, key_dim], bias)
            self.key_dense = EinsumDense("abc,cde->abde", v_dims, [tv, heads, key_dim], bias)
            self.value_dense = EinsumDense("abc,cde->abde", v_dims, [tv, heads, value_dim], bias)
            self.output_dense = EinsumDense(
                "abcd,cde->abe", [tq, heads, value_dim], [tq, out], "e" if use_bias else None
            )
        else:
            self.query_dense = nn.Linear(q_dim, heads * key_dim, bias=use_bias)
            self.key_dense = nn.Linear(v_dim, heads * key_dim, bias=use_bias)
            self.value_dense = nn.Linear(v_dim, heads * value_dim, bias=use_bias)
            self.output_dense = nn.Linear(heads * value_dim, out, bias=use_bias)
        self.dropout = nn.Dropout(dropout)

    def project(self, layer, x):
        y = layer(x)
        return y if self.dense == "einsum" else y.unflatten(-1, (self.heads, -1))

    def forward(self, query, value, key=None, attention_mask=None):
        key = value if key is None else key
        q = self.project(self.query_dense, query) * (1.0 / math.sqrt(self.key_dim))
        k, v = self.project(self.key_dense, key), self.project(self.value_dense, value)
        scores = torch.einsum("aecd,abcd->acbe", k, q)
        if attention_mask is not None:
            scores = scores + (1.0 - attention_mask[:, None].to(scores)) * -1e9
        probs = self.dropout(torch.softmax(scores, -1))
        o = torch.einsum("acbe,aecd->abcd", probs, v)
        return self.output_dense(o if self.dense == "einsum" else o.flatten(-2))


class AttentionModel(nn.Module):
    """``make_one_layer_attention_model`` (``seq1_mha``) / ``make_two_layer_attention_model``
    (``seq2_mha``: a Dense(1) after the attention); the model takes the query, value, key
    and mask, and passes the key and mask as the setting says."""

    def __init__(self, mha, out: int | None, use_key: bool, use_mask: bool):
        super().__init__()
        self.mha, self.use_key, self.use_mask = mha, use_key, use_mask
        self.dense = nn.Linear(out, 1) if out else None

    def forward(self, query, value, key, mask):
        y = self.mha(query, value, key if self.use_key else None, mask if self.use_mask else None)
        return reshape_and_sum(self.dense(y) if self.dense is not None else y)


# (query_input_dims, value_input_dims, use_key, use_attention_mask, num_heads, key_dim,
#  value_dim, dropout, use_bias, output_shape): get_attention_parameter_tuples()
ATTENTION_CASES = {
    "defaults": ([2, 3], [3, 4], False, False, 2, 2, 3, 0.0, True, None),
    "use_key": ([2, 3], [3, 4], True, False, 2, 2, 3, 0.0, True, None),
    "no_bias": ([2, 3], [3, 4], False, False, 2, 2, 3, 0.0, False, None),
    "dropout": ([2, 3], [3, 4], False, False, 2, 2, 3, 0.1, True, None),
    "output_shape": ([2, 3], [3, 4], False, False, 2, 2, 3, 0.0, True, [3]),
    "single_head": ([2, 3], [3, 4], False, False, 1, 2, 3, 0.0, True, 3),
    "attention_mask": ([2, 3], [3, 4], False, True, 2, 2, 3, 0.0, True, None),
}


def attention_inputs(q_dims, v_dims, seed: int = 0):
    """``get_multi_head_attention_example_inputs``: a batch of 2; the query, value and key
    ``range``s scaled by 1, 2 and 3 over their example's size; a random boolean mask
    ``[batch, query length, value length]``."""
    qn, vn = math.prod(q_dims), math.prod(v_dims)
    query = range_batch(2, q_dims) / qn
    value = 2.0 * range_batch(2, v_dims) / vn
    key = 3.0 * range_batch(2, v_dims) / vn
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(2, q_dims[0], v_dims[0], generator=g) <= 0.5
    return query, value, key, mask


@pytest.mark.parametrize("setting", list(ATTENTION_CASES))
def test_multi_head_attention_norms(setting):
    """multi_head_attention_test.py ``test_gradient_norms_on_various_models``: each setting in
    ``seq1_mha`` (its projections ``EinsumDense`` layers) and ``seq2_mha`` (``nn.Linear``
    ones), micro-batches of 2 (of the batch of 2). With attention dropout, the loop is
    autograd's per-example backward through the same batched forward (one draw of the
    dropout masks, as TensorFlow Privacy's reference reseeds to get)."""
    q_dims, v_dims, use_key, use_mask, heads, kd, vd, dropout, bias, out_shape = ATTENTION_CASES[
        setting
    ]
    out = q_dims[1] if out_shape is None else 3
    inputs = attention_inputs(q_dims, v_dims)
    for seq, dense in (("seq1_mha", "einsum"), ("seq2_mha", "linear")):
        torch.manual_seed(0)
        mha = KerasMultiHeadAttention(q_dims, v_dims, heads, kd, vd, dropout, bias, out, dense)
        model = AttentionModel(mha, out if seq == "seq2_mha" else None, use_key, use_mask).double()
        if not dropout:
            check_norms(model, inputs, microbatches=2, what=f"{setting} {seq}")
            continue
        w = torch.ones(2, dtype=D)
        params = dict(model.named_parameters())
        torch.manual_seed(1)
        losses = mse_loss(model(*inputs), w)
        rows = [
            torch.autograd.grad(loss, list(params.values()), retain_graph=True) for loss in losses
        ]
        want = {n: torch.stack([r[i] for r in rows]) for i, n in enumerate(params)}
        model.zero_grad()
        torch.manual_seed(1)
        with gradhooks.add_hooks(model, quantities=("norms",), loss_reduction="sum") as h:
            mse_loss(model(*inputs), w).sum().backward()
            assert_close(h.norms(), flat_grads(want).norm(dim=1), f"{setting} {seq}: norms")
        model.zero_grad()
        torch.manual_seed(1)
        with gradhooks.add_hooks(model, loss_reduction="sum"):
            mse_loss(model(*inputs), w).sum().backward()
        assert_grad1(model, want, f"{setting} {seq}")
        gradhooks.clear_grad1(model)


class OwnKernelsAttention(nn.Module):
    """Keras' attention with its projection kernels held by the layer itself (one module with
    parameters, ``einsum`` on each, dropout on the probabilities in its own forward), as a
    port might write it."""

    def __init__(self, q_dim=3, v_dim=4, heads=2, key_dim=2, value_dim=3):
        super().__init__()
        self.q = nn.Parameter(torch.randn(q_dim, heads, key_dim))
        self.k = nn.Parameter(torch.randn(v_dim, heads, key_dim))
        self.v = nn.Parameter(torch.randn(v_dim, heads, value_dim))
        self.o = nn.Parameter(torch.randn(heads, value_dim, q_dim))
        self.dropout = nn.Dropout(0.1)

    def forward(self, query, value):
        q = torch.einsum("abc,cde->abde", query, self.q)
        k = torch.einsum("abc,cde->abde", value, self.k)
        v = torch.einsum("abc,cde->abde", value, self.v)
        probs = self.dropout(torch.softmax(torch.einsum("aecd,abcd->acbe", k, q), -1))
        return torch.einsum("abcd,cde->abe", torch.einsum("acbe,aecd->abcd", probs, v), self.o)


def test_attention_with_its_own_kernels_and_dropout_is_refused():
    """The ``dropout`` setting with the kernels the attention layer's own: gradhooks has no
    rule for the layer, and its fallback, which runs the layer again per example, cannot
    draw the batch's dropout masks again: refused, naming the layer and the remedies (the
    projections as sublayers, above, match the loop with dropout)."""
    torch.manual_seed(0)
    model = OwnKernelsAttention().double()
    query, value, _, _ = attention_inputs([2, 3], [3, 4])
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with pytest.raises(gradhooks.UnsupportedError) as info:
            reshape_and_sum(model(query, value)).square().sum().backward()
    said = str(info.value)
    assert "OwnKernelsAttention" in said and "draws random numbers" in said
    assert "register a rule" in said


# == clip_grads_test.py =========================================================================


@pytest.mark.parametrize("input_dim", [1, 2])
def test_clip_weights(input_dim):
    """``DirectWeightsTest.test_clip_weights``: for norms from ``get_nd_test_batches`` (zeros
    among them) and bounds from 1e-6 to 1e6, ``norm · factor ≤ C`` and every factor finite
    in ``(0, 1]``."""
    for x, _ in nd_test_batches(input_dim):
        for c in (1e-6, 0.5, 1.0, 2.0, 10.0, 1e6):
            factors = gradhooks.clip_factors(x, c)
            assert bool((x * factors <= c + 1e-6).all()), (x, c)
            assert bool(((factors > 0) & (factors <= 1)).all()), factors


class TwoLayer(nn.Module):
    """``ComputeClippedGradsAndOutputsTest``'s model: ``make_two_layer_functional_model`` of a
    Dense(3) on inputs of 2."""

    def __init__(self):
        super().__init__()
        self.layer1, self.dense = nn.Linear(2, 3), nn.Linear(3, 1)

    def forward(self, x):
        return reshape_and_sum(self.dense(self.layer1(x)))


@pytest.mark.parametrize("reduction", ["sum", "sum_over_batch_size"])
def test_clipped_gradients_on_different_losses(reduction):
    """``test_clipped_gradients_on_different_losses``: batches of 1, 2 and 10 (``range``
    inputs, targets ``1 + range``), bounds 0.1, 1 and 10: the DP step without noise (every
    method) is the loop's clipped sum (divided by the batch for the mean), its norm is at
    most ``C·batch`` (sum) or ``C`` (mean), and it is the plain gradient where no example's
    norm exceeds ``C`` (the peer asserts it where the plain gradient's norm is below the
    bound: true of its initialization, not of every one)."""
    mean = reduction == "sum_over_batch_size"
    for batch in (1, 2, 10):
        x = torch.arange(batch * 2, dtype=D).reshape(batch, 2)
        y = 1.0 + torch.arange(batch, dtype=D)[:, None]
        for clip in (0.1, 1.0, 10.0):
            torch.manual_seed(0)
            model = TwoLayer().double()
            per = loop_grad(model, lambda o, t: F.mse_loss(o, t, reduction="sum"), x, y)
            factors = gradhooks.clip_factors(flat_grads(per).norm(dim=1), clip)
            want = {
                n: torch.einsum("b,b...->...", factors, g) / (batch if mean else 1)
                for n, g in per.items()
            }
            true = flat_grads(
                {n: g.sum(0, keepdim=True) / (batch if mean else 1) for n, g in per.items()}
            ).norm()
            for quantities, method in (
                (("grad1",), "grad1"),
                (("norms",), "bookkeeping"),
                (("norms",), "ghost"),
            ):
                with gradhooks.add_hooks(model, quantities=quantities) as h:
                    losses = (model(x) - y).square().mean(-1)
                    gradhooks.dp_sgd_step(
                        h,
                        losses,
                        max_norm=clip,
                        noise_multiplier=0.0,
                        method=method,
                        reduction="mean" if mean else "sum",
                    )
                for n, p in model.named_parameters():
                    assert_close(p.grad, want[n], f"batch {batch} C={clip} {method}: {n}")
                gradhooks.clear_grad1(model)
                got = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
                bound = clip if mean else clip * batch
                assert got <= bound + 1e-12  # (the triangle inequality)
                if bool((factors == 1).all()):  # nothing clipped: the gradient itself
                    assert_close(got, true, "no example clipped")
                model.zero_grad()


class Shared(nn.Module):
    """``SharedLayerTest``: one Dense(1) without bias on ``k`` inputs (summed), on one input
    ``k`` times, or on the two slices ``x[:, :, 0]`` and ``x[:, :, 1]``."""

    def __init__(self, input_dim: int, how: str, k: int = 1):
        super().__init__()
        self.base, self.how, self.k = nn.Linear(input_dim, 1, bias=False), how, k

    def forward(self, *xs):
        if self.how == "inputs":
            return sum(self.base(x) for x in xs)
        if self.how == "repeated":
            return sum(self.base(xs[0]) for _ in range(self.k))
        return self.base(xs[0][:, :, 0]) + self.base(xs[0][:, :, 1])


@pytest.mark.parametrize("how", ["inputs", "repeated", "slices"])
def test_shared_layer_norms_are_exact(how):
    """``test_gradient_norms_on_multiple_inputs_are_upper_bounded``,
    ``..._on_single_repeated_input_...``, ``..._on_input_slices_...``: TensorFlow Privacy's
    norms of a layer used several times are upper bounds (``true - computed ≤ 1e-3``);
    gradhooks' are the norms (the cross terms between uses included), for 1, 2 and 10 uses,
    batches of 1 and 2, inputs of 1 and 3 features."""
    for batch in (1, 2):
        for input_dim in (1, 3):
            for k in (1, 2, 10) if how != "slices" else (2,):
                torch.manual_seed(0)
                model = Shared(input_dim, how, k).double()
                if how == "inputs":
                    xs = tuple(
                        float(j + 1) * torch.ones(batch, input_dim, dtype=D) for j in range(k)
                    )
                elif how == "repeated":
                    xs = (torch.ones(batch, input_dim, dtype=D),)
                else:
                    xs = (
                        torch.arange(batch * input_dim * 2, dtype=D).reshape(batch, input_dim, 2),
                    )
                y = 1.0 + torch.arange(batch, dtype=D)[:, None]
                check_norms(
                    model,
                    xs,
                    loss=lambda o, t: (o - t).square().mean(-1),
                    target=y,
                    what=f"{how} batch {batch} dim {input_dim} x{k}",
                )


# == noise_utils_test.py, gradient_clipping_utils_test.py =======================================


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_noise_std(reduction):
    """``test_noise_is_computed_correctly``: the noise added to the clipped sum has standard
    deviation ``C·σ`` (a summed loss) or ``C·σ/batch`` (a mean), within 10%, for ``(C, σ)``
    of ``(3, 2)`` and ``(5, 4)``, batches of 1, 2 and 10 (on 10,000 entries, where the peer's 100
    would leave the estimate's own spread near its tolerance)."""
    for clip, sigma in ((3.0, 2.0), (5.0, 4.0)):
        for batch in (1, 2, 10):
            torch.manual_seed(0)
            model = nn.Linear(100, 100, bias=False).double()
            x = torch.randn(batch, 100, dtype=D)
            with gradhooks.add_hooks(model, quantities=("norms",)) as h:
                losses = model(x).square().sum(1)
                gradhooks.dp_sgd_step(
                    h, losses, max_norm=clip, noise_multiplier=0.0, reduction=reduction
                )
            clipped = model.weight.grad.clone()
            with gradhooks.add_hooks(model, quantities=("norms",)) as h:
                losses = model(x).square().sum(1)
                gradhooks.dp_sgd_step(
                    h,
                    losses,
                    max_norm=clip,
                    noise_multiplier=sigma,
                    reduction=reduction,
                    generator=torch.Generator().manual_seed(7),
                )
            std = (model.weight.grad - clipped).std().item()
            want = clip * sigma / (batch if reduction == "mean" else 1)
            assert abs(std - want) <= 0.1 * want, (clip, sigma, batch, std, want)


class Packed(nn.Module):
    """``test_outputs_are_consistent``: inputs packed as the setting says (one tensor, a tuple,
    a list or a dict of two), each through a Linear of its own, stacked, and outputs packed
    the same way (``(i + 1)·`` the stack for output ``i``)."""

    def __init__(self, packing, outputs: int):
        super().__init__()
        self.packing, self.outputs = packing, outputs
        self.lin = nn.ModuleList(nn.Linear(3, 3) for _ in range(1 if packing is None else 2))

    def forward(self, x):
        xs = [x] if self.packing is None else list(x.values()) if self.packing is dict else list(x)
        stack = torch.stack([lin(t) for lin, t in zip(self.lin, xs)], 1)
        outs = [stack * float(i + 1) for i in range(self.outputs)]
        if self.outputs == 1:
            return outs[0]
        return (
            {str(i): o for i, o in enumerate(outs)} if self.packing is dict else self.packing(outs)
        )


@pytest.mark.parametrize(
    "packing", [None, tuple, list, dict], ids=["plain", "tuple", "list", "dict"]
)
def test_packed_inputs_and_outputs(packing):
    """gradient_clipping_utils_test.py ``ModelForwardPassTest``: the hooked model's outputs are
    the model's, and ``grad1`` the loop's, for inputs and outputs packed the same way (a
    batch of 3)."""
    torch.manual_seed(0)
    model = Packed(packing, 1 if packing is None else 2).double()
    xs = [float(i + 1) * torch.randn(3, 3, dtype=D) for i in range(1 if packing is None else 2)]
    x = (
        xs[0]
        if packing is None
        else {str(i): t for i, t in enumerate(xs)}
        if packing is dict
        else packing(xs)
    )

    def loss(out):
        leaves = (
            out.values()
            if isinstance(out, dict)
            else out
            if isinstance(out, (tuple, list))
            else [out]
        )
        return sum(t.square().sum() for t in leaves)

    with torch.no_grad():
        plain = model(x)
    want = loop_grad(model, loss, (x,))
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        out = model(x)
        loss(out).backward()
    assert type(out) is type(plain)
    for a, b in zip(
        *(
            o.values() if isinstance(o, dict) else o if isinstance(o, (tuple, list)) else [o]
            for o in (out, plain)
        )
    ):
        assert torch.equal(a.detach(), b)
    assert_grad1(model, want, f"packed {packing}")


# == keras_models/dp_keras_model_test.py ========================================================


def dense_zeros(inputs: int, bias: bool = True) -> nn.Linear:
    """``Dense(1, kernel_initializer='zeros', bias_initializer='zeros')``."""
    layer = nn.Linear(inputs, 1, bias=bias).double()
    nn.init.zeros_(layer.weight)
    if bias:
        nn.init.zeros_(layer.bias)
    return layer


METHODS = ((("grad1",), "grad1"), (("norms",), "bookkeeping"), (("norms",), "ghost"))


@pytest.mark.parametrize("clip", [1e9, 10.0, 40.0, 200.0])
def test_dp_sequential_clipping_norm(clip):
    """``testBaseline`` (a bound of 1e9) and ``testClippingNorm``: one example ``[3, 4]``
    labelled ``3·3 + 1·4 + 2``, a zero Dense layer, Keras' mean squared error, one DP step
    without noise and SGD at 0.01: the weights are the gradient clipped to ``C`` (scaled by
    ``min(1, C/‖g‖)``, ``‖g‖ = √(90² + 120² + 30²)``), times the learning rate, by every
    method; the gradient itself from autograd."""
    x = torch.tensor([[3.0, 4.0]], dtype=D)
    y = x @ torch.tensor([[3.0], [1.0]], dtype=D) + 2
    for quantities, method in METHODS:
        model = dense_zeros(2)
        plain = dense_zeros(2)
        F.mse_loss(plain(x), y).backward()
        g = torch.cat([plain.weight.grad.flatten(), plain.bias.grad])
        scale = min(1.0, clip / g.norm().item())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with gradhooks.add_hooks(model, quantities=quantities) as h:
            losses = (model(x) - y).square().mean(-1)
            gradhooks.dp_sgd_step(h, losses, max_norm=clip, noise_multiplier=0.0, method=method)
        opt.step()
        assert_close(model.weight, -0.01 * scale * plain.weight.grad, f"{method} weight")
        assert_close(model.bias, -0.01 * scale * plain.bias.grad, f"{method} bias")


def microbatched(x: Tensor, y: Tensor, microbatches: int | None):
    """TensorFlow Privacy's ``num_microbatches`` as a torch batch: the batch viewed as
    ``[microbatches, batch / microbatches, ...]``, so that gradhooks' examples are the
    micro-batches (its ``None``: one example each)."""
    m = microbatches or x.shape[0]
    return x.reshape(m, -1, *x.shape[1:]), y.reshape(m, -1, *y.shape[1:])


@pytest.mark.parametrize("microbatches", [None, 1, 2, 4])
def test_dp_sequential_microbatches(microbatches):
    """``testMicrobatches``: four examples, a zero Dense layer without bias, ``C = 1``, no
    noise, SGD at 1: the weights are minus the mean over micro-batches of each micro-batch's
    mean gradient clipped to ``C`` (the peer's ``_compute_expected_gradients``, written out
    below), by every method, the micro-batches as gradhooks' examples."""
    x = torch.tensor([[2.0, 3.0], [4.0, 5.0], [6.0, 7.0], [8.0, 9.0]], dtype=D)
    y = torch.tensor([[1.0], [3.0], [-2.0], [-4.0]], dtype=D)
    m = microbatches or 4
    grads = 2 * x * (0.0 - y)  # (predictions of the zero weights: 0)
    mb = grads.reshape(m, 4 // m, -1).mean(1)
    want = (mb * (1.0 / mb.norm(dim=1)).clamp(max=1.0)[:, None]).mean(0)
    xs, ys = microbatched(x, y, microbatches)
    for quantities, method in METHODS:
        model = dense_zeros(2, bias=False)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        with gradhooks.add_hooks(model, quantities=quantities) as h:
            losses = (model(xs) - ys).square().mean((1, 2))
            gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=0.0, method=method)
        opt.step()
        assert_close(model.weight.flatten(), -want, f"{microbatches} micro-batches, {method}")


@pytest.mark.parametrize("microbatches", [None, 1, 2, 4])
def test_dp_sequential_noise_multiplier(microbatches):
    """``testNoiseMultiplier``: four zero examples of 1000 features labelled 0 (a zero
    gradient), a zero Dense layer, one step at learning rate 1: the weights' standard
    deviation is ``C·σ / micro-batches`` within 10%, for ``(C, σ)`` of ``(3, 2)`` and
    ``(5, 4)``."""
    x, y = torch.zeros(4, 1000, dtype=D), torch.zeros(4, 1, dtype=D)
    xs, ys = microbatched(x, y, microbatches)
    m = xs.shape[0]
    for clip, sigma in ((3.0, 2.0), (5.0, 4.0)):
        model = dense_zeros(1000)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        with gradhooks.add_hooks(model, quantities=("norms",)) as h:
            losses = (model(xs) - ys).square().mean((1, 2))
            gradhooks.dp_sgd_step(
                h, losses, max_norm=clip, noise_multiplier=sigma,
                generator=torch.Generator().manual_seed(3),
            )  # fmt: skip
        opt.step()
        std, want = model.weight.std(unbiased=False).item(), clip * sigma / m
        assert abs(std - want) <= 0.1 * want, (clip, sigma, m, std)


def test_regularization_gradient():
    """``testRegularizationGradient``: a Dense layer of ones with an L2 regularizer
    (``0.025 · Σ w²``) and its output multiplied by 0. TensorFlow Privacy adds the
    regularizer's gradient to the clipped sum, unclipped; in gradhooks the penalty added to
    each example's loss is refused (it is not each example's: clipping it would not bound an
    example's influence), naming the parameter and the remedy, and the remedy, its gradient
    added to ``.grad`` after the step, gives the peer's weights ``1 - 2·0.025``."""
    x = torch.arange(20, dtype=D).reshape(2, 10)
    model = nn.Linear(10, 1, bias=False).double()
    nn.init.ones_(model.weight)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        losses = (model(x) * 0.0).square().mean(-1) + 0.025 * model.weight.square().sum()
        with pytest.raises(gradhooks.CheckFailedError) as info:
            gradhooks.dp_sgd_step(h, losses, max_norm=1e9, noise_multiplier=0.0)
    said = str(info.value)
    assert "'weight'" in said and "add its gradient to .grad after the step" in said
    assert model.weight.grad is None  # nothing written
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        losses = (model(x) * 0.0).square().mean(-1)
        gradhooks.dp_sgd_step(h, losses, max_norm=1e9, noise_multiplier=0.0)
    model.weight.grad += 2 * 0.025 * model.weight.detach()
    opt.step()
    assert_close(model.weight, torch.full((1, 10), 1.0 - 2.0 * 0.025, dtype=D), "decayed")


# == optimizers/clip_and_aggregate_gradients_test.py =============================================


class GatherModel(nn.Module):
    """``_get_loss_and_vars``: six examples; example ``i`` reads embedding ``ind0[i]`` of a
    table of 4 (the sixth none: a zero row, ``concat``-ed in the peer, masked here), and
    its own row of ``var1`` (``[6, 1]``, looked up by the example's index); a variable the
    loss never reaches (``dummy_var``). Each example's loss is ``½‖data0ᵢ - val0ᵢ‖² +
    ½‖data1ᵢ - var1ᵢ‖²``."""

    def __init__(self, sparse: bool = False):
        super().__init__()
        self.emb0 = nn.Embedding(4, 2, sparse=sparse)
        self.var1 = nn.Embedding(6, 1)
        self.dummy = nn.Parameter(torch.ones(1, 1))
        with torch.no_grad():
            self.emb0.weight.copy_(torch.arange(4.0)[:, None].expand(4, 2))
            self.var1.weight.copy_(torch.tensor([[1.0], [1.0], [2.0], [2.0], [3.0], [3.0]]))

    def forward(self, ind, mask, who):
        return self.emb0(ind) * mask[..., None], self.var1(who)


IND0 = torch.tensor([1, 1, 2, 3, 2, 0])
MASK0 = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0], dtype=D)
DATA0 = torch.tensor(
    [[3.0, 4.0], [5.0, 6.0], [7.0, 8.0], [-1.0, 0.0], [-2.0, -1.0], [-3.0, -2.0]], dtype=D
)
DATA1 = torch.tensor([[-1.0], [-2.0], [-2.0], [-3.0], [-3.0], [-4.0]], dtype=D)


def gather_losses(out, data0, data1):
    """Each unit's loss: the sum over its examples (``reduce_sum`` of the ``[n, -1]``
    reshape) of the half squared distances, over the unit's axes after the first."""
    val0, val1 = out
    per = 0.5 * (data0 - val0).square().sum(-1) + 0.5 * (data1 - val1).square().sum(-1)
    return per.flatten(1).sum(1) if per.dim() > 1 else per


@pytest.mark.parametrize(
    "n,clip,agg",
    [(6, None, "mean"), (2, None, "sum"), (3, 1.0, "sum"), (2, 100.0, "mean"), (1, 0.5, "mean")],
)
def test_clip_and_aggregate_gradients(n, clip, agg):
    """``testCorrectTensor``, ``testSparse``: the six examples' losses summed in ``n`` units
    (gradhooks' examples: the batch viewed as ``[n, 6 / n]``), clipped to ``C`` (none without
    one) and aggregated by ``mean`` or ``sum``, against the per-unit loop, by every method;
    the embedding dense and ``sparse=True`` (its ``.grad`` sparse, as the peer's
    ``IndexedSlices``), the unreached variable's gradient zero (the peer's
    ``unconnected_gradients='zero'``). The peer's ``normalize=True`` (every unit scaled to
    ``C``, not offered by gradhooks) is left out; its settings run with flat clipping."""
    view = (n, -1)
    ins = (IND0.reshape(view), MASK0.reshape(view), torch.arange(6).reshape(view))
    data = (DATA0.reshape(n, -1, 2), DATA1.reshape(n, -1, 1))
    bound = 1e9 if clip is None else clip
    for sparse in (False, True):
        torch.manual_seed(0)
        model = GatherModel(sparse).double()
        per = loop_grad(model, lambda o, i: gather_losses(o, *(d[i] for d in data)).sum(), ins,
                        torch.arange(n))  # fmt: skip
        factors = gradhooks.clip_factors(flat_grads(per).norm(dim=1), bound)
        for quantities, method in METHODS:
            model.zero_grad()
            with gradhooks.add_hooks(model, quantities=quantities) as h:
                losses = gather_losses(model(*ins), *data)
                gradhooks.dp_sgd_step(
                    h, losses, max_norm=bound, noise_multiplier=0.0, method=method,
                    reduction="sum" if agg == "sum" else "mean",
                )  # fmt: skip
            for name, p in model.named_parameters():
                want = torch.einsum("b,b...->...", factors, per[name]) / (1 if agg == "sum" else n)
                assert p.grad.is_sparse == (sparse and name == "emb0.weight"), name
                assert_close(p.grad.to_dense(), want, f"n={n} {method} sparse={sparse}: {name}")
            gradhooks.clear_grad1(model)


# == optimizers/dp_optimizer_keras_test.py =======================================================


class Residuals(nn.Module):
    """``DPOptimizerComputeGradientsTest``'s loss ``½‖data0 - var0‖² + ½‖data1 - var1‖²``
    per example, as a module holding ``var0`` and ``var1`` (each example's data its input):
    the unit's loss is the mean over its examples (a micro-batch's, as the peer's)."""

    def __init__(self):
        super().__init__()
        self.var0 = nn.Parameter(torch.tensor([1.0, 2.0]))
        self.var1 = nn.Parameter(torch.tensor([3.0]))

    def forward(self, data0, data1):
        return 0.5 * ((data0 - self.var0).square().sum(-1) + (data1 - self.var1).square().sum(-1))


@pytest.mark.parametrize("microbatches", [1, 2, 4])
def test_dp_optimizer_clipping_norm_multiple_variables(microbatches):
    """``testClippingNormMultipleVariables``: four examples, ``C = 2.5``, no noise: each
    micro-batch's mean gradient of both variables together clipped, then averaged (the peer's
    expected gradients, written out below), by every method and through ``DPOptimizer``'s
    ``backward`` (the micro-batches as gradhooks' examples)."""
    data0 = torch.tensor([[3.0, 6.0], [5.0, 6.0], [4.0, 8.0], [-1.0, 0.0]], dtype=D)
    data1 = torch.tensor([[8.0], [2.0], [3.0], [1.0]], dtype=D)
    var = torch.tensor([1.0, 2.0, 3.0], dtype=D)
    grads = torch.cat([data0, data1], 1) - var
    mb = grads.reshape(microbatches, 4 // microbatches, -1).mean(1)
    want = -(mb * (2.5 / mb.norm(dim=1).clamp(min=2.5))[:, None]).mean(0)
    units = (data0.reshape(microbatches, -1, 2), data1.reshape(microbatches, -1, 1))
    for quantities, method in METHODS:
        model = Residuals().double()
        with gradhooks.add_hooks(model, quantities=quantities) as h:
            opt = gradhooks.DPOptimizer(
                torch.optim.SGD(model.parameters(), lr=2.0), h, max_grad_norm=2.5,
                noise_multiplier=0.0, expected_batch_size=microbatches, method=method,
            )  # fmt: skip
            opt.backward(model(*units).mean(1))
            opt.step()
        got = torch.cat([model.var0.grad, model.var1.grad])
        assert_close(got, want, f"{microbatches} micro-batches, {method}")


@pytest.mark.parametrize("optimizer", ["SGD", "Adam", "Adagrad"])
def test_large_batch_emulation(optimizer):
    """``testLargeBatchEmulationNoNoise``, ``testLargeBatchEmulation``: a Dense layer
    ``var0 · x + var1`` (weights ``[1, 2]``, bias 3) whose output is the loss, physical
    batches of two examples, a bound no example reaches and no noise: nothing moves until a
    logical batch of 1, 2 or 4 physical batches ends, and then the step is the plain
    optimizer's on the mean loss of the logical batch (for SGD at rate 1, the peer's
    ``[-1, 1], 2`` then ``[-4, -0.5], 1`` for two physical batches)."""
    x1 = torch.tensor([[2.0, 0.0], [0.0, 1.0]], dtype=D)
    x2 = torch.tensor([[4.0, 2.0], [2.0, 1.0]], dtype=D)

    def dense():
        layer = nn.Linear(2, 1).double()
        with torch.no_grad():
            layer.weight.copy_(torch.tensor([[1.0, 2.0]]))
            layer.bias.fill_(3.0)
        return layer

    make = getattr(torch.optim, optimizer)
    for steps in (1, 2, 4):
        model, plain = dense(), dense()
        ref = make(plain.parameters(), lr=1.0)
        with gradhooks.add_hooks(model, quantities=("norms",)) as h:
            opt = gradhooks.DPOptimizer(
                make(model.parameters(), lr=1.0), h, max_grad_norm=100.0, noise_multiplier=0.0,
                expected_batch_size=2 * steps,
            )  # fmt: skip
            batches = [x1, x2, x2, x2, x1, x2, x1, x1][: 2 * steps]
            for logical in (batches[:steps], batches[steps:]):
                ref.zero_grad()
                (sum(plain(x).sum() for x in logical) / (2 * steps)).backward()
                ref.step()
                for i, x in enumerate(logical):
                    before = [p.detach().clone() for p in model.parameters()]
                    opt.backward(model(x).squeeze(1))
                    if i < steps - 1:
                        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
                opt.step()
                opt.zero_grad()
                for (n, p), q in zip(model.named_parameters(), plain.parameters()):
                    assert_close(p.detach(), q.detach(), f"{optimizer}, {steps} steps: {n}")


class SimpleEmbeddingModel(nn.Module):
    """dp_optimizer_keras_test.py's ``SimpleEmbeddingModel``: an embedding (10 ids, 6 wide)
    of 4 tokens, and a pooler (a zero Dense(6) with tanh) of the first token; both outputs
    returned."""

    def __init__(self):
        super().__init__()
        self.embed_layer = nn.Embedding(10, 6)
        self.pool_layer = nn.Linear(6, 6)
        nn.init.zeros_(self.pool_layer.weight)
        nn.init.zeros_(self.pool_layer.bias)

    def forward(self, ids):
        sequence_output = self.embed_layer(ids)
        return sequence_output, torch.tanh(self.pool_layer(sequence_output[:, 0:1].squeeze(1)))


class EmbeddingClassifier(nn.Module):
    """``keras_embedding_model_fn``: a Dense(1) classification of the sequence output (the
    pooler then reaches no loss) or of the pooled one, with the peer's softmax over its one
    unit (1 whatever the input: every gradient is 0) or a sigmoid."""

    def __init__(self, use_sequence_output: bool, activation: str):
        super().__init__()
        self.inner, self.classification = SimpleEmbeddingModel(), nn.Linear(6, 1)
        self.use_sequence_output, self.activation = use_sequence_output, activation

    def forward(self, ids):
        sequence_output, pooled_output = self.inner(ids)
        z = self.classification(sequence_output if self.use_sequence_output else pooled_output)
        return torch.softmax(z, -1) if self.activation == "softmax" else torch.sigmoid(z)


@pytest.mark.parametrize("use_sequence_output", [True, False], ids=["sequence", "pooled"])
def test_unconnected_gradients(use_sequence_output):
    """``DPVectorizedOptimizerUnconnectedNodesTest``: where the pooler reaches no loss (the
    sequence output classified), the peer's vectorized optimizer fails unless told to take
    its gradients as 0; gradhooks' step gives every parameter the loop's clipped mean (the
    unreached pooler's 0, noise alone with ``σ > 0``), by every method, and with the peer's
    softmax over one unit (every gradient 0, every norm 0) no NaN."""
    torch.manual_seed(0)
    ids, y = torch.randint(0, 10, (8, 4)), torch.randint(0, 2, (8, 1)).to(D)
    target = y[:, None].expand(8, 4, 1) if use_sequence_output else y

    def losses(out, t):
        return (out - t).square().flatten(1).mean(1)

    for activation in ("softmax", "sigmoid"):
        torch.manual_seed(1)
        model = EmbeddingClassifier(use_sequence_output, activation).double()
        per = loop_grad(model, lambda o, t: losses(o, t).sum(), ids, target)
        factors = gradhooks.clip_factors(flat_grads(per).norm(dim=1), 1.0)
        for quantities, method in METHODS:
            with gradhooks.add_hooks(model, quantities=quantities) as h:
                norms = gradhooks.dp_sgd_step(
                    h, losses(model(ids), target), max_norm=1.0, noise_multiplier=0.0,
                    method=method,
                )  # fmt: skip
            assert_close(norms, flat_grads(per).norm(dim=1), f"{activation} {method}: norms")
            for n, p in model.named_parameters():
                want = torch.einsum("b,b...->...", factors, per[n]) / 8
                assert_close(p.grad, want, f"{activation} {method}: {n}")
            gradhooks.clear_grad1(model)
        if use_sequence_output:
            with gradhooks.add_hooks(model, quantities=("norms",)) as h:
                gradhooks.dp_sgd_step(
                    h, losses(model(ids), target), max_norm=1.0, noise_multiplier=0.5,
                    generator=torch.Generator().manual_seed(0),
                )  # fmt: skip
            assert model.inner.pool_layer.weight.grad.abs().min() > 0  # the noise reaches it


# == jax-privacy: jax_privacy/experimental/gradient_clipping_test.py =============================


class MeanQuadratic(nn.Module):
    """gradient_clipping_test.py's ``mean_quadratic_loss`` per example, ``½ mean((p - xᵢ)²)``
    over the example's features, its parameter ``p = [2]`` (``noise``: plus a standard
    normal draw per example, as ``test_sum_clipped_grad_prng_key`` adds one from its key)."""

    def __init__(self, dtype=D, noise: bool = False):
        super().__init__()
        self.params = nn.Parameter(torch.tensor([2.0], dtype=dtype))
        self.noise = noise

    def forward(self, x):
        out = 0.5 * (self.params - x).square().flatten(1).mean(1)
        return out + torch.randn_like(out) if self.noise else out


def clipped_sum_by_loop(model: nn.Module, x: Tensor, clip: float, weights=None) -> Tensor:
    """The reference: each example's gradient in float64 by the loop, clipped to ``clip``
    (weighted by ``weights``, a padding example's 0), summed."""
    ref = MeanQuadratic()
    with torch.no_grad():
        ref.params.copy_(model.params.double())
    w = torch.ones(x.shape[0], dtype=D) if weights is None else weights
    per = loop_grad(ref, lambda o, wi: (o * wi).sum(), x.double(), w)["params"]
    return torch.einsum(
        "b,b...->...", gradhooks.clip_factors(per.flatten(1).norm(dim=1), clip), per
    )


@pytest.mark.parametrize("dtype", [D, torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_sum_clipped_grad_basic(dtype):
    """``test_sum_clipped_grad_basic``, ``test_sum_clipped_grad_float16`` and
    ``test_sum_clipped_grad_return_metrics``: ``p = 2``, examples 1, 4 and 7, whose gradients
    1, -2 and -5 clipped to 2.5 sum to -3.5, in float64, float32, bfloat16 and float16 (the
    parameters and inputs in that dtype), by every method; the norms returned are 1, 2, 5 (both
    against the float64 loop)."""
    for quantities, method in METHODS:
        model = MeanQuadratic(dtype)
        x = torch.tensor([[1.0], [4.0], [7.0]], dtype=dtype)
        with gradhooks.add_hooks(model, quantities=quantities) as h:
            norms = gradhooks.dp_sgd_step(
                h, model(x), max_norm=2.5, noise_multiplier=0.0, reduction="sum", method=method
            )
        assert model.params.grad.dtype == dtype
        want = clipped_sum_by_loop(model, x, 2.5)
        assert_close(model.params.grad.double(), want, f"{dtype} {method}")
        ref = MeanQuadratic()
        per = loop_grad(ref, lambda o: o.sum(), x.double())["params"]
        assert_close(norms.double(), per.flatten(1).norm(dim=1), f"{dtype} {method}: norms")


def test_sum_clipped_grad_with_padding_examples():
    """``test_sum_clipped_grad_with_padding_examples``: padding examples (their losses
    multiplied by 0, as gradhooks' empty batches do) add nothing: none padded, all padded (a
    zero gradient), the last two padded (the first example's alone), by every method."""
    x = torch.tensor([[1.0], [4.0], [7.0]], dtype=D)
    for padding in ([False, False, False], [True, True, True], [False, True, True]):
        keep = (~torch.tensor(padding)).to(D)
        for quantities, method in METHODS:
            model = MeanQuadratic()
            with gradhooks.add_hooks(model, quantities=quantities) as h:
                gradhooks.dp_sgd_step(
                    h, model(x) * keep, max_norm=2.5, noise_multiplier=0.0, reduction="sum",
                    method=method,
                )  # fmt: skip
            want = clipped_sum_by_loop(model, x, 2.5, keep)
            assert_close(model.params.grad, want, f"padding {padding}, {method}")


@pytest.mark.parametrize("microbatch_size", [None, 1, 2])
def test_sum_clipped_grad_extra_batch_axis(microbatch_size):
    """``test_sum_clipped_grad_extra_batch_axis`` (``keep_batch_dim=False``): two users of
    three examples each (``x`` of shape ``[users, examples, 1]``), each user's gradient of
    the mean over its examples clipped to 1000 (nothing clipped) and summed: divided by the
    users, the gradient of the mean loss over all six examples; taken by ``DPOptimizer`` in
    physical batches of ``microbatch_size`` users (``None``: both at once)."""
    x = torch.tensor([[[1.0], [2.0], [3.0]], [[3.0], [4.0], [5.0]]], dtype=D)
    plain = MeanQuadratic()
    plain(x.reshape(6, 1)).mean().backward()
    for quantities, method in METHODS:
        model = MeanQuadratic()
        step = microbatch_size or 2
        with gradhooks.add_hooks(model, quantities=quantities) as h:
            opt = gradhooks.DPOptimizer(
                torch.optim.SGD(model.parameters(), lr=1.0), h, max_grad_norm=1000.0,
                noise_multiplier=0.0, expected_batch_size=2, method=method,
            )  # fmt: skip
            for users in x.split(step):
                opt.backward(model(users))
            opt.step()
        assert_close(model.params.grad, plain.params.grad, f"{microbatch_size} {method}")


def test_sum_clipped_grad_prng_key():
    """``test_sum_clipped_grad_prng_key``: the loss adds a random draw per example, which does
    not change its gradient: the clipped sum is the loop's (the draw made once, in the
    batch's forward), by every method."""
    x = torch.tensor([[10.0], [20.0], [30.0]], dtype=D)
    for quantities, method in METHODS:
        torch.manual_seed(0)
        model = MeanQuadratic(noise=True)
        with gradhooks.add_hooks(model, quantities=quantities) as h:
            gradhooks.dp_sgd_step(
                h, model(x), max_norm=1.0, noise_multiplier=0.0, reduction="sum", method=method
            )
        assert_close(model.params.grad, clipped_sum_by_loop(model, x, 1.0), method)

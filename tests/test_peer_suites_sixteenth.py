"""A sixteenth set of the cases that other projects check in their own test suites, written in
gradhooks' terms and compared with float64 references (per-example loops of autograd,
``torch.autograd.functional`` Jacobians and Hessians, and :mod:`gradhooks.oracle`). The first
fifteen sets are :mod:`test_peer_suites`, :mod:`test_peer_suites_more`,
:mod:`test_peer_suites_third` to :mod:`test_peer_suites_fifteenth`; this one adds:

- Opacus (``opacus/tests/layers_grad_test.py``): each layer of its ``LayersGradTest``
  (Conv1d, Conv2d, a Linear on ``[batch, in]`` and ``[batch, 8, in]``, LayerNorm over one,
  two and three axes, GroupNorm and affine InstanceNorm of 1-d to 3-d inputs, Embedding of
  indices ``[batch, 8, 4]``, ``[batch, 8]`` and ``[batch]``, its ``SequenceBias`` and
  ``DPMultiheadAttention`` time-major, its ``DPLSTM``), weights drawn from ``U(-1, 1)``,
  under ``L1Loss`` of the squeezed output (``mean`` and ``sum``): ``grad1`` against the loop,
  and a DP step whose bound clips nothing and which adds no noise equal to the plain
  gradient, by every clipping method; the attention with ``dropout=0.05`` in training too,
  against a loop that replays each example's own dropout masks;
- Opacus (``opacus/tests/dp_layers_test.py``): ``DPMultiheadAttention`` loaded from
  ``nn.MultiheadAttention``'s ``state_dict`` (1, 2 and 8 heads, without bias, with
  ``add_bias_kv``, ``add_zero_attn``, a key and value of other widths) and ``DPLSTM`` loaded
  from ``nn.LSTM``'s, with an initial state: the same outputs and the same ``grad1``, each
  against the loop;
- Opacus (``opacus/tests/dp_model_inspector_test.py``): the modules its inspector accepts or
  refuses: InstanceNorm with and without ``affine`` and ``track_running_stats`` in training
  (running statistics moved as without the hooks), a parameter multiplied in the root's
  forward (trainable, then frozen), and grouped 1x1 convolutions;
- ASDL (``kazukiosawa/asdl``: ``tests/test_fisher.py``): ``test_kronA_linear`` and
  ``test_kronA_conv`` (``A`` is the bias-augmented inputs' second moment, a convolution's
  over its unfolded patches and positions), ``test_kron_linear`` (for one datum,
  ``kron(G, A)`` is the layer's exact and empirical Fisher, with and without the bias),
  ``test_kron_conv`` and ``test_kron_lw`` (for one datum, a convolution's ``kron(G, A)`` times
  its positions plus the terms between positions is its exact Fisher block, on one
  convolution and on its network of four convolutions with GroupNorm, max-pooling and two
  Linears); ``tests/test_precondition_accumulate.py``: K-FAC's running factors after the
  same batch three times equal the batch's own, and its inverse kept between updates;
- BackPACK (``test/extensions/secondorder/diag_hessian/``): ``DiagHessian`` of its
  piecewise-linear problems (Linear and convolutions with ReLU, LeakyReLU, max- and
  average-pooling, zero padding) under ``CrossEntropyLoss`` and ``MSELoss``, ``mean`` and
  ``sum``, as the diagonal of autograd-hacks' ``param.hess`` (:func:`gradhooks.compute_hess`);
  its smooth activations (sigmoid, tanh), whose Hessian has terms the Gauss-Newton block has
  not, are out of ``compute_hess``'s scope (it is the GGN, as documented);
- dp-transformers (``microsoft/dp-transformers``: ``tests/test_layers.py``,
  ``TestDPMergedLinear.test_equivalent_to_loralib``): loralib's ``MergedLinear`` (an
  ``nn.Linear`` with its own ``lora_A`` and ``lora_B`` applied by a grouped ``conv1d`` to the
  enabled parts of q, k and v) over its settings (``enable_lora``, ``r`` 0 and 3, ``alpha``,
  ``bias``, ``fan_in_fan_out``, which the peer marks as failing), in training and merged in
  eval.

Found and fixed: a module's own parameters given to ``F.linear`` in its ``forward`` (loralib's
``MergedLinear``, an ``nn.Linear`` whose forward adds the LoRA update) on a sequence, whose output
the next line changes in place (``result += ...``), had no ``grad1`` (a warning said no forward
was captured, and the DP step refused them): the output of ``F.linear`` on ``[batch, seq, in]`` is
a view, and an in-place change drops a view's gradient hooks. gradhooks now hooks that output as
it hooks a layer's, as a tensor of its own. And a weight a module gives to ``F.linear`` before
more of its own ``forward`` (an activation, the LoRA update) got no Kronecker factors from
:func:`gradhooks.kfac`, with no warning (:class:`gradhooks.KFAC` then stepped it on its raw
gradient), and :func:`gradhooks.jacobians` refused it: their backwards stopped at the hooked
modules' outputs, before that call; they now reach the outputs of such calls too.

``grad1[i]`` is always the gradient of example ``i``'s own loss (the loss of a batch of one).
Every comparison is in float64 at the harness's ``rtol=1e-7, atol=1e-9`` unless a test says
otherwise.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_close, assert_grad1, one_thread, seeded  # noqa: F401

D = torch.float64
METHODS = ("grad1", "ghost", "bookkeeping")


def opacus_layers():
    return pytest.importorskip("opacus.layers", reason="needs opacus")


# == Opacus: layers_grad_test.py ================================================================


def uniform_init(layer: nn.Module) -> nn.Module:
    """``_check_one_layer_with_criterion``: every weight and bias drawn from ``U(-1, 1)``, in
    float64."""
    layer = layer.double()
    for name, p in layer.named_parameters():
        if "weight" in name or "bias" in name:
            nn.init.uniform_(p, -1.0, 1.0)
    return layer


def first(out):
    """``_run_once``: the first output of a layer that returns a tuple."""
    return out[0] if isinstance(out, tuple) else out


def l1_per_example(out: Tensor, batch_dim: int, reduction: str) -> Tensor:
    """``[batch]``: each example's ``L1Loss`` against zeros (the mean or the sum over its
    entries), so that ``L1Loss(reduction)`` of the whole batch is their mean or sum."""
    rows = out.movedim(batch_dim, 0).abs().flatten(1)
    return rows.mean(1) if reduction == "mean" else rows.sum(1)


def loop_along(layer: nn.Module, args: tuple, batch_dim: int, loss_of, replay=None) -> dict:
    """``{name: [batch, *shape]}``: each example alone (its slice of every input along
    ``batch_dim``, kept as a batch of one) through autograd; ``replay(i)`` is a context in which
    example ``i``'s forward runs (its own dropout masks)."""
    batch = args[0].shape[batch_dim]
    rows: dict[str, list[Tensor]] = {}
    for i in range(batch):
        one = tuple(a.narrow(batch_dim if a.dim() > 1 else 0, i, 1) for a in args)
        layer.zero_grad()
        if replay is None:
            loss_of(layer(*one)).backward()
        else:
            with replay(i):
                loss_of(layer(*one)).backward()
        for n, p in layer.named_parameters():
            rows.setdefault(n, []).append(p.grad.clone())
    layer.zero_grad()
    return {n: torch.stack(g) for n, g in rows.items()}


def check_layer_grad(layer: nn.Module, args: tuple, batch_dim: int, reduction: str, what: str):
    """``_check_one_layer_with_criterion``: the layer's ``grad1`` under ``L1Loss(reduction)``
    of its squeezed output against the per-example loop (and reduced to ``.grad``), then the
    DP step by every method, bound ``1e9``, no noise, against the plain gradient (the peer's
    ``ConstantFlatClipper(1e9)`` run against its run without DP)."""
    want = loop_along(
        layer, args, batch_dim, lambda out: l1_per_example(first(out), batch_dim, reduction).sum()
    )
    out = first(layer(*args)).squeeze()
    F.l1_loss(out, torch.zeros_like(out), reduction=reduction).backward()
    plain = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()

    with gradhooks.add_hooks(layer, loss_reduction=reduction, batch_dim=batch_dim):
        out = first(layer(*args)).squeeze()
        F.l1_loss(out, torch.zeros_like(out), reduction=reduction).backward()
    assert_grad1(layer, want, f"{what} ({reduction})")
    for n, p in layer.named_parameters():
        reduced = p.grad1.mean(0) if reduction == "mean" else p.grad1.sum(0)
        assert_close(reduced, plain[n], f"{what} ({reduction}): grad1 reduced, {n}")
    gradhooks.clear_grad1(layer)
    layer.zero_grad()

    for method in METHODS:
        quantities = ("grad1",) if method == "grad1" else ("norms",)
        with gradhooks.add_hooks(layer, quantities=quantities, batch_dim=batch_dim) as h:
            losses = l1_per_example(first(layer(*args)), batch_dim, reduction)
            gradhooks.dp_sgd_step(
                h, losses, max_norm=1e9, noise_multiplier=0.0, method=method, reduction=reduction
            )
        for n, p in layer.named_parameters():
            assert_close(p.grad, plain[n], f"{what} ({reduction}), DP step by {method}: {n}")
        gradhooks.clear_grad1(layer)
        layer.zero_grad()


LAYERS = {
    "conv1d": (lambda: nn.Conv1d(16, 8, 3, 1), lambda: (torch.randn(6, 16, 12),)),
    "conv2d": (lambda: nn.Conv2d(16, 8, 3, 1), lambda: (torch.randn(6, 16, 8, 8),)),
    "linear": (lambda: nn.Linear(8, 4), lambda: (torch.randn(16, 8),)),
    "linear_3d": (lambda: nn.Linear(8, 4), lambda: (torch.randn(16, 8, 8),)),
    "embedding_3d": (lambda: nn.Embedding(256, 10), lambda: (torch.randint(0, 255, (6, 8, 4)),)),
    "embedding_2d": (lambda: nn.Embedding(256, 10), lambda: (torch.randint(0, 255, (6, 8)),)),
    "embedding_1d": (lambda: nn.Embedding(256, 10), lambda: (torch.randint(0, 255, (16,)),)),
    "layernorm_1": (lambda: nn.LayerNorm(6), lambda: (torch.randn(6, 4, 6, 6),)),
    "layernorm_2": (lambda: nn.LayerNorm((6, 6)), lambda: (torch.randn(6, 4, 6, 6),)),
    "layernorm_3": (lambda: nn.LayerNorm((4, 6, 6)), lambda: (torch.randn(6, 4, 6, 6),)),
    "groupnorm_1d": (lambda: nn.GroupNorm(4, 16), lambda: (torch.randn(6, 16, 10),)),
    "groupnorm_2d": (lambda: nn.GroupNorm(4, 16), lambda: (torch.randn(6, 16, 5, 4),)),
    "groupnorm_3d": (lambda: nn.GroupNorm(4, 16), lambda: (torch.randn(6, 16, 5, 4, 3),)),
    "instancenorm_1d": (
        lambda: nn.InstanceNorm1d(16, affine=True),
        lambda: (torch.randn(6, 16, 10),),
    ),
    "instancenorm_2d": (
        lambda: nn.InstanceNorm2d(16, affine=True),
        lambda: (torch.randn(6, 16, 5, 4),),
    ),
    "instancenorm_3d": (
        lambda: nn.InstanceNorm3d(16, affine=True),
        lambda: (torch.randn(6, 16, 5, 4, 3),),
    ),
}


def doubled(args: tuple) -> tuple:
    return tuple(a.double() if a.is_floating_point() else a for a in args)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", LAYERS)
def test_opacus_layers_grad(name, reduction):
    """layers_grad_test.py ``test_conv1d``, ``test_conv2d``, ``test_linear`` (both inputs),
    ``test_layernorm`` (the three ``normalized_shape``), ``test_groupnorm``,
    ``test_instancenorm`` and ``test_embedding`` (its three index shapes; the last, ``[batch]``,
    gives ``[batch, dim]`` outputs), on smaller batches and widths than the peer's."""
    make, inputs = LAYERS[name]
    torch.manual_seed(0)
    layer = uniform_init(make())
    check_layer_grad(layer, doubled(inputs()), 0, reduction, name)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_opacus_layers_grad_sequence_bias_time_major(reduction):
    """layers_grad_test.py ``test_sequence_bias``: Opacus' ``SequenceBias(2)`` (a bias appended
    as one more step) on a time-major ``[4, 3, 2]`` input, the examples on dimension 1
    (``batch_dim=1``)."""
    layers = opacus_layers()
    torch.manual_seed(0)
    layer = uniform_init(layers.SequenceBias(2))
    check_layer_grad(layer, (torch.randn(4, 3, 2, dtype=D),), 1, reduction, "SequenceBias")


MHA_SETTINGS = {
    "plain": dict(),
    "bias_kv": dict(bias=True, add_bias_kv=True),
    "bias_kv_zero_attn": dict(bias=True, add_bias_kv=True, add_zero_attn=True),
    "kdim_vdim": dict(bias=True, add_bias_kv=True, add_zero_attn=True, kdim=7, vdim=7),
}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("setting", MHA_SETTINGS)
def test_opacus_layers_grad_dp_multihead_attention(setting, reduction):
    """layers_grad_test.py ``test_multihead_attention``: ``DPMultiheadAttention(8, 1)``
    time-major (``[T, batch, E]``, ``batch_dim=1``), self-attention and a query of 6 steps
    over a key and value of 5 steps of width 7 (``kdim``, ``vdim``), with ``add_bias_kv`` and
    ``add_zero_attn``; its first output, the attention's."""
    layers = opacus_layers()
    kw = MHA_SETTINGS[setting]
    torch.manual_seed(0)
    layer = uniform_init(layers.DPMultiheadAttention(8, 1, **kw))
    q = torch.randn(6, 4, 8, dtype=D)
    if "kdim" in kw:
        args = (q, torch.randn(5, 4, 7, dtype=D), torch.randn(5, 4, 7, dtype=D))
    else:
        args = (q, q, q)
    check_layer_grad(layer, args, 1, reduction, f"DPMultiheadAttention {setting}")


class DropoutMasks:
    """Records the masks a ``nn.Dropout`` draws in the batched forward (its output over its
    input: the softmax's weights are never 0) and replays example ``i``'s rows of them in the
    forward of example ``i`` alone (rows ``i·heads`` to ``(i+1)·heads`` of the attention's
    ``[batch · heads, T, S]`` weights)."""

    def __init__(self, dropout: nn.Dropout, heads: int):
        self.dropout, self.heads, self.mask = dropout, heads, None

    def record(self):
        def hook(module, inputs, output):
            self.mask = (output / inputs[0]).detach()

        return self.dropout.register_forward_hook(hook)

    def replay(self, i: int):
        rows = self.mask[i * self.heads : (i + 1) * self.heads]

        class Replay:
            def __enter__(inner):
                inner.handle = self.dropout.register_forward_hook(lambda m, a, out: a[0] * rows)

            def __exit__(inner, *exc):
                inner.handle.remove()

        return Replay()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_opacus_layers_grad_dp_multihead_attention_dropout(reduction):
    """layers_grad_test.py ``test_multihead_attention``, ``DPMultiheadAttention(8, 2,
    add_bias_kv=True, dropout=0.05)`` in training: the attention's dropout draws a mask per
    example and head. The peer seeds both runs alike; here ``grad1`` is checked against a loop
    that replays each example's own masks, and every DP step (bound ``1e9``, no noise), under
    the same seed, against the plain gradient."""
    layers = opacus_layers()
    torch.manual_seed(0)
    layer = uniform_init(
        layers.DPMultiheadAttention(8, 2, bias=True, add_bias_kv=True, dropout=0.05)
    )
    layer.train()
    x = torch.randn(6, 5, 8, dtype=D)
    masks = DropoutMasks(layer.dropout, heads=2)

    def batch_loss():
        torch.manual_seed(7)
        out = first(layer(x, x, x)).squeeze()
        return F.l1_loss(out, torch.zeros_like(out), reduction=reduction)

    handle = masks.record()
    batch_loss().backward()
    handle.remove()
    plain = {n: p.grad.clone() for n, p in layer.named_parameters()}
    assert 0 < (masks.mask == 0).sum() < masks.mask.numel()  # some weights dropped, not all
    want = loop_along(
        layer,
        (x, x, x),
        1,
        lambda out: l1_per_example(first(out), 1, reduction).sum(),
        replay=masks.replay,
    )

    with gradhooks.add_hooks(layer, loss_reduction=reduction, batch_dim=1):
        batch_loss().backward()
    assert_grad1(layer, want, f"dropout ({reduction})")
    gradhooks.clear_grad1(layer)
    layer.zero_grad()
    for method in METHODS:
        quantities = ("grad1",) if method == "grad1" else ("norms",)
        with gradhooks.add_hooks(layer, quantities=quantities, batch_dim=1) as h:
            torch.manual_seed(7)
            losses = l1_per_example(first(layer(x, x, x)), 1, reduction)
            gradhooks.dp_sgd_step(
                h, losses, max_norm=1e9, noise_multiplier=0.0, method=method, reduction=reduction
            )
        for n, p in layer.named_parameters():
            assert_close(p.grad, plain[n], f"dropout ({reduction}), DP step by {method}: {n}")
        gradhooks.clear_grad1(layer)
        layer.zero_grad()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("shape", [(6, 7, 5), (7, 6, 5)], ids=["batch_first", "batch_second"])
def test_opacus_layers_grad_dplstm(shape, reduction):
    """layers_grad_test.py ``test_lstm_batch_first`` and ``test_lstm_batch_second`` (whose
    layer is batch-first too, so the first of its ``[20, 30, 25]`` dimensions is the batch):
    Opacus' ``DPLSTM(5, 4, 1, batch_first=True)``, the loss on its output sequence (the first
    of its outputs)."""
    layers = opacus_layers()
    torch.manual_seed(0)
    layer = uniform_init(layers.DPLSTM(5, 4, 1, batch_first=True))
    check_layer_grad(layer, (torch.randn(*shape, dtype=D),), 0, reduction, "DPLSTM")


# == Opacus: dp_layers_test.py ==================================================================


def torch_layout(dp: dict[str, Tensor], names: list[str]) -> dict[str, Tensor]:
    """``DPMultiheadAttention``'s per-example gradients ``[batch, ...]`` laid out as
    ``nn.MultiheadAttention``'s parameters ``names`` (the inverse of the peer's
    ``load_state_dict``: q, k and v stacked into ``in_proj_*``, the sequence biases as
    ``bias_k`` / ``bias_v`` ``[1, 1, E]``)."""
    as_torch = {
        "in_proj_weight": lambda: torch.cat([dp[f"{c}linear.weight"] for c in "qkv"], 1),
        "in_proj_bias": lambda: torch.cat([dp[f"{c}linear.bias"] for c in "qkv"], 1),
        "q_proj_weight": lambda: dp["qlinear.weight"],
        "k_proj_weight": lambda: dp["klinear.weight"],
        "v_proj_weight": lambda: dp["vlinear.weight"],
        "bias_k": lambda: dp["seq_bias_k.bias"][:, None, None],
        "bias_v": lambda: dp["seq_bias_v.bias"][:, None, None],
        "out_proj.weight": lambda: dp["out_proj.weight"],
        "out_proj.bias": lambda: dp["out_proj.bias"],
    }
    return {n: as_torch[n]() for n in names}


@pytest.mark.parametrize(
    "kw",
    [
        dict(num_heads=1),
        dict(num_heads=2, bias=False),
        dict(num_heads=8, add_bias_kv=True),
        dict(num_heads=2, bias=False, add_bias_kv=True),
        dict(num_heads=2, add_zero_attn=True),
        dict(num_heads=2, kdim=6, vdim=6),
    ],
    ids=["heads_1", "no_bias", "heads_8_bias_kv", "no_bias_bias_kv", "zero_attn", "kdim_vdim"],
)
def test_opacus_dp_multihead_attention_same_as_torch(kw):
    """dp_layers_test.py ``DPLayersTest.test_multihead_attention``: ``DPMultiheadAttention``
    given ``nn.MultiheadAttention``'s ``state_dict`` gives its outputs and attention weights;
    beyond the peer, both layers' ``grad1`` (time-major, ``batch_dim=1``, half the squared
    output) are the per-example loop's and the same numbers, the DP layer's q, k and v
    projections stacked into torch's ``in_proj_*``."""
    layers = opacus_layers()
    torch.manual_seed(0)
    original = nn.MultiheadAttention(8, **kw).double()
    dp = layers.DPMultiheadAttention(8, **kw).double()
    dp.load_state_dict(original.state_dict())
    q = torch.randn(5, 4, 8, dtype=D)
    k = v = q if "kdim" not in kw else torch.randn(6, 4, kw["kdim"], dtype=D)
    y_torch, w_torch = original(q, k, v)
    y_dp, w_dp = dp(q, k, v)
    assert_close(y_dp, y_torch, "outputs")
    assert_close(w_dp, w_torch, "attention weights")

    def loss(out):
        return 0.5 * first(out).square().sum()

    for layer in (original, dp):
        want = loop_along(layer, (q, k, v), 1, loss)
        with gradhooks.add_hooks(layer, loss_reduction="sum", batch_dim=1):
            loss(layer(q, k, v)).backward()
        assert_grad1(layer, want, type(layer).__name__)
    names = [n for n, _ in original.named_parameters()]
    mapped = torch_layout({n: p.grad1 for n, p in dp.named_parameters()}, names)
    for n, p in original.named_parameters():
        assert_close(mapped[n], p.grad1, f"DP layer's grad1 against torch's: {n}")


def test_opacus_dplstm_same_as_lstm_with_initial_state():
    """dp_layers_test.py ``DPLSTMTest``: ``DPLSTM`` given ``nn.LSTM``'s weights (its
    ``state_dict``; the peer's older ``initialize_weights``), batch-first, with an initial
    ``(h, c)`` per example (``[1, batch, hidden]``, the batch on dimension 1 of the state):
    the same output and final state (``test_lstm_forward``) and, under ``MSELoss`` against a
    random target (``test_lstm_backward``), the same ``.grad``; beyond the peer, both layers'
    ``grad1``, against the per-example loop."""
    layers = opacus_layers()
    torch.manual_seed(0)
    batch, steps, features, hidden = 5, 6, 4, 3
    original = nn.LSTM(features, hidden, batch_first=True).double()
    dp = layers.DPLSTM(features, hidden, batch_first=True).double()
    dp.load_state_dict(original.state_dict())
    x = torch.randn(batch, steps, features, dtype=D)
    h0, c0 = torch.randn(2, 1, batch, hidden, dtype=D)
    y = torch.randn(batch, steps, hidden, dtype=D)
    out_torch, (h_torch, c_torch) = original(x, (h0, c0))
    out_dp, (h_dp, c_dp) = dp(x, (h0, c0))
    for got, want, what in [
        (out_dp, out_torch, "output"),
        (h_dp, h_torch, "h"),
        (c_dp, c_torch, "c"),
    ]:
        assert_close(got, want, what)

    per_example = {}
    for layer in (original, dp):
        want = {n: torch.zeros(batch, *p.shape, dtype=D) for n, p in layer.named_parameters()}
        for i in range(batch):  # each example with its own initial state
            layer.zero_grad()
            out, _ = layer(x[i : i + 1], (h0[:, i : i + 1], c0[:, i : i + 1]))
            F.mse_loss(out, y[i : i + 1]).backward()
            for n, p in layer.named_parameters():
                want[n][i] = p.grad
        layer.zero_grad()
        with gradhooks.add_hooks(layer):
            F.mse_loss(layer(x, (h0, c0))[0], y).backward()
        assert_grad1(layer, want, type(layer).__name__)
        per_example[type(layer).__name__] = {n: p.grad1 for n, p in layer.named_parameters()}
    for n, p in original.named_parameters():
        assert_close(dp.get_parameter(n).grad, p.grad, f".grad of {n}")
        assert_close(per_example["DPLSTM"][n], per_example["LSTM"][n], f"grad1 of {n}")


# == Opacus: dp_model_inspector_test.py =========================================================


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(affine=True),
        dict(track_running_stats=True),
        dict(affine=True, track_running_stats=True),
    ],
    ids=["plain", "affine", "running_stats", "affine_running_stats"],
)
def test_opacus_inspector_instance_norm_running_stats(kw):
    """dp_model_inspector_test.py ``test_running_stats``: ``InstanceNorm1d(16)`` with and
    without ``affine`` and ``track_running_stats``, after a 1x1 convolution, in training (the
    inspector refuses the last, affine with running statistics). In training an instance norm
    normalizes each example by its own statistics, so every parameter has per-example
    gradients: ``grad1`` is the loop's, and the running statistics move as without the
    hooks."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(3, 16, 1), nn.InstanceNorm1d(16, **kw), nn.Tanh()).double()
    model.train()
    x = torch.randn(5, 3, 10, dtype=D)
    plain = copy.deepcopy(model)
    plain(x)
    want = loop_grad(copy.deepcopy(model), lambda out: 0.5 * out.square().sum(), x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        (0.5 * model(x).square().sum()).backward()
    assert_grad1(model, want, "instance norm")
    for (name, b), b_plain in zip(model.named_buffers(), plain.buffers(), strict=True):
        assert_close(b.double(), b_plain.double(), f"buffer {name}")


class SampleNetWithExtraParam(nn.Module):
    """dp_model_inspector_test.py ``test_extra_param``: a Linear, then a parameter of the root
    multiplied in its own forward (no layer, so no rule: the fallback's)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.extra_param = nn.Parameter(torch.randn(16, 2))

    def forward(self, x):
        return self.fc(x).matmul(self.extra_param)


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
def test_opacus_inspector_extra_param(frozen):
    """dp_model_inspector_test.py ``test_extra_param``: the inspector refuses the trainable
    ``extra_param`` and accepts it frozen; gradhooks gives it (by its fallback) and ``fc`` the
    loop's ``grad1`` under a mean cross-entropy, and, frozen, gives it none, and the DP step by
    every method (bound 1, noise 0) is the per-example loop's clipped mean."""
    model = seeded(SampleNetWithExtraParam).double()
    model.extra_param.requires_grad_(not frozen)
    x, y = torch.randn(6, 8, dtype=D), torch.randint(2, (6,))
    want = loop_grad(model, F.cross_entropy, x, y)
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x), y).backward()
    assert_grad1(model, want, "extra param", frozen_clean=True)
    gradhooks.clear_grad1(model)
    trainable = {n: g for n, g in want.items() if model.get_parameter(n).requires_grad}
    flat = torch.cat([g.flatten(1) for g in trainable.values()], 1)
    factors = (1.0 / flat.norm(dim=1)).clamp(max=1.0)
    for method in METHODS:
        model.zero_grad()
        quantities = ("grad1",) if method == "grad1" else ("norms",)
        with gradhooks.add_hooks(model, quantities=quantities) as h:
            losses = F.cross_entropy(model(x), y, reduction="none")
            gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=0.0, method=method)
        for n, g in trainable.items():
            clipped = torch.einsum("b,b...->...", factors, g) / len(x)
            assert_close(model.get_parameter(n).grad, clipped, f"DP step by {method}: {n}")
        assert frozen == (model.extra_param.grad is None)
        gradhooks.clear_grad1(model)


class GroupedConvs(nn.Module):
    """dp_model_inspector_test.py ``test_conv2d``'s three 1x1 convolutions in one network:
    3 to 6 channels in one group and in 3 (two filters per input channel), added, then 6 to
    6 in 2 groups."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Conv2d(3, 6, kernel_size=1, groups=1)
        self.depthwise = nn.Conv2d(3, 6, kernel_size=1, groups=3)
        self.grouped = nn.Conv2d(6, 6, kernel_size=1, groups=2)

    def forward(self, x):
        return self.grouped(torch.tanh(self.dense(x) + self.depthwise(x))).flatten(1)


def test_opacus_inspector_conv2d_groups():
    """dp_model_inspector_test.py ``test_conv2d``: the convolutions its inspector accepts (one
    group, and 3 groups of 3 to 6 channels) and the one its older version refused (6 to 6 in 2
    groups), under a mean cross-entropy, against the loop."""
    model = seeded(GroupedConvs).double()
    x, y = torch.randn(5, 3, 2, 2, dtype=D), torch.randint(24, (5,))
    want = loop_grad(model, F.cross_entropy, x, y)
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x), y).backward()
    assert_grad1(model, want, "grouped 1x1 convolutions")


# == ASDL: tests/test_fisher.py =================================================================


def kfac_loss(lossname: str) -> str:
    return "cross_entropy" if lossname == "cross_entropy" else "mse"


def with_ones(a: Tensor) -> Tensor:
    """``[features + 1, ...]``: a ones row appended (the bias's input)."""
    return torch.cat([a, torch.ones_like(a[:1])])


@pytest.mark.parametrize("lossname", ["cross_entropy", "mse"])
@pytest.mark.parametrize("fisher", ["exact", "mc", "empirical"])
def test_asdl_kron_a_linear(fisher, lossname):
    """test_fisher.py ``test_kronA_linear``: for ``Linear(20, 10)`` on a batch of 4, ``A`` is
    ``x_extᵀ x_ext / 4`` (the inputs with a ones column), whatever the Fisher and the loss."""
    torch.manual_seed(0)
    model = nn.Linear(20, 10).double()
    x = torch.randn(4, 20, dtype=D)
    y = (
        torch.zeros(4, dtype=torch.long)
        if lossname == "cross_entropy"
        else torch.randn(4, 10, dtype=D)
    )
    f = gradhooks.kfac(model, x, y, fisher=fisher, loss=kfac_loss(lossname))["weight"]
    x_ext = with_ones(x.T).T
    assert_close(f.A, x_ext.T @ x_ext / 4, f"A ({fisher}, {lossname})")


@pytest.mark.parametrize("lossname", ["cross_entropy", "mse"])
@pytest.mark.parametrize("fisher", ["exact", "mc", "empirical"])
def test_asdl_kron_a_conv(fisher, lossname):
    """test_fisher.py ``test_kronA_conv``: for ``Conv2d(3, 4, 5)`` then ``Flatten`` on a batch
    of 4 images 6x6, ``A`` is ``m mᵀ / (positions · 4)``, ``m`` the unfolded patches
    (``im2col``, a ones row appended) of every example and position side by side."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 5), nn.Flatten()).double()
    x = torch.randn(4, 3, 6, 6, dtype=D)
    y = (
        torch.zeros(4, dtype=torch.long)
        if lossname == "cross_entropy"
        else torch.randn(4, 16, dtype=D)
    )
    f = gradhooks.kfac(model, x, y, fisher=fisher, loss=kfac_loss(lossname))["0.weight"]
    patches = F.unfold(x, 5)  # [batch, 3·5·5, positions]
    m = with_ones(patches.transpose(0, 1).flatten(1))  # [3·5·5 + 1, batch · positions]
    assert_close(f.A, m @ m.T / (patches.shape[-1] * 4), f"A ({fisher}, {lossname})")


def loss_hessian_columns(z: Tensor, y: Tensor, lossname: str, fisher: str) -> Tensor:
    """``[columns, outputs]`` for one datum's flattened output ``z``: the columns of a square
    root of the loss's Hessian in ``z`` (``"exact"``) or the loss's gradient (``"empirical"``);
    the losses are ``cross_entropy`` and the summed squared error."""
    z = z.detach().flatten()
    if fisher == "empirical":
        z = z.clone().requires_grad_()
        if lossname == "cross_entropy":
            loss = F.cross_entropy(z[None], y, reduction="sum")
        else:
            loss = F.mse_loss(z, y.flatten(), reduction="sum")
        return torch.autograd.grad(loss, z)[0][None]
    if lossname == "mse":
        return math.sqrt(2) * torch.eye(len(z), dtype=D)
    p = z.softmax(0)
    values, vectors = torch.linalg.eigh(torch.diag(p) - torch.outer(p, p))
    return (vectors * values.clamp(min=0).sqrt()).T


def layer_fisher(model: nn.Module, layer: nn.Module, x: Tensor, columns: Tensor) -> Tensor:
    """One datum's Fisher block of ``layer``'s ``cat([W.flatten(1), b[:, None]], 1)``
    (flattened row-major), ``Jᵀ (Σ_k c_k c_kᵀ) J``, ``J`` the Jacobian of the model's
    flattened output by autograd."""
    names = {id(p): n for n, p in model.named_parameters()}
    bias = layer.bias is not None
    theta = layer.weight.detach().flatten(1)
    if bias:
        theta = torch.cat([theta, layer.bias.detach()[:, None]], 1)

    def output(t: Tensor) -> Tensor:
        values = {n: p.detach() for n, p in model.named_parameters()}
        w = t[:, : layer.weight[0].numel()] if bias else t
        values[names[id(layer.weight)]] = w.reshape(layer.weight.shape)
        if bias:
            values[names[id(layer.bias)]] = t[:, -1]
        return torch.func.functional_call(model, values, (x,)).flatten()

    J = torch.autograd.functional.jacobian(output, theta).flatten(1)
    return J.T @ columns.T @ columns @ J


def positions_and_gradients(model, layer, x: Tensor, columns: Tensor):
    """``a`` ``[in·k·k (+1), positions]``, the layer's unfolded input patches (a ones row for
    the bias), and ``g`` ``[columns, out, positions]``, the gradient of each column's
    ``c_kᵀ z`` with respect to the layer's output at each position, for one datum."""
    seen = {}
    handle = layer.register_forward_hook(lambda m, inp, out: seen.update(a=inp[0], out=out))
    try:
        z = model(x).flatten()
    finally:
        handle.remove()
    if isinstance(layer, nn.Conv2d):
        a = F.unfold(seen["a"], layer.kernel_size, layer.dilation, layer.padding, layer.stride)[0]
    else:
        a = seen["a"].reshape(-1, layer.in_features).T
    if layer.bias is not None:
        a = with_ones(a)
    g = torch.stack([torch.autograd.grad(z, seen["out"], c, retain_graph=True)[0] for c in columns])
    return a.detach(), g.reshape(len(columns), seen["out"].shape[1], -1)


def between_positions(a: Tensor, g: Tensor) -> Tensor:
    """test_fisher.py's correction, ``Σ_k Σ_{i≠j} [kron(g_ki g_kjᵀ, a_i a_jᵀ) - kron(g_ki
    g_kiᵀ, a_j a_jᵀ)]``, summed in closed form: with ``u_ki = kron(g_ki, a_i)``, the first
    sum is ``Σ_k (Σ_i u_ki)(Σ_i u_ki)ᵀ - Σ_ki u_ki u_kiᵀ``, the second ``kron(Σ_ki g_ki g_kiᵀ,
    Σ_j a_j a_jᵀ) - Σ_ki u_ki u_kiᵀ``."""
    u = torch.einsum("kos,is->ksoi", g, a).flatten(2)  # [columns, positions, out·in]
    whole = u.sum(1)
    return whole.T @ whole - torch.kron(torch.einsum("kos,kps->op", g, g), a @ a.T)


@pytest.mark.parametrize("lossname", ["cross_entropy", "mse"])
@pytest.mark.parametrize("fisher", ["exact", "empirical"])
@pytest.mark.parametrize("bias", [True, False])
def test_asdl_kron_linear_one_datum(bias, fisher, lossname):
    """test_fisher.py ``test_kron_linear``: for ``Linear(20, 10)`` and one datum, ``kron(G, A)``
    is the layer's Fisher (the GGN for ``"exact"``, the gradient's outer product for
    ``"empirical"``), its bias block the last row and column of ``A`` (ASDL lays the bias
    out apart; here it is the weight's last column). The peer's ``FISHER_MC`` compares with its
    own sampled Fisher; a sampled label is the generator's, so that case is ``"empirical"``
    here at a known label."""
    torch.manual_seed(0)
    model = nn.Linear(20, 10, bias=bias).double()
    x = torch.randn(1, 20, dtype=D)
    y = torch.tensor([0]) if lossname == "cross_entropy" else torch.randn(1, 10, dtype=D)
    f = gradhooks.kfac(model, x, y, fisher=fisher, loss=kfac_loss(lossname), reduction="sum")
    columns = loss_hessian_columns(model(x), y, lossname, fisher)
    want = layer_fisher(model, model, x, columns)
    assert_close(torch.kron(f["weight"].G, f["weight"].A), want, f"{fisher} Fisher block")


def check_conv_blocks(model: nn.Module, x: Tensor, y: Tensor, lossname: str, fisher: str):
    """Every Conv2d's ``kron(G, A) · positions + between_positions`` and every Linear's
    ``kron(G, A)`` against its Fisher block, for one datum (``test_kron_lw``)."""
    factors = gradhooks.kfac(model, x, y, fisher=fisher, loss=kfac_loss(lossname), reduction="sum")
    columns = loss_hessian_columns(model(x), y, lossname, fisher)
    checked = 0
    for name, layer in model.named_modules():
        if not isinstance(layer, nn.Conv2d | nn.Linear):
            continue
        f = factors[f"{name}.weight"]
        a, g = positions_and_gradients(model, layer, x, columns)
        got = torch.kron(f.G, f.A) * a.shape[1] + between_positions(a, g)
        assert_close(got, layer_fisher(model, layer, x, columns), f"{name} ({fisher}, {lossname})")
        checked += 1
    assert checked


@pytest.mark.parametrize("lossname", ["cross_entropy", "mse"])
@pytest.mark.parametrize("fisher", ["exact", "empirical"])
@pytest.mark.parametrize("padding,bias", [(0, True), (1, True), (1, False)])
def test_asdl_kron_conv_one_datum(padding, bias, fisher, lossname):
    """test_fisher.py ``test_kron_conv``: ``Conv2d(3, 2, 3, padding)`` then ``Flatten`` on one
    5x5 image: K-FAC's ``kron(G, A)`` treats positions as independent (``A`` a mean over
    them), so ``kron(G, A) · positions`` plus the peer's terms between positions is the
    convolution's Fisher block exactly."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 2, 3, padding=padding, bias=bias), nn.Flatten()).double()
    x = torch.randn(1, 3, 5, 5, dtype=D)
    outputs = model(x).shape[1]
    y = torch.tensor([0]) if lossname == "cross_entropy" else torch.randn(1, outputs, dtype=D)
    check_conv_blocks(model, x, y, lossname, fisher)


class AsdlNet(nn.Module):
    """test_fisher.py's ``Net``: four 3x3 convolutions each followed by GroupNorm and ReLU,
    max-pooling after the second and the fourth, two Linears (its dropouts at rate 0)."""

    def __init__(self, padding: int, data_size: int):
        super().__init__()
        self.conv1, self.norm1 = nn.Conv2d(3, 3, 3, padding=padding), nn.GroupNorm(1, 3)
        self.conv2, self.norm2 = nn.Conv2d(3, 6, 3, padding=padding), nn.GroupNorm(2, 6)
        self.conv3, self.norm3 = nn.Conv2d(6, 6, 3, padding=padding), nn.GroupNorm(2, 6)
        self.conv4, self.norm4 = nn.Conv2d(6, 6, 3, padding=padding), nn.GroupNorm(2, 6)
        self.fc1 = nn.Linear(6 * (data_size // 4 - 3 + 3 * padding) ** 2, 12)
        self.fc2 = nn.Linear(12, 10)

    def forward(self, x):
        x = F.relu(self.norm2(self.conv2(F.relu(self.norm1(self.conv1(x))))))
        x = F.max_pool2d(x, 2, 2)
        x = F.relu(self.norm4(self.conv4(F.relu(self.norm3(self.conv3(x))))))
        x = F.max_pool2d(x, 2, 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


@pytest.mark.parametrize("lossname", ["cross_entropy", "mse"])
@pytest.mark.parametrize("padding,data_size", [(1, 8), (0, 16)])
def test_asdl_kron_lw_net_one_datum(padding, data_size, lossname):
    """test_fisher.py ``test_kron_lw``: on its ``Net`` (GroupNorm between the layers, which
    K-FAC leaves out) and one image, every convolution's ``kron(G, A) · positions`` plus the
    terms between positions, and every Linear's ``kron(G, A)``, is the layer's exact Fisher
    (GGN) block."""
    torch.manual_seed(0)
    model = AsdlNet(padding, data_size).double()
    x = torch.randn(1, 3, data_size, data_size, dtype=D)
    y = torch.tensor([3]) if lossname == "cross_entropy" else torch.randn(1, 10, dtype=D)
    check_conv_blocks(model, x, y, lossname, "exact")


# == ASDL: tests/test_precondition_accumulate.py ================================================


def asdl_convnet(n_dim: int = 32, channels: int = 2, classes: int = 10) -> nn.Sequential:
    """test_precondition_accumulate.py's ``convnet``: two 3x3 convolutions, each followed by
    max-pooling of 3 and ReLU, and a Linear."""
    features = int(n_dim / 2**4) ** 2 * channels
    return nn.Sequential(
        nn.Conv2d(3, channels, 3), nn.MaxPool2d(3), nn.ReLU(),
        nn.Conv2d(channels, channels, 3), nn.MaxPool2d(3), nn.ReLU(),
        nn.Flatten(), nn.Linear(features, classes),
    )  # fmt: skip


@pytest.mark.parametrize("lossname", ["cross_entropy", "mse"])
@pytest.mark.parametrize("fisher", ["exact", "empirical"])
def test_asdl_kfac_accumulate_the_same_batch(fisher, lossname):
    """test_precondition_accumulate.py (``KFAC``): the curvature accumulated three times on
    one batch is the batch's own, and the inverse is kept until it is updated. Here
    ``gradhooks.KFAC`` (running averages, ``decay=0.9``; a base SGD with ``lr=0``, so the
    model stays put) steps three times on one batch: its running factors are
    :func:`gradhooks.kfac`'s of that batch. Then, with ``inverse_every=3``, two steps on
    another batch: the running factors are ``0.9`` and ``0.81`` of the first batch's, the rest
    the second's, and both steps precondition by the inverse taken at the first of them (step
    3), kept through the next. (The peer's ``FISHER_MC`` reseeds its sampler for each
    accumulation; gradhooks' one generator draws new labels each step, so the sampled Fisher
    is left out.)"""
    torch.manual_seed(0)
    model = asdl_convnet().double()
    x1, x2 = torch.randn(2, 4, 3, 32, 32, dtype=D)
    labels = torch.zeros(4, dtype=torch.long)
    y = labels if lossname == "cross_entropy" else F.one_hot(labels, 10).double()
    name = kfac_loss(lossname)

    def loss_of(x):
        out = model(x)
        return (
            F.cross_entropy(out, y)
            if lossname == "cross_entropy"
            else F.mse_loss(out, y, reduction="sum") / 4
        )

    opt = gradhooks.KFAC(
        model, torch.optim.SGD(model.parameters(), lr=0.0), damping=1e-2, decay=0.9,
        fisher=fisher, loss=name, inverse_every=3,
    )  # fmt: skip
    for _ in range(3):
        opt.zero_grad()
        loss_of(x1).backward()
        opt.step(x1, y)
    once = gradhooks.kfac(model, x1, y, fisher=fisher, loss=name)
    assert set(opt.factors) == set(once) == {"0.weight", "3.weight", "7.weight"}
    for n, f in once.items():
        assert_close(opt.factors[n].A, f.A, f"running A of {n}")
        assert_close(opt.factors[n].G, f.G, f"running G of {n}")

    second = gradhooks.kfac(model, x2, y, fisher=fisher, loss=name)

    def mixed(w: float) -> dict:
        return {
            n: dataclasses.replace(
                f, A=w * f.A + (1 - w) * second[n].A, G=w * f.G + (1 - w) * second[n].G
            )
            for n, f in once.items()
        }

    # step 3 (another batch): new factors, inverted (3 % inverse_every == 0); step 4: new
    # factors again, the inverse of step 3 kept
    for w in (0.9, 0.81):
        opt.zero_grad()
        loss_of(x2).backward()
        raw = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step(x2, y)
        got = {n: p.grad.clone() for n, p in model.named_parameters()}
        for n, f in mixed(w).items():
            assert_close(opt.factors[n].A, f.A, f"running A of {n}, weight {w}")
            assert_close(opt.factors[n].G, f.G, f"running G of {n}, weight {w}")
        for n, p in model.named_parameters():
            p.grad = raw[n].clone()
        gradhooks.kfac_precondition(model, mixed(0.9), damping=1e-2)
        for n, p in model.named_parameters():
            assert_close(got[n], p.grad, f"preconditioned by step 3's inverse: {n} ({w})")


# == BackPACK: test/extensions/secondorder/diag_hessian/ ========================================


def relu_head(layer: nn.Module, features: int) -> nn.Sequential:
    return nn.Sequential(layer, nn.ReLU(), nn.Flatten(), nn.Linear(features, 5))


DIAG_HESSIAN_SETTINGS = {
    # id: (model, input shape, reduction), from secondorder_settings.py
    "linear": (lambda: nn.Sequential(nn.Linear(10, 5)), (3, 10), "mean"),
    "linear_linear": (lambda: nn.Sequential(nn.Linear(10, 7), nn.Linear(7, 5)), (3, 10), "mean"),
    "linear_relu_linear": (
        lambda: nn.Sequential(nn.Linear(10, 7), nn.ReLU(), nn.Linear(7, 5)),
        (3, 10),
        "sum",
    ),
    "conv1d": (lambda: relu_head(nn.Conv1d(3, 2, 2), 12), (3, 3, 7), "sum"),
    "conv1d_strided_dilated": (
        lambda: relu_head(nn.Conv1d(3, 6, 2, stride=4, padding=2, dilation=3), 18),
        (3, 3, 8),
        "sum",
    ),
    "conv2d_no_bias": (lambda: relu_head(nn.Conv2d(3, 2, 2, bias=False), 72), (3, 3, 7, 7), "mean"),
    "conv2d_strided_dilated": (
        lambda: relu_head(nn.Conv2d(3, 6, 2, stride=4, padding=2, dilation=3), 54),
        (3, 3, 8, 8),
        "mean",
    ),
    "conv3d_strided_padded": (
        lambda: relu_head(nn.Conv3d(3, 2, 2, dilation=1, padding=2, stride=3), 64),
        (3, 3, 2, 7, 7),
        "sum",
    ),
    "conv_transpose1d_dilated": (
        lambda: relu_head(nn.ConvTranspose1d(2, 3, 2, padding=0, dilation=5, stride=3), 72),
        (3, 2, 7),
        "sum",
    ),
    "conv_transpose2d": (lambda: relu_head(nn.ConvTranspose2d(3, 2, 2), 128), (3, 3, 7, 7), "mean"),
    # BackPACK's padding and pooling modules (test/test_problems_padding.py, ..._pooling.py)
    # between a convolution and the Linear, all piecewise linear too
    "padding_pooling": (
        lambda: nn.Sequential(
            nn.ZeroPad2d(1),
            nn.Conv2d(2, 3, 3),
            nn.MaxPool2d(2),
            nn.LeakyReLU(),
            nn.AvgPool2d(2),
            nn.Flatten(),
            nn.Linear(3, 5),
        ),
        (3, 2, 4, 4),
        "sum",
    ),  # fmt: skip
    "conv_transpose3d_no_bias": (
        lambda: relu_head(nn.ConvTranspose3d(3, 2, 2, bias=False), 384),
        (2, 3, 2, 7, 7),
        "mean",
    ),
}


def autograd_hessian_blocks(model: nn.Module, x: Tensor, loss) -> dict[str, Tensor]:
    """``{name: [numel, numel]}``: each parameter's block of the Hessian of
    ``loss(model(x))`` (``torch.func.hessian`` of the loss in that parameter, flattened, the
    others held)."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    blocks = {}
    for name, p in params.items():

        def of(flat, name=name, p=p):
            values = {**params, name: flat.view_as(p)}
            return loss(torch.func.functional_call(model, values, (x,)))

        blocks[name] = torch.func.hessian(of)(p.flatten())
    return blocks


def hess_of(model: nn.Module, x: Tensor, hess_type: str) -> dict[str, Tensor]:
    """autograd-hacks' recipe: ``backprop_hess`` of the output, then ``compute_hess``: each
    parameter's ``hess`` (of the batch's mean loss)."""
    gradhooks.add_hooks(model)
    try:
        gradhooks.backprop_hess(model(x), hess_type=hess_type)
        gradhooks.compute_hess(model)
    finally:
        gradhooks.remove_hooks(model)
    return {n: p.hess for n, p in model.named_parameters()}


@pytest.mark.parametrize("setting", DIAG_HESSIAN_SETTINGS)
def test_backpack_diag_hessian_of_piecewise_linear_problems(setting):
    """diag_hessian/test_diag_hessian.py ``test_diag_h`` on secondorder_settings.py's problems
    under ``CrossEntropyLoss`` (Linear, convolutions strided, padded and dilated, transposed,
    1-d to 3-d, each followed by ReLU and a Linear; zero padding, max- and average-pooling and
    LeakyReLU around a convolution): after piecewise-linear functions alone the loss's
    Hessian in each layer's parameters is the Gauss-Newton block, so ``param.hess`` (of the
    mean loss; times the batch for ``reduction="sum"``) is autograd's Hessian block, whose
    diagonal is BackPACK's ``DiagHessian``; the blocks are compared whole."""
    make, shape, reduction = DIAG_HESSIAN_SETTINGS[setting]
    torch.manual_seed(0)
    model = make().double()
    x = torch.rand(*shape, dtype=D)
    y = torch.randint(0, 5, (shape[0],))
    scale = 1.0 if reduction == "mean" else float(shape[0])
    got = hess_of(model, x, "CrossEntropy")
    want = autograd_hessian_blocks(
        model, x, lambda out: F.cross_entropy(out, y, reduction=reduction)
    )
    for n, block in want.items():
        assert_close(scale * got[n], block, f"{setting}: hess of {n}")
        assert_close(scale * got[n].diagonal(), block.diagonal(), f"{setting}: DiagHessian {n}")


def test_backpack_diag_hessian_sigmoid_regression():
    """secondorder_settings.py's regression problem, ``Linear(10, 7)``, ``Sigmoid``,
    ``Linear(7, 5)`` under ``MSELoss(reduction="mean")`` (the mean over the batch and the 5
    outputs, ``2/5`` of autograd-hacks' ``"LeastSquares"``, half the squared error averaged
    over the batch): the last layer's ``hess`` is the Hessian (nothing curved follows it);
    the first's is the Gauss-Newton block, without the terms through the sigmoid's curvature
    that BackPACK's ``DiagHessian`` adds (out of ``compute_hess``'s scope, as documented), and
    differs from the Hessian."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 7), nn.Sigmoid(), nn.Linear(7, 5)).double()
    x, target = torch.rand(3, 10, dtype=D), torch.rand(3, 5, dtype=D)
    got = hess_of(model, x, "LeastSquares")
    hessian = autograd_hessian_blocks(model, x, lambda out: F.mse_loss(out, target))
    for n in ("2.weight", "2.bias"):
        assert_close(2 / 5 * got[n], hessian[n], f"hess of {n}")
    params = {n: p.detach() for n, p in model.named_parameters()}
    for n in ("0.weight", "0.bias"):
        J = torch.func.jacrev(
            lambda w, n=n: torch.func.functional_call(model, {**params, n: w}, (x,))
        )(params[n]).reshape(3, 5, -1)
        ggn = 2 / 15 * torch.einsum("bop,boq->pq", J, J)  # the MSE's Hessian: 2/15 · I
        assert_close(2 / 5 * got[n], ggn, f"hess of {n}: the GGN")
        assert not torch.allclose(ggn, hessian[n], rtol=1e-4), n


# == dp-transformers: tests/test_layers.py ======================================================


class MergedLinear(nn.Linear):
    """loralib's ``MergedLinear`` (``loralib/layers.py``), which dp-transformers'
    ``DPMergedLinear`` is checked against, rewritten: an ``nn.Linear`` (frozen where LoRA is
    on; its bias trainable) whose forward adds, in place, ``x @ ΔWᵀ · alpha / r``, ``ΔW`` the
    LoRA update of the enabled parts of its output (q, k, v): ``lora_B`` applied to ``lora_A``
    by a grouped ``conv1d``, zero-padded to every output; ``fan_in_fan_out`` stores the weight
    ``[in, out]`` (GPT-2's ``Conv1D``); ``eval()`` merges ``ΔW`` into the weight
    (``merge_weights``), ``train()`` takes it out again. ``lora_B`` is drawn, not zero, so
    that every parameter has a gradient."""

    def __init__(
        self, in_features, out_features, r, lora_alpha, enable_lora, fan_in_fan_out=False,
        merge_weights=True, bias=True,
    ):  # fmt: skip
        super().__init__(in_features, out_features, bias=bias)
        self.r, self.enable_lora, self.fan_in_fan_out = r, list(enable_lora), fan_in_fan_out
        self.merge_weights, self.merged = merge_weights, False
        self.lora_dropout = nn.Identity()  # (lora_dropout=0)
        if r > 0 and any(enable_lora):
            parts = sum(enable_lora)
            self.lora_A = nn.Parameter(torch.empty(r * parts, in_features))
            self.lora_B = nn.Parameter(torch.randn(out_features // len(enable_lora) * parts, r))
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
            self.scaling = lora_alpha / r
            self.weight.requires_grad = False
            enabled = torch.zeros(
                len(enable_lora), out_features // len(enable_lora), dtype=torch.bool
            )
            enabled[torch.tensor(enable_lora)] = True
            self.register_buffer("lora_ind", enabled.flatten(), persistent=False)
        if fan_in_fan_out:
            self.weight.data = self.weight.data.T

    def lora(self) -> bool:
        return self.r > 0 and any(self.enable_lora)

    def T(self, w: Tensor) -> Tensor:
        return w.T if self.fan_in_fan_out else w

    def merge_AB(self) -> Tensor:
        delta = F.conv1d(
            self.lora_A[None], self.lora_B[..., None], groups=sum(self.enable_lora)
        ).squeeze(0)
        padded = delta.new_zeros(len(self.lora_ind), *delta.shape[1:])
        padded[self.lora_ind] = delta
        return self.T(padded)

    def train(self, mode: bool = True):
        super().train(mode)
        if self.lora() and self.merge_weights and mode == self.merged:
            sign = -1 if mode else 1
            self.weight.data += sign * self.merge_AB().detach() * self.scaling
            self.merged = not mode
        return self

    def forward(self, x):
        result = F.linear(x, self.T(self.weight), bias=self.bias)
        if self.lora() and not self.merged:
            result += self.lora_dropout(x) @ self.T(self.merge_AB().T) * self.scaling
        return result


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("fan_in_fan_out", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    "enable_lora,r,alpha",
    [([True, False, True], 3, 1), ([True, False, False], 3, 2), ([True, False, True], 0, 1)],
    ids=["q_v_r3", "q_r3_alpha2", "r0"],
)
def test_dp_transformers_merged_linear(enable_lora, r, alpha, bias, fan_in_fan_out, mode):
    """test_layers.py ``TestDPMergedLinear.test_equivalent_to_loralib`` over its settings
    (``enable_lora`` on q and v or q alone, ``r`` 3 or 0 (no LoRA: a plain Linear),
    ``alpha``, ``bias``, ``fan_in_fan_out``, which the peer marks as an expected failure,
    ``merge_weights`` in training and merged in eval), on ``[batch, 4, 8]`` inputs: each
    trainable parameter's ``grad1`` under each example's norm of its residual against the
    loop (the peer's loss, the norm of the whole batch's residual, is not a sum of
    per-example losses), and a DP step by every method (bound 1, no noise) against the loop's
    clipped mean. Merged, the LoRA matrices are unused (no ``.grad``, no ``grad1``); without a
    bias nothing trainable is left, and the hooked output requires no gradient. The weight's
    ``F.linear`` on the sequence is a view that the forward changes in place; its per-example
    gradients were missing (and the DP step refused) until the engine hooked that call as it
    hooks a layer's."""
    torch.manual_seed(0)
    model = MergedLinear(8, 24, r, alpha, enable_lora, fan_in_fan_out, bias=bias).double()
    model.train(mode == "train")
    x, y = torch.randn(5, 4, 8, dtype=D), torch.randn(5, 4, 24, dtype=D)
    if model.merged and not bias:  # the frozen merged weight alone: no gradient to take
        with gradhooks.add_hooks(model, loss_reduction="sum"):
            assert not model(x).requires_grad
        assert all(getattr(p, "grad1", None) is None for p in model.parameters())
        return

    def loss(out, target):
        return (out - target).flatten(1).norm(dim=1).sum()

    want = loop_grad(model, loss, x, y)
    loss(model(x), y).backward()  # (which parameters the loss reaches)
    reached = {n: g for n, g in want.items() if model.get_parameter(n).grad is not None}
    model.zero_grad()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        loss(model(x), y).backward()
    for n, p in model.named_parameters():
        if n in reached:
            assert_close(p.grad1, reached[n], f"grad1 of {n}")
        else:
            assert getattr(p, "grad1", None) is None and p.grad is None, n
    gradhooks.clear_grad1(model)

    flat = torch.cat([g.flatten(1) for g in reached.values()], 1)
    factors = (1.0 / flat.norm(dim=1)).clamp(max=1.0)
    for method in METHODS:
        model.zero_grad()
        quantities = ("grad1",) if method == "grad1" else ("norms",)
        with gradhooks.add_hooks(model, quantities=quantities) as h:
            losses = (model(x) - y).flatten(1).norm(dim=1)
            gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=0.0, method=method)
        for n, g in reached.items():
            clipped = torch.einsum("b,b...->...", factors, g) / len(x)
            assert_close(model.get_parameter(n).grad, clipped, f"DP step by {method}: {n}")
        gradhooks.clear_grad1(model)


# == the engine cases behind loralib's layer ====================================================


class LinearPlusInPlace(nn.Module):
    """The engine case behind loralib's layer: parameters of the module itself in
    ``F.linear`` (its ``forward`` hooked as the Linear rule's call), whose output on a
    sequence is a view, changed in place by the next line."""

    def __init__(self, change):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(3))
        self.other = nn.Parameter(torch.randn(3, 4))
        self.change = change

    def forward(self, x):
        out = F.linear(x, self.weight, self.bias)
        return self.change(out, x @ self.other.T)


def add_(out, d):
    out += d
    return out


def mul_(out, d):
    out *= d
    return out


def tanh_(out, d):
    return out.tanh_() + d


def slice_mul_(out, d):
    out[..., :2] *= 3
    return out + d


@pytest.mark.parametrize(
    "change", [add_, mul_, tanh_, slice_mul_], ids=["add_", "mul_", "tanh_", "slice_mul_"]
)
@pytest.mark.parametrize("shape", [(5, 4), (5, 6, 4)], ids=["flat", "sequence"])
def test_f_linear_output_changed_in_place(shape, change):
    """A parameter's ``F.linear`` whose output the forward changes in place (``+=``, ``*=``,
    ``tanh_``, ``*=`` on a slice of it): on ``[batch, in]`` and on ``[batch, 6, in]``, whose
    output is a view, every parameter's ``grad1`` is the loop's (on the sequence the weight's
    and bias's were missing, with a warning, and the DP step refused them)."""
    model = seeded(lambda: LinearPlusInPlace(change)).double()
    x = torch.randn(*shape, dtype=D)
    want = loop_grad(model, lambda out: out.square().sum(), x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        model(x).square().sum().backward()
    assert_grad1(model, want, f"{change.__name__} on {shape}")


class OwnLinear(nn.Module):
    """A custom layer that gives its own weight and bias to ``F.linear``, then (``inner``)
    applies a ``tanh`` in the same ``forward``, or leaves that to the next layer."""

    def __init__(self, inner: bool):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(6))
        self.inner = inner

    def forward(self, x):
        out = F.linear(x, self.weight, self.bias)
        return torch.tanh(out) if self.inner else out


class MeanOverPositions(nn.Module):
    def forward(self, x):
        return x.mean(1) if x.dim() == 3 else x


def own_and_twin(inner: bool) -> tuple[nn.Module, nn.Module]:
    """``OwnLinear`` then a Linear head (the outputs averaged over positions), and its twin
    of ``nn.Linear`` layers (the same numbers)."""
    torch.manual_seed(0)
    after = nn.Identity() if inner else nn.Tanh()
    own = nn.Sequential(OwnLinear(inner), after, nn.Linear(6, 3), MeanOverPositions())
    twin = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3), MeanOverPositions())
    twin.load_state_dict(own.state_dict())
    return own.double(), twin.double()


@pytest.mark.parametrize("fisher", ["exact", "empirical", "mc"])
@pytest.mark.parametrize("shape", [(8, 4), (4, 5, 4)], ids=["flat", "sequence"])
@pytest.mark.parametrize("inner", [True, False], ids=["tanh_inside", "tanh_after"])
def test_kfac_and_jacobians_of_a_weight_given_to_f_linear(inner, shape, fisher):
    """A weight its module gives to ``F.linear`` (as loralib's, kronfluence's and many custom
    layers do) has the Kronecker factors of an ``nn.Linear`` in its place, and its
    Jacobians are autograd's, also where the module applies more after ``F.linear`` (then
    ``gradhooks.kfac`` left the weight out without a word, ``gradhooks.KFAC`` stepped it
    unpreconditioned, and ``jacobians`` refused it), on ``[batch, in]`` and
    ``[batch, 5, in]``."""
    own, twin = own_and_twin(inner)
    x, y = torch.randn(*shape, dtype=D), torch.randint(3, shape[:1])
    got = gradhooks.kfac(own, x, y, fisher=fisher, generator=torch.Generator().manual_seed(1))
    want = gradhooks.kfac(twin, x, y, fisher=fisher, generator=torch.Generator().manual_seed(1))
    assert sorted(got) == sorted(want) == ["0.weight", "2.weight"]
    for n, f in want.items():
        assert_close(got[n].A, f.A, f"A of {n}")
        assert_close(got[n].G, f.G, f"G of {n}")
        assert got[n].bias_name == f.bias_name

    jac = gradhooks.jacobians(own, x)
    params = {n: p.detach() for n, p in own.named_parameters()}
    ref = torch.func.vmap(
        torch.func.jacrev(lambda p, xi: torch.func.functional_call(own, p, (xi[None],))[0]),
        in_dims=(None, 0),
    )(params, x)
    for n, r in ref.items():
        assert_close(jac[n], r.reshape(jac[n].shape), f"Jacobian of {n}")


def test_kfac_optimizer_preconditions_a_weight_given_to_f_linear():
    """``gradhooks.KFAC`` on the model whose first layer gives its weight to ``F.linear``
    then applies a ``tanh``: the same step as on its ``nn.Linear`` twin (the weight was
    stepped on its raw gradient, without a word)."""
    own, twin = own_and_twin(inner=True)
    x, y = torch.randn(8, 4, dtype=D), torch.randint(3, (8,))
    for model in (own, twin):
        opt = gradhooks.KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1), fisher="exact")
        F.cross_entropy(model(x), y).backward()
        opt.step(x)
    for (n, p), q in zip(own.named_parameters(), twin.parameters(), strict=True):
        assert_close(p, q, f"{n} after the step")

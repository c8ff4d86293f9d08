"""A sixth set of the cases that other projects check in their own test suites, written in
gradhooks' terms and compared with float64 references (``torch.func`` ``vmap(grad)`` /
``jacrev`` / ``hessian`` and per-example loops). The first five sets are
:mod:`test_peer_suites`, :mod:`test_peer_suites_more`, :mod:`test_peer_suites_third`,
:mod:`test_peer_suites_fourth` and :mod:`test_peer_suites_fifth`; this one adds:

- BackPACK (``test/core/derivatives/*_settings.py``): every convolution setting of its
  derivatives tests (1-d to 3-d, transposed, grouped, strided past the kernel, dilated, padded
  wider than the kernel), its Linear settings over extra dimensions, its Embedding, BatchNorm
  (in eval), LSTM and RNN settings, each layer's ``grad1``, norms and squared sums; the
  convolution rule's columns against its ``unfold_by_conv`` (``test/utils/test_conv.py``);
  its ``KFLR`` check that for one example the Kronecker factors are the layer's GGN block,
  on its batch-of-one networks, and the grouped convolutions its ``KFAC`` refuses, factored
  per group (``test/extensions/secondorder/hbp/``); the functional networks of its converter
  (``test/converter/converter_cases.py``); backwards on a retained graph and nothing kept
  after the last (``test/test_retain_graph.py``, ``test/extensions/graph_clear_test.py``);
- kfac-pytorch (``gpauloski/kfac-pytorch``: ``tests/layers/modules_test.py``,
  ``tests/layers/layers_test.py``, ``tests/training_test.py``): its ``LinearModuleHelper`` /
  ``Conv2dModuleHelper`` factors (patches scaled by the positions, a ones column for the bias)
  as gradhooks' factors rescaled, the merged ``[out, in·k·k + 1]`` gradient, its
  ``KFACEigenLayer`` preconditioning against ``kfac_precondition``, and its training schedule
  (factors every 5 steps, inverses every 10, running averages) against ``gradhooks.KFAC``;
- Opacus (``tests/module_validator_test.py``, ``tests/privacy_engine_validation_test.py``,
  ``tests/utils.py``, ``tests/accountants_test.py``): a BatchNorm without learnable
  parameters in training (which its validator accepts) refused, then the model after
  ``convert_batch_norm`` (its ``ModuleValidator.fix``, with and without ``num_groups``); the
  modules of its validation tests through a DP step by every clipping method; the
  accountant's ``state_dict`` / ``load_state_dict``;
- dp-transformers (``tests/test_dp_utils.py``): the noise multiplier for a privacy budget.

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
from torch.func import functional_call, hessian, jacrev

import gradhooks
from gradhooks.oracle import vmap_grad
from harness import assert_close, assert_grad1, seeded, sq

D = torch.float64


def trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def check_quantities(model: nn.Module, x, loss=sq, target=None) -> None:
    """``grad1``, per-parameter norms and squared sums of a sum-reduced ``loss`` against
    ``vmap(grad)``."""
    want = vmap_grad(model, loss, x, target)
    with gradhooks.add_hooks(
        model, loss_reduction="sum", quantities=("grad1", "norms", "sum_grad_sq")
    ) as h:
        loss(model(x), target).backward()
        norms, sums = h.param_norms(), h.sum_grad_sq()
    assert_grad1(model, want, "grad1")
    for n in trainable(model):
        assert_close(norms[n], want[n].flatten(1).norm(dim=1), f"norms of {n}")
        assert_close(sums[n], want[n].pow(2).sum(0), f"squared sums of {n}")


# == BackPACK: test/core/derivatives/*_settings.py ================================================

# (layer, positional arguments, keyword arguments, input shape): convolution_settings.py
CONVOLUTIONS = [
    (nn.Conv2d, (2, 3, 2), dict(bias=False, padding=1, stride=2, dilation=2), (3, 2, 7, 7)),
    (nn.Conv1d, (3, 9, 2), dict(padding=1, bias=False, groups=3), (3, 3, 7)),
    (nn.Conv1d, (6, 9, 2), dict(padding=1, bias=False, groups=3), (3, 6, 7)),
    (nn.Conv1d, (4, 8, 2), dict(padding=1, bias=False, groups=4), (3, 4, 7)),
    (nn.Conv1d, (2, 3, 2), dict(padding=1, bias=False), (3, 2, 7)),
    (nn.Conv1d, (3, 6, 2), dict(padding=2, stride=4, dilation=3), (1, 3, 8)),
    (nn.Conv1d, (3, 6, 2), dict(padding=2, stride=4, dilation=3, groups=3), (1, 3, 8)),
    (nn.Conv1d, (2, 3, 2), dict(padding=1, groups=1), (3, 2, 11)),
    (nn.Conv2d, (2, 4, 2), dict(padding=1, groups=2), (3, 2, 7, 7)),
    (nn.Conv2d, (4, 4, 2), dict(padding=1, groups=2), (3, 4, 7, 7)),
    (nn.Conv2d, (6, 9, 2), dict(padding=1, groups=3), (3, 6, 7, 7)),
    (nn.Conv2d, (4, 12, 2), dict(padding=1, groups=4), (3, 4, 7, 7)),
    (nn.Conv2d, (2, 4, 2), dict(padding=2, stride=4, dilation=3, groups=2), (1, 2, 8, 8)),
    (nn.Conv2d, (3, 6, 2), dict(padding=2, stride=4, dilation=3), (1, 3, 8, 8)),
    (nn.Conv2d, (2, 3, 2), dict(padding=1, groups=1), (3, 2, 7, 7)),
    (nn.Conv3d, (2, 4, 2), dict(groups=2), (3, 2, 5, 7, 7)),
    (nn.Conv3d, (3, 6, 2), dict(groups=3), (3, 3, 5, 7, 7)),
    (nn.Conv3d, (2, 3, 2), dict(padding=2, bias=False, dilation=2, stride=2), (3, 2, 5, 7, 7)),
    (nn.Conv3d, (3, 6, 2), dict(padding=2, stride=4), (1, 3, 3, 4, 4)),
    (nn.Conv3d, (2, 3, 2), dict(padding=1, groups=1), (3, 2, 3, 7, 7)),
    (nn.ConvTranspose1d, (2, 3, 2), dict(padding=1, bias=False), (3, 2, 7)),
    (nn.ConvTranspose1d, (3, 6, 2), dict(padding=2, stride=4, dilation=3), (1, 3, 8)),
    (nn.ConvTranspose1d, (2, 3, 2), dict(padding=1, groups=1), (3, 2, 11)),
    (
        nn.ConvTranspose2d,
        (2, 3, 2),
        dict(bias=False, padding=1, stride=2, dilation=2),
        (3, 2, 7, 7),
    ),
    (nn.ConvTranspose2d, (3, 6, 2), dict(padding=2, stride=4, dilation=3), (1, 3, 8, 8)),
    (nn.ConvTranspose2d, (2, 3, 2), dict(padding=1, groups=1), (3, 2, 7, 7)),
    (
        nn.ConvTranspose3d,
        (2, 3, 2),
        dict(padding=2, bias=False, dilation=2, stride=2),
        (3, 2, 5, 7, 7),
    ),
    (nn.ConvTranspose3d, (3, 6, 2), dict(padding=2, stride=4), (1, 3, 3, 4, 4)),
    (nn.ConvTranspose3d, (2, 3, 2), dict(padding=1, groups=1), (3, 2, 3, 7, 7)),
    (nn.Conv1d, (2, 3, 2), dict(padding=0, dilation=2, groups=1), (3, 2, 7)),
    (nn.Conv2d, (2, 3, 2), dict(padding=0, dilation=2, groups=1), (3, 2, 7, 7)),
    (nn.Conv3d, (2, 3, 2), dict(padding=0, dilation=2, groups=1), (3, 2, 3, 7, 7)),
    (nn.ConvTranspose1d, (2, 3, 2), dict(padding=0, stride=3, dilation=5, groups=1), (3, 2, 20)),
    (nn.ConvTranspose2d, (2, 4, 2), dict(padding=0, dilation=2, groups=1), (3, 2, 9, 9)),
    (nn.ConvTranspose3d, (2, 4, 2), dict(padding=0, dilation=2, groups=1), (3, 2, 9, 9, 9)),
    (nn.Conv1d, (4, 6, 2), dict(padding=0, dilation=2, groups=2), (3, 4, 7)),
    (nn.Conv2d, (4, 6, 2), dict(padding=0, dilation=2, groups=2), (3, 4, 7, 7)),
    (nn.Conv3d, (4, 6, 2), dict(padding=0, dilation=2, groups=2), (3, 4, 3, 7, 7)),
    (nn.Conv1d, (6, 9, 2), dict(padding=0, dilation=2, groups=3), (3, 6, 7)),
    (nn.Conv2d, (6, 9, 2), dict(padding=0, dilation=2, groups=3), (3, 6, 7, 7)),
    (nn.Conv3d, (6, 9, 2), dict(padding=0, dilation=2, groups=3), (3, 6, 3, 7, 7)),
    (nn.ConvTranspose1d, (6, 9, 2), dict(padding=0, dilation=2, groups=3), (3, 6, 7)),
    (nn.ConvTranspose2d, (6, 9, 2), dict(padding=0, dilation=2, groups=3), (3, 6, 7, 7)),
    (nn.ConvTranspose3d, (6, 9, 2), dict(padding=0, dilation=2, groups=3), (3, 6, 3, 7, 7)),
    (nn.ConvTranspose1d, (4, 6, 2), dict(padding=0, dilation=2, groups=2), (3, 4, 7)),
    (nn.ConvTranspose2d, (4, 6, 2), dict(padding=0, dilation=2, groups=2), (3, 4, 7, 7)),
    (nn.ConvTranspose3d, (4, 6, 2), dict(padding=0, dilation=2, groups=2), (3, 4, 3, 7, 7)),
]


def conv_id(setting) -> str:
    layer, args, kw, shape = setting
    opts = ",".join(f"{k}={v}" for k, v in kw.items())
    return f"{layer.__name__}{args}[{opts}]{list(shape)}"


@pytest.mark.parametrize("setting", CONVOLUTIONS, ids=[conv_id(s) for s in CONVOLUTIONS])
def test_backpack_derivatives_convolution_settings(setting):
    """BackPACK's convolution settings (``test/core/derivatives/convolution_settings.py``,
    each layer's derivatives and ``batch_grad``): 1-d to 3-d convolutions and transposed
    convolutions, grouped, strided by more than the kernel (``stride=4``: positions no kernel
    reads), dilated, padded by more than the kernel, on batches of 3 and of 1; ``grad1``,
    norms and squared sums against ``vmap(grad)``."""
    layer, args, kw, shape = setting
    model = seeded(lambda: layer(*args, **kw)).to(D)
    torch.manual_seed(1)
    check_quantities(model, torch.rand(shape, dtype=D))


class Output(nn.Module):
    """A recurrent layer's output sequence alone (BackPACK's derivatives of ``output[0]``)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x)[0]


def batch_norm_eval(layer: nn.Module) -> nn.Module:
    """BackPACK's ``initialize_batch_norm_eval`` (``test/utils/evaluation_mode.py``): random
    running statistics and affine parameters, in eval mode."""
    with torch.no_grad():
        layer.running_mean.uniform_()
        layer.running_var.uniform_()
        layer.weight.uniform_()
        layer.bias.uniform_()
    return layer.eval()


OTHER_LAYERS = {  # (layer factory, input factory)
    "linear": (lambda: nn.Linear(5, 3), lambda: torch.rand(10, 5)),
    "linear-no-bias": (lambda: nn.Linear(7, 3, bias=False), lambda: torch.rand(12, 7)),
    "linear-11-10": (lambda: nn.Linear(11, 10), lambda: torch.rand(6, 11)),
    "linear-large-inputs": (
        lambda: nn.Linear(3, 2),
        lambda: torch.tensor([(-1, 43, 1.3), (-2, -0.3, 2.3), (0, -4, 0.33)]),
    ),
    "linear-one-additional": (lambda: nn.Linear(4, 3), lambda: torch.rand(3, 2, 4)),
    "linear-two-additional": (lambda: nn.Linear(4, 3), lambda: torch.rand(3, 2, 3, 4)),
    "linear-three-additional": (lambda: nn.Linear(4, 3), lambda: torch.rand(3, 2, 3, 5, 4)),
    "embedding-of-scalars": (lambda: nn.Embedding(3, 5), lambda: torch.randint(0, 3, (4,))),
    "embedding-3x3": (lambda: nn.Embedding(5, 7), lambda: torch.randint(0, 5, (8, 3, 3))),
    "batch-norm-1d-eval": (
        lambda: batch_norm_eval(nn.BatchNorm1d(7)),
        lambda: torch.rand(5, 7),
    ),
    "batch-norm-1d-sequence-eval": (
        lambda: batch_norm_eval(nn.BatchNorm1d(7)),
        lambda: torch.rand(5, 7, 4),
    ),
    "batch-norm-2d-eval": (
        lambda: batch_norm_eval(nn.BatchNorm2d(7)),
        lambda: torch.rand(5, 7, 3, 4),
    ),
    "batch-norm-3d-eval": (
        lambda: batch_norm_eval(nn.BatchNorm3d(7)),
        lambda: torch.rand(5, 7, 3, 4, 2),
    ),
    "lstm": (lambda: Output(nn.LSTM(4, 3, batch_first=True)), lambda: torch.rand(3, 5, 4)),
    "rnn": (lambda: Output(nn.RNN(4, 3, batch_first=True)), lambda: torch.rand(3, 5, 4)),
}


@pytest.mark.parametrize("name", OTHER_LAYERS)
def test_backpack_derivatives_layer_settings(name):
    """BackPACK's other layer settings (``test/core/derivatives/linear_settings.py``,
    ``embedding_settings.py``, ``batch_norm_settings.py`` in eval, ``lstm_settings.py``,
    ``rnn_settings.py``): Linear over up to three extra dimensions and on inputs of very
    different magnitudes, an Embedding of one index per example and of ``[3, 3]`` indices,
    BatchNorm in eval with random running statistics on every input rank, a batch-first LSTM
    and RNN; ``grad1``, norms and squared sums against ``vmap(grad)``."""
    make_layer, make_input = OTHER_LAYERS[name]
    model = seeded(make_layer).to(D)
    torch.manual_seed(1)
    x = make_input()
    check_quantities(model, x.to(D) if x.is_floating_point() else x)


# == BackPACK: test/extensions/secondorder/hbp (KFLR, KFAC) =========================================


class Scale(nn.Module):
    """BackPACK's ``ScaleModule`` (``backpack/custom_module/scale_module.py``)."""

    def __init__(self, weight: float):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return self.weight * x


class Parallel(nn.Module):
    """BackPACK's ``Parallel`` (``backpack/custom_module/branching.py``): the sum of the
    branches."""

    def __init__(self, *branches: nn.Module):
        super().__init__()
        self.branches = nn.ModuleList(branches)

    def forward(self, x):
        return sum(branch(x) for branch in self.branches)


def mse(out, target):
    return F.mse_loss(out, target, reduction="sum")


def cross_entropy(out, target):
    return F.cross_entropy(out, target, reduction="sum")


def bce_with_logits(out, target):
    return F.binary_cross_entropy_with_logits(out, target, reduction="sum")


def regression(shape):
    return lambda: torch.rand(shape, dtype=D)


def labels(classes):
    return lambda: torch.randint(classes, (1,))


def binary(shape):
    return lambda: torch.randint(2, shape).to(D)


BATCH_OF_ONE = {  # (network, input shape, loss, target): kfac_settings.py, batch size 1
    "mlp-relu-mse": (
        lambda: nn.Sequential(nn.Linear(7, 3), nn.ReLU(), nn.Linear(3, 1)),
        (1, 7), mse, regression((1, 1)),
    ),
    "mlp-sigmoid-cross-entropy": (
        lambda: nn.Sequential(nn.Linear(5, 4), nn.Sigmoid(), nn.Linear(4, 3)),
        (1, 5), cross_entropy, labels(3),
    ),
    "bce-non-binary-labels": (
        lambda: nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 1)),
        (1, 6), bce_with_logits, regression((1, 1)),
    ),
    "bce-binary-labels": (
        lambda: nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 1)),
        (1, 6), bce_with_logits, binary((1, 1)),
    ),
    "conv1d-single-output": (
        lambda: nn.Sequential(nn.Conv1d(2, 4, 4), nn.ReLU(), nn.Conv1d(4, 1, 1), nn.Flatten()),
        (1, 2, 4), mse, regression((1, 1)),
    ),
    "conv2d-single-output": (
        lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Conv2d(4, 1, 1), nn.Flatten()),
        (1, 2, 3, 3), mse, regression((1, 1)),
    ),
    "conv3d-single-output": (
        lambda: nn.Sequential(nn.Conv3d(2, 3, 3), nn.ReLU(), nn.Conv3d(3, 1, 1), nn.Flatten()),
        (1, 2, 3, 3, 3), mse, regression((1, 1)),
    ),
    "convtranspose1d-single-output": (
        lambda: nn.Sequential(
            nn.ConvTranspose1d(2, 4, 3, padding=5), nn.Sigmoid(),
            nn.ConvTranspose1d(4, 1, 1), nn.Flatten(),
        ),
        (1, 2, 9), mse, regression((1, 1)),
    ),
    "convtranspose2d-single-output": (
        lambda: nn.Sequential(
            nn.ConvTranspose2d(2, 3, 2, padding=2), nn.Sigmoid(),
            nn.ConvTranspose2d(3, 1, 1), nn.Flatten(),
        ),
        (1, 2, 4, 4), mse, regression((1, 1)),
    ),
    "convtranspose3d-single-output": (
        lambda: nn.Sequential(
            nn.ConvTranspose3d(2, 4, 2, padding=3), nn.Sigmoid(),
            nn.ConvTranspose3d(4, 1, 1), nn.Flatten(),
        ),
        (1, 2, 6, 6, 6), mse, regression((1, 1)),
    ),
    "branching-linear": (
        lambda: nn.Sequential(
            nn.Linear(10, 5), nn.ReLU(), Parallel(nn.Identity(), nn.Linear(5, 5)),
            nn.Sigmoid(), nn.Linear(5, 4),
        ),
        (1, 10), cross_entropy, labels(4),
    ),
    "branching-scale": (
        lambda: nn.Sequential(
            nn.Linear(10, 5), nn.ReLU(), Parallel(Scale(3.0), nn.Linear(5, 5)),
            nn.Sigmoid(), nn.Linear(5, 4),
        ),
        (1, 10), cross_entropy, labels(4),
    ),
}  # fmt: skip


def ggn_blocks(model: nn.Module, x: Tensor, loss, target: Tensor, factors) -> dict:
    """For each factored weight, the GGN ``Jᵀ H J`` of ``cat([W, b[:, None]], 1)`` (the
    weight as the factors' matrix: ``[out, in·k]``, or ``W.transpose(0, 1)`` for a transposed
    convolution) flattened, ``J`` the Jacobian of the flattened output and ``H`` the loss's
    Hessian with respect to it (``torch.func``)."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    out = model(x).detach()

    def flat_output(ps):
        return functional_call(model, ps, (x,)).flatten()

    J = jacrev(flat_output)(params)  # {name: [outputs, *shape]}
    H = hessian(lambda o: loss(o.reshape(out.shape), target))(out.flatten())
    blocks = {}
    for name, f in factors.items():
        JW = J[name]
        if f.layout == "in_out":
            JW = JW.transpose(1, 2)
        JW = JW.reshape(JW.shape[0], JW.shape[1], -1)  # [outputs, out, in·k]
        if f.bias:
            JW = torch.cat([JW, J[f.bias_name][..., None]], 2)
        Jt = JW.flatten(1)
        blocks[name] = Jt.T @ H @ Jt
    return blocks


@pytest.mark.parametrize("name", BATCH_OF_ONE)
def test_backpack_kflr_of_one_example_is_its_ggn_block(name):
    """BackPACK's ``test_kflr_equals_ggn`` (``test/extensions/secondorder/hbp/test_kflr.py``
    on ``kfac_settings.py``'s batch-of-one networks; its ``test_kfac_should_approx_ggn_
    montecarlo`` checks the Monte-Carlo ``KFAC`` against the same): for one example, a layer
    without weight sharing (a Linear; a convolution or transposed convolution whose output
    has one position) has ``kron(G, A)`` equal to its block of the GGN, exactly. gradhooks'
    ``fisher="exact"`` factors (bias column included, so the block is the weight's and bias's
    together) against ``Jᵀ H J`` by ``torch.func``, for MSE, cross-entropy, BCE with logits
    on binary and non-binary labels, and through skip connections."""
    make_model, shape, loss, make_target = BATCH_OF_ONE[name]
    model = seeded(make_model).to(D)
    torch.manual_seed(1)
    x, target = torch.rand(shape, dtype=D), make_target()
    factors = gradhooks.kfac(model, x, target, fisher="exact", loss=loss, reduction="sum")
    weights = {n for n, p in model.named_parameters() if p.dim() > 1}
    assert set(factors) == weights, "every weight is factored"
    for n, block in ggn_blocks(model, x, loss, target, factors).items():
        f = factors[n]
        assert_close(torch.kron(f.G, f.A), block, f"{name}: kron(G, A) of {n}")


# == kfac-pytorch: tests/layers/modules_test.py, tests/layers/layers_test.py ===========================


def captured(model: nn.Module, layer: nn.Module, x: Tensor, loss) -> tuple[Tensor, Tensor]:
    """The input of ``layer`` and the gradient of the batch's ``loss`` with respect to its
    output, as kfac-pytorch's module hooks save them (a forward of ``model`` without
    gradhooks)."""
    seen = {}
    handle = layer.register_forward_hook(lambda m, inputs, out: seen.update(a=inputs[0], y=out))
    try:
        out = model(x)
    finally:
        handle.remove()
    (g,) = torch.autograd.grad(loss(out), seen["y"])
    return seen["a"].detach(), g


def kfac_pytorch_factors(layer: nn.Module, a: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """kfac-pytorch's ``get_a_factor`` / ``get_g_factor`` (``kfac/layers/modules.py``, with
    ``get_cov`` and ``append_bias_ones`` of ``kfac/layers/utils.py``), rewritten: a Linear's
    rows as they are; a Conv2d's patches (``[batch, out_h, out_w, in·kh·kw]``, padded, strided)
    and output-gradients as rows, each divided by the output positions; ``A = aᵀa / rows``,
    ``G = gᵀg / rows``."""
    if isinstance(layer, nn.Conv2d):
        positions = g.shape[2] * g.shape[3]
        ph, pw = layer.padding
        patches = F.pad(a, (pw, pw, ph, ph))
        patches = patches.unfold(2, layer.kernel_size[0], layer.stride[0])
        patches = patches.unfold(3, layer.kernel_size[1], layer.stride[1])
        a = patches.permute(0, 2, 3, 1, 4, 5).reshape(-1, patches[0, :, 0, 0].numel())
        g = g.permute(0, 2, 3, 1).reshape(-1, g.shape[1])
    else:
        positions = 1
        a, g = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
    if layer.bias is not None:
        a = torch.cat([a, a.new_ones(a.shape[0], 1)], 1)
    a, g = a / positions, g / positions
    return a.T @ a / a.shape[0], g.T @ g / g.shape[0]


MODULE_HELPERS = {  # modules_test.py's parameters
    "conv-k2-s1-p0-bias": (lambda: nn.Conv2d(3, 5, 2, 1, 0), (4, 3, 10, 10)),
    "conv-k3-s2-p1-no-bias": (lambda: nn.Conv2d(3, 5, 3, 2, 1, bias=False), (4, 3, 10, 10)),
    "linear-bias": (lambda: nn.Linear(5, 3), (4, 5)),
    "linear-no-bias": (lambda: nn.Linear(5, 3, bias=False), (4, 5)),
}


@pytest.mark.parametrize("name", MODULE_HELPERS)
def test_kfac_pytorch_module_helper_factors(name):
    """kfac-pytorch's ``test_conv2d_module`` / ``test_linear_module``
    (``tests/layers/modules_test.py``): the factors' shapes (``in·k·k + bias`` and ``out``)
    and the merged gradient ``[out, in·k·k + 1]`` (bias last), and the factors themselves by
    its recipe on the layer's saved input and output-gradient. Its scalings in gradhooks'
    terms (a sum-reduced loss, whose output-gradients are each example's own; ``S`` output
    positions, ``B`` examples): ``A = A_gradhooks / S²``, ``G = G_gradhooks("sum") / (B·S³)``,
    gradhooks' ``expand`` convention (positions as examples). Its loss, ``(out -
    target).sum()``, has the same output-gradient for every position; a squared error here."""
    make_layer, shape = MODULE_HELPERS[name]
    layer = seeded(make_layer).to(D)
    torch.manual_seed(1)
    x = torch.rand(shape, dtype=D)
    target = torch.rand_like(layer(x))

    def loss(out, t=target):
        return (out - t).pow(2).sum()

    factors = gradhooks.kfac(layer, x, target, fisher="empirical", loss=loss, reduction="sum")
    f = factors["weight"]
    bias = layer.bias is not None
    in_features = layer.weight[0].numel()
    assert f.bias == bias and f.A.shape == (in_features + bias,) * 2
    assert f.G.shape == (layer.weight.shape[0],) * 2

    A, G = kfac_pytorch_factors(layer, *captured(layer, layer, x, loss))
    S, B = target[0, 0].numel() if target.dim() > 2 else 1, shape[0]
    assert_close(f.A / S**2, A, f"{name}: A")
    assert_close(f.G / (B * S**3), G, f"{name}: G")

    loss(layer(x)).backward()
    merged = layer.weight.grad.flatten(1).clone()  # (preconditioned in place below)
    if bias:
        merged = torch.cat([merged, layer.bias.grad[:, None]], 1)
    assert merged.shape == (layer.weight.shape[0], in_features + bias)
    gradhooks.kfac_precondition(layer, factors, damping=1e-3)
    inverse = f.inverse(damping=1e-3)
    got = layer.weight.grad.flatten(1)
    if bias:
        got = torch.cat([got, layer.bias.grad[:, None]], 1)
    assert_close(got, inverse.apply(merged), f"{name}: the merged gradient, preconditioned")


class KfacNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, stride=2, padding=1)
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x):
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


def test_kfac_pytorch_eigen_layer_preconditioning_is_the_damped_solve():
    """kfac-pytorch's ``test_preconditioning_step`` for ``KFACEigenLayer``
    (``tests/layers/layers_test.py``; ``kfac/layers/eigen.py``): the merged gradient
    ``[out, in + 1]`` preconditioned in the eigenbases of the factors, ``QG ((QGᵀ grad QA) /
    (dG dAᵀ + λ)) QAᵀ``, the exact solve of ``(kron(G, A) + λI) vec = vec(grad)``; with
    ``prediv_eigenvalues`` the same numbers. ``kfac_precondition`` against it for a
    convolution and a Linear (the gradient changes, as its test asserts)."""
    model = seeded(KfacNet).to(D)
    torch.manual_seed(1)
    x, y = torch.randn(6, 2, 8, 8, dtype=D), torch.randint(5, (6,))
    damping = 1e-2
    factors = gradhooks.kfac(model, x, fisher="exact")
    F.cross_entropy(model(x), y).backward()
    merged = {
        n: torch.cat([m.weight.grad.flatten(1), m.bias.grad[:, None]], 1)
        for n, m in [("conv", model.conv), ("fc", model.fc)]
    }
    want = {}
    for n, grad in merged.items():
        f = factors[f"{n}.weight"]
        dA, QA = torch.linalg.eigh(f.A)
        dG, QG = torch.linalg.eigh(f.G)
        v1 = QG.T @ grad @ QA
        want[n] = QG @ (v1 / (dG[:, None] * dA[None, :] + damping)) @ QA.T
        prediv = QG @ (v1 * (1 / (dG[:, None] * dA[None, :] + damping))) @ QA.T
        assert_close(prediv, want[n], f"{n}: prediv_eigenvalues")
    gradhooks.kfac_precondition(model, factors, damping=damping)
    for n, m in [("conv", model.conv), ("fc", model.fc)]:
        got = torch.cat([m.weight.grad.flatten(1), m.bias.grad[:, None]], 1)
        assert not torch.allclose(got, merged[n]), f"{n}: the gradient changed"
        assert_close(got, want[n], f"{n}: preconditioned gradient")


# == Opacus: tests/module_validator_test.py, tests/privacy_engine_validation_test.py =============


class NonLearnableBN(nn.Module):
    """Opacus' ``SampleNetWithNonLearnableBN`` (``test_is_valid_non_learnable_bn``): a batch
    norm whose affine parameters are frozen and one without (``affine=False``), each after a
    convolution (its second convolution's input channels made to fit the first's output)."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(8, 3, 4, 4)
        self.b1 = nn.BatchNorm2d(3)
        self.c2 = nn.Conv2d(3, 3, 1)
        self.b2 = nn.BatchNorm2d(3, affine=False)
        self.b1.requires_grad_(False)

    def forward(self, x):
        return self.b2(self.c2(self.b1(self.c1(x)))).flatten(1)


def test_opacus_batch_norm_without_learnable_parameters_still_mixes_the_examples():
    """Opacus' ``ModuleValidator`` accepts a model whose batch norms have nothing to learn
    (``module_validator_test.py``, ``test_is_valid_non_learnable_bn``), but in training they
    normalize each example by the batch's statistics, so the convolutions' per-example
    gradients do not exist: gradhooks refuses the backward, naming the batch norm. In eval
    mode, and after ``convert_batch_norm`` (Opacus' ``ModuleValidator.fix``: a group norm in
    each place, ``affine`` kept), ``grad1`` is the oracle's."""
    model = seeded(NonLearnableBN).to(D)
    torch.manual_seed(1)
    x = torch.randn(6, 8, 8, 8, dtype=D)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with pytest.raises(gradhooks.MixedExamplesError, match="b1"):
            sq(model(x)).backward()
    model.zero_grad()
    gradhooks.clear_grad1(model)

    model.eval()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(x)).backward()
    assert_grad1(model, vmap_grad(model, sq, x, None), "eval", frozen_clean=True)

    model.train()
    gradhooks.clear_grad1(model)
    gradhooks.convert_batch_norm(model)
    assert isinstance(model.b1, nn.GroupNorm) and isinstance(model.b2, nn.GroupNorm)
    assert model.b2.weight is None and not model.b1.weight.requires_grad
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(x)).backward()
    assert_grad1(model, vmap_grad(model, sq, x, None), "converted", frozen_clean=True)


@pytest.mark.parametrize("num_groups, want", [(None, 16), (4, 4), (5, None)])
def test_opacus_fix_batch_norm_with_a_number_of_groups(num_groups, want):
    """Opacus' ``test_fix_bn_with_args`` (``module_validator_test.py``): a ``BatchNorm2d(16)``
    becomes a ``GroupNorm`` of 16 groups by default (``gcd(32, 16)``) or of the
    ``num_groups`` asked; one that does not divide the channels is refused, with nothing
    changed. (Its ``replace_bn_with_in=True``, an ``InstanceNorm2d``, gradhooks does not
    offer.) The converted layer's ``grad1`` is the oracle's."""
    model = nn.Sequential()
    model.add_module("fc", nn.Linear(4, 8))
    model.add_module("bn", nn.BatchNorm2d(16))
    model = model.to(D)
    if want is None:
        with pytest.raises(gradhooks.ConfigurationError, match="num_groups"):
            gradhooks.convert_batch_norm(model, num_groups=num_groups)
        assert isinstance(model.bn, nn.BatchNorm2d), "nothing changed"
        return
    gradhooks.convert_batch_norm(model, num_groups=num_groups)
    assert isinstance(model.bn, nn.GroupNorm) and model.bn.num_groups == want
    norm = model.bn
    with torch.no_grad():
        norm.weight.uniform_()
        norm.bias.uniform_()
    torch.manual_seed(1)
    x = torch.randn(3, 16, 4, 5, dtype=D)
    with gradhooks.add_hooks(norm, loss_reduction="sum"):
        sq(norm(x).pow(2)).backward()
    assert_grad1(norm, vmap_grad(norm, lambda o, t=None: sq(o.pow(2)), x, None), f"{want} groups")


class BasicSupportedModule(nn.Module):
    """Opacus' ``BasicSupportedModule`` (``tests/utils.py``): a Conv1d, a GroupNorm, a Linear
    over the last dimension and a LayerNorm over the last two, on ``[batch, 16, 5]``."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(16, 8, 2)
        self.gn = nn.GroupNorm(2, 8)
        self.fc = nn.Linear(4, 8)
        self.ln = nn.LayerNorm([8, 8])

    def forward(self, x):
        return self.ln(self.fc(self.gn(self.conv(x))))


class CustomLinearModule(nn.Module):
    """Opacus' ``CustomLinearModule``: ``F.linear`` on its own ``_weight`` and ``_bias``."""

    def __init__(self, in_features: int = 5, out_features: int = 8):
        super().__init__()
        self._weight = nn.Parameter(torch.randn(out_features, in_features))
        self._bias = nn.Parameter(torch.randn(out_features))

    def forward(self, x):
        return F.linear(x, self._weight, self._bias)


class MatmulModule(nn.Module):
    """Opacus' ``MatmulModule``: ``torch.matmul`` by a parameter ``[in, out]``, which its hooks
    mode hands to functorch and its ExpandedWeights mode refuses."""

    def __init__(self, input_features: int = 5, output_features: int = 8):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(input_features, output_features))

    def forward(self, x):
        return torch.matmul(x, self.weight)


class LinearWithExtraParam(nn.Module):
    """Opacus' ``LinearWithExtraParam``: a Linear, then ``matmul`` by a parameter of the
    parent module."""

    def __init__(self, in_features: int = 5, out_features: int = 8, hidden_dim: int = 8):
        super().__init__()
        self.fc = nn.Linear(in_features, hidden_dim)
        self.extra_param = nn.Parameter(torch.randn(hidden_dim, out_features))

    def forward(self, x):
        return self.fc(x).matmul(self.extra_param)


def frozen_extra() -> nn.Module:
    model = LinearWithExtraParam()
    model.extra_param.requires_grad_(False)
    return model


VALIDATION_MODULES = {
    "basic-supported": BasicSupportedModule,
    "custom-linear": CustomLinearModule,
    "matmul": MatmulModule,
    "extra-param": LinearWithExtraParam,
    "extra-param-frozen": frozen_extra,
}


@pytest.mark.parametrize("method", ["grad1", "bookkeeping", "ghost"])
@pytest.mark.parametrize("name", VALIDATION_MODULES)
def test_opacus_privacy_engine_validation_modules_dp_step(name, method):
    """Opacus' ``privacy_engine_validation_test.py`` runs ``make_private`` on the modules of
    its ``tests/utils.py`` (in hooks mode, ``MatmulModule`` and the extra parameter go to
    functorch; in ExpandedWeights mode ``MatmulModule`` fails at the forward; with the extra
    parameter frozen, hooks alone) on ``[batch, 16, 5]`` inputs. Here a DP step of each (no
    noise, a bound between the examples' norms) by every clipping method against the clipped
    mean of the per-example gradients by ``vmap(grad)``."""
    model = seeded(VALIDATION_MODULES[name]).to(D)
    torch.manual_seed(1)
    x = torch.randn(10, 16, 5, dtype=D)
    want = vmap_grad(model, sq, x, None)
    names = list(trainable(model))
    norms = torch.cat([want[n].flatten(1) for n in names], 1).norm(dim=1)
    C = norms.median().item()
    factors = (C / norms).clamp(max=1.0)
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        out = model(x)
        losses = 0.5 * out.pow(2).flatten(1).sum(1)
        got = gradhooks.dp_sgd_step(h, losses, max_norm=C, noise_multiplier=0.0, method=method)
    assert (norms > C).any() and (norms < C).any(), "both clipped and unclipped examples"
    assert_close(got, norms, f"{name}, {method}: norms")
    for n, p in model.named_parameters():
        if n not in names:
            assert p.grad is None, f"{name}: frozen {n} has a gradient"
            continue
        clipped = torch.einsum("b,b...->...", factors, want[n]) / len(x)
        assert_close(p.grad, clipped, f"{name}, {method}: clipped mean of {n}")


# == BackPACK: hbp's settings its KFAC / KFLR refuse (secondorder_settings.py) ====================

# GROUP_CONV_SETTINGS: (layer, arguments as BackPACK passes them, input shape)
GROUPED = {
    "conv1d": (nn.Conv1d, (6, 4, 2, 1, 0, 1, 2), (3, 6, 7)),
    "conv2d": (nn.Conv2d, (6, 3, 2, 1, 0, 1, 3), (3, 6, 7, 5)),
    "conv3d": (nn.Conv3d, (4, 2, 2, 1, 0, 2, 2), (3, 4, 7, 5, 6)),
    "convtranspose1d": (nn.ConvTranspose1d, (6, 3, 2, 4, 2, 0, 3, True, 3), (3, 6, 8)),
    "convtranspose2d": (nn.ConvTranspose2d, (4, 2, 2, 1, 0, 0, 2, True, 2), (3, 4, 9, 9)),
    "convtranspose3d": (
        nn.ConvTranspose3d, (4, 2, (2, 2, 1), 2, 2, 0, 2, True, 2), (3, 4, 3, 5, 5),
    ),
}  # fmt: skip


TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


class SplitGroups(nn.Module):
    """A grouped (transposed) convolution as one ungrouped layer per group, each on its
    group's input channels, their outputs concatenated: the same function."""

    def __init__(self, conv: nn.Module):
        super().__init__()
        g, transposed = conv.groups, isinstance(conv, TRANSPOSED)
        cin, cout = conv.in_channels // g, conv.out_channels // g
        self.cin, self.parts = cin, nn.ModuleList()
        for k in range(g):
            part = type(conv)(
                cin, cout, conv.kernel_size, conv.stride, conv.padding,
                **(dict(output_padding=conv.output_padding) if transposed else {}),
                dilation=conv.dilation, bias=conv.bias is not None, dtype=conv.weight.dtype,
            )  # fmt: skip
            rows = slice(k * cin, (k + 1) * cin) if transposed else slice(k * cout, (k + 1) * cout)
            with torch.no_grad():
                part.weight.copy_(conv.weight[rows])
                if conv.bias is not None:
                    part.bias.copy_(conv.bias[k * cout : (k + 1) * cout])
            self.parts.append(part)

    def forward(self, x):
        return torch.cat(
            [p(x[:, k * self.cin : (k + 1) * self.cin]) for k, p in enumerate(self.parts)], 1
        )


@pytest.mark.parametrize("name", GROUPED)
def test_backpack_kfac_of_grouped_convolutions_is_that_of_each_group(name):
    """BackPACK's ``KFAC`` / ``KFLR`` / ``KFRA`` refuse grouped convolutions
    (``test_kfac_not_supported`` on ``GROUP_CONV_SETTINGS``, ``test/extensions/secondorder/
    secondorder_settings.py``: a ReLU CNN with a frozen Linear head, cross-entropy summed).
    gradhooks factors each group (``A`` ``[groups, in/groups·k, ...]``, ``G`` ``[groups,
    out/groups, ...]``): the same network with the layer split into one convolution per group
    has, for each part, the factors of that group, for its settings (strided, dilated,
    transposed with a stride above the kernel)."""
    layer, args, shape = GROUPED[name]
    torch.manual_seed(0)
    conv = layer(*args).to(D)
    torch.manual_seed(1)
    x, y = torch.rand(shape, dtype=D), torch.randint(5, (shape[0],))
    features = conv(x)[0].numel()
    head = nn.Linear(features, 5).to(D).requires_grad_(False)
    grouped = nn.Sequential(conv, nn.ReLU(), nn.Flatten(), head)
    split = nn.Sequential(SplitGroups(conv), nn.ReLU(), nn.Flatten(), head)
    assert_close(split(x), grouped(x), "the split network is the same function")
    got = gradhooks.kfac(grouped, x, y, fisher="exact", reduction="sum")["0.weight"]
    parts = gradhooks.kfac(split, x, y, fisher="exact", reduction="sum")
    assert got.A.shape[0] == conv.groups
    for k in range(conv.groups):
        want = parts[f"0.parts.{k}.weight"]
        assert_close(got.A[k], want.A, f"{name}: A of group {k}")
        assert_close(got.G[k], want.G, f"{name}: G of group {k}")


# == BackPACK: test/converter/converter_cases.py =================================================


class InplaceActivation(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.relu, self.linear2 = (
            nn.Linear(3, 2),
            nn.ReLU(inplace=True),
            nn.Linear(2, 2),
        )

    def forward(self, x):
        return self.linear2(self.relu(self.linear(x)))


class MultipleUsages(nn.Module):
    """One parameter-free ReLU module used in three places."""

    def __init__(self):
        super().__init__()
        self.linear, self.relu, self.linear2 = nn.Linear(3, 2), nn.ReLU(), nn.Linear(2, 2)

    def forward(self, x):
        return self.relu(self.linear2(self.relu(self.linear(self.relu(x)))))


class FlattenNetwork(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.linear2 = nn.Linear(4, 3), nn.Linear(2 * 3, 3)

    def forward(self, x):
        return self.linear2(torch.flatten(self.linear(x), 2)).flatten(1)


class Multiply(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x):
        return (0.5 * self.linear(x * 2.5)).multiply(3.1415)


class Add(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.linear1, self.linear2 = nn.Linear(3, 3), nn.Linear(3, 2), nn.Linear(3, 2)

    def forward(self, x):
        x = self.linear(x)
        x1, x2 = self.linear1(x), self.linear2(x)
        return torch.relu(x1 + x2).add(x2)


class Permute(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.linear2 = nn.Linear(3, 2), nn.Linear(5, 2)

    def forward(self, x):
        return torch.permute(self.linear2(self.linear(x).permute(0, 2, 1)), (0, 2, 1))


class Transpose(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.linear2 = nn.Linear(3, 2), nn.Linear(5, 3)

    def forward(self, x):
        return torch.transpose(self.linear2(self.linear(x).transpose(1, 2)), 1, 2)


class TolstoiCharRNN(nn.Module):
    """Its character RNN (smaller): an Embedding, dropout, a two-layer LSTM (or RNN) whose
    input-hidden biases are zero and frozen, a Linear, the classes moved to dimension 1."""

    def __init__(self, rnn: type[nn.Module] = nn.LSTM):
        super().__init__()
        self.embedding, self.dropout = nn.Embedding(25, 16), nn.Dropout(0.2)
        self.lstm = rnn(16, 16, num_layers=2, dropout=0.36, batch_first=True)
        for name in ("bias_ih_l0", "bias_ih_l1"):
            bias = getattr(self.lstm, name)
            with torch.no_grad():
                bias.zero_()
            bias.requires_grad_(False)
        self.dense = nn.Linear(16, 25)

    def forward(self, x):
        x, _ = self.lstm(self.dropout(self.embedding(x)))
        return self.dense(self.dropout(x)).permute(0, 2, 1)


CONVERTER = {  # (network, input, classes-first cross-entropy or MSE)
    "inplace-activation": (InplaceActivation, lambda: torch.rand(3, 3, dtype=D), False),
    "multiple-usages": (MultipleUsages, lambda: torch.rand(3, 3, dtype=D), False),
    "flatten": (FlattenNetwork, lambda: torch.rand(3, 2, 2, 4, dtype=D), False),
    "multiply": (Multiply, lambda: torch.rand(2, 4, dtype=D), False),
    "add": (Add, lambda: torch.rand(3, 3, dtype=D), False),
    "permute": (Permute, lambda: torch.rand(3, 5, 3, dtype=D), True),
    "transpose": (Transpose, lambda: torch.rand(3, 5, 3, dtype=D), True),
    "tolstoi-lstm": (TolstoiCharRNN, lambda: torch.randint(0, 25, (4, 7)), True),
    "tolstoi-rnn": (lambda: TolstoiCharRNN(nn.RNN), lambda: torch.randint(0, 25, (4, 7)), True),
}


@pytest.mark.parametrize("name", CONVERTER)
def test_backpack_converter_networks(name):
    """BackPACK's converter cases (``test/converter/converter_cases.py``, ``test_converter.py``:
    networks written with torch functions and tensor methods, which BackPACK must first
    convert to modules): an in-place ReLU, one ReLU module used three times, ``flatten``,
    scalar multiplications, additions of branches, ``permute`` and ``transpose`` between
    Linears (a cross-entropy with the classes on dimension 1, per position), and its
    Tolstoi character LSTM and RNN (in eval: their dropout between layers is refused in
    training). gradhooks follows the batch through them as written; ``grad1`` against
    ``vmap(grad)`` under a summed MSE or cross-entropy. (Its ResNet-18 and wide ResNet-50
    cases need torchvision; a ResNet is in :mod:`test_peer_suites_more`.)"""
    make_model, make_input, classes_first = CONVERTER[name]
    model = seeded(make_model).to(D).eval()
    torch.manual_seed(1)
    x = make_input()
    out = model(x)
    if classes_first:
        target = torch.randint(out.shape[1], (out.shape[0], *out.shape[2:]))
        loss = cross_entropy
    else:
        target = torch.rand_like(out)
        loss = mse
    want = vmap_grad(model, loss, x, target)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        loss(model(x), target).backward()
    assert_grad1(model, want, name, frozen_clean=True)


# == Opacus: tests/accountants_test.py (state_dict, load_state_dict) ===============================


@pytest.mark.parametrize(
    "state",
    [
        {},
        {"1": 2},
        {"history": []},
        {"method": "pld", "history": []},
        {"method": "rdp"},
        {"method": "rdp", "history": None},
        {"method": "rdp", "history": [[1.5, 0.04]]},
        {"method": "rdp", "history": [[1.5, 0.04, 2.5]]},
    ],
    ids=["empty", "other-keys", "no-method", "other-method", "no-history", "history-none",
         "short-entry", "fractional-steps"],
)  # fmt: skip
def test_opacus_accountant_load_state_dict_refuses_what_is_not_its_checkpoint(state):
    """Opacus' ``test_accountant_load_state_dict`` (``tests/accountants_test.py``): loading
    ``{}``, ``{"1": 2}``, ``{"history": []}`` or another accountant's state raises a
    ``ValueError``. gradhooks' ``PrivacyAccountant.load_state_dict`` raises its
    ``ConfigurationError`` (a ``ValueError``) for those and for a checkpoint of the right
    method whose history is missing or malformed (an entry without its steps; a fractional
    number of steps, which ``int`` would have truncated, under-counting the privacy spent),
    and leaves the accountant's history as it was."""
    accountant = gradhooks.PrivacyAccountant()
    accountant.step(noise_multiplier=1.5, sample_rate=0.04, steps=10)
    with pytest.raises(gradhooks.ConfigurationError):
        accountant.load_state_dict(state)
    assert accountant.history == [(1.5, 0.04, 10)], "history unchanged"


def test_opacus_accountant_state_dict_round_trip_continues_the_run():
    """Opacus' ``test_accountant_state_dict`` and ``test_accountant_load_state_dict``: the
    state's history equals the accountant's but is not the same object (changing one leaves the
    other), a new accountant loaded from it reports the same ε, and going on recording after
    the load gives the ε of the whole run (σ = 1.5, q = 0.04, 2250 steps, 1000 of them after
    the checkpoint; against one accountant that recorded every step, and against
    dp-accounting's RDP accountant given the whole run)."""
    pytest.importorskip("dp_accounting")
    sigma, q, steps, delta = 1.5, 0.04, int(90 / 0.04), 1e-5
    first = gradhooks.PrivacyAccountant()
    first.step(noise_multiplier=sigma, sample_rate=q, steps=steps - 1000)
    state = first.state_dict()
    assert [tuple(e) for e in state["history"]] == first.history
    state["history"][0][2] += 1
    assert first.steps == steps - 1000, "the state is a copy"

    second = gradhooks.PrivacyAccountant()
    assert second.state_dict() != first.state_dict()
    second.load_state_dict(first.state_dict())
    assert second.epsilon(delta) == first.epsilon(delta)
    for _ in range(1000):
        second.step(noise_multiplier=sigma, sample_rate=q)
    whole = gradhooks.PrivacyAccountant()
    whole.step(noise_multiplier=sigma, sample_rate=q, steps=steps)
    assert second.history == whole.history == [(sigma, q, steps)]

    import dp_accounting

    reference = dp_accounting.rdp.RdpAccountant()
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    reference.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    assert second.epsilon(delta) == pytest.approx(reference.get_epsilon(delta), rel=1e-12)


# == BackPACK: test/test_retain_graph.py, test/extensions/graph_clear_test.py =====================


def test_backpack_retain_graph_per_component_gradients():
    """BackPACK's ``test_for_loop_replace`` (``test/test_retain_graph.py``): per-example
    gradients of each output component of a Linear ``[5, 3]``, one backward of
    ``A[:, i]`` per component on the retained graph, against autograd's gradient of each
    ``A[b, i]`` alone. ``grad1`` adds up over backwards like ``.grad``: ``zero_grad`` between
    components gives each component's; without it, the sum over the components."""
    torch.manual_seed(0)
    x, fc = torch.randn(5, 2, dtype=D), nn.Linear(2, 3).to(D)
    A = fc(x)
    want = torch.stack([
        torch.stack([torch.autograd.grad(A[b, i], fc.weight, retain_graph=True)[0] for i in range(3)])
        for b in range(5)
    ])  # fmt: skip
    got = torch.zeros_like(want)
    with gradhooks.add_hooks(fc, loss_reduction="sum"):
        A = fc(x)
        for i in range(3):
            fc.zero_grad()
            A[:, i].backward(torch.ones_like(A[:, i]), retain_graph=True)
            got[:, i] = fc.weight.grad1
        assert_close(got, want, "grad1 of each component")
        fc.zero_grad()
        for i in range(3):
            A[:, i].backward(torch.ones_like(A[:, i]), retain_graph=True)
        assert_close(fc.weight.grad1, want.sum(1), "grad1 summed over the components")


GRAPH_CLEAR = {  # graph_clear_test.py's problems: (network, input shape)
    "standard": (lambda: nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4)), (2, 3)),
    "flatten-no-op": (lambda: nn.Sequential(nn.Linear(3, 4), nn.Flatten(), nn.Linear(4, 4)), (2, 3)),
    "flatten-with-op": (
        lambda: nn.Sequential(nn.Linear(3, 4), nn.Flatten(), nn.Linear(12, 4)), (2, 3, 3),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", GRAPH_CLEAR)
def test_backpack_nothing_kept_after_the_last_backward(name):
    """BackPACK's ``test_retain_graph`` (its modules keep no input or output after a
    backward, and keep them after ``retain_graph=True``) and ``test_graph_clear``
    (``test/extensions/graph_clear_test.py``: no saved quantities after the backward) on its
    three problems. The hidden activation (the second Linear's input, which the hooks capture)
    is alive while the graph is retained, ``grad1`` is right at every backward, and once the
    last backward has run without ``retain_graph`` nothing holds the activation, the handle
    still open. (One collection, at the end: late in the suite's process a collection takes
    seconds.)"""
    import gc
    import weakref

    make_model, shape = GRAPH_CLEAR[name]
    model = seeded(make_model).to(D)
    torch.manual_seed(1)
    x = torch.rand(shape, dtype=D)
    seen = []
    model[-1].register_forward_pre_hook(lambda m, inputs: seen.append(weakref.ref(inputs[0])))
    want = vmap_grad(model, sq, x, None)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        loss = sq(model(x))
        for k in range(1, 4):
            model.zero_grad()
            loss.backward(retain_graph=True)
            assert seen[-1]() is not None, "kept while the graph is retained"
            assert_grad1(model, want, f"{name}: backward {k} of a retained graph")
        model.zero_grad()
        loss.backward()
        assert_grad1(model, want, f"{name}: the last backward")
        del loss
        gc.collect()
        assert seen[-1]() is None, "the activation is freed after the last backward"


class TinyModel(nn.Module):
    """kfac-pytorch's ``TinyModel`` (``testing/models.py``): a Linear without bias, a ReLU, a
    Linear and a softmax."""

    def __init__(self):
        super().__init__()
        self.linear1 = nn.Linear(10, 20, bias=False)
        self.linear2 = nn.Linear(20, 10)

    def forward(self, x):
        return torch.softmax(self.linear2(torch.relu(self.linear1(x))), 1)


def kfac_by_hand(model, x, y, steps, lr, damping, decay, factors_every, inverse_every):
    """kfac-pytorch's ``KFACPreconditioner.step`` (``kfac/preconditioner.py``,
    ``kfac/layers/base.py``) then SGD, written out: new factors every ``factors_every`` steps
    averaged into running ones (``A ← decay·A + (1 - decay)·A_new``, likewise ``G``), inverses
    every ``inverse_every`` steps, each weight's merged gradient ``[out, in(+1)]``
    preconditioned by them, then ``p ← p - lr·grad``. Its running factors start from the
    identity, gradhooks' from the first factors (used here); its ``kl_clip`` rescaling is left
    out (gradhooks has none). Returns the losses."""
    running, inverses, losses = {}, {}, []
    for step in range(steps):
        model.zero_grad()
        loss = mse(model(x), y)
        losses.append(loss.item())
        loss.backward()
        if step % factors_every == 0:
            new = gradhooks.kfac(model, x, fisher="exact", loss="mse")
            for n, f in new.items():
                old = running.get(n)
                running[n] = f if old is None else dataclasses.replace(
                    f, A=decay * old.A + (1 - decay) * f.A, G=decay * old.G + (1 - decay) * f.G
                )  # fmt: skip
        if step % inverse_every == 0:
            inverses = {n: f.inverse(damping) for n, f in running.items()}
        modules = dict(model.named_modules())
        with torch.no_grad():
            for n, inv in inverses.items():
                layer = modules[n.rsplit(".", 1)[0]]
                grad = layer.weight.grad
                if inv.bias:
                    grad = torch.cat([grad, layer.bias.grad[:, None]], 1)
                step_ = inv.apply(grad)
                layer.weight.grad = step_[:, : layer.weight.shape[1]].clone()
                if inv.bias:
                    layer.bias.grad = step_[:, -1].clone()
            for p in model.parameters():
                p -= lr * p.grad
    return losses


def test_kfac_pytorch_training_schedule_of_factors_and_inverses():
    """kfac-pytorch's ``test_training`` (``tests/training_test.py``): its ``TinyModel``
    trained 20 steps on a batch of 4 under a summed MSE with ``factor_update_steps=5`` and
    ``inv_update_steps=10`` lowers the loss. ``gradhooks.KFAC`` with the same schedule
    (``factors_every=5``, ``inverse_every=10``, ``decay=0.95``, the exact GGN's factors)
    against the schedule written out (:func:`kfac_by_hand`): the same losses at every step
    and the same parameters after the last, so the inverses between updates are the stale
    ones and the running averages follow its recipe."""
    torch.manual_seed(0)
    x, y = torch.rand(4, 10, dtype=D), torch.rand(4, 10, dtype=D)
    model = seeded(TinyModel).to(D)
    by_hand = copy.deepcopy(model)
    # (its damping is 1e-3 with its kl_clip rescaling the step; without one, a step that
    # large overshoots: a damping of 0.1 here)
    kw = dict(damping=0.1, decay=0.95, factors_every=5, inverse_every=10)
    opt = gradhooks.KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1), fisher="exact",
                         loss="mse", **kw)  # fmt: skip
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = mse(model(x), y)
        losses.append(loss.item())
        loss.backward()
        opt.step(x)
    want = kfac_by_hand(by_hand, x, y, steps=20, lr=0.1, **kw)
    assert losses[0] > losses[-1], "training lowers the loss"
    assert losses == pytest.approx(want, rel=1e-9)
    for (n, p), q in zip(model.named_parameters(), by_hand.parameters()):
        assert_close(p, q, f"{n} after 20 steps")


# == dp-transformers: tests/test_dp_utils.py (find_noise_multiplier) ===============================


@pytest.mark.parametrize(
    "sample_rate, steps, epsilon, delta",
    [
        (2e-3, 10_000, 4.0, 1e-7),
        (256 / 50_000, int(50 * 50_000 / 256), 10.0, 1e-5),
        (0.26058631921824105, 18_800, 4.0, 0.00011448277499759097),
    ],
    ids=["inverse", "robustness", "robustness-2"],
)
def test_dp_transformers_noise_multiplier_for_a_budget(sample_rate, steps, epsilon, delta):
    """dp-transformers' ``find_noise_multiplier`` tests (``tests/test_dp_utils.py``): for
    ``q = 2e-3``, 10,000 steps, ε = 4, δ = 1e-7 the noise multiplier lies in ``(0, 2)`` and
    its accountant gives back ε = 4 within 0.5 (``test_inverse``, with the PRV accountant);
    a CIFAR-like run (``q = 256/50,000``, 50 epochs, ε = 10) raises no warning
    (``test_robustness``); a sampling rate of 0.26 over 18,800 steps does not overflow
    (``test_robustness_2``). ``noise_multiplier_for`` (RDP) against the same: a finite
    positive σ, without warnings, whose ε is at most the target and within 0.5 of it."""
    pytest.importorskip("dp_accounting")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sigma = gradhooks.noise_multiplier_for(epsilon, delta, sample_rate, steps)
    assert 0 < sigma < float("inf")
    if epsilon == 4.0 and steps == 10_000:
        assert sigma < 2, "a sensible range"
    accountant = gradhooks.PrivacyAccountant()
    accountant.step(noise_multiplier=sigma, sample_rate=sample_rate, steps=steps)
    spent = accountant.epsilon(delta)
    assert epsilon - 0.5 < spent <= epsilon


# == BackPACK: test/utils/test_conv.py; Opacus: opacus/utils/tensor_utils.py (unfold2d, unfold3d) ==

FORWARD_CONVOLUTIONS = [s for s in CONVOLUTIONS if s[0] in (nn.Conv1d, nn.Conv2d, nn.Conv3d)] + [
    (nn.Conv2d, (2, 3, 3), dict(padding=1, padding_mode="circular"), (3, 2, 5, 6)),
    (nn.Conv1d, (2, 3, 3), dict(padding=2, padding_mode="reflect"), (3, 2, 7)),
    (nn.Conv3d, (2, 4, 2), dict(padding=1, padding_mode="replicate", groups=2), (3, 2, 3, 4, 4)),
    (nn.Conv1d, (2, 3, 4), dict(padding="same", dilation=2), (3, 2, 9)),
    (nn.Conv2d, (2, 3, (2, 4)), dict(padding="same", padding_mode="circular"), (3, 2, 7, 8)),
]


def unfold_by_conv(x: Tensor, module: nn.Module) -> Tensor:
    """BackPACK's ``unfold_by_conv`` (``backpack/utils/conv.py``), rewritten: the columns as a
    convolution of each channel with one-hot kernels, one per kernel offset, rows ordered
    (channel, offset); ``[batch, channels · prod(kernel), positions]``. The module's padding
    is applied first as its forward applies it."""
    kernel = module.kernel_size
    K = math.prod(kernel)
    channels = x.shape[1]
    one_hot = (
        torch.eye(K, dtype=x.dtype).reshape(K, 1, *kernel).repeat(channels, 1, *[1] * len(kernel))
    )
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[len(kernel)]
    padding = module.padding
    if isinstance(padding, str) or module.padding_mode != "zeros":
        if padding == "same":  # (torch puts the odd one of the total on the right)
            total = [d * (k - 1) for d, k in zip(module.dilation, kernel)]
        else:
            total = [2 * p for p in padding]
        pads = []
        for t in reversed(total):
            pads += [t // 2, t - t // 2]
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, pads, mode=mode)
        padding = 0
    cols = conv(x, one_hot, None, module.stride, padding, module.dilation, groups=channels)
    return cols.flatten(2)


@pytest.mark.parametrize(
    "setting", FORWARD_CONVOLUTIONS, ids=[conv_id(s) for s in FORWARD_CONVOLUTIONS]
)
def test_backpack_convolution_with_unfold(setting):
    """BackPACK's ``test_unfold_by_conv`` and ``test_convolution_with_unfold``
    (``test/utils/test_conv.py``, on its convolution settings; Opacus' ``unfold2d`` /
    ``unfold3d`` in ``opacus/utils/tensor_utils.py`` are the same columns): the columns
    gradhooks' convolution rule builds (``conv_input_columns``, ``[batch, in · prod(kernel),
    positions]``) equal the one-hot-convolution unfold (and ``F.unfold`` for a 2-d
    convolution with zero padding), and the convolution as a grouped matrix product of the
    weight with them is the layer's output; for every forward setting of its derivatives
    tests and for circular, reflect and replicate padding and ``padding="same"``."""
    from gradhooks.rules.conv import conv_input_columns

    layer, args, kw, shape = setting
    module = seeded(lambda: layer(*args, **kw)).to(D)
    torch.manual_seed(1)
    x = torch.rand(shape, dtype=D)
    with torch.no_grad():
        cols = conv_input_columns(module, x)
        assert_close(cols, unfold_by_conv(x, module), "the one-hot convolution's columns")
        if (
            layer is nn.Conv2d
            and module.padding_mode == "zeros"
            and not isinstance(module.padding, str)
        ):
            unfold = F.unfold(x, module.kernel_size, module.dilation, module.padding, module.stride)
            assert_close(cols, unfold, "F.unfold")
        out = module(x)
        if module.bias is not None:
            out = out - module.bias.reshape(1, -1, *[1] * (out.dim() - 2))
        G, N, cout = module.groups, x.shape[0], out.shape[1]
        W = module.weight.reshape(G, cout // G, -1)
        by_matmul = torch.einsum("goi,ngip->ngop", W, cols.reshape(N, G, W.shape[2], -1))
        assert_close(by_matmul.reshape(out.shape), out, "the convolution by its columns")


# == BackPACK: test/test_batch_first.py (Permute and the batch axis) ================================


class Permuted(nn.Module):
    """The batch axis moved by ``permute`` (BackPACK's ``Permute``), a layer on the last
    dimension, the axis moved back, a Linear head. ``how``: what acts on the last dimension
    (``"linear"``, a hooked Linear; ``"frozen"``, a frozen one; ``"functional"``,
    ``F.linear`` by a buffer; ``"layer_norm"``; ``"matmul"``)."""

    def __init__(self, perm: tuple[int, ...], back: tuple[int, ...], features: int, how: str):
        super().__init__()
        self.perm, self.back, self.how = perm, back, how
        self.layer = nn.Linear(features, features)
        self.register_buffer("W", torch.randn(features, features))
        if how == "frozen":
            self.layer.requires_grad_(False)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        y = x.permute(*self.perm)
        if self.how in ("linear", "frozen"):
            y = self.layer(y)
        elif self.how == "functional":
            y = F.linear(y, self.W)
        elif self.how == "layer_norm":
            y = F.layer_norm(y, y.shape[-1:])
        else:
            y = y @ self.W.T
        return self.head(y.permute(*self.back))


@pytest.mark.parametrize(
    "perm, back, features", [((1, 0, 2), (1, 0, 2), 6), ((2, 0, 1), (1, 2, 0), 5)]
)
def test_backpack_permuted_batch_axis_is_followed(perm, back, features):
    """BackPACK's ``test_permute_batch_axis`` (``test/test_batch_first.py``): its ``Permute``
    refuses to move the batch axis (``Permute(1, 0, 2)``, ``Permute(2, 0, 1)``). gradhooks
    follows it: a Linear on ``x.permute(1, 0, 2)`` (time-major) or ``x.permute(2, 0, 1)``
    (the batch in the middle), the axis moved back, gives the oracle's ``grad1``."""
    model = seeded(lambda: Permuted(perm, back, features, "linear")).to(D)
    torch.manual_seed(1)
    x = torch.randn(4, 5, 6, dtype=D)
    want = vmap_grad(model, sq, x, None)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(x)).backward()
    assert_grad1(model, want, f"permute{perm}")


@pytest.mark.parametrize("how", ["linear", "frozen", "functional", "layer_norm", "matmul"])
def test_backpack_batch_axis_moved_into_the_features_is_refused(how):
    """The case BackPACK's ``Permute`` guards against: the batch moved last
    (``x.permute(1, 2, 0)``) and a Linear, ``F.linear``, a LayerNorm or ``matmul`` acting on
    that dimension, so every output entry is computed from every example's input: per-example
    gradients do not exist (a batch of one does not even run: the layer expects 4 features).
    Each is refused with a ``MixedExamplesError``, as ``matmul`` was: before, the tracker left
    a tensor whose examples ``F.linear`` or ``F.layer_norm`` contracted of unknown layout, and
    the head, presumed to hold the examples on dimension 0, got each row's gradient in the
    mixed forward without an error (a frozen Linear, ``F.linear``, a LayerNorm), or the hooked
    Linear a ``RuleError`` blaming its own rule."""
    model = seeded(lambda: Permuted((1, 2, 0), (2, 0, 1), 4, how)).to(D)
    torch.manual_seed(1)
    x = torch.randn(4, 5, 6, dtype=D)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with pytest.raises(gradhooks.MixedExamplesError):
            sq(model(x)).backward()

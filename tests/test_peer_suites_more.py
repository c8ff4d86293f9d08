"""More of the cases that other per-example-gradient projects check in their own test suites,
written in gradhooks' terms and compared with float64 references (``vmap(grad)`` and the
per-example loops of :mod:`gradhooks.oracle`, or a loop written out where the examples sit on
another dimension). :mod:`test_peer_suites` holds the first set; this one adds:

- torch's ExpandedWeights tests (``test/test_expanded_weights.py``,
  ``call_for_per_sample_grads``): every module setting of its legacy module tests under a
  ``sum`` and a ``mean`` loss (the input's gradient checked too), every sample input of its
  op-database ops, a module called twice in one forward, RNN / LSTM / GRU from its module
  database (``batch_first=False``, initial states, packed sequences), its small models (a CNN,
  instance / group / layer norm after a convolution, an embedding over ``[batch, 5, 5]``
  indices), inputs given by keyword, inside a dataclass or shared by the batch, and the inputs
  and arguments it refuses;
- functorch's per-sample-gradient tests (``test/functorch/test_eager_transforms.py``:
  ``test_resnet18_per_sample_grads`` with GroupNorm for BatchNorm, ``test_ensemble_regression``,
  ``test_lennard_jones_batched_jacrev``), the ``torch.func`` per-sample-gradients tutorial, and
  ``functional_call`` / ``vmap(grad)`` on a hooked model;
- Opacus: ``per_sample_gradients_utils_test.py`` (hypothesis over Conv1d and Linear settings,
  ``batch_first=False``, empty batches), ``per_sample_gradient_clip_test.py`` (flat and
  per-layer clipping of a net with a frozen layer), ``gradient_accumulation_test.py``,
  ``grad_sample_module_fast_gradient_clipping_test.py`` and ``embedding_norm_sample_test.py``
  (ghost-clipping norms and gradients, embedding rows repeated in an example),
  ``poisson_test.py`` / ``dpdataloader_test.py``, its schedulers and noise, attention masks,
  time-major DP steps, mixed precision, a MobileNetV3 after ``ModuleValidator.fix``;
- private-transformers (``tests/test_privacy_engine.py``: clipped and accumulated gradients of
  BERT, RoBERTa, ALBERT classifiers, GPT-2 / OpenAI-GPT / OPT language models with tied or
  untied embeddings, BART and T5) and fastDP (book-keeping clipping of GPT-2 with LoRA,
  layer-wise and parameter-wise norms, BiTFiT, a ViT, gradient checkpointing), on tiny random
  configurations.

``grad1[i]`` is always the gradient of example ``i``'s own loss (the loss of a batch of one), so
``grad1.sum(0)`` (sum loss) or ``grad1.mean(0)`` (mean loss) is ``.grad``. Every comparison is
in float64 at the harness's ``rtol=1e-7, atol=1e-9`` unless a test says otherwise.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

import gradhooks
from gradhooks.oracle import loop_grad, vmap_grad
from harness import OpCall, as_double, assert_close, seeded
from harness import sum_of_squares as sq

DOUBLE = torch.float64


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def loop_along(model: nn.Module, loss, inputs: tuple, dims: tuple) -> dict[str, Tensor]:
    """Per-example gradients by a loop over the examples, example ``i`` being index ``i`` of
    dimension ``dims[k]`` of ``inputs[k]`` (``None``: the input is shared). The loss of
    example ``i`` is ``loss`` of its batch of one."""
    batch = next(x.shape[d] for x, d in zip(inputs, dims, strict=True) if d is not None)
    params = trainable(model)
    rows = []
    for i in range(batch):
        one = tuple(
            x if d is None else x.narrow(d, i, 1).contiguous()
            for x, d in zip(inputs, dims, strict=True)
        )
        grads = torch.autograd.grad(loss(model(*one)), [p for _, p in params], allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g for (_, p), g in zip(params, grads)])
    return {n: torch.stack([r[k] for r in rows]) for k, (n, _) in enumerate(params)}


def assert_grad1(model: nn.Module, want: dict[str, Tensor], what: str = "") -> None:
    """Every trainable parameter's ``grad1`` is ``want``; frozen ones have none."""
    checked = 0
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert not hasattr(p, "grad1"), f"{what}: frozen {n} got a grad1"
            continue
        assert hasattr(p, "grad1"), f"{what}: {n} has no grad1"
        assert_close(p.grad1, want[n], f"{what}: {n}")
        checked += 1
    assert checked, f"{what}: no trainable parameter was checked"


def clipped_by_oracle(want: dict[str, Tensor], max_norm: float) -> dict[str, Tensor]:
    """``Σ_i min(1, C/‖g_i‖) · g_i`` of the oracle's per-example gradients (whole model)."""
    flat = torch.cat([g.flatten(1) for g in want.values()], 1)
    factor = (max_norm / flat.norm(dim=1)).clamp(max=1.0)
    return {n: torch.einsum("b,b...->...", factor, g) for n, g in want.items()}


# == torch: test/test_expanded_weights.py =======================================================
# Its ContextManagerTests run call_for_per_sample_grads over torch's legacy module tests of
# Linear, Conv1d/2d/3d, Embedding, LayerNorm, GroupNorm and InstanceNorm, compare grad_sample
# with a loop over the examples and check the input's gradient too.


def idx(*shape, high=4):
    return lambda: torch.randint(0, high, shape)


def rand(*shape):
    return lambda: torch.randn(*shape)


EW_MODULES = [
    ("linear", lambda: nn.Linear(10, 8), rand(4, 10)),
    ("linear_no_bias", lambda: nn.Linear(10, 8, bias=False), rand(4, 10)),
    ("linear_3d_input", lambda: nn.Linear(10, 8), rand(4, 3, 10)),
    ("linear_4d_input", lambda: nn.Linear(10, 8), rand(3, 2, 3, 10)),
    ("conv1d", lambda: nn.Conv1d(4, 5, 3), rand(2, 4, 10)),
    ("conv1d_stride", lambda: nn.Conv1d(4, 5, 3, stride=2), rand(2, 4, 10)),
    ("conv1d_pad1_no_bias", lambda: nn.Conv1d(4, 5, 3, 1, 1, bias=False), rand(2, 4, 10)),
    ("conv1d_pad2_dilated", lambda: nn.Conv1d(4, 5, 3, padding=2, dilation=2), rand(2, 4, 10)),
    ("conv1d_groups", lambda: nn.Conv1d(4, 6, 3, groups=2), rand(2, 4, 10)),
    ("conv1d_depthwise_multiplier", lambda: nn.Conv1d(4, 8, 3, groups=4), rand(2, 4, 10)),
    (
        "conv1d_pad_same_dilated",
        lambda: nn.Conv1d(4, 5, 3, padding="same", dilation=2),
        rand(2, 4, 10),
    ),
    ("conv1d_pad_same_even_kernel", lambda: nn.Conv1d(4, 5, 4, padding="same"), rand(2, 4, 10)),
    ("conv1d_pad_valid", lambda: nn.Conv1d(4, 5, 3, padding="valid"), rand(2, 4, 10)),
    (
        "conv1d_circular",
        lambda: nn.Conv1d(4, 5, 3, padding=2, padding_mode="circular"),
        rand(2, 4, 10),
    ),
    (
        "conv1d_reflect",
        lambda: nn.Conv1d(4, 5, 3, padding=1, padding_mode="reflect"),
        rand(2, 4, 10),
    ),
    (
        "conv1d_replicate",
        lambda: nn.Conv1d(4, 5, 3, padding=2, padding_mode="replicate"),
        rand(2, 4, 10),
    ),
    ("conv2d", lambda: nn.Conv2d(3, 4, (3, 2)), rand(2, 3, 7, 5)),
    ("conv2d_strided", lambda: nn.Conv2d(3, 4, (3, 3), (2, 2)), rand(2, 3, 6, 6)),
    ("conv2d_padded", lambda: nn.Conv2d(3, 4, (3, 3), (2, 2), (1, 1)), rand(2, 3, 6, 6)),
    ("conv2d_dilated", lambda: nn.Conv2d(3, 4, (3, 4), (1, 1), (1, 1), (2, 2)), rand(2, 3, 8, 8)),
    ("conv2d_groups", lambda: nn.Conv2d(4, 6, (3, 2), groups=2), rand(2, 4, 6, 5)),
    ("conv2d_depthwise", lambda: nn.Conv2d(4, 4, 3, groups=4), rand(2, 4, 6, 6)),
    (
        "conv2d_depthwise_multiplier",
        lambda: nn.Conv2d(4, 8, 3, groups=4, bias=False),
        rand(2, 4, 6, 6),
    ),
    (
        "conv2d_pad_tuple_reflect",
        lambda: nn.Conv2d(3, 4, 3, padding=(1, 2), padding_mode="reflect"),
        rand(2, 3, 6, 6),
    ),
    (
        "conv2d_replicate",
        lambda: nn.Conv2d(3, 4, 3, padding=2, padding_mode="replicate"),
        rand(2, 3, 5, 5),
    ),
    (
        "conv2d_circular_strided",
        lambda: nn.Conv2d(3, 4, 3, 2, (1, 2), padding_mode="circular"),
        rand(2, 3, 6, 6),
    ),
    (
        "conv2d_pad_same_dilated",
        lambda: nn.Conv2d(3, 4, (3, 2), padding="same", dilation=2),
        rand(2, 3, 6, 6),
    ),
    ("conv3d", lambda: nn.Conv3d(2, 3, (2, 3, 2)), rand(2, 2, 4, 5, 4)),
    ("conv3d_stride_padding", lambda: nn.Conv3d(2, 3, 2, stride=2, padding=1), rand(2, 2, 4, 4, 4)),
    ("conv3d_dilated", lambda: nn.Conv3d(2, 3, 2, dilation=2), rand(2, 2, 5, 5, 5)),
    ("conv3d_groups", lambda: nn.Conv3d(4, 4, 2, groups=2), rand(2, 4, 3, 3, 3)),
    (
        "conv3d_circular",
        lambda: nn.Conv3d(2, 3, 3, padding=1, padding_mode="circular"),
        rand(2, 2, 3, 4, 3),
    ),
    ("conv3d_pad_same", lambda: nn.Conv3d(2, 3, 3, padding="same"), rand(2, 2, 3, 4, 3)),
    ("embedding", lambda: nn.Embedding(4, 3), idx(2, 3)),
    ("embedding_padding_idx", lambda: nn.Embedding(4, 3, padding_idx=0), idx(3, 5)),
    ("embedding_3d_indices", lambda: nn.Embedding(4, 3), idx(2, 3, 2)),
    ("layer_norm_1d", lambda: nn.LayerNorm(5), rand(4, 5)),
    ("layer_norm_2d", lambda: nn.LayerNorm([5, 6]), rand(4, 5, 6)),
    ("layer_norm_3d_input_last", lambda: nn.LayerNorm(6, eps=1e-3), rand(4, 5, 6)),
    ("layer_norm_no_bias", lambda: nn.LayerNorm([2, 3], bias=False), rand(3, 4, 2, 3)),
    ("group_norm_1d", lambda: nn.GroupNorm(3, 6), rand(4, 6, 5)),
    ("group_norm_2d", lambda: nn.GroupNorm(3, 6, eps=1e-3), rand(2, 6, 2, 3)),
    ("group_norm_one_group", lambda: nn.GroupNorm(1, 6), rand(3, 6, 4)),
    ("group_norm_group_per_channel", lambda: nn.GroupNorm(6, 6), rand(3, 6, 4)),
    ("group_norm_3d", lambda: nn.GroupNorm(2, 4), rand(2, 4, 2, 3, 2)),
    ("instance_norm1d", lambda: nn.InstanceNorm1d(3, affine=True), rand(4, 3, 15)),
    ("instance_norm2d", lambda: nn.InstanceNorm2d(3, affine=True), rand(2, 3, 5, 6)),
    ("instance_norm3d", lambda: nn.InstanceNorm3d(3, affine=True), rand(2, 3, 3, 4, 3)),
    (
        "instance_norm1d_tracking",
        lambda: nn.InstanceNorm1d(3, affine=True, track_running_stats=True),
        rand(4, 3, 7),
    ),
]
EW_IDS = [m[0] for m in EW_MODULES]


def ew_loss(reduction: str):
    """torch's ``reduction(module(x))`` (``sum`` or ``mean`` of every output element), plus
    half the sum of squares (the mean: over the elements) so that normalized outputs have
    gradients that are not zero by symmetry."""
    if reduction == "sum":
        return lambda out, t=None: out.sum() + sq(out)
    return lambda out, t=None: out.mean() + 0.5 * (out**2).mean()


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning")
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("case", EW_MODULES, ids=EW_IDS)
def test_expanded_weights_module_settings(case, reduction):
    """Per-example gradients of one module under a ``sum`` or ``mean`` loss of all its
    outputs, and the input's gradient unchanged by the hooks: torch's
    ``TestExpandedWeightModule`` over ``module_tests`` / ``new_module_tests`` (Linear,
    Conv1d/2d/3d with stride, padding modes and "same"/"valid", dilation and groups,
    Embedding, LayerNorm, GroupNorm, InstanceNorm) and ``TestExpandedWeightFunctional``'s
    ``_sum`` / ``_mean`` variants."""
    name, factory, inputs = case
    model = seeded(factory).double()
    torch.manual_seed(1)
    x = as_double(inputs())
    loss = ew_loss(reduction)
    want = loop_grad(model, loss, x)
    if not any(True for _ in model.buffers()):  # (vmap cannot update running statistics)
        by_vmap = vmap_grad(model, loss, x)
        for n in want:
            assert_close(by_vmap[n], want[n], f"{name}: vmap vs loop, {n}")
    diff = x.is_floating_point()
    if diff:  # the input's gradient without hooks
        x_plain = x.clone().requires_grad_()
        (input_grad,) = torch.autograd.grad(loss(model(x_plain)), x_plain)
        x = x.clone().requires_grad_()
    with gradhooks.add_hooks(model, loss_reduction=reduction):
        loss(model(x)).backward()
    assert_grad1(model, want, f"{name} ({reduction})")
    for n, p in trainable(model):
        reduced = p.grad1.sum(0) if reduction == "sum" else p.grad1.mean(0)
        assert_close(reduced, p.grad, f"{name}: grad1 reduced vs .grad, {n}")
    if diff:
        assert_close(x.grad, input_grad, f"{name}: the input's gradient")


class Twice(nn.Module):
    """``module(x) + module(x)``: one module called twice in one forward."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x) + self.module(x)


TWICE = ["linear_3d_input", "conv1d_groups", "conv2d_padded", "conv3d", "embedding",
         "layer_norm_2d", "group_norm_2d", "instance_norm2d"]  # fmt: skip


@pytest.mark.parametrize("name", TWICE)
def test_expanded_weights_module_called_twice(name):
    """A module called twice on the same input: each example's gradient is twice that of one
    call. torch's ``_do_test_multi_input`` (``module(input) + module(input)``; older
    ExpandedWeights refused a second call, "incorrect for multiple calls")."""
    _, factory, inputs = EW_MODULES[EW_IDS.index(name)]
    module = seeded(factory).double()
    torch.manual_seed(1)
    x = as_double(inputs())
    loss = ew_loss("sum")
    once = vmap_grad(module, lambda out, t=None: out.sum(), x)
    model = Twice(module)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        model(x).sum().backward()
    assert_grad1(model, {f"module.{n}": 2 * g for n, g in once.items()}, name)
    model.zero_grad()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        loss(model(x)).backward()
    assert_grad1(model, vmap_grad(model, loss, x), f"{name}, a loss not linear in the output")


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize(
    "name",
    [
        "linear",
        "conv2d_groups",
        "embedding_padding_idx",
        "group_norm_1d",
        "instance_norm1d",
        "layer_norm_2d",
    ],  # fmt: skip
)
def test_expanded_weights_small_batches(name, batch):
    """Batches of one and two examples (where a squeezed or broadcast batch dimension would go
    unnoticed): torch's ExpandedWeights module tests, whose legacy inputs are of batch 1 to 4,
    and its ``batch_size`` argument."""
    _, factory, inputs = EW_MODULES[EW_IDS.index(name)]
    model = seeded(factory).double()
    torch.manual_seed(1)
    x = as_double(inputs())[:batch]
    loss = ew_loss("mean")
    want = vmap_grad(model, loss, x)
    with gradhooks.add_hooks(model):
        loss(model(x)).backward()
    assert_grad1(model, want, f"{name}, batch {batch}")


def conv_for(dims: int):
    return (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1]


def instance_norm_model(dims: int) -> nn.Module:
    return nn.Sequential(
        conv_for(dims)(3, 4, 3, padding=1),
        (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)[dims - 1](4, affine=True),
        nn.Flatten(),
        nn.Linear(4 * 5**dims, 10),
    )


def group_norm_model(dims: int) -> nn.Module:
    return nn.Sequential(
        conv_for(dims)(3, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Flatten(),
        nn.Linear(4 * 5**dims, 10),
    )  # fmt: skip


def layer_norm_model(dims: int) -> nn.Module:
    """The LayerNorm normalizes the spatial dimensions only, once per channel."""
    return nn.Sequential(
        conv_for(dims)(3, 4, 3, padding=1), nn.LayerNorm([5] * dims), nn.Flatten(),
        nn.Linear(4 * 5**dims, 10),
    )  # fmt: skip


def ew_convnet(dims: int = 2) -> nn.Module:
    """torch's ``convnet`` of ``test_cnn_model_sum`` / ``_mean``, narrower."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, 1, 1), nn.ReLU(), nn.AvgPool2d(2, 2),
        nn.Conv2d(4, 6, 3, 1, 1), nn.ReLU(), nn.AvgPool2d(2, 2),
        nn.Conv2d(6, 8, 3, 1, 1), nn.ReLU(), nn.AdaptiveAvgPool2d((1, 1)),
        nn.Flatten(start_dim=1, end_dim=-1), nn.Linear(8, 10, bias=True),
    )  # fmt: skip


class EmbeddingModel(nn.Module):
    """torch's ``embedding_model``: an embedding of ``[batch, 5, 5]`` indices, flattened."""

    def __init__(self):
        super().__init__()
        self.seq = nn.Sequential(nn.Embedding(16, 3), nn.Flatten(1, -1), nn.Linear(75, 10))

    def forward(self, x):
        return self.seq(x)


EW_MODELS = [
    ("cnn", lambda: ew_convnet(), rand(6, 3, 8, 8)),
    *[(f"instance_norm_{d}d", lambda d=d: instance_norm_model(d), rand(4, 3, *[5] * d))
      for d in (1, 2, 3)],
    *[(f"group_norm_{d}d", lambda d=d: group_norm_model(d), rand(4, 3, *[5] * d))
      for d in (1, 2, 3)],
    *[(f"layer_norm_{d}d", lambda d=d: layer_norm_model(d), rand(4, 3, *[5] * d))
      for d in (1, 2, 3)],
    ("embedding", EmbeddingModel, idx(6, 5, 5, high=16)),
]  # fmt: skip


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("case", EW_MODELS, ids=[m[0] for m in EW_MODELS])
def test_expanded_weights_models(case, reduction):
    """torch's ``TestExpandedWeightFunctional`` models under ``CrossEntropyLoss``: a CNN
    (``test_cnn_model_sum`` / ``_mean``), a convolution followed by InstanceNorm, GroupNorm or
    a LayerNorm over the spatial dimensions (``test_*_norm_model`` in 1, 2 and 3 dimensions),
    an embedding of ``[batch, 5, 5]`` indices (``test_embedding_model``)."""
    name, factory, inputs = case
    model = seeded(factory).double()
    torch.manual_seed(1)
    x = as_double(inputs())
    y = torch.randint(0, 10, (x.shape[0],))
    want = vmap_grad(model, lambda out, t: F.cross_entropy(out, t, reduction="sum"), x, y)
    with gradhooks.add_hooks(model, loss_reduction=reduction):
        F.cross_entropy(model(x), y, reduction=reduction).backward()
    assert_grad1(model, want, f"{name} ({reduction})")


class Functional(nn.Module):
    """A layer written with a ``torch.nn.functional`` call on parameters of its own (no rule
    for the class): what ExpandedWeights' op tests feed ``F.linear``, ``F.conv*d``,
    ``F.embedding``, ``F.layer_norm``, ``F.group_norm`` and ``F.instance_norm``."""

    def __init__(self, op: str):
        super().__init__()
        self.op = op
        shapes = {
            "linear": [(5, 4), (5,)], "conv1d": [(6, 2, 3), (6,)], "conv2d": [(6, 2, 3, 2), (6,)],
            "conv3d": [(4, 2, 2, 2, 2), (4,)], "embedding": [(7, 3)],
            "layer_norm": [(4,), (4,)], "group_norm": [(4,), (4,)], "instance_norm": [(4,), (4,)],
        }[op]  # fmt: skip
        self.weight = nn.Parameter(torch.randn(*shapes[0]))
        self.bias = nn.Parameter(torch.randn(*shapes[1])) if len(shapes) > 1 else None

    def forward(self, x):
        w = [self.weight] if self.bias is None else [self.weight, self.bias]
        if self.op == "linear":
            return F.linear(x, *w)
        if self.op == "conv1d":
            return F.conv1d(x, *w, stride=2, padding=1, groups=2)
        if self.op == "conv2d":
            return F.conv2d(x, *w, padding=(1, 0), dilation=(1, 2), groups=2)
        if self.op == "conv3d":
            return F.conv3d(x, *w, stride=(1, 2, 1), groups=2)
        if self.op == "embedding":
            return F.embedding(x, w[0], padding_idx=0)
        if self.op == "layer_norm":
            return F.layer_norm(x, (4,), *w)
        if self.op == "group_norm":
            return F.group_norm(x, 2, *w)
        return F.instance_norm(x, weight=w[0], bias=w[1])


FUNCTIONAL_INPUTS = {
    "linear": rand(3, 2, 4), "conv1d": rand(3, 4, 7), "conv2d": rand(3, 4, 5, 6),
    "conv3d": rand(3, 4, 3, 4, 3), "embedding": idx(3, 5, high=7),
    "layer_norm": rand(3, 5, 4), "group_norm": rand(3, 4, 6), "instance_norm": rand(3, 4, 6),
}  # fmt: skip


@pytest.mark.parametrize("op", list(FUNCTIONAL_INPUTS))
def test_expanded_weights_functional_ops_on_own_parameters(op):
    """``torch.nn.functional`` layers called on a module's own parameters, computed through
    the fallback: torch's ``test_expanded_weight_per_sample_grad_sum`` over the op database's
    ``supports_expanded_weight`` ops (their sample inputs: groups, strides, padding,
    dilation, ``padding_idx``)."""
    model = seeded(lambda: Functional(op)).double()
    torch.manual_seed(1)
    x = as_double(FUNCTIONAL_INPUTS[op]())
    loss = ew_loss("sum")
    want = vmap_grad(model, loss, x)
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        loss(model(x)).backward()
    assert_grad1(model, want, op)
    assert [n for n, _ in h.fallback_modules()] == [""]


def ew_supported(name: str, x: Tensor, args: tuple) -> bool:
    """torch's ``supported_inputs``: the sample inputs that have a batch dimension and do not
    normalize across it."""
    if x.dim() == 0 or x.shape[0] == 0:
        return False
    if name == "nn.functional.linear":
        return x.dim() > 1
    if name == "nn.functional.layer_norm":
        return tuple(x.shape) != tuple(args[0])
    if name.startswith("nn.functional.conv"):
        return x.dim() == int(name[-2]) + 2
    if name == "nn.functional.embedding":
        return x.dim() > 1
    return True


EW_OPS = ["conv1d", "conv2d", "conv3d", "group_norm", "instance_norm", "layer_norm", "linear",
          "embedding"]  # fmt: skip


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning")
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("name", EW_OPS)
def test_expanded_weights_op_database_sample_inputs(name, reduction):
    """Every sample input of torch's op database for the ops ExpandedWeights supports
    (``op.supports_expanded_weight``: their weights, biases, groups, strides, padding,
    dilation, ``eps``, ``padding_idx``, ``max_norm``...), filtered as torch's
    ``supported_inputs`` does, each op called on a module's own parameters (the fallback):
    ``TestExpandedWeightFunctional.test_expanded_weight_per_sample_grad_sum`` / ``_mean``,
    against the per-example loop."""
    methods = pytest.importorskip("torch.testing._internal.common_methods_invocations")
    (info,) = [o for o in methods.op_db if o.name == f"nn.functional.{name}"]
    assert info.supports_expanded_weight
    loss = ew_loss(reduction)
    checked = 0
    for sample in info.sample_inputs("cpu", DOUBLE, requires_grad=True):
        if name == "embedding":  # (its op database entry flips the index and the weight)
            x, args = sample.args[0], (sample.input, *sample.args[1:])
        else:
            x, args = sample.input, sample.args
        if not ew_supported(info.name, x, args):
            continue
        op = F.embedding if name == "embedding" else info.op
        model = OpCall(op, args, sample.kwargs)
        if not list(model.parameters()):
            continue
        x = x.detach().clone()
        want = loop_grad(model, loss, x)
        with gradhooks.add_hooks(model, loss_reduction=reduction):
            loss(model(x)).backward()
        assert_grad1(model, want, f"{name} on {tuple(x.shape)}, {sample.kwargs}")
        checked += 1
    assert checked, f"{name}: no sample input checked"


class TwoInputs(nn.Module):
    """torch's ``CustomModule`` of ``test_per_sample_api_compute_batch_size``."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(5, 5)

    def forward(self, input1, input2):
        return self.linear(input1) + self.linear(input2)


@pytest.mark.parametrize("how", ["positional", "second-by-keyword", "both-by-keyword"])
def test_expanded_weights_inputs_by_keyword(how):
    """Inputs given positionally or by keyword, the batch found in either: torch's
    ``test_per_sample_api_compute_batch_size``."""
    model = seeded(TwoInputs).double()
    a, b = torch.randn(4, 5, dtype=DOUBLE), torch.randn(4, 5, dtype=DOUBLE)
    want = vmap_grad(model, sq, (a, b))
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        if how == "positional":
            out = model(a, b)
        elif how == "second-by-keyword":
            out = model(a, input2=b)
        else:
            out = model(input1=a, input2=b)
        sq(out).backward()
    assert_grad1(model, want, how)


@dataclasses.dataclass
class Pair:
    """Two tensors in an object that is not a pytree."""

    elem1: Tensor
    elem2: Tensor


class PairInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(5, 5)

    def forward(self, pair: Pair, other):
        return self.linear(pair.elem1) + self.linear(pair.elem2)


def test_expanded_weights_input_inside_a_dataclass():
    """The batch inside an object that is not a pytree (a dataclass of two tensors), beside a
    string: torch's ``test_per_sample_api_compute_batch_size_not_pytreeable`` (where
    ExpandedWeights cannot find the batch size). The batch is found where the layer sees it."""
    model = seeded(PairInput).double()
    pair = Pair(torch.randn(4, 5, dtype=DOUBLE), torch.randn(4, 5, dtype=DOUBLE))
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(pair, "")).backward()
    rows = [
        torch.autograd.grad(
            sq(model(Pair(pair.elem1[i : i + 1], pair.elem2[i : i + 1]), "")),
            list(model.parameters()),
        )
        for i in range(4)
    ]
    for k, (n, p) in enumerate(model.named_parameters()):
        assert_close(p.grad1, torch.stack([r[k] for r in rows]), n)


@pytest.mark.parametrize("shape", [(5,), (1, 5)], ids=["vector", "row"])
def test_expanded_weights_second_input_without_a_batch(shape):
    """A layer called on the batch and on a second input shared by every example (a vector,
    or one row broadcast over the batch): each example's gradient holds both calls, the
    shared one's through that example's loss. torch's ``call_for_per_sample_grads(model,
    batch_size=4)(input, torch.randn(5))``, against a loop that keeps the shared input."""
    model = seeded(TwoInputs).double()
    a, b = torch.randn(4, 5, dtype=DOUBLE), torch.randn(*shape, dtype=DOUBLE)
    loss = ew_loss("sum")
    want = loop_along(model, loss, (a, b), (0, None))
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        loss(model(a, b)).backward()
    assert_grad1(model, want, f"shared input {shape}")


class MHAOutput(nn.Module):
    """Self-attention's output (``m(x, x, x)[0]``)."""

    def __init__(self):
        super().__init__()
        self.m = nn.MultiheadAttention(4, 2)

    def forward(self, x):
        return self.m(x, x, x)[0]


UNBATCHED = [
    ("linear_rank_1", lambda: nn.Linear(10, 8), rand(10), r"\(10,\)"),
    ("layer_norm_of_the_whole_input", lambda: nn.LayerNorm([4, 5]), rand(4, 5), r"\(4, 5\)"),
    ("conv1d_unbatched", lambda: nn.Conv1d(4, 5, 3), rand(4, 10), r"\(4, 10\)"),
    ("conv2d_unbatched", lambda: nn.Conv2d(3, 5, 3), rand(3, 6, 6), r"\(3, 6, 6\)"),
    ("instance_norm_unbatched", lambda: nn.InstanceNorm1d(3, affine=True), rand(3, 7),
     r"\(3, 7\)"),
    ("gru_unbatched", lambda: RNNOutput(nn.GRU(4, 3)), rand(5, 4), r"\(5, 4\)"),
    ("attention_unbatched", MHAOutput, rand(5, 4), r"\(5, 4\)"),
]  # fmt: skip


@pytest.mark.parametrize(
    "factory,inputs,shape", [u[1:] for u in UNBATCHED], ids=[u[0] for u in UNBATCHED]
)
def test_expanded_weights_unbatched_inputs_are_refused(factory, inputs, shape):
    """An input without a batch dimension (a rank-1 input to Linear, torch's unbatched
    convolution, instance norm, RNN and attention inputs, a LayerNorm over the whole input,
    which would normalize across the examples) is refused with
    :class:`gradhooks.UnbatchedInputError` naming the layer and the shape, and nothing is
    written: torch's ``test_unsupported_expand_weights`` (``supported_inputs(...,
    supported_inputs=False)``: "Expanded Weights" errors for the same inputs)."""
    model = seeded(factory).double()
    x = as_double(inputs())
    with (
        gradhooks.add_hooks(model, loss_reduction="sum"),
        pytest.raises(gradhooks.UnbatchedInputError, match=rf"(?s){shape}.*batch dimension"),
    ):
        out = model(x)
        (out * torch.randn_like(out)).sum().backward()
    assert all(not hasattr(p, "grad1") and p.grad is None for p in model.parameters())


BAD_ARGUMENTS = [
    ("loss_reduction_empty", dict(loss_reduction=""), "loss_reduction"),
    ("loss_reduction_none", dict(loss_reduction="none"), "loss_reduction"),
    ("batch_dim_float", dict(batch_dim=6.4), "batch_dim"),
    ("batch_dim_negative", dict(batch_dim=-64), "batch_dim"),
    ("batch_dim_bool", dict(batch_dim=True), "batch_dim"),
    ("max_grad1_bytes_negative", dict(max_grad1_bytes=-5), "max_grad1_bytes"),
    ("max_grad1_bytes_bool", dict(max_grad1_bytes=True), "max_grad1_bytes"),
]


@pytest.mark.parametrize(
    "kwargs,what", [b[1:] for b in BAD_ARGUMENTS], ids=[b[0] for b in BAD_ARGUMENTS]
)
def test_expanded_weights_api_arguments_are_checked(kwargs, what):
    """Arguments that cannot work are refused by ``add_hooks`` itself, naming the argument,
    before anything is hooked (not at a later backward, nor as a limit of -5 bytes): torch's
    ``test_per_sample_api_failing`` ("Batch size passed must be None or an integer", "Batch
    size must be positive", "Expected loss_reduction argument to be sum or mean"). ``True``
    is an ``int`` to Python, not a dimension or a number of bytes."""
    model = nn.Linear(10, 10)
    with pytest.raises(gradhooks.ConfigurationError, match=what):
        gradhooks.add_hooks(model, **kwargs)
    assert not model._forward_hooks and not model._forward_pre_hooks
    model(torch.randn(6, 10)).sum().backward()
    assert not hasattr(model.weight, "grad1")


def test_expanded_weights_module_must_be_a_module():
    """A model that is not an ``nn.Module`` is refused with a ``TypeError``: torch's "Module
    passed must be nn.Module"."""
    with pytest.raises(gradhooks.ConfigurationTypeError, match="nn.Module, got str"):
        gradhooks.add_hooks("fail")


class RNNOutput(nn.Module):
    """torch's ``RNNWrapper``: the output sequence of an RNN module (``ret[0]``)."""

    def __init__(self, m: nn.Module):
        super().__init__()
        self.m = m

    def forward(self, *inputs):
        return self.m(*inputs)[0]


RNN_SETTINGS = [
    ("rnn_tanh", nn.RNN, {}),
    ("rnn_relu_no_bias", nn.RNN, dict(nonlinearity="relu", bias=False)),
    ("rnn_two_layers_bidirectional", nn.RNN, dict(num_layers=2, bidirectional=True)),
    ("gru", nn.GRU, {}),
    ("gru_two_layers", nn.GRU, dict(num_layers=2)),
    ("gru_bidirectional_no_bias", nn.GRU, dict(bidirectional=True, bias=False)),
    ("lstm", nn.LSTM, {}),
    ("lstm_two_layers_bidirectional", nn.LSTM, dict(num_layers=2, bidirectional=True)),
    ("lstm_proj_size", nn.LSTM, dict(proj_size=2)),
]


def initial_state(kind, kw: dict, batch: int):
    """An initial state ``[layers · directions, batch, hidden]`` (a pair for an LSTM)."""
    layers = kw.get("num_layers", 1) * (2 if kw.get("bidirectional") else 1)
    out = kw.get("proj_size", 0) or 3
    h = torch.randn(layers, batch, out, dtype=DOUBLE)
    return (h, torch.randn(layers, batch, 3, dtype=DOUBLE)) if kind is nn.LSTM else h


@pytest.mark.parametrize("with_state", [False, True], ids=["no-state", "initial-state"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "time-major"])
@pytest.mark.parametrize("case", RNN_SETTINGS, ids=[r[0] for r in RNN_SETTINGS])
def test_expanded_weights_rnn_modules(case, batch_first, with_state):
    """RNN, GRU and LSTM over the module database's settings (layers, directions, bias,
    ``nonlinearity``, ``proj_size``), batch-first or time-major (``batch_dim=1``), with or
    without an initial state batched on its dimension 1: torch's ``test_module`` of
    ``TestExpandedWeightModule`` (``call_for_per_sample_grads(..., batch_first=...)``),
    against a loop over the examples."""
    _, kind, kw = case
    model = seeded(lambda: RNNOutput(kind(4, 3, batch_first=batch_first, **kw))).double()
    torch.manual_seed(1)
    batch, steps = 3, 5
    x = torch.randn(*((batch, steps) if batch_first else (steps, batch)), 4, dtype=DOUBLE)
    inputs, dims = (x,), (0 if batch_first else 1,)
    if with_state:
        state = initial_state(kind, kw, batch)
        if kind is nn.LSTM:  # (the loop narrows each tensor: pass the pair as two)
            model = seeded(lambda: LSTMWithState(kind(4, 3, batch_first=batch_first, **kw)))
            model = model.double()
            inputs, dims = (x, *state), (dims[0], 1, 1)
        else:
            inputs, dims = (x, state), (dims[0], 1)
    loss = ew_loss("sum")
    want = loop_along(model, loss, inputs, dims)
    with gradhooks.add_hooks(model, loss_reduction="sum", batch_dim=0 if batch_first else 1):
        loss(model(*inputs)).backward()
    assert_grad1(model, want, f"{case[0]}")


class LSTMWithState(nn.Module):
    def __init__(self, m: nn.Module):
        super().__init__()
        self.m = m

    def forward(self, x, h, c):
        return self.m(x, (h, c))[0]


@pytest.mark.parametrize("case", RNN_SETTINGS[::2], ids=[r[0] for r in RNN_SETTINGS[::2]])
def test_expanded_weights_rnn_on_packed_sequences(case):
    """An RNN on a ``PackedSequence`` of sequences of unequal length: torch's
    ``_do_test_rnn_packed_sequence`` (the batch size is the packed sequence's first batch
    size; each example's gradient is that of its own sequence, up to its length)."""
    _, kind, kw = case
    model = seeded(lambda: RNNOutput(kind(4, 3, batch_first=True, **kw))).double()
    torch.manual_seed(1)
    x = torch.randn(4, 6, 4, dtype=DOUBLE)
    lengths = torch.tensor([6, 2, 5, 3])
    loss = ew_loss("sum")
    rows = [
        torch.autograd.grad(loss(model(x[i : i + 1, : lengths[i]])), list(model.parameters()))
        for i in range(4)
    ]
    packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        loss(model(packed).data).backward()
    for k, (n, p) in enumerate(model.named_parameters()):
        assert_close(p.grad1, torch.stack([r[k] for r in rows]), n)


@pytest.mark.parametrize("layers", [1, 2], ids=["one-layer", "two-layers-bidirectional"])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "time-major"])
@pytest.mark.parametrize("kind", [nn.RNN, nn.GRU, nn.LSTM], ids=lambda k: k.__name__)
def test_expanded_weights_rnn_packed_with_initial_and_final_states(kind, batch_first, layers):
    """An RNN on an unsorted ``PackedSequence`` with an initial state (in the batch's own
    order, which torch permutes to the packed order), its final state in the loss too:
    torch's ``_do_test_rnn_packed_sequence`` with the module database's ``h`` arguments, and
    Opacus' ``dp_rnn_test.py`` (packed input, initial states), against a loop over each
    example's own sequence and state."""
    kw = dict(num_layers=2, bidirectional=True) if layers == 2 else {}
    rnn = seeded(lambda: kind(4, 3, batch_first=batch_first, **kw)).double()
    torch.manual_seed(1)
    x, lengths = torch.randn(4, 6, 4, dtype=DOUBLE), torch.tensor([3, 6, 2, 5])
    stacked = 4 if layers == 2 else 1  # layers × directions
    states = [torch.randn(stacked, 4, 3, dtype=DOUBLE)]
    if kind is nn.LSTM:
        states.append(torch.randn_like(states[0]))

    def run(seq, *state):
        out, final = rnn(seq, tuple(state) if kind is nn.LSTM else state[0])
        finals = final if kind is nn.LSTM else (final,)
        return ew_loss("sum")(out.data if isinstance(out, PackedSequence) else out) + sq(finals)

    rows = []
    for i in range(4):
        seq = x[i : i + 1, : lengths[i]]
        one = run(seq if batch_first else seq.transpose(0, 1), *[h[:, i : i + 1] for h in states])
        rows.append(torch.autograd.grad(one, list(rnn.parameters())))
    with gradhooks.add_hooks(rnn, loss_reduction="sum"):
        packed = nn.utils.rnn.pack_padded_sequence(
            x if batch_first else x.transpose(0, 1), lengths, batch_first=batch_first,
            enforce_sorted=False,
        )  # fmt: skip
        run(packed, *states).backward()
    for k, (n, p) in enumerate(rnn.named_parameters()):
        assert_close(p.grad1, torch.stack([r[k] for r in rows]), n)


@pytest.mark.parametrize("kind", [nn.RNN, nn.GRU, nn.LSTM], ids=lambda k: k.__name__)
def test_expanded_weights_rnn_state_as_long_as_the_batch(kind):
    """A batch-first RNN of two layers on a batch of two, with an initial state
    ``[layers=2, batch=2, hidden]``: the state's first dimension is as long as the batch
    but is not it (torch's ``batch_hidden`` batches the state on dimension 1)."""
    rnn = kind(4, 3, num_layers=2, batch_first=True)
    model = seeded(lambda: LSTMWithState(rnn) if kind is nn.LSTM else RNNOutput(rnn)).double()
    torch.manual_seed(1)
    x = torch.randn(2, 5, 4, dtype=DOUBLE)
    states = [torch.randn(2, 2, 3, dtype=DOUBLE) for _ in range(2 if kind is nn.LSTM else 1)]
    loss = ew_loss("sum")
    want = loop_along(model, loss, (x, *states), (0, *[1] * len(states)))
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        loss(model(x, *states)).backward()
    assert_grad1(model, want, kind.__name__)


# == functorch: test/functorch/test_eager_transforms.py and the torch.func tutorial ===========


class TutorialCNN(nn.Module):
    """The ``torch.func`` per-sample-gradients tutorial's ``SimpleCNN`` (narrower, on 12 x 12
    images): two convolutions, a max-pool, two linear layers, ``log_softmax``."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 8, 3, 1)
        self.fc1 = nn.Linear(8 * 4 * 4, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return F.log_softmax(self.fc2(x), dim=1)


@pytest.mark.parametrize("quantities", [("grad1",), ("grad1", "norms")], ids=["grad1", "norms"])
def test_functorch_tutorial_cnn_with_nll_loss(quantities):
    """The tutorial's ``SimpleCNN`` under ``F.nll_loss`` (mean), whose per-sample gradients
    it computes with ``vmap(grad(compute_loss), in_dims=(None, 0, 0))`` and checks against a
    loop: ``grad1`` and the per-example norms against both."""
    model = seeded(TutorialCNN).double()
    torch.manual_seed(1)
    x, y = torch.randn(8, 1, 12, 12, dtype=DOUBLE), torch.randint(0, 10, (8,))

    def loss(out, t):
        return F.nll_loss(out, t, reduction="sum")

    want = vmap_grad(model, loss, x, y)
    by_loop = loop_grad(model, loss, x, y)
    for n in want:
        assert_close(by_loop[n], want[n], f"loop vs vmap, {n}")
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        F.nll_loss(model(x), y).backward()
    assert_grad1(model, want, "SimpleCNN")
    if "norms" in quantities:
        flat = torch.cat([g.flatten(1) for g in want.values()], 1)
        assert_close(h.norms(), flat.norm(dim=1), "per-example norms")


class BasicBlock(nn.Module):
    """A ResNet basic block with GroupNorm where torchvision's has BatchNorm (functorch's
    ``convert_batchnorm_modules``: ``GroupNorm(min(32, C), C)``)."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.gn1 = nn.GroupNorm(min(32, cout), cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.gn2 = nn.GroupNorm(min(32, cout), cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(min(32, cout), cout)
            )

    def forward(self, x):
        out = self.gn2(self.conv2(F.relu(self.gn1(self.conv1(x)))))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


def small_resnet() -> nn.Module:
    """torchvision's ``resnet18`` layout, two stages of one block, narrow."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 7, 2, 3, bias=False),
        nn.GroupNorm(4, 4),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
        BasicBlock(4, 4, 1),
        BasicBlock(4, 8, 2),
        nn.AdaptiveAvgPool2d((1, 1)),
        nn.Flatten(),
        nn.Linear(8, 10),
    )


def test_functorch_resnet_with_group_norm_per_sample_grads():
    """A ResNet whose BatchNorms are GroupNorms, under ``CrossEntropyLoss`` (mean), batch 3:
    functorch's ``test_resnet18_per_sample_grads`` (``vmap(grad)`` against a loop)."""
    model = seeded(small_resnet).double()
    torch.manual_seed(1)
    x, y = torch.randn(3, 3, 16, 16, dtype=DOUBLE), torch.randint(0, 10, (3,))
    want = vmap_grad(model, lambda out, t: F.cross_entropy(out, t, reduction="sum"), x, y)
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x), y).backward()
    assert_grad1(model, want, "resnet")


class MLPClassifier(nn.Module):
    """functorch's ``MLPClassifier`` of ``test_ensemble_regression``."""

    def __init__(self, hidden_dim=32, n_classes=2):
        super().__init__()
        self.fc1 = nn.Linear(2, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, n_classes)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), -1)


def spirals(n: int, noise_std: float = 0.05) -> tuple[Tensor, Tensor]:
    ts = torch.linspace(0, 1, n, dtype=DOUBLE)
    rs, signs = ts**0.5, torch.randint(0, 2, (n,)) * 2 - 1
    thetas = rs * 2 * torch.pi
    xs = rs * signs * torch.cos(thetas) + torch.randn(n, dtype=DOUBLE) * noise_std
    ys = rs * signs * torch.sin(thetas) + torch.randn(n, dtype=DOUBLE) * noise_std
    return torch.stack([xs, ys], dim=1), (signs > 0).long()


def test_functorch_ensemble_mlp_nll_on_spirals():
    """functorch's ``MLPClassifier`` with ``log_softmax`` and ``NLLLoss`` (mean) on 100
    points of two spirals (``test_ensemble_regression``): ``grad1`` of each point, and the
    per-example norms, against the oracle."""
    model = seeded(MLPClassifier).double()
    torch.manual_seed(1)
    points, labels = spirals(100)
    want = vmap_grad(model, lambda out, t: F.nll_loss(out, t, reduction="sum"), points, labels)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        nn.NLLLoss()(model(points), labels).backward()
    assert_grad1(model, want, "MLPClassifier")
    for n, norm in h.param_norms().items():
        assert_close(norm, want[n].flatten(1).norm(dim=1), f"norms of {n}")


def lennard_jones_loss(model, drs, energies_t, forces_t):
    """functorch's ``test_lennard_jones_batched_jacrev``: energies from the distances, forces
    from the network's derivative with respect to its input (``create_graph=True``)."""
    norms = drs.norm(dim=1).reshape(-1, 1).requires_grad_()
    energies = model(norms)
    (deriv,) = torch.autograd.grad(energies.sum(), norms, create_graph=True)
    forces = -deriv * drs / norms
    return ((energies - energies_t) ** 2).sum() + 0.01 * ((forces - forces_t) ** 2).sum() / 3


def test_functorch_lennard_jones_loss_of_input_derivatives_is_refused():
    """A loss built from the network's derivative with respect to its input (forces from an
    energy model, functorch's ``test_lennard_jones_batched_jacrev``) has per-example
    gradients through the double backward, which hooks do not see: refused (naming the layer
    and ``create_graph``) with no ``grad1`` written, never a silently wrong one. The loop
    gives the reference."""
    model = seeded(
        lambda: nn.Sequential(
            nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
        )
    ).double()
    r = torch.linspace(0.5, 1.0, 6, dtype=DOUBLE)
    drs = torch.outer(r, torch.tensor([1.0, 0.0, 0.0], dtype=DOUBLE))
    e_t, f_t = torch.randn(6, 1, dtype=DOUBLE), torch.randn(6, 3, dtype=DOUBLE)
    with (
        gradhooks.add_hooks(model, loss_reduction="sum"),
        pytest.raises(gradhooks.UnsupportedError, match=r"(?s)Linear.*create_graph=True"),
    ):
        lennard_jones_loss(model, drs, e_t, f_t).backward()
    assert not any(hasattr(p, "grad1") for p in model.parameters())


def test_functorch_functional_call_and_vmap_grad_under_hooks():
    """The functorch idioms on a hooked model: ``functional_call(model, params, x)`` with
    other parameter tensors (the tutorial's ``ft_compute_grad``) gives those tensors their
    ``grad1``; ``vmap(grad(...))`` run while the hooks are on is unaffected by them and
    leaves no ``grad1``; a plain backward afterwards gives ``grad1`` equal to it."""
    from torch.func import functional_call, grad, vmap

    model = seeded(lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))).double()
    torch.manual_seed(1)
    x = torch.randn(5, 3, dtype=DOUBLE)
    other = {n: (2 * p.detach()).requires_grad_() for n, p in model.named_parameters()}
    doubled = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in doubled.named_parameters():
            p.copy_(other[n])
    params = {n: p.detach() for n, p in model.named_parameters()}

    def one(params, xi):
        return sq(functional_call(model, params, (xi.unsqueeze(0),)))

    want = vmap(grad(one), in_dims=(None, 0))(params, x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(functional_call(model, other, (x,))).backward()
        for n, g in vmap_grad(doubled, sq, x).items():
            assert_close(other[n].grad1, g, f"functional_call: {n}")
        assert not any(hasattr(p, "grad1") for p in model.parameters())
        got = vmap(grad(one), in_dims=(None, 0))(params, x)
        assert not any(hasattr(p, "grad1") for p in model.parameters())
        sq(model(x)).backward()
    for n, p in model.named_parameters():
        assert_close(got[n], want[n], f"vmap(grad) under hooks: {n}")
        assert_close(p.grad1, want[n], f"grad1: {n}")


# == Opacus: per_sample_gradients_utils_test.py, hypothesis over Conv1d and Linear ==========

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(
    n=st.integers(0, 4),
    c=st.sampled_from([1, 3, 6]),
    w=st.integers(6, 10),
    grow=st.booleans(),
    kernel_size=st.integers(2, 3),
    stride=st.integers(1, 2),
    padding=st.sampled_from([0, 1, 2, "same", "valid"]),
    dilation=st.integers(1, 2),
    pick=st.integers(0, 11),
)
def test_opacus_conv1d_settings_by_hypothesis(
    n, c, w, grow, kernel_size, stride, padding, dilation, pick
):
    """Conv1d over batch size (0 to 4), channels growing or shrinking, kernel, stride,
    padding (int, "same", "valid"), dilation and groups: Opacus'
    ``PerSampleGradientsUtilsTest.test_conv1d``. An empty batch gives an empty ``grad1``
    (where Opacus raises). The groups are drawn among the common divisors of the channels."""
    out_channels = 2 * c if grow else max(c // 2, 1)
    stride = 1 if padding == "same" else stride  # (torch refuses "same" with strides)
    divisors = [g for g in range(1, 13) if c % g == 0 and out_channels % g == 0]
    groups = divisors[pick % len(divisors)]
    conv = seeded(
        lambda: nn.Conv1d(c, out_channels, kernel_size, stride, padding, dilation, groups)
    ).double()
    x = torch.randn(n, c, w, dtype=DOUBLE)
    want = vmap_grad(conv, sq, x)
    with gradhooks.add_hooks(conv, loss_reduction="sum"):
        sq(conv(x)).backward()
    assert_grad1(conv, want, "conv1d")


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(
    n=st.integers(0, 4),
    z=st.integers(1, 4),
    h=st.integers(1, 3),
    w=st.integers(3, 7),
    input_dim=st.integers(2, 4),
    bias=st.booleans(),
    batch_first=st.booleans(),
)
def test_opacus_linear_settings_by_hypothesis(n, z, h, w, input_dim, bias, batch_first):
    """Linear on inputs of 2 to 4 dimensions, batch-first or not (``batch_dim=1``), with and
    without bias, batch sizes 0 to 4: Opacus' ``PerSampleGradientsUtilsTest.test_linear``
    (``GradSampleModule(batch_first=...)``)."""
    hypothesis.assume(batch_first or input_dim > 2)
    shape = {2: [n, w], 3: [n, z, w], 4: [n, z, h, w]}[input_dim]
    linear = seeded(lambda: nn.Linear(w, w + 2, bias=bias)).double()
    x = torch.randn(*shape, dtype=DOUBLE)
    want = vmap_grad(linear, sq, x)
    if not batch_first:
        x = x.transpose(0, 1)
    with gradhooks.add_hooks(linear, loss_reduction="sum", batch_dim=0 if batch_first else 1):
        sq(linear(x)).backward()
    assert_grad1(linear, want, f"linear {shape}, batch_first={batch_first}")


# == Opacus: per_sample_gradient_clip_test.py, gradient_accumulation_test.py ================


class ClipNet(nn.Module):
    """Opacus' ``SampleConvNet`` of its clipping and accumulation tests (narrower): a Conv2d,
    a max-pool, the spatial positions flattened into a sequence for a Conv1d, a frozen Conv1d,
    a Linear over the last dimension of ``[batch, channels, positions]``, a Linear head."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 4, 2)
        self.conv2 = nn.Conv1d(4, 6, 3, 1)
        self.convf = nn.Conv1d(6, 6, 1, 1)
        self.convf.requires_grad_(False)
        self.fc1 = nn.Linear(7, 5)
        self.fc2 = nn.Linear(6 * 5, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2, 2)  # [B, 4, 3, 3]
        x = x.view(x.shape[0], x.shape[1], x.shape[2] * x.shape[3])  # [B, 4, 9]
        x = self.fc1(self.convf(F.relu(self.conv2(x))))  # [B, 6, 5]
        return self.fc2(x.view(-1, x.shape[-2] * x.shape[-1]))


def clip_data(n: int = 8):
    torch.manual_seed(3)
    return torch.randn(n, 1, 14, 14, dtype=DOUBLE), torch.randint(0, 10, (n,))


def ce_sum(out, t):
    return F.cross_entropy(out, t, reduction="sum")


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_opacus_flat_clipping_of_a_net_with_a_frozen_layer(method):
    """Flat clipping to a small norm: each layer's clipped gradient is smaller than its
    unclipped one and not zero, and equals the oracle's clipped mean; the frozen layer gets
    nothing: Opacus' ``test_clipped_grad_norm_is_smaller`` / ``_not_zero`` (its
    ``ConstantFlatClipper``)."""
    model = seeded(ClipNet).double()
    x, y = clip_data()
    want = vmap_grad(model, ce_sum, x, y)
    clipped = clipped_by_oracle(want, max_norm=1e-3)
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        gradhooks.dp_sgd_step(
            h, F.cross_entropy(model(x), y, reduction="none"), max_norm=1e-3,
            noise_multiplier=0.0, method=method,
        )  # fmt: skip
    for n, p in trainable(model):
        assert_close(p.grad, clipped[n] / 8, f"{method}: {n}")
        assert 0 < p.grad.norm() < want[n].mean(0).norm(), n
    assert model.convf.weight.grad is None and not hasattr(model.convf.weight, "grad1")


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_opacus_clipping_to_a_high_value_does_nothing(method):
    """Clipping to a norm above every example's gives the plain mean gradient: Opacus'
    ``test_clipping_to_high_value_does_nothing``."""
    model = seeded(ClipNet).double()
    x, y = clip_data()
    F.cross_entropy(model(x), y).backward()
    plain = {n: p.grad.clone() for n, p in trainable(model)}
    model.zero_grad()
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        norms = gradhooks.dp_sgd_step(
            h, F.cross_entropy(model(x), y, reduction="none"), max_norm=1e6,
            noise_multiplier=0.0, method=method,
        )  # fmt: skip
    assert (norms < 1e6).all()
    for n, p in trainable(model):
        assert_close(p.grad, plain[n], f"{method}: {n}")


def test_opacus_per_layer_clipping_from_parameter_norms():
    """Per-layer clipping (Opacus' ``ConstantPerLayerClipper``, fastDP's
    ``clipping_style="param-wise"``): each parameter's per-example gradient clipped to its own
    norm, from ``Hooks.param_norms()`` and ``grad1``, equals the oracle's; with high norms it
    does nothing (``test_clipping_to_high_value_does_nothing_per_layer``)."""
    model = seeded(ClipNet).double()
    x, y = clip_data()
    want = vmap_grad(model, ce_sum, x, y)
    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("grad1", "norms")) as h:
        ce_sum(model(x), y).backward()
    norms = h.param_norms()
    assert set(norms) == {n for n, _ in trainable(model)}
    for max_norm in (1e-3, 1e6):
        for n, p in trainable(model):
            assert_close(norms[n], want[n].flatten(1).norm(dim=1), f"norms of {n}")
            factor = (max_norm / norms[n]).clamp(max=1.0)
            got = torch.einsum("b,b...->...", factor, p.grad1)
            ref = torch.einsum(
                "b,b...->...", (max_norm / want[n].flatten(1).norm(dim=1)).clamp(max=1.0), want[n]
            )
            assert_close(got, ref, f"per-layer clipped {n} at {max_norm}")
            if max_norm > 1:
                assert_close(got, p.grad, f"unclipped {n}")


def test_opacus_accumulation_over_a_dataset_equals_its_gradient():
    """Clipped gradients accumulated over every physical batch of a dataset, clipping at 999
    and no noise, are the mean gradient over the whole dataset: Opacus'
    ``test_privacy_engine_no_poisson_accumulation`` (its ``test_grad_sample_accumulation``
    checks the same sum)."""
    model = seeded(ClipNet).double()
    x, y = clip_data(16)
    F.cross_entropy(model(x), y).backward()
    plain = {n: p.grad.clone() for n, p in trainable(model)}
    model.zero_grad()
    start = copy.deepcopy(model.state_dict())
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD([p for _, p in trainable(model)], lr=1.0), h, max_grad_norm=999.0,
            noise_multiplier=0.0, expected_batch_size=16,
        )  # fmt: skip
        for part in (slice(0, 4), slice(4, 5), slice(5, 12), slice(12, 16)):
            opt.backward(F.cross_entropy(model(x[part]), y[part], reduction="none"))
        assert opt.examples == 16
        opt.step()
    for n, p in trainable(model):
        assert_close(p.detach(), start[n] - plain[n], f"step of {n}")


def test_opacus_steps_without_zero_grad_use_their_own_batch():
    """Two DP steps with no ``zero_grad`` between them: the second step's gradient is its own
    batch's clipped mean, not added to the first's (Opacus refuses the missing ``zero_grad``,
    ``test_privacy_engine_zero_grad``; gradhooks' step replaces ``p.grad``)."""
    model = seeded(ClipNet).double()
    x, y = clip_data(12)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD([p for _, p in trainable(model)], lr=0.5), h, max_grad_norm=0.05,
            noise_multiplier=0.0, expected_batch_size=6,
        )  # fmt: skip
        opt.backward(F.cross_entropy(model(x[:6]), y[:6], reduction="none"))
        opt.step()
        snapshot = copy.deepcopy(model)
        opt.backward(F.cross_entropy(model(x[6:]), y[6:], reduction="none"))
        opt.step()
    with gradhooks.paused():
        want = clipped_by_oracle(vmap_grad(snapshot, ce_sum, x[6:], y[6:]), max_norm=0.05)
    for n, p in trainable(model):
        assert_close(p.grad, want[n] / 6, f"second step's gradient of {n}")
        assert_close(p.detach(), snapshot.get_parameter(n).detach() - 0.5 * want[n] / 6, n)


# == Opacus: grad_sample_module_fast_gradient_clipping_test.py ==============================


class FastClipModule(nn.Module):
    """Opacus' ``SampleModule`` of its fast-gradient-clipping test (hidden width 16 for its
    1024): Linear, ReLU, LayerNorm, three Linear, a softmax over the sequence."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(2, 2)
        self.fc3 = nn.Linear(2, 16)
        self.fc4 = nn.Linear(16, 16)
        self.fc5 = nn.Linear(16, 1)
        self.layer_norm = nn.LayerNorm(2)

    def forward(self, x):
        x = self.layer_norm(F.relu(self.fc1(x)))
        x = self.fc5(self.fc4(self.fc3(x))).flatten(start_dim=1)
        return F.softmax(x, dim=1)


def soft_ce(out, t):
    """Cross-entropy with class-probability targets (float targets), summed."""
    return F.cross_entropy(out, t, reduction="sum")


@pytest.mark.parametrize("length", [1, 5])
@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_opacus_fast_gradient_clipping_norms_and_gradients(method, length):
    """Per-parameter per-example norms (Opacus' ``_norm_sample``) and the clipped gradient of
    its ``SampleModule`` on ``[10, length, 2]`` sequences under cross-entropy with
    probability targets: ``test_norm_calculation_fast_gradient_clipping`` and
    ``test_gradient_calculation_fast_gradient_clipping``, here in float64 against the oracle
    (Opacus compares its two engines at ``atol=1e-3``)."""
    model = seeded(FastClipModule).double()
    torch.manual_seed(1)
    x = torch.randn(10, length, 2, dtype=DOUBLE)
    t = torch.randint(0, 2, (10, length)).double()
    want = vmap_grad(model, soft_ce, x, t)
    quantities = ("grad1", "norms") if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        norms = gradhooks.dp_sgd_step(
            h, F.cross_entropy(model(x), t, reduction="none"), max_norm=1.0,
            noise_multiplier=0.0, method=method,
        )  # fmt: skip
        per_param = h.param_norms()
    flat = torch.cat([g.flatten(1) for g in want.values()], 1)
    assert_close(norms, flat.norm(dim=1), "per-example norms")
    for n, g in want.items():
        assert_close(per_param[n], g.flatten(1).norm(dim=1), f"norms of {n}")
    clipped = clipped_by_oracle(want, max_norm=1.0)
    for n, p in trainable(model):
        assert_close(p.grad, clipped[n] / 10, f"{method}: {n}")


class OneDimEmbedding(nn.Module):
    """Opacus' ``SampleEmbeddingModule``: an embedding of 3 rows of width 1."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(3, 1)
        with torch.no_grad():
            self.embedding.weight.copy_(torch.tensor([[0.1], [0.2], [0.3]]))

    def forward(self, x):
        return self.embedding(x)


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_opacus_fast_clipping_embedding_with_repeated_indices(method):
    """An embedding looked up twice at the same row within one example (``[[1, 1], [2, 0],
    [2, 0]]``), its ``[3, 2, 1]`` output read by cross-entropy as 2 classes at 1 position:
    the ghost norm must add the repeated row's two contributions before squaring. Opacus'
    ``GradSampleModuleFastGradientClippingEmbeddingLayerTest`` (norms and gradients)."""
    model = OneDimEmbedding().double()
    x = torch.tensor([[1, 1], [2, 0], [2, 0]])
    t = torch.tensor([[[0.1], [0.1]], [[0.2], [0.3]], [[0.2], [0.3]]], dtype=DOUBLE)

    def loss(out, tt):
        return F.cross_entropy(out, tt, reduction="none").sum()

    want = vmap_grad(model, loss, x, t)
    quantities = ("grad1", "norms") if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        norms = gradhooks.dp_sgd_step(
            h, F.cross_entropy(model(x), t, reduction="none").sum(1), max_norm=0.02,
            noise_multiplier=0.0, method=method,
        )  # fmt: skip
    assert_close(norms, want["embedding.weight"].flatten(1).norm(dim=1), "norms")
    assert (norms > 0.02).any(), "the case must clip"
    clipped = clipped_by_oracle(want, max_norm=0.02)
    assert_close(model.embedding.weight.grad, clipped["embedding.weight"] / 3, method)


EMBEDDING_INDICES = {
    "two-per-example-repeated": (1, lambda: torch.tensor([[1, 1], [2, 0], [2, 0]])),
    "one-per-example-3d": (2, lambda: torch.tensor([1, 1, 2, 0, 2, 0]).view(6, 1, 1)),
    "six-per-example-many-repeats": (
        1,
        lambda: torch.tensor(
            [[0] * 6, [1] + [0] * 5, [2, 3, 4, 5, 6, 7], [4, 3] + [0] * 4, [8, 7, 9, 6, 5, 0]]
        ).view(5, 6, 1),
    ),
}


@pytest.mark.parametrize("case", list(EMBEDDING_INDICES))
@pytest.mark.parametrize("per_example_grads", ["varying", "constant"])
def test_opacus_embedding_norm_sample(case, per_example_grads):
    """Per-example norms of an embedding's weight gradient where an example looks up the same
    row several times (up to six), with index tensors of 2 and 3 dimensions and widths 1 and
    2: Opacus' ``embedding_norm_sample_test.py`` (``compute_embedding_norm_sample``), whose
    output-gradients are constant within an example (so that repeated rows add up) or here
    also varying."""
    dim, indices = EMBEDDING_INDICES[case]
    idx = indices()
    model = seeded(lambda: nn.Embedding(10, dim)).double()
    torch.manual_seed(1)
    shape = (*idx.shape, dim)
    if per_example_grads == "constant":
        weights = torch.randn(idx.shape[0], dtype=DOUBLE).view(-1, *[1] * (len(shape) - 1))
        weights = weights.expand(shape)
    else:
        weights = torch.randn(shape, dtype=DOUBLE)

    def loss(out, w):
        return (out * w).sum()

    want = vmap_grad(model, loss, idx, weights)["weight"].flatten(1).norm(dim=1)
    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("norms",)) as h:
        loss(model(idx), weights).backward()
    assert_close(h.param_norms()["weight"], want, case)
    assert_close(h.norms(), want, case)


class TimeMajorClassifier(nn.Module):
    """A time-major body (``[T, batch, F]``) averaged over time, then a linear head."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body, self.head = body, nn.Linear(4, 3)

    def forward(self, x):
        out = self.body(x)
        return self.head((out[0] if isinstance(out, tuple) else out).mean(0))


class SeenBatchFirst(nn.Module):
    """The oracle's view of a time-major model: ``[batch, T, F]`` in."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.m = model

    def forward(self, x):
        return self.m(x.transpose(0, 1))


TIME_MAJOR_BODIES = {
    "lstm": lambda: nn.LSTM(4, 4),
    "gru-two-layers-bidirectional": lambda: nn.GRU(4, 2, 2, bidirectional=True),
    "self-attention": MHAOutput,  # (time-major: nn.MultiheadAttention's default)
    "transformer-encoder-layer": lambda: nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0),
}


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
@pytest.mark.parametrize("body", list(TIME_MAJOR_BODIES))
def test_opacus_time_major_dp_step(body, method):
    """The DP-SGD step of a time-major model (``batch_dim=1``: an LSTM, a bidirectional GRU,
    self-attention, a transformer encoder layer, each under a linear head), by every method:
    Opacus' ``GradSampleModule(batch_first=False)`` under its ``DPOptimizer`` (its RNN and
    attention examples), against the clipped mean of the loop run batch-first."""
    model = seeded(lambda: TimeMajorClassifier(TIME_MAJOR_BODIES[body]())).double()
    torch.manual_seed(1)
    x, y = torch.randn(5, 6, 4, dtype=DOUBLE), torch.randint(0, 3, (6,))
    by_loop = loop_grad(SeenBatchFirst(model), ce_sum, x.transpose(0, 1).contiguous(), y)
    want = clipped_by_oracle({n.removeprefix("m."): g for n, g in by_loop.items()}, 0.1)
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities, batch_dim=1) as h:
        gradhooks.dp_sgd_step(
            h, F.cross_entropy(model(x), y, reduction="none"), max_norm=0.1,
            noise_multiplier=0.0, method=method,
        )  # fmt: skip
    for n, p in model.named_parameters():
        assert_close(p.grad, want[n] / 6, f"{body} {method}: {n}")


COUPLED_LOSSES = {
    "plus-a-batch-mean-of-outputs": lambda out, loss: loss + out.mean(),
    "centred-on-the-batch-mean": lambda out, loss: loss - loss.mean(),
}


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
@pytest.mark.parametrize("coupling", list(COUPLED_LOSSES))
def test_opacus_per_sample_losses_that_couple_the_examples_are_refused(coupling, method):
    """ "Per-sample" losses each of which depends on the whole batch (a batch mean added to
    each, losses centred on their mean): clipping them cannot bound one example's influence,
    and the hooks' rows are not their gradients. Opacus' ``DPLossFastGradientClipping`` and
    fastDP take such a vector as it comes; every gradhooks method refuses the step
    (:class:`gradhooks.CheckFailedError`, naming the parameters) with no ``.grad`` written."""
    model = seeded(lambda: nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))).double()
    torch.manual_seed(1)
    x, y = torch.randn(6, 4, dtype=DOUBLE), torch.randint(0, 3, (6,))
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        out = model(x)
        losses = COUPLED_LOSSES[coupling](out, F.cross_entropy(out, y, reduction="none"))
        with pytest.raises(gradhooks.CheckFailedError, match=r"'0\.weight'"):
            gradhooks.dp_sgd_step(h, losses, max_norm=0.1, noise_multiplier=0.0, method=method)
    assert all(p.grad is None for p in model.parameters())


class WithUnusedLayers(nn.Module):
    """A model with trainable layers its forward does not use (a branch not taken)."""

    def __init__(self):
        super().__init__()
        self.used, self.unused, self.emb = nn.Linear(4, 3), nn.Linear(4, 3), nn.Embedding(5, 3)

    def forward(self, x):
        return self.used(x)


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_opacus_parameters_without_a_gradient_get_the_noise_alone(method):
    """Trainable parameters the forward did not use: the clipped sum is the used layer's
    (its norms those of the used parameters), the unused ones get a zero clipped sum and,
    with noise, the noise alone (standard deviation σC/B), as DP-SGD's definition has it.
    Opacus' DPOptimizer raises "Per sample gradient is not initialized" for them."""
    model = seeded(WithUnusedLayers).double()
    torch.manual_seed(1)
    x, y = torch.randn(6, 4, dtype=DOUBLE), torch.randint(0, 3, (6,))
    clipped = clipped_by_oracle(vmap_grad(model, ce_sum, x, y), 0.1)
    start = copy.deepcopy(model)
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        gradhooks.dp_sgd_step(
            h, F.cross_entropy(model(x), y, reduction="none"), max_norm=0.1,
            noise_multiplier=0.0, method=method,
        )  # fmt: skip
        for n, p in model.named_parameters():
            assert_close(p.grad, clipped[n] / 6, f"{method}: {n}")
        assert not model.unused.weight.grad.any()
        model.zero_grad()
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=1.0), h, max_grad_norm=0.1,
            noise_multiplier=4.0, expected_batch_size=6, generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
        opt.backward(F.cross_entropy(model(x), y, reduction="none"))
        opt.step()
    moved = torch.cat([(p - start.get_parameter(n)).flatten() for n, p in model.named_parameters()
                       if not n.startswith("used.")])  # fmt: skip
    assert 0.8 < moved.std().item() / (4.0 * 0.1 / 6) < 1.2, moved.std()  # (33 coordinates)


def norm_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv1d(3, 4, 3), nn.GroupNorm(2, 4), nn.Tanh(), nn.Flatten(), nn.Linear(16, 5),
        nn.LayerNorm(5), nn.Linear(5, 3),
    )  # fmt: skip


FROZEN = {
    "conv-bias": ["0.bias"],
    "conv-weight": ["0.weight"],
    "group-norm-weight": ["1.weight"],
    "linear-bias": ["4.bias"],
    "layer-norm-weight": ["5.weight"],
    "bitfit-biases-only": ["0.weight", "1.weight", "4.weight", "5.weight", "6.weight"],
}


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
@pytest.mark.parametrize("frozen", list(FROZEN))
def test_fastdp_one_parameter_of_a_layer_frozen(frozen, method):
    """A layer with one of its parameters frozen (a bias, a weight, a norm's scale), or only
    the biases trained (fastDP's DP-BiTFiT): the per-example norms and the clipped step
    count only what is trained, and the frozen parameters get no gradient. Opacus' frozen
    parameter tests, fastDP's ``bias-only`` fine-tuning."""
    model = seeded(norm_net).double()
    for n in FROZEN[frozen]:
        model.get_parameter(n).requires_grad_(False)
    torch.manual_seed(1)
    x, y = torch.randn(6, 3, 6, dtype=DOUBLE), torch.randint(0, 3, (6,))
    want = vmap_grad(model, ce_sum, x, y)
    clipped = clipped_by_oracle(want, 0.05)
    quantities = ("grad1", "norms") if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        norms = gradhooks.dp_sgd_step(
            h, F.cross_entropy(model(x), y, reduction="none"), max_norm=0.05,
            noise_multiplier=0.0, method=method,
        )  # fmt: skip
        assert set(h.param_norms()) == set(want)
    assert_close(norms, torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1), "norms")
    for n, p in model.named_parameters():
        if n in FROZEN[frozen]:
            assert p.grad is None, n
        else:
            assert_close(p.grad, clipped[n] / 6, f"{method}: {n}")


class HeadMaskedAttention(nn.Module):
    """Attention whose mask is per example and per head (``[batch, heads, L, S]`` folded to
    torch's ``[batch · heads, L, S]``), its attention weights returned per head."""

    def __init__(self):
        super().__init__()
        self.m = nn.MultiheadAttention(6, 2, batch_first=True)

    def forward(self, q, k, mask):
        mask = mask.reshape(-1, *mask.shape[-2:])
        return self.m(q, k, k, attn_mask=mask, need_weights=True, average_attn_weights=False)


class MaskedTransformer(nn.Module):
    """``nn.Transformer`` with a causal target mask and a source padding mask."""

    def __init__(self):
        super().__init__()
        self.t = nn.Transformer(d_model=6, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                dim_feedforward=8, dropout=0.0, batch_first=True)  # fmt: skip

    def forward(self, src, tgt, pad):
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], dtype=src.dtype)
        return self.t(src, tgt, tgt_mask=causal, src_key_padding_mask=pad,
                      memory_key_padding_mask=pad)  # fmt: skip


def attention_inputs(mask: str):
    torch.manual_seed(1)
    q, k = torch.randn(3, 4, 6, dtype=DOUBLE), torch.randn(3, 5, 6, dtype=DOUBLE)
    if mask == "float":
        return q, k, torch.randn(3, 2, 4, 5, dtype=DOUBLE)
    keep = torch.rand(3, 2, 4, 5) > 0.7
    keep[..., 0] = False  # (every query sees a key)
    return q, k, keep


def transformer_inputs():
    torch.manual_seed(1)
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[1, 3:] = True
    return torch.randn(3, 5, 6, dtype=DOUBLE), torch.randn(3, 4, 6, dtype=DOUBLE), pad


MASKED = [
    ("attention-float-mask-per-head", HeadMaskedAttention, lambda: attention_inputs("float")),
    ("attention-bool-mask-per-head", HeadMaskedAttention, lambda: attention_inputs("bool")),
    ("transformer-causal-and-padding", MaskedTransformer, transformer_inputs),
]


@pytest.mark.parametrize("factory,inputs", [m[1:] for m in MASKED], ids=[m[0] for m in MASKED])
def test_opacus_attention_masks_and_weights(factory, inputs):
    """Attention with a float or boolean mask that differs per example and per head (torch's
    ``[batch · heads, L, S]`` layout), its per-head attention weights in the loss, and
    ``nn.Transformer`` with causal and padding masks: Opacus' ``dp_multihead_attention_test``
    (``attn_mask``, ``need_weights``) and its transformer tests, against the loop."""
    model = seeded(factory).double()
    args = inputs()

    def loss(out, t=None):
        return sq(out) + sum((o**3).sum() for o in (out if isinstance(out, tuple) else (out,)))

    want = loop_grad(model, loss, args)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        loss(model(*args)).backward()
    assert_grad1(model, want, factory.__name__)


# == Opacus: poisson_test.py, dpdataloader_test.py, privacy_engine_test.py ===================


def test_opacus_poisson_batches_sizes_and_empty_batches():
    """Poisson sampling: each batch holds each example independently with probability ``q``
    (sizes binomial, sorted distinct indices in range), some batches are empty, and an
    empty batch comes out of the loader with 0 rows and the feature shape: Opacus'
    ``PoissonSamplingTest`` and ``DPDataLoaderTest.test_collate_classes`` /
    ``test_batch_sizes`` (an empty batch keeps its shape)."""
    from torch.utils.data import TensorDataset

    sampler = gradhooks.PoissonSampler(
        1000, 10, steps=400, generator=torch.Generator().manual_seed(0)
    )
    sizes = []
    for batch in sampler:
        assert batch == sorted(set(batch)) and all(0 <= i < 1000 for i in batch)
        sizes.append(len(batch))
    sizes = torch.tensor(sizes, dtype=DOUBLE)
    # binomial(1000, 0.01): mean 10, sd 3.15; the mean of 400 within 4 standard errors
    assert abs(sizes.mean().item() - 10) < 4 * 3.15 / 20, sizes.mean()
    assert abs(sizes.std().item() - 3.146) < 0.5, sizes.std()
    data = TensorDataset(torch.randn(50, 3, 4), torch.arange(50))
    loader = gradhooks.poisson_loader(
        data, 0.5, steps=40, generator=torch.Generator().manual_seed(1)
    )
    shapes = [(tuple(x.shape), tuple(y.shape), y.dtype) for x, y in loader]
    assert ((0, 3, 4), (0,), torch.int64) in shapes
    assert all(s[0][1:] == (3, 4) for s in shapes)


def test_opacus_make_private_step_is_the_clipped_mean_over_the_poisson_batch():
    """``make_private`` without noise: each logical step moves the model by ``lr`` times the
    clipped sum of the Poisson batch's per-example gradients over the expected batch size,
    whatever physical batches the batch was split into: Opacus' ``PrivacyEngine`` tests with
    ``noise_multiplier=0`` (``test_basic``, ``BatchMemoryManager``'s ``test_equivalent_to_one_batch``)."""
    from torch.utils.data import TensorDataset

    model = seeded(lambda: nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))).double()
    torch.manual_seed(1)
    data = TensorDataset(torch.randn(40, 4, dtype=DOUBLE), torch.randint(0, 3, (40,)))
    private = gradhooks.make_private(
        model, torch.optim.SGD(model.parameters(), lr=1.0), data, delta=1e-3,
        max_grad_norm=0.1, noise_multiplier=0.0, steps=3, expected_batch_size=8,
        max_physical_batch_size=3, generator=torch.Generator().manual_seed(2),
    )  # fmt: skip
    try:
        logical, before, stepped = [], copy.deepcopy(model), 0
        for x, y in private.batches():
            logical.append((x, y))
            private.backward(F.cross_entropy(model(x), y, reduction="none"))
            if private.step():
                xs, ys = torch.cat([b[0] for b in logical]), torch.cat([b[1] for b in logical])
                with gradhooks.paused():
                    want = clipped_by_oracle(vmap_grad(before, ce_sum, xs, ys), max_norm=0.1)
                for n, p in model.named_parameters():
                    start = before.get_parameter(n).detach()
                    assert_close(p.detach(), start - want[n] / 8, f"step {stepped}: {n}")
                logical, before, stepped = [], copy.deepcopy(model), stepped + 1
        assert stepped == 3
    finally:
        private.close()


# == private-transformers: tests/test_privacy_engine.py; fastDP (book-keeping, LoRA) =========


def transformers_or_skip():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


VOCAB, SEQ = 30, 6


def tiny_classifier(kind: str) -> nn.Module:
    """A 2-layer BERT / RoBERTa / ALBERT sequence classifier, width 8, no dropout."""
    tf = transformers_or_skip()
    common = dict(
        hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=12,
        vocab_size=VOCAB, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=2,
    )  # fmt: skip
    if kind == "bert":
        return tf.BertForSequenceClassification(tf.BertConfig(**common))
    if kind == "roberta":
        return tf.RobertaForSequenceClassification(tf.RobertaConfig(**common, pad_token_id=1))
    cfg = tf.AlbertConfig(**common, embedding_size=4, classifier_dropout_prob=0.0)
    return tf.AlbertForSequenceClassification(cfg)  # (its layers share their parameters)


def tiny_lm(kind: str, tied: bool) -> nn.Module:
    """A 2-layer GPT-2, OpenAI-GPT or OPT language model, width 8, no dropout, with the
    output layer tied to the word embeddings or not."""
    tf = transformers_or_skip()
    if kind == "gpt2":
        cfg = tf.GPT2Config(n_embd=8, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=16,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            tie_word_embeddings=tied)  # fmt: skip
        return tf.GPT2LMHeadModel(cfg)
    if kind == "openai-gpt":
        cfg = tf.OpenAIGPTConfig(n_embd=8, n_layer=2, n_head=2, vocab_size=VOCAB,
                                 n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                 attn_pdrop=0.0, tie_word_embeddings=tied)  # fmt: skip
        return tf.OpenAIGPTLMHeadModel(cfg)
    cfg = tf.OPTConfig(hidden_size=8, num_hidden_layers=2, ffn_dim=12, num_attention_heads=2,
                       vocab_size=VOCAB, max_position_embeddings=16, word_embed_proj_dim=8,
                       dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                       layerdrop=0.0, do_layer_norm_before=kind == "opt", pad_token_id=1,
                       tie_word_embeddings=tied)  # fmt: skip
    return tf.OPTForCausalLM(cfg)


class Logits(nn.Module):
    """A Hugging Face model called on ``input_ids`` alone, its logits out."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).logits


def lm_losses(logits: Tensor, ids: Tensor) -> Tensor:
    """private-transformers' per-example language-model loss: the cross-entropy of each next
    token, averaged over the sequence, ``[batch]``."""
    shifted = logits[..., :-1, :].permute(0, 2, 1)
    return F.cross_entropy(shifted, ids[..., 1:], reduction="none").mean(dim=1)


def dp_step_against_the_loop(model, batches, per_example, max_norm, method, lr=1.0):
    """DPOptimizer over ``batches`` (the physical batches of one logical batch, tuples whose
    first tensor is the model's input), no noise, SGD with ``lr``: the per-example norms are
    the loop's, and the parameters move by ``lr`` times the loop's clipped sum over the
    examples divided by their number. ``per_example(output, batch)`` gives the ``[batch]``
    losses. private-transformers' ``virtual_step`` / ``step`` against its loop that clips
    example by example."""
    whole = tuple(torch.cat([b[k] for b in batches]) for k in range(len(batches[0])))
    size = whole[0].shape[0]
    params = trainable(model)
    rows = []
    for i in range(size):  # (backward, not autograd.grad: reentrant checkpointing needs it)
        one = tuple(t[i : i + 1] for t in whole)
        for _, p in params:
            p.grad = None
        per_example(model(one[0]), one).sum().backward()
        rows.append([p.grad for _, p in params])
    for _, p in params:
        p.grad = None
    want = {n: torch.stack([r[k] for r in rows]) for k, (n, _) in enumerate(params)}
    flat = torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)
    assert (flat > max_norm).any(), "the case must clip"
    clipped = clipped_by_oracle(want, max_norm)
    start = {n: p.detach().clone() for n, p in params}
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    norms = []
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD([p for _, p in params], lr=lr), h, max_grad_norm=max_norm,
            noise_multiplier=0.0, expected_batch_size=size, method=method,
        )  # fmt: skip
        for b in batches:
            norms.append(opt.backward(per_example(model(b[0]), b)))
        opt.step()
    assert_close(torch.cat(norms), flat, "per-example norms")
    for n, p in params:
        assert_close(p.detach(), start[n] - lr * clipped[n] / size, f"{method}: step of {n}")


def micro_batches(count: int, size: int, labels: int | None = None):
    torch.manual_seed(5)
    return [
        (torch.randint(2, VOCAB, (size, SEQ)),)
        + (() if labels is None else (torch.randint(0, labels, (size,)),))
        for _ in range(count)
    ]


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
@pytest.mark.parametrize("kind", ["bert", "roberta", "albert"])
def test_private_transformers_classification(kind, method):
    """A sequence classifier (BERT, RoBERTa, ALBERT whose layers share parameters) clipped
    per example over two micro-batches and stepped once: private-transformers'
    ``test_classification`` (``virtual_step`` then ``step``, against clipping one example at
    a time; its ghost clipping skips ALBERT, whose shared parameters gradhooks sums)."""
    model = seeded(lambda: Logits(tiny_classifier(kind))).double().train()

    def losses(logits, b):
        return F.cross_entropy(logits, b[1], reduction="none")

    dp_step_against_the_loop(model, micro_batches(2, 2, labels=2), losses, 0.05, method)


LMS = [("gpt2", True), ("gpt2", False), ("openai-gpt", True), ("opt", True), ("opt", False),
       ("opt-350m-layout", True)]  # fmt: skip


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
@pytest.mark.parametrize("kind,tied", LMS, ids=[f"{k}-{'tied' if t else 'untied'}" for k, t in LMS])
def test_private_transformers_generation(kind, tied, method):
    """A causal language model (GPT-2, OpenAI-GPT, OPT with its layer norms before or, as
    opt-350m, after each block) with tied or untied word embeddings, the per-example loss the
    mean next-token cross-entropy, clipped over two micro-batches: private-transformers'
    ``test_generation`` (whose ghost clipping refuses tied embeddings)."""
    model = seeded(lambda: Logits(tiny_lm(kind, tied))).double().train()
    dp_step_against_the_loop(model, micro_batches(2, 2), lambda out, b: lm_losses(out, b[0]),
                             0.5, method)  # fmt: skip


class Seq2Seq(nn.Module):
    """An encoder-decoder on ``[batch, source + target]`` ids: the first ``source`` are the
    encoder's ``input_ids``, the rest the ``decoder_input_ids``."""

    def __init__(self, model: nn.Module, source: int):
        super().__init__()
        self.model, self.source = model, source

    def forward(self, ids):
        src, tgt = ids[:, : self.source], ids[:, self.source :]
        return self.model(input_ids=src, decoder_input_ids=tgt).logits


def seq2seq_batches(source: int = 7, target: int = 4):
    torch.manual_seed(5)
    return [(torch.randint(3, VOCAB, (2, source + target)),) for _ in range(2)]


@pytest.mark.parametrize("positions", ["frozen", "trained"])
@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_private_transformers_bart_conditional_generation(method, positions):
    """BART (tied embeddings, used by the encoder on 7 tokens and by the decoder on 4) under
    the decoder's mean next-token loss, clipped over two micro-batches, its learned position
    embeddings frozen as private-transformers' ``test_conditional_generation`` freezes them
    (its TODO: "per-sample grad hooks ... for the learned positional embedding layer in
    BART") or trained."""
    tf = transformers_or_skip()
    cfg = tf.BartConfig(d_model=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=12, decoder_ffn_dim=12,
                        vocab_size=VOCAB, max_position_embeddings=16, dropout=0.0,
                        attention_dropout=0.0, activation_dropout=0.0)  # fmt: skip
    bart = seeded(lambda: tf.BartForConditionalGeneration(cfg))
    if positions == "frozen":
        bart.model.encoder.embed_positions.requires_grad_(False)
        bart.model.decoder.embed_positions.requires_grad_(False)
    model = Seq2Seq(bart, 7).double().train()
    dp_step_against_the_loop(
        model, seq2seq_batches(), lambda out, b: lm_losses(out, b[0][:, 7:]), 0.5, method
    )


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_fastdp_gpt2_lora_book_keeping_and_parameter_norms():
    """GPT-2 with LoRA adapters (peft) on its attention, only the adapters trainable: their
    per-example norms, parameter by parameter (fastDP's ``clipping_style="param-wise"``) and
    by layer (``"layer-wise"``: a LoRA pair together), and the book-keeping DP step (fastDP's
    ``clipping_mode="MixOpt"``), against the loop."""
    peft = pytest.importorskip("peft")
    base = seeded(lambda: tiny_lm("gpt2", True))
    config = peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["c_attn"],
                             fan_in_fan_out=True)  # fmt: skip
    model = Logits(peft.get_peft_model(base, config)).double().train()
    torch.manual_seed(6)
    for _, p in trainable(model):  # (LoRA's B starts at zero: a gradient for A too)
        with torch.no_grad():
            p.normal_(0, 0.3)
    ids = micro_batches(1, 4)[0][0]
    params = trainable(model)
    assert params and all("lora_" in n for n, _ in params)
    want = loop_grad(model, lambda out, t: lm_losses(out, t).sum(), ids, ids)
    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("norms",)) as h:
        lm_losses(model(ids), ids).sum().backward()
        per_param = h.param_norms()
    for n, g in want.items():
        assert_close(per_param[n], g.flatten(1).norm(dim=1), f"norms of {n}")
    layers = {n.rsplit(".lora_", 1)[0] for n in want}
    for layer in layers:
        pair = [g.flatten(1) for n, g in want.items() if n.startswith(layer + ".lora_")]
        got = torch.stack([per_param[n] for n in want if n.startswith(layer + ".lora_")])
        assert_close(got.norm(dim=0), torch.cat(pair, 1).norm(dim=1), f"layer norm of {layer}")
    model.zero_grad()
    dp_step_against_the_loop(model, [(ids[:2],), (ids[2:],)], lambda out, b: lm_losses(out, b[0]),
                             0.05, "bookkeeping")  # fmt: skip


def test_private_transformers_t5_conditional_generation():
    """T5 (relative position biases computed once and shared by its layers, tied
    embeddings) under the decoder's mean next-token loss, clipped over two micro-batches
    (book-keeping), the encoder on 7 tokens and the decoder on 4: private-transformers'
    ``test_conditional_generation`` with ``t5-base`` (which it runs in float32 only; here
    float64)."""
    tf = transformers_or_skip()
    cfg = tf.T5Config(d_model=8, d_kv=4, d_ff=12, num_layers=2, num_heads=2, vocab_size=VOCAB,
                      dropout_rate=0.0, relative_attention_num_buckets=8,
                      decoder_start_token_id=0)  # fmt: skip
    model = Seq2Seq(seeded(lambda: tf.T5ForConditionalGeneration(cfg)), 7).double().train()
    dp_step_against_the_loop(
        model, seq2seq_batches(), lambda out, b: lm_losses(out, b[0][:, 7:]), 0.5, "bookkeeping"
    )


class WithMask(nn.Module):
    """A Hugging Face classifier on ``input_ids`` and an ``attention_mask`` (padding)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids, mask):
        return self.model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("method", ["grad1", "bookkeeping"])
def test_fastdp_bert_classification_with_padding(method):
    """A BERT classifier on right-padded sequences (an ``attention_mask`` as long as the
    batch, found as batched beside the ids), clipped over two micro-batches: fastDP's
    ``text_classification`` example (GLUE with padding), against the loop."""
    model = seeded(lambda: WithMask(tiny_classifier("bert"))).double().train()
    torch.manual_seed(4)
    ids = torch.randint(2, VOCAB, (4, SEQ))
    mask = torch.ones(4, SEQ, dtype=torch.long)
    mask[1, 3:], mask[3, 5:] = 0, 0
    y = torch.randint(0, 2, (4,))

    class IdsAndMask(nn.Module):  # (dp_step_against_the_loop feeds one tensor: both stacked)
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, both):
            return self.inner(both[:, 0], both[:, 1])

    batches = [(torch.stack([ids, mask], 1)[k : k + 2], y[k : k + 2]) for k in (0, 2)]
    dp_step_against_the_loop(
        IdsAndMask(model), batches, lambda out, b: F.cross_entropy(out, b[1], reduction="none"),
        0.05, method,
    )  # fmt: skip


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_fastdp_vision_transformer(method):
    """A vision transformer (patch-embedding convolution, class token and position
    embeddings held as parameters of the embedding module) under cross-entropy, clipped
    over two micro-batches: fastDP's ``CIFAR_TIMM`` examples (ViT, DeiT, BEiT), with
    Hugging Face's ``ViTForImageClassification``."""
    tf = transformers_or_skip()
    cfg = tf.ViTConfig(hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=12, image_size=8, patch_size=4, num_channels=3,
                       num_labels=3, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)  # fmt: skip

    class Pixels(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(pixel_values=x).logits

    model = seeded(lambda: Pixels(tf.ViTForImageClassification(cfg))).double().train()
    torch.manual_seed(3)
    batches = [(torch.randn(2, 3, 8, 8, dtype=DOUBLE), torch.randint(0, 3, (2,))) for _ in "ab"]
    dp_step_against_the_loop(
        model, batches, lambda out, b: F.cross_entropy(out, b[1], reduction="none"), 0.05, method
    )


# == Opacus: scheduler_test.py, randomness_test.py, privacy_engine_test.py (noise) ===========


def test_opacus_schedulers_change_the_clipping_norm_and_the_recorded_noise():
    """A clipping-norm schedule and a noise schedule that set the optimizer's
    ``max_grad_norm`` and ``noise_multiplier`` between steps (Opacus' ``GradClipScheduler``
    and ``ExponentialNoise`` / ``StepNoise``, ``scheduler_test.py``): each step clips at the
    norm then set (against the oracle, no noise), and the accountant records each step's
    multiplier."""
    model = seeded(lambda: nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))).double()
    torch.manual_seed(1)
    x, y = torch.randn(6, 4, dtype=DOUBLE), torch.randint(0, 3, (6,))
    accountant = gradhooks.PrivacyAccountant()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0), h, max_grad_norm=1.0,
            noise_multiplier=0.0, expected_batch_size=6, sample_rate=0.1, accountant=accountant,
        )  # fmt: skip
        with gradhooks.paused():
            want = vmap_grad(model, ce_sum, x, y)
        flat = torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)
        for step, gamma in enumerate([1.0, 0.5, 0.25]):
            opt.max_grad_norm = gamma * flat.median().item()
            opt.noise_multiplier = 0.0 if step == 0 else 1.0 - gamma
            opt.backward(F.cross_entropy(model(x), y, reduction="none"))
            noise_free = opt.noise_multiplier == 0
            opt.step()
            if noise_free:
                clipped = clipped_by_oracle(want, opt.max_grad_norm)
                for n, p in model.named_parameters():
                    assert_close(p.grad, clipped[n] / 6, f"step {step}: {n}")
            opt.zero_grad()
    assert accountant.history == [(0.0, 0.1, 1), (0.5, 0.1, 1), (0.75, 0.1, 1)]


def test_opacus_noise_is_reproducible_by_seed_and_fresh_at_each_step():
    """The noise comes from the generator: the same seed gives the same noisy gradients,
    another seed other ones, and two steps never draw the same noise: Opacus'
    ``randomness_test.py`` (``secure_mode=False`` with a seed) and ``test_noise_changes_every_time``."""
    x, y = torch.randn(6, 4, dtype=DOUBLE), torch.randint(0, 3, (6,))

    def noisy_grads(seed: int, steps: int = 2) -> list[Tensor]:
        model = seeded(lambda: nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)))
        model = model.double()
        out = []
        with gradhooks.add_hooks(model, quantities=("norms",)) as h:
            opt = gradhooks.DPOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.0), h, max_grad_norm=1.0,
                noise_multiplier=1.0, expected_batch_size=6,
                generator=torch.Generator().manual_seed(seed),
            )  # fmt: skip
            for _ in range(steps):
                opt.backward(F.cross_entropy(model(x), y, reduction="none"))
                opt.step()
                out.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
                opt.zero_grad()
        return out

    a, b, c = noisy_grads(7), noisy_grads(7), noisy_grads(8)
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    assert not torch.allclose(a[0], c[0]) and not torch.allclose(a[0], a[1])


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_private_transformers_gpt2_classification_on_padded_sequences(method):
    """GPT-2 as a sequence classifier on right-padded sequences: its logits are read at each
    sequence's last token, found from the ids (``logits[arange(batch), last]``), clipped over
    two micro-batches: private-transformers' and fastDP's text classification with GPT-2."""
    tf = transformers_or_skip()
    cfg = tf.GPT2Config(n_embd=8, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=16,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, num_labels=2,
                        pad_token_id=0)  # fmt: skip
    model = seeded(lambda: Logits(tf.GPT2ForSequenceClassification(cfg))).double().train()
    torch.manual_seed(4)
    ids, y = torch.randint(2, VOCAB, (4, SEQ)), torch.randint(0, 2, (4,))
    ids[1, 3:], ids[3, 5:] = 0, 0
    dp_step_against_the_loop(
        model, [(ids[:2], y[:2]), (ids[2:], y[2:])],
        lambda out, b: F.cross_entropy(out, b[1], reduction="none"), 0.05, method,
    )  # fmt: skip


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_fastdp_gpt2_with_gradient_checkpointing(reentrant):
    """GPT-2 with Hugging Face's gradient checkpointing (each block's forward run again in the
    backward), reentrant or not, clipped over two micro-batches (book-keeping): fastDP's
    large-model examples and DP fine-tuning recipes that checkpoint to fit the batch."""
    lm = seeded(lambda: tiny_lm("gpt2", True))
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model = Logits(lm).double().train()
    dp_step_against_the_loop(
        model, micro_batches(2, 2), lambda out, b: lm_losses(out, b[0]), 0.5, "bookkeeping"
    )


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_fastdp_bert_lora_with_a_trained_classifier(method):
    """BERT with LoRA on its query and value projections and its classifier trained in full
    (peft's ``modules_to_save``, which wraps the classifier), clipped over two micro-batches:
    fastDP's and private-transformers' parameter-efficient classification."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["query", "value"],
                             modules_to_save=["classifier"], task_type="SEQ_CLS")  # fmt: skip
    model = Logits(peft.get_peft_model(seeded(lambda: tiny_classifier("bert")), config))
    model = model.double().train()
    torch.manual_seed(6)
    for n, p in trainable(model):  # (LoRA's B starts at zero)
        if "lora_B" in n:
            with torch.no_grad():
                p.normal_(0, 0.3)
    assert any("modules_to_save" in n for n, _ in trainable(model))
    dp_step_against_the_loop(
        model, micro_batches(2, 2, labels=2),
        lambda out, b: F.cross_entropy(out, b[1], reduction="none"), 0.05, method,
    )  # fmt: skip


# == Opacus: models after ModuleValidator.fix, trainable sets that change, mixed precision ====


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, reduced: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(channels, reduced, 1), nn.Conv2d(reduced, channels, 1)

    def forward(self, x):
        scale = self.fc2(F.relu(self.fc1(F.adaptive_avg_pool2d(x, 1))))
        return x * F.hardsigmoid(scale)


class InvertedResidual(nn.Module):
    """MobileNetV3's block with GroupNorm for BatchNorm: expansion, depthwise convolution,
    squeeze-and-excitation, projection, a residual where the shapes allow."""

    def __init__(self, cin: int, expanded: int, cout: int, stride: int):
        super().__init__()
        self.expand = nn.Sequential(
            nn.Conv2d(cin, expanded, 1, bias=False), nn.GroupNorm(2, expanded), nn.Hardswish()
        )
        self.depthwise = nn.Sequential(
            nn.Conv2d(expanded, expanded, 3, stride, 1, groups=expanded, bias=False),
            nn.GroupNorm(2, expanded), nn.Hardswish(),
        )  # fmt: skip
        self.se = SqueezeExcite(expanded, 4)
        self.project = nn.Sequential(
            nn.Conv2d(expanded, cout, 1, bias=False), nn.GroupNorm(2, cout)
        )
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.project(self.se(self.depthwise(self.expand(x))))
        return x + y if self.residual else y


def small_mobilenet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, 2, 1, bias=False), nn.GroupNorm(2, 4), nn.Hardswish(),
        InvertedResidual(4, 8, 4, 1), InvertedResidual(4, 12, 6, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 16), nn.Hardswish(), nn.Linear(16, 10),
    )  # fmt: skip


def test_opacus_mobilenet_v3_after_module_validator_fix():
    """A MobileNetV3 (depthwise convolutions, squeeze-and-excitation, Hardswish, residuals)
    with GroupNorm for BatchNorm, as Opacus' ``ModuleValidator.fix`` makes it: Opacus'
    ``test_custom_module_validation`` (``mobilenet_v3_small``), every parameter by a rule."""
    model = seeded(small_mobilenet).double()
    torch.manual_seed(1)
    x, y = torch.randn(4, 3, 16, 16, dtype=DOUBLE), torch.randint(0, 10, (4,))
    want = vmap_grad(model, ce_sum, x, y)
    with gradhooks.add_hooks(model) as h:
        F.cross_entropy(model(x), y).backward()
    assert_grad1(model, want, "mobilenet")
    assert not list(h.fallback_modules())


def test_opacus_layers_frozen_and_unfrozen_after_hooking():
    """Layers unfrozen or frozen after the hooks were added (fine-tuning that trains more of
    the model as it goes, where Opacus asks for the model to be wrapped again): each
    backward's ``grad1`` covers exactly the parameters trainable then, and a DP step clips
    the new set (against the oracle)."""
    model = seeded(lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))).double()
    model[0].requires_grad_(False)
    torch.manual_seed(1)
    x, y = torch.randn(5, 3, dtype=DOUBLE), torch.randint(0, 2, (5,))
    with gradhooks.add_hooks(model, loss_reduction="sum", quantities=("grad1", "norms")) as h:
        sq(model(x)).backward()
        assert_grad1(model, vmap_grad(model, sq, x), "first layer frozen")
        model.zero_grad()
        model[0].requires_grad_(True)
        sq(model(x)).backward()
        assert_grad1(model, vmap_grad(model, sq, x), "first layer unfrozen")
        model.zero_grad()
        model[2].requires_grad_(False)
        sq(model(x)).backward()
        assert_grad1(model, vmap_grad(model, sq, x), "last layer frozen")
        model.zero_grad()
        model[2].requires_grad_(True)
        want = clipped_by_oracle(vmap_grad(model, ce_sum, x, y), max_norm=0.1)
        gradhooks.dp_sgd_step(
            h, F.cross_entropy(model(x), y, reduction="none"), max_norm=0.1, noise_multiplier=0.0
        )
    for n, p in model.named_parameters():
        assert_close(p.grad, want[n] / 5, f"DP step after unfreezing: {n}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_opacus_mixed_precision_against_the_float64_loop(dtype):
    """A float32 model under CPU autocast to float16 or bfloat16: ``grad1`` (float32, as the
    parameters) against the float64 loop, to 8 unit roundoffs of the autocast dtype (3.9e-3,
    3.1e-2) relative to the largest entry (the forward and the backward each round several
    times in half precision; measured: 6e-4 for float16, 1.4e-2 for bfloat16), and summing
    to ``.grad``:
    Opacus' ``mixed_precision_test.py``."""
    model = seeded(
        lambda: nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(144, 10))
    )
    torch.manual_seed(1)
    x, y = torch.randn(6, 1, 8, 8), torch.randint(0, 10, (6,))
    want = loop_grad(copy.deepcopy(model).double(), ce_sum, x.double(), y)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with torch.autocast("cpu", dtype=dtype):
            out = model(x)
        ce_sum(out.float(), y).backward()
    tol = 8 * torch.finfo(dtype).eps / 2  # (8 unit roundoffs)
    for n, p in model.named_parameters():
        assert p.grad1.dtype == torch.float32, n
        err = (p.grad1.double() - want[n]).abs().max() / want[n].abs().max()
        assert err < tol, f"{n}: relative error {err:.2e} > {tol:.2e}"
        torch.testing.assert_close(p.grad1.sum(0), p.grad, rtol=tol, atol=tol * p.grad.abs().max())

"""More of the cases that other per-example-gradient projects check in their own test suites,
written in gradhooks' terms and compared with float64 references (``vmap(grad)`` and the
per-example loops of :mod:`gradhooks.oracle`, or a loop written out where the examples sit on
another dimension). :mod:`test_peer_suites` holds the first set; this one adds:

- torch's ExpandedWeights tests (``test/test_expanded_weights.py``,
  ``call_for_per_sample_grads``): every module setting of its legacy module tests under a
  ``sum`` and a ``mean`` loss (the input's gradient checked too), a module called twice in one
  forward, RNN / LSTM / GRU from its module database (``batch_first=False``, an initial state,
  packed sequences), its small models (a CNN, instance / group / layer norm after a
  convolution, an embedding over ``[batch, 5, 5]`` indices), functional layers on a module's
  own parameters, inputs given by keyword or inside a dataclass;
- functorch's per-sample-gradient tests (``test/functorch/test_eager_transforms.py``:
  ``test_resnet18_per_sample_grads`` with GroupNorm for BatchNorm, ``test_ensemble_regression``,
  ``test_lennard_jones_batched_jacrev``) and the ``torch.func`` per-sample-gradients tutorial;
- Opacus: ``per_sample_gradients_utils_test.py`` (hypothesis over Conv1d and Linear settings,
  ``batch_first=False``, empty batches), ``per_sample_gradient_clip_test.py`` (flat and
  per-layer clipping of a net with a frozen layer), ``gradient_accumulation_test.py``,
  ``grad_sample_module_fast_gradient_clipping_test.py`` (ghost-clipping norms and gradients,
  an embedding with repeated indices), ``poisson_test.py`` / ``dpdataloader_test.py``;
- private-transformers (``tests/test_privacy_engine.py``: clipped and accumulated gradients of
  BERT, RoBERTa, ALBERT classifiers, GPT-2 / OpenAI-GPT / OPT language models with tied or
  untied embeddings, BART) and fastDP (book-keeping clipping of GPT-2 with LoRA, layer-wise
  and parameter-wise norms), on tiny random configurations.

``grad1[i]`` is always the gradient of example ``i``'s own loss (the loss of a batch of one), so
``grad1.sum(0)`` (sum loss) or ``grad1.mean(0)`` (mean loss) is ``.grad``. Every comparison is
in float64 at the harness's ``rtol=1e-7, atol=1e-9`` unless a test says otherwise.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gradhooks
from gradhooks.oracle import loop_grad, vmap_grad
from harness import assert_close

DOUBLE = torch.float64


def sq(out, target=None) -> Tensor:
    """Half the sum of squares: a sum of per-example losses."""
    leaves = out if isinstance(out, tuple | list) else (out,)
    return sum(0.5 * (t**2).sum() for t in leaves if isinstance(t, Tensor))


def seeded(factory, seed: int = 0):
    torch.manual_seed(seed)
    return factory()


def as_double(t):
    return t.double() if isinstance(t, Tensor) and t.is_floating_point() else t


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


@pytest.mark.parametrize("bad", ["", "none", "batchmean"])
def test_expanded_weights_loss_reduction_must_be_sum_or_mean(bad):
    """A ``loss_reduction`` other than "sum" or "mean" is refused before anything is hooked:
    torch's ``test_per_sample_api_failing`` ("Expected loss_reduction argument to be sum or
    mean")."""
    model = nn.Linear(10, 10)
    with pytest.raises(gradhooks.ConfigurationError, match="loss_reduction"):
        gradhooks.add_hooks(model, loss_reduction=bad)
    assert not model._forward_hooks and not model._forward_pre_hooks
    model(torch.randn(6, 10)).sum().backward()
    assert not hasattr(model.weight, "grad1")


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

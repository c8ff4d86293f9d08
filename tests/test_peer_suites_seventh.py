"""A seventh set of the cases that other projects check in their own test suites, written in
gradhooks' terms and compared with float64 references (``torch.func`` ``vmap(grad)`` and
per-example loops). The first six sets are :mod:`test_peer_suites`,
:mod:`test_peer_suites_more`, :mod:`test_peer_suites_third`, :mod:`test_peer_suites_fourth`,
:mod:`test_peer_suites_fifth` and :mod:`test_peer_suites_sixth`; this one adds:

- torch's op database (``torch/testing/_internal/common_methods_invocations.py``, whose sample
  inputs functorch's ``test/functorch/test_ops.py`` runs under ``vmap`` of ``vjp``): the ops
  with weights that ExpandedWeights does not support (``conv_transpose1d/2d/3d``, ``prelu``,
  ``rms_norm``, ``batch_norm`` in eval), each sample input called on a module's own
  parameters, and the samples that have no per-example gradient (an unbatched input,
  ``batch_norm`` in training) refused; ``F.embedding_bag`` on a table of its own (bags as rows
  of indices, ``per_sample_weights`` given with the batch, ``padding_idx``; bags cut by
  ``offsets``, which the fallback cannot split, refused) and ``F.bilinear`` on two batched
  inputs; ``tensordot`` and the ops that mix the examples where the batch is contracted,
  paired or inside a matrix (``cov``, ``corrcoef``, ``pdist``, ``linalg.matrix_norm``,
  ``addbmm``, ``inverse``, ``matrix_exp``, ``pinverse``, ``renorm``, ``fft.hfftn``) refused,
  and the same ops keeping the examples against the loop;
- PEFT (``huggingface/peft``: ``tests/test_custom_models.py``): its adapters on its small
  custom models (LoRA on an Embedding, a Conv1d, a grouped Conv2d with and without DoRA, with
  ``lora_bias``; LoRA on ``nn.MultiheadAttention``, batch-first and time-major; LoRA on a raw
  ``nn.Parameter`` through ``target_parameters``; ``modules_to_save``; LoHa with
  ``use_effective_conv2d``, LoKr with ``decompose_both``, IA3, VeRA, OFT, BOFT, HRA,
  FourierFT), every trainable parameter's ``grad1`` against the per-example loop, and some
  of them in a DP step by every clipping method (the DP-for-transformers libraries' LoRA);
- private-transformers (``tests/test_privacy_engine.py``, ``test_image_classification``):
  DeiT with its distillation head and BEiT with relative position biases, layer scale and
  mean pooling, clipped over two micro-batches by every method, with the isolated parameters
  its ``freeze_isolated_params_for_vit`` freezes frozen or (gradhooks covers them) trained;
- Opacus (``opacus/tests/privacy_engine_test.py``, ``grad_sample_module_test.py``): an
  optimizer over another model's parameters refused (``test_parameters_match``), one built
  before ``convert_batch_norm`` replaced the normalization refused and one built after it
  stepped as the loop (``test_validator_weight_update_check``), the noise's level on zero
  gradients (``test_noise_level``), and ``load_state_dict`` into a hooked model, copied or
  assigned (``test_load_state_dict``);
- curvlinops (``test/cases.py``, ``test_jacobian.py``, ``test_kfac.py``): its model that
  reads its input from a ``UserDict``: Jacobians, ``grad1`` and K-FAC factors.

``grad1[i]`` is always the gradient of example ``i``'s own loss (the loss of a batch of one).
Every comparison is in float64 at the harness's ``rtol=1e-7, atol=1e-9`` unless a test says
otherwise.
"""

from __future__ import annotations

import copy
import math
from collections import UserDict
from types import MappingProxyType

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import TensorDataset

import gradhooks
from gradhooks.oracle import loop_grad, vmap_grad
from harness import OpCall, assert_close, assert_grad1, seeded, sq

D = torch.float64


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


# == torch's op database: the weighted ops beyond ExpandedWeights' ===============================


# the op, and the number of dimensions of a batched input (None: any with a batch dimension)
WEIGHTED_OPS = {
    "conv_transpose1d": 3,
    "conv_transpose2d": 4,
    "conv_transpose3d": 5,
    "prelu": None,
    "rms_norm": None,
    "batch_norm": None,
}


def _samples(name: str):
    methods = pytest.importorskip("torch.testing._internal.common_methods_invocations")
    infos = [o for o in methods.op_db if o.name == f"nn.functional.{name}"]
    assert infos, name
    for sample in infos[0].sample_inputs("cpu", D, requires_grad=True):
        x = sample.input
        if x.dim() == 0 or x.shape[0] == 0:
            continue
        model = OpCall(infos[0].op, sample.args, sample.kwargs)
        if list(model.parameters()):
            yield x.detach().clone(), model, sample


def _batched(name: str, x: Tensor, sample) -> bool:
    """Whether the sample has a batch dimension with examples that do not mix: a batched
    convolution input, a ``rms_norm`` over fewer dimensions than the input's, ``prelu`` with
    a channel dimension, ``batch_norm`` in eval."""
    dims = WEIGHTED_OPS[name]
    if dims is not None:
        return x.dim() == dims
    if name == "rms_norm":
        return x.dim() > len(sample.args[0])
    if name == "prelu":
        return x.dim() >= 2
    return not sample.kwargs.get("training", False)


OP_RUNS = [(name, "sum") for name in WEIGHTED_OPS] + [("conv_transpose2d", "mean"),
                                                      ("rms_norm", "mean")]  # fmt: skip


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name,reduction", OP_RUNS, ids=[f"{n}-{r}" for n, r in OP_RUNS])
def test_op_database_weighted_ops_beyond_expanded_weights(name, reduction):
    """Every batched sample input of torch's op database for the ops with weights that
    ExpandedWeights does not support (transposed convolutions with their strides, groups,
    dilations and output padding, ``prelu`` with one weight or one per channel, ``rms_norm``
    over one or more dimensions, ``batch_norm`` with running statistics in eval), called on a
    module's own parameters: the per-sample gradients that functorch's ``test_ops.py`` takes
    of these samples under ``vmap``, against the per-example loop."""
    checked = 0
    for x, model, sample in _samples(name):
        if not _batched(name, x, sample):
            continue
        want = loop_grad(model, sq, x)
        scale = x.shape[0] if reduction == "mean" else 1
        with gradhooks.add_hooks(model, loss_reduction=reduction):
            (sq(model(x)) / scale).backward()
        assert_grad1(model, want, f"{name} on {tuple(x.shape)}, {sample.kwargs}")
        checked += 1
    assert checked, f"{name}: no sample input checked"


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("name", ["conv_transpose1d", "conv_transpose2d", "batch_norm"])
def test_op_database_samples_without_per_example_gradients_are_refused(name):
    """The op database's other samples of these ops: an unbatched transposed-convolution
    input (``[channels, *spatial]``, whose dimension 0 is no batch) and ``batch_norm`` in
    training (statistics over the batch) are refused with a gradhooks error, nothing written
    to ``grad1``. One kind of sample reads as batched: one channel in and one out, a
    ``[1, *spatial]`` input and output, a batch of one whose ``grad1`` is the whole
    gradient (checked so)."""
    refused = 0
    for x, model, sample in _samples(name):
        if _batched(name, x, sample):
            continue
        one_channel = name != "batch_norm" and x.shape[0] == 1 and model.arg0.shape[:2] == (1, 1)
        if one_channel:
            want = loop_grad(model, sq, x)
            with gradhooks.add_hooks(model, loss_reduction="sum"):
                sq(model(x)).backward()
            assert_grad1(model, want, f"{name} on {tuple(x.shape)}")
            continue
        with pytest.raises(gradhooks.GradhooksError):
            with gradhooks.add_hooks(model, loss_reduction="sum"):
                sq(model(x)).backward()
        assert not any(hasattr(p, "grad1") for p in model.parameters()), name
        refused += 1
    assert refused, f"{name}: no such sample"


class Tensordot(nn.Module):
    def __init__(self, weight: Tensor, dims):
        super().__init__()
        self.weight, self.dims = nn.Parameter(weight), dims

    def forward(self, x):
        return torch.tensordot(x, self.weight, dims=self.dims)


TENSORDOTS = {  # (input shape, weight shape, dims): the op database's, on a batch of 3
    "last-two": ((3, 2, 2), (2, 2, 4), 2),
    "listed": ((3, 2, 4), (2, 5, 4), ([1, 2], [0, 2])),
    "batch-contracted": ((3, 2, 1), (2, 1, 3), ([0, 1], [2, 0])),
}


@pytest.mark.parametrize("case", list(TENSORDOTS))
def test_op_database_tensordot_on_its_own_weight(case):
    """The op database's ``tensordot`` samples (``dims=2``; ``dims`` as two lists, one of them
    contracting the input's dimension 0 with a weight's dimension as long as the batch), the
    weight a module's own: where the examples' dimension is kept, ``grad1`` against the
    loop; where it is contracted, the output sums over the examples, and is refused as
    mixing them (it was taken as a batch of one, ``grad1`` of one row, the whole gradient)."""
    x_shape, w_shape, dims = TENSORDOTS[case]
    model = seeded(lambda: Tensordot(torch.randn(w_shape, dtype=D), dims))
    torch.manual_seed(1)
    x = torch.randn(x_shape, dtype=D)
    if case == "batch-contracted":
        with pytest.raises(gradhooks.MixedExamplesError, match="tensordot"):
            with gradhooks.add_hooks(model, loss_reduction="sum"):
                sq(model(x)).backward()
        assert not hasattr(model.weight, "grad1")
        return
    want = loop_grad(model, sq, x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(x)).backward()
    assert_grad1(model, want, f"tensordot {case}")


class OnOwnWeight(nn.Module):
    """``how(x, weight)``: an op of the database on the input and a weight of the module's."""

    def __init__(self, weight: Tensor, how):
        super().__init__()
        self.weight, self.how = nn.Parameter(weight), how

    def forward(self, x):
        return self.how(x, self.weight)


# (weight shape, the op on [3, 4] inputs): each mixes the 3 examples of its input
MIXING = {
    "cov": ((4,), lambda x, w: torch.cov((x * w).T)),
    "corrcoef": ((4,), lambda x, w: torch.corrcoef((x * w).T)),
    "pdist": ((4,), lambda x, w: F.pdist(x * w)[None]),
    "matrix_norm": ((3, 4), lambda x, w: torch.linalg.matrix_norm(x * w)[None, None]),
    "addbmm": ((3, 4, 5), lambda x, w: torch.addbmm(torch.zeros(1, 5, dtype=D), x[:, None], w)),
    "inverse": ((3,), lambda x, w: torch.inverse(x[:, :3] * w + 3 * torch.eye(3, dtype=D))),
    "linalg.inv": ((3,), lambda x, w: torch.linalg.inv(x[:, :3] * w + 3 * torch.eye(3, dtype=D))),
    "matrix_exp": ((3,), lambda x, w: torch.matrix_exp(x[:, :3] * w)),
    "pinverse": ((4,), lambda x, w: torch.pinverse(x * w)),
    "renorm": ((4,), lambda x, w: torch.renorm(x * w, 2, 1, 0.5)),
    "fft.hfftn": ((4,), lambda x, w: torch.fft.hfftn(x * w)),
    "fft.ihfftn": ((4,), lambda x, w: torch.fft.ihfftn(x * w).real),
}
# (weight shape, the op, input shape): the same ops where each example keeps its own rows
KEEPING = {
    "matrix_norm": ((4, 2), lambda x, w: torch.linalg.matrix_norm(x @ w), (3, 5, 4)),
    "inverse": ((4, 4), lambda x, w: torch.inverse(x * w + 4 * torch.eye(4, dtype=D)), (3, 4, 4)),
    "pinverse": ((5, 4), lambda x, w: torch.pinverse(x * w), (3, 5, 4)),
    "renorm": ((4,), lambda x, w: torch.renorm(x * w, 2, 0, 0.5), (3, 4)),
    "fft.hfftn": ((4, 5), lambda x, w: torch.fft.hfftn(x * w, dim=(1, 2)), (3, 4, 5)),
    "fft.ihfftn": ((4, 5), lambda x, w: torch.fft.ihfftn(x * w, dim=(1, 2)).real, (3, 4, 5)),
    "addbmm": ((4, 5), lambda x, w: torch.addbmm(x.new_zeros(x.shape[0], 5), x.transpose(0, 1),
                                                 w.expand(2, 4, 5)), (3, 2, 4)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(MIXING))
def test_op_database_ops_that_mix_the_examples_are_refused(name):
    """Ops of the database that had no rule for following the batch and mix the examples:
    ``cov`` / ``corrcoef`` of variables over the batch's observations, ``pdist`` between the
    examples' rows, ``linalg.matrix_norm`` over its default last two dimensions, ``addbmm``
    summing its batch of products, the functions of a whole matrix (``inverse``,
    ``linalg.inv``, ``matrix_exp``, ``pinverse``) of a ``[batch, n]`` input, ``renorm`` of
    slices across the batch, ``fft.hfftn`` / ``ihfftn`` over every dimension, each on a
    module's own weight. Refused as mixing; before, they
    went to the fallback unseen: a ``grad1`` of one row, the whole gradient (``matrix_norm``,
    ``addbmm``), or per-example numbers of a loss that has none (the others), with no error.
    Where the examples keep their rows (``matrix_norm``, ``inverse`` and ``pinverse`` of each
    example's matrix, ``addbmm`` over another dimension, ``renorm`` of each example's slice,
    the Fourier transforms over the other dimensions), ``grad1`` against the loop."""
    shape, how = MIXING[name]
    model = seeded(lambda: OnOwnWeight(torch.randn(shape, dtype=D), how))
    torch.manual_seed(1)
    x = torch.randn(3, 4, dtype=D)
    with pytest.raises(gradhooks.MixedExamplesError):
        with gradhooks.add_hooks(model, loss_reduction="sum"):
            sq(model(x)).backward()
    assert not hasattr(model.weight, "grad1")
    if name in KEEPING:
        shape, how, x_shape = KEEPING[name]
        model = seeded(lambda: OnOwnWeight(torch.randn(shape, dtype=D), how))
        x = torch.randn(x_shape, dtype=D)
        want = loop_grad(model, sq, x)
        with gradhooks.add_hooks(model, loss_reduction="sum"):
            sq(model(x)).backward()
        assert_grad1(model, want, f"{name} keeping the examples")


class Bag(nn.Module):
    """``F.embedding_bag`` on a table of its own: each row of ``indices`` one example's bag,
    the per-sample weights (if any) given with the batch."""

    def __init__(self, mode: str, padding_idx: int | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(10, 5, dtype=D))
        self.mode, self.padding_idx = mode, padding_idx

    def forward(self, indices, weights=None):
        return F.embedding_bag(
            indices, self.weight, mode=self.mode, per_sample_weights=weights,
            padding_idx=self.padding_idx,
        )  # fmt: skip


BAGS = [("sum", None, True), ("sum", 2, True), ("sum", None, False), ("mean", 2, False),
        ("max", None, False)]  # fmt: skip


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    "mode,padding_idx,weighted",
    BAGS,
    ids=[f"{m}-pad{p}-{'weighted' if w else 'plain'}" for m, p, w in BAGS],
)
def test_op_database_embedding_bag_on_its_own_table(mode, padding_idx, weighted):
    """The op database's ``embedding_bag`` samples with 2-d indices (``sum`` with
    ``per_sample_weights``, ``mean``, ``max``, a ``padding_idx`` that every bag skips), the
    table a module's own parameter, the bags the examples: ``grad1`` against the loop."""
    model = seeded(lambda: Bag(mode, padding_idx))
    torch.manual_seed(1)
    indices = torch.randint(0, 10, (4, 5))
    inputs = (indices, torch.rand(4, 5, dtype=D)) if weighted else (indices,)
    want = loop_grad(model, sq, inputs)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(*inputs)).backward()
    assert_grad1(model, want, f"embedding_bag {mode}")


class BagsByOffsets(Bag):
    def forward(self, indices, offsets):
        return F.embedding_bag(indices, self.weight, offsets, mode=self.mode)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_op_database_embedding_bag_cut_by_offsets_is_refused():
    """The op database's 1-d ``embedding_bag`` samples, whose bags ``offsets`` cuts out of one
    flat index tensor: the fallback cannot take one bag out of them (dimension 0 of the
    indices is no batch), and refuses with a gradhooks error rather than guess."""
    model = seeded(lambda: BagsByOffsets("sum"))
    indices, offsets = torch.randint(0, 10, (6,)), torch.tensor([0, 2, 3])
    with pytest.raises(gradhooks.GradhooksError):
        with gradhooks.add_hooks(model, loss_reduction="sum"):
            sq(model(indices, offsets)).backward()
    assert not hasattr(model.weight, "grad1")


class Bilinear(nn.Module):
    def __init__(self, in1: int, in2: int, out: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out, in1, in2, dtype=D))
        self.bias = nn.Parameter(torch.randn(out, dtype=D)) if bias else None

    def forward(self, x1, x2):
        return F.bilinear(x1, x2, self.weight, self.bias)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("shape", [(8,), (2, 3)], ids=["flat", "extra-dimension"])
def test_op_database_bilinear_of_two_batched_inputs(shape, bias):
    """The op database's ``bilinear`` samples (``[8, 3]`` with ``[8, 4]``, and ``[2, 3, 3]``
    with ``[2, 3, 4]``, with and without bias), both inputs carrying the batch, the weight a
    module's own: ``grad1`` against ``vmap(grad)``."""
    model = seeded(lambda: Bilinear(3, 4, 5, bias))
    torch.manual_seed(1)
    inputs = (torch.randn(*shape, 3, dtype=D), torch.randn(*shape, 4, dtype=D))
    want = vmap_grad(model, sq, inputs)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(*inputs)).backward()
    assert_grad1(model, want, "bilinear")


# == PEFT: tests/test_custom_models.py ==========================================================


class EmbConv(nn.Module):
    """PEFT's ``ModelEmbConv1D`` and ``ModelConv1D`` in one: an Embedding, a Conv1d over the
    tokens, a Linear head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.conv1d = nn.Conv1d(6, 6, 3, padding=1)
        self.lin0 = nn.Linear(6, 2)

    def forward(self, ids):
        h = self.conv1d(self.emb(ids).transpose(1, 2)).relu()
        return F.log_softmax(self.lin0(h.mean(2)), -1)


class ConvGroups(nn.Module):
    """PEFT's ``ModelConv2DGroups``: a grouped Conv2d (groups dividing the rank), a Linear."""

    def __init__(self):
        super().__init__()
        self.conv2d = nn.Conv2d(8, 8, 3, groups=4)
        self.lin0 = nn.Linear(8, 2)

    def forward(self, x):
        return F.log_softmax(self.lin0(self.conv2d(x).relu().flatten(1)), -1)


class Conv(nn.Module):
    """PEFT's ``ModelConv2D``: a Conv2d, a Linear."""

    def __init__(self):
        super().__init__()
        self.conv2d = nn.Conv2d(5, 6, 3)
        self.lin0 = nn.Linear(6, 2)

    def forward(self, x):
        return F.log_softmax(self.lin0(self.conv2d(x).flatten(1)), -1)


class MLP(nn.Module):
    """PEFT's ``MLP`` (dropout left out: the loop and the batch would draw differently)."""

    def __init__(self):
        super().__init__()
        self.lin0, self.lin1 = nn.Linear(10, 20), nn.Linear(20, 2)

    def forward(self, x):
        return F.log_softmax(self.lin1(self.lin0(x).relu()), -1)


class LinearUsingParameter(nn.Module):
    """PEFT's ``_LinearUsingParameter``: ``x @ weight + bias``, the weight ``[in, out]``."""

    def __init__(self, fan_in: int, fan_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(fan_in, fan_out))
        self.bias = nn.Parameter(torch.ones(fan_out))

    def forward(self, x):
        return x @ self.weight + self.bias


class MlpUsingParameters(nn.Module):
    """PEFT's ``MlpUsingParameters``, whose weights LoRA targets as parameters."""

    def __init__(self):
        super().__init__()
        self.lin0, self.lin1 = LinearUsingParameter(10, 20), LinearUsingParameter(20, 2)

    def forward(self, x):
        return F.log_softmax(self.lin1(self.lin0(x).relu()), -1)


class Mha(nn.Module):
    """PEFT's ``ModelMha``: ``nn.MultiheadAttention`` (time-major, as there, or batch-first),
    a Linear."""

    def __init__(self, batch_first: bool):
        super().__init__()
        self.mha = nn.MultiheadAttention(10, 2, batch_first=batch_first)
        self.lin0 = nn.Linear(10, 2)

    def forward(self, x):
        return F.log_softmax(self.lin0(self.mha(x, x, x)[0]), -1)


def _tokens():
    return torch.randint(0, 11, (3, 5))


def _images(channels: int):
    return lambda: torch.randn(3, channels, 3, 3, dtype=D)


def _rows():
    return torch.randn(3, 10, dtype=D)


def _peft_cases():
    peft = pytest.importorskip("peft")
    no_init = dict(init_lora_weights=False)  # (B = 0 would make A's gradient 0)
    return {
        "lora-embedding-conv1d": (
            EmbConv, peft.LoraConfig(target_modules=["emb", "conv1d"], **no_init), _tokens),
        "lora-grouped-conv2d": (
            ConvGroups, peft.LoraConfig(r=4, target_modules=["conv2d"], **no_init), _images(8)),
        "dora-grouped-conv2d": (
            ConvGroups,
            peft.LoraConfig(r=4, target_modules=["conv2d"], use_dora=True, **no_init),
            _images(8)),
        "lora-bias-conv2d": (
            Conv, peft.LoraConfig(target_modules=["conv2d"], lora_bias=True, **no_init),
            _images(5)),
        "lora-target-parameters": (
            MlpUsingParameters, peft.LoraConfig(target_parameters=["lin0.weight"], **no_init),
            _rows),
        "lora-modules-to-save": (
            MLP, peft.LoraConfig(target_modules=["lin0"], modules_to_save=["lin1"], **no_init),
            _rows),
        "loha-effective-conv2d": (
            Conv, peft.LoHaConfig(target_modules=["conv2d", "lin0"], use_effective_conv2d=True,
                                  init_weights=False), _images(5)),
        "lokr-decompose-both": (
            MLP, peft.LoKrConfig(target_modules=["lin0"], decompose_both=True, r=1, alpha=1,
                                 init_weights=False), _rows),
        "ia3-conv2d-feedforward": (
            Conv, peft.IA3Config(target_modules=["conv2d", "lin0"], feedforward_modules=["conv2d"],
                                 init_ia3_weights=False), _images(5)),
        "vera": (MLP, peft.VeraConfig(r=4, target_modules=["lin0", "lin1"], init_weights=False),
                 _rows),
        "oft": (Conv, peft.OFTConfig(r=0, oft_block_size=2, target_modules=["lin0"],
                                     init_weights=False), _images(5)),
        "boft": (MLP, peft.BOFTConfig(boft_block_size=2, target_modules=["lin0"],
                                      init_weights=False), _rows),
        "hra": (MLP, peft.HRAConfig(r=2, target_modules=["lin0"], init_weights=False), _rows),
        "fourierft": (MLP, peft.FourierFTConfig(n_frequency=8, target_modules=["lin0"],
                                                init_weights=False), _rows),
    }  # fmt: skip


PEFT_CASES = ["lora-embedding-conv1d", "lora-grouped-conv2d", "dora-grouped-conv2d",
              "lora-bias-conv2d", "lora-target-parameters", "lora-modules-to-save",
              "loha-effective-conv2d", "lokr-decompose-both", "ia3-conv2d-feedforward", "vera",
              "oft", "boft", "hra", "fourierft"]  # fmt: skip


def nll_sum(out: Tensor, target: Tensor) -> Tensor:
    return F.nll_loss(out, target, reduction="sum")


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("case", PEFT_CASES)
def test_peft_adapters_on_its_custom_models(case):
    """PEFT's ``TEST_CASES`` (``tests/test_custom_models.py``): each adapter on its small
    models (the adapters' weights random, ``init_*_weights=False``, so that every one has a
    gradient), the base frozen, under ``NLLLoss``: every trainable parameter's ``grad1``
    against the per-example loop, and the frozen ones left without one."""
    peft = pytest.importorskip("peft")
    factory, config, inputs = _peft_cases()[case]
    model = seeded(lambda: peft.get_peft_model(factory(), config)).double()
    torch.manual_seed(1)
    x, y = inputs(), torch.randint(0, 2, (3,))
    want = loop_grad(model, nll_sum, x, y)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        nll_sum(model(x), y).backward()
    assert_grad1(model, want, case, frozen_clean=True)


# FourierFT builds its weight in float32 (``torch.fft.ifft2`` of a float32 spectrum): its
# clipped sums agree with the loop's to float32's precision only
PEFT_DP_CASES = {"lora-embedding-conv1d": {}, "loha-effective-conv2d": {},
                 "ia3-conv2d-feedforward": {}, "vera": {},
                 "fourierft": dict(rtol=1e-5, atol=1e-7)}  # fmt: skip


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("case", list(PEFT_DP_CASES))
def test_peft_adapters_in_a_dp_step_by_every_method(case):
    """The DP-for-transformers libraries' parameter-efficient training (fastDP's and
    dp-transformers' LoRA) with PEFT's other adapters too: one DP step without noise,
    clipped at the median per-example norm, by ``grad1``, ghost clipping and book-keeping;
    the norms and every adapter's gradient against the loop's clipped sum."""
    peft = pytest.importorskip("peft")
    factory, config, inputs = _peft_cases()[case]
    model = seeded(lambda: peft.get_peft_model(factory(), config)).double()
    torch.manual_seed(1)
    x, y = inputs(), torch.randint(0, 2, (3,))
    want = loop_grad(model, nll_sum, x, y)
    norms = torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)
    max_norm = norms.median().item()
    factors = (max_norm / norms).clamp(max=1.0)
    tol = PEFT_DP_CASES[case]
    for method in ("grad1", "ghost", "bookkeeping"):
        model.zero_grad(set_to_none=True)
        quantities = ("grad1",) if method == "grad1" else ("norms",)
        with gradhooks.add_hooks(model, quantities=quantities) as h:
            got = gradhooks.dp_sgd_step(
                h, F.nll_loss(model(x), y, reduction="none"), max_norm=max_norm,
                noise_multiplier=0.0, reduction="sum", method=method,
            )  # fmt: skip
        torch.testing.assert_close(got, norms, **(tol or dict(rtol=1e-7, atol=1e-9)))
        for n, p in trainable(model):
            clipped = (factors.view(-1, *[1] * (want[n].dim() - 1)) * want[n]).sum(0)
            torch.testing.assert_close(
                p.grad, clipped, **(tol or dict(rtol=1e-7, atol=1e-9)),
                msg=lambda m, n=n, method=method: f"{case} {method} {n}: {m}",
            )  # fmt: skip


@pytest.mark.parametrize("batch_first", [False, True], ids=["time-major", "batch-first"])
def test_peft_lora_on_multihead_attention(batch_first):
    """PEFT's ``MHA 2 LoRA`` case: LoRA on ``nn.MultiheadAttention`` (its packed input
    projection and its output projection) and on the Linear after it, time-major as PEFT's
    ``ModelMha`` is (hooked with ``batch_dim=1``) or batch-first: ``grad1`` against a loop
    over each example's own sequence."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(target_modules=["mha", "lin0"], init_lora_weights=False)
    model = seeded(lambda: peft.get_peft_model(Mha(batch_first), config)).double()
    torch.manual_seed(1)
    x = torch.randn(3, 4, 10, dtype=D)
    params = trainable(model)
    rows = []
    for i in range(3):
        one = x[i : i + 1] if batch_first else x[i : i + 1].transpose(0, 1)
        rows.append(torch.autograd.grad(sq(model(one)), [p for _, p in params]))
    want = {n: torch.stack([r[k] for r in rows]) for k, (n, _) in enumerate(params)}
    assert any("mha.lora_A" in n for n in want) and any("out_proj.lora_A" in n for n in want)
    inputs = x if batch_first else x.transpose(0, 1)
    with gradhooks.add_hooks(model, loss_reduction="sum", batch_dim=0 if batch_first else 1):
        sq(model(inputs)).backward()
    assert_grad1(model, want, "LoRA on attention", frozen_clean=True)


# == private-transformers: tests/test_privacy_engine.py, test_image_classification ==============


class Pixels(nn.Module):
    """A Hugging Face image classifier called on ``pixel_values``, its logits out."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(pixel_values=x).logits


def tiny_vision(kind: str) -> nn.Module:
    """A 2-layer DeiT (class and distillation tokens, two heads whose logits are averaged) or
    BEiT (relative position biases per layer or shared, layer scale, mean pooling), width 8,
    8x8 images in 4x4 patches, no dropout."""
    tf = pytest.importorskip("transformers")
    tf.logging.set_verbosity_error()
    common = dict(
        hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=12,
        image_size=8, patch_size=4, num_channels=3, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    if kind == "deit":
        return tf.DeiTForImageClassificationWithTeacher(tf.DeiTConfig(**common))
    if kind == "beit":
        cfg = tf.BeitConfig(**common, use_relative_position_bias=True, layer_scale_init_value=0.1,
                            use_mean_pooling=True, drop_path_rate=0.0)  # fmt: skip
    else:
        cfg = tf.BeitConfig(**common, use_shared_relative_position_bias=True,
                            use_absolute_position_embeddings=True, layer_scale_init_value=0.1,
                            use_mean_pooling=False, drop_path_rate=0.0)  # fmt: skip
    return tf.BeitForImageClassification(cfg)


def freeze_isolated(model: nn.Module) -> list[str]:
    """What private-transformers' ``freeze_isolated_params_for_vit`` freezes (the parameters
    its hooks have no rule for): the class, distillation and mask tokens, the position
    embeddings, BEiT's relative position bias tables and layer scales. Their names."""
    names = ("cls_token", "distillation_token", "mask_token", "position_embeddings",
             "relative_position_bias_table", "lambda_1", "lambda_2")  # fmt: skip
    frozen = []
    for n, p in model.named_parameters():
        if n.rsplit(".", 1)[-1] in names:
            p.requires_grad_(False)
            frozen.append(n)
    return frozen


def clipped_by_loop(model, batches, max_norm):
    """Each example's gradient by the loop, ``min(1, C/‖g_i‖)``-clipped, summed; and the norms."""
    params = trainable(model)
    rows = []
    for x, y in batches:
        for i in range(x.shape[0]):
            loss = F.cross_entropy(model(x[i : i + 1]), y[i : i + 1], reduction="sum")
            rows.append(torch.autograd.grad(loss, [p for _, p in params]))
    norms = torch.stack([torch.cat([g.flatten() for g in r]).norm() for r in rows])
    factors = (max_norm / norms).clamp(max=1.0)
    sums = {n: sum(f * r[k] for f, r in zip(factors, rows)) for k, (n, _) in enumerate(params)}
    return sums, norms


# (model, clipping method, isolated parameters frozen): each model and each method
VISION_RUNS = [("deit", "grad1", True), ("beit", "ghost", False), ("beit", "bookkeeping", True),
               ("beit-shared-bias", "bookkeeping", False)]  # fmt: skip


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    "kind,method,frozen",
    VISION_RUNS,
    ids=[f"{k}-{m}-{'isolated-frozen' if f else 'all-trained'}" for k, m, f in VISION_RUNS],
)
def test_private_transformers_image_classification(kind, method, frozen):
    """private-transformers' ``test_image_classification`` (DeiT, BEiT; ViT is in
    :mod:`test_peer_suites_more`): the per-example cross-entropy clipped over two
    micro-batches (``virtual_step`` then ``step``) and stepped once with SGD, no noise,
    against its loop that clips example by example; with the parameters its
    ``freeze_isolated_params_for_vit`` freezes frozen, or trained (gradhooks has their
    per-example gradients)."""
    model = seeded(lambda: Pixels(tiny_vision(kind))).double().train()
    if frozen:
        assert freeze_isolated(model)
    torch.manual_seed(3)
    batches = [(torch.randn(2, 3, 8, 8, dtype=D), torch.randint(0, 3, (2,))) for _ in "ab"]
    max_norm, lr = 0.05, 1.0
    sums, norms = clipped_by_loop(model, batches, max_norm)
    assert (norms > max_norm).any(), "the case must clip"
    start = {n: p.detach().clone() for n, p in trainable(model)}
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    seen = []
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD([p for _, p in trainable(model)], lr=lr), h, max_grad_norm=max_norm,
            noise_multiplier=0.0, expected_batch_size=4, method=method,
        )  # fmt: skip
        for x, y in batches:
            seen.append(opt.backward(F.cross_entropy(model(x), y, reduction="none")))
        opt.step()
    assert_close(torch.cat(seen), norms, "per-example norms")
    for n, p in trainable(model):
        assert_close(p.detach(), start[n] - lr * sums[n] / 4, f"{kind} {method}: step of {n}")


# == Opacus: privacy_engine_test.py, grad_sample_module_test.py ==================================


class SampleConvNet(nn.Module):
    """A small convolutional classifier with a BatchNorm (Opacus' validator tests' kind)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.norm = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.fc(self.norm(self.conv(x)).relu().flatten(1))


def conv_data(n: int = 12) -> TensorDataset:
    torch.manual_seed(2)
    return TensorDataset(torch.randn(n, 1, 6, 6, dtype=D), torch.randint(0, 3, (n,)))


def _make_private(model, optimizer, data, **kw):
    settings = dict(delta=1e-5, max_grad_norm=1.0, noise_multiplier=1.0, steps=2,
                    expected_batch_size=4)  # fmt: skip
    return gradhooks.make_private(model, optimizer, data, **{**settings, **kw})


def test_opacus_optimizer_over_another_models_parameters_is_refused():
    """Opacus' ``test_parameters_match``: a model and an optimizer over a copy's parameters
    (equal values, other tensors) are refused before any step, which would otherwise update
    the copy with gradients nobody clipped; the model is left without hooks (it can be hooked
    again)."""
    model = seeded(SampleConvNet).double().eval()
    twin = copy.deepcopy(model)
    with pytest.raises(gradhooks.ConfigurationError, match="do not clip"):
        _make_private(model, torch.optim.SGD(twin.parameters(), lr=0.1), conv_data())
    with gradhooks.add_hooks(model):
        pass


def test_opacus_optimizer_built_before_the_normalization_was_replaced():
    """Opacus' ``test_validator_weight_update_check``: ``convert_batch_norm`` (its
    ``ModuleValidator.fix``) called after the optimizer was built leaves the optimizer holding
    the old BatchNorm's parameters: refused. The optimizer built after it: one step without
    noise is the loop's clipped mean over the Poisson batch."""
    model = seeded(SampleConvNet).double()
    stale = torch.optim.SGD(model.parameters(), lr=1.0)
    model = gradhooks.convert_batch_norm(model)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    data = conv_data()
    with pytest.raises(gradhooks.ConfigurationError, match="do not clip"):
        _make_private(model, stale, data)
    lr, max_norm = 1.0, 0.5
    private = _make_private(
        model, torch.optim.SGD(model.parameters(), lr=lr), data, noise_multiplier=0.0,
        max_grad_norm=max_norm, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    start = {n: p.detach().clone() for n, p in trainable(model)}
    for x, y in private.batches():
        batch = (x, y)
        with gradhooks.paused():
            sums, _ = clipped_by_loop(model, [batch], max_norm)
        private.backward(F.cross_entropy(model(x), y, reduction="none"))
        assert private.step()
        break
    private.close()
    assert batch[0].shape[0] > 0, "the seed must draw a non-empty batch"
    for n, p in trainable(model):
        assert_close(p.detach(), start[n] - lr * sums[n] / 4, f"step of {n}")


def test_opacus_noise_level_on_zero_gradients():
    """Opacus' ``test_noise_level``: every parameter zero and every gradient zero (the loss
    multiplied by 0), so that each step adds the noise alone: after ``k`` SGD steps the
    squared norm of the parameters is ``k · n · (σ C lr / B)²`` on average (``n``
    parameters, ``B`` the expected batch size), within 15% as there (``k·n = 4,623`` draws:
    the relative standard deviation of the sum is ``√(2/(k·n)) ≈ 2%``)."""
    model = seeded(lambda: nn.Sequential(nn.Linear(20, 50), nn.Tanh(), nn.Linear(50, 3))).double()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    torch.manual_seed(4)
    data = TensorDataset(torch.randn(40, 20, dtype=D), torch.randint(0, 3, (40,)))
    sigma, max_norm, lr, batch, steps = 1.3, 0.7, 0.5, 8.0, 3
    private = _make_private(
        model, torch.optim.SGD(model.parameters(), lr=lr), data, noise_multiplier=sigma,
        max_grad_norm=max_norm, steps=steps, expected_batch_size=batch,
        generator=torch.Generator().manual_seed(5),
    )  # fmt: skip
    for x, y in private.batches():
        private.backward(0.0 * F.cross_entropy(model(x), y, reduction="none"))
        private.step()
    assert private.steps_taken == steps
    private.close()
    n = sum(p.numel() for p in model.parameters())
    expected = steps * n * (sigma * max_norm * lr / batch) ** 2
    got = sum(p.detach().pow(2).sum() for p in model.parameters()).item()
    assert math.isclose(got, expected, rel_tol=0.15), (got, expected)


@pytest.mark.parametrize("assign", [False, True], ids=["copied", "assigned"])
def test_opacus_load_state_dict_into_a_hooked_model(assign):
    """Opacus' ``test_load_state_dict``: another model's ``state_dict`` loaded into the hooked
    model between two backwards, copied into its parameters or (``assign=True``) replacing
    them with new tensors: the next backward's ``grad1`` is that of the loaded weights, on
    every parameter the model now holds."""

    def net():
        return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()

    model, other = seeded(net), seeded(net, seed=1)
    torch.manual_seed(2)
    x = torch.randn(5, 3, dtype=D)
    want = vmap_grad(other, sq, x)
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        sq(model(x)).backward()
        model.load_state_dict(other.state_dict(), assign=assign)
        h.clear()
        model.zero_grad()
        sq(model(x)).backward()
        assert_grad1(model, want, f"after load_state_dict(assign={assign})")


# == curvlinops: test/cases.py (dict-like inputs), test_jacobian.py, test_kfac.py ==============


class ModelWithDictInput(nn.Module):
    """curvlinops' ``ModelWithDictInput``: the model takes a mapping and reads its ``"x"``."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 5), nn.ReLU(), nn.Linear(5, 3))

    def forward(self, data):
        return self.net(data["x"])


@pytest.mark.parametrize("kind", [dict, UserDict, MappingProxyType], ids=lambda k: k.__name__)
def test_curvlinops_model_of_a_dict_like_input(kind):
    """curvlinops' cases with a dict-like input (``UserDict({"x": ...})``, a mapping that is
    no ``dict``, and so no pytree node), which its ``JacobianLinearOperator``, GGN, empirical
    Fisher and K-FAC tests run on: per-example Jacobians against ``vmap(jacrev)``, ``grad1``
    (the empirical Fisher's rows) against the loop, and K-FAC factors equal to those of the
    same input in a ``dict``; an input in such a mapping that requires grad is refused, as
    one in a ``dict`` is."""
    model = seeded(ModelWithDictInput).double()
    torch.manual_seed(1)
    x, y = torch.rand(4, 10, dtype=D), torch.randint(0, 3, (4,))
    params = {n: p.detach() for n, p in model.named_parameters()}

    def out_of_one(p, xi):
        return torch.func.functional_call(model, p, ({"x": xi[None]},))[0]

    want = torch.func.vmap(torch.func.jacrev(out_of_one), in_dims=(None, 0))(params, x)
    got = gradhooks.jacobians(model, (kind({"x": x}),))
    for n in params:
        assert_close(got[n], want[n], f"Jacobian of {n}")
    rows = [
        torch.autograd.grad(F.cross_entropy(model({"x": x[i : i + 1]}), y[i : i + 1]),
                            list(model.parameters()))
        for i in range(4)
    ]  # fmt: skip
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        F.cross_entropy(model(kind({"x": x})), y, reduction="sum").backward()
    for k, (n, p) in enumerate(model.named_parameters()):
        assert_close(p.grad1, torch.stack([r[k] for r in rows]), f"grad1 of {n}")
    plain = gradhooks.kfac(model, ({"x": x},), y, fisher="empirical")
    factors = gradhooks.kfac(model, (kind({"x": x}),), y, fisher="empirical")
    for n in plain:
        assert torch.equal(factors[n].A, plain[n].A) and torch.equal(factors[n].G, plain[n].G), n
    with pytest.raises(gradhooks.UnsupportedInputError, match="requires grad"):
        gradhooks.jacobians(model, (kind({"x": x.clone().requires_grad_()}),))


class OwnWeightOnDictInput(nn.Module):
    """A layer with no rule (the fallback) that reads its input from a mapping."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(10, 3, dtype=D))

    def forward(self, data):
        return torch.tanh(data["x"] @ self.weight)


def test_curvlinops_dict_like_input_of_a_layer_without_a_rule():
    """The same input read by a layer without a rule: in a ``dict`` the fallback splits it per
    example (``grad1`` against the loop); in a ``UserDict``, which pytree takes for one leaf,
    it cannot, and refuses with an error that shows the mapping by the shapes it holds and
    says to pass a ``dict`` (not the tensors' values)."""
    model = seeded(OwnWeightOnDictInput)
    torch.manual_seed(1)
    x = torch.rand(4, 10, dtype=D)
    rows = [torch.autograd.grad(sq(model({"x": x[i : i + 1]})), model.weight) for i in range(4)]
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model({"x": x})).backward()
    assert_close(model.weight.grad1, torch.stack([r[0] for r in rows]), "a dict input")
    with pytest.raises(gradhooks.UnsupportedInputError) as refused:
        with gradhooks.add_hooks(model, loss_reduction="sum"):
            sq(model(UserDict({"x": x}))).backward()
    said = str(refused.value)
    assert "UserDict {'x': (4, 10)}" in said and "a dict" in said, said
    assert "tensor(" not in said, said

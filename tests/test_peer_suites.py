"""The cases that other per-example-gradient libraries check in their own test suites, written
in gradhooks' terms and compared with the float64 oracle (``vmap(grad)`` and the per-example
loop of :mod:`gradhooks.oracle`).

Each test's docstring names the peer suite that checks the same thing:

- Opacus: ``opacus/tests/grad_samples/*`` (one file per layer) and
  ``opacus/tests/grad_sample_module_test.py`` (hooks, ``zero_grad``, accumulation, frozen and
  tied parameters, unsupported layers), and its DP optimizer tests;
- BackPACK: ``test/extensions/firstorder/*`` (``BatchGrad``, ``BatchL2Grad``,
  ``SumGradSquared``, ``Variance`` over its problem settings, losses with ``reduction="sum"``
  and ``"mean"``);
- autograd-hacks: ``test_autograd_hacks.py`` (``grad1`` of a Conv2d/Linear net, ``mean`` and
  ``sum`` losses, the Hessian);
- curvlinops / ASDL: per-example gradients of layers with weight sharing over a sequence.

Scaling: BackPACK's ``BatchGrad`` under a mean loss holds ``grad_i / batch``; Opacus'
``grad_sample`` holds ``batch · grad_i`` summed back to the mean's gradient; gradhooks'
``grad1[i]`` is always the gradient of example ``i``'s own loss, so ``grad1.mean(0)`` (mean
loss) or ``grad1.sum(0)`` (sum loss) is ``.grad``. Every comparison here is in float64 at
``rtol=1e-7, atol=1e-9`` (the harness's tolerances).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gradhooks
from gradhooks.oracle import loop_grad, vmap_grad
from harness import assert_close
from harness import sum_of_squares as sq


def oracle_check(
    model: nn.Module,
    inputs,
    loss=sq,
    target=None,
    reduction: str = "sum",
    loop: bool = False,
    quantities=("grad1",),
):
    """Run ``model`` (made float64) on ``inputs`` under gradhooks with ``loss`` (which reduces
    over the batch by ``reduction``) and assert that every trainable parameter's ``grad1``
    equals ``vmap(grad)`` (and the per-example loop with ``loop=True``), and that it reduces to
    ``.grad``. Returns the handle (removed) and the oracle's gradients."""
    model = model.double()
    inputs = tuple(
        t.double() if t.is_floating_point() else t
        for t in (inputs if isinstance(inputs, tuple) else (inputs,))
    )
    want = vmap_grad(model, loss, inputs, target)
    if loop:
        by_loop = loop_grad(model, loss, inputs, target)
        for n in want:
            assert_close(by_loop[n], want[n], f"loop vs vmap, {n}")
    with gradhooks.add_hooks(model, loss_reduction=reduction, quantities=quantities) as h:
        out = model(*inputs)
        (loss(out) if target is None else loss(out, target)).backward()
    checked = 0
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert not hasattr(p, "grad1"), f"frozen {n} got a grad1"
            continue
        if "grad1" in quantities:
            assert_close(p.grad1, want[n], f"{type(model).__name__} ({reduction}): {n}")
            reduced = p.grad1.mean(0) if reduction == "mean" else p.grad1.sum(0)
            assert_close(reduced, p.grad, f"grad1 reduced vs .grad, {n}")
        checked += 1
    assert checked, "no trainable parameter was checked"
    return h, want


def seeded(factory):
    torch.manual_seed(0)
    return factory()


# == Opacus: opacus/tests/grad_samples/*, one layer at a time ===================================

CONV_SETTINGS = [
    dict(stride=1, padding=0),
    dict(stride=2, padding=1, bias=False),
    dict(stride=1, padding=2, dilation=2),
    dict(stride=1, padding="same", groups=2),
    dict(stride=1, padding="valid", dilation=1, groups=4),
    dict(stride=2, padding=1, padding_mode="circular"),
    dict(stride=1, padding=1, padding_mode="reflect"),
]


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize(
    "kw", CONV_SETTINGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items())
)
def test_conv_grad1_over_strides_padding_dilation_groups(dims, kw):
    """Conv1d/2d/3d over stride, padding (int, "same", "valid"), padding modes, dilation,
    groups and bias: Opacus' ``conv1d_test.py``, ``conv2d_test.py``, ``conv3d_test.py``
    (hypothesis over the same hyper-parameters) and BackPACK's conv problem settings."""
    if dims == 3 and kw.get("padding_mode") == "reflect":
        pytest.skip("covered in 1d and 2d; keeps the 3d cases small")
    conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1]
    model = seeded(lambda: conv(4, 8, 3, **kw))
    size = (7, 6, 5)[dims - 1]
    oracle_check(model, torch.randn(3, 4, *([size] * dims)))


@pytest.mark.parametrize("shape", [(5, 6), (5, 3, 6), (5, 2, 3, 6)], ids=["2d", "3d", "4d"])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_grad1_with_extra_dimensions(shape, bias):
    """Linear on inputs of 2, 3 and 4 dimensions (the extra ones shared by the example):
    Opacus' ``linear_test.py``; curvlinops' and ASDL's weight-sharing ("expand") setting."""
    model = seeded(lambda: nn.Linear(6, 4, bias=bias))
    oracle_check(model, torch.randn(*shape))


@pytest.mark.parametrize("padding_idx", [None, 0])
@pytest.mark.parametrize("shape", [(5,), (5, 7)], ids=["one-index", "sequence"])
def test_embedding_grad1(shape, padding_idx):
    """Embedding of one index or a sequence per example, with and without ``padding_idx``:
    Opacus' ``embedding_test.py``; BackPACK's Embedding setting."""
    model = seeded(lambda: nn.Embedding(10, 4, padding_idx=padding_idx))
    idx = torch.randint(0, 10, shape)
    idx[0].view(-1)[0] = 0  # the padding index occurs
    oracle_check(model, idx)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_grad1_with_offsets(mode):
    """EmbeddingBag with a flat index list and offsets (one bag per example, bags of unequal
    length), against a loop over the bags: Opacus' ``embedding_bag_test.py``."""
    bag = seeded(lambda: nn.EmbeddingBag(10, 4, mode=mode)).double()
    idx = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])
    offsets = torch.tensor([0, 3, 4, 6])
    ends = [*offsets[1:].tolist(), len(idx)]
    want = []
    for start, end in zip(offsets.tolist(), ends, strict=True):
        bag.zero_grad()
        sq(bag(idx[start:end], torch.tensor([0]))).backward()
        want.append(bag.weight.grad.clone())
    bag.zero_grad()
    with gradhooks.add_hooks(bag, loss_reduction="sum"):
        sq(bag(idx, offsets)).backward()
    assert_close(bag.weight.grad1, torch.stack(want), f"EmbeddingBag({mode}) weight")


def test_embedding_bag_per_sample_weights():
    """EmbeddingBag(mode="sum") with ``per_sample_weights``, one bag per row of a 2-d input:
    Opacus' ``embedding_bag_test.py`` feeds bags of the same kind."""
    bag = seeded(lambda: nn.EmbeddingBag(10, 4, mode="sum"))

    class Weighted(nn.Module):
        def __init__(self):
            super().__init__()
            self.bag = bag

        def forward(self, idx, weights):
            return self.bag(idx, per_sample_weights=weights)

    oracle_check(Weighted(), (torch.randint(0, 10, (4, 3)), torch.rand(4, 3)))


NORMS = [
    ("group_norm", lambda: nn.GroupNorm(2, 4), (5, 4, 6)),
    ("group_norm_4d", lambda: nn.GroupNorm(4, 4, affine=True), (5, 4, 3, 3)),
    ("instance_norm1d", lambda: nn.InstanceNorm1d(4, affine=True), (5, 4, 6)),
    ("instance_norm2d", lambda: nn.InstanceNorm2d(4, affine=True), (5, 4, 3, 3)),
    ("instance_norm3d", lambda: nn.InstanceNorm3d(4, affine=True), (5, 4, 2, 3, 3)),
    ("layer_norm_last", lambda: nn.LayerNorm(6), (5, 3, 6)),
    ("layer_norm_two", lambda: nn.LayerNorm((3, 6)), (5, 3, 6)),
    ("layer_norm_no_bias", lambda: nn.LayerNorm(6, bias=False), (5, 6)),
    ("rms_norm", lambda: nn.RMSNorm(6), (5, 3, 6)),
    ("rms_norm_two", lambda: nn.RMSNorm((3, 6), eps=1e-5), (5, 3, 6)),
]


@pytest.mark.parametrize("factory,shape", [n[1:] for n in NORMS], ids=[n[0] for n in NORMS])
def test_normalization_grad1(factory, shape):
    """GroupNorm, InstanceNorm1d/2d/3d, LayerNorm (one and two normalized dimensions) and
    RMSNorm: Opacus' ``group_norm_test.py``, ``instance_norm*_test.py``, ``layer_norm_test.py``,
    ``rms_norm_test.py``. The loss is made non-symmetric (a weighted sum), since a normalized
    output's plain sum of squares has a zero gradient for the scale."""
    model = seeded(factory)
    torch.manual_seed(1)
    x = torch.randn(*shape)
    w = torch.randn(shape[1:]).double()
    oracle_check(model, x, loss=lambda out, t=None: (out * w).sum() + sq(out))


@pytest.mark.parametrize("kind", [nn.RNN, nn.GRU, nn.LSTM])
@pytest.mark.parametrize(
    "kw",
    [
        dict(num_layers=1, batch_first=True),
        dict(num_layers=2, batch_first=False, bidirectional=True),
        dict(num_layers=2, batch_first=True, bias=False),
    ],
    ids=["one-layer", "two-layer-bidirectional", "no-bias"],
)
def test_rnn_grad1(kind, kw):
    """RNN, GRU and LSTM over layers, directions, ``batch_first`` and bias: Opacus'
    ``dp_rnn_test.py`` (DPRNN / DPGRU / DPLSTM against their torch counterparts)."""
    rnn = seeded(lambda: kind(4, 5, **kw))

    class BatchFirst(nn.Module):
        """The oracle maps dimension 0: hand a time-major RNN ``[T, batch, F]``."""

        def __init__(self):
            super().__init__()
            self.rnn = rnn

        def forward(self, x):
            if kw["batch_first"]:
                return self.rnn(x)[0]
            return self.rnn(x.transpose(0, 1))[0].transpose(0, 1)

    oracle_check(BatchFirst(), torch.randn(3, 4, 4))


def test_lstm_grad1_with_initial_state():
    """An LSTM given its initial ``(h0, c0)``: Opacus' ``dp_rnn_test.py`` passes a state."""
    model = seeded(lambda: nn.LSTM(4, 5, batch_first=True))
    x, h0, c0 = torch.randn(3, 6, 4), torch.randn(1, 3, 5), torch.randn(1, 3, 5)

    class WithState(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = model

        def forward(self, x, h0, c0):
            return self.lstm(x, (h0.transpose(0, 1), c0.transpose(0, 1)))[0]

    oracle_check(WithState(), (x, h0.transpose(0, 1), c0.transpose(0, 1)))


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(bias=False),
        dict(add_bias_kv=True),
        dict(add_zero_attn=True),
        dict(kdim=3, vdim=5),
    ],
    ids=["plain", "no-bias", "bias-kv", "zero-attn", "kdim-vdim"],
)
def test_multihead_attention_grad1(kw):
    """MultiheadAttention with and without bias, ``add_bias_kv``, ``add_zero_attn``, other key
    and value sizes: Opacus' ``multi_head_attention_test.py`` (DPMultiheadAttention)."""
    mha = seeded(lambda: nn.MultiheadAttention(6, 2, batch_first=True, **kw))

    class Attend(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = mha

        def forward(self, q, k, v):
            return self.mha(q, k, v, need_weights=False)[0]

    q = torch.randn(3, 4, 6)
    k = torch.randn(3, 5, kw.get("kdim", 6))
    v = torch.randn(3, 5, kw.get("vdim", 6))
    oracle_check(Attend(), (q, k, v))


class SequenceBias(nn.Module):
    """A learned vector appended to each sequence (Opacus' ``opacus.layers.SequenceBias``):
    ``[batch, T, F]`` to ``[batch, T + 1, F]``."""

    def __init__(self, features: int):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(features))

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([x, self.bias.expand(x.shape[0], 1, -1)], dim=1)


def test_sequence_bias_grad1_through_the_fallback():
    """A layer without a rule whose parameter is expanded over the batch: Opacus'
    ``sequence_bias_test.py``. gradhooks computes it through its ``torch.func`` fallback."""
    model = seeded(lambda: nn.Sequential(nn.Linear(4, 4), SequenceBias(4), nn.Linear(4, 2)))
    h, _ = oracle_check(model, torch.randn(3, 5, 4))
    assert [n for n, _ in h.fallback_modules()] == ["1"]


# == Opacus: opacus/tests/grad_sample_module_test.py ============================================


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 3, 3), nn.GroupNorm(1, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 4)
    ).double()


def net_input(batch=4) -> Tensor:
    torch.manual_seed(2)
    return torch.randn(batch, 1, 6, 6, dtype=torch.float64)


def test_outputs_and_grads_unaltered_by_hooks():
    """The hooked model's outputs and ``.grad`` are those of the plain model: Opacus'
    ``test_outputs_unaltered`` and its ``.grad`` comparison."""
    plain, hooked = small_net(), small_net()
    x = net_input()
    out_plain = plain(x)
    sq(out_plain).backward()
    with gradhooks.add_hooks(hooked, loss_reduction="sum"):
        out = hooked(x)
        sq(out).backward()
    assert torch.equal(out, out_plain)
    for (n, p), q in zip(hooked.named_parameters(), plain.parameters(), strict=True):
        assert_close(p.grad, q.grad, f".grad of {n}")


def test_remove_hooks_leaves_the_model_as_it_was():
    """After the hooks are removed no hook is left on any module and a backward writes no
    ``grad1``: Opacus' ``test_remove_hooks``."""
    model = small_net()
    before = {
        n: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
        for n, m in model.named_modules()
    }
    attrs = {n: set(vars(m)) for n, m in model.named_modules()}
    h = gradhooks.add_hooks(model)
    sq(model(net_input())).backward()
    h.remove()
    gradhooks.clear_grad1(model)
    after = {
        n: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
        for n, m in model.named_modules()
    }
    assert after == before
    assert {n: set(vars(m)) for n, m in model.named_modules()} == attrs
    sq(model(net_input())).backward()
    assert not any(hasattr(p, "grad1") for p in model.parameters())


def test_disable_and_enable_hooks():
    """While capture is disabled a backward writes no ``grad1``; enabled again, it does:
    Opacus' ``test_enable_hooks`` / ``test_disable_hooks`` and autograd-hacks'
    ``disable_hooks`` / ``enable_hooks``."""
    model = small_net()
    x = net_input()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        gradhooks.disable_hooks()
        try:
            sq(model(x)).backward()
        finally:
            gradhooks.enable_hooks()
        assert not any(hasattr(p, "grad1") for p in model.parameters())
        model.zero_grad()
        sq(model(x)).backward()
        want = vmap_grad(model, sq, x)
        for n, p in model.named_parameters():
            assert_close(p.grad1, want[n], n)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_clears_grad1(set_to_none):
    """After ``optimizer.zero_grad()`` the next backward's ``grad1`` is its own, of a batch of
    another size: Opacus' ``test_zero_grad``. (gradhooks starts ``grad1`` afresh at the start
    of the backward that follows a reset ``.grad``, rather than at ``zero_grad`` itself.)"""
    model = small_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x1, x2 = net_input(), net_input(3) * 2
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(x1)).backward()
        opt.zero_grad(set_to_none=set_to_none)
        sq(model(x2)).backward()
    want = vmap_grad(model, sq, x2)
    for n, p in model.named_parameters():
        assert_close(p.grad1, want[n], n)


def test_grad1_accumulates_across_backwards_like_grad():
    """Two backwards without ``zero_grad`` between them add up, as ``.grad`` does (the same
    examples: grad1 = the sum of both losses' per-example gradients): Opacus'
    ``test_grad_sample_accumulation`` (virtual steps)."""
    model = small_net()
    x = net_input()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(x)).backward()
        (3 * sq(model(x))).backward()
    want = vmap_grad(model, sq, x)
    for n, p in model.named_parameters():
        assert_close(p.grad1, 4 * want[n], n)
        assert_close(p.grad1.sum(0), p.grad, f"{n} reduced")


def test_frozen_parameters_get_no_grad1():
    """A parameter with ``requires_grad=False`` gets no ``grad1``; the others are exact:
    Opacus' ``test_no_grad_sample_for_frozen_parameters`` (and its frozen-layer tests)."""
    model = small_net()
    model[0].bias.requires_grad_(False)
    model[1].requires_grad_(False)
    oracle_check(model, net_input())
    assert not hasattr(model[0].bias, "grad1")
    assert hasattr(model[0].weight, "grad1")


def test_fully_frozen_layer_in_the_middle():
    """A whole frozen layer between trainable ones still passes the gradient through: Opacus'
    ``test_frozen_layer`` cases."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))
    model[2].requires_grad_(False)
    oracle_check(model, torch.randn(5, 4), loop=True)


class Tied(nn.Module):
    """An embedding whose weight is also the output projection (a tied language-model head)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.mid(self.emb(idx))))


def test_tied_parameters_sum_both_uses():
    """A weight shared by two layers gets the sum of both uses' per-example gradients: Opacus'
    shared-parameter tests (``test_tied_weights``); autograd-hacks asserts on these."""
    model = seeded(Tied)
    oracle_check(model, torch.randint(0, 10, (4, 5)), loss=lambda out, t=None: sq(out) / 10)


def test_module_used_twice_in_one_forward():
    """One Linear applied twice in the same forward: the per-example gradient sums both calls
    (Opacus' ``test_shared_layer`` / reused modules; autograd-hacks refuses this)."""
    lin = seeded(lambda: nn.Linear(4, 4))

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(torch.tanh(self.lin(x)))

    oracle_check(Twice(), torch.randn(5, 4), loop=True)


class Unsupported(nn.Module):
    """A layer with a trainable parameter and no rule: a per-feature scale and square."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return (x * self.scale) ** 2


def test_unsupported_layer_by_fallback_or_refused():
    """A model with a layer no rule covers: Opacus refuses it (``test_unsupported_layer``,
    ``GradSampleModule`` raises ``NotImplementedError``); gradhooks computes it exactly by its
    fallback, and with ``unsupported="error"`` refuses it, naming it, before hooking anything."""
    model = seeded(lambda: nn.Sequential(nn.Linear(3, 4), Unsupported(), nn.Linear(4, 2)))
    h, _ = oracle_check(model, torch.randn(5, 3), loop=True)
    assert [n for n, _ in h.fallback_modules()] == ["1"]
    assert not gradhooks.is_supported(model[1])
    fresh = seeded(lambda: nn.Sequential(nn.Linear(3, 4), Unsupported(), nn.Linear(4, 2)))
    hooks_before = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in fresh.modules()]
    with pytest.raises(gradhooks.UnsupportedModuleError, match=r"'1'.*Unsupported"):
        gradhooks.add_hooks(fresh, unsupported="error")
    assert [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in fresh.modules()] == (
        hooks_before
    )


def test_batch_norm_in_train_mode_is_refused():
    """BatchNorm with batch statistics has no per-example gradient: Opacus refuses it
    (``ModuleValidator``, ``test_batchnorm_validation``); BackPACK's ``BatchGrad`` refuses it in
    train mode. gradhooks raises, naming the layer and what to do."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(48, 2))
    with (
        gradhooks.add_hooks(model),
        pytest.raises(gradhooks.MixedExamplesError, match=r"'1'.*BatchNorm2d.*GroupNorm"),
    ):
        model(torch.randn(4, 1, 6, 6))


def test_batch_norm_in_eval_mode():
    """BatchNorm in eval mode is a per-example affine map: BackPACK's ``BatchGrad`` settings
    with BatchNorm in eval mode."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(48, 2))
    model(torch.randn(8, 1, 6, 6))  # running statistics away from their defaults
    model.eval()
    oracle_check(model, torch.randn(4, 1, 6, 6))


def test_empty_batch_gives_empty_grad1():
    """A batch of zero examples gives ``grad1`` of shape ``[0, *param.shape]``: Opacus'
    empty-batch tests (``test_empty_batch`` of its optimizer and GradSampleModule)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(torch.randn(0, 3))).backward()
    for p in model.parameters():
        assert p.grad1.shape == (0, *p.shape)


# == BackPACK: test/extensions/firstorder/* ======================================================


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 3, 2, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(3, 3, 2, stride=1),
        nn.Sigmoid(),
        nn.AvgPool2d(1),
        nn.Flatten(),
        nn.Linear(3, 4),
    )


BACKPACK_PROBLEMS = [
    (
        "linear-relu-linear",
        lambda: nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 4)),
        (6, 5),
    ),
    (
        "linear-sigmoid-linear",
        lambda: nn.Sequential(nn.Linear(5, 6), nn.Sigmoid(), nn.Linear(6, 4)),
        (6, 5),
    ),
    ("cnn-pool", cnn, (6, 2, 4, 4)),
    (
        "conv-transpose1d",
        lambda: nn.Sequential(
            nn.ConvTranspose1d(2, 3, 3, stride=2), nn.Flatten(), nn.Linear(3 * 9, 4)
        ),
        (6, 2, 4),
    ),
    (
        "conv-transpose2d",
        lambda: nn.Sequential(
            nn.ConvTranspose2d(2, 3, 2, padding=1, output_padding=1, stride=2, dilation=2),
            nn.Flatten(),
            nn.LazyLinear(4),
        ),
        (6, 2, 3, 3),
    ),
    (
        "conv-transpose3d-groups",
        lambda: nn.Sequential(
            nn.ConvTranspose3d(2, 4, 2, groups=2), nn.Flatten(), nn.Linear(4 * 27, 4)
        ),
        (6, 2, 2, 2, 2),
    ),
]


def ce(reduction):
    def loss(out, target):
        return F.cross_entropy(out, target, reduction=reduction)

    return loss


def mse(reduction):
    def loss(out, target):
        return F.mse_loss(out, target, reduction=reduction)

    return loss


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("lossname", ["cross_entropy", "mse"])
@pytest.mark.parametrize(
    "factory,shape", [p[1:] for p in BACKPACK_PROBLEMS], ids=[p[0] for p in BACKPACK_PROBLEMS]
)
def test_batch_grad_over_problems_and_losses(factory, shape, lossname, reduction):
    """``grad1`` (BackPACK's ``BatchGrad``) of each problem under CrossEntropyLoss and MSELoss
    with ``reduction="sum"`` and ``"mean"``: BackPACK's ``batchgrad_settings.py`` /
    ``firstorder_settings.py``. (MSELoss's mean divides by every element, not only the batch:
    each example's own loss is then its mean over the outputs, and grad1 is its gradient.)"""
    torch.manual_seed(0)
    model = factory()
    x = torch.randn(*shape)
    if any(isinstance(m, nn.LazyLinear) for m in model.modules()):
        model(x)
    torch.manual_seed(3)
    if lossname == "cross_entropy":
        target, loss = torch.randint(0, 4, (shape[0],)), ce(reduction)
    else:
        target, loss = torch.randn(shape[0], 4).double(), mse(reduction)
    oracle_check(model, x, loss=loss, target=target, reduction=reduction)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_batch_l2_grad_sum_grad_squared_and_variance(reduction):
    """Per-parameter squared per-example norms (BackPACK's ``BatchL2Grad``), the sum of
    squared per-example gradients (``SumGradSquared``), and their variance (``Variance``), each
    against the oracle's per-example gradients: BackPACK's ``batch_l2_grad``,
    ``sum_grad_squared`` and ``variance`` tests. gradhooks' quantities are of each example's
    own loss whatever the reduction (BackPACK's carry a ``1/batch`` or ``1/batch²`` under a
    mean loss)."""
    torch.manual_seed(0)
    model = cnn().double()
    x = torch.randn(6, 2, 4, 4, dtype=torch.float64)
    target = torch.randint(0, 4, (6,))
    loss = ce(reduction)
    want = vmap_grad(model, loss, x, target)
    with gradhooks.add_hooks(
        model, loss_reduction=reduction, quantities=("norms", "sum_grad_sq")
    ) as h:
        loss(model(x), target).backward()
    norms, sgs, var = h.param_norms(), h.sum_grad_sq(), h.grad_variance()
    total = torch.zeros(6, dtype=torch.float64)
    for n, g in want.items():
        flat = g.flatten(1)
        assert_close(norms[n] ** 2, (flat**2).sum(1), f"BatchL2Grad {n}")
        assert_close(sgs[n], (g**2).sum(0), f"SumGradSquared {n}")
        assert_close(var[n], (g**2).mean(0) - g.mean(0) ** 2, f"Variance {n}")
        total += (flat**2).sum(1)
    assert_close(h.norms(), total.sqrt(), "whole-model norms")


def test_batch_grad_of_a_mixed_model_with_every_quantity_at_once():
    """``grad1``, norms and the squared sum from one backward agree with each other: BackPACK
    runs several first-order extensions in one ``backward`` (``test_extensions_together``)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(10, 4),
        nn.Flatten(),
        nn.Linear(12, 6),
        nn.ReLU(),
        nn.LayerNorm(6),
        nn.Linear(6, 3),
    ).double()
    idx = torch.randint(0, 10, (5, 3))
    h, want = oracle_check(model, idx, quantities=("grad1", "norms", "sum_grad_sq"))
    for n, p in model.named_parameters():
        assert_close(h.param_norms()[n], p.grad1.flatten(1).norm(dim=1), f"norm {n}")
        assert_close(h.sum_grad_sq()[n], (p.grad1**2).sum(0), f"sum_grad_sq {n}")


# == autograd-hacks: test_autograd_hacks.py ======================================================


class AHNet(nn.Module):
    """autograd-hacks' test network: two convolutions, pooling, two linear layers."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3)
        self.conv2 = nn.Conv2d(4, 6, 3)
        self.fc1 = nn.Linear(6 * 2 * 2, 8)
        self.fc2 = nn.Linear(8, 5)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


@pytest.mark.parametrize("loss_type", ["mean", "sum"])
def test_autograd_hacks_grad1(loss_type):
    """``add_hooks``, ``backward``, ``compute_grad1(model, loss_type)`` on a Conv2d/Linear net
    with a cross-entropy loss of either reduction, against a per-example loop: autograd-hacks'
    ``test_grad1``."""
    model = seeded(AHNet).double()
    torch.manual_seed(1)
    x = torch.randn(5, 1, 8, 8, dtype=torch.float64)
    y = torch.randint(0, 5, (5,))
    want = loop_grad(model, ce(loss_type), x, y)
    gradhooks.add_hooks(model)
    try:
        F.cross_entropy(model(x), y, reduction=loss_type).backward()
        gradhooks.compute_grad1(model, loss_type=loss_type)
        for n, p in model.named_parameters():
            assert_close(p.grad1, want[n], n)
    finally:
        gradhooks.remove_hooks(model)


def test_autograd_hacks_multiple_backprops_refused():
    """``compute_grad1`` after two backwards without ``clear_backprops`` refuses ("Multiple
    backprops detected"); after ``clear_backprops`` the next backward is its own:
    autograd-hacks' ``test_grad1`` and the assertion its ``compute_grad1`` carries."""
    model = seeded(AHNet).double()
    x = torch.randn(3, 1, 8, 8, dtype=torch.float64)
    gradhooks.add_hooks(model)
    try:
        sq(model(x)).backward()
        sq(model(x)).backward()
        with pytest.raises(Exception, match="[Mm]ultiple backprops"):
            gradhooks.compute_grad1(model, loss_type="sum")
        gradhooks.clear_backprops(model)
        model.zero_grad()
        sq(model(x)).backward()
        gradhooks.compute_grad1(model, loss_type="sum")
        want = vmap_grad(model, sq, x)
        for n, p in model.named_parameters():
            assert_close(p.grad1, want[n], n)
    finally:
        gradhooks.remove_hooks(model)


@pytest.mark.parametrize("hess_type", ["LeastSquares", "CrossEntropy"])
def test_autograd_hacks_hessian(hess_type):
    """``backprop_hess`` then ``compute_hess``: ``param.hess`` of a Linear-ReLU-Linear net is
    the loss's Hessian (Gauss-Newton; exact for piecewise-linear activations) from
    ``torch.autograd.functional.hessian``: autograd-hacks' ``test_hess``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 3)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    y = torch.randint(0, 3, (5,))
    gradhooks.add_hooks(model)
    try:
        gradhooks.backprop_hess(model(x), hess_type=hess_type)
        gradhooks.compute_hess(model)
    finally:
        gradhooks.remove_hooks(model)
    if hess_type == "LeastSquares":
        assert_hess_is_autograds(model, x, lambda out: 0.5 * (out**2).sum(1).mean())
    else:
        assert_hess_is_autograds(model, x, lambda out: F.cross_entropy(out, y))


def assert_hess_is_autograds(model, x, loss) -> None:
    """Every parameter's ``hess`` is ``torch.autograd.functional.hessian`` of ``loss(model(x))``
    in that parameter (flattened), the others held."""
    params = dict(model.named_parameters())
    for name, p in params.items():

        def loss_of(flat, name=name, p=p):
            values = {n: q.detach() for n, q in params.items()}
            values[name] = flat.view_as(p)
            return loss(torch.func.functional_call(model, values, (x,)))

        want = torch.autograd.functional.hessian(loss_of, p.detach().flatten())
        assert_close(p.hess, want, f"hess of {name}")


def test_autograd_hacks_is_supported():
    """``is_supported`` says whether a built-in rule covers a layer: autograd-hacks'
    ``is_supported`` (Linear and Conv2d there)."""
    assert gradhooks.is_supported(nn.Linear(2, 2))
    assert gradhooks.is_supported(nn.Conv2d(1, 1, 1))
    assert not gradhooks.is_supported(Unsupported())


# == Opacus' DP optimizer tests ==================================================================


def clipped_sum_by_oracle(want: dict[str, Tensor], max_norm: float) -> dict[str, Tensor]:
    flat = torch.cat([g.flatten(1) for g in want.values()], 1)
    factor = (max_norm / flat.norm(dim=1)).clamp(max=1.0)
    return {n: torch.einsum("b,b...->...", factor, g) for n, g in want.items()}


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_dp_sgd_step_clips_each_example(method):
    """A DP-SGD step without noise is the mean of the per-example gradients clipped to
    ``max_norm`` over the whole model: Opacus' ``test_clipping`` (``DPOptimizer`` with
    ``noise_multiplier=0``) and its ghost-clipping tests."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(48, 4)).double()
    x = torch.randn(6, 1, 6, 6, dtype=torch.float64)
    y = torch.randint(0, 4, (6,))
    want = clipped_sum_by_oracle(vmap_grad(model, ce("sum"), x, y), max_norm=0.1)
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        per_example = F.cross_entropy(model(x), y, reduction="none")
        gradhooks.dp_sgd_step(h, per_example, max_norm=0.1, noise_multiplier=0.0, method=method)
    for n, p in model.named_parameters():
        assert_close(p.grad, want[n] / 6, f"{method}: {n}")


@pytest.mark.parametrize("quantities", [("grad1",), ("norms",)], ids=["grad1", "norms"])
def test_dp_optimizer_physical_batches_equal_one_logical_batch(quantities):
    """A logical batch split into physical batches gives the same step as one backward:
    Opacus' virtual-step tests (``test_virtual_step``, ``BatchMemoryManager``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x = torch.randn(8, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (8,))
    want = clipped_sum_by_oracle(vmap_grad(model, ce("sum"), x, y), max_norm=0.5)
    start = copy.deepcopy(model.state_dict())
    with gradhooks.add_hooks(model) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=1.0),
            h,
            max_grad_norm=0.5,
            noise_multiplier=0.0,
            expected_batch_size=8,
        )
        for part in (slice(0, 3), slice(3, 8)):
            opt.backward(F.cross_entropy(model(x[part]), y[part], reduction="none"))
        opt.step()
    for n, p in model.named_parameters():
        assert_close(p.detach(), start[n] - want[n] / 8, f"step of {n}")


def test_dp_noise_has_the_promised_standard_deviation():
    """The noise added to each coordinate is Gaussian with standard deviation
    ``noise_multiplier · max_norm / batch``: Opacus' ``test_noise_level``. A loss with zero
    gradient isolates the noise; 20,000 coordinates put the sample deviation within 3%."""
    torch.manual_seed(0)
    model = nn.Linear(200, 100).double()
    x = torch.randn(4, 200, dtype=torch.float64)
    with gradhooks.add_hooks(model) as h:
        per_example = 0.0 * model(x).sum(1)
        gradhooks.dp_sgd_step(
            h,
            per_example,
            max_norm=2.0,
            noise_multiplier=1.5,
            generator=torch.Generator().manual_seed(1),
        )
    noise = torch.cat([p.grad.flatten() for p in model.parameters()])
    want = 1.5 * 2.0 / 4
    assert abs(noise.std().item() / want - 1) < 0.03, noise.std().item()
    assert abs(noise.mean().item()) < 3 * want / noise.numel() ** 0.5


# == More of the peers' settings =================================================================


def test_time_major_input_with_batch_dim_1():
    """Inputs whose batch dimension is 1 (``[T, batch, F]``): Opacus' ``batch_first=False``
    of ``GradSampleModule`` (its RNN and transformer tests)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x = torch.randn(6, 3, 4, dtype=torch.float64)  # [T, batch, F]
    want = vmap_grad(model, sq, x.transpose(0, 1))
    with gradhooks.add_hooks(model, loss_reduction="sum", batch_dim=1):
        sq(model(x)).backward()
    for n, p in model.named_parameters():
        assert_close(p.grad1, want[n], n)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_cross_entropy_over_a_sequence(reduction):
    """A language-model loss: cross-entropy over ``[batch · T, classes]`` logits, reduced over
    every token: curvlinops' per-example settings with sequence losses and BackPACK's
    ``CrossEntropyLoss`` on ``[N, C, d]`` outputs. Each example's own loss is the mean (or sum)
    over its tokens."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 10))
    idx, target = torch.randint(0, 10, (4, 5)), torch.randint(0, 10, (4, 5))

    def loss(out, t):
        return F.cross_entropy(out.reshape(-1, 10), t.reshape(-1), reduction=reduction)

    oracle_check(model, idx, loss=loss, target=target, reduction=reduction)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_cross_entropy_on_channels_first_outputs(reduction):
    """Cross-entropy on ``[N, C, L]`` outputs of a Conv1d (a per-position classifier):
    BackPACK's ``CrossEntropyLoss`` settings with extra output dimensions."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv1d(4, 5, 1))
    x, target = torch.randn(4, 3, 6), torch.randint(0, 5, (4, 6))
    oracle_check(
        model,
        x,
        loss=lambda out, t: F.cross_entropy(out, t, reduction=reduction),
        target=target,
        reduction=reduction,
    )


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_bce_with_logits(reduction):
    """BCEWithLogitsLoss over several outputs: BackPACK's loss settings."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ELU(), nn.Linear(6, 3))
    x, target = torch.randn(5, 4), torch.rand(5, 3).double()

    def loss(out, t):
        return F.binary_cross_entropy_with_logits(out, t, reduction=reduction)

    oracle_check(model, x, loss=loss, target=target, reduction=reduction)


def test_autograd_hacks_compute_grad1_rescales_to_its_loss_type():
    """Hooks added for a mean loss and a sum loss backpropagated, then
    ``compute_grad1(model, loss_type="sum")``: autograd-hacks takes the reduction from
    ``compute_grad1``, and so does gradhooks."""
    model = seeded(AHNet).double()
    x = torch.randn(4, 1, 8, 8, dtype=torch.float64)
    y = torch.randint(0, 5, (4,))
    want = vmap_grad(model, ce("sum"), x, y)
    gradhooks.add_hooks(model)  # loss_reduction="mean"
    try:
        F.cross_entropy(model(x), y, reduction="sum").backward()
        gradhooks.compute_grad1(model, loss_type="sum")
        for n, p in model.named_parameters():
            assert_close(p.grad1, want[n], n)
    finally:
        gradhooks.remove_hooks(model)


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_dp_sgd_step_with_tied_and_reused_parameters(method):
    """Clipping with a weight shared by two layers: the clipped norm is of the sum of both
    uses (Opacus' ghost-clipping tests with tied embeddings)."""
    model = seeded(Tied).double()
    idx, y = torch.randint(0, 10, (5, 3)), torch.randint(0, 10, (5, 3))

    def loss(out, t):
        return F.cross_entropy(out.reshape(-1, 10), t.reshape(-1), reduction="sum")

    want = clipped_sum_by_oracle(vmap_grad(model, loss, idx, y), max_norm=0.3)
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        out = model(idx)
        per_example = F.cross_entropy(out.transpose(1, 2), y, reduction="none").sum(1)
        gradhooks.dp_sgd_step(
            h, per_example, max_norm=0.3, noise_multiplier=0.0, method=method, reduction="sum"
        )
    for n, p in model.named_parameters():
        assert_close(p.grad, want[n], f"{method}: {n}")


def test_dp_optimizer_empty_physical_batch():
    """A Poisson-sampled physical batch with no example: the step is the noise alone (zero
    without noise), never an error: Opacus' ``test_empty_batch`` of its DP optimizer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    start = copy.deepcopy(model.state_dict())
    x, y = torch.randn(0, 4, dtype=torch.float64), torch.randint(0, 3, (0,))
    with gradhooks.add_hooks(model) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=1.0),
            h,
            max_grad_norm=0.5,
            noise_multiplier=0.0,
            expected_batch_size=8,
        )
        opt.backward(F.cross_entropy(model(x), y, reduction="none"))
        opt.step()
    for n, p in model.named_parameters():
        assert_close(p.detach(), start[n], f"empty step of {n}")


def test_packed_sequence_lstm():
    """An LSTM over a ``PackedSequence`` of sequences of unequal length: Opacus'
    ``dp_rnn_test.py`` (``packed_input_flag``). Each example's gradient is of its own
    sequence, up to its length."""
    lstm = seeded(lambda: nn.LSTM(3, 4, batch_first=True)).double()
    torch.manual_seed(1)
    x = torch.randn(3, 5, 3, dtype=torch.float64)
    lengths = torch.tensor([5, 2, 4])
    want = []
    for i in range(3):
        lstm.zero_grad()
        out, _ = lstm(x[i : i + 1, : lengths[i]])
        sq(out).backward()
        want.append({n: p.grad.clone() for n, p in lstm.named_parameters()})
    lstm.zero_grad()
    with gradhooks.add_hooks(lstm, loss_reduction="sum"):
        packed = nn.utils.rnn.pack_padded_sequence(
            x, lengths, batch_first=True, enforce_sorted=False
        )
        out, _ = lstm(packed)
        sq(out.data).backward()
    for n, p in lstm.named_parameters():
        assert_close(p.grad1, torch.stack([w[n] for w in want]), n)


class Calling(nn.Module):
    """``module`` called by ``how(module, *inputs)``: a layer given keyword arguments or a
    state, or whose output is a tuple."""

    def __init__(self, module: nn.Module, how):
        super().__init__()
        self.module, self.how = module, how

    def forward(self, *inputs):
        return self.how(self.module, *inputs)


def first(module, x):
    return module(x)[0]


MORE_LAYERS = [
    (
        "lstm-proj-size",
        lambda: Calling(nn.LSTM(4, 6, 2, proj_size=3, batch_first=True), first),
        lambda: torch.randn(3, 4, 4),
    ),
    (
        "rnn-relu",
        lambda: Calling(nn.RNN(4, 6, nonlinearity="relu", batch_first=True), first),
        lambda: torch.randn(3, 4, 4),
    ),
    (
        "gru-initial-state",
        lambda: Calling(
            nn.GRU(4, 6, batch_first=True), lambda m, x, h: m(x, h.transpose(0, 1).contiguous())[0]
        ),
        lambda: (torch.randn(3, 4, 4), torch.randn(3, 1, 6)),
    ),
    (
        "mha-key-padding-mask",
        lambda: Calling(
            nn.MultiheadAttention(6, 2, batch_first=True),
            lambda m, q, k, mask: m(q, k, k, key_padding_mask=mask, need_weights=False)[0],
        ),
        lambda: (
            torch.randn(3, 4, 6),
            torch.randn(3, 5, 6),
            torch.tensor([[0, 0, 0, 0, 0], [0, 0, 0, 1, 1], [0, 1, 1, 1, 1]]).bool(),
        ),
    ),
    (
        "mha-causal",
        lambda: Calling(
            nn.MultiheadAttention(6, 2, batch_first=True),
            lambda m, q: m(q, q, q, attn_mask=torch.ones(4, 4).triu(1).bool(), need_weights=False)[
                0
            ],
        ),
        lambda: torch.randn(3, 4, 6),
    ),
    (
        "mha-sequence-first-with-weights",
        lambda: Calling(nn.MultiheadAttention(6, 2), lambda m, q: m(*[q.transpose(0, 1)] * 3)),
        lambda: torch.randn(3, 4, 6),
    ),
    (
        "conv2d-same-even-kernel-dilated",
        lambda: nn.Conv2d(2, 3, (2, 4), padding="same", dilation=(2, 1)),
        lambda: torch.randn(3, 2, 6, 7),
    ),
    (
        "conv2d-replicate-strided",
        lambda: nn.Conv2d(2, 3, 3, padding=(1, 2), stride=(1, 2), padding_mode="replicate"),
        lambda: torch.randn(3, 2, 6, 7),
    ),
    (
        "conv-transpose2d-output-size",
        lambda: Calling(
            nn.ConvTranspose2d(2, 3, 3, stride=2), lambda m, x: m(x, output_size=[10, 10])
        ),
        lambda: torch.randn(3, 2, 4, 4),
    ),
    (
        "conv-transpose1d-groups-dilation",
        lambda: nn.ConvTranspose1d(
            4, 6, 3, stride=2, padding=1, dilation=2, groups=2, output_padding=1
        ),
        lambda: torch.randn(3, 4, 5),
    ),
    (
        "transformer-encoder-layer",
        lambda: nn.TransformerEncoderLayer(6, 2, 12, dropout=0.0, batch_first=True),
        lambda: torch.randn(3, 4, 6),
    ),
    (
        "transformer-encoder-norm-first",
        lambda: nn.TransformerEncoderLayer(
            6, 2, 12, dropout=0.0, batch_first=True, norm_first=True
        ),
        lambda: torch.randn(3, 4, 6),
    ),
    (
        "transformer-decoder-layer",
        lambda: nn.TransformerDecoderLayer(6, 2, 12, dropout=0.0, batch_first=True),
        lambda: (torch.randn(3, 4, 6), torch.randn(3, 5, 6)),
    ),
    (
        "prelu-per-channel",
        lambda: nn.Sequential(nn.Conv1d(2, 3, 1), nn.PReLU(3)),
        lambda: torch.randn(3, 2, 5),
    ),
    (
        "bilinear-by-fallback",
        lambda: Calling(nn.Bilinear(3, 4, 2), lambda m, a, b: m(a, b)),
        lambda: (torch.randn(5, 3), torch.randn(5, 4)),
    ),
    ("batch-norm1d-eval-sequence", lambda: nn.BatchNorm1d(4).eval(), lambda: torch.randn(3, 4, 5)),
]


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning")
@pytest.mark.parametrize(
    "factory,inputs", [m[1:] for m in MORE_LAYERS], ids=[m[0] for m in MORE_LAYERS]
)
def test_more_layer_settings(factory, inputs):
    """Layer settings the peers' per-layer suites sweep: Opacus' ``dp_rnn_test.py``
    (nonlinearity, initial states), ``multi_head_attention_test.py`` (masks, sequence-first
    inputs), ``conv2d_test.py`` ("same" padding with even kernels, padding modes), BackPACK's
    ConvTranspose settings (``output_size``, groups, dilation) and its BatchNorm-in-eval
    setting; transformer layers and PReLU as Opacus' model tests use them; a Bilinear layer
    (no rule in either peer) by the fallback."""
    model = seeded(factory)
    torch.manual_seed(1)
    oracle_check(
        model,
        inputs(),
        loss=lambda out, t=None: (
            sq(out) + sum((o**3).sum() for o in (out if isinstance(out, tuple) else (out,)))
        ),
    )


class Parent(nn.Module):
    """A module with a parameter of its own and children with rules (Opacus'
    ``test_custom_module`` with parameters and submodules)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.scale = nn.Parameter(torch.randn(4))
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.lin(x) * self.scale))


class TwiceUnsupported(nn.Module):
    """A layer without a rule applied twice around a Linear."""

    def __init__(self):
        super().__init__()
        self.u, self.lin = Unsupported(), nn.Linear(4, 4)

    def forward(self, x):
        return self.u(self.lin(self.u(x)))


@pytest.mark.parametrize("factory", [Parent, TwiceUnsupported], ids=lambda f: f.__name__)
def test_custom_modules_with_own_parameters(factory):
    """Modules holding their own parameters beside children with rules, and a module without a
    rule used twice: Opacus' custom-module tests of ``GradSampleModule``."""
    oracle_check(seeded(factory), torch.randn(5, 3 if factory is Parent else 4), loop=True)


def test_embedding_max_norm_renormalizes_then_differentiates():
    """Embedding(max_norm=...) renormalizes its looked-up rows in place during the forward;
    each example's gradient is then that of the renormalized table (Opacus'
    ``embedding_test.py`` sweeps ``max_norm``). Against a loop over the examples on the
    renormalized table."""
    model = seeded(
        lambda: nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Flatten(), nn.Linear(12, 2))
    ).double()
    idx = torch.randint(0, 10, (5, 3))
    reference = copy.deepcopy(model)
    with torch.no_grad():
        reference[0](idx)  # the same renormalization the hooked forward does
    want = loop_grad(reference, sq, idx)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(idx)).backward()
    for n, p in model.named_parameters():
        assert_close(p.grad1, want[n], n)
        assert_close(p.grad1.sum(0), p.grad, f"{n} reduced")


def test_embedding_scale_grad_by_freq_counts_within_each_example():
    """Embedding(scale_grad_by_freq=True): each example's gradient divides by the counts in
    that example (its own loss's gradient), so ``grad1.sum(0)`` is not ``.grad``, which divides
    by counts over the batch. Opacus' embedding grad sampler does not handle the flag."""
    model = seeded(lambda: nn.Embedding(10, 4, scale_grad_by_freq=True)).double()
    idx = torch.tensor([[1, 1, 2], [3, 1, 1], [4, 5, 6]])
    want = vmap_grad(model, sq, idx)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(idx)).backward()
    assert_close(model.weight.grad1, want["weight"], "weight")
    assert not torch.allclose(model.weight.grad1.sum(0), model.weight.grad)


def test_instance_norm_with_running_stats_in_train_mode():
    """InstanceNorm(track_running_stats=True) in train mode normalizes each example by its own
    statistics (and updates running ones): Opacus' ``instance_norm*_test.py``. vmap cannot run
    the in-place running update, so the loop is the oracle; the running statistics are those of
    the plain model."""
    factory = lambda: nn.InstanceNorm1d(4, affine=True, track_running_stats=True)  # noqa: E731
    model = seeded(factory).double()
    torch.manual_seed(1)
    x, w = torch.randn(3, 4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)

    def loss(out, t=None):
        return (out * w).sum()

    want = loop_grad(copy.deepcopy(model), loss, x)
    plain = seeded(factory).double()
    plain(x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        loss(model(x)).backward()
    for n, p in model.named_parameters():
        assert_close(p.grad1, want[n], n)
    assert_close(model.running_mean, plain.running_mean, "running_mean")
    assert_close(model.running_var, plain.running_var, "running_var")


def mha_net() -> nn.Module:
    return Calling(
        nn.MultiheadAttention(6, 2, batch_first=True, add_bias_kv=True, kdim=4, vdim=5),
        lambda m, q, k, v: m(q, k, v)[0],
    )


QUANTITY_MODELS = [
    ("tied", Tied, lambda: torch.randint(0, 10, (4, 5))),
    (
        "lstm-two-layer",
        lambda: Calling(nn.LSTM(3, 4, 2, batch_first=True), first),
        lambda: torch.randn(3, 5, 3),
    ),
    ("mha", mha_net, lambda: (torch.randn(3, 4, 6), torch.randn(3, 5, 4), torch.randn(3, 5, 5))),
    (
        "embedding-bag",
        lambda: nn.EmbeddingBag(10, 4, mode="mean"),
        lambda: torch.tensor([[1, 1, 2], [3, 4, 3], [5, 5, 5]]),
    ),
    (
        "conv-transpose2d",
        lambda: nn.ConvTranspose2d(2, 3, 3, stride=2, groups=1),
        lambda: torch.randn(3, 2, 4, 4),
    ),
]


@pytest.mark.parametrize(
    "factory,inputs", [m[1:] for m in QUANTITY_MODELS], ids=[m[0] for m in QUANTITY_MODELS]
)
def test_norms_and_sum_grad_sq_per_layer_family(factory, inputs):
    """Per-example norms (BackPACK's ``BatchL2Grad``, Opacus' ghost-clipping norms) and
    ``SumGradSquared`` for tied weights, RNNs, attention, bags and transposed convolutions,
    against the oracle's per-example gradients: BackPACK's first-order extension tests and
    Opacus' ``test_ghost_clipping`` norms, layer by layer."""
    model = seeded(factory).double()
    torch.manual_seed(1)
    x = inputs()
    x = tuple(
        t.double() if t.is_floating_point() else t for t in (x if isinstance(x, tuple) else (x,))
    )
    want = vmap_grad(model, sq, x)
    with gradhooks.add_hooks(
        model, loss_reduction="mean", quantities=("norms", "sum_grad_sq")
    ) as h:
        (sq(model(*x)) / x[0].shape[0]).backward()
    for n, g in want.items():
        assert_close(h.param_norms()[n], g.flatten(1).norm(dim=1), f"norms {n}")
        assert_close(h.sum_grad_sq()[n], (g**2).sum(0), f"sum_grad_sq {n}")


def test_dp_step_through_embedding_lstm_and_attention():
    """Clipping a model of an Embedding, an LSTM and attention, by each method: Opacus'
    DP-LSTM and DPMultiheadAttention end-to-end tests (``test_dp_lstm``, its text models)."""

    class Text(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.lstm = nn.Embedding(10, 6), nn.LSTM(6, 6, batch_first=True)
            self.attn = nn.MultiheadAttention(6, 2, batch_first=True)
            self.out = nn.Linear(6, 3)

        def forward(self, x):
            h = self.lstm(self.emb(x))[0]
            return self.out(self.attn(h, h, h)[0][:, -1])

    model = seeded(Text).double()
    x, y = torch.randint(0, 10, (4, 5)), torch.randint(0, 3, (4,))
    want = clipped_sum_by_oracle(loop_grad(model, ce("sum"), x, y), max_norm=0.5)
    for method in ("grad1", "ghost", "bookkeeping"):
        model.zero_grad()
        quantities = ("grad1",) if method == "grad1" else ("norms",)
        with gradhooks.add_hooks(model, quantities=quantities) as h:
            per_example = F.cross_entropy(model(x), y, reduction="none")
            gradhooks.dp_sgd_step(
                h, per_example, max_norm=0.5, noise_multiplier=0.0, method=method, reduction="sum"
            )
        for n, p in model.named_parameters():
            assert_close(p.grad, want[n], f"{method}: {n}")


# == BackPACK's first-order settings, one by one =================================================


class TimeMajorRNN(nn.Module):
    """[batch, T, F] to a time-major RNN and back to [batch, hidden, T] (BackPACK's
    ``Permute`` / ``RNN`` / ``ReduceTuple`` / ``Permute`` setting)."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.RNN(6, 3)

    def forward(self, x):
        return self.rnn(x.permute(1, 0, 2))[0].permute(1, 2, 0)


def cnn_setting(conv, args, in_shape):
    def factory():
        return nn.Sequential(conv(*args), nn.ReLU(), nn.Flatten(), nn.LazyLinear(4))

    return factory, in_shape


def eval_with_stats(factory, in_shape):
    """``factory()`` with its batch norms run once on other data (running statistics away
    from their defaults), then in eval mode."""

    def make():
        model = factory()
        with torch.no_grad():
            model(torch.rand(8, *in_shape[1:]) * 3 + 1)
        return model.eval()

    return make


FIRST_ORDER = [
    (
        "linear-one-additional-mse-mean",
        lambda: nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2)),
        (3, 4, 5),
        "mse",
        "mean",
        (3, 4, 2),
    ),
    (
        "linear-two-additional-mse-mean",
        lambda: nn.Sequential(nn.Linear(5, 3), nn.Sigmoid(), nn.Linear(3, 2)),
        (3, 4, 2, 5),
        "mse",
        "mean",
        (3, 4, 2, 2),
    ),
    (
        "linear-three-additional-mse-sum",
        lambda: nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2)),
        (3, 4, 2, 3, 5),
        "mse",
        "sum",
        (3, 4, 2, 3, 2),
    ),
    (
        "linear-two-additional-flatten-ce-mean",
        lambda: nn.Sequential(nn.Linear(5, 3), nn.Sigmoid(), nn.Linear(3, 2), nn.Flatten()),
        (3, 4, 2, 5),
        "ce",
        "mean",
        16,
    ),
    (
        "conv1d-dilation-stride",
        *cnn_setting(nn.Conv1d, (2, 3, 2, 2, 0, 2), (3, 2, 7)),
        "ce",
        "mean",
        4,
    ),
    (
        "conv2d-stride-padding-dilation",
        *cnn_setting(nn.Conv2d, (3, 6, 2, 4, 2, 3), (3, 3, 8, 8)),
        "ce",
        "mean",
        4,
    ),
    (
        "conv3d-no-bias",
        *cnn_setting(nn.Conv3d, (3, 2, 2, 4, 2, 1, 1, False), (3, 3, 2, 7, 7)),
        "ce",
        "sum",
        4,
    ),
    (
        "conv-transpose1d-dilation",
        *cnn_setting(nn.ConvTranspose1d, (3, 6, 2, 4, 2, 0, 1, True, 3), (3, 3, 8)),
        "ce",
        "mean",
        4,
    ),
    (
        "conv-transpose2d-dilation",
        *cnn_setting(nn.ConvTranspose2d, (2, 4, 2, 1, 0, 0, 1, True, 2), (3, 2, 9, 9)),
        "ce",
        "mean",
        4,
    ),
    (
        "conv-transpose3d-no-bias",
        *cnn_setting(nn.ConvTranspose3d, (3, 2, 2, 4, 2, 0, 1, False), (3, 3, 2, 7, 7)),
        "ce",
        "sum",
        4,
    ),
    (
        "batch-norm1d-eval-ce-over-positions",
        eval_with_stats(lambda: nn.BatchNorm1d(3), (2, 3, 4)),
        (2, 3, 4),
        "ce",
        "mean",
        (2, 4),
    ),
    (
        "batch-norm2d-eval-ce-over-positions",
        eval_with_stats(lambda: nn.BatchNorm2d(2), (3, 2, 4, 3)),
        (3, 2, 4, 3),
        "ce",
        "mean",
        (3, 4, 3),
    ),
    (
        "batch-norm3d-linear-batch-norm3d-eval",
        eval_with_stats(
            lambda: nn.Sequential(
                nn.BatchNorm3d(3), nn.Linear(2, 3), nn.BatchNorm3d(3), nn.ReLU(), nn.BatchNorm3d(3)
            ),
            (3, 3, 4, 1, 2),
        ),
        (3, 3, 4, 1, 2),
        "ce",
        "mean",
        (3, 4, 1, 3),
    ),
    ("rnn-time-major-ce-over-steps", TimeMajorRNN, (8, 5, 6), "ce", "mean", (8, 5)),
    (
        "rnn-time-major-flatten-mse",
        lambda: nn.Sequential(TimeMajorRNN(), nn.Flatten()),
        (8, 5, 6),
        "mse",
        "mean",
        (8, 15),
    ),
]


@pytest.mark.parametrize(
    "factory,in_shape,lossname,reduction,target",
    [s[1:] for s in FIRST_ORDER],
    ids=[s[0] for s in FIRST_ORDER],
)
def test_backpack_first_order_settings(factory, in_shape, lossname, reduction, target):
    """BackPACK's ``firstorder_settings.py``, setting by setting: Linear with one to three
    additional dimensions under MSELoss and CrossEntropyLoss, its Conv/ConvTranspose 1d-3d
    hyper-parameter tuples (stride, padding, dilation, output padding, bias) behind
    ReLU-Flatten-Linear, BatchNorm1d/2d/3d in eval mode under a cross-entropy over positions,
    and a time-major RNN under a cross-entropy over time steps; ``grad1`` (BatchGrad) against
    the oracle."""
    torch.manual_seed(0)
    model = factory()
    x = torch.rand(*in_shape)
    if any(isinstance(m, nn.modules.lazy.LazyModuleMixin) for m in model.modules()):
        model(x)
    torch.manual_seed(1)
    if lossname == "ce":
        classes = target if isinstance(target, int) else None
        if classes is None:  # targets over positions: classes are the output's dim 1
            with torch.no_grad():
                classes = model(x).shape[1]
            target = torch.randint(0, classes, target)
        else:
            target = torch.randint(0, classes, (in_shape[0],))
        loss = ce(reduction)
    else:
        target, loss = torch.rand(*target).double(), mse(reduction)
    oracle_check(model, x, loss=loss, target=target, reduction=reduction)


# == Opacus' GradSampleModule: custom layers and validation ======================================


class SimpleLinear(nn.Module):
    """A layer written with ``F.linear`` on a parameter of its own, ``[in, out]``."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(4, 2))

    def forward(self, x):
        return F.linear(x, self.p.T)


def simple_linear_net():
    return nn.Sequential(SimpleLinear(), nn.Tanh(), nn.Linear(2, 3))


def test_rule_registered_for_a_custom_layer():
    """A rule registered for a custom layer is used for it (no fallback) and is exact: Opacus'
    ``test_standard_module_validation`` (``register_grad_sampler`` for ``SimpleLinear``)."""
    registry = copy.deepcopy(gradhooks.REGISTRY)  # the built-in rules, and one more

    @registry.register(SimpleLinear)
    def simple_linear(call):
        x, g = call.inputs[0], call.grad_output  # [batch, in], [batch, out]
        return {"p": gradhooks.Direct(torch.einsum("bi,bo->bio", x, g))}

    model = seeded(simple_linear_net).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    want = vmap_grad(model, sq, x)
    with gradhooks.add_hooks(model, registry=registry, loss_reduction="sum") as h:
        sq(model(x)).backward()
    assert list(h.fallback_modules()) == []
    for n, p in model.named_parameters():
        assert_close(p.grad1, want[n], n)


def test_wrong_custom_rule_is_caught_not_written():
    """A rule 1% off is caught at the backward (``grad1`` does not add up to ``.grad``) and
    its ``grad1`` is not written: the check Opacus' per-layer tests make offline
    (``per_sample_gradients_utils``), made at run time."""
    registry = gradhooks.Registry()

    @registry.register(SimpleLinear)
    def simple_linear(call):
        x, g = call.inputs[0], call.grad_output
        return {"p": gradhooks.Direct(1.01 * torch.einsum("bi,bo->bio", x, g))}

    model = seeded(simple_linear_net).double()
    with gradhooks.add_hooks(model, registry=registry, loss_reduction="sum"):
        with pytest.raises(gradhooks.CheckFailedError, match=r"'0\.p'"):
            sq(model(torch.randn(5, 4, dtype=torch.float64))).backward()
    assert not hasattr(model[0].p, "grad1")


class SampleConvNet(nn.Module):
    """Opacus' ``SampleConvNet`` (smaller): strided convolutions, overlapping max-pools and a
    ``view(-1, ...)`` before the linear layers."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 4, 8, 2, padding=3), nn.Conv2d(4, 6, 4, 2)
        self.fc1, self.fc2 = nn.Linear(6 * 4 * 4, 8), nn.Linear(8, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2, 1)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2, 1)
        return self.fc2(F.relu(self.fc1(x.view(-1, 6 * 4 * 4))))


def test_sample_conv_net_with_l1_loss():
    """Opacus' ``GradSampleModule`` test model under its ``L1Loss`` (mean): every layer's
    per-example gradient against the oracle."""
    oracle_check(
        seeded(SampleConvNet),
        torch.randn(4, 3, 28, 28),
        loss=lambda out, t=None: F.l1_loss(out, torch.zeros_like(out)),
        reduction="mean",
    )


def test_state_dict_unchanged_and_hooks_not_added_twice():
    """Hooking leaves ``state_dict`` as it was (Opacus' ``test_state_dict`` /
    ``test_to_standard_module``), and hooking an already hooked model is refused, since it
    would count every gradient twice."""
    model = seeded(SampleConvNet)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with gradhooks.add_hooks(model):
        assert list(model.state_dict()) == list(before)
        with pytest.raises(gradhooks.StateError, match="already has gradhooks hooks"):
            gradhooks.add_hooks(model)
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)


class TinyNet(nn.Module):
    """autograd-hacks' tiny LeNet for its Hessian test: pools, two convolutions, two linear
    layers, ReLUs (piecewise linear, so the Gauss-Newton matrix is the Hessian)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 2, 2), nn.Conv2d(2, 2, 2)
        self.fc1, self.fc2 = nn.Linear(2, 2), nn.Linear(2, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(F.max_pool2d(x, 4, 4))), 2, 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2, 2)
        return self.fc2(F.relu(self.fc1(x.view(-1, 2))))


@pytest.mark.parametrize("hess_type", ["CrossEntropy", "LeastSquares"])
def test_autograd_hacks_hessian_of_tiny_lenet_after_clear(hess_type):
    """``backprop_hess``, ``clear_backprops``, ``backprop_hess`` again on the same output, then
    ``compute_hess``: every parameter's ``hess`` is autograd's Hessian of the mean loss
    (cross-entropy, or half the squared error per example): autograd-hacks' ``test_hess`` on
    its ``TinyNet``."""
    model = seeded(TinyNet).double()
    x = torch.rand(3, 1, 28, 28, dtype=torch.float64)
    y = torch.randint(0, 10, (3,))
    target = torch.rand(3, 10, dtype=torch.float64)
    gradhooks.add_hooks(model)
    try:
        output = model(x)
        gradhooks.backprop_hess(output, hess_type=hess_type)
        gradhooks.clear_backprops(model)
        gradhooks.backprop_hess(output, hess_type=hess_type)
        gradhooks.compute_hess(model)
    finally:
        gradhooks.remove_hooks(model)
    if hess_type == "CrossEntropy":
        assert_hess_is_autograds(model, x, lambda out: F.cross_entropy(out, y))
    else:
        assert_hess_is_autograds(model, x, lambda out: ((out - target) ** 2).sum() / 2 / len(out))


# == Opacus' mixed-precision tests ===============================================================


def mixed_net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 5),
        nn.LayerNorm(5),
        nn.Linear(5, 3),
    )


@pytest.mark.parametrize("how", ["bfloat16-model", "bfloat16-autocast"])
def test_mixed_precision_against_the_float64_loop(how):
    """Per-example gradients of a bfloat16 model, and of a float32 model under CPU bfloat16
    autocast, against the float64 per-example loop: Opacus' ``mixed_precision_test.py``.
    bfloat16 keeps 8 significant bits (unit roundoff 2⁻⁹ ≈ 2e-3); through seven layers and a
    normalization the errors measured here are 1e-3 to 1.2e-2 relative (per parameter, in
    norm), so the bound is 16 roundoffs, 16 · 2⁻⁹ ≈ 3e-2 relative (2.5 times the largest error
    measured)."""
    torch.manual_seed(1)
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 3, (4,))
    want = loop_grad(mixed_net().double(), ce("sum"), x.double(), y)
    model = mixed_net()
    if how == "bfloat16-model":
        model, x = model.to(torch.bfloat16), x.bfloat16()
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=how == "bfloat16-autocast"):
            out = model(x)
        F.cross_entropy(out.float(), y, reduction="sum").backward()
    for n, p in model.named_parameters():
        assert p.grad1.dtype == p.dtype
        err = ((p.grad1.double() - want[n]).norm() / want[n].norm()).item()
        assert err < 3e-2, f"{how} {n}: relative error {err:.2e}"


# == Batches of one, and what has no reproducible per-example gradient ===========================


ONE = [(m[0], m[1], m[2]) for m in MORE_LAYERS if m[0] != "bilinear-by-fallback"] + [
    (n[0], n[1], lambda shape=n[2]: torch.randn(*shape)) for n in NORMS
]


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning")
@pytest.mark.parametrize("factory,inputs", [o[1:] for o in ONE], ids=[o[0] for o in ONE])
def test_batch_of_one(factory, inputs):
    """A batch of one example (where a squeezed batch dimension would go unnoticed): Opacus'
    per-layer hypothesis sweeps draw ``N`` from 1 up."""
    torch.manual_seed(1)
    x = inputs()
    x = tuple(t[:1] for t in (x if isinstance(x, tuple) else (x,)))
    oracle_check(
        seeded(factory),
        x,
        loss=lambda out, t=None: (
            sq(out) + sum((o**3).sum() for o in (out if isinstance(out, tuple) else (out,)))
        ),
    )


@pytest.mark.parametrize("kind", [nn.RNN, nn.GRU, nn.LSTM])
def test_dropout_between_rnn_layers_in_training_is_refused(kind):
    """Dropout between stacked RNN layers in training mode draws a mask inside torch's kernel
    that no per-example recomputation can see: refused at the forward, naming the layer and
    what to do, with neither ``.grad`` nor ``grad1`` written. (Opacus' ``DPLSTM`` re-implements
    the layer to support it, ``dp_lstm_test.py``.)"""
    model = seeded(lambda: Calling(kind(3, 4, 2, dropout=0.5, batch_first=True), first))
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with pytest.raises(gradhooks.ConfigurationError, match=r"'module'.*dropout=0\.5.*eval"):
            model(torch.randn(3, 2, 3))
    for p in model.parameters():
        assert p.grad is None and not hasattr(p, "grad1")


def test_dropout_inside_attention_in_training_is_refused():
    """MultiheadAttention with dropout in training mode draws its mask inside torch's
    attention: refused, naming the layer and the remedy (Opacus' ``DPMultiheadAttention``
    re-implements the layer, ``dp_multihead_attention_test.py``)."""
    model = seeded(
        lambda: Calling(
            nn.MultiheadAttention(4, 2, dropout=0.3, batch_first=True), lambda m, q: m(q, q, q)[0]
        )
    )
    with (
        gradhooks.add_hooks(model, loss_reduction="sum"),
        pytest.raises(gradhooks.UnsupportedError, match=r"'module'.*MultiheadAttention.*dropout=0"),
    ):
        sq(model(torch.randn(3, 2, 4))).backward()


class MeanOfTokens(nn.Module):
    """A text classifier whose every parameter is in a layer over many positions: an Embedding
    and a Linear over 64 tokens, averaged (Opacus' text examples, its embedding tests in
    ``grad_sample_module_fast_gradient_clipping_test.py``)."""

    def __init__(self):
        super().__init__()
        self.emb, self.lin = nn.Embedding(50, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.lin(self.emb(x)).mean(1)


ALL_SUMMED = [
    ("embedding-linear-64-tokens", MeanOfTokens, lambda: torch.randint(0, 50, (6, 64))),
    (
        "lstm-alone",
        lambda: Calling(nn.LSTM(3, 3, batch_first=True), lambda m, x: m(x)[0][:, -1]),
        lambda: torch.randn(6, 5, 3),
    ),
    (
        "conv2d-alone-64-positions",
        lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten()),
        lambda: torch.randn(6, 2, 8, 8),
    ),
]


@pytest.mark.parametrize("method", [None, "grad1", "ghost", "bookkeeping"])
@pytest.mark.parametrize(
    "factory,inputs", [m[1:] for m in ALL_SUMMED], ids=[m[0] for m in ALL_SUMMED]
)
def test_dp_step_where_every_layer_sums_its_grad1(factory, inputs, method):
    """The DP-SGD step of a model whose every layer takes its batch gradient from its
    per-example gradients (an Embedding, a Linear or convolution over 64 positions on CPU, an
    LSTM): the clipped mean of the oracle's per-example gradients, by every method and by
    ``DPOptimizer``'s default (book-keeping), which once refused these models, saying the
    loss did not depend on their parameters. Opacus' text and convolution examples, its
    ``DPLSTM`` tests."""
    model = seeded(factory).double()
    torch.manual_seed(1)
    x, y = inputs(), torch.randint(0, 3, (6,))
    x = x.double() if x.is_floating_point() else x
    want = clipped_sum_by_oracle(loop_grad(model, ce("sum"), x, y), max_norm=0.05)
    start = copy.deepcopy(model.state_dict())
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=1.0),
            h,
            max_grad_norm=0.05,
            noise_multiplier=0.0,
            expected_batch_size=6,
            method=method,
        )
        opt.backward(F.cross_entropy(model(x), y, reduction="none"))
        opt.step()
    for n, p in model.named_parameters():
        assert_close(p.detach(), start[n] - want[n] / 6, f"{method}: step of {n}")


def test_dp_step_of_a_loss_not_from_the_model_is_still_refused():
    """A per-example loss that does not depend on the hooked model's parameters (a detached
    output) is refused on the book-keeping path too: the step would be noise alone."""
    model = seeded(MeanOfTokens).double()
    x, y = torch.randint(0, 50, (6, 64)), torch.randint(0, 3, (6,))
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        out = model(x).detach().requires_grad_()
        with pytest.raises(gradhooks.StateError, match="does not depend on any trainable"):
            gradhooks.dp_sgd_step(
                h,
                F.cross_entropy(out, y, reduction="none"),
                max_norm=1.0,
                noise_multiplier=0.0,
                method="bookkeeping",
            )
    assert all(p.grad is None for p in model.parameters())


class BatchFirst(nn.Module):
    """``module`` (time-major, ``[T, batch, ...]``) seen batch-first, for the oracle, which
    maps dimension 0."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.m = module

    def forward(self, x):
        out = self.m(x.transpose(0, 1))
        return (out[0] if isinstance(out, tuple) else out).transpose(0, 1)


TIME_MAJOR = [
    ("linear", lambda: nn.Linear(4, 3), lambda: torch.randn(3, 5, 4)),
    ("linear-40-positions", lambda: nn.Linear(4, 3), lambda: torch.randn(3, 40, 4)),
    ("embedding-40-positions", lambda: nn.Embedding(10, 4), lambda: torch.randint(0, 10, (3, 40))),
    ("layer-norm", lambda: nn.LayerNorm(4), lambda: torch.randn(3, 5, 4)),
    ("rms-norm", lambda: nn.RMSNorm(4), lambda: torch.randn(3, 5, 4)),
    (
        "lstm-bidirectional",
        lambda: nn.LSTM(4, 3, 2, bidirectional=True),
        lambda: torch.randn(3, 5, 4),
    ),
    ("gru", lambda: nn.GRU(4, 3), lambda: torch.randn(3, 5, 4)),
    (
        "mha",
        lambda: Calling(nn.MultiheadAttention(4, 2), lambda m, x: m(x, x, x)[0]),
        lambda: torch.randn(3, 5, 4),
    ),
    (
        "transformer-encoder-layer",
        lambda: nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0),
        lambda: torch.randn(3, 5, 4),
    ),
    (
        "embedding-lstm",
        lambda: nn.Sequential(nn.Embedding(10, 4), nn.LSTM(4, 4)),
        lambda: torch.randint(0, 10, (3, 5)),
    ),
]


@pytest.mark.parametrize(
    "quantities", [("grad1",), ("norms", "sum_grad_sq")], ids=["grad1", "norms"]
)
@pytest.mark.parametrize(
    "factory,inputs", [m[1:] for m in TIME_MAJOR], ids=[m[0] for m in TIME_MAJOR]
)
def test_time_major_layers_with_batch_dim_1(factory, inputs, quantities):
    """Time-major inputs ``[T, batch, ...]`` hooked with ``batch_dim=1``, under a mean loss:
    Opacus' ``GradSampleModule(batch_first=False)`` in ``per_sample_gradients_utils_test.py``
    and its RNN / attention tests. ``grad1``, or norms and squared sums, against the oracle
    run batch-first."""
    model = seeded(factory).double()
    torch.manual_seed(1)
    x = inputs()
    x = x.double() if x.is_floating_point() else x

    def loss(out, t=None):
        return sq(out) + (out**3).sum()

    want = {n.removeprefix("m."): g for n, g in vmap_grad(BatchFirst(model), loss, x).items()}
    with gradhooks.add_hooks(model, batch_dim=1, quantities=quantities) as h:
        out = model(x.transpose(0, 1).contiguous())
        (loss(out[0] if isinstance(out, tuple) else out) / x.shape[0]).backward()
    for n, p in model.named_parameters():
        if "grad1" in quantities:
            assert_close(p.grad1, want[n], n)
        else:
            assert_close(h.param_norms()[n], want[n].flatten(1).norm(dim=1), f"norms {n}")
            assert_close(h.sum_grad_sq()[n], (want[n] ** 2).sum(0), f"sum_grad_sq {n}")


def freq_embedding_classifier():
    return Calling(
        nn.ModuleList([nn.Embedding(20, 4, scale_grad_by_freq=True), nn.Linear(4, 3)]),
        lambda m, x: m[1](m[0](x).mean(1)),
    )


@pytest.mark.parametrize("repeats", [True, False], ids=["rows-repeat", "rows-unique"])
@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_dp_step_through_batch_counted_embedding_is_refused(method, repeats):
    """An Embedding with ``scale_grad_by_freq=True`` divides each row's gradient by its count
    over the whole batch: the examples are coupled there, and clipping cannot bound one's
    influence. Every DP step is refused, naming the parameter and the option, with no ``.grad``
    written, also when this batch happens to repeat no row across examples (where autograd's
    check alone would have let it through). Opacus' embedding grad sampler ignores the flag."""
    model = seeded(freq_embedding_classifier).double()
    x = torch.randint(0, 20, (5, 40)) if repeats else torch.arange(20).view(5, 4)
    y = torch.randint(0, 3, (5,))
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        with pytest.raises(
            gradhooks.UnsupportedError, match=r"'module\.0\.weight'.*scale_grad_by_freq=False"
        ):
            gradhooks.dp_sgd_step(
                h,
                F.cross_entropy(model(x), y, reduction="none"),
                max_norm=1.0,
                noise_multiplier=0.0,
                method=method,
            )
    assert all(p.grad is None for p in model.parameters())

"""``gradhooks.convert_batch_norm``: a model's batch norms replaced by group norms, after which
its per-example gradients exist and match the float64 oracle, in a training loop; what cannot be
converted is refused with the model left as it was."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad, vmap_grad
from harness import assert_grad1, hf, seeded

D = torch.float64


class Block(nn.Module):
    """A residual block as ResNets write it: conv, batch norm, ReLU, twice, and the shortcut."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(h)))


def _resnet(c: int = 12) -> nn.Sequential:
    model = nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c, eps=1e-3), nn.ReLU(), Block(c),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 40), nn.BatchNorm1d(40),
        nn.ReLU(), nn.Linear(40, 3),
    )  # fmt: skip
    for m in model.modules():  # (a trained model's scales and shifts, not 1 and 0)
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    return model.to(D)


def resnet() -> nn.Sequential:
    return seeded(_resnet)


def batch(step: int = 0, n: int = 5):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 3, 6, 6, dtype=D, generator=gen), torch.randint(3, (n,), generator=gen)


def test_every_batch_norm_becomes_a_group_norm_that_keeps_what_it_learned():
    model = resnet()
    old = {n: m for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    model[7].weight.requires_grad_(False)
    assert gradhooks.convert_batch_norm(model) is model
    for name, bn in old.items():
        gn = model.get_submodule(name)
        assert type(gn) is nn.GroupNorm, name
        assert gn.num_channels == bn.num_features and gn.num_groups == math.gcd(32, gn.num_channels)
        assert (gn.eps, gn.affine, gn.training) == (bn.eps, bn.affine, bn.training)
        assert torch.equal(gn.weight, bn.weight) and torch.equal(gn.bias, bn.bias)
        assert gn.weight.dtype == D and gn.weight.requires_grad == bn.weight.requires_grad
    assert not model[7].weight.requires_grad
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


@pytest.mark.parametrize("hooked_first", [False, True], ids=["convert, hook", "hook, convert"])
def test_grad1_of_the_converted_model_matches_the_oracles_over_training_steps(hooked_first):
    """Refused before (batch statistics in train mode); after the conversion, several SGD steps
    with zero_grad, each step's grad1 against vmap(grad) and the loop, in float64."""
    model = resnet()
    hooks = gradhooks.add_hooks(model) if hooked_first else None
    if hooked_first:
        x, y = batch()
        with pytest.raises(gradhooks.MixedExamplesError, match="convert_batch_norm"):
            F.cross_entropy(model(x), y).backward()
        model.zero_grad()
    model = gradhooks.convert_batch_norm(model)
    if hooks is None:
        hooks = gradhooks.add_hooks(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x, y = batch(step)
        want = vmap_grad(model, F.cross_entropy, x, y)
        loop = loop_grad(model, F.cross_entropy, x, y)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        assert_grad1(model, want, f"step {step} vs vmap")
        assert_grad1(model, loop, f"step {step} vs the loop")
        opt.step()
    hooks.remove()


def test_under_bf16_autocast_grad1_is_as_close_to_the_float64_loop_as_autograd_is():
    """bfloat16 keeps 8 significant bits: through this network's eight layers autograd's own
    batch gradient moves up to ~20% from float64's. Each example's gradient must be within
    twice that of the float64 loop's (plus 5e-2, the small models' tolerance in
    test_autocast), and grad1's mean within 5e-2 of autograd's bf16 gradient; an example's
    gradient given to another, or a lost scale, is off by the gradient itself (~1)."""
    model = gradhooks.convert_batch_norm(resnet().float())
    ref = copy.deepcopy(model).double()
    x, y = batch()
    want = loop_grad(ref, F.cross_entropy, x, y)
    F.cross_entropy(ref(x), y).backward()
    with gradhooks.add_hooks(model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x.float()), y)
        loss.backward()

    def rel(a, b):
        return float((a.double() - b.double()).abs().max() / b.double().abs().max())

    for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert rel(p.grad1, want[name]) <= 2 * rel(p.grad, r.grad) + 5e-2, name
        assert rel(p.grad1.mean(0), p.grad) < 5e-2, name


def test_num_groups_and_the_model_itself_a_batch_norm():
    model = resnet()
    gradhooks.convert_batch_norm(model, num_groups=2)
    assert {m.num_groups for m in model.modules() if isinstance(m, nn.GroupNorm)} == {2}
    bn = nn.BatchNorm3d(6, affine=False, track_running_stats=False)
    gn = gradhooks.convert_batch_norm(bn)
    assert type(gn) is nn.GroupNorm and (gn.num_groups, gn.num_channels, gn.affine) == (2, 6, False)


def _unchanged(model: nn.Module, before: dict) -> None:
    assert {n: type(m) for n, m in model.named_modules()} == before


@pytest.mark.parametrize(
    "case, error, words",
    [
        ("groups that do not divide", gradhooks.ConfigurationError, r"num_groups=5 .* 12 channels"),
        ("a subclass", gradhooks.UnsupportedModuleError, r"'3.bn2' \(.*ActBatchNorm\).*subclass"),
        ("a lazy one", gradhooks.UnsupportedModuleError, r"'10' \(LazyBatchNorm1d\).*forward"),
    ],
)
def test_what_cannot_be_converted_is_refused_and_nothing_changes(case, error, words):
    class ActBatchNorm(nn.BatchNorm2d):  # (as timm's BatchNormAct2d: norm, then activation)
        def forward(self, x):
            return F.relu(super().forward(x))

    model = resnet()
    kwargs = {}
    if case == "groups that do not divide":
        kwargs["num_groups"] = 5
    elif case == "a subclass":
        model[3].bn2 = ActBatchNorm(12).to(D)
    else:
        model.append(nn.LazyBatchNorm1d())
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(error, match=words) as info:
        gradhooks.convert_batch_norm(model, **kwargs)
    assert "Nothing was changed" in str(info.value)
    _unchanged(model, before)


def test_a_bad_num_groups_is_refused():
    with pytest.raises(gradhooks.ConfigurationError, match="positive int"):
        gradhooks.convert_batch_norm(resnet(), num_groups=0)


def test_hugging_face_resnet_after_conversion_matches_the_loop():
    """Hugging Face's ResNet, as its modeling file writes it (nn.BatchNorm2d in every conv
    layer): refused as it is in train mode, matching the loop after the conversion."""
    config_cls, model_cls = hf("ResNetConfig"), hf("ResNetForImageClassification")
    config = config_cls(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=3
    )
    model = seeded(lambda: model_cls(config)).to(D)
    x, y = batch()
    x = F.interpolate(x, size=16)

    def loss(out, target):
        return F.cross_entropy(out.logits, target)

    with gradhooks.add_hooks(model):
        with pytest.raises(gradhooks.MixedExamplesError, match=r"BatchNorm2d"):
            loss(model(x), y).backward()
    model.zero_grad()
    model = gradhooks.convert_batch_norm(model)
    want = loop_grad(model, loss, x, y)
    with gradhooks.add_hooks(model):
        loss(model(x), y).backward()
    assert_grad1(model, want, "ResNet after convert_batch_norm")

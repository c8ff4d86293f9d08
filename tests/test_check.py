"""The checks: every built-in rule passes the public checker (gradhooks.check_rule) against
vmap(grad); Hooks.check tells the loss's reduction and a loss term that bypasses the layers."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import vmap_grad
from harness import assert_matches, mlp, sq

D = torch.float64


def _tokens(vocab, *shape):
    return lambda: torch.randint(vocab, shape)


# -- check_rule ------------------------------------------------------------------------------------


# One representative module and input per registered type; a new rule must add itself here.
EXAMPLES = {
    nn.Linear: (lambda: nn.Linear(4, 3), lambda: torch.randn(3, 2, 4)),
    nn.Conv1d: (lambda: nn.Conv1d(2, 4, 3, stride=2, padding=1, groups=2), lambda: torch.randn(3, 2, 9)),
    nn.Conv2d: (lambda: nn.Conv2d(2, 4, 3, padding="same", padding_mode="reflect"), lambda: torch.randn(3, 2, 6, 5)),
    nn.Conv3d: (lambda: nn.Conv3d(2, 2, 2, dilation=2, groups=2), lambda: torch.randn(2, 2, 5, 5, 5)),
    nn.ConvTranspose1d: (lambda: nn.ConvTranspose1d(2, 4, 3, stride=2, output_padding=1), lambda: torch.randn(3, 2, 5)),
    nn.ConvTranspose2d: (lambda: nn.ConvTranspose2d(2, 4, 3, stride=2, groups=2, dilation=2), lambda: torch.randn(3, 2, 4, 4)),
    nn.ConvTranspose3d: (lambda: nn.ConvTranspose3d(2, 2, 2, stride=2), lambda: torch.randn(2, 2, 3, 3, 3)),
    nn.Embedding: (lambda: nn.Embedding(7, 3, padding_idx=0), _tokens(7, 3, 4)),
    nn.EmbeddingBag: (lambda: nn.EmbeddingBag(7, 3, mode="mean"), _tokens(7, 3, 4)),
    nn.LayerNorm: (lambda: nn.LayerNorm(4), lambda: torch.randn(3, 2, 4)),
    nn.RMSNorm: (lambda: nn.RMSNorm(4), lambda: torch.randn(3, 2, 4)),
    nn.GroupNorm: (lambda: nn.GroupNorm(2, 4), lambda: torch.randn(3, 4, 5)),
    nn.InstanceNorm1d: (lambda: nn.InstanceNorm1d(3, affine=True), lambda: torch.randn(3, 3, 5)),
    nn.InstanceNorm2d: (lambda: nn.InstanceNorm2d(3, affine=True), lambda: torch.randn(3, 3, 4, 4)),
    nn.InstanceNorm3d: (lambda: nn.InstanceNorm3d(2, affine=True), lambda: torch.randn(2, 2, 3, 3, 3)),
    nn.BatchNorm1d: (lambda: _trained_bn(nn.BatchNorm1d(3), (8, 3)), lambda: torch.randn(4, 3)),
    nn.BatchNorm2d: (lambda: _trained_bn(nn.BatchNorm2d(3), (8, 3, 3, 3)), lambda: torch.randn(4, 3, 3, 3)),
    nn.BatchNorm3d: (lambda: _trained_bn(nn.BatchNorm3d(2), (8, 2, 2, 2, 2)), lambda: torch.randn(2, 2, 2, 2, 2)),
    nn.PReLU: (lambda: nn.PReLU(3), lambda: torch.randn(3, 3, 4)),
    nn.MultiheadAttention: (lambda: nn.MultiheadAttention(4, 2, batch_first=True, add_bias_kv=True), lambda: (torch.randn(3, 5, 4),) * 3),
    nn.RNN: (lambda: nn.RNN(3, 4, 2, batch_first=True), lambda: torch.randn(3, 5, 3)),
    nn.LSTM: (lambda: nn.LSTM(3, 4, batch_first=True, bidirectional=True), lambda: torch.randn(3, 5, 3)),
    nn.GRU: (lambda: nn.GRU(3, 4, 2, batch_first=True), lambda: torch.randn(3, 5, 3)),
    nn.RNNCell: (lambda: nn.RNNCell(3, 4, nonlinearity="relu"), lambda: (torch.randn(3, 3), torch.randn(3, 4))),
    nn.LSTMCell: (lambda: nn.LSTMCell(3, 4), lambda: (torch.randn(3, 3), (torch.randn(3, 4), torch.randn(3, 4)))),
    nn.GRUCell: (lambda: nn.GRUCell(3, 4), lambda: (torch.randn(3, 3), torch.randn(3, 4))),
    nn.TransformerEncoderLayer: (lambda: nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True), lambda: torch.randn(3, 5, 4)),
    nn.TransformerDecoderLayer: (lambda: nn.TransformerDecoderLayer(4, 2, 8, dropout=0.0, batch_first=True), lambda: (torch.randn(3, 5, 4), torch.randn(3, 6, 4))),
}  # fmt: skip


def _trained_bn(bn, shape):
    """A BatchNorm with non-trivial running statistics, in eval mode."""
    with torch.no_grad():
        bn.train()(3 * torch.randn(shape) + 1)
    return bn.eval()


# Types registered by name, by that name (their library imported in the test)
NAMED_EXAMPLES = {
    "transformers.pytorch_utils.Conv1D": (lambda cls: cls(5, 4), lambda: torch.randn(3, 2, 4)),
    "loralib.layers.Linear": (
        lambda cls: _lora_b_drawn(cls(5, 4, r=2, lora_alpha=2)),
        lambda: torch.randn(3, 2, 5),
    ),
    "loralib.layers.MergedLinear": (
        lambda cls: _lora_b_drawn(cls(4, 6, r=2, lora_alpha=2, enable_lora=[True, False, True])),
        lambda: torch.randn(3, 2, 4),
    ),
}


def _lora_b_drawn(layer):
    """A loralib layer whose ``lora_B`` (zeros as made) is drawn, so that ``lora_A`` gets a
    gradient to check."""
    with torch.no_grad():
        layer.lora_B.normal_()
    return layer


@pytest.mark.parametrize("module_type", gradhooks.REGISTRY.types(), ids=lambda t: t.__name__)
def test_builtin_rule_passes_check_rule(module_type):
    assert module_type in EXAMPLES, f"add an example for {module_type.__name__} to EXAMPLES"
    make_module, make_input = EXAMPLES[module_type]
    torch.manual_seed(0)
    report = gradhooks.check_rule(make_module(), make_input())
    assert report.ok and report.differences, str(report)


@pytest.mark.parametrize("name", gradhooks.REGISTRY.names())
def test_builtin_rule_by_name_passes_check_rule(name):
    assert name in NAMED_EXAMPLES, f"add an example for {name} to NAMED_EXAMPLES"
    path, _, cls_name = name.rpartition(".")
    cls = getattr(pytest.importorskip(path), cls_name)
    make_module, make_input = NAMED_EXAMPLES[name]
    torch.manual_seed(0)
    module = make_module(cls)
    assert gradhooks.REGISTRY.lookup(module) is not None, f"{name}: its class is not found"
    report = gradhooks.check_rule(module, make_input())
    assert report.ok and report.differences, str(report)


# -- Hooks.check -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "declared,real", [("mean", "sum"), ("sum", "mean"), ("mean", "mean"), ("sum", "sum")]
)
def test_check_says_which_reduction_the_loss_used(declared, real):
    model = mlp()
    x, y = torch.randn(6, 3, dtype=D), torch.randint(2, (6,))
    with gradhooks.add_hooks(model, loss_reduction=declared) as h:
        F.cross_entropy(model(x), y, reduction=real).backward()
        # grad1 always reduces to .grad (the engine's scale cancels): only the loss can tell,
        # and without it the report says what it could not check, never "ok"
        blind = h.check()
        assert not blind.ok and not blind.problems and not blind.failures
        assert len(blind.unchecked) == 1 and "reduction" in blind.unchecked[0]
        assert str(blind).startswith("Hooks.check(Sequential): UNCHECKED\n")
        assert "h.check(loss_fn, inputs, target)" in str(blind)
        assert "unchecked=[" in repr(blind)
        assert "6× too " + ("large" if declared == "mean" else "small") in blind.unchecked[0]
        if declared == real:
            report = h.check(F.cross_entropy, x, y)
            assert report.ok and report.reduction == real
        else:
            with pytest.raises(
                gradhooks.CheckFailedError, match=f"the loss is the {real} of the per-example"
            ):
                h.check(F.cross_entropy, x, y)
            report = h.check(F.cross_entropy, x, y, raise_on_error=False)
            assert report.reduction == real
            h.rescale(real)  # what the message says to do
            assert h.check(F.cross_entropy, x, y).ok
            assert_matches(model, vmap_grad(model, F.cross_entropy, x, y), "rescaled")


def test_check_reports_a_loss_term_that_bypasses_the_layers():
    """Weight decay added to the loss is no example's: the first backward says so (and writes
    no grad1); with verify=False grad1 keeps the per-example terms, and check() reports it."""
    model = mlp()
    x = torch.randn(4, 3, dtype=D)
    with gradhooks.add_hooks(model) as h:
        loss = sq(model(x)) / 4 + 0.1 * model[0].weight.pow(2).sum()  # weight decay in the loss
        with pytest.raises(gradhooks.CheckFailedError, match=r"'0.weight'.*weight decay"):
            loss.backward()
        assert not hasattr(model[0].weight, "grad1")
    model.zero_grad()
    with gradhooks.add_hooks(model, verify=False) as h:
        loss = sq(model(x)) / 4 + 0.1 * model[0].weight.pow(2).sum()
        loss.backward()
        report = h.check(raise_on_error=False)
    assert len(report.problems) == 1 and "'0.weight'" in report.problems[0]
    assert "weight decay" in report.problems[0]


def test_one_report_for_both_checks():
    """check_rule and Hooks.check return the same CheckReport; its str names the check, the
    module and all it found."""
    rule = gradhooks.check_rule(nn.Linear(3, 2), torch.randn(4, 3))
    assert type(rule) is gradhooks.CheckReport and rule.ok
    assert str(rule).startswith("check_rule(Linear): ok\n  weight (sum)")
    model = mlp()
    x, y = torch.randn(6, 3, dtype=D), torch.randint(2, (6,))
    with gradhooks.add_hooks(model, loss_reduction="mean") as h:
        F.cross_entropy(model(x), y, reduction="sum").backward()
        report = h.check(F.cross_entropy, x, y, raise_on_error=False)
    assert type(report) is gradhooks.CheckReport and not report.ok
    assert not report.differences and not report.failures
    text = str(report)
    assert text.startswith("Hooks.check(Sequential): FAILED\n  the loss's reduction: sum\n")
    assert all(f"  - {p}" in text for p in report.problems) and report.problems


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_check_rule_and_the_loop_oracle_under_no_grad(mode):
    """check_rule and the per-example loop compute gradients whatever the caller's grad mode
    (under torch.no_grad() a forward records nothing: they raised torch's "does not require
    grad", or an AttributeError under inference_mode)."""
    model = mlp()
    x = torch.randn(5, 3, dtype=D)
    want = gradhooks.oracle.vmap_grad(model, lambda o: o.pow(2).sum(), x)
    with getattr(torch, mode)():
        assert gradhooks.check_rule(nn.Linear(3, 2), torch.randn(4, 3)).ok
        got = gradhooks.oracle.loop_grad(model, lambda o: o.pow(2).sum(), x)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-7, atol=1e-9)

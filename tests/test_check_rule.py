"""Every built-in rule passes the public checker (gradhooks.check_rule) against vmap(grad)."""

import pytest
import torch
from torch import nn

import gradhooks


def _tokens(vocab, *shape):
    return lambda: torch.randint(vocab, shape)


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
    nn.TransformerEncoderLayer: (lambda: nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True), lambda: torch.randn(3, 5, 4)),
    nn.TransformerDecoderLayer: (lambda: nn.TransformerDecoderLayer(4, 2, 8, dropout=0.0, batch_first=True), lambda: (torch.randn(3, 5, 4), torch.randn(3, 6, 4))),
}  # fmt: skip


def _trained_bn(bn, shape):
    """A BatchNorm with non-trivial running statistics, in eval mode."""
    with torch.no_grad():
        bn.train()(3 * torch.randn(shape) + 1)
    return bn.eval()


@pytest.mark.parametrize("module_type", gradhooks.REGISTRY.types(), ids=lambda t: t.__name__)
def test_builtin_rule_passes_check_rule(module_type):
    assert module_type in EXAMPLES, f"add an example for {module_type.__name__} to EXAMPLES"
    make_module, make_input = EXAMPLES[module_type]
    torch.manual_seed(0)
    report = gradhooks.check_rule(make_module(), make_input())
    assert report.ok and report.differences, str(report)

"""The models every quantity (norms, DP-SGD, K-FAC, squared sums, Jacobians) is tested on.

One list, keyed by the layer type each case exercises: when a rule for a new layer type is
registered, add a case for it here (``test_every_registered_layer_has_a_quantity_case`` fails
until then) and every quantity is tested on it.
"""

from __future__ import annotations

import torch
from torch import nn

from harness import Case, cross_entropy_sum


class Reused(nn.Module):
    """One Linear called twice in a forward (cross terms between the calls)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(torch.tanh(self.fc(x)))))


class ReusedSeq(nn.Module):
    """A Linear reused on a sequence: Gram-form cross terms with several shared positions."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):  # [batch, 3, 8]
        return self.head(torch.tanh(self.fc(torch.tanh(self.fc(x)))).mean(1))


class Tied(nn.Module):
    """A weight shared by two modules (cross terms between users)."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(5, 3)
        self.mid = nn.Linear(3, 5)
        self.dec = nn.Linear(5, 3)
        self.dec.weight = self.enc.weight

    def forward(self, x):
        return self.dec(torch.tanh(self.mid(torch.tanh(self.enc(x)))))


class SmallConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 4, 3, stride=2, groups=2)
        self.fc = nn.Linear(4 * 2 * 2, 3)

    def forward(self, x):  # [batch, 2, 6, 6]
        h = torch.tanh(self.conv2(torch.tanh(self.conv1(x))))
        return self.fc(h.flatten(1))


def _seq(*layers):
    return lambda: nn.Sequential(*layers)


# {layer type: cases}; every case's output is [batch, outputs] (Jacobians, K-FAC need that)
CASES_BY_LAYER: dict[type, list[Case]] = {
    nn.Linear: [
        Case(
            "mlp",
            lambda: nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)),
            lambda b: torch.randn(b, 6),
        ),
        Case(
            "mlp_ce",
            lambda: nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)),
            lambda b: torch.randn(b, 6),
            lambda b: torch.randint(3, (b,)),
            cross_entropy_sum,
        ),
        Case(
            "linear_seq_gram",
            lambda: nn.Sequential(nn.Linear(8, 8), nn.Flatten()),
            lambda b: torch.randn(b, 2, 8),
        ),
        Case(
            "linear_seq_materialize",
            lambda: nn.Sequential(nn.Linear(5, 3), nn.Flatten()),
            lambda b: torch.randn(b, 6, 5),
        ),
        Case("reused_linear", Reused, lambda b: torch.randn(b, 4)),
        Case("reused_linear_seq", ReusedSeq, lambda b: torch.randn(b, 3, 8)),
        Case("tied_linear", Tied, lambda b: torch.randn(b, 5)),
    ],  # fmt: skip
    nn.Conv2d: [
        Case(
            "conv_net",
            SmallConvNet,
            lambda b: torch.randn(b, 2, 6, 6),
            lambda b: torch.randint(3, (b,)),
            cross_entropy_sum,
        ),
        Case(
            "conv_gram", _seq(nn.Conv2d(3, 8, 3), nn.Flatten()), lambda b: torch.randn(b, 3, 4, 4)
        ),
        Case(
            # the Gram of the columns from the Gram of the input's positions (ConvWeight.input_gram),
            # cross terms between the two calls included
            "conv_gram_positions",
            _seq(*[nn.Conv2d(8, 8, 3, padding=1)] * 2, nn.Flatten()),
            lambda b: torch.randn(b, 8, 4, 4),
        ),
        Case(
            "conv1d_gram_positions",
            _seq(nn.Conv1d(16, 16, 5, padding=2), nn.Flatten()),
            lambda b: torch.randn(b, 16, 8),
        ),
        Case(
            "reused_conv",
            _seq(*[nn.Conv2d(2, 2, 3, padding=1)] * 2, nn.Flatten()),
            lambda b: torch.randn(b, 2, 3, 3),
        ),
    ],  # fmt: skip
    nn.Conv1d: [
        Case(
            "conv1d",
            _seq(nn.Conv1d(2, 3, 2, dilation=2), nn.Flatten()),
            lambda b: torch.randn(b, 2, 5),
        ),
    ],
    nn.Conv3d: [
        Case(
            "conv3d", _seq(nn.Conv3d(1, 2, 2), nn.Flatten()), lambda b: torch.randn(b, 1, 3, 3, 2)
        ),
    ],
}


class _Head(nn.Module):
    """``layer`` on the input, then whatever ``pool`` makes of its output, then a Linear to 3."""

    def __init__(self, layer, features, pool=lambda out: out.flatten(1)):
        super().__init__()
        self.layer, self.pool, self.head = layer, pool, nn.Linear(features, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.pool(self.layer(x))))


def _head(make_layer, features, pool=lambda out: out.flatten(1)):
    return lambda: _Head(make_layer(), features, pool)


def _sum_of_pair(out):
    """An LSTMCell's ``(h', c')``: both reach the loss."""
    return out[0] + out[1]


def _eval_bn(bn):
    with torch.no_grad():
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    return bn.eval()


def _tokens(vocab, *shape):
    return lambda b: torch.randint(vocab, (b, *shape))


_last_step = lambda out: out[0][:, -1]  # (output, state) of an RNN -> last time step
_first = lambda out: out[0].mean(1)  # (attention output, weights) -> pooled


class _SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x)


class _Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerDecoderLayer(4, 2, 8, dropout=0.0, batch_first=True)

    def forward(self, x):
        return self.layer(x, x)


CASES_BY_LAYER.update({
    nn.ConvTranspose1d: [Case("conv_transpose1d", _head(lambda: nn.ConvTranspose1d(2, 3, 3, stride=2), 27), lambda b: torch.randn(b, 2, 4))],
    nn.ConvTranspose2d: [Case("conv_transpose2d", _head(lambda: nn.ConvTranspose2d(2, 2, 2, stride=2, groups=2), 32), lambda b: torch.randn(b, 2, 2, 2))],
    nn.ConvTranspose3d: [Case("conv_transpose3d", _head(lambda: nn.ConvTranspose3d(1, 2, 2, stride=2), 32), lambda b: torch.randn(b, 1, 1, 1, 2))],
    nn.Embedding: [Case("embedding", _head(lambda: nn.Embedding(7, 3, padding_idx=0), 12), _tokens(7, 4))],
    nn.EmbeddingBag: [Case("embedding_bag", _head(lambda: nn.EmbeddingBag(7, 3), 3), _tokens(7, 4))],
    nn.LayerNorm: [Case("layer_norm", _head(lambda: nn.LayerNorm(4), 12), lambda b: torch.randn(b, 3, 4))],
    nn.RMSNorm: [Case("rms_norm", _head(lambda: nn.RMSNorm(4), 12), lambda b: torch.randn(b, 3, 4))],
    nn.GroupNorm: [Case("group_norm", _head(lambda: nn.GroupNorm(2, 4), 20), lambda b: torch.randn(b, 4, 5))],
    nn.InstanceNorm1d: [Case("instance_norm1d", _head(lambda: nn.InstanceNorm1d(3, affine=True), 15), lambda b: torch.randn(b, 3, 5))],
    nn.InstanceNorm2d: [Case("instance_norm2d", _head(lambda: nn.InstanceNorm2d(2, affine=True), 18), lambda b: torch.randn(b, 2, 3, 3))],
    nn.InstanceNorm3d: [Case("instance_norm3d", _head(lambda: nn.InstanceNorm3d(2, affine=True), 16), lambda b: torch.randn(b, 2, 2, 2, 2))],
    nn.BatchNorm1d: [Case("batch_norm1d_eval", _head(lambda: _eval_bn(nn.BatchNorm1d(4)), 4), lambda b: torch.randn(b, 4))],
    nn.BatchNorm2d: [Case("batch_norm2d_eval", _head(lambda: _eval_bn(nn.BatchNorm2d(2)), 18), lambda b: torch.randn(b, 2, 3, 3))],
    nn.BatchNorm3d: [Case("batch_norm3d_eval", _head(lambda: _eval_bn(nn.BatchNorm3d(2)), 16), lambda b: torch.randn(b, 2, 2, 2, 2))],
    nn.PReLU: [Case("prelu", _head(lambda: nn.PReLU(3), 12), lambda b: torch.randn(b, 3, 4))],
    nn.MultiheadAttention: [Case("multihead_attention", _head(_SelfAttention, 4, _first), lambda b: torch.randn(b, 3, 4))],
    nn.RNN: [Case("rnn", _head(lambda: nn.RNN(3, 4, batch_first=True), 4, _last_step), lambda b: torch.randn(b, 3, 3))],
    nn.LSTM: [Case("lstm", _head(lambda: nn.LSTM(3, 4, batch_first=True), 4, _last_step), lambda b: torch.randn(b, 3, 3))],
    nn.GRU: [Case("gru", _head(lambda: nn.GRU(3, 4, batch_first=True), 4, _last_step), lambda b: torch.randn(b, 3, 3))],
    nn.RNNCell: [Case("rnn_cell", _head(lambda: nn.RNNCell(3, 4), 4), lambda b: torch.randn(b, 3))],
    nn.LSTMCell: [Case("lstm_cell", _head(lambda: nn.LSTMCell(3, 4), 4, _sum_of_pair), lambda b: torch.randn(b, 3))],
    nn.GRUCell: [Case("gru_cell", _head(lambda: nn.GRUCell(3, 4), 4), lambda b: torch.randn(b, 3))],
    nn.TransformerEncoderLayer: [Case("transformer_encoder_layer", _head(lambda: nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True), 4, lambda out: out.mean(1)), lambda b: torch.randn(b, 3, 4))],
    nn.TransformerDecoderLayer: [Case("transformer_decoder_layer", _head(_Decoder, 4, lambda out: out.mean(1)), lambda b: torch.randn(b, 3, 4))],
})  # fmt: skip

try:  # Hugging Face's Conv1D (its rule is registered by name): where transformers imports
    from transformers.pytorch_utils import Conv1D
except ImportError:  # pragma: no cover
    Conv1D = None
if Conv1D is not None:  # Conv1D(out, in): weight [in, out]
    CASES_BY_LAYER[Conv1D] = [
        Case("hf_conv1d", _head(lambda: Conv1D(5, 4), 15), lambda b: torch.randn(b, 3, 4)),
        Case("hf_conv1d_rows", _head(lambda: Conv1D(5, 4), 5), lambda b: torch.randn(b, 4)),
    ]

try:  # loralib's LoRA layers (their rule is registered by name): where loralib imports
    import loralib
except ImportError:
    loralib = None
if loralib is not None:

    def _lora_drawn(layer):
        """``lora_B`` drawn (zeros as made: ``lora_A`` would get no gradient), and the frozen
        weight trained too (every parameter of a case is trainable)."""
        with torch.no_grad():
            layer.lora_B.normal_()
        return layer.requires_grad_(True)

    CASES_BY_LAYER[loralib.Linear] = [
        Case("loralib_linear", _head(lambda: _lora_drawn(loralib.Linear(4, 5, r=2)), 15),
             lambda b: torch.randn(b, 3, 4)),
    ]  # fmt: skip
    CASES_BY_LAYER[loralib.MergedLinear] = [
        Case("loralib_merged", _head(lambda: _lora_drawn(loralib.MergedLinear(
            4, 6, r=2, enable_lora=[True, False, True])), 18), lambda b: torch.randn(b, 3, 4)),
    ]  # fmt: skip

CASES = [case for cases in CASES_BY_LAYER.values() for case in cases]

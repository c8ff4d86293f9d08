"""An eighth round of other projects' models against the per-example loop, and sixteen of them
trained as their users train them.

Each model is a small excerpt of a public project's model code, rewritten in plain torch (each
class cites the repository and file it follows), or a Hugging Face model built from a tiny
configuration: torch.nn's own blocks as tutorials and projects use them (``nn.Transformer``
sequence first with causal and padding masks, ``nn.MultiheadAttention`` with other key and
value widths, ``add_bias_kv`` and ``add_zero_attn``, a bidirectional LSTM with ``proj_size``
over unsorted ``PackedSequence``s, a tagger given its batch packed by its data loader and
padding it back, ``nn.Bilinear`` arc scores, ``nn.Unflatten``, ``nn.PixelShuffle`` and a
pixel-unshuffle by view and permute, ``nn.Unfold`` and ``nn.Fold`` soft patches,
``nn.ConvTranspose3d``, lazy modules, ``nn.ChannelShuffle``, ``nn.MaxUnpool2d`` and
``nn.Softmax2d``, ``nn.LocalResponseNorm`` and ``nn.LPPool2d``, a triplet network called three
times, an ``EmbeddingBag`` of flat tokens and offsets); a mixture density network of
``torch.distributions``, SimSiam's two views through one encoder, N-BEATS; torchvision's
SqueezeNet, MobileNetV3, ShuffleNetV2, GoogLeNet with its auxiliary heads, DenseNet's
checkpointed bottlenecks and VGG (torchvision's PyPI build does not import beside the CPU
torch); and Hugging Face's translation models (Pegasus, Marian, M2M100), probabilistic
forecasters (TimeSeriesTransformer, Informer) and PatchTST and PatchTSMixer.

Each is built in float64 (float32 where the model computes in float32 inside) and training
mode; ``grad1`` and the per-example norms of one backward are compared with a loop of batches
of one (``rtol=1e-7``; ``1e-5`` for the forecasters): 34 match. Seven are refused by gradhooks'
own error naming the layer and the shapes: BatchNorm in training mode (MobileNetV3, SimSiam,
PatchTST's and PatchTSMixer's batch norms), Autoformer's delays chosen in training by their
mean over the batch, CLIP's and SigLIP's logits of every image against every text; lazy modules
hooked before their first forward are refused naming the remedy. The hierarchical attention
network's attention applied to a ``PackedSequence``'s rows is refused, saying so, where the
loop works (a strict xfail, with the reason). The tagger given a ``PackedSequence`` of unsorted
lengths was once refused too: its output padded back in the batch's order was taken for a
permutation of it (``tests/test_tracking_reorders.py``). Sixteen are then trained in float32 as
their users train them: three steps of ``zero_grad``, a forward under CPU bfloat16 autocast,
``backward`` (or gradhooks' DP step) and an AdamW step; at each step ``grad1`` (or the clipped
``.grad``) equals the float64 per-example loop within bfloat16's tolerance (and twice the error
of the same model's own loop under the same autocast), and ``grad1`` reduces to ``.grad``. The
triplet network was once refused there: its last bias cancels between its three calls, and the
run-time checks took autograd's rounding of each call's share for a wrong ``grad1``
(``tests/test_autocast.py``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from functools import partial

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from test_lib_sweep_seventh import (
    BF16_TOL,
    autocast_gradients,
    build,
    cross_entropy,
    mse,
    own_gradients,
)
from test_lib_sweep_seventh import Spec as _Spec
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pack_sequence, pad_packed_sequence

import gradhooks
from harness import corrupting, one_thread, raised  # noqa: F401 (one_thread: an autouse fixture)

B = 3  # the batch


@dataclass
class Spec(_Spec):
    """As round seven's, with ``add_hooks``' keyword arguments (a sequence-first model's
    ``batch_dim``) and the dtype the model is checked in (float32 where it computes in float32
    inside, as its authors wrote it)."""

    hooks: dict = field(default_factory=dict)
    dtype: torch.dtype = torch.float64


def built(factory, dtype: torch.dtype | None = None) -> Spec:
    """``factory``'s model and inputs in ``dtype`` (by default the spec's), training mode."""
    torch.manual_seed(0)
    spec = factory()
    return build(lambda: spec, dtype or spec.dtype)


def assert_matches_loop(factory) -> None:
    """``grad1`` and the per-example norms of one backward against the loop."""
    spec = built(factory)
    want = own_gradients(spec)
    assert want, "no trainable parameter"
    hooks = dict(loss_reduction="sum", quantities=("grad1", "norms"), **spec.hooks)
    with gradhooks.add_hooks(spec.model, **hooks) as h:
        spec.losses(spec.model(*spec.args), *spec.targets).sum().backward()
    tol = dict(rtol=spec.rtol, atol=spec.rtol * 1e-3)
    for n, p in spec.model.named_parameters():
        if not p.requires_grad:
            continue
        if p.grad is None:
            assert getattr(p, "grad1", None) is None and not want[n].any(), n
            continue
        assert getattr(p, "grad1", None) is not None, f"{n} has no grad1"
        torch.testing.assert_close(p.grad1, want[n], **tol, msg=lambda m, n=n: f"{n}: {m}")
        torch.testing.assert_close(p.grad1.sum(0), p.grad, **tol, msg=lambda m, n=n: f"{n}: {m}")
    norms = torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)
    torch.testing.assert_close(h.norms(), norms.to(h.norms().dtype), **tol)


def assert_refused(factory, error: type, says: list[str]) -> None:
    """Refused by gradhooks' own ``error``, whose message names ``says``; no ``grad1``."""
    spec = built(factory)

    def run():
        with gradhooks.add_hooks(spec.model, loss_reduction="sum", **spec.hooks):
            spec.losses(spec.model(*spec.args), *spec.targets).sum().backward()

    raised(error, says, run)
    assert all(getattr(p, "grad1", None) is None for p in spec.model.parameters())


# -- torch.nn's own blocks, as tutorials and projects use them -----------------------------------


class PositionalEncoding(nn.Module):
    """pytorch/tutorials, ``beginner_source/translation_transformer.py``:
    ``PositionalEncoding`` (sequence first, ``[length, 1, emb]``; dropout 0)."""

    def __init__(self, emb_size: int, maxlen: int = 16):
        super().__init__()
        den = torch.exp(-torch.arange(0, emb_size, 2) * math.log(10000) / emb_size)
        pos = torch.arange(0, maxlen).reshape(maxlen, 1)
        pos_embedding = torch.zeros((maxlen, emb_size))
        pos_embedding[:, 0::2] = torch.sin(pos * den)
        pos_embedding[:, 1::2] = torch.cos(pos * den)
        self.register_buffer("pos_embedding", pos_embedding.unsqueeze(-2))

    def forward(self, token_embedding: Tensor):
        return token_embedding + self.pos_embedding[: token_embedding.size(0), :]


class Seq2SeqTransformer(nn.Module):
    """pytorch/tutorials, ``beginner_source/translation_transformer.py``: ``nn.Transformer``
    sequence first, with a causal target mask and key padding masks for source, target and
    memory (the tutorial's ``create_mask``, here inside the forward)."""

    def __init__(self, vocab=11, emb=8, heads=2, ffn=16, pad=1):
        super().__init__()
        self.pad, self.emb = pad, emb
        self.transformer = nn.Transformer(d_model=emb, nhead=heads, num_encoder_layers=1,
                                          num_decoder_layers=1, dim_feedforward=ffn,
                                          dropout=0.0)  # fmt: skip
        self.generator = nn.Linear(emb, vocab)
        self.src_tok_emb = nn.Embedding(vocab, emb)
        self.tgt_tok_emb = nn.Embedding(vocab, emb)
        self.positional_encoding = PositionalEncoding(emb)

    def forward(self, src: Tensor, trg: Tensor):
        tgt_mask = nn.Transformer.generate_square_subsequent_mask(trg.shape[0], dtype=torch.bool)
        src_mask = torch.zeros((src.shape[0], src.shape[0]), dtype=torch.bool)
        src_padding_mask = (src == self.pad).transpose(0, 1)
        tgt_padding_mask = (trg == self.pad).transpose(0, 1)
        src_emb = self.positional_encoding(self.src_tok_emb(src) * math.sqrt(self.emb))
        tgt_emb = self.positional_encoding(self.tgt_tok_emb(trg) * math.sqrt(self.emb))
        outs = self.transformer(src_emb, tgt_emb, src_mask, tgt_mask, None, src_padding_mask,
                                tgt_padding_mask, src_padding_mask)  # fmt: skip
        return self.generator(outs)


def seq_first(args, i):
    return tuple(a[:, i : i + 1] for a in args)


def seq_first_cross_entropy(logits, target):
    """``logits`` ``[length, batch, vocab]``, ``target`` ``[batch, length]`` (padding 1 left out)."""
    per = F.cross_entropy(logits.permute(1, 2, 0), target, reduction="none", ignore_index=1)
    return per.sum(1)


def translation_transformer():
    src = torch.randint(2, 11, (5, B))
    src[3:, 0] = 1  # the first sentence padded
    trg = torch.randint(2, 11, (4, B))
    trg[2:, 1] = 1
    out = torch.randint(2, 11, (B, 4))
    out[1, 2:] = 1
    return Spec(Seq2SeqTransformer(), (src, trg), seq_first_cross_entropy, (out,),
                split=seq_first, hooks=dict(batch_dim=1))  # fmt: skip


class LatentCrossAttention(nn.Module):
    """A Perceiver's latent array attending to the inputs with ``nn.MultiheadAttention`` of
    other key and value widths (``kdim``, ``vdim``), as krasserm/perceiver-io's
    ``perceiver/model/core/modules.py`` once did; here sequence first, with a learned bias
    key and value (``add_bias_kv``), a zero key (``add_zero_attn``) and a key padding mask."""

    def __init__(self, latents=3, dim=8, kdim=5, vdim=6, classes=4):
        super().__init__()
        self.latent = nn.Parameter(torch.randn(latents, dim) * 0.5)
        self.to_values = nn.Linear(kdim, vdim)
        self.attn = nn.MultiheadAttention(dim, 2, kdim=kdim, vdim=vdim, add_bias_kv=True,
                                          add_zero_attn=True)  # fmt: skip
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: Tensor, pad: Tensor):  # x [length, batch, kdim], pad [batch, length]
        q = self.latent.unsqueeze(1).expand(-1, x.shape[1], -1)
        out, _ = self.attn(q, x, torch.tanh(self.to_values(x)), key_padding_mask=pad)
        return self.head(self.norm(out + q).mean(0))


def latent_cross_attention():
    x = torch.randn(6, B, 5)
    pad = torch.zeros(B, 6, dtype=torch.bool)
    pad[0, 4:] = True
    pad[2, 5:] = True

    def split(args, i):
        return args[0][:, i : i + 1], args[1][i : i + 1]

    return Spec(LatentCrossAttention(), (x, pad), cross_entropy, (torch.randint(0, 4, (B,)),),
                split=split, hooks=dict(batch_dim=1))  # fmt: skip


def batch_first_split(args, i):
    """Example ``i`` of a padded batch with its length: cut to that length."""
    x, lengths = args
    return x[i : i + 1, : int(lengths[i])], lengths[i : i + 1]


class ProjectedLSTMClassifier(nn.Module):
    """A bidirectional two-layer ``nn.LSTM`` with ``proj_size`` over a ``PackedSequence`` of
    unsorted lengths (``enforce_sorted=False``), classifying from the last hidden states of
    both directions, as a sentence classifier does."""

    def __init__(self, vocab=13, emb=6, hidden=8, proj=4, classes=3):
        super().__init__()
        self.embedding = nn.Embedding(vocab, emb, padding_idx=0)
        self.lstm = nn.LSTM(emb, hidden, num_layers=2, bidirectional=True, proj_size=proj,
                            batch_first=True)  # fmt: skip
        self.fc = nn.Linear(2 * proj, classes)

    def forward(self, tokens: Tensor, lengths: Tensor):
        packed = pack_padded_sequence(self.embedding(tokens), lengths, batch_first=True,
                                      enforce_sorted=False)  # fmt: skip
        _, (h, _) = self.lstm(packed)
        return self.fc(torch.cat([h[-2], h[-1]], dim=1))


def padded_tokens(vocab=13, length=6):
    lengths = torch.tensor([4, 6, 3])
    tokens = torch.randint(1, vocab, (B, length))
    tokens[torch.arange(length) >= lengths[:, None]] = 0
    return tokens, lengths


def lstm_proj_packed():
    return Spec(ProjectedLSTMClassifier(), padded_tokens(), cross_entropy,
                (torch.randint(0, 3, (B,)),), split=batch_first_split)  # fmt: skip


class WordAttention(nn.Module):
    """sgrvinod/a-PyTorch-Tutorial-to-Text-Classification, ``model.py``: ``WordAttention``, the
    word level of a hierarchical attention network: a bidirectional GRU over a
    ``PackedSequence``, the attention's layers applied to the packed rows (``.data``, time-major
    and sorted by length), the softmax computed on the padded scores with its maximum taken
    out, and the sentence the weighted sum of the GRU's padded outputs."""

    def __init__(self, vocab=13, emb=6, hidden=5, att=4, classes=3):
        super().__init__()
        self.embeddings = nn.Embedding(vocab, emb)
        self.word_rnn = nn.GRU(emb, hidden, num_layers=1, bidirectional=True, batch_first=True)
        self.word_attention = nn.Linear(2 * hidden, att)
        self.word_context_vector = nn.Linear(att, 1, bias=False)
        self.fc = nn.Linear(2 * hidden, classes)

    def forward(self, tokens: Tensor, lengths: Tensor):
        packed = pack_padded_sequence(self.embeddings(tokens), lengths, batch_first=True,
                                      enforce_sorted=False)  # fmt: skip
        packed_words, _ = self.word_rnn(packed)
        att_w = torch.tanh(self.word_attention(packed_words.data))
        att_w = self.word_context_vector(att_w).squeeze(1)
        max_value = att_w.max()  # (a scalar of the batch: it cancels in the softmax)
        att_w = torch.exp(att_w - max_value)
        att_w, _ = pad_packed_sequence(
            packed_words._replace(data=att_w), batch_first=True
        )  # (the sorted batch put back in order by the unsorted indices)
        word_alphas = att_w / torch.sum(att_w, dim=1, keepdim=True)
        sentences, _ = pad_packed_sequence(packed_words, batch_first=True)
        sentences = (sentences * word_alphas.unsqueeze(2)).sum(dim=1)
        return self.fc(sentences)


class PackedTagger(nn.Module):
    """A tagger whose data loader packs the batch (``pack_sequence`` in its ``collate_fn``, as
    many sequence-labelling scripts do): a bidirectional GRU over the ``PackedSequence`` it is
    given, padded back (``pad_packed_sequence``, to a fixed length) and tagged by a Linear."""

    def __init__(self, features=3, hidden=4, tags=3, length=6):
        super().__init__()
        self.length = length
        self.rnn = nn.GRU(features, hidden, bidirectional=True)
        self.tag = nn.Linear(2 * hidden, tags)

    def forward(self, packed):
        padded, _ = pad_packed_sequence(self.rnn(packed)[0], batch_first=True,
                                        total_length=self.length)  # fmt: skip
        return self.tag(padded)


def packed_tagger(enforce_sorted: bool):
    """Sequences of 6, 4 and 2 steps (sorted by length, as ``enforce_sorted`` needs) or of 4, 6
    and 2, each example's own tags (-100 where padded: no loss)."""
    lengths = (6, 4, 2) if enforce_sorted else (4, 6, 2)
    seqs = [torch.randn(n, 3, dtype=torch.float64) for n in lengths]
    tags = torch.randint(0, 3, (B, 6))
    tags[torch.arange(6) >= torch.tensor(lengths)[:, None]] = -100

    def split(args, i):
        return (pack_sequence([seqs[i]]),)

    return Spec(PackedTagger(), (pack_sequence(seqs, enforce_sorted=enforce_sorted),),
                cross_entropy, (tags,), split=split)  # fmt: skip


def han_word_attention():
    return Spec(WordAttention(), padded_tokens(), cross_entropy, (torch.randint(0, 3, (B,)),),
                split=batch_first_split)  # fmt: skip


class BilinearArcScorer(nn.Module):
    """A dependency parser's arc scorer with ``nn.Bilinear``: every (head, dependent) pair of
    one sentence's BiLSTM states scored, each dependent's head a softmax over the words."""

    def __init__(self, vocab=13, emb=6, hidden=4, arc=5):
        super().__init__()
        self.embedding = nn.Embedding(vocab, emb)
        self.lstm = nn.LSTM(emb, hidden, batch_first=True, bidirectional=True)
        self.head_mlp = nn.Linear(2 * hidden, arc)
        self.dep_mlp = nn.Linear(2 * hidden, arc)
        self.bilinear = nn.Bilinear(arc, arc, 1)

    def forward(self, tokens: Tensor):
        h, _ = self.lstm(self.embedding(tokens))
        n = tokens.shape[1]
        heads = F.elu(self.head_mlp(h)).unsqueeze(1).expand(-1, n, -1, -1)
        deps = F.elu(self.dep_mlp(h)).unsqueeze(2).expand(-1, -1, n, -1)
        return self.bilinear(deps.contiguous(), heads.contiguous()).squeeze(-1)  # [b, dep, head]


def bilinear_arcs():
    return Spec(BilinearArcScorer(), (torch.randint(0, 13, (B, 5)),), cross_entropy,
                (torch.randint(0, 5, (B, 5)),))  # fmt: skip


class DCGANGenerator(nn.Module):
    """pytorch/examples, ``dcgan/main.py``: ``Generator``, its first transposed convolution a
    ``Linear`` and ``nn.Unflatten`` (as many ports write it), BatchNorm made GroupNorm as for
    private training, the ``Tanh`` output."""

    def __init__(self, nz=4, ngf=4, nc=1):
        super().__init__()
        self.main = nn.Sequential(
            nn.Linear(nz, ngf * 4 * 2 * 2, bias=False),
            nn.Unflatten(1, (ngf * 4, 2, 2)),
            nn.GroupNorm(2, ngf * 4),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),
            nn.GroupNorm(2, ngf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, nc, 4, 2, 1, bias=False),
            nn.Tanh(),
        )

    def forward(self, z):
        return self.main(z)


def dcgan_unflatten():
    return Spec(DCGANGenerator(), (torch.randn(B, 4),), mse, (torch.rand(B, 1, 8, 8) * 2 - 1,))


class ESPCN(nn.Module):
    """pytorch/examples, ``super_resolution/model.py``: ``Net``, the sub-pixel convolution
    (``nn.PixelShuffle``); narrower."""

    def __init__(self, upscale_factor=2, width=6):
        super().__init__()
        self.relu = nn.ReLU()
        self.conv1 = nn.Conv2d(1, width, (5, 5), (1, 1), (2, 2))
        self.conv2 = nn.Conv2d(width, width, (3, 3), (1, 1), (1, 1))
        self.conv3 = nn.Conv2d(width, width // 2, (3, 3), (1, 1), (1, 1))
        self.conv4 = nn.Conv2d(width // 2, upscale_factor**2, (3, 3), (1, 1), (1, 1))
        self.pixel_shuffle = nn.PixelShuffle(upscale_factor)

    def forward(self, x):
        x = self.relu(self.conv1(x))
        x = self.relu(self.conv2(x))
        x = self.relu(self.conv3(x))
        return self.pixel_shuffle(self.conv4(x))


def espcn():
    return Spec(ESPCN(), (torch.randn(B, 1, 5, 5),), mse, (torch.randn(B, 1, 10, 10),))


class SoftSplit(nn.Module):
    """ruiliu-ai/FuseFormer, ``model/fuseformer.py``: ``SoftSplit``, overlapping patches of
    each frame (``nn.Unfold``) embedded by a ``Linear``."""

    def __init__(self, channel, hidden, kernel_size, stride, padding):
        super().__init__()
        self.t2t = nn.Unfold(kernel_size=kernel_size, stride=stride, padding=padding)
        self.embedding = nn.Linear(math.prod(kernel_size) * channel, hidden)

    def forward(self, x, b):
        feat = self.embedding(self.t2t(x).permute(0, 2, 1))
        return feat.view(b, -1, feat.size(2))


class SoftComp(nn.Module):
    """ruiliu-ai/FuseFormer, ``model/fuseformer.py``: ``SoftComp``, the tokens projected back
    to patches and summed where they overlap (``nn.Fold``; ``F.fold`` there), then a
    convolution."""

    def __init__(self, channel, hidden, output_size, kernel_size, stride, padding):
        super().__init__()
        self.embedding = nn.Linear(hidden, math.prod(kernel_size) * channel)
        self.fold = nn.Fold(output_size, kernel_size, stride=stride, padding=padding)
        self.bias_conv = nn.Conv2d(channel, channel, kernel_size=3, stride=1, padding=1)

    def forward(self, x, t):
        feat = self.embedding(x)
        b, _, c = feat.size()
        feat = feat.view(b * t, -1, c).permute(0, 2, 1)
        return self.bias_conv(self.fold(feat))


class FuseFormerLite(nn.Module):
    """FuseFormer's frames of each video folded into the batch, split into soft patches,
    attended across every frame's patches of the video, composed back."""

    def __init__(self, channel=3, hidden=8, size=(6, 6), kernel=(3, 3), stride=(2, 2)):
        super().__init__()
        self.ss = SoftSplit(channel, hidden, kernel, stride, (1, 1))
        self.attn = nn.MultiheadAttention(hidden, 2, batch_first=True)
        self.norm = nn.LayerNorm(hidden)
        self.sc = SoftComp(channel, hidden, size, kernel, stride, (1, 1))

    def forward(self, video):  # [b, t, c, h, w]
        b, t = video.shape[:2]
        tokens = self.ss(video.flatten(0, 1), b)
        y = self.norm(tokens)
        tokens = tokens + self.attn(y, y, y, need_weights=False)[0]
        return self.sc(tokens, t).view_as(video) + video


def fuseformer():
    return Spec(FuseFormerLite(), (torch.randn(B, 2, 3, 6, 6),), mse, (torch.randn(B, 2, 3, 6, 6),))


class Decoder3d(nn.Module):
    """wolny/pytorch-3dunet, ``pytorch3dunet/unet3d/buildingblocks.py``: a ``Decoder`` that
    upsamples by ``nn.ConvTranspose3d``, joins the encoder's features by concatenation and
    applies a double convolution (GroupNorm, ReLU), here after a one-level encoder."""

    def __init__(self, cin=1, f=4, classes=2):
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv3d(cin, f, 3, padding=1), nn.GroupNorm(2, f), nn.ReLU())
        self.enc2 = nn.Sequential(nn.MaxPool3d(2), nn.Conv3d(f, 2 * f, 3, padding=1),
                                  nn.GroupNorm(2, 2 * f), nn.ReLU())  # fmt: skip
        self.up = nn.ConvTranspose3d(2 * f, 2 * f, kernel_size=3, stride=2, padding=1,
                                     output_padding=1)  # fmt: skip
        self.dec = nn.Sequential(nn.Conv3d(3 * f, f, 3, padding=1), nn.GroupNorm(2, f), nn.ReLU())
        self.final = nn.Conv3d(f, classes, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        return self.final(self.dec(torch.cat((e1, self.up(self.enc2(e1))), dim=1)))


def unet3d():
    def loss(logits, target):
        return F.cross_entropy(logits, target, reduction="none").flatten(1).sum(1)

    return Spec(Decoder3d(), (torch.randn(B, 1, 4, 4, 4),), loss,
                (torch.randint(0, 2, (B, 4, 4, 4)),))  # fmt: skip


class LazyTagger(nn.Module):
    """A multi-label classifier of lazy modules (``nn.LazyConv2d``, ``nn.LazyLinear``), their
    shapes taken from a first forward, as the tutorials on lazy modules make them, with
    ``nn.Mish`` and ``nn.CELU`` activations."""

    def __init__(self, labels=4):
        super().__init__()
        self.features = nn.Sequential(nn.LazyConv2d(4, 3), nn.Mish(), nn.AdaptiveAvgPool2d(2),
                                      nn.Flatten())  # fmt: skip
        self.head = nn.Sequential(nn.LazyLinear(6), nn.CELU(0.5), nn.LazyLinear(labels))

    def forward(self, x):
        return self.head(self.features(x))


def multilabel_soft_margin(logits, target):
    return F.multilabel_soft_margin_loss(logits, target, reduction="none")


def lazy_tagger():
    model = LazyTagger()
    x = torch.randn(B, 2, 5, 5)
    with torch.no_grad():
        model(x)  # (the lazy modules made: their parameters' shapes come from this forward)
    return Spec(model, (x,), multilabel_soft_margin, (torch.randint(0, 2, (B, 4)).float(),))


def pixel_unshuffle(x, scale):
    """xinntao/BasicSR, ``basicsr/archs/arch_util.py``: ``pixel_unshuffle`` by view and
    permute."""
    b, c, hh, hw = x.size()
    h, w = hh // scale, hw // scale
    x_view = x.view(b, c, h, scale, w, scale)
    return x_view.permute(0, 1, 3, 5, 2, 4).reshape(b, c * scale**2, h, w)


class ResidualDenseBlock(nn.Module):
    """xinntao/BasicSR, ``basicsr/archs/rrdbnet_arch.py``: ``ResidualDenseBlock`` (three
    convolutions here, five there), each on the concatenation of all before, scaled by 0.2."""

    def __init__(self, num_feat=4, num_grow_ch=2):
        super().__init__()
        self.conv1 = nn.Conv2d(num_feat, num_grow_ch, 3, 1, 1)
        self.conv2 = nn.Conv2d(num_feat + num_grow_ch, num_grow_ch, 3, 1, 1)
        self.conv3 = nn.Conv2d(num_feat + 2 * num_grow_ch, num_feat, 3, 1, 1)
        self.lrelu = nn.LeakyReLU(negative_slope=0.2, inplace=True)

    def forward(self, x):
        x1 = self.lrelu(self.conv1(x))
        x2 = self.lrelu(self.conv2(torch.cat((x, x1), 1)))
        x3 = self.conv3(torch.cat((x, x1, x2), 1))
        return x3 * 0.2 + x


class RRDBNet(nn.Module):
    """xinntao/BasicSR, ``basicsr/archs/rrdbnet_arch.py``: ``RRDBNet`` at ``scale=2`` (Real-ESRGAN
    x2): the input pixel-unshuffled, a body of dense blocks, upsampled twice by nearest
    interpolation and convolution."""

    def __init__(self, num_in_ch=1, num_out_ch=1, num_feat=4, num_block=2):
        super().__init__()
        self.conv_first = nn.Conv2d(num_in_ch * 4, num_feat, 3, 1, 1)
        self.body = nn.Sequential(*[ResidualDenseBlock(num_feat) for _ in range(num_block)])
        self.conv_body = nn.Conv2d(num_feat, num_feat, 3, 1, 1)
        self.conv_up1 = nn.Conv2d(num_feat, num_feat, 3, 1, 1)
        self.conv_up2 = nn.Conv2d(num_feat, num_feat, 3, 1, 1)
        self.conv_hr = nn.Conv2d(num_feat, num_feat, 3, 1, 1)
        self.conv_last = nn.Conv2d(num_feat, num_out_ch, 3, 1, 1)
        self.lrelu = nn.LeakyReLU(negative_slope=0.2, inplace=True)

    def forward(self, x):
        feat = self.conv_first(pixel_unshuffle(x, scale=2))
        feat = feat + self.conv_body(self.body(feat))
        feat = self.lrelu(self.conv_up1(F.interpolate(feat, scale_factor=2, mode="nearest")))
        feat = self.lrelu(self.conv_up2(F.interpolate(feat, scale_factor=2, mode="nearest")))
        return self.conv_last(self.lrelu(self.conv_hr(feat)))


def rrdbnet():
    return Spec(RRDBNet(), (torch.randn(B, 1, 4, 4),), mse, (torch.randn(B, 1, 8, 8),))


class ShuffleUnit(nn.Module):
    """jaxony/ShuffleNet, ``model.py``: ``ShuffleUnit`` (stride 1, ``add``), grouped 1x1
    convolutions around a depthwise one, the channels shuffled between (``nn.ChannelShuffle``
    here, a view and transpose there), BatchNorm made GroupNorm."""

    def __init__(self, channels=8, groups=2):
        super().__init__()
        mid = channels // 2
        self.g_conv_1x1_compress = nn.Sequential(
            nn.Conv2d(channels, mid, 1, groups=groups), nn.GroupNorm(2, mid), nn.ReLU()
        )
        self.shuffle = nn.ChannelShuffle(groups)
        self.depthwise_conv3x3 = nn.Conv2d(mid, mid, 3, padding=1, groups=mid)
        self.bn_after_depthwise = nn.GroupNorm(2, mid)
        self.g_conv_1x1_expand = nn.Conv2d(mid, channels, 1, groups=groups)
        self.bn_expand = nn.GroupNorm(2, channels)

    def forward(self, x):
        out = self.shuffle(self.g_conv_1x1_compress(x))
        out = self.bn_after_depthwise(self.depthwise_conv3x3(out))
        return F.relu(x + self.bn_expand(self.g_conv_1x1_expand(out)))


class ShuffleNetV1Lite(nn.Module):
    def __init__(self, classes=3):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.units = nn.Sequential(ShuffleUnit(), ShuffleUnit())
        self.fc = nn.Linear(8, classes)

    def forward(self, x):
        return self.fc(self.units(self.stem(x)).mean((2, 3)))


def image_batch(side=8, classes=3, channels=3):
    return (torch.randn(B, channels, side, side),), (torch.randint(0, classes, (B,)),)


def shufflenet_v1():
    x, y = image_batch()
    return Spec(ShuffleNetV1Lite(), x, cross_entropy, y)


class SegNetLite(nn.Module):
    """A SegNet (Badrinarayanan et al.) encoder-decoder as its PyTorch ports write it
    (e.g. delta-onera/segnet_pytorch, ``segnet.py``): max pooling that returns its indices,
    ``nn.MaxUnpool2d`` putting the decoder's values back where the maxima were, GroupNorm for
    BatchNorm; a ``nn.Softmax2d`` over the classes and a negative log-likelihood."""

    def __init__(self, cin=3, f=4, classes=3):
        super().__init__()
        self.enc1 = nn.Sequential(nn.Conv2d(cin, f, 3, padding=1), nn.GroupNorm(2, f), nn.ReLU())
        self.enc2 = nn.Sequential(nn.Conv2d(f, 2 * f, 3, padding=1), nn.GroupNorm(2, 2 * f),
                                  nn.ReLU())  # fmt: skip
        self.pool = nn.MaxPool2d(2, 2, return_indices=True)
        self.unpool = nn.MaxUnpool2d(2, 2)
        self.dec2 = nn.Sequential(nn.Conv2d(2 * f, f, 3, padding=1), nn.GroupNorm(2, f), nn.ReLU())
        self.dec1 = nn.Conv2d(f, classes, 3, padding=1)
        self.softmax = nn.Softmax2d()

    def forward(self, x):
        x1, id1 = self.pool(self.enc1(x))
        x2, id2 = self.pool(self.enc2(x1))
        d2 = self.dec2(self.unpool(x2, id2, output_size=x1.shape))
        return self.softmax(self.dec1(self.unpool(d2, id1, output_size=x.shape)))


def segnet():
    def nll(probs, target):
        return F.nll_loss(probs.clamp_min(1e-12).log(), target, reduction="none").flatten(1).sum(1)

    return Spec(SegNetLite(), (torch.randn(B, 3, 8, 8),), nll, (torch.randint(0, 3, (B, 8, 8)),))


class AlexNetLRN(nn.Module):
    """The original AlexNet's local response normalization after its first two convolutions
    (``nn.LocalResponseNorm(5, alpha=1e-4, beta=0.75, k=2)``, as in the Caffe reference model
    ports), and a power-average pool (``nn.LPPool2d``) of the second convolution; narrower."""

    def __init__(self, classes=3):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 6, 3, stride=1, padding=1), nn.ReLU(inplace=True),
            nn.LocalResponseNorm(5, alpha=1e-4, beta=0.75, k=2.0), nn.MaxPool2d(2),
            nn.Conv2d(6, 8, 3, padding=1), nn.LPPool2d(2, 2), nn.ReLU(inplace=True),
            nn.LocalResponseNorm(5, alpha=1e-4, beta=0.75, k=2.0),
        )  # fmt: skip
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(8 * 2 * 2, 8),
                                        nn.ReLU(inplace=True), nn.Linear(8, classes))  # fmt: skip

    def forward(self, x):
        return self.classifier(self.features(x))


def alexnet_lrn():
    x, y = image_batch()
    return Spec(AlexNetLRN(), x, cross_entropy, y)


class TripletNet(nn.Module):
    """adambielski/siamese-triplet, ``networks.py``: ``EmbeddingNet`` (convolutions and
    ``PReLU``s; narrower) called on the anchors, the positives and the negatives in turn
    (``TripletNet``)."""

    def __init__(self):
        super().__init__()
        self.convnet = nn.Sequential(nn.Conv2d(1, 4, 3), nn.PReLU(), nn.MaxPool2d(2, stride=2))
        self.fc = nn.Sequential(nn.Linear(4 * 3 * 3, 8), nn.PReLU(), nn.Linear(8, 2))

    def get_embedding(self, x):
        return self.fc(self.convnet(x).view(x.size(0), -1))

    def forward(self, x1, x2, x3):
        return self.get_embedding(x1), self.get_embedding(x2), self.get_embedding(x3)


def triplet_loss(out, margin=1.0):
    """adambielski/siamese-triplet, ``losses.py``: ``TripletLoss``, each triplet's own loss."""
    anchor, positive, negative = out
    distance_positive = (anchor - positive).pow(2).sum(1)
    distance_negative = (anchor - negative).pow(2).sum(1)
    return F.relu(distance_positive - distance_negative + margin)


def triplet():
    return Spec(TripletNet(), tuple(torch.randn(B, 1, 8, 8) for _ in range(3)), triplet_loss)


class TextClassificationModel(nn.Module):
    """pytorch/tutorials, ``beginner_source/text_sentiment_ngrams_tutorial.py``:
    ``TextClassificationModel``, an ``nn.EmbeddingBag`` (mean) of every example's tokens
    joined into one flat tensor, with the offsets where each starts."""

    def __init__(self, vocab_size=20, embed_dim=6, num_class=3):
        super().__init__()
        self.embedding = nn.EmbeddingBag(vocab_size, embed_dim, sparse=False)
        self.fc = nn.Linear(embed_dim, num_class)

    def forward(self, text, offsets):
        return self.fc(self.embedding(text, offsets))


def text_bag():
    texts = [torch.randint(0, 20, (n,)) for n in (4, 2, 5)]
    offsets = torch.tensor([0, 4, 6])

    def split(args, i):
        return texts[i], torch.zeros(1, dtype=torch.long)

    return Spec(TextClassificationModel(), (torch.cat(texts), offsets), cross_entropy,
                (torch.randint(0, 3, (B,)),), split=split)  # fmt: skip


class MixtureDensityNetwork(nn.Module):
    """tonyduan/mdn, ``mdn/models.py``: ``MixtureDensityNetwork``, a categorical network and a
    network of the components' means and log standard deviations, its loss the negative
    log-likelihood of a ``torch.distributions`` mixture written out (``logsumexp`` of the
    mixing log-probabilities and the ``Normal``'s log-densities)."""

    def __init__(self, dim_in=3, dim_out=2, n_components=3, hidden=8):
        super().__init__()
        self.n_components, self.dim_out = n_components, dim_out
        self.pi_network = nn.Sequential(nn.Linear(dim_in, hidden), nn.ELU(),
                                        nn.Linear(hidden, n_components))  # fmt: skip
        self.normal_network = nn.Sequential(nn.Linear(dim_in, hidden), nn.ELU(),
                                            nn.Linear(hidden, 2 * dim_out * n_components))  # fmt: skip

    def forward(self, x):
        pi = torch.distributions.OneHotCategorical(logits=self.pi_network(x))
        params = self.normal_network(x)
        mean, sd = torch.split(params, params.shape[1] // 2, dim=1)
        mean = torch.stack(mean.split(mean.shape[1] // self.n_components, 1)).transpose(0, 1)
        sd = torch.stack(sd.split(sd.shape[1] // self.n_components, 1)).transpose(0, 1)
        return pi, torch.distributions.Normal(mean, torch.exp(sd))


def mdn_loss(out, y):
    """tonyduan/mdn, ``mdn/models.py``: ``MixtureDensityNetwork.loss``, each example's."""
    pi, normal = out
    loglik = normal.log_prob(y.unsqueeze(1).expand_as(normal.loc)).sum(dim=2)
    return -torch.logsumexp(torch.log(pi.probs) + loglik, dim=1)


def mdn():
    return Spec(MixtureDensityNetwork(), (torch.randn(B, 3),), mdn_loss, (torch.randn(B, 2),))


class SimSiam(nn.Module):
    """facebookresearch/simsiam, ``simsiam/builder.py``: ``SimSiam``, one encoder (a small
    convolutional backbone and a projector) and a predictor, called on two views of each image;
    the loss (``main_simsiam.py``) the negative cosine of each view's prediction against the
    other view's detached projection. BatchNorm there, made GroupNorm here
    (``gradhooks.convert_batch_norm``) as for private training."""

    def __init__(self, dim=8, pred_dim=4):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Linear(4, dim, bias=False), nn.BatchNorm1d(dim), nn.ReLU(inplace=True),
            nn.Linear(dim, dim), nn.BatchNorm1d(dim, affine=False),
        )  # fmt: skip
        self.predictor = nn.Sequential(nn.Linear(dim, pred_dim, bias=False),
                                       nn.BatchNorm1d(pred_dim), nn.ReLU(inplace=True),
                                       nn.Linear(pred_dim, dim))  # fmt: skip

    def forward(self, x1, x2):
        z1, z2 = self.encoder(x1), self.encoder(x2)
        p1, p2 = self.predictor(z1), self.predictor(z2)
        return p1, p2, z1.detach(), z2.detach()


def simsiam_loss(out):
    p1, p2, z1, z2 = out
    return -(F.cosine_similarity(p1, z2, dim=1) + F.cosine_similarity(p2, z1, dim=1)) * 0.5


def simsiam(private=True):
    model = gradhooks.convert_batch_norm(SimSiam(), num_groups=1) if private else SimSiam()
    return Spec(model, (torch.randn(B, 3, 8, 8), torch.randn(B, 3, 8, 8)), simsiam_loss)


class NBeatsBlock(nn.Module):
    """ServiceNow/N-BEATS, ``models/nbeats.py``: ``NBeatsBlock`` with the generic basis
    (``GenericBasis``: the first of the expansion coefficients the backcast, the last the
    forecast)."""

    def __init__(self, input_size, theta_size, layers=2, layer_size=8, backcast=6, forecast=3):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(input_size, layer_size)] + [
            nn.Linear(layer_size, layer_size) for _ in range(layers - 1)])  # fmt: skip
        self.basis_parameters = nn.Linear(layer_size, theta_size)
        self.backcast_size, self.forecast_size = backcast, forecast

    def forward(self, x):
        block_input = x
        for layer in self.layers:
            block_input = torch.relu(layer(block_input))
        theta = self.basis_parameters(block_input)
        return theta[:, : self.backcast_size], theta[:, -self.forecast_size :]


class NBeats(nn.Module):
    """ServiceNow/N-BEATS, ``models/nbeats.py``: ``NBeats``, the input reversed and masked,
    each block's backcast taken off the residuals and its forecast added up."""

    def __init__(self, blocks=3, backcast=6, forecast=3):
        super().__init__()
        self.blocks = nn.ModuleList([NBeatsBlock(backcast, backcast + forecast)
                                     for _ in range(blocks)])  # fmt: skip

    def forward(self, x, input_mask):
        residuals = x.flip(dims=(1,))
        input_mask = input_mask.flip(dims=(1,))
        forecast = x[:, -1:]
        for block in self.blocks:
            backcast, block_forecast = block(residuals)
            residuals = (residuals - backcast) * input_mask
            forecast = forecast + block_forecast
        return forecast


def nbeats():
    mask = torch.ones(B, 6)
    mask[0, :2] = 0  # (the first series' first values missing)
    return Spec(NBeats(), (torch.randn(B, 6), mask), mse, (torch.randn(B, 3),))


# -- torchvision's models, rewritten small (its PyPI build does not import beside CPU torch) -------


class Fire(nn.Module):
    """pytorch/vision, ``torchvision/models/squeezenet.py``: ``Fire``."""

    def __init__(self, inplanes, squeeze_planes, expand1x1_planes, expand3x3_planes):
        super().__init__()
        self.squeeze = nn.Conv2d(inplanes, squeeze_planes, kernel_size=1)
        self.squeeze_activation = nn.ReLU(inplace=True)
        self.expand1x1 = nn.Conv2d(squeeze_planes, expand1x1_planes, kernel_size=1)
        self.expand1x1_activation = nn.ReLU(inplace=True)
        self.expand3x3 = nn.Conv2d(squeeze_planes, expand3x3_planes, kernel_size=3, padding=1)
        self.expand3x3_activation = nn.ReLU(inplace=True)

    def forward(self, x):
        x = self.squeeze_activation(self.squeeze(x))
        return torch.cat([self.expand1x1_activation(self.expand1x1(x)),
                          self.expand3x3_activation(self.expand3x3(x))], 1)  # fmt: skip


class SqueezeNet(nn.Module):
    """pytorch/vision, ``torchvision/models/squeezenet.py``: ``SqueezeNet`` 1.1 (two Fire
    modules, narrower), its classifier a 1x1 convolution, ReLU and global average pool."""

    def __init__(self, num_classes=3):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, kernel_size=3, stride=2), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2, ceil_mode=True),
            Fire(8, 2, 4, 4), Fire(8, 2, 4, 4),
        )  # fmt: skip
        final_conv = nn.Conv2d(8, num_classes, kernel_size=1)
        self.classifier = nn.Sequential(nn.Dropout(p=0.0), final_conv, nn.ReLU(inplace=True),
                                        nn.AdaptiveAvgPool2d((1, 1)))  # fmt: skip

    def forward(self, x):
        return torch.flatten(self.classifier(self.features(x)), 1)


def squeezenet():
    x, y = image_batch(side=11)
    return Spec(SqueezeNet(), x, cross_entropy, y)


def conv_norm_act(cin, cout, k=3, stride=1, groups=1, norm=None, act=None):
    """pytorch/vision, ``torchvision/ops/misc.py``: ``Conv2dNormActivation`` (no bias before a
    norm)."""
    layers = [nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=norm is None)]
    if norm is not None:
        layers.append(norm(cout))
    if act is not None:
        layers.append(act(inplace=True))
    return nn.Sequential(*layers)


class SqueezeExcitation(nn.Module):
    """pytorch/vision, ``torchvision/ops/misc.py``: ``SqueezeExcitation`` (MobileNetV3's, with
    ``Hardsigmoid``)."""

    def __init__(self, input_channels, squeeze_channels):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(input_channels, squeeze_channels, 1)
        self.fc2 = nn.Conv2d(squeeze_channels, input_channels, 1)
        self.activation = nn.ReLU()
        self.scale_activation = nn.Hardsigmoid()

    def forward(self, input):
        scale = self.fc2(self.activation(self.fc1(self.avgpool(input))))
        return self.scale_activation(scale) * input


class MBV3Block(nn.Module):
    """pytorch/vision, ``torchvision/models/mobilenetv3.py``: ``InvertedResidual``: expand,
    depthwise, squeeze-and-excite, project, the residual where the shapes allow."""

    def __init__(self, cin, exp, cout, k, se, act, stride, norm):
        super().__init__()
        self.use_res_connect = stride == 1 and cin == cout
        layers = []
        if exp != cin:
            layers.append(conv_norm_act(cin, exp, 1, norm=norm, act=act))
        layers.append(conv_norm_act(exp, exp, k, stride, groups=exp, norm=norm, act=act))
        if se:
            layers.append(SqueezeExcitation(exp, max(8, exp // 4)))
        layers.append(conv_norm_act(exp, cout, 1, norm=norm))
        self.block = nn.Sequential(*layers)

    def forward(self, input):
        result = self.block(input)
        if self.use_res_connect:
            result += input
        return result


class MobileNetV3(nn.Module):
    """pytorch/vision, ``torchvision/models/mobilenetv3.py``: ``MobileNetV3`` (small's first
    blocks, narrower), ``Hardswish``, its BatchNorm ``eps=0.001, momentum=0.01``."""

    def __init__(self, num_classes=3):
        super().__init__()
        norm = partial(nn.BatchNorm2d, eps=0.001, momentum=0.01)
        self.features = nn.Sequential(
            conv_norm_act(3, 8, 3, 2, norm=norm, act=nn.Hardswish),
            MBV3Block(8, 8, 8, 3, True, nn.ReLU, 1, norm),
            MBV3Block(8, 16, 8, 3, False, nn.ReLU, 2, norm),
            MBV3Block(8, 24, 8, 5, True, nn.Hardswish, 1, norm),
            conv_norm_act(8, 24, 1, norm=norm, act=nn.Hardswish),
        )
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(24, 16), nn.Hardswish(inplace=True),
                                        nn.Dropout(p=0.0), nn.Linear(16, num_classes))  # fmt: skip

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def mobilenet_v3(bn_eval=True):
    x, y = image_batch()
    return Spec(MobileNetV3(), x, cross_entropy, y, bn_eval=bn_eval)


def channel_shuffle(x: Tensor, groups: int) -> Tensor:
    """pytorch/vision, ``torchvision/models/shufflenetv2.py``: ``channel_shuffle``."""
    batchsize, num_channels, height, width = x.size()
    x = x.view(batchsize, groups, num_channels // groups, height, width)
    x = torch.transpose(x, 1, 2).contiguous()
    return x.view(batchsize, num_channels, height, width)


class ShuffleV2Block(nn.Module):
    """pytorch/vision, ``torchvision/models/shufflenetv2.py``: ``InvertedResidual``, the input
    chunked in two (stride 1) or fed to two branches (stride 2), then shuffled."""

    def __init__(self, inp, oup, stride):
        super().__init__()
        self.stride = stride
        bf = oup // 2
        if stride > 1:
            self.branch1 = nn.Sequential(
                nn.Conv2d(inp, inp, 3, stride, 1, bias=False, groups=inp), nn.BatchNorm2d(inp),
                nn.Conv2d(inp, bf, 1, 1, 0, bias=False), nn.BatchNorm2d(bf), nn.ReLU(inplace=True),
            )  # fmt: skip
        else:
            self.branch1 = nn.Sequential()
        self.branch2 = nn.Sequential(
            nn.Conv2d(inp if stride > 1 else bf, bf, 1, 1, 0, bias=False), nn.BatchNorm2d(bf),
            nn.ReLU(inplace=True),
            nn.Conv2d(bf, bf, 3, stride, 1, bias=False, groups=bf), nn.BatchNorm2d(bf),
            nn.Conv2d(bf, bf, 1, 1, 0, bias=False), nn.BatchNorm2d(bf), nn.ReLU(inplace=True),
        )  # fmt: skip

    def forward(self, x):
        if self.stride == 1:
            x1, x2 = x.chunk(2, dim=1)
            out = torch.cat((x1, self.branch2(x2)), dim=1)
        else:
            out = torch.cat((self.branch1(x), self.branch2(x)), dim=1)
        return channel_shuffle(out, 2)


class ShuffleNetV2(nn.Module):
    """pytorch/vision, ``torchvision/models/shufflenetv2.py``: ``ShuffleNetV2`` (one stage),
    made private as Opacus' users make it: ``gradhooks.convert_batch_norm`` (GroupNorm)."""

    def __init__(self, num_classes=3):
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8),
                                   nn.ReLU(inplace=True))  # fmt: skip
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.stage2 = nn.Sequential(ShuffleV2Block(8, 16, 2), ShuffleV2Block(16, 16, 1))
        self.conv5 = nn.Sequential(nn.Conv2d(16, 16, 1, 1, 0, bias=False), nn.BatchNorm2d(16),
                                   nn.ReLU(inplace=True))  # fmt: skip
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x):
        x = self.conv5(self.stage2(self.maxpool(self.conv1(x))))
        return self.fc(x.mean([2, 3]))


def shufflenet_v2():
    x, y = image_batch(side=16)
    return Spec(gradhooks.convert_batch_norm(ShuffleNetV2()), x, cross_entropy, y)


class BasicConv2d(nn.Module):
    """pytorch/vision, ``torchvision/models/googlenet.py``: ``BasicConv2d``."""

    def __init__(self, in_channels, out_channels, **kwargs):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, bias=False, **kwargs)
        self.bn = nn.BatchNorm2d(out_channels, eps=0.001)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)), inplace=True)


class Inception(nn.Module):
    """pytorch/vision, ``torchvision/models/googlenet.py``: ``Inception`` (its "5x5" branch a
    3x3, as there)."""

    def __init__(self, cin, ch1x1, ch3x3red, ch3x3, ch5x5red, ch5x5, pool_proj):
        super().__init__()
        self.branch1 = BasicConv2d(cin, ch1x1, kernel_size=1)
        self.branch2 = nn.Sequential(BasicConv2d(cin, ch3x3red, kernel_size=1),
                                     BasicConv2d(ch3x3red, ch3x3, kernel_size=3, padding=1))  # fmt: skip
        self.branch3 = nn.Sequential(BasicConv2d(cin, ch5x5red, kernel_size=1),
                                     BasicConv2d(ch5x5red, ch5x5, kernel_size=3, padding=1))  # fmt: skip
        self.branch4 = nn.Sequential(nn.MaxPool2d(kernel_size=3, stride=1, padding=1, ceil_mode=True),
                                     BasicConv2d(cin, pool_proj, kernel_size=1))  # fmt: skip

    def forward(self, x):
        return torch.cat([self.branch1(x), self.branch2(x), self.branch3(x), self.branch4(x)], 1)


class InceptionAux(nn.Module):
    """pytorch/vision, ``torchvision/models/googlenet.py``: ``InceptionAux`` (narrower)."""

    def __init__(self, cin, num_classes):
        super().__init__()
        self.conv = BasicConv2d(cin, 4, kernel_size=1)
        self.fc1 = nn.Linear(4 * 4 * 4, 8)
        self.fc2 = nn.Linear(8, num_classes)

    def forward(self, x):
        x = torch.flatten(self.conv(F.adaptive_avg_pool2d(x, (4, 4))), 1)
        return self.fc2(F.relu(self.fc1(x), inplace=True))


class GoogLeNet(nn.Module):
    """pytorch/vision, ``torchvision/models/googlenet.py``: ``GoogLeNet`` with ``aux_logits``
    (two inception blocks, narrower): in training it returns the logits and both auxiliary
    heads', which the transfer-learning scripts weigh 0.3 in the loss."""

    def __init__(self, num_classes=3):
        super().__init__()
        self.conv1 = BasicConv2d(3, 8, kernel_size=3, stride=2, padding=1)
        self.inception3a = Inception(8, 4, 2, 4, 2, 2, 2)
        self.aux1 = InceptionAux(12, num_classes)
        self.inception3b = Inception(12, 4, 2, 4, 2, 4, 4)
        self.aux2 = InceptionAux(16, num_classes)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x):
        x = self.inception3a(self.conv1(x))
        aux1 = self.aux1(x) if self.training else None
        x = self.inception3b(x)
        aux2 = self.aux2(x) if self.training else None
        return self.fc(torch.flatten(self.avgpool(x), 1)), aux2, aux1


def googlenet_loss(out, target):
    logits, aux2, aux1 = out
    return cross_entropy(logits, target) + 0.3 * (
        cross_entropy(aux1, target) + cross_entropy(aux2, target)
    )


def googlenet():
    x, y = image_batch(side=16)
    return Spec(GoogLeNet(), x, googlenet_loss, y, bn_eval=True)


class DenseLayer(nn.Module):
    """pytorch/vision, ``torchvision/models/densenet.py``: ``_DenseLayer`` with
    ``memory_efficient=True``: the bottleneck of the concatenated features recomputed in the
    backward (``torch.utils.checkpoint``, ``use_reentrant=False``)."""

    def __init__(self, num_input_features, growth_rate=4, bn_size=2):
        super().__init__()
        self.norm1 = nn.BatchNorm2d(num_input_features)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(num_input_features, bn_size * growth_rate, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth_rate)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth_rate, growth_rate, 3, padding=1, bias=False)

    def bn_function(self, inputs):
        return self.conv1(self.relu1(self.norm1(torch.cat(inputs, 1))))

    def forward(self, input):
        prev_features = [input] if isinstance(input, Tensor) else input
        if any(t.requires_grad for t in prev_features):

            def closure(*inputs):
                return self.bn_function(inputs)

            bottleneck_output = cp.checkpoint(closure, *prev_features, use_reentrant=False)
        else:
            bottleneck_output = self.bn_function(prev_features)
        return self.conv2(self.relu2(self.norm2(bottleneck_output)))


class DenseBlock(nn.ModuleDict):
    """pytorch/vision, ``torchvision/models/densenet.py``: ``_DenseBlock``."""

    def __init__(self, num_layers, num_input_features, growth_rate=4):
        super().__init__()
        for i in range(num_layers):
            layer = DenseLayer(num_input_features + i * growth_rate, growth_rate)
            self.add_module(f"denselayer{i + 1}", layer)

    def forward(self, init_features):
        features = [init_features]
        for _, layer in self.items():
            features.append(layer(features))
        return torch.cat(features, 1)


class DenseNet(nn.Module):
    """pytorch/vision, ``torchvision/models/densenet.py``: ``DenseNet`` (one block), made
    private with ``gradhooks.convert_batch_norm``."""

    def __init__(self, num_classes=3):
        super().__init__()
        self.features = nn.Sequential(OrderedDict([
            ("conv0", nn.Conv2d(3, 8, kernel_size=3, stride=2, padding=1, bias=False)),
            ("norm0", nn.BatchNorm2d(8)), ("relu0", nn.ReLU(inplace=True)),
            ("pool0", nn.MaxPool2d(kernel_size=3, stride=2, padding=1)),
            ("denseblock1", DenseBlock(2, 8)), ("norm5", nn.BatchNorm2d(16)),
        ]))  # fmt: skip
        self.classifier = nn.Linear(16, num_classes)

    def forward(self, x):
        out = F.adaptive_avg_pool2d(F.relu(self.features(x), inplace=True), (1, 1))
        return self.classifier(torch.flatten(out, 1))


def densenet():
    x, y = image_batch(side=12)
    return Spec(gradhooks.convert_batch_norm(DenseNet()), x, cross_entropy, y)


class VGG(nn.Module):
    """pytorch/vision, ``torchvision/models/vgg.py``: ``VGG`` from a configuration list,
    ``AdaptiveAvgPool2d((7, 7))`` before the classifier (here from 2x2, each value repeated);
    narrower."""

    def __init__(self, cfg=(4, "M", 8, "M"), num_classes=3):
        super().__init__()
        layers, cin = [], 3
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                layers += [nn.Conv2d(cin, v, kernel_size=3, padding=1), nn.ReLU(inplace=True)]
                cin = v
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(cin * 7 * 7, 8), nn.ReLU(True), nn.Dropout(p=0.0),
            nn.Linear(8, 8), nn.ReLU(True), nn.Dropout(p=0.0), nn.Linear(8, num_classes),
        )  # fmt: skip

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def vgg():
    x, y = image_batch(side=8)
    return Spec(VGG(), x, cross_entropy, y)


# -- Hugging Face models the other tests do not build: translation, time series, contrastive -----


def _hf():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


class Seq2SeqLM(nn.Module):
    """A Hugging Face encoder-decoder's logits under teacher forcing, a padded source."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, decoder_input_ids):
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          decoder_input_ids=decoder_input_ids).logits  # fmt: skip


def translation(kind: str):
    """A tiny Pegasus, Marian or M2M100 translation model, trained as ``run_translation.py``
    trains it: the source right-padded, the targets' cross-entropy."""
    t = _hf()
    config_cls, model_cls = {
        "pegasus": (t.PegasusConfig, t.PegasusForConditionalGeneration),
        "marian": (t.MarianConfig, t.MarianMTModel),
        "m2m100": (t.M2M100Config, t.M2M100ForConditionalGeneration),
    }[kind]
    config = config_cls(vocab_size=40, d_model=16, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                        decoder_ffn_dim=32, max_position_embeddings=32, dropout=0.0,
                        attention_dropout=0.0, activation_dropout=0.0, encoder_layerdrop=0.0,
                        decoder_layerdrop=0.0, pad_token_id=1, decoder_start_token_id=2)  # fmt: skip
    ids = torch.randint(3, 40, (B, 6))
    mask = torch.ones(B, 6, dtype=torch.long)
    ids[0, 4:], mask[0, 4:] = 1, 0
    return Spec(Seq2SeqLM(model_cls(config)), (ids, mask, torch.randint(3, 40, (B, 5))),
                cross_entropy, (torch.randint(3, 40, (B, 5)),))  # fmt: skip


class Forecaster(nn.Module):
    """A probabilistic forecaster of Hugging Face (``TimeSeriesTransformerForPrediction`` and
    its kin): each example's negative log-likelihood of its future values under the predicted
    distribution, as the model's own loss computes it before averaging over the batch."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, past_values, past_time_features, past_observed_mask, future_values,
                future_time_features):  # fmt: skip
        out = self.model(past_values=past_values, past_time_features=past_time_features,
                         past_observed_mask=past_observed_mask, future_values=future_values,
                         future_time_features=future_time_features)  # fmt: skip
        distribution = self.model.output_distribution(out.params, loc=out.loc, scale=out.scale)
        return -distribution.log_prob(future_values)


def summed(per, *_):
    return per.flatten(1).sum(1)


def forecaster(kind: str, context=8, prediction=3, **more):
    """A tiny forecaster, lags 1 and 2, one time feature, the first series' first values
    unobserved (its scaling from the observed values only)."""
    t = _hf()
    config_cls, model_cls = {
        "time-series-transformer": (t.TimeSeriesTransformerConfig,
                                    t.TimeSeriesTransformerForPrediction),
        "informer": (t.InformerConfig, t.InformerForPrediction),
        "autoformer": (t.AutoformerConfig, t.AutoformerForPrediction),
    }[kind]  # fmt: skip
    config = config_cls(prediction_length=prediction, context_length=context, lags_sequence=[1, 2],
                        num_time_features=1, d_model=8, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16,
                        decoder_ffn_dim=16, dropout=0.0, attention_dropout=0.0,
                        activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
                        **more)  # fmt: skip
    past = context + 2
    observed = torch.ones(B, past)
    observed[0, :3] = 0
    args = (torch.rand(B, past) + 1, torch.randn(B, past, 1), observed,
            torch.rand(B, prediction) + 1, torch.randn(B, prediction, 1))  # fmt: skip
    # (Autoformer's aggregation of delays is float32, as its authors wrote it)
    dtype = torch.float32 if kind == "autoformer" else torch.float64
    return Spec(Forecaster(model_cls(config)), args, summed, rtol=1e-5, dtype=dtype)


class PointForecaster(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, past_values):
        return self.model(past_values=past_values).prediction_outputs


def patch_forecaster(kind: str, **more):
    """A tiny PatchTST or PatchTSMixer point forecaster of two channels, each series standardized
    by its own statistics, the mean squared error of the forecast."""
    t = _hf()
    common = dict(num_input_channels=2, context_length=12, patch_length=4, patch_stride=2,
                  prediction_length=3, d_model=8, dropout=0.0, head_dropout=0.0)  # fmt: skip
    if kind == "patchtst":
        config = t.PatchTSTConfig(num_attention_heads=2, num_hidden_layers=1, ffn_dim=16,
                                  attention_dropout=0.0, positional_dropout=0.0, path_dropout=0.0,
                                  ff_dropout=0.0, **common, **more)  # fmt: skip
        model = t.PatchTSTForPrediction(config)
    else:
        config = t.PatchTSMixerConfig(num_layers=2, **common, **more)
        model = t.PatchTSMixerForPrediction(config)
    return Spec(PointForecaster(model), (torch.randn(B, 12, 2),), mse, (torch.randn(B, 3, 2),))


class Contrastive(nn.Module):
    """CLIP's or SigLIP's image-text logits of the batch, ``[images, texts]``."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, pixel_values):
        return self.model(input_ids=input_ids, pixel_values=pixel_values).logits_per_image


def clip_loss(logits_per_image):
    """Hugging Face's ``clip_loss`` (each image's and each text's cross-entropy against its
    pair), each example's share."""
    labels = torch.arange(len(logits_per_image))
    return (F.cross_entropy(logits_per_image, labels, reduction="none")
            + F.cross_entropy(logits_per_image.t(), labels, reduction="none")) / 2  # fmt: skip


def sigmoid_loss(logits_per_image):
    """SigLIP's pairwise sigmoid loss, each image's row."""
    labels = 2 * torch.eye(len(logits_per_image)) - 1
    return -F.logsigmoid(labels * logits_per_image).sum(1)


def contrastive(kind: str):
    t = _hf()
    text = dict(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=16)  # fmt: skip
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=8, patch_size=4)  # fmt: skip
    if kind == "clip":
        config = t.CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)
        model, loss = t.CLIPModel(config), clip_loss
    else:
        config = t.SiglipConfig(text_config=text, vision_config=vision)
        model, loss = t.SiglipModel(config), sigmoid_loss
    args = (torch.randint(0, 40, (B, 5)), torch.randn(B, 3, 8, 8))
    return Spec(Contrastive(model), args, loss)


# -- the checks ----------------------------------------------------------------------------------

MATCH = {
    "translation-transformer": translation_transformer,
    "latent-cross-attention": latent_cross_attention,
    "lstm-proj-packed": lstm_proj_packed,
    "packed-tagger-sorted": partial(packed_tagger, enforce_sorted=True),
    "packed-tagger-unsorted": partial(packed_tagger, enforce_sorted=False),
    "bilinear-arcs": bilinear_arcs,
    "dcgan-unflatten": dcgan_unflatten,
    "espcn": espcn,
    "fuseformer": fuseformer,
    "unet3d": unet3d,
    "lazy-tagger": lazy_tagger,
    "rrdbnet": rrdbnet,
    "shufflenet-v1": shufflenet_v1,
    "segnet": segnet,
    "alexnet-lrn": alexnet_lrn,
    "triplet": triplet,
    "text-bag": text_bag,
    "mdn": mdn,
    "simsiam-groupnorm": simsiam,
    "nbeats": nbeats,
    "squeezenet": squeezenet,
    "mobilenet-v3-frozen-bn": mobilenet_v3,
    "shufflenet-v2-groupnorm": shufflenet_v2,
    "googlenet-aux": googlenet,
    "densenet-checkpointed": densenet,
    "vgg": vgg,
    "pegasus": partial(translation, "pegasus"),
    "marian": partial(translation, "marian"),
    "m2m100": partial(translation, "m2m100"),
    "time-series-transformer": partial(forecaster, "time-series-transformer"),
    # (ProbSparse attention, which at this length keeps every query: its sampled keys unused)
    "informer": partial(forecaster, "informer"),
    "patchtst-layernorm": partial(patch_forecaster, "patchtst", norm_type="layernorm"),
    "patchtsmixer": partial(patch_forecaster, "patchtsmixer"),
    "patchtsmixer-mix-channel": partial(
        patch_forecaster,
        "patchtsmixer",
        mode="mix_channel",
        gated_attn=True,
        self_attn=True,
        self_attn_heads=2,
    ),  # fmt: skip
}

BATCH_NORM = ["BatchNorm", "GroupNorm", "eval"]
REFUSED = {
    "mobilenet-v3": (
        partial(mobilenet_v3, bn_eval=False),
        gradhooks.MixedExamplesError,
        ["'features.0.1' (BatchNorm2d)", *BATCH_NORM],
    ),
    "patchtst": (
        partial(patch_forecaster, "patchtst"),
        gradhooks.MixedExamplesError,
        ["'model.model.encoder.layers.0.norm_sublayer1.batchnorm' (BatchNorm1d)", *BATCH_NORM],
    ),
    "patchtsmixer-batchnorm": (
        partial(patch_forecaster, "patchtsmixer", norm_mlp="BatchNorm"),
        gradhooks.MixedExamplesError,
        ["mixers.0.patch_mixer.norm.norm.batchnorm' (BatchNorm1d)", *BATCH_NORM],
    ),
    "simsiam": (
        partial(simsiam, private=False),
        gradhooks.MixedExamplesError,
        ["'encoder.1' (BatchNorm2d)", *BATCH_NORM],
    ),
    # (the delays of its auto-correlation chosen in training by their mean over the batch)
    "autoformer": (
        partial(forecaster, "autoformer", label_length=4, moving_average=3),
        gradhooks.MixedExamplesError,
        ["'model.model.encoder.layers.0.self_attn.out_proj' (Linear)", "(3, 8, 8)"],
    ),
    "clip": (partial(contrastive, "clip"), gradhooks.MixedExamplesError, ["(3, 3)", "matmul"]),
    "siglip": (partial(contrastive, "siglip"), gradhooks.MixedExamplesError, ["(3, 3)", "matmul"]),
}


@pytest.mark.parametrize("name", MATCH)
def test_model_matches_the_loop(name):
    assert_matches_loop(MATCH[name])


@pytest.mark.parametrize("name", REFUSED)
def test_model_refused(name):
    factory, error, says = REFUSED[name]
    assert_refused(factory, error, says)


def test_the_check_tells_a_wrong_grad1(monkeypatch):
    """Two examples' ``grad1`` of one parameter swapped: the comparison with the loop fails."""
    monkeypatch.setattr(gradhooks, "add_hooks", corrupting(gradhooks.add_hooks))
    with pytest.raises(AssertionError):
        assert_matches_loop(espcn)


def test_lazy_modules_not_yet_made_are_refused():
    """``add_hooks`` before the lazy modules' first forward: refused, naming the parameter
    and the remedy; the model is left without hooks."""
    model = LazyTagger()
    hooks = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]
    raised(gradhooks.ConfigurationError, ["'features.0.weight'", "before add_hooks"],
           lambda: gradhooks.add_hooks(model))  # fmt: skip
    assert [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()] == hooks
    x = torch.randn(B, 2, 5, 5)
    with torch.no_grad():
        model(x)  # (the remedy: one forward first)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        model(x).sum().backward()
    assert all(p.grad1.shape == (B, *p.shape) for p in model.parameters())


@pytest.mark.xfail(
    strict=True,
    raises=gradhooks.MixedExamplesError,
    reason=(
        "The attention's scores have the whole batch's maximum taken out (att_w - "
        "att_w.max(), one number of every example's scores, which the softmax then cancels): "
        "the tracker takes that subtraction for a reduction over the examples, and refuses "
        "the layer after it; telling that a later normalization cancels it would take "
        "following the softmax written out by hand (exp, a sum, a division)."
    ),
)
def test_attention_on_packed_rows():
    """A false refusal: the hierarchical attention network's word attention, whose loop works.
    Its Linears on the packed rows are followed (the test after it)."""
    assert_matches_loop(han_word_attention)


class WordAttentionStable(WordAttention):
    """:class:`WordAttention` with each sentence's own maximum taken out of its scores, where
    the tutorial takes the batch's."""

    def forward(self, tokens: Tensor, lengths: Tensor):
        packed = pack_padded_sequence(self.embeddings(tokens), lengths, batch_first=True,
                                      enforce_sorted=False)  # fmt: skip
        packed_words, _ = self.word_rnn(packed)
        att_w = torch.tanh(self.word_attention(packed_words.data))
        att_w = self.word_context_vector(att_w).squeeze(1)
        att_w, _ = pad_packed_sequence(packed_words._replace(data=att_w), batch_first=True,
                                       padding_value=-torch.inf)  # fmt: skip
        word_alphas = torch.softmax(att_w, dim=1)
        sentences, _ = pad_packed_sequence(packed_words, batch_first=True)
        sentences = (sentences * word_alphas.unsqueeze(2)).sum(dim=1)
        return self.fc(sentences)


def test_attention_on_packed_rows_without_the_batch_maximum():
    """The word attention's Linears on the rows of the GRU's PackedSequence (its ``.data``,
    time-major and sorted by length, each row one example's word): each example's gradient is
    the sum of its rows', against the loop."""
    assert_matches_loop(lambda: replace(han_word_attention(), model=WordAttentionStable()))


# -- trained as users train: bfloat16 autocast, a few steps ----------------------------------------


def off(got: Tensor, want: Tensor, scale: Tensor | float) -> float:
    """The largest error of ``got`` relative to ``scale``."""
    return float((got.float() - want.float()).abs().max() / max(float(scale), 1e-30))


def train_bf16(factory, how: str, steps: int = 3) -> None:
    """The model in float32, trained as its users train it: ``zero_grad``, a forward under CPU
    bfloat16 autocast, the loss (in float32) averaged over the batch, ``backward`` (or
    gradhooks' DP step, ``how="dp"``, clipping without noise) and an AdamW step. At each step,
    ``grad1`` against the per-example loop in float64 at that step's parameters, and its mean
    against ``.grad`` (or ``.grad`` against the loop's clipped mean), within ``BF16_TOL`` plus
    twice the error of the same model's own per-example loop under the same autocast (a
    gradient zero in exact arithmetic is that loop's rounding), relative to the largest entry
    of each parameter's rows (or of its clipped terms: a mean of terms of both signs is smaller
    than each), and no less than a tenth of the model's largest: a gradient that is zero in
    exact arithmetic (a key's bias; the triplet network's last bias, which cancels between its
    three calls) is rounding of the model's scale on both sides, a few bfloat16 units."""
    spec = built(factory, torch.float32)
    twin = built(factory, torch.float64)  # (the float64 loop's, at each step's parameters)
    model = spec.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    with gradhooks.add_hooks(model, loss_reduction="mean", **spec.hooks) as hooks:
        for step in range(steps):
            optimizer.zero_grad()
            low = autocast_gradients(spec)
            twin.model.load_state_dict(model.state_dict())
            want = own_gradients(twin)
            floor = 0.1 * max(float(w.abs().max()) for w in want.values())
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses = spec.losses(model(*spec.args), *spec.targets).float()
            norms = torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)
            if how == "dp":
                C = 0.5 * float(norms.max())
                gradhooks.dp_sgd_step(hooks, losses, max_norm=C, noise_multiplier=0.0)
                factor = (C / (norms + 1e-6)).clamp(max=1.0)
                for n, p in trainable.items():
                    rows = factor.view(-1, *[1] * p.dim())
                    terms, own = want[n] * rows, low[n] * rows
                    scale = max(terms.abs().max(), floor)
                    tol = BF16_TOL + 2 * off(own.mean(0), terms.mean(0), scale)
                    err = off(p.grad, terms.mean(0), scale)
                    assert err < tol, (step, n, err, tol)
            else:
                losses.mean().backward()
                for n, p in trainable.items():
                    if p.grad is None:
                        assert getattr(p, "grad1", None) is None and not want[n].any(), n
                        continue
                    assert p.grad1.shape == (B, *p.shape), n
                    scale = max(want[n].abs().max(), floor)
                    tol = BF16_TOL + 2 * off(low[n], want[n], scale)
                    err = off(p.grad1, want[n], scale)
                    assert err < tol, (step, n, err, tol)
                    assert off(p.grad1.mean(0), p.grad, scale) < BF16_TOL, (step, n)
            optimizer.step()


TRAINED = {
    "translation-transformer": (translation_transformer, "grad1"),
    "lstm-proj-packed": (lstm_proj_packed, "dp"),
    "fuseformer": (fuseformer, "grad1"),
    "espcn": (espcn, "dp"),
    "rrdbnet": (rrdbnet, "grad1"),
    "segnet": (segnet, "grad1"),
    "triplet": (triplet, "dp"),
    "mdn": (mdn, "dp"),
    "simsiam-groupnorm": (simsiam, "dp"),
    "nbeats": (nbeats, "grad1"),
    "mobilenet-v3-frozen-bn": (mobilenet_v3, "grad1"),
    "googlenet-aux": (googlenet, "grad1"),
    "densenet-checkpointed": (densenet, "dp"),
    "pegasus": (partial(translation, "pegasus"), "grad1"),
    "time-series-transformer": (partial(forecaster, "time-series-transformer"), "dp"),
    "patchtsmixer": (partial(patch_forecaster, "patchtsmixer"), "grad1"),
}


def test_the_training_check_tells_a_wrong_step(monkeypatch):
    """Two examples' ``grad1`` of one parameter swapped after each backward, or the DP step's
    ``.grad`` of one parameter of the wrong sign: the training loop's comparison fails."""
    specs = []  # (the trained model's spec is built first, its float64 twin next)

    def kept():
        specs.append(espcn())
        return specs[-1]

    backward = Tensor.backward

    def swapped(self, *args, **kwargs):
        backward(self, *args, **kwargs)
        p = specs[0].model.conv1.weight
        p.grad1 = p.grad1[[1, 0, 2]]

    with monkeypatch.context() as m:
        m.setattr(Tensor, "backward", swapped)
        with pytest.raises(AssertionError):
            train_bf16(kept, "grad1", steps=1)
    step = gradhooks.dp_sgd_step

    def wrong_sign(hooks, *args, **kwargs):
        out = step(hooks, *args, **kwargs)
        hooks.model.conv1.weight.grad.neg_()
        return out

    monkeypatch.setattr(gradhooks, "dp_sgd_step", wrong_sign)
    with pytest.raises(AssertionError):
        train_bf16(espcn, "dp", steps=1)


@pytest.mark.parametrize("name", TRAINED)
def test_model_trained_under_bf16_autocast(name):
    factory, how = TRAINED[name]
    train_bf16(factory, how)

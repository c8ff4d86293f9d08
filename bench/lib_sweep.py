"""Models of pure-Python libraries (x-transformers, diffusers, perceiver-pytorch, ...) against
the per-example loop.

    python -m bench.lib_sweep                                  # every model it can build
    python -m bench.lib_sweep --models xt-rotary,unet2d        # some, by name
    python -m bench.lib_sweep --libraries diffusers            # one library's
    python -m bench.lib_sweep --out /tmp/sweep --limit 60

Each model is built as its library's users build it, at a tiny configuration, in float64, in
training mode with every dropout (and stochastic depth's DropPath) at 0, and given a batch of
3; its loss is the one its users write (a language model's summed token cross-entropy, a classifier's cross-entropy, the DDPM
loss: the mean squared error between the predicted and the true noise of each example, at a
timestep of its own), summed or averaged over the batch as the row says.
``add_hooks(model, loss_reduction=...)`` and one ``backward()`` give ``grad1``, compared
parameter by parameter with each example's own gradient (:func:`gradhooks.oracle.loop_grad`:
one forward and backward per example). The outcomes are those of ``bench.sweep`` (the Hugging Face sweep's): match
(within ``rtol=1e-7``, or ``1e-4`` where the model computes in float32 inside, as the row
says), refused (gradhooks' own error, its first line), mismatch (a silently wrong ``grad1``:
the parameter and its error), crash (another exception from inside gradhooks), skipped (the
library is not installed, the model does not build or run, draws random numbers in training
mode, or took longer than ``--limit`` seconds).

With ``--settings default`` (or a list of models), some of them also run in a training loop (3
SGD steps), under bfloat16 autocast (against the float64 loop, at a tolerance of 5e-2: about 16
units of bfloat16's rounding), under float16 autocast with a ``GradScaler`` (``grad1`` divided
by its scale, at 1e-2) and in ``gradhooks.dp_sgd_step`` (book-keeping, against the loop's
clipped sum).

Writes ``<out>/lib-sweep.json`` and ``<out>/lib-sweep.md`` (``<out>`` is ``bench/results``).
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib
import importlib.util
import json
import sys
import time
import types
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python bench/lib_sweep.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

import gradhooks
from gradhooks.oracle import loop_grad

from . import sweep
from .sweep import (
    FLOAT32_RTOL,
    OUTCOMES,
    ROUNDED,
    RTOL,
    Result,
    Skip,
    TimeLimit,
    first_line,
    hooked_backward,
    progress,
    time_limit,
)
from .timm_sweep import import_torchvision

ROOT = Path(__file__).resolve().parent.parent
BATCH = 3
SEQ = 8
VOCAB = 99
DIM = 32
CLASSES = 3


@dataclass
class Example:
    """A model, a batch and its users' loss.

    ``losses(out, *targets)`` gives each example's own loss, ``[batch]``; the sweep sums or
    averages them (``reduction``). ``inputs`` go to the model, ``targets`` only to the loss;
    both are batched along dimension 0 and sliced together for the loop.
    """

    model: nn.Module
    inputs: tuple[Tensor, ...]
    losses: Callable[..., Tensor]
    targets: tuple[Tensor, ...] = ()
    reduction: str = "sum"
    call: Callable[..., object] | None = None  # model(*inputs) by default
    # the call returns the batch's loss itself, as the library computes it (a mean over
    # examples of one size each: a VQ-VAE's commitment loss); a batch of one gives one
    # example's, and ``losses`` is the identity
    batch_loss: bool = False


@dataclass(frozen=True)
class Case:
    name: str
    library: str  # the module imported (skipped when it is not installed)
    build: Callable[[], Example]
    note: str = ""


CASES: dict[str, Case] = {}


def case(name: str, library: str, note: str = ""):
    def register(build: Callable[[], Example]) -> Callable[[], Example]:
        if name in CASES:
            raise ValueError(f"case {name!r} registered twice")
        CASES[name] = Case(name, library, build, note)
        return build

    return register


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tokens(seq: int = SEQ, vocab: int = VOCAB, seed: int = 0) -> Tensor:
    return torch.randint(0, vocab, (BATCH, seq), generator=_gen(seed))


def _randn(*shape: int, seed: int = 0) -> Tensor:
    return torch.randn(*shape, generator=_gen(seed), dtype=torch.float64)


def token_ce(logits: Tensor, labels: Tensor) -> Tensor:
    """Each example's summed token cross-entropy, ``[batch]``."""
    ce = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none")
    return ce.view(labels.shape[0], -1).sum(1)


def class_ce(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits, labels, reduction="none")


def mse(pred: Tensor, target: Tensor) -> Tensor:
    """Each example's mean squared error, ``[batch]`` (``F.mse_loss`` of a batch of one)."""
    return (pred - target).pow(2).flatten(1).mean(1)


def _labels(classes: int = CLASSES, seed: int = 1) -> Tensor:
    return torch.randint(0, classes, (BATCH,), generator=_gen(seed))


# -- x-transformers -----------------------------------------------------------------------------


def _xt_lm(layers: str = "Decoder", wrapper: dict | None = None, **attn) -> Example:
    import x_transformers as xt

    torch.manual_seed(0)
    cls = getattr(xt, layers)
    kw = {"dim": DIM, "depth": 2, "heads": 4, "attn_dim_head": 8, **attn}
    model = xt.TransformerWrapper(
        num_tokens=VOCAB, max_seq_len=16, attn_layers=cls(**kw), **(wrapper or {})
    )
    ids = _tokens()
    return Example(model, (ids,), token_ce, (_tokens(seed=1),))


XT_DECODERS = {
    "xt-decoder": {},
    "xt-rotary": {"rotary_pos_emb": True},
    "xt-rotary-xpos": {"rotary_pos_emb": True, "rotary_xpos": True},
    "xt-alibi": {"alibi_pos_bias": True, "alibi_num_heads": 2},
    "xt-rel-pos-bias": {"rel_pos_bias": True},
    "xt-dynamic-pos-bias": {"dynamic_pos_bias": True},
    "xt-glu-ff": {"ff_glu": True, "ff_swish": True},
    "xt-residual-attn": {"residual_attn": True},
    "xt-ff-no-bias": {"ff_no_bias": True, "attn_gate_values": True},
    "xt-rmsnorm": {"use_rmsnorm": True},
    "xt-scalenorm": {"use_scalenorm": True},
    "xt-sandwich-norm": {"sandwich_norm": True},
    "xt-post-norm": {"pre_norm": False},
    "xt-gqa": {"attn_kv_heads": 2},
    "xt-one-kv-head": {"attn_one_kv_head": True},
    "xt-qk-norm": {"attn_qk_norm": True},
    "xt-talking-heads": {"attn_pre_talking_heads": True, "attn_post_talking_heads": True},
    "xt-shift-tokens": {"shift_tokens": 1},
    "xt-macaron": {"macaron": True},
    "xt-gate-residual": {"gate_residual": True},
    "xt-value-residual": {"add_value_residual": True},
    "xt-memory-kv": {"attn_num_mem_kv": 2},
    "xt-layerscale": {"use_layerscale": True, "layerscale_init_value": 0.1},
    "xt-hyper-connections": {"num_residual_streams": 2},
    "xt-weight-tied-layers": {"weight_tie_layers": True},
    "xt-sparse-topk": {"attn_sparse_topk": 3},
    "xt-softclamp-logits": {"attn_softclamp_logits": True},
}
for _name, _kw in XT_DECODERS.items():
    case(_name, "x_transformers")(lambda _kw=_kw: _xt_lm("Decoder", **_kw))

case("xt-memory-tokens", "x_transformers")(
    lambda: _xt_lm("Decoder", {"num_memory_tokens": 2}, rotary_pos_emb=True)
)
case("xt-tied-embedding", "x_transformers")(
    lambda: _xt_lm("Decoder", {"tie_embedding": True}, attn_flash=False)
)
case("xt-encoder", "x_transformers")(lambda: _xt_lm("Encoder", ff_glu=True))
case("xt-l2norm-embed", "x_transformers")(
    lambda: _xt_lm("Decoder", {"l2norm_embed": True, "post_emb_norm": True})
)


@case("xt-encoder-classifier", "x_transformers", "average-pooled encoder, a linear head")
def _xt_classifier() -> Example:
    import x_transformers as xt

    torch.manual_seed(0)
    model = xt.TransformerWrapper(
        num_tokens=VOCAB,
        max_seq_len=16,
        logits_dim=CLASSES,
        average_pool_embed=True,
        attn_layers=xt.Encoder(dim=DIM, depth=2, heads=4, attn_dim_head=8),
    )
    return Example(model, (_tokens(),), class_ce, (_labels(),), reduction="mean")


@case("xt-continuous", "x_transformers", "ContinuousTransformerWrapper, a regression")
def _xt_continuous() -> Example:
    import x_transformers as xt

    torch.manual_seed(0)
    model = xt.ContinuousTransformerWrapper(
        dim_in=5,
        dim_out=3,
        max_seq_len=16,
        attn_layers=xt.Encoder(dim=DIM, depth=2, heads=4, attn_dim_head=8, rotary_pos_emb=True),
    )
    return Example(model, (_randn(BATCH, SEQ, 5),), mse, (_randn(BATCH, SEQ, 3, seed=1),), "mean")


@case("xt-cross-attend", "x_transformers", "a decoder attending to a per-example context")
def _xt_cross() -> Example:
    import x_transformers as xt

    torch.manual_seed(0)
    model = xt.TransformerWrapper(
        num_tokens=VOCAB,
        max_seq_len=16,
        attn_layers=xt.Decoder(dim=DIM, depth=2, heads=4, attn_dim_head=8, cross_attend=True),
    )
    context = _randn(BATCH, 5, DIM, seed=2)
    return Example(
        model,
        (_tokens(), context),
        token_ce,
        (_tokens(seed=1),),
        call=lambda m, ids, ctx: m(ids, context=ctx),
    )


@case("xt-xtransformer", "x_transformers", "XTransformer encoder-decoder")
def _xt_encdec() -> Example:
    import x_transformers as xt

    torch.manual_seed(0)
    model = xt.XTransformer(
        dim=DIM,
        enc_num_tokens=VOCAB,
        enc_depth=1,
        enc_heads=4,
        enc_max_seq_len=16,
        dec_num_tokens=VOCAB,
        dec_depth=1,
        dec_heads=4,
        dec_max_seq_len=16,
        tie_token_emb=True,
    )
    src, tgt = _tokens(), _tokens(seed=1)

    def call(m, src, tgt):  # the decoder's logits of the target (teacher forcing)
        enc = m.encoder(src, return_embeddings=True)
        return m.decoder.net(tgt[:, :-1], context=enc)

    return Example(model, (src, tgt), token_ce, (tgt[:, 1:],), call=call)


@case("xt-vit", "x_transformers", "ViTransformerWrapper")
def _xt_vit() -> Example:
    import x_transformers as xt

    torch.manual_seed(0)
    model = xt.ViTransformerWrapper(
        image_size=16,
        patch_size=4,
        num_classes=CLASSES,
        attn_layers=xt.Encoder(dim=DIM, depth=2, heads=4, attn_dim_head=8),
    )
    return Example(model, (_randn(BATCH, 3, 16, 16),), class_ce, (_labels(),), "mean")


# -- other lucidrains packages ------------------------------------------------------------------


@case("perceiver", "perceiver_pytorch", "Perceiver on images, Fourier-encoded positions")
def _perceiver() -> Example:
    from perceiver_pytorch import Perceiver

    torch.manual_seed(0)
    model = Perceiver(
        input_channels=3,
        input_axis=2,
        num_freq_bands=4,
        max_freq=10.0,
        depth=2,
        num_latents=8,
        latent_dim=DIM,
        cross_heads=1,
        latent_heads=4,
        cross_dim_head=8,
        latent_dim_head=8,
        num_classes=CLASSES,
        attn_dropout=0.0,
        ff_dropout=0.0,
        weight_tie_layers=False,
    )
    return Example(model, (_randn(BATCH, 8, 8, 3),), class_ce, (_labels(),), "mean")


@case("perceiver-io", "perceiver_pytorch", "PerceiverIO with per-example queries")
def _perceiver_io() -> Example:
    from perceiver_pytorch import PerceiverIO

    torch.manual_seed(0)
    model = PerceiverIO(
        dim=5,
        queries_dim=DIM,
        logits_dim=VOCAB,
        depth=2,
        num_latents=8,
        latent_dim=DIM,
        cross_heads=1,
        latent_heads=4,
        cross_dim_head=8,
        latent_dim_head=8,
    )
    data, queries = _randn(BATCH, 6, 5), _randn(BATCH, SEQ, DIM, seed=2)
    return Example(
        model,
        (data, queries),
        token_ce,
        (_tokens(seed=1),),
        call=lambda m, x, q: m(x, queries=q),
    )


@case("perceiver-lm", "perceiver_pytorch", "PerceiverLM")
def _perceiver_lm() -> Example:
    from perceiver_pytorch.perceiver_io import PerceiverLM

    torch.manual_seed(0)
    model = PerceiverLM(
        num_tokens=VOCAB,
        dim=DIM,
        depth=2,
        max_seq_len=16,
        num_latents=8,
        latent_dim=DIM,
        cross_heads=1,
        latent_heads=4,
        cross_dim_head=8,
        latent_dim_head=8,
    )
    return Example(model, (_tokens(),), token_ce, (_tokens(seed=1),))


@case("performer-lm", "performer_pytorch", "PerformerLM, its random features drawn once")
def _performer() -> Example:
    from performer_pytorch import PerformerLM

    torch.manual_seed(0)
    model = PerformerLM(
        num_tokens=VOCAB,
        max_seq_len=16,
        dim=DIM,
        depth=2,
        heads=4,
        dim_head=8,
        causal=True,
        nb_features=16,
        feature_redraw_interval=None,
        generalized_attention=False,
        ff_glu=True,
        rotary_position_emb=True,
    )
    return Example(model, (_tokens(),), token_ce, (_tokens(seed=1),))


@case("linear-attention-lm", "linear_attention_transformer", "LinearAttentionTransformerLM")
def _linear_attention() -> Example:
    from linear_attention_transformer import LinearAttentionTransformerLM

    torch.manual_seed(0)
    model = LinearAttentionTransformerLM(
        num_tokens=VOCAB,
        dim=DIM,
        heads=4,
        depth=2,
        max_seq_len=16,
        causal=True,
        ff_dropout=0.0,
        attn_layer_dropout=0.0,
        attn_dropout=0.0,
        emb_dim=16,
        dim_head=8,
        blindspot_size=2,
        n_local_attn_heads=2,
        local_attn_window_size=4,
    )
    return Example(model, (_tokens(),), token_ce, (_tokens(seed=1),))


@case("mlp-mixer", "mlp_mixer_pytorch", "MLPMixer on images")
def _mlp_mixer() -> Example:
    from mlp_mixer_pytorch import MLPMixer

    torch.manual_seed(0)
    model = MLPMixer(image_size=16, channels=3, patch_size=4, dim=DIM, depth=2, num_classes=CLASSES)
    return Example(model, (_randn(BATCH, 3, 16, 16),), class_ce, (_labels(),), "mean")


class RotaryAttentionLM(nn.Module):
    """A small causal language model with ``rotary_embedding_torch`` as its README uses it:
    ``rotate_queries_or_keys`` on the heads of ``q`` and ``k``."""

    def __init__(self, rotary_cls, heads: int = 4, dim_head: int = 8, **rotary):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(VOCAB, DIM)
        self.rotary = rotary_cls(dim=dim_head // 2, **rotary)
        self.qkv = nn.Linear(DIM, 3 * heads * dim_head, bias=False)
        self.out = nn.Linear(heads * dim_head, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids)
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        if getattr(self.rotary, "use_xpos", False):
            q, k = self.rotary.rotate_queries_and_keys(q, k)
        else:
            q, k = self.rotary.rotate_queries_or_keys(q), self.rotary.rotate_queries_or_keys(k)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(att.transpose(1, 2).reshape(b, n, -1))
        return self.head(self.norm(x))


@case("rotary-embedding", "rotary_embedding_torch", "RotaryEmbedding in a hand-written LM")
def _rotary() -> Example:
    from rotary_embedding_torch import RotaryEmbedding

    torch.manual_seed(0)
    model = RotaryAttentionLM(RotaryEmbedding)
    return Example(model, (_tokens(),), token_ce, (_tokens(seed=1),))


@case("rotary-embedding-xpos", "rotary_embedding_torch", "xpos, learned frequencies")
def _rotary_xpos() -> Example:
    from rotary_embedding_torch import RotaryEmbedding

    torch.manual_seed(0)
    model = RotaryAttentionLM(RotaryEmbedding, use_xpos=True, learned_freq=True)
    return Example(model, (_tokens(),), token_ce, (_tokens(seed=1),))


@case("local-attention-lm", "local_attention", "LocalTransformer")
def _local_attention() -> Example:
    from local_attention import LocalTransformer

    torch.manual_seed(0)
    model = LocalTransformer(
        num_tokens=VOCAB,
        dim=DIM,
        depth=2,
        heads=4,
        dim_head=8,
        max_seq_len=16,
        causal=True,
        local_attn_window_size=4,
    )
    return Example(model, (_tokens(),), token_ce, (_tokens(seed=1),))


# -- diffusers ----------------------------------------------------------------------------------

IMG = 16


def _ddpm(model: nn.Module, channels: int, call=None, extra: tuple[Tensor, ...] = ()) -> Example:
    """The DDPM training loss: noise, a timestep per example, the scheduler's noisy images, the
    mean squared error between the model's predicted noise and the true noise."""
    from diffusers import DDPMScheduler

    scheduler = DDPMScheduler(num_train_timesteps=100)
    g = _gen(3)
    clean = torch.randn(BATCH, channels, IMG, IMG, generator=g, dtype=torch.float64)
    noise = torch.randn(clean.shape, generator=g, dtype=torch.float64)
    timesteps = torch.randint(0, 100, (BATCH,), generator=g)
    noisy = scheduler.add_noise(clean, noise, timesteps)
    if call is None:

        def call(m, x, t, *rest):
            return m(x, t, *rest).sample

    return Example(model, (noisy, timesteps, *extra), mse, (noise,), "mean", call=call)


@case("unet2d", "diffusers", "UNet2DModel, DDPM loss")
def _unet2d() -> Example:
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    model = UNet2DModel(
        sample_size=IMG,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=8,
        attention_head_dim=8,
    )
    return _ddpm(model, 3)


@case("unet2d-class-conditional", "diffusers", "UNet2DModel with class labels")
def _unet2d_classes() -> Example:
    from diffusers import UNet2DModel

    torch.manual_seed(0)
    model = UNet2DModel(
        sample_size=IMG,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=8,
        num_class_embeds=CLASSES,
        time_embedding_type="fourier",
    )
    return _ddpm(
        model,
        3,
        call=lambda m, x, t, y: m(x, t, class_labels=y).sample,
        extra=(_labels(),),
    )


@case("unet2d-condition", "diffusers", "UNet2DConditionModel, text-like context")
def _unet2d_condition() -> Example:
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    model = UNet2DConditionModel(
        sample_size=IMG,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(16, 32),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=DIM,
        attention_head_dim=4,
        norm_num_groups=8,
    )
    context = _randn(BATCH, 5, DIM, seed=4)
    return _ddpm(
        model,
        4,
        call=lambda m, x, t, c: m(x, t, encoder_hidden_states=c).sample,
        extra=(context,),
    )


@case("dit", "diffusers", "DiTTransformer2DModel, class-conditional")
def _dit() -> Example:
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(0)
    model = DiTTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        sample_size=IMG,
        patch_size=4,
        num_embeds_ada_norm=CLASSES,
        norm_num_groups=8,
    )
    return _ddpm(
        model,
        4,
        call=lambda m, x, t, y: m(x, timestep=t, class_labels=y).sample,
        extra=(_labels(),),
    )


@case("transformer2d", "diffusers", "Transformer2DModel on latents (continuous input)")
def _transformer2d() -> Example:
    from diffusers import Transformer2DModel

    torch.manual_seed(0)
    model = Transformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=16,
        num_layers=2,
        norm_num_groups=8,
        cross_attention_dim=DIM,
    )
    context = _randn(BATCH, 5, DIM, seed=4)
    return _ddpm(
        model,
        16,
        call=lambda m, x, t, c: m(x, encoder_hidden_states=c).sample,
        extra=(context,),
    )


@case("autoencoder-kl", "diffusers", "AutoencoderKL reconstruction (posterior mode)")
def _autoencoder() -> Example:
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    model = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        latent_channels=4,
        norm_num_groups=4,
        sample_size=IMG,
    )
    x = _randn(BATCH, 3, IMG, IMG, seed=5)
    return Example(model, (x,), mse, (x,), "mean", call=lambda m, x: m(x).sample)


@case("unet1d", "diffusers", "UNet1DModel (temporal residual blocks), DDPM loss on sequences")
def _unet1d() -> Example:
    from diffusers import DDPMScheduler, UNet1DModel

    torch.manual_seed(0)
    model = UNet1DModel(
        in_channels=4,
        out_channels=4,
        block_out_channels=(8, 16, 16, 32),
        time_embedding_type="positional",
        use_timestep_embedding=True,
        flip_sin_to_cos=False,
        freq_shift=1.0,
        out_block_type="OutConv1DBlock",
        mid_block_type="MidResTemporalBlock1D",
        down_block_types=("DownResnetBlock1D",) * 4,
        up_block_types=("UpResnetBlock1D",) * 3,
        act_fn="swish",
        layers_per_block=1,
    )
    scheduler = DDPMScheduler(num_train_timesteps=100)
    g = _gen(3)
    clean = torch.randn(BATCH, 4, 16, generator=g, dtype=torch.float64)
    noise = torch.randn(clean.shape, generator=g, dtype=torch.float64)
    t = torch.randint(0, 100, (BATCH,), generator=g)
    noisy = scheduler.add_noise(clean, noise, t)
    return Example(model, (noisy, t), mse, (noise,), "mean", call=lambda m, x, t: m(x, t).sample)


# -- sentence-transformers ----------------------------------------------------------------------


@case("sentence-transformer", "sentence_transformers", "tiny BERT, mean pooling of padded pairs")
def _sentence_transformer() -> Example:
    """``SentenceTransformer([Transformer, Pooling("mean")])`` of a tiny random BERT written to
    a temporary folder (it loads by path), trained with ``CosineSimilarityLoss``: the squared
    difference between the cosine of a pair's embeddings and its label, averaged."""
    import tempfile

    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Pooling, Transformer

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(f"w{i}" for i in range(94))]
        vocab = Path(folder) / "vocab.txt"
        vocab.write_text("\n".join(words) + "\n")
        transformers.BertTokenizer(str(vocab)).save_pretrained(folder)
        config = transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            max_position_embeddings=32,
        )  # fmt: skip
        transformers.BertModel(config).save_pretrained(folder)
        encoder = Transformer(folder)
    model = SentenceTransformer(
        modules=[encoder, Pooling(encoder.get_word_embedding_dimension(), "mean")], device="cpu"
    )

    def padded(seed: int) -> tuple[Tensor, Tensor]:
        ids = torch.randint(5, VOCAB, (BATCH, SEQ), generator=_gen(seed))
        mask = torch.ones_like(ids)
        for b, pad in enumerate((0, 2, 3)):
            if pad:
                ids[b, -pad:], mask[b, -pad:] = 0, 0
        return ids, mask

    def call(m, ids_a, mask_a, ids_b, mask_b):
        a = m({"input_ids": ids_a, "attention_mask": mask_a})["sentence_embedding"]
        b = m({"input_ids": ids_b, "attention_mask": mask_b})["sentence_embedding"]
        return F.cosine_similarity(a, b)

    labels = torch.rand(BATCH, generator=_gen(6), dtype=torch.float64)
    return Example(
        model, (*padded(1), *padded(2)), lambda cos, y: (cos - y) ** 2, (labels,), "mean",
        call=call,
    )  # fmt: skip


# -- tabular models: tab-transformer-pytorch, rtdl_revisiting_models, pytorch-tabnet -----------


def _tabular(categories: tuple[int, ...] = (5, 4, 3), continuous: int = 4):
    cat = torch.stack(
        [torch.randint(0, n, (BATCH,), generator=_gen(10 + i)) for i, n in enumerate(categories)], 1
    )
    return cat, _randn(BATCH, continuous, seed=11)


@case("tab-transformer", "tab_transformer_pytorch", "TabTransformer, binary cross-entropy")
def _tab_transformer() -> Example:
    from tab_transformer_pytorch import TabTransformer

    torch.manual_seed(0)
    model = TabTransformer(
        categories=(5, 4, 3), num_continuous=4, dim=16, depth=2, heads=2, dim_head=8, dim_out=1,
        mlp_hidden_mults=(2,), mlp_act=nn.ReLU(), attn_dropout=0.0, ff_dropout=0.0,
    )  # fmt: skip
    y = torch.rand(BATCH, generator=_gen(12), dtype=torch.float64).round()

    def bce(logits: Tensor, y: Tensor) -> Tensor:
        return F.binary_cross_entropy_with_logits(logits.squeeze(-1), y, reduction="none")

    return Example(model, _tabular(), bce, (y,), "mean")


@case("tab-ft-transformer", "tab_transformer_pytorch", "FTTransformer, a classifier")
def _tab_ft_transformer() -> Example:
    from tab_transformer_pytorch import FTTransformer

    torch.manual_seed(0)
    model = FTTransformer(
        categories=(5, 4, 3), num_continuous=4, dim=16, depth=2, heads=2, dim_head=8,
        dim_out=CLASSES, attn_dropout=0.0, ff_dropout=0.0,
    )  # fmt: skip
    return Example(model, _tabular(), class_ce, (_labels(),), "mean")


@case("rtdl-mlp", "rtdl_revisiting_models", "MLP, a regression")
def _rtdl_mlp() -> Example:
    from rtdl_revisiting_models import MLP

    torch.manual_seed(0)
    model = MLP(d_in=6, d_out=1, n_blocks=2, d_block=16, dropout=0.0)
    return Example(model, (_randn(BATCH, 6),), mse, (_randn(BATCH, 1, seed=1),), "mean")


@case("rtdl-resnet", "rtdl_revisiting_models", "ResNet (BatchNorm1d in training mode)")
def _rtdl_resnet() -> Example:
    from rtdl_revisiting_models import ResNet

    torch.manual_seed(0)
    model = ResNet(
        d_in=6, d_out=CLASSES, n_blocks=2, d_block=16, d_hidden=None, d_hidden_multiplier=2.0,
        dropout1=0.0, dropout2=0.0,
    )  # fmt: skip
    return Example(model, (_randn(BATCH, 6),), class_ce, (_labels(),), "mean")


def _rtdl_ft(**backbone) -> Example:
    from rtdl_revisiting_models import FTTransformer

    torch.manual_seed(0)
    kw = FTTransformer.get_default_kwargs(n_blocks=1)
    kw.update(d_block=16, attention_n_heads=2, attention_dropout=0.0, ffn_dropout=0.0,
              residual_dropout=0.0, d_out=CLASSES, **backbone)  # fmt: skip
    model = FTTransformer(n_cont_features=4, cat_cardinalities=[5, 4, 3], **kw)
    cat, cont = _tabular()
    return Example(model, (cont, cat), class_ce, (_labels(),), "mean")


case("rtdl-ft-transformer", "rtdl_revisiting_models", "FTTransformer, categorical and numeric")(
    _rtdl_ft
)
case("rtdl-ft-linformer", "rtdl_revisiting_models", "FTTransformer, Linformer key compression")(
    lambda: _rtdl_ft(
        linformer_kv_compression_ratio=0.5, linformer_kv_compression_sharing="headwise"
    )
)


@case("tabnet", "pytorch_tabnet", "TabNet network, sparsemax masks (ghost BatchNorm)")
def _tabnet() -> Example:
    from pytorch_tabnet.tab_network import TabNet

    torch.manual_seed(0)
    model = TabNet(input_dim=6, output_dim=CLASSES, n_d=4, n_a=4, n_steps=2, virtual_batch_size=4,
                   group_attention_matrix=torch.eye(6, dtype=torch.float64))  # fmt: skip
    return Example(model, (_randn(BATCH, 6),), class_ce, (_labels(),), "mean")


# -- sequence models: linformer, nystrom-attention, reformer-pytorch, g-mlp-pytorch, conformer,
#    mambapy, CoCa-pytorch --------------------------------------------------------------------


@case("linformer-lm", "linformer", "LinformerLM: keys and values projected along the sequence")
def _linformer() -> Example:
    from linformer import LinformerLM

    torch.manual_seed(0)
    model = LinformerLM(num_tokens=VOCAB, dim=DIM, seq_len=SEQ, depth=2, k=4, heads=4)
    return Example(model, (_tokens(),), token_ce, (_tokens(seed=1),))


@case("linformer-shared-kv", "linformer", "one key-value head, the projection shared")
def _linformer_shared() -> Example:
    from linformer import LinformerLM

    torch.manual_seed(0)
    model = LinformerLM(num_tokens=VOCAB, dim=DIM, seq_len=SEQ, depth=2, k=4, heads=4,
                        one_kv_head=True, share_kv=True)  # fmt: skip
    return Example(model, (_tokens(),), token_ce, (_tokens(seed=1),))


class SequenceClassifier(nn.Module):
    """An encoder of ``[batch, seq, dim]`` features, mean-pooled, then a linear head."""

    def __init__(self, encoder: nn.Module, dim: int = DIM, classes: int = CLASSES):
        super().__init__()
        self.proj, self.encoder, self.head = nn.Linear(4, dim), encoder, nn.Linear(dim, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.encoder(self.proj(x)).mean(1))


@case("nystromformer", "nystrom_attention", "Nystromformer: landmarks, an iterative pseudo-inverse")
def _nystrom() -> Example:
    from nystrom_attention import Nystromformer

    torch.manual_seed(0)
    encoder = Nystromformer(dim=DIM, depth=2, dim_head=8, heads=4, num_landmarks=4,
                            attn_values_residual_conv_kernel=3)  # fmt: skip
    model = SequenceClassifier(encoder)
    return Example(model, (_randn(BATCH, SEQ, 4),), class_ce, (_labels(),), "mean")


@case("reformer-lm", "reformer_pytorch", "ReformerLM: LSH attention, reversible layers")
def _reformer() -> Example:
    from reformer_pytorch import ReformerLM

    torch.manual_seed(0)
    model = ReformerLM(num_tokens=VOCAB, dim=DIM, depth=2, max_seq_len=SEQ, heads=2, dim_head=8,
                       bucket_size=2, n_hashes=2, causal=True)  # fmt: skip

    def call(m, ids):  # the hashes' random rotations drawn the same for the loop and the batch
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return m(ids)

    return Example(model, (_tokens(),), token_ce, (_tokens(seed=1),), call=call)


@case("gmlp-lm", "g_mlp_pytorch", "gMLP: spatial gating (a weight across positions), causal")
def _gmlp() -> Example:
    from g_mlp_pytorch import gMLP

    torch.manual_seed(0)
    model = gMLP(num_tokens=VOCAB, dim=DIM, depth=2, seq_len=SEQ, causal=True, attn_dim=8)
    return Example(model, (_tokens(),), token_ce, (_tokens(seed=1),))


@case("gmlp-circulant", "g_mlp_pytorch", "gMLP, spatial weights of a circulant matrix, 2 heads")
def _gmlp_circulant() -> Example:
    from g_mlp_pytorch import gMLP

    torch.manual_seed(0)
    model = gMLP(num_tokens=VOCAB, dim=DIM, depth=2, seq_len=SEQ, heads=2, circulant_matrix=True)
    return Example(model, (_tokens(),), token_ce, (_tokens(seed=1),))


class TokenHead(nn.Module):
    """``[batch, seq, dim]`` features to token logits."""

    def __init__(self, encoder: nn.Module, dim: int = DIM):
        super().__init__()
        self.proj, self.encoder, self.head = nn.Linear(4, dim), encoder, nn.Linear(dim, VOCAB)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.encoder(self.proj(x)))


def _conformer(causal: bool) -> Example:
    from conformer import Conformer

    torch.manual_seed(0)
    encoder = Conformer(dim=DIM, depth=2, dim_head=8, heads=4, ff_mult=2, conv_kernel_size=3,
                        conv_causal=causal)  # fmt: skip
    return Example(TokenHead(encoder), (_randn(BATCH, SEQ, 4),), token_ce, (_tokens(seed=1),))


case("conformer", "conformer", "Conformer (BatchNorm1d in its convolution module)")(
    lambda: _conformer(False)
)
case("conformer-causal", "conformer", "Conformer, causal depthwise convolutions (no BatchNorm)")(
    lambda: _conformer(True)
)


class MambaLM(nn.Module):
    """mambapy's ``LM`` (whose module imports the CUDA ``mamba_ssm``, for Mamba-2): token
    embeddings, ``Mamba``, an ``RMSNorm``, the head tied to the embeddings."""

    def __init__(self, config):
        from mambapy.mamba import Mamba, RMSNorm

        super().__init__()
        self.embedding = nn.Embedding(VOCAB, config.d_model)
        self.mamba = Mamba(config)
        self.norm_f = RMSNorm(config.d_model, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.d_model, VOCAB, bias=False)
        self.lm_head.weight = self.embedding.weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.lm_head(self.norm_f(self.mamba(self.embedding(ids))))


def _mamba(pscan: bool) -> Example:
    from mambapy.mamba import MambaConfig

    torch.manual_seed(0)
    config = MambaConfig(d_model=16, n_layers=2, d_state=4, expand_factor=2, d_conv=3, pscan=pscan)
    return Example(MambaLM(config), (_tokens(),), token_ce, (_tokens(seed=1),))


case("mamba-pscan", "mambapy", "Mamba LM, its parallel scan (an autograd Function)")(
    lambda: _mamba(True)
)
case("mamba-sequential", "mambapy", "Mamba LM, the sequential selective scan")(
    lambda: _mamba(False)
)


@case("coca-captions", "coca_pytorch", "CoCa, the captioning loss on given image tokens")
def _coca() -> Example:
    from coca_pytorch import CoCa

    torch.manual_seed(0)
    model = CoCa(dim=DIM, num_tokens=VOCAB, unimodal_depth=1, multimodal_depth=1, image_dim=16,
                 num_img_queries=4, dim_head=8, heads=4, ff_mult=2)  # fmt: skip
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=_gen(0))
    ids[1, -2:] = 0  # (padding, its pad_id)

    def call(m, text, image_tokens):
        return m(text, image_tokens=image_tokens)

    def caption_ce(logits: Tensor, labels: Tensor) -> Tensor:
        ce = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=0, reduction="none")
        return ce.sum(1)

    labels = torch.randint(1, VOCAB, (BATCH, SEQ), generator=_gen(1))
    return Example(model, (ids, _randn(BATCH, 6, 16, seed=2)), caption_ce, (labels,), call=call)


def _axial_image(reversible: bool) -> Example:
    """AxialImageTransformer with a 1x1 convolution head, its layers reversible or not."""
    from axial_attention import AxialImageTransformer

    torch.manual_seed(0)
    encoder = AxialImageTransformer(dim=8, depth=2, heads=2, reversible=reversible,
                                    axial_pos_emb_shape=(6, 6))  # fmt: skip
    model = nn.Sequential(encoder, nn.Conv2d(8, 3, 1))
    x = _randn(BATCH, 8, 6, 6)
    return Example(model, (x,), mse, (_randn(BATCH, 3, 6, 6, seed=1),), "mean")


@case("axial-image-transformer", "axial_attention", "AxialImageTransformer, reversible layers")
def _axial() -> Example:
    return _axial_image(reversible=True)


@case("axial-image-transformer-plain", "axial_attention", "AxialImageTransformer, reversible=False")
def _axial_plain() -> Example:
    return _axial_image(reversible=False)


@case("axial-attention", "axial_attention", "AxialAttention on channels-last images")
def _axial_attention() -> Example:
    from axial_attention import AxialAttention, AxialPositionalEmbedding

    torch.manual_seed(0)
    model = nn.Sequential(
        AxialPositionalEmbedding(dim=8, shape=(6, 6), emb_dim_index=3),
        AxialAttention(dim=8, dim_index=3, heads=2, num_dimensions=2),
        nn.Linear(8, 3),
    )
    x = _randn(BATCH, 6, 6, 8)
    return Example(model, (x,), mse, (_randn(BATCH, 6, 6, 3, seed=1),), "mean")


@case("enformer", "enformer_pytorch", "Enformer, tiny: convolution tower (BatchNorm1d), Poisson")
def _enformer() -> Example:
    from enformer_pytorch import Enformer

    torch.manual_seed(0)
    model = Enformer.from_hparams(dim=24, depth=1, heads=2, output_heads={"human": 3},
                                  target_length=4, attn_dim_key=4, dropout_rate=0.0,
                                  attn_dropout=0.0, pos_dropout=0.0, num_downsamples=3,
                                  dim_divisible_by=4)  # fmt: skip
    seq = F.one_hot(torch.randint(0, 4, (BATCH, 64), generator=_gen(0)), 4).double()
    target = torch.rand(BATCH, 4, 3, generator=_gen(1), dtype=torch.float64)

    def poisson(pred: Tensor, target: Tensor) -> Tensor:
        return (
            F.poisson_nll_loss(pred, target, log_input=False, reduction="none").flatten(1).mean(1)
        )

    return Example(model, (seq,), poisson, (target,), "mean", call=lambda m, s: m(s, head="human"))


# -- implicit and continuous-depth models: siren-pytorch, pykan, zuko, torchdiffeq, torchcde -----


@case("siren", "siren_pytorch", "SirenNet: sine layers of their own weights, coordinates to RGB")
def _siren() -> Example:
    from siren_pytorch import SirenNet

    torch.manual_seed(0)
    model = SirenNet(dim_in=2, dim_hidden=16, dim_out=3, num_layers=3, w0_initial=30.0)
    coords = _randn(BATCH, 10, 2)
    return Example(model, (coords,), mse, (_randn(BATCH, 10, 3, seed=1),), "mean")


@case("kan", "kan", "pykan KAN: B-spline activations on every edge")
def _kan() -> Example:
    import os
    import tempfile

    from kan import KAN

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        here = os.getcwd()
        os.chdir(folder)  # (it may write a checkpoint folder where it is made)
        try:
            model = KAN(width=[4, 5, CLASSES], grid=3, k=3, seed=0, auto_save=False)
        finally:
            os.chdir(here)
    return Example(model, (_randn(BATCH, 4),), class_ce, (_labels(),), "mean")


def _flow(kind: str) -> Example:
    import zuko

    torch.manual_seed(0)
    flow = getattr(zuko.flows, kind)(features=3, context=2, transforms=2, hidden_features=[16, 16])
    x, c = _randn(BATCH, 3), _randn(BATCH, 2, seed=1)
    return Example(flow, (x, c), lambda log_p: -log_p, (), "mean",
                   call=lambda m, x, c: m(c).log_prob(x))  # fmt: skip


case("zuko-maf", "zuko", "MAF: masked autoregressive layers, conditional, negative log-likelihood")(
    lambda: _flow("MAF")
)
case("zuko-nsf", "zuko", "NSF: rational-quadratic splines, conditional, negative log-likelihood")(
    lambda: _flow("NSF")
)


class ODEFunc(nn.Module):
    def __init__(self, dim: int = 4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, 16), nn.Tanh(), nn.Linear(16, dim))

    def forward(self, t: Tensor, y: Tensor) -> Tensor:
        return self.net(y)


class NeuralODE(nn.Module):
    """``torchdiffeq.odeint`` of a small network from ``t=0`` to ``1``, then a linear head."""

    def __init__(self, adjoint: bool = False, **solver):
        super().__init__()
        self.func, self.head = ODEFunc(), nn.Linear(4, 2)
        self.solver, self.adjoint = solver, adjoint

    def forward(self, y0: Tensor) -> Tensor:
        import torchdiffeq

        t = torch.tensor([0.0, 1.0], dtype=y0.dtype)
        solve = torchdiffeq.odeint_adjoint if self.adjoint else torchdiffeq.odeint
        return self.head(solve(self.func, y0, t, **self.solver)[-1])


def _ode(**solver) -> Example:
    torch.manual_seed(0)
    model = NeuralODE(**solver)
    return Example(model, (_randn(BATCH, 4),), mse, (_randn(BATCH, 2, seed=1),), "mean")


RK4 = {"method": "rk4", "options": {"step_size": 0.25}}
case("neural-ode-rk4", "torchdiffeq", "odeint, fixed steps (rk4, step 0.25)")(lambda: _ode(**RK4))
case("neural-ode-dopri5", "torchdiffeq", "odeint, adaptive steps (dopri5) chosen for the batch")(
    lambda: _ode(method="dopri5", rtol=1e-6, atol=1e-8)
)
case("neural-ode-adjoint", "torchdiffeq", "odeint_adjoint, fixed steps (rk4)")(
    lambda: _ode(adjoint=True, **RK4)
)


class CDEField(nn.Module):
    """A neural CDE's vector field: ``[..., hidden]`` to ``[..., hidden, channels]``."""

    def __init__(self, hidden: int, channels: int):
        super().__init__()
        self.hidden = hidden
        self.net = nn.Sequential(nn.Linear(hidden, 16), nn.ReLU(), nn.Linear(16, hidden * channels))

    def forward(self, t: Tensor, z: Tensor) -> Tensor:
        return self.net(z).tanh().view(*z.shape[:-1], self.hidden, -1)


class NeuralCDE(nn.Module):
    """torchcde's README model: ``z0`` from the path's first value, ``cdeint`` of a vector
    field over a cubic spline of the series (its coefficients, the input), a linear readout."""

    def __init__(self, adjoint: bool, channels: int = 3, hidden: int = 8, classes: int = CLASSES):
        super().__init__()
        self.adjoint = adjoint
        self.initial = nn.Linear(channels, hidden)
        self.field = CDEField(hidden, channels)
        self.readout = nn.Linear(hidden, classes)

    def forward(self, coeffs: Tensor) -> Tensor:
        import torchcde

        X = torchcde.CubicSpline(coeffs)
        z0 = self.initial(X.evaluate(X.interval[0]))
        z = torchcde.cdeint(X=X, func=self.field, z0=z0, t=X.interval, adjoint=self.adjoint, **RK4)
        return self.readout(z[:, -1])


def _neural_cde(adjoint: bool) -> Example:
    import torchcde

    torch.manual_seed(0)
    t = torch.linspace(0, 1, 5, dtype=torch.float64)
    series = torch.cat([t.expand(BATCH, 5)[..., None], _randn(BATCH, 5, 2)], -1)
    coeffs = torchcde.hermite_cubic_coefficients_with_backward_differences(series)
    return Example(NeuralCDE(adjoint), (coeffs,), class_ce, (_labels(),), "mean")


case(
    "neural-cde", "torchcde", "cdeint over a cubic spline of a series, rk4, adjoint (its default)"
)(lambda: _neural_cde(True))
case("neural-cde-direct", "torchcde", "cdeint, rk4, backpropagated through the solver")(
    lambda: _neural_cde(False)
)


# -- vector-quantize-pytorch: VQ-VAE bottlenecks -------------------------------------------------


class VQAutoencoder(nn.Module):
    """A VQ-VAE on sequences of feature vectors: an encoder, a quantizer of
    ``vector_quantize_pytorch``, a decoder. Its users' loss, which it returns: the
    reconstruction error plus the commitment loss(es) the quantizer returns, each a mean over
    the batch. An EMA codebook is updated in the forward; each forward here starts from the
    codebook as built, so that the loop's batches of one and the batch quantize alike."""

    def __init__(self, quantizer: nn.Module, dim: int = 8):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, dim))
        self.quantizer = quantizer
        self.decoder = nn.Sequential(nn.Linear(dim, 16), nn.GELU(), nn.Linear(16, 4))
        self.initial: list[Tensor] | None = None

    def forward(self, x: Tensor) -> Tensor:
        buffers = list(self.quantizer.buffers())
        with torch.no_grad():
            if self.initial is None:
                self.initial = [b.clone() for b in buffers]
            for b, kept in zip(buffers, self.initial):
                b.copy_(kept)
        quantized, *rest = self.quantizer(self.encoder(x))
        commit = rest[1] if len(rest) > 1 else torch.zeros(())  # (FSQ: no loss of its own)
        return F.mse_loss(self.decoder(quantized), x) + commit.sum()


def _vq(quantizer: Callable[[], nn.Module]) -> Example:
    torch.manual_seed(0)
    model = VQAutoencoder(quantizer())
    return Example(model, (_randn(BATCH, SEQ, 4),), lambda loss: loss, (), "mean", batch_loss=True)


def _vector_quantize(**kw):
    from vector_quantize_pytorch import VectorQuantize

    return VectorQuantize(dim=8, codebook_size=16, commitment_weight=0.25, **kw)


def _residual_vq():
    from vector_quantize_pytorch import ResidualVQ

    return ResidualVQ(dim=8, num_quantizers=2, codebook_size=16, commitment_weight=0.25)


def _fsq():
    from vector_quantize_pytorch import FSQ

    return FSQ(levels=[5, 5, 3], dim=8)


case("vq-vae-ema", "vector_quantize_pytorch", "VectorQuantize, EMA codebook, commitment loss")(
    lambda: _vq(_vector_quantize)
)
case(
    "vq-vae-learnable", "vector_quantize_pytorch", "VectorQuantize, a codebook learned by gradient"
)(lambda: _vq(lambda: _vector_quantize(learnable_codebook=True, ema_update=False)))
case("vq-vae-cosine", "vector_quantize_pytorch", "VectorQuantize, cosine similarity, EMA")(
    lambda: _vq(lambda: _vector_quantize(use_cosine_sim=True))
)
case("residual-vq", "vector_quantize_pytorch", "ResidualVQ, 2 quantizers, EMA codebooks")(
    lambda: _vq(_residual_vq)
)
case("fsq", "vector_quantize_pytorch", "FSQ: finite scalar quantization, straight-through")(
    lambda: _vq(_fsq)
)


# -- routing-transformer, nflows, e3nn ----------------------------------------------------------


@case("routing-lm", "routing_transformer", "RoutingTransformerLM: k-means routed attention")
def _routing() -> Example:
    """Its k-means centroids are set from the first batch it sees and moved by the user's
    ``update_kmeans()`` after a backward (not by a backward hook here: the loop's backwards
    would move them between examples); its commitment loss, a mean over the batch, is left
    out."""
    from routing_transformer import RoutingTransformerLM

    torch.manual_seed(0)
    model = RoutingTransformerLM(num_tokens=VOCAB, dim=DIM, depth=2, max_seq_len=SEQ, heads=4,
                                 dim_head=8, window_size=4, causal=True, n_local_attn_heads=2,
                                 _register_kmeans_update=False)  # fmt: skip
    return Example(model, (_tokens(),), token_ce, (_tokens(seed=1),))


@case("nflows-maf", "nflows", "MaskedAutoregressiveFlow, negative log-likelihood")
def _nflows() -> Example:
    from nflows.flows import MaskedAutoregressiveFlow

    torch.manual_seed(0)
    flow = MaskedAutoregressiveFlow(features=3, hidden_features=16, num_layers=2,
                                    num_blocks_per_layer=1)  # fmt: skip
    return Example(flow, (_randn(BATCH, 3),), lambda log_p: -log_p, (), "mean",
                   call=lambda m, x: m.log_prob(x))  # fmt: skip


class EquivariantNet(nn.Module):
    """An e3nn message from each point's neighbours: spherical harmonics of the relative
    positions, a fully connected tensor product with the features, summed over the points,
    an equivariant linear map to scalars; a point cloud per example."""

    def __init__(self):
        from e3nn import o3

        super().__init__()
        self.irreps_sh = o3.Irreps.spherical_harmonics(2)
        self.tp = o3.FullyConnectedTensorProduct("4x0e + 2x1o", self.irreps_sh, "8x0e + 4x1o")
        self.out = o3.Linear("8x0e + 4x1o", "1x0e")

    def forward(self, features: Tensor, positions: Tensor) -> Tensor:
        from e3nn import o3

        rel = positions[:, :, None] - positions[:, None, :]  # [batch, n, n, 3]
        sh = o3.spherical_harmonics(self.irreps_sh, rel, normalize=True, normalization="component")
        n = features.shape[1]
        messages = self.tp(features[:, None].expand(-1, n, -1, -1), sh)
        return self.out(messages.sum(2)).sum(1)  # [batch, 1]


@case("e3nn-tensor-product", "e3nn", "o3.FullyConnectedTensorProduct and o3.Linear (codegen)")
def _e3nn() -> Example:
    torch.manual_seed(0)
    model = EquivariantNet()
    features, positions = _randn(BATCH, 5, 10), _randn(BATCH, 5, 3, seed=1)
    return Example(model, (features, positions), mse, (_randn(BATCH, 1, seed=2),), "mean")


# -- medical and segmentation networks: monai, segmentation-models-pytorch -----------------------


def pixel_ce(logits: Tensor, labels: Tensor) -> Tensor:
    """Each image's mean cross-entropy over its pixels, ``[batch]``."""
    return F.cross_entropy(logits, labels, reduction="none").flatten(1).mean(1)


def _segmentation(model: nn.Module, channels: int = 1, side: int = 16) -> Example:
    x = _randn(BATCH, channels, side, side)
    labels = torch.randint(0, 2, (BATCH, side, side), generator=_gen(1))
    return Example(model, (x,), pixel_ce, (labels,), "mean")


@case("monai-unet", "monai", "UNet, residual units, InstanceNorm, segmentation")
def _monai_unet() -> Example:
    from monai.networks.nets import UNet

    torch.manual_seed(0)
    model = UNet(spatial_dims=2, in_channels=1, out_channels=2, channels=(4, 8, 16),
                 strides=(2, 2), num_res_units=1)  # fmt: skip
    return _segmentation(model)


@case("monai-basic-unet", "monai", "BasicUNet (InstanceNorm, LeakyReLU)")
def _monai_basic_unet() -> Example:
    from monai.networks.nets import BasicUNet

    torch.manual_seed(0)
    model = BasicUNet(spatial_dims=2, in_channels=1, out_channels=2, features=(4, 4, 8, 8, 16, 4))
    return _segmentation(model, side=32)  # (InstanceNorm needs 2 pixels at the bottom)


@case("monai-segresnet", "monai", "SegResNet (GroupNorm)")
def _monai_segresnet() -> Example:
    from monai.networks.nets import SegResNet

    torch.manual_seed(0)
    model = SegResNet(spatial_dims=2, init_filters=8, in_channels=1, out_channels=2,
                      blocks_down=(1, 1), blocks_up=(1,), norm=("group", {"num_groups": 4}))  # fmt: skip
    return _segmentation(model)


@case("monai-unetr", "monai", "UNETR: a ViT encoder, a convolutional decoder")
def _monai_unetr() -> Example:
    from monai.networks.nets import UNETR

    torch.manual_seed(0)
    model = UNETR(in_channels=1, out_channels=2, img_size=(16, 16), feature_size=4,
                  hidden_size=DIM, mlp_dim=64, num_heads=4, spatial_dims=2)  # fmt: skip
    return _segmentation(model)


@case("monai-swin-unetr", "monai", "SwinUNETR: shifted windows, relative position bias")
def _monai_swin_unetr() -> Example:
    from monai.networks.nets import SwinUNETR

    torch.manual_seed(0)
    model = SwinUNETR(in_channels=1, out_channels=2, feature_size=12, depths=(1, 1, 1, 1),
                      num_heads=(1, 1, 2, 2), spatial_dims=2, window_size=4,
                      use_v2=True)  # fmt: skip
    return _segmentation(model, side=64)


@case("monai-densenet", "monai", "DenseNet121-like classifier (BatchNorm)")
def _monai_densenet() -> Example:
    from monai.networks.nets import DenseNet

    torch.manual_seed(0)
    model = DenseNet(spatial_dims=2, in_channels=1, out_channels=CLASSES, init_features=8,
                     growth_rate=4, block_config=(2, 2), bn_size=2)  # fmt: skip
    return Example(model, (_randn(BATCH, 1, 16, 16),), class_ce, (_labels(),), "mean")


def _smp(arch: str, **kw) -> Example:
    import segmentation_models_pytorch as smp

    torch.manual_seed(0)
    model = getattr(smp, arch)(encoder_weights=None, in_channels=1, classes=2, **kw)
    for m in model.modules():  # (the mit encoders' stochastic depth, as dropout: off)
        if isinstance(getattr(m, "drop_prob", None), float):
            m.drop_prob = 0.0
    return _segmentation(model, side=32)


case("smp-unet-resnet", "segmentation_models_pytorch", "Unet, resnet18 encoder (BatchNorm)")(
    lambda: _smp("Unet", encoder_name="resnet18", encoder_depth=3, decoder_channels=(16, 8, 4))
)


@case("smp-unet-resnet-gn", "segmentation_models_pytorch",
      "Unet, resnet18 encoder, its BatchNorm made GroupNorm by Opacus' ModuleValidator.fix")  # fmt: skip
def _smp_group_norm() -> Example:
    from opacus.validators import ModuleValidator

    ex = _smp("Unet", encoder_name="resnet18", encoder_depth=3, decoder_channels=(16, 8, 4))
    ex.model = ModuleValidator.fix(ex.model)
    return ex


# -- diffusion and flows: denoising-diffusion-pytorch, normflows ---------------------------------


class Float64(nn.Module):
    """``x.double()``, as a module."""

    def forward(self, x: Tensor) -> Tensor:
        return x.double()


def _gaussian_diffusion(one_d: bool) -> Example:
    """lucidrains' ``GaussianDiffusion.p_losses`` at a given timestep and noise per example (its
    forward draws them): the mean, over the batch, of each example's weighted mean squared
    error."""
    import denoising_diffusion_pytorch as ddp

    torch.manual_seed(0)
    if one_d:
        unet = ddp.Unet1D(dim=8, dim_mults=(1, 2), channels=2)
        diffusion = ddp.GaussianDiffusion1D(unet, seq_length=16, timesteps=100)
        shape = (BATCH, 2, 16)
    else:
        unet = ddp.Unet(dim=8, dim_mults=(1, 2), channels=3, flash_attn=False)
        diffusion = ddp.GaussianDiffusion(unet, image_size=IMG, timesteps=100)
        shape = (BATCH, 3, IMG, IMG)
    # its sinusoidal time embedding is float32 whatever the model's dtype: made float64 here
    unet.time_mlp = nn.Sequential(unet.time_mlp[0], Float64(), *unet.time_mlp[1:])
    g = _gen(3)
    clean = torch.randn(*shape, generator=g, dtype=torch.float64)
    noise = torch.randn(*shape, generator=g, dtype=torch.float64)
    t = torch.randint(0, 100, (BATCH,), generator=g)
    return Example(diffusion, (clean, t, noise), lambda loss: loss, (), "mean", batch_loss=True,
                   call=lambda m, x, t, n: m.p_losses(x, t, noise=n))  # fmt: skip


case("ddpm-unet", "denoising_diffusion_pytorch", "GaussianDiffusion of a Unet, p_losses")(
    lambda: _gaussian_diffusion(False)
)
case("ddpm-unet1d", "denoising_diffusion_pytorch", "GaussianDiffusion1D of a Unet1D, p_losses")(
    lambda: _gaussian_diffusion(True)
)


class FlowNLL(nn.Module):
    """A flow's negative log-likelihood as a module's forward (what gradhooks' warning asks
    for where the flow's ``log_prob`` is called directly)."""

    def __init__(self, flow: nn.Module):
        super().__init__()
        self.flow = flow

    def forward(self, x: Tensor) -> Tensor:
        return -self.flow.log_prob(x)


def _normflow(kind: str, module: bool = False) -> Example:
    """normflows' RealNVP (masked affine couplings and ActNorm) or neural spline flow, its
    negative log-likelihood by ``log_prob``, called as its users call it, or (``module``)
    from a module's forward."""
    import normflows as nf

    torch.manual_seed(0)
    flows = []
    for i in range(2):
        if kind == "realnvp":
            mask = torch.tensor([(i + j) % 2 for j in range(4)], dtype=torch.float64)
            scale = nf.nets.MLP([4, 16, 4], init_zeros=True)
            shift = nf.nets.MLP([4, 16, 4], init_zeros=True)
            flows += [nf.flows.MaskedAffineFlow(mask, shift, scale), nf.flows.ActNorm(4)]
        else:
            flows += [nf.flows.AutoregressiveRationalQuadraticSpline(4, 1, 16),
                      nf.flows.LULinearPermute(4)]  # fmt: skip
    model = nf.NormalizingFlow(nf.distributions.DiagGaussian(4), flows)
    if module:
        return Example(FlowNLL(model), (_randn(BATCH, 4),), lambda nll: nll, (), "mean")
    return Example(model, (_randn(BATCH, 4),), lambda log_p: -log_p, (), "mean",
                   call=lambda m, x: m.log_prob(x))  # fmt: skip


case("normflows-realnvp", "normflows", "RealNVP: masked affine couplings, ActNorm; log_prob")(
    lambda: _normflow("realnvp")
)
case("normflows-realnvp-module", "normflows", "the same, log_prob in a module's forward")(
    lambda: _normflow("realnvp", module=True)
)
case("normflows-nsf", "normflows", "autoregressive rational-quadratic splines, LU permutations")(
    lambda: _normflow("nsf")
)


# -- spiking and liquid networks: snntorch, ncps --------------------------------------------------


class SpikingNet(nn.Module):
    """snntorch's tutorial network: Linear, a Leaky neuron with a learned decay and threshold
    (or a Synaptic one, with learned decays), Linear, a Leaky output neuron, stepped over time;
    the output's spike counts and membrane potentials summed over the steps as logits. The
    spikes come out in float32 (its surrogate's ``.float()``): cast back to the input's."""

    def __init__(self, synaptic: bool = False, steps: int = 6):
        import snntorch as snn
        from snntorch import surrogate

        super().__init__()
        self.steps = steps
        grad = surrogate.fast_sigmoid(slope=25)
        self.fc1, self.fc2 = nn.Linear(4, 16), nn.Linear(16, CLASSES)
        if synaptic:
            self.lif1 = snn.Synaptic(alpha=0.8, beta=0.9, spike_grad=grad, learn_alpha=True,
                                     learn_beta=True)  # fmt: skip
        else:
            self.lif1 = snn.Leaky(beta=0.9, spike_grad=grad, learn_beta=True,
                                  learn_threshold=True)  # fmt: skip
        self.lif2 = snn.Leaky(beta=0.8, spike_grad=grad, learn_beta=True)
        self.synaptic = synaptic

    def forward(self, x: Tensor) -> Tensor:
        if self.synaptic:
            syn1, mem1 = self.lif1.init_synaptic()
        else:
            mem1 = self.lif1.init_leaky()
        mem2, total = self.lif2.init_leaky(), 0
        for _ in range(self.steps):
            if self.synaptic:
                spk1, syn1, mem1 = self.lif1(self.fc1(x), syn1, mem1)
            else:
                spk1, mem1 = self.lif1(self.fc1(x), mem1)
            spk2, mem2 = self.lif2(self.fc2(spk1.to(x.dtype)), mem2)  # (spikes: float32)
            # (the membrane too: a gradient where no spike comes)
            total = total + spk2.to(x.dtype) + mem2
        return total


case("snn-leaky", "snntorch", "Leaky neurons, learned decay and threshold, surrogate gradient")(
    lambda: _snn(False)
)
case("snn-synaptic", "snntorch", "Synaptic neurons: learned synaptic and membrane decays")(
    lambda: _snn(True)
)


def _snn(synaptic: bool) -> Example:
    torch.manual_seed(0)
    x = _randn(BATCH, 4) * 2
    return Example(SpikingNet(synaptic), (x,), class_ce, (_labels(),), "mean")


class LiquidRegressor(nn.Module):
    """An ncps sequence model (``CfC`` or ``LTC``) on ``[batch, time, features]``, its last
    output regressed."""

    def __init__(self, kind: str):
        from ncps.torch import LTC, CfC
        from ncps.wirings import AutoNCP

        super().__init__()
        if kind == "ltc":
            self.rnn = LTC(3, AutoNCP(8, 2, seed=0), ode_unfolds=3)
        else:
            self.rnn = CfC(3, 8, proj_size=2, mode=kind)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.rnn(x)
        return out[:, -1]


def _liquid(kind: str) -> Example:
    torch.manual_seed(0)
    return Example(LiquidRegressor(kind), (_randn(BATCH, 5, 3),), mse,
                   (_randn(BATCH, 2, seed=1),), "mean")  # fmt: skip


case("ncps-cfc", "ncps", "CfC: closed-form continuous-time cells")(lambda: _liquid("default"))
case("ncps-ltc", "ncps", "LTC: liquid time-constant cells, an NCP wiring")(lambda: _liquid("ltc"))


# -- graphs and point clouds: torch_geometric, egnn-pytorch --------------------------------------


class DenseGraphNet(nn.Module):
    """torch_geometric's dense layers on a batch of graphs padded to one size: node features
    ``[batch, nodes, features]``, adjacency ``[batch, nodes, nodes]``, a mask of real nodes;
    a masked mean over the nodes, a linear head."""

    def __init__(self, kind: str):
        import torch_geometric.nn as gnn

        super().__init__()
        if kind == "gcn":
            self.conv1, self.conv2 = gnn.DenseGCNConv(4, 16), gnn.DenseGCNConv(16, 16)
        else:
            self.conv1, self.conv2 = gnn.DenseSAGEConv(4, 16), gnn.DenseGraphConv(16, 16)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: Tensor, adj: Tensor, mask: Tensor) -> Tensor:
        x = self.conv1(x, adj, mask).relu()
        x = self.conv2(x, adj, mask).relu()
        pooled = (x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return self.head(pooled)


class SparseGraphNet(nn.Module):
    """torch_geometric's message passing as its users batch graphs: the graphs' nodes
    concatenated into one ``[nodes, features]`` table, their edges into one edge index, a
    ``batch`` vector naming each node's graph (``Batch.from_data_list``), ``global_mean_pool``
    per graph. Built here from the padded dense batch, so that a batch of one is a graph."""

    def __init__(self, kind: str):
        import torch_geometric.nn as gnn

        super().__init__()
        conv = {"gcn": gnn.GCNConv, "gat": lambda i, o: gnn.GATConv(i, o, heads=2, concat=False),
                "gin": lambda i, o: gnn.GINConv(nn.Sequential(nn.Linear(i, o), nn.ReLU(),
                                                              nn.Linear(o, o)))}[kind]  # fmt: skip
        self.conv1, self.conv2 = conv(4, 16), conv(16, 16)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: Tensor, adj: Tensor, mask: Tensor) -> Tensor:
        from torch_geometric.data import Batch, Data
        from torch_geometric.nn import global_mean_pool

        graphs = []
        for b in range(x.shape[0]):
            n = int(mask[b].sum())
            graphs.append(Data(x=x[b, :n], edge_index=adj[b, :n, :n].nonzero().t()))
        batch = Batch.from_data_list(graphs)
        h = self.conv1(batch.x, batch.edge_index).relu()
        h = self.conv2(h, batch.edge_index).relu()
        return self.head(global_mean_pool(h, batch.batch))


def _graphs() -> tuple[Tensor, Tensor, Tensor]:
    """A batch of 3 random undirected graphs of 5, 4 and 6 nodes, padded to 6."""
    nodes = 6
    x = _randn(BATCH, nodes, 4)
    upper = torch.rand(BATCH, nodes, nodes, generator=_gen(7)) < 0.5
    adj = (upper.triu(1) | upper.triu(1).transpose(1, 2)).double()
    mask = torch.zeros(BATCH, nodes, dtype=torch.bool)
    for b, n in enumerate((5, 4, 6)):
        mask[b, :n] = True
    adj = adj * mask[:, :, None] * mask[:, None, :]
    return x * mask[..., None], adj, mask


def _graph(model_cls, kind: str) -> Example:
    torch.manual_seed(0)
    return Example(model_cls(kind), _graphs(), class_ce, (_labels(),), "mean")


case("pyg-dense-gcn", "torch_geometric", "DenseGCNConv on a padded batch of graphs")(
    lambda: _graph(DenseGraphNet, "gcn")
)
case("pyg-dense-sage", "torch_geometric", "DenseSAGEConv, DenseGraphConv, padded graphs")(
    lambda: _graph(DenseGraphNet, "sage")
)
case("pyg-gcn", "torch_geometric", "GCNConv on graphs batched as one (Batch.from_data_list)")(
    lambda: _graph(SparseGraphNet, "gcn")
)
case("pyg-gat", "torch_geometric", "GATConv on graphs batched as one")(
    lambda: _graph(SparseGraphNet, "gat")
)
case("pyg-gin", "torch_geometric", "GINConv (an MLP per node) on graphs batched as one")(
    lambda: _graph(SparseGraphNet, "gin")
)


@case("egnn", "egnn_pytorch", "EGNN_Network: coordinates and features, E(n)-equivariant")
def _egnn() -> Example:
    from egnn_pytorch import EGNN_Network

    torch.manual_seed(0)
    net = EGNN_Network(num_tokens=10, dim=8, depth=2, num_nearest_neighbors=3, m_dim=8)
    feats = torch.randint(0, 10, (BATCH, 6), generator=_gen(0))
    coors = _randn(BATCH, 6, 3, seed=1)

    def call(m, feats, coors):
        h, x = m(feats, coors)
        return torch.cat([h.sum(1), x.flatten(1)], -1)

    target = _randn(BATCH, 8 + 18, seed=2)
    return Example(net, (feats, coors), mse, (target,), "mean", call=call)


# -- vision: kornia -------------------------------------------------------------------------------


@case("kornia-vit", "kornia", "kornia.models.VisionTransformer, a linear head on its class token")
def _kornia_vit() -> Example:
    from kornia.models.vit import VisionTransformer

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.vit = VisionTransformer(image_size=16, patch_size=4, embed_dim=DIM, depth=2,
                                         num_heads=4)  # fmt: skip
            self.head = nn.Linear(DIM, CLASSES)

        def forward(self, x):
            return self.head(self.vit(x)[:, 0])

    torch.manual_seed(0)
    return Example(Classifier(), (_randn(BATCH, 3, 16, 16),), class_ce, (_labels(),), "mean")


class SpatialTransformer(nn.Module):
    """A spatial transformer network: a small CNN predicts each image's affine transform,
    ``kornia.geometry.transform.warp_affine`` resamples the image with it, a CNN classifies."""

    def __init__(self):
        super().__init__()
        self.loc = nn.Sequential(nn.Conv2d(1, 4, 3, stride=2), nn.ReLU(), nn.Flatten(),
                                 nn.Linear(4 * 7 * 7, 6))  # fmt: skip
        with torch.no_grad():
            self.loc[-1].weight.mul_(0.1)
            self.loc[-1].bias.copy_(torch.tensor([1.0, 0, 0, 0, 1, 0]))
        self.cls = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Tanh(), nn.AdaptiveAvgPool2d(2),
                                 nn.Flatten(), nn.Linear(16, CLASSES))  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        from kornia.geometry.transform import warp_affine

        theta = self.loc(x).view(-1, 2, 3)
        return self.cls(warp_affine(x, theta, dsize=(16, 16), align_corners=True))


@case("kornia-stn", "kornia", "a spatial transformer: predicted affine warps (warp_affine)")
def _kornia_stn() -> Example:
    torch.manual_seed(0)
    return Example(SpatialTransformer(), (_randn(BATCH, 1, 16, 16),), class_ce, (_labels(),),
                   "mean")  # fmt: skip


# -- lucidrains' sequence models: soft-moe-pytorch, minGRU-pytorch, iTransformer; pytorch-tcn -----


@case("soft-moe", "soft_moe_pytorch", "SoftMoE: slots mixed from each sequence's tokens")
def _soft_moe() -> Example:
    from soft_moe_pytorch import SoftMoE

    class MoELM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.norm = nn.Embedding(VOCAB, DIM), nn.LayerNorm(DIM)
            self.moe = SoftMoE(dim=DIM, num_experts=4, num_slots=2)
            self.head = nn.Linear(DIM, VOCAB)

        def forward(self, ids):
            x = self.embed(ids)
            return self.head(self.norm(x + self.moe(x)))

    torch.manual_seed(0)
    return Example(MoELM(), (_tokens(),), token_ce, (_tokens(seed=1),))


def _min_lm(lstm: bool) -> Example:
    from minGRU_pytorch.minLM import minLM

    torch.manual_seed(0)
    model = minLM(num_tokens=VOCAB, dim=DIM, depth=2, use_lstm=lstm, enable_conv=True)
    return Example(model, (_tokens(),), token_ce, (_tokens(seed=1),))


case("mingru-lm", "minGRU_pytorch", "minLM of minGRU layers: a log-space parallel scan")(
    lambda: _min_lm(False)
)
case("minlstm-lm", "minGRU_pytorch", "minLM of minLSTM layers")(lambda: _min_lm(True))


@case("itransformer", "iTransformer", "iTransformer: variates as tokens, a forecast")
def _itransformer() -> Example:
    from iTransformer import iTransformer

    torch.manual_seed(0)
    model = iTransformer(num_variates=4, lookback_len=16, dim=DIM, depth=2, heads=4, dim_head=8,
                         pred_length=4, num_mem_tokens=2, num_residual_streams=1,
                         use_reversible_instance_norm=True, flash_attn=False)  # fmt: skip
    return Example(model, (_randn(BATCH, 16, 4),), mse, (_randn(BATCH, 4, 4, seed=1),), "mean",
                   call=lambda m, x: m(x)[4] if isinstance(m(x), dict) else m(x))  # fmt: skip


def _tcn(**kw) -> Example:
    from pytorch_tcn import TCN

    torch.manual_seed(0)
    model = TCN(num_inputs=3, num_channels=[8, 8], kernel_size=3, dropout=0.0,
                output_projection=2, **kw)  # fmt: skip
    return Example(model, (_randn(BATCH, 3, 12),), mse, (_randn(BATCH, 2, 12, seed=1),), "mean")


case("tcn", "pytorch_tcn", "TCN: causal dilated convolutions, weight_norm (its default)")(_tcn)
case("tcn-skip", "pytorch_tcn", "TCN, skip connections, layer norm, gated activations")(
    lambda: _tcn(use_norm="layer_norm", use_skip_connections=True, use_gate=True)
)


# -- memories and routers: product-key-memory, colt5-attention, gateloop-transformer ----------


class ResidualLM(nn.Module):
    """Token embeddings, ``x + layer(norm(x))``, a head: a language model around one layer."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.embed, self.norm, self.layer = nn.Embedding(VOCAB, DIM), nn.LayerNorm(DIM), layer
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids)
        return self.head(x + self.layer(self.norm(x)))


@case("pkm", "product_key_memory", "product-key memory: top-k keys, an EmbeddingBag of values")
def _pkm() -> Example:
    from product_key_memory import PKM

    torch.manual_seed(0)
    pkm = PKM(dim=DIM, heads=2, num_keys=8, topk=4, dim_head=8)
    return Example(ResidualLM(pkm), (_tokens(),), token_ce, (_tokens(seed=1),))


@case("colt5-routed-ff", "colt5_attention", "CoLT5's routed feedforward: coordinate descent")
def _colt5() -> Example:
    from colt5_attention import ConditionalRoutedFeedForward

    torch.manual_seed(0)
    ff = ConditionalRoutedFeedForward(dim=DIM, num_heavy_tokens=4, light_ff_mult=0.5,
                                      heavy_ff_mult=2)  # fmt: skip
    return Example(ResidualLM(ff), (_tokens(),), token_ce, (_tokens(seed=1),))


def _gateloop(checkpoint: bool) -> Example:
    from gateloop_transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(dim=DIM, num_tokens=VOCAB, depth=2, dim_head=8, heads=4,
                        checkpoint_gate_looped_attn=checkpoint)  # fmt: skip
    return Example(model, (_tokens(),), token_ce, (_tokens(seed=1),))


case("gateloop-lm", "gateloop_transformer", "GateLoop: a gated linear recurrence, a scan")(
    lambda: _gateloop(False)
)
case("gateloop-lm-checkpointed", "gateloop_transformer", "the same, its scan checkpointed")(
    lambda: _gateloop(True)
)


@case("x-mlps-nff", "x_mlps_pytorch", "nFeedforwards: weights l2-normalized by a parametrization")
def _nff() -> Example:
    from x_mlps_pytorch import nFeedforwards

    torch.manual_seed(0)
    model = nFeedforwards(dim=16, depth=2, dim_in=6, dim_out=CLASSES)
    return Example(model, (_randn(BATCH, 6),), class_ce, (_labels(),), "mean")


# -- the check ----------------------------------------------------------------------------------


# -- a wider round: lucidrains' Mega, PaLM, MEGABYTE, block-recurrent and hourglass transformers,
# lambda and halo attention, ResMLP; einops, entmax, geoopt, pytorch-metric-learning, pyro,
# gpytorch, torchdyn, torchsde, spikingjelly ----------------------------------------------------


@case(
    "mega-lm", "mega_pytorch", "Mega: multi-headed damped EMA (an FFT convolution), gated attention"
)
def _mega() -> Example:
    from mega_pytorch import Mega

    torch.manual_seed(0)
    model = Mega(num_tokens=VOCAB, dim=DIM, depth=2, ema_heads=4, attn_dim_qk=16,
                 attn_dim_value=32, laplacian_attn_fn=True)  # fmt: skip
    return Example(model, (_tokens(),), token_ce, (_tokens(seed=1),))


@case("palm-lm", "palm_pytorch", "PaLM: parallel attention and feedforward, one key-value head")
def _palm() -> Example:
    from palm_pytorch import PaLM

    torch.manual_seed(0)
    model = PaLM(num_tokens=VOCAB, dim=DIM, depth=2, heads=4, dim_head=8)
    return Example(model, (_tokens(),), token_ce, (_tokens(seed=1),))


@case("megabyte", "MEGABYTE_pytorch", "MEGABYTE: a global model over patches, a local one within")
def _megabyte() -> Example:
    from MEGABYTE_pytorch import MEGABYTE

    torch.manual_seed(0)
    model = MEGABYTE(num_tokens=VOCAB, dim=(DIM, 16), depth=(1, 1), max_seq_len=(4, 4),
                     dim_head=8, heads=2, flash_attn=False)  # fmt: skip
    ids = torch.randint(1, VOCAB, (BATCH, 16), generator=_gen(0))
    labels = torch.randint(0, VOCAB, (BATCH, 16), generator=_gen(1))
    return Example(model, (ids,), token_ce, (labels,), call=lambda m, x: m(x).flatten(1, -2))


@case(
    "block-recurrent",
    "block_recurrent_transformer_pytorch",
    "BlockRecurrentTransformer: blocks of 4 tokens, state vectors carried between blocks",
)
def _block_recurrent() -> Example:
    from block_recurrent_transformer_pytorch import BlockRecurrentTransformer

    torch.manual_seed(0)
    model = BlockRecurrentTransformer(num_tokens=VOCAB, dim=DIM, depth=2, dim_head=8, heads=4,
                                      max_seq_len=SEQ, block_width=4, num_state_vectors=4,
                                      recurrent_layers=(2,))  # fmt: skip
    return Example(model, (_tokens(),), token_ce, (_tokens(seed=1),),
                   call=lambda m, x: m(x, return_memories_and_states=False))  # fmt: skip


@case(
    "hourglass-lm",
    "hourglass_transformer_pytorch",
    "HourglassTransformerLM: the sequence shortened by 2, then upsampled, causal",
)
def _hourglass() -> Example:
    from hourglass_transformer_pytorch import HourglassTransformerLM

    torch.manual_seed(0)
    model = HourglassTransformerLM(num_tokens=VOCAB, dim=DIM, max_seq_len=SEQ, shorten_factor=2,
                                   depth=(1, 1, 1), heads=4, dim_head=8, causal=True)  # fmt: skip
    return Example(model, (_tokens(),), token_ce, (_tokens(seed=1),))


class ImageClassifier(nn.Module):
    """A stem convolution, an attention layer of a library on ``[batch, channels, h, w]``, a
    mean over the image and a linear head."""

    def __init__(self, layer: nn.Module, channels: int = 8):
        super().__init__()
        self.stem, self.layer = nn.Conv2d(3, channels, 3, padding=1), layer
        self.head = nn.Linear(channels, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.layer(self.stem(x)).mean((2, 3)))


def _image_classifier(layer: nn.Module) -> Example:
    return Example(
        ImageClassifier(layer), (_randn(BATCH, 3, 8, 8),), class_ce, (_labels(),), "mean"
    )


def _lambda_layer() -> nn.Module:
    from lambda_networks import LambdaLayer

    torch.manual_seed(0)
    return LambdaLayer(dim=8, dim_out=8, r=3, dim_k=4, heads=2, dim_u=1)


case("lambda-layer", "lambda_networks", "LambdaLayer: local-position lambdas (Conv3d), BatchNorm")(
    lambda: _image_classifier(_lambda_layer())
)


@case("lambda-layer-gn", "lambda_networks",
      "LambdaLayer, its BatchNorm made GroupNorm by Opacus' ModuleValidator.fix")  # fmt: skip
def _lambda_layer_gn() -> Example:
    from opacus.validators import ModuleValidator

    return _image_classifier(ModuleValidator.fix(_lambda_layer()))


@case(
    "halo-attention", "halonet_pytorch", "HaloAttention: blocks with halos (unfold), rel. positions"
)
def _halo() -> Example:
    from halonet_pytorch import HaloAttention

    torch.manual_seed(0)
    return _image_classifier(HaloAttention(dim=8, block_size=4, halo_size=1, dim_head=4, heads=2))


@case("res-mlp", "res_mlp_pytorch", "ResMLP: cross-patch linear layers, affine (Aff) normalization")
def _res_mlp() -> Example:
    from res_mlp_pytorch import ResMLP

    torch.manual_seed(0)
    model = ResMLP(image_size=8, patch_size=4, dim=16, depth=2, num_classes=CLASSES)
    return Example(model, (_randn(BATCH, 3, 8, 8),), class_ce, (_labels(),), "mean")


class EinMixNet(nn.Module):
    """einops' ``EinMix`` layers: a token mixer whose weight spans positions and a channel
    mixer per group, in the MLP-Mixer fashion, on ``[batch, tokens, channels]``."""

    def __init__(self):
        from einops.layers.torch import EinMix, Reduce

        super().__init__()
        self.tokens = EinMix("b t c -> b u c", weight_shape="t u", bias_shape="u", t=SEQ, u=SEQ)
        self.channels = EinMix("b t (g c) -> b t (g d)", weight_shape="g c d", bias_shape="g d",
                               g=2, c=2, d=4)  # fmt: skip
        self.pool = Reduce("b t c -> b c", "mean")
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.pool(self.channels(torch.tanh(self.tokens(x)))))


@case("einmix", "einops", "EinMix: weights applied by einsum over tokens and channel groups")
def _einmix() -> Example:
    torch.manual_seed(0)
    return Example(EinMixNet(), (_randn(BATCH, SEQ, 4),), class_ce, (_labels(),), "mean")


class SparseAttentionClassifier(nn.Module):
    """Self-attention whose weights are entmax-1.5 of the scores (or entmax of a learned
    ``alpha``, by bisection), a mean over the sequence, a linear head."""

    def __init__(self, learned_alpha: bool):
        super().__init__()
        self.qkv, self.head = nn.Linear(4, 24), nn.Linear(8, CLASSES)
        self.alpha = nn.Parameter(torch.tensor(1.5)) if learned_alpha else None

    def forward(self, x: Tensor) -> Tensor:
        from entmax import entmax15, entmax_bisect

        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(1, 2) / 8**0.5
        if self.alpha is None:
            weights = entmax15(scores, dim=-1)
        else:
            weights = entmax_bisect(scores, 1 + F.softplus(self.alpha), dim=-1, n_iter=60)
        return self.head((weights @ v).mean(1))


case("entmax15-attention", "entmax", "attention weights by entmax15 (sparse, its own backward)")(
    lambda: _sparse_attention(False)
)
case("entmax-bisect-alpha", "entmax", "entmax by bisection, alpha learned (a scalar parameter)")(
    lambda: _sparse_attention(True)
)


def _sparse_attention(learned_alpha: bool) -> Example:
    torch.manual_seed(0)
    model = SparseAttentionClassifier(learned_alpha)
    return Example(model, (_randn(BATCH, SEQ, 4),), class_ce, (_labels(),), "mean")


class HyperbolicClassifier(nn.Module):
    """geoopt: features mapped onto the Poincare ball (``expmap0``), logits the negative
    distances to class prototypes that are ``ManifoldParameter``s on the ball."""

    def __init__(self):
        import geoopt

        super().__init__()
        self.ball = geoopt.PoincareBall(c=1.0)
        self.encoder = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
        points = self.ball.expmap0(torch.randn(CLASSES, 2) * 0.3)
        self.prototypes = geoopt.ManifoldParameter(points, manifold=self.ball)

    def forward(self, x: Tensor) -> Tensor:
        z = self.ball.expmap0(self.encoder(x))
        return -self.ball.dist(z[:, None], self.prototypes[None])


@case("geoopt-poincare", "geoopt", "prototypes as ManifoldParameters on the Poincare ball")
def _geoopt() -> Example:
    torch.manual_seed(0)
    return Example(HyperbolicClassifier(), (_randn(BATCH, 4),), class_ce, (_labels(),), "mean")


class ArcFaceModel(nn.Module):
    """An embedder and pytorch-metric-learning's ``ArcFaceLoss``, whose class centres ``W``
    are the loss's own parameter; the forward returns the library's loss of the batch (its
    mean), or, with the library's ``DoNothingReducer``, each example's."""

    def __init__(self, per_example: bool):
        from pytorch_metric_learning.losses import ArcFaceLoss
        from pytorch_metric_learning.reducers import DoNothingReducer

        super().__init__()
        self.embed = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        reducer = DoNothingReducer() if per_example else None
        self.loss = ArcFaceLoss(num_classes=CLASSES, embedding_size=8, reducer=reducer)
        self.per_example = per_example

    def forward(self, x: Tensor, labels: Tensor) -> Tensor:
        out = self.loss(self.embed(x), labels)
        return out["loss"]["losses"] if self.per_example else out


def _arcface(per_example: bool) -> Example:
    torch.manual_seed(0)
    inputs = (_randn(BATCH, 4), _labels())
    return Example(ArcFaceModel(per_example), inputs, lambda loss: loss, (), "mean",
                   batch_loss=not per_example)  # fmt: skip


case(
    "arcface-loss", "pytorch_metric_learning", "ArcFaceLoss: an angular margin, its W, batch mean"
)(lambda: _arcface(False))
case("arcface-loss-per-example", "pytorch_metric_learning",
     "ArcFaceLoss with DoNothingReducer: each example's loss")(lambda: _arcface(True))  # fmt: skip


class PyroFlow(nn.Module):
    """pyro's normalizing flow: two ``affine_coupling`` transforms (``DenseNN`` conditioners)
    around a fixed permutation, on a standard normal; the forward gives each example's
    log-density. (An ``affine_autoregressive``'s inverse starts from ``torch.zeros`` in the
    default dtype, and so does not run in float64.)"""

    def __init__(self, dim: int = 3):
        from pyro.distributions import transforms as T

        super().__init__()
        self.dim = dim
        self.couplings = nn.ModuleList([T.affine_coupling(dim, hidden_dims=[16]) for _ in "ab"])
        self.permute = T.Permute(torch.tensor([2, 0, 1]))

    def forward(self, x: Tensor) -> Tensor:
        import pyro.distributions as dist

        base = dist.Normal(
            torch.zeros(self.dim, dtype=x.dtype), torch.ones(self.dim, dtype=x.dtype)
        )
        transforms = [self.couplings[0], self.permute, self.couplings[1]]
        return dist.TransformedDistribution(base.to_event(1), transforms).log_prob(x)


@case("pyro-flow", "pyro", "affine coupling transforms (DenseNN), negative log-likelihood")
def _pyro_flow() -> Example:
    torch.manual_seed(0)
    return Example(PyroFlow(), (_randn(BATCH, 3),), lambda log_p: -log_p, (), "mean")


class DeepKernelGP(nn.Module):
    """gpytorch's deep kernel learning, variational: a feature extractor, an ``ApproximateGP``
    with 6 inducing points (a Cholesky variational distribution, an RBF kernel) and a Gaussian
    likelihood; the forward gives the ``VariationalELBO`` of the batch, negated."""

    def __init__(self, num_data: int = BATCH):
        import gpytorch

        class GP(gpytorch.models.ApproximateGP):
            def __init__(self, inducing):
                q = gpytorch.variational.CholeskyVariationalDistribution(len(inducing))
                strategy = gpytorch.variational.VariationalStrategy(
                    self, inducing, q, learn_inducing_locations=True
                )
                super().__init__(strategy)
                self.mean = gpytorch.means.ConstantMean()
                self.kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel())

            def forward(self, z):
                return gpytorch.distributions.MultivariateNormal(self.mean(z), self.kernel(z))

        super().__init__()
        self.features = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
        self.gp = GP(torch.randn(6, 2))
        self.likelihood = gpytorch.likelihoods.GaussianLikelihood()
        self.elbo = gpytorch.mlls.VariationalELBO(self.likelihood, self.gp, num_data=num_data)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return -self.elbo(self.gp(self.features(x)), y)


@case("gpytorch-dkl", "gpytorch", "deep kernel learning: a feature extractor, a variational GP")
def _gpytorch() -> Example:
    torch.manual_seed(0)
    return Example(DeepKernelGP(), (_randn(BATCH, 4), _randn(BATCH, seed=1)), lambda loss: loss,
                   (), "mean", batch_loss=True)  # fmt: skip


class DynClassifier(nn.Module):
    """torchdyn's ``NeuralODE`` (fixed ``rk4`` steps, backpropagation through the solver, or its
    adjoint), its state at ``t=1`` through a linear head."""

    def __init__(self, sensitivity: str):
        from torchdyn.core import NeuralODE

        super().__init__()
        field = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 4))
        self.ode = NeuralODE(field, sensitivity=sensitivity, solver="rk4")
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        t_span = torch.linspace(0, 1, 5, dtype=x.dtype)
        _, trajectory = self.ode(x, t_span)
        return self.head(trajectory[-1])


def _torchdyn(sensitivity: str) -> Example:
    torch.manual_seed(0)
    return Example(DynClassifier(sensitivity), (_randn(BATCH, 4),), mse,
                   (_randn(BATCH, 2, seed=1),), "mean")  # fmt: skip


case("torchdyn-node", "torchdyn", "NeuralODE, rk4 steps, gradients through the solver")(
    lambda: _torchdyn("autograd")
)
case("torchdyn-adjoint", "torchdyn", "NeuralODE, its adjoint (a backward of its own)")(
    lambda: _torchdyn("adjoint")
)


class NeuralSDE(nn.Module):
    """``torchsde.sdeint`` of a neural SDE (diagonal noise, Euler steps of 0.25) driven by a
    Brownian path given with the batch (``[batch, steps, dim]`` increments), so that an example
    sees the same noise alone as in the batch; its state at ``t=1`` through a linear head."""

    sde_type, noise_type = "ito", "diagonal"

    def __init__(self, dim: int = 4):
        super().__init__()
        self.drift = nn.Sequential(nn.Linear(dim, 16), nn.Tanh(), nn.Linear(16, dim))
        self.diffusion = nn.Sequential(nn.Linear(dim, dim), nn.Sigmoid())
        self.head = nn.Linear(dim, 2)

    def f(self, t, y):
        return self.drift(y)

    def g(self, t, y):
        return self.diffusion(y)

    def forward(self, y0: Tensor, increments: Tensor) -> Tensor:
        import torchsde

        class GivenPath(torchsde.BaseBrownian):
            """The Brownian motion of the given increments on the grid ``0, 0.25, ..., 1``."""

            dtype, device, shape = increments.dtype, increments.device, increments[:, 0].shape
            levy_area_approximation = "none"

            def __call__(self, ta, tb=None, return_U=False, return_A=False):
                w = torch.cat([torch.zeros_like(increments[:, :1]), increments.cumsum(1)], 1)
                at = lambda t: w[:, round(float(t) * 4)]  # noqa: E731
                return at(ta) if tb is None else at(tb) - at(ta)

            def __repr__(self):
                return "GivenPath()"

        ts = torch.tensor([0.0, 1.0], dtype=y0.dtype)
        ys = torchsde.sdeint(self, y0, ts, bm=GivenPath(), method="euler", dt=0.25)
        return self.head(ys[-1])


@case("neural-sde", "torchsde", "sdeint, Euler steps, a Brownian path given per example")
def _neural_sde() -> Example:
    torch.manual_seed(0)
    inputs = (_randn(BATCH, 4), _randn(BATCH, 4, 4, seed=2) * 0.5)
    return Example(NeuralSDE(), inputs, mse, (_randn(BATCH, 2, seed=1),), "mean")


class SpikingJellyNet(nn.Module):
    """spikingjelly's multi-step network: ``layer.Linear`` and ``ParametricLIFNode`` (a learned
    time constant) over ``[time, batch, features]``, with the linear layers applied to time
    and batch folded into one dimension; the spike counts over time as logits. Its neurons'
    state is reset at each forward (``functional.reset_net``)."""

    def __init__(self, steps: int = 4):
        from spikingjelly.activation_based import layer, neuron, surrogate

        super().__init__()
        self.steps = steps
        lif = dict(surrogate_function=surrogate.ATan(), step_mode="m", detach_reset=True)
        self.net = nn.Sequential(
            layer.Linear(4, 16, step_mode="m"), neuron.ParametricLIFNode(**lif),
            layer.Linear(16, CLASSES, step_mode="m"), neuron.ParametricLIFNode(**lif),
        )  # fmt: skip

    def forward(self, x: Tensor) -> Tensor:
        from spikingjelly.activation_based import functional

        functional.reset_net(self.net)
        spikes = self.net(x.unsqueeze(0).repeat(self.steps, 1, 1) * 2)
        return spikes.sum(0).to(x.dtype)


@case("spikingjelly-plif", "spikingjelly", "multi-step Linear and ParametricLIF neurons (ATan)")
def _spikingjelly() -> Example:
    torch.manual_seed(0)
    return Example(SpikingJellyNet(), (_randn(BATCH, 4),), class_ce, (_labels(),), "mean")


# -- tabular embeddings and ensembles: rtdl_num_embeddings, tabm ---------------------------------


class NumEmbeddingMLP(nn.Module):
    """An MLP on numeric features embedded one by one (``rtdl_num_embeddings``' README): the
    embeddings ``[batch, features, d]`` flattened, two Linear layers."""

    def __init__(self, embeddings: nn.Module, features: int, d: int):
        super().__init__()
        self.embeddings = embeddings
        self.mlp = nn.Sequential(nn.Linear(features * d, 16), nn.ReLU(), nn.Linear(16, CLASSES))

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(self.embeddings(x).flatten(1))


def _num_embeddings(kind: str) -> Example:
    import rtdl_num_embeddings as rne

    torch.manual_seed(0)
    x = _randn(BATCH, 4)
    if kind == "periodic":
        emb, d = rne.PeriodicEmbeddings(4, 8, n_frequencies=6, lite=False), 8
    elif kind == "periodic-lite":
        emb, d = rne.PeriodicEmbeddings(4, 8, n_frequencies=6, lite=True), 8
    elif kind == "linear-relu":
        emb, d = rne.LinearReLUEmbeddings(4, 8), 8
    else:  # bins of a training set of its own, the quantiles of each feature
        bins = rne.compute_bins(_randn(64, 4, seed=5).float(), n_bins=5)
        emb, d = rne.PiecewiseLinearEmbeddings(bins, 8, activation=True, version="B"), 8
    return Example(NumEmbeddingMLP(emb, 4, d), (x,), class_ce, (_labels(),), "mean")


case(
    "rtdl-periodic",
    "rtdl_num_embeddings",
    "PeriodicEmbeddings: cos and sin of learned frequencies, a Linear per feature",
)(lambda: _num_embeddings("periodic"))
case(
    "rtdl-periodic-lite",
    "rtdl_num_embeddings",
    "PeriodicEmbeddings(lite=True): one Linear shared by the features",
)(lambda: _num_embeddings("periodic-lite"))
case(
    "rtdl-linear-relu", "rtdl_num_embeddings", "LinearReLUEmbeddings: a weight and bias per feature"
)(lambda: _num_embeddings("linear-relu"))
case(
    "rtdl-piecewise-linear",
    "rtdl_num_embeddings",
    "PiecewiseLinearEmbeddings of quantile bins (version B)",
)(lambda: _num_embeddings("piecewise"))


def ensemble_ce(logits: Tensor, labels: Tensor) -> Tensor:
    """TabM's loss: each of the ``k`` members' cross-entropy, ``[batch, k, classes]``,
    averaged over the members."""
    k = logits.shape[1]
    ce = F.cross_entropy(logits.flatten(0, 1), labels.repeat_interleave(k), reduction="none")
    return ce.view(-1, k).mean(1)


def _tabm(arch: str, embeddings: bool = False) -> Example:
    import rtdl_num_embeddings as rne
    import tabm

    torch.manual_seed(0)
    kw = dict(n_num_features=4, cat_cardinalities=[5, 4, 3], d_out=CLASSES, k=4, n_blocks=2,
              d_block=16, dropout=0.0, arch_type=arch)  # fmt: skip
    if embeddings:
        kw["num_embeddings"] = rne.PeriodicEmbeddings(4, 8, n_frequencies=6, lite=False)
    model = tabm.TabM.make(**kw)
    cat, cont = _tabular()
    return Example(model, (cont, cat), ensemble_ce, (_labels(),), "mean")


case("tabm", "tabm", "TabM: k=4 members by BatchEnsemble (shared weights, per-member scalings)")(
    lambda: _tabm("tabm")
)
case("tabm-mini-periodic", "tabm", "TabM-mini after PeriodicEmbeddings")(
    lambda: _tabm("tabm-mini", embeddings=True)
)
case("tabm-packed", "tabm", "TabM-packed: k independent MLPs (LinearEnsemble, batched weights)")(
    lambda: _tabm("tabm-packed")
)


# -- audio front ends: asteroid-filterbanks, nnAudio ----------------------------------------------


class FilterbankSeparator(nn.Module):
    """A TasNet-like separator of ``asteroid_filterbanks``: a learned analysis filterbank
    (``Encoder``), a mask from a 1x1 convolution, the masked representation back to a waveform
    by the synthesis filterbank (``Decoder``), padded to the input's length."""

    def __init__(self, kind: str, **kw):
        from asteroid_filterbanks import make_enc_dec

        super().__init__()
        self.encoder, self.decoder = make_enc_dec(kind, n_filters=16, kernel_size=16, stride=8,
                                                  **kw)  # fmt: skip
        channels = self.encoder.n_feats_out
        self.mask = nn.Sequential(nn.Conv1d(channels, channels, 1), nn.Sigmoid())

    def forward(self, wav: Tensor) -> Tensor:
        spec = self.encoder(wav)
        out = self.decoder(spec * self.mask(spec))
        return F.pad(out, (0, wav.shape[-1] - out.shape[-1]))  # (asteroid's pad_x_to_y)


def _separator(kind: str, **kw) -> Example:
    torch.manual_seed(0)
    wav, clean = _randn(BATCH, 1, 128), _randn(BATCH, 1, 128, seed=1)
    return Example(FilterbankSeparator(kind, **kw), (wav,), mse, (clean,), "mean")


case("asteroid-free", "asteroid_filterbanks", "Encoder and Decoder of free (learned) filters")(
    lambda: _separator("free")
)
case("asteroid-param-sinc", "asteroid_filterbanks", "ParamSincFB: sinc filters of learned bands")(
    lambda: _separator("param_sinc", sample_rate=8000.0, min_low_hz=50, min_band_hz=50)
)
case(
    "asteroid-analytic",
    "asteroid_filterbanks",
    "AnalyticFreeFB: learned filters, their Hilbert pairs by FFT",
)(lambda: _separator("analytic_free"))


class SpectrogramClassifier(nn.Module):
    """An audio classifier on ``nnAudio``'s spectrogram layer with trainable kernels: the log
    of the spectrogram, a convolution over time, a mean over time, a Linear head."""

    def __init__(self, layer: nn.Module, bins: int):
        super().__init__()
        self.spec = layer
        self.conv = nn.Conv1d(bins, 8, 3, padding=1)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, wav: Tensor) -> Tensor:
        s = torch.log1p(self.spec(wav))
        return self.head(self.conv(s).relu().mean(-1))


def _nnaudio(kind: str) -> Example:
    from nnAudio import features

    torch.manual_seed(0)
    if kind == "stft":
        layer = features.STFT(n_fft=32, hop_length=8, freq_scale="no", sr=8000, trainable=True,
                              output_format="Magnitude", verbose=False)  # fmt: skip
        bins = 17
    else:
        layer = features.MelSpectrogram(sr=8000, n_fft=32, n_mels=8, hop_length=8,
                                        trainable_mel=True, trainable_STFT=True, verbose=False)  # fmt: skip
        bins = 8
    return Example(
        SpectrogramClassifier(layer, bins), (_randn(BATCH, 256),), class_ce, (_labels(),), "mean"
    )


case("nnaudio-stft", "nnAudio", "STFT as a Conv1d of trainable Fourier kernels, the magnitude")(
    lambda: _nnaudio("stft")
)
case("nnaudio-mel", "nnAudio", "MelSpectrogram: trainable STFT kernels and mel filters")(
    lambda: _nnaudio("mel")
)


# -- mixtures of experts: mixture-of-experts, st-moe-pytorch --------------------------------------


class MoELM(nn.Module):
    """A language model of one mixture-of-experts layer, which returns its users' loss: the
    mean token cross-entropy plus the layer's auxiliary loss (a mean of each sequence's load
    balance), as the libraries' READMEs add them."""

    def __init__(self, moe: nn.Module, aux: bool = True):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.moe = moe
        self.head = nn.Linear(16, VOCAB)
        self.aux = aux

    def forward(self, ids: Tensor, labels: Tensor) -> Tensor:
        x = self.embed(ids)
        out, aux, *_ = self.moe(x)
        loss = token_ce(self.head(x + out), labels).mean()
        return loss + aux if self.aux else loss


def _moe_lm(moe: nn.Module, aux: bool = True) -> Example:
    return Example(MoELM(moe, aux), (_tokens(), _tokens(seed=1)), lambda loss: loss, (), "mean",
                   batch_loss=True)  # fmt: skip


@case("moe-top2", "mixture_of_experts", "MoE: top-2 gating with capacity, its balance loss")
def _moe_top2() -> Example:
    from mixture_of_experts import MoE

    torch.manual_seed(0)
    return _moe_lm(MoE(dim=16, num_experts=4, hidden_dim=32, second_policy_train="all"))


@case("moe-top2-task-loss", "mixture_of_experts", "the same, its balance loss left out")
def _moe_top2_task() -> Example:
    from mixture_of_experts import MoE

    torch.manual_seed(0)
    return _moe_lm(MoE(dim=16, num_experts=4, hidden_dim=32, second_policy_train="all"), False)


@case("moe-hierarchical", "mixture_of_experts", "HeirarchicalMoE: experts of experts")
def _moe_hier() -> Example:
    from mixture_of_experts import HeirarchicalMoE

    torch.manual_seed(0)
    return _moe_lm(HeirarchicalMoE(dim=16, num_experts=(2, 2), hidden_dim=32,
                                   second_policy_train="all"))  # fmt: skip


@case("st-moe", "st_moe_pytorch", "ST-MoE: top-2 routing, balance and router z-losses")
def _st_moe() -> Example:
    from st_moe_pytorch import MoE

    torch.manual_seed(0)
    # (a threshold near zero routes every token to its second expert: no random draw decides)
    return _moe_lm(MoE(dim=16, num_experts=4, expert_hidden_mult=2, threshold_train=1e-30))


# -- lucidrains' FLASH; a RetNet; Charformer's GBST -------------------------


@case("flash-lm", "flash_pytorch", "FLASH: gated attention units, quadratic within groups")
def _flash() -> Example:
    from flash_pytorch import FLASHTransformer

    torch.manual_seed(0)
    model = FLASHTransformer(num_tokens=VOCAB, dim=DIM, depth=2, group_size=4,
                             query_key_dim=16, causal=True)  # fmt: skip
    return Example(model, (_tokens(),), token_ce, (_tokens(seed=1),))


@case("flash-lm-laplace", "flash_pytorch", "FLASH, bidirectional, Laplace attention (erf)")
def _flash_laplace() -> Example:
    from flash_pytorch import FLASHTransformer

    torch.manual_seed(0)
    model = FLASHTransformer(num_tokens=VOCAB, dim=DIM, depth=2, group_size=4, query_key_dim=16,
                             laplace_attn_fn=True, norm_type="layernorm")  # fmt: skip
    return Example(model, (_tokens(),), token_ce, (_tokens(seed=1),))


@case("retnet-lm", "yet_another_retnet", "RetNet: multi-scale retention, parallel form")
def _retnet() -> Example:
    from yet_another_retnet.retnet import RetNet

    torch.manual_seed(0)
    model = RetNet(num_tokens=VOCAB, d_model=DIM, nhead=4, num_layers=2, dropout=0.0,
                   dim_feedforward=64)  # fmt: skip
    return Example(model, (_tokens(),), token_ce, (_tokens(seed=1),),
                   call=lambda m, ids: m.forward_parallel(ids))  # fmt: skip


class CharClassifier(nn.Module):
    """Charformer's GBST (soft subword blocks scored and mixed per position, then downsampled)
    under a small encoder and a pooled head."""

    def __init__(self):
        from charformer_pytorch import GBST

        super().__init__()
        self.gbst = GBST(num_tokens=VOCAB, dim=16, max_block_size=4, downsample_factor=2)
        self.encoder = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, ids: Tensor) -> Tensor:
        x, _ = self.gbst(ids)
        return self.head(self.encoder(x).mean(1))


@case("charformer-gbst", "charformer_pytorch", "GBST: gradient-based subword blocks, a classifier")
def _charformer() -> Example:
    torch.manual_seed(0)
    return Example(CharClassifier(), (_tokens(),), class_ce, (_labels(),), "mean")


# -- state-space and recurrent layers: s5-pytorch, sru ---------------------------------------------


class SequenceRegressor(nn.Module):
    """A sequence layer between a Linear in and a Linear out, ``[batch, time, features]``; the
    layer called ``time_first`` takes ``[time, batch, features]``."""

    def __init__(self, layer: nn.Module, dim: int, time_first: bool = False):
        super().__init__()
        self.inp, self.layer, self.out = nn.Linear(4, dim), layer, nn.Linear(dim, 2)
        self.time_first = time_first

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        if self.time_first:
            h = self.layer(h.transpose(0, 1))[0].transpose(0, 1)
        else:
            h = self.layer(h)
        return self.out(h)


@case("s5-block", "s5", "S5Block: a diagonal complex state space, vmapped over the batch")
def _s5() -> Example:
    from s5 import S5Block

    torch.manual_seed(0)
    model = SequenceRegressor(S5Block(dim=8, state_dim=8, bidir=False), 8)
    for t in [*model.parameters(), *model.buffers()]:
        if t.is_complex():  # (complex64 as built: .double() keeps complex tensors as they are)
            t.data = t.data.to(torch.complex128)
    return Example(model, (_randn(BATCH, SEQ, 4),), mse, (_randn(BATCH, SEQ, 2, seed=1),), "mean")


@case("sru", "sru", "SRU: simple recurrent units, time first (its pure-PyTorch recurrence)")
def _sru() -> Example:
    from sru import SRU

    torch.manual_seed(0)
    model = SequenceRegressor(SRU(8, 8, num_layers=2, layer_norm=True), 8, time_first=True)

    def call(m, x):  # (without autograd SRU runs a compiled float32 kernel of its own)
        with torch.enable_grad():
            return m(x)

    return Example(model, (_randn(BATCH, SEQ, 4),), mse, (_randn(BATCH, SEQ, 2, seed=1),), "mean",
                   call=call)  # fmt: skip


# -- vit-pytorch's models that bench.timm_sweep does not build ------------------------------------


def _vit_module(module: str):
    _package_without_init("vit_pytorch")
    return importlib.import_module(f"vit_pytorch.{module}")


def _package_without_init(name: str) -> None:
    """Make ``name``'s submodules importable without running its ``__init__``: vit-pytorch's
    imports torchvision (for DINO's augmentations), which its models do not need, and which a
    CPU-only torch may lack."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.submodule_search_locations is None:
        raise ModuleNotFoundError(f"No module named {name!r}")
    package = types.ModuleType(name)
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    sys.modules[name] = package


# packages whose __init__ imports torchvision, which their models do not use
WITHOUT_INIT = {"vit_pytorch", "segment_anything", "encodec"}

VIT = dict(num_classes=CLASSES, dim=DIM, depth=2, heads=4, mlp_dim=64, dim_head=8)


def _vit_example(model: nn.Module, *shape: int) -> Example:
    return Example(model, (_randn(BATCH, *shape),), class_ce, (_labels(),), "mean")


class NaViTPairs(nn.Module):
    """NaViT as its README calls it: a list, one entry per example, of that example's images
    of different sizes, each example's patches packed into one sequence (an attention mask
    keeps its images apart), the sequences padded to the longest; a logit row per image. Each
    example here is two images: a 16x16 one and the left ``width`` columns of a 16x16 one (its
    width an input of its own, so that the sequences differ in length)."""

    def __init__(self):
        super().__init__()
        self.navit = _vit_module("na_vit").NaViT(image_size=16, patch_size=4, channels=3, **VIT)

    def forward(self, first: Tensor, second: Tensor, width: Tensor) -> Tensor:
        pairs = [[a, b[..., : int(w)]] for a, b, w in zip(first, second, width)]
        return self.navit(pairs)


@case("navit", "vit_pytorch", "NaViT: images of several sizes packed per example, padded")
def _navit() -> Example:
    torch.manual_seed(0)
    width = torch.tensor([16, 8, 12])
    labels = torch.randint(0, CLASSES, (BATCH, 2), generator=_gen(1))

    def losses(logits: Tensor, labels: Tensor) -> Tensor:  # (a row per image, two per example)
        return class_ce(logits, labels.flatten()).view(-1, 2).sum(1)

    inputs = (_randn(BATCH, 3, 16, 16), _randn(BATCH, 3, 16, 16, seed=2), width)
    return Example(NaViTPairs(), inputs, losses, (labels,), "mean")


@case("vivit", "vit_pytorch", "ViViT: factorized space and time encoders on video")
def _vivit() -> Example:
    torch.manual_seed(0)
    kw = {k: v for k, v in VIT.items() if k != "depth"}
    model = _vit_module("vivit").ViViT(image_size=16, image_patch_size=8, frames=4,
                                       frame_patch_size=2, spatial_depth=1, temporal_depth=1,
                                       use_flash_attn=False, **kw)  # fmt: skip
    return _vit_example(model, 3, 4, 16, 16)


@case("vit-3d", "vit_pytorch", "ViT of 3D patches (video: frames and pixels)")
def _vit_3d() -> Example:
    torch.manual_seed(0)
    model = _vit_module("vit_3d").ViT(image_size=16, image_patch_size=8, frames=4,
                                      frame_patch_size=2, **VIT)  # fmt: skip
    return _vit_example(model, 3, 4, 16, 16)


@case("vit-1d", "vit_pytorch", "ViT of 1D patches (a signal)")
def _vit_1d() -> Example:
    torch.manual_seed(0)
    model = _vit_module("vit_1d").ViT(seq_len=64, patch_size=8, channels=2, **VIT)
    return _vit_example(model, 2, 64)


@case("vit-patch-merger", "vit_pytorch", "ViT with a PatchMerger: tokens merged by learned queries")
def _vit_patch_merger() -> Example:
    torch.manual_seed(0)
    model = _vit_module("vit_with_patch_merger").ViT(image_size=16, patch_size=4,
                                                     patch_merge_layer=1,
                                                     patch_merge_num_tokens=4, **VIT)  # fmt: skip
    return _vit_example(model, 3, 16, 16)


@case("n-vit", "vit_pytorch", "nViT: the normalized ViT, weights on the hypersphere")
def _n_vit() -> Example:
    torch.manual_seed(0)
    model = _vit_module("normalized_vit").nViT(image_size=16, patch_size=4, **VIT)
    return _vit_example(model, 3, 16, 16)


@case("look-vit", "vit_pytorch", "LookViT: cross-attention between low- and high-resolution tokens")
def _look_vit() -> Example:
    torch.manual_seed(0)
    model = _vit_module("look_vit").LookViT(dim=16, image_size=32, num_classes=CLASSES, depth=1,
                                            patch_size=8, heads=2, dim_head=8,
                                            highres_patch_size=4, cross_attn_heads=2,
                                            cross_attn_dim_head=8, patch_conv_kernel_size=3,
                                            dropout=0.0)  # fmt: skip
    return _vit_example(model, 3, 32, 32)


@case("learnable-memory-vit", "vit_pytorch", "a frozen ViT, learned memory tokens (Adapter)")
def _learnable_memory() -> Example:
    lm = _vit_module("learnable_memory_vit")
    torch.manual_seed(0)
    vit = lm.ViT(image_size=16, patch_size=4, **VIT)
    model = lm.Adapter(vit=vit, num_memories_per_layer=2, num_classes=CLASSES)
    return _vit_example(model, 3, 16, 16)


# -- more libraries: lucidrains' efficient attentions, hyper-connections, FrEIA, EfficientNet -----


def _lm_example(model: nn.Module) -> Example:
    return Example(model, (_tokens(),), token_ce, (_tokens(seed=1),))


@case("h-transformer-1d", "h_transformer_1d", "H-Transformer-1D: hierarchical attention, causal")
def _h_transformer() -> Example:
    from h_transformer_1d import HTransformer1D

    torch.manual_seed(0)
    return _lm_example(HTransformer1D(num_tokens=VOCAB, dim=DIM, depth=2, max_seq_len=SEQ,
                                      causal=True, heads=4, dim_head=8, block_size=2))  # fmt: skip


@case("h-transformer-1d-bidir", "h_transformer_1d", "H-Transformer-1D, bidirectional, token shift")
def _h_transformer_bidir() -> Example:
    from h_transformer_1d import HTransformer1D

    torch.manual_seed(0)
    return _lm_example(HTransformer1D(num_tokens=VOCAB, dim=DIM, depth=2, max_seq_len=SEQ,
                                      heads=4, dim_head=8, block_size=2,
                                      shift_tokens=True))  # fmt: skip


class TokenClassifier(nn.Module):
    """Tokens embedded, a sequence encoder ``[batch, seq, dim] -> [batch, seq, dim]``, the
    mean over positions, a head."""

    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.embed, self.encoder = nn.Embedding(VOCAB, DIM), encoder
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, ids: Tensor) -> Tensor:
        out = self.encoder(self.embed(ids))
        return self.head((out[0] if isinstance(out, tuple) else out).mean(1))


@case("agent-transformer", "agent_attention_pytorch", "Agent attention: learned agent tokens")
def _agent() -> Example:
    from agent_attention_pytorch.agent_transformer import AgentTransformer

    torch.manual_seed(0)
    model = TokenClassifier(AgentTransformer(DIM, num_agent_tokens=4, depth=2, heads=4,
                                             dim_head=8))  # fmt: skip
    return Example(model, (_tokens(),), class_ce, (_labels(),), "mean")


class HyperResidualMLP(nn.Module):
    """hyper-connections as its README uses them: the residual stream expanded to ``streams``
    copies, each block a branch whose input and output mix the streams by learned (and, with
    ``dynamic``, input-dependent) weights, the streams reduced by a sum at the end."""

    def __init__(self, manifold: bool = False):
        import hyper_connections as hc

        super().__init__()
        get = (hc.mc_get_init_and_expand_reduce_stream_functions if manifold
               else hc.get_init_and_expand_reduce_stream_functions)  # fmt: skip
        init, self.expand, self.reduce = get(2, dim=16) if not manifold else get(2)
        self.inp, self.head = nn.Linear(4, 16), nn.Linear(16, CLASSES)
        self.blocks = nn.ModuleList(
            init(dim=16, branch=nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.GELU()))
            for _ in range(2)
        )

    def forward(self, x: Tensor) -> Tensor:
        h = self.expand(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return self.head(self.reduce(h).mean(1))


@case("hyper-connections", "hyper_connections", "hyper-connections: 2 residual streams mixed")
def _hyper() -> Example:
    torch.manual_seed(0)
    return Example(HyperResidualMLP(), (_randn(BATCH, SEQ, 4),), class_ce, (_labels(),), "mean")


@case("hyper-connections-mhc", "hyper_connections", "mHC: streams mixed by a Sinkhorn projection")
def _hyper_mhc() -> Example:
    torch.manual_seed(0)
    return Example(HyperResidualMLP(manifold=True), (_randn(BATCH, SEQ, 4),), class_ce,
                   (_labels(),), "mean")  # fmt: skip


class MogrifiedLSTM(nn.Module):
    """Mogrifier gating of an LSTM's input and state: the two modulate each other for a few
    rounds (factorized weights) before each step of an ``nn.LSTMCell``."""

    def __init__(self):
        from mogrifier import Mogrifier

        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.mog = Mogrifier(dim=8, iters=4, factorize_k=4)
        self.cell, self.head = nn.LSTMCell(8, 8), nn.Linear(8, 2)

    def forward(self, x: Tensor) -> Tensor:
        xs = self.inp(x)
        h = c = xs.new_zeros(x.shape[0], 8)
        outs = []
        for t in range(x.shape[1]):
            xt, h = self.mog(xs[:, t], h)
            h, c = self.cell(xt, (h, c))
            outs.append(h)
        return self.head(torch.stack(outs, 1))


@case("mogrifier-lstm", "mogrifier", "Mogrifier: input and state modulating each other, an LSTM")
def _mogrifier() -> Example:
    torch.manual_seed(0)
    return Example(MogrifiedLSTM(), (_randn(BATCH, SEQ, 4),), mse, (_randn(BATCH, SEQ, 2, seed=1),),
                   "mean")  # fmt: skip


class BotNet(nn.Module):
    """A convolutional stem, a BottleStack (relative-position self-attention in bottleneck
    blocks, BatchNorm between), a pooled head."""

    def __init__(self):
        from bottleneck_transformer_pytorch import BottleStack

        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.stack = BottleStack(dim=8, fmap_size=8, dim_out=16, proj_factor=2, num_layers=1,
                                 heads=2, dim_head=8, downsample=True, rel_pos_emb=True)  # fmt: skip
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.stack(self.stem(x)).mean((2, 3)))


@case("botnet", "bottleneck_transformer_pytorch", "BoTNet: attention in bottlenecks, BatchNorm")
def _botnet() -> Example:
    torch.manual_seed(0)
    return _vit_example(BotNet(), 3, 8, 8)


@case("efficientnet", "efficientnet_pytorch", "EfficientNet: MBConv, squeeze-excite, BatchNorm")
def _efficientnet() -> Example:
    from efficientnet_pytorch import EfficientNet

    torch.manual_seed(0)
    model = EfficientNet.from_name("efficientnet-b0", num_classes=CLASSES, width_coefficient=0.1,
                                   depth_coefficient=0.1, image_size=32, dropout_rate=0.0,
                                   drop_connect_rate=0.0)  # fmt: skip
    return _vit_example(model, 3, 32, 32)


class InnNLL(nn.Module):
    """A FrEIA invertible network's negative log-likelihood of each example under a standard
    normal: ``0.5 |z|^2 - log|det J|``, ``[batch]``."""

    def __init__(self, block: str):
        import FrEIA.framework as Ff
        import FrEIA.modules as Fm

        super().__init__()

        def subnet(c_in: int, c_out: int) -> nn.Module:
            return nn.Sequential(nn.Linear(c_in, 16), nn.Tanh(), nn.Linear(16, c_out))

        self.inn = Ff.SequenceINN(6)
        for _ in range(2):
            if block == "all-in-one":
                self.inn.append(Fm.AllInOneBlock, subnet_constructor=subnet, permute_soft=False)
            else:
                self.inn.append(Fm.GLOWCouplingBlock, subnet_constructor=subnet, clamp=2.0)
                self.inn.append(Fm.ActNorm)

    def forward(self, x: Tensor) -> Tensor:
        z, log_det = self.inn(x)
        return 0.5 * z.pow(2).sum(1) - log_det


@case("freia-glow", "FrEIA", "FrEIA: GLOW couplings and ActNorm, the flow's likelihood")
def _freia_glow() -> Example:
    torch.manual_seed(0)
    return Example(InnNLL("glow"), (_randn(BATCH, 6),), lambda nll: nll, (), "mean")


@case("freia-all-in-one", "FrEIA", "FrEIA: AllInOneBlock (affine coupling, ActNorm, permutation)")
def _freia_all() -> Example:
    torch.manual_seed(0)
    return Example(InnNLL("all-in-one"), (_randn(BATCH, 6),), lambda nll: nll, (), "mean")


@case("h-transformer-1d-reversible", "h_transformer_1d", "H-Transformer-1D, reversible layers")
def _h_transformer_rev() -> Example:
    from h_transformer_1d import HTransformer1D

    torch.manual_seed(0)
    return _lm_example(HTransformer1D(num_tokens=VOCAB, dim=DIM, depth=2, max_seq_len=SEQ,
                                      causal=True, heads=4, dim_head=8, block_size=2,
                                      reversible=True))  # fmt: skip


@case("jumbo-vit", "vit_pytorch", "Jumbo ViT: a class token 6 times wider, split to attend")
def _jumbo_vit() -> Example:
    torch.manual_seed(0)
    kw = {k: v for k, v in VIT.items() if k != "dim_head"}
    model = _vit_module("jumbo_vit").JumboViT(image_size=16, patch_size=4, dim_head=8, **kw)
    return _vit_example(model, 3, 16, 16)


@case("simple-uvit", "vit_pytorch", "Simple U-ViT: long skips between blocks, register tokens")
def _simple_uvit() -> Example:
    torch.manual_seed(0)
    kw = {k: v for k, v in VIT.items() if k != "dim_head"}
    model = _vit_module("simple_uvit").SimpleUViT(image_size=16, patch_size=4, dim_head=8, **kw)
    return _vit_example(model, 3, 16, 16)


@case("looped-vit", "vit_pytorch", "Looped ViT: blocks looped over, supervised at every loop")
def _looped_vit() -> Example:
    torch.manual_seed(0)
    model = _vit_module("looped_vit").LoopedViT(num_classes=CLASSES, dim=DIM, image_size=16,
                                                patch_size=4, pre_loop_depth=1,
                                                num_looped_blocks=2, post_loop_depth=1,
                                                loop_depth=1, heads=4, dim_head=8,
                                                mlp_dim=64)  # fmt: skip
    return _vit_example(model, 3, 16, 16)


@case("regionvit", "vit_pytorch", "RegionViT: regional and local tokens, attention between them")
def _regionvit() -> Example:
    torch.manual_seed(0)
    model = _vit_module("regionvit").RegionViT(dim=(8, 16, 16, 16), depth=(1, 1, 1, 1),
                                               window_size=2, num_classes=CLASSES)  # fmt: skip
    return _vit_example(model, 3, 64, 64)


# -- video, memory, routed attention, neural operators -----------------------------------------


@case("timesformer", "timesformer_pytorch", "TimeSformer: divided space-time attention, rotary")
def _timesformer() -> Example:
    from timesformer_pytorch import TimeSformer

    torch.manual_seed(0)
    model = TimeSformer(dim=DIM, image_size=8, patch_size=4, num_frames=2, num_classes=CLASSES,
                        depth=2, heads=4, dim_head=8)  # fmt: skip
    return _vit_example(model, 2, 3, 8, 8)


@case("timesformer-shift", "timesformer_pytorch", "TimeSformer, tokens shifted across frames")
def _timesformer_shift() -> Example:
    from timesformer_pytorch import TimeSformer

    torch.manual_seed(0)
    model = TimeSformer(dim=DIM, image_size=8, patch_size=4, num_frames=2, num_classes=CLASSES,
                        depth=2, heads=4, dim_head=8, rotary_emb=False,
                        shift_tokens=True)  # fmt: skip
    return _vit_example(model, 2, 3, 8, 8)


def _rmt(**kw) -> Example:
    from recurrent_memory_transformer_pytorch import (
        RecurrentMemoryTransformer,
        RecurrentMemoryTransformerWrapper,
    )

    torch.manual_seed(0)
    core = RecurrentMemoryTransformer(DIM, num_tokens=VOCAB, depth=2, num_memory_tokens=2,
                                      seq_len=4, dim_head=8, heads=2, num_residual_streams=1,
                                      **kw)  # fmt: skip
    model = RecurrentMemoryTransformerWrapper(core)
    # (the wrapper's loss: each segment's mean token cross-entropy, weighted by its length,
    # averaged over the batch; 9 tokens: 2 segments of 4 predicted from the ones before)
    return Example(model, (_tokens(9),), lambda loss: loss, (), "mean",
                   call=lambda m, ids: m(ids, return_loss=True), batch_loss=True)  # fmt: skip


@case("rmt-loss", "recurrent_memory_transformer_pytorch",
      "Recurrent Memory Transformer, the loss of the batch computed inside (its README's)")  # fmt: skip
def _rmt_loss() -> Example:
    return _rmt()


def _rmt_logits(**kw) -> Example:
    ex = _rmt(**kw)
    return Example(ex.model, (_tokens(),), token_ce, (_tokens(seed=1),))


@case("rmt", "recurrent_memory_transformer_pytorch",
      "Recurrent Memory Transformer: memories read and written across 2 segments")  # fmt: skip
def _rmt_plain() -> Example:
    return _rmt_logits()


@case("rmt-xl", "recurrent_memory_transformer_pytorch",
      "the same, XL memories (keys and values of the segment before), rotary")  # fmt: skip
def _rmt_xl() -> Example:
    return _rmt_logits(use_xl_memories=True, rotary_pos_emb=True, abs_pos_emb=False)


@case("mixture-of-attention", "mixture_of_attention",
      "MixtureOfAttention: queries and keys routed to 2 experts by coordinate descent")  # fmt: skip
def _mixture_of_attention() -> Example:
    from mixture_of_attention import MixtureOfAttention

    torch.manual_seed(0)
    moa = MixtureOfAttention(dim=DIM, num_routed_queries=4, num_routed_key_values=4,
                             num_experts=2, dim_head=8, heads=2, use_triton=False)  # fmt: skip
    return Example(TokenClassifier(moa), (_tokens(),), class_ce, (_labels(),), "mean")


@case("mixture-of-attention-causal", "mixture_of_attention",
      "MixtureOfAutoregressiveAttention: routing within causal windows")  # fmt: skip
def _mixture_of_attention_causal() -> Example:
    from mixture_of_attention import MixtureOfAutoregressiveAttention

    torch.manual_seed(0)
    moa = MixtureOfAutoregressiveAttention(dim=DIM, local_attn_window_size=4, routed_window_size=4,
                                           num_routed_queries=2, num_routed_key_values=2,
                                           num_experts=2, dim_head=8, heads=2)  # fmt: skip
    return Example(TokenHead(moa), (_randn(BATCH, SEQ, 4),), token_ce, (_tokens(seed=1),))


@case("hierarchical-transformer", "simple_hierarchical_transformer",
      "HierarchicalTransformer: tokens pooled to 2x coarser streams, local windows")  # fmt: skip
def _hierarchical() -> Example:
    from simple_hierarchical_transformer import HierarchicalTransformer

    torch.manual_seed(0)
    model = HierarchicalTransformer(num_tokens=VOCAB, dim=DIM, depth=2, dim_head=8, heads=2,
                                    seq_len=SEQ, hierarchies=(1, 2),
                                    window_sizes=(4, None))  # fmt: skip
    return _lm_example(model)


def _bs_roformer(kind: str, **kw) -> Example:
    import bs_roformer

    torch.manual_seed(0)
    model = getattr(bs_roformer, kind)(dim=16, depth=1, time_transformer_depth=1,
                                       freq_transformer_depth=1, dim_head=8, heads=2,
                                       stft_n_fft=64, stft_hop_length=16, stft_win_length=64,
                                       **kw)  # fmt: skip
    audio, target = _randn(BATCH, 256), _randn(BATCH, 256, seed=1)
    # (its loss: the L1 loss of the waveform and of multi-resolution STFTs, means over the
    # batch)
    return Example(model, (audio, target), lambda loss: loss, (), "mean",
                   call=lambda m, x, y: m(x, target=y), batch_loss=True)  # fmt: skip


@case("bs-roformer", "bs_roformer",
      "BS-RoFormer: complex STFT, band-split, axial time and frequency attention, a mask")  # fmt: skip
def _bs_roformer_plain() -> Example:
    return _bs_roformer("BSRoformer", dim_freqs_in=33, freqs_per_bands=(8, 8, 8, 9),
                        num_residual_streams=1, multi_stft_resolutions_window_sizes=(64, 32),
                        multi_stft_hop_size=16)  # fmt: skip


@case("bs-roformer-hyper", "bs_roformer", "BS-RoFormer, 2 residual streams (hyper-connections)")
def _bs_roformer_hyper() -> Example:
    return _bs_roformer("BSRoformer", dim_freqs_in=33, freqs_per_bands=(8, 8, 8, 9),
                        num_residual_streams=2, multi_stft_resolutions_window_sizes=(64, 32),
                        multi_stft_hop_size=16)  # fmt: skip


@case("mel-band-roformer", "bs_roformer",
      "Mel-Band RoFormer: overlapping mel bands gathered and scattered back, value residuals")  # fmt: skip
def _mel_band_roformer() -> Example:
    return _bs_roformer("MelBandRoformer", dim_freqs_in=33, num_bands=4, sample_rate=8000,
                        num_residual_streams=1, attn_dropout=0.0, ff_dropout=0.0,
                        multi_stft_resolutions_window_sizes=(64, 32),
                        multi_stft_hop_size=16)  # fmt: skip


def _fno(kind: str, **kw) -> Example:
    import neuralop.models

    torch.manual_seed(0)
    model = getattr(neuralop.models, kind)(in_channels=1, out_channels=1, hidden_channels=8,
                                           n_layers=2, **kw)  # fmt: skip
    for param in model.parameters():  # (.double() leaves the complex spectral weights)
        if param.is_complex():
            param.data = param.data.to(torch.complex128)

    # (its users' loss: neuralop.losses.LpLoss, each example's relative L2 error, summed)
    def relative_l2(pred: Tensor, target: Tensor) -> Tensor:
        return (pred - target).flatten(1).norm(dim=1) / target.flatten(1).norm(dim=1)

    side = kw.get("n_modes", (4, 4))
    shape = (1, 16) if len(side) == 1 else (1, 16, 16)
    return Example(model, (_randn(BATCH, *shape),), relative_l2, (_randn(BATCH, *shape, seed=1),))


@case("fno", "neuralop", "FNO: spectral convolutions (complex weights, rfft), a grid embedding")
def _fno2d() -> Example:
    return _fno("FNO", n_modes=(4, 4))


@case("fno-1d", "neuralop", "FNO on 1D signals, soft-gated channel MLPs")
def _fno1d() -> Example:
    return _fno("FNO", n_modes=(4,))


@case("tfno", "neuralop", "TFNO: spectral weights as a Tucker factorization (tensorly)")
def _tfno() -> Example:
    return _fno("TFNO", n_modes=(4, 4), factorization="tucker", rank=0.5)


def _xlstm_config(**kw):
    from xlstm import (
        FeedForwardConfig,
        mLSTMBlockConfig,
        mLSTMLayerConfig,
        sLSTMBlockConfig,
        sLSTMLayerConfig,
    )

    mlstm = mLSTMBlockConfig(mlstm=mLSTMLayerConfig(conv1d_kernel_size=2, qkv_proj_blocksize=4,
                                                    num_heads=2))  # fmt: skip
    slstm = sLSTMBlockConfig(slstm=sLSTMLayerConfig(backend="vanilla", num_heads=2,
                                                    conv1d_kernel_size=2,
                                                    bias_init="powerlaw_blockdependent"),
                             feedforward=FeedForwardConfig(proj_factor=1.3, act_fn="gelu"))  # fmt: skip
    return dict(mlstm_block=mlstm, slstm_block=slstm, context_length=SEQ, embedding_dim=16,
                **kw)  # fmt: skip


@case("xlstm-lm", "xlstm", "xLSTM: an mLSTM block (matrix memory), an sLSTM block (vanilla)")
def _xlstm_lm() -> Example:
    from xlstm import xLSTMLMModel, xLSTMLMModelConfig

    torch.manual_seed(0)
    config = xLSTMLMModelConfig(vocab_size=VOCAB, num_blocks=2, slstm_at=[1], **_xlstm_config())
    return _lm_example(xLSTMLMModel(config))


@case("xlstm-mlstm", "xlstm", "xLSTM block stack of mLSTM blocks alone (parallel form)")
def _xlstm_mlstm() -> Example:
    from xlstm import xLSTMBlockStack, xLSTMBlockStackConfig

    torch.manual_seed(0)
    config = xLSTMBlockStackConfig(num_blocks=2, slstm_at=[], **_xlstm_config())
    stack = xLSTMBlockStack(config)
    proj, head = nn.Linear(4, 16), nn.Linear(16, CLASSES)
    model = nn.Sequential(proj, stack, head)
    return Example(model, (_randn(BATCH, SEQ, 4),), lambda out, y: class_ce(out.mean(1), y),
                   (_labels(),), "mean")  # fmt: skip


@case("titans-neural-memory", "titans_pytorch",
      "Titans NeuralMemory: an MLP memorizing each chunk at test time (torch.func grads)")  # fmt: skip
def _titans_memory() -> Example:
    from titans_pytorch import NeuralMemory

    torch.manual_seed(0)
    return Example(TokenClassifier(NeuralMemory(dim=DIM, chunk_size=4)), (_tokens(),), class_ce,
                   (_labels(),), "mean")  # fmt: skip


@case("titans-mac", "titans_pytorch",
      "Titans MemoryAsContextTransformer: persistent and long-term memory tokens")  # fmt: skip
def _titans_mac() -> Example:
    from titans_pytorch import MemoryAsContextTransformer

    torch.manual_seed(0)
    model = MemoryAsContextTransformer(num_tokens=VOCAB, dim=DIM, depth=1, segment_len=4,
                                       num_persist_mem_tokens=2, num_longterm_mem_tokens=2,
                                       dim_head=8, heads=2)  # fmt: skip
    return _lm_example(model)


# -- a fifth round: lucidrains' reversible, ring, sparse and feedback transformers, gated state
# spaces, GLOM, Hamburger, involution, E(n)-equivariant and few-shot models ----------------------


class DefaultFloat64(nn.Module):
    """A model run with float64 as torch's default dtype: flash attention written in torch
    (memory-efficient-attention-pytorch's, ring-attention-pytorch's) keeps its running row
    sums and maxima in the default dtype, and fills them with the float64 input's most negative
    value, which float32 cannot hold."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *xs: Tensor) -> Tensor:
        was = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            return self.model(*xs)
        finally:
            torch.set_default_dtype(was)


@case("mea-reversible", "memory_efficient_attention_pytorch",
      "memory-efficient-attention-pytorch: reversible layers, chunked checkpointed attention")  # fmt: skip
def _mea_reversible() -> Example:
    from memory_efficient_attention_pytorch.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(num_tokens=VOCAB, max_seq_len=SEQ, dim=DIM, depth=2, causal=True,
                        dim_head=8, heads=4, use_flash_attn=False, q_bucket_size=4,
                        k_bucket_size=4)  # fmt: skip
    return _lm_example(model)


@case("mea-flash", "memory_efficient_attention_pytorch",
      "FlashAttention in torch: its own autograd.Function, blocks of 4 queries and keys")  # fmt: skip
def _mea_flash() -> Example:
    from memory_efficient_attention_pytorch import FlashAttention

    torch.manual_seed(0)
    attn = FlashAttention(dim=DIM, dim_head=8, heads=4, causal=True, q_bucket_size=4,
                          k_bucket_size=4)  # fmt: skip
    return Example(DefaultFloat64(ResidualLM(attn)), (_tokens(),), token_ce, (_tokens(seed=1),))


@case("ring-flash", "ring_attention_pytorch",
      "RingTransformer on one process: flash attention by buckets (its own autograd.Function)")  # fmt: skip
def _ring_flash() -> Example:
    from ring_attention_pytorch import RingTransformer

    torch.manual_seed(0)
    model = RingTransformer(num_tokens=VOCAB, dim=DIM, depth=2, causal=True, dim_head=8, heads=4,
                            bucket_size=4, use_cuda_kernel=False)  # fmt: skip
    return _lm_example(DefaultFloat64(model))


@case("native-sparse-attention", "native_sparse_attention_pytorch",
      "Native Sparse Attention: compressed blocks, top-k selected blocks, a sliding window")  # fmt: skip
def _native_sparse_attention() -> Example:
    from native_sparse_attention_pytorch import SparseAttention

    torch.manual_seed(0)
    attn = SparseAttention(dim=DIM, dim_head=8, heads=4, sliding_window_size=2,
                           compress_block_size=2, compress_block_sliding_stride=2,
                           selection_block_size=2, num_selected_blocks=2,
                           causal=True)  # fmt: skip
    return Example(ResidualLM(attn), (_tokens(),), token_ce, (_tokens(seed=1),))


@case("gss-lm", "gated_state_spaces_pytorch",
      "Gated State Spaces: a diagonal state space's kernel, a convolution by FFT")  # fmt: skip
def _gss_lm() -> Example:
    from gated_state_spaces_pytorch import GatedStateSpacesLM

    torch.manual_seed(0)
    return _lm_example(GatedStateSpacesLM(num_tokens=VOCAB, dim=DIM, depth=2, dss_kernel_N=16,
                                          dss_kernel_H=16, dim_expansion_factor=2))  # fmt: skip


@case("compressive-transformer", "compressive_transformer_pytorch",
      "Compressive Transformer: memories and memories compressed by a Conv1d, GRU gating")  # fmt: skip
def _compressive() -> Example:
    from compressive_transformer_pytorch import CompressiveTransformer

    torch.manual_seed(0)
    model = CompressiveTransformer(num_tokens=VOCAB, dim=DIM, seq_len=SEQ, depth=2, heads=4,
                                   mem_len=SEQ, cmem_ratio=4, memory_layers=[2])  # fmt: skip
    return _lm_example(model)


@case("feedback-transformer", "feedback_transformer_pytorch",
      "Feedback Transformer: segments of 2 attend to a memory of all layers' past outputs")  # fmt: skip
def _feedback() -> Example:
    from feedback_transformer_pytorch import FeedbackTransformer

    torch.manual_seed(0)
    model = FeedbackTransformer(num_tokens=VOCAB, dim=DIM, depth=2, seq_len=2, mem_len=4,
                                heads=4, dim_head=8)  # fmt: skip
    return _lm_example(model)


class Pooled(nn.Module):
    """A model's output, its mean over every dimension but the batch's first and last, a
    linear head: a classifier around an encoder of any output shape."""

    def __init__(self, model: nn.Module, dim: int = DIM):
        super().__init__()
        self.model, self.head = model, nn.Linear(dim, CLASSES)

    def forward(self, *xs: Tensor) -> Tensor:
        return self.head(self.model(*xs).flatten(1, -2).mean(1))


@case("glom", "glom_pytorch", "GLOM: columns of levels, bottom-up, top-down and consensus, 4 steps")
def _glom() -> Example:
    from glom_pytorch import Glom

    torch.manual_seed(0)
    glom = Glom(dim=16, levels=2, image_size=8, patch_size=4)
    return Example(Pooled(glom, 16), (_randn(BATCH, 3, 8, 8),), class_ce, (_labels(),), "mean")


@case("hamburger", "hamburger_pytorch",
      "Hamburger: a matrix decomposition (NMF) by 3 steps, the last one differentiated")  # fmt: skip
def _hamburger() -> Example:
    from hamburger_pytorch import Hamburger

    torch.manual_seed(0)
    return _image_classifier(Hamburger(dim=8, n=64, inner_dim=16, ratio=4, K=3))


@case("involution", "involution_pytorch", "Involution: kernels generated per pixel, unfolded")
def _involution() -> Example:
    from involution_pytorch import Inv2d

    torch.manual_seed(0)
    return _image_classifier(Inv2d(channels=8, kernel_size=3, stride=1, group_ch=4, red_ratio=2))


class EquivariantRegressor(nn.Module):
    """EnTransformer on atoms and coordinates: a logit per atom of its features, and its new
    coordinates."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model, self.head = model, nn.Linear(DIM, CLASSES)

    def forward(self, atoms: Tensor, coors: Tensor) -> Tensor:
        feats, coors = self.model(atoms, coors)
        return torch.cat((self.head(feats), coors), -1)


def _en_loss(out: Tensor, labels: Tensor, target: Tensor) -> Tensor:
    return token_ce(out[..., :CLASSES], labels) + mse(out[..., CLASSES:], target)


@case("en-transformer", "en_transformer",
      "E(n)-equivariant transformer: features and coordinates, 3 nearest neighbors")  # fmt: skip
def _en_transformer() -> Example:
    from en_transformer import EnTransformer

    torch.manual_seed(0)
    model = EnTransformer(num_tokens=10, dim=DIM, depth=2, dim_head=32, heads=2, neighbors=3,
                          coors_hidden_dim=8)  # fmt: skip
    atoms = torch.randint(0, 10, (BATCH, 6), generator=_gen(2))
    return Example(EquivariantRegressor(model), (atoms, _randn(BATCH, 6, 3)), _en_loss,
                   (torch.randint(0, CLASSES, (BATCH, 6), generator=_gen(3)),
                    _randn(BATCH, 6, 3, seed=4)), "mean")  # fmt: skip


class FewShot(nn.Module):
    """CrossTransformer's README: a small ConvNet encodes each example's query image and its
    own support images, 2 classes of 2, in one call of ``[batch * 4, ...]``; the query's
    distances to each class are the logits."""

    def __init__(self):
        super().__init__()
        from cross_transformers_pytorch import CrossTransformer

        self.encoder = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
                                     nn.Conv2d(8, 8, 3, stride=2, padding=1))  # fmt: skip
        self.cross = CrossTransformer(dim=8, dim_key=4, dim_value=4)

    def forward(self, query: Tensor, supports: Tensor) -> Tensor:
        return -self.cross(self.encoder, query, supports)


@case("cross-transformer", "cross_transformers_pytorch",
      "CrossTransformer: few-shot, each example's support images encoded in one batch")  # fmt: skip
def _cross_transformer() -> Example:
    torch.manual_seed(0)
    query, supports = _randn(BATCH, 3, 8, 8), _randn(BATCH, 2, 2, 3, 8, 8, seed=1)
    return Example(FewShot(), (query, supports), class_ce, (_labels(2),), "mean")


@case("fast-transformer", "fast_transformer_pytorch",
      "Fastformer: additive attention, its projections tied across layers, padding masks")  # fmt: skip
def _fast_transformer() -> Example:
    from fast_transformer_pytorch import FastTransformer

    torch.manual_seed(0)
    # (absolute positions: its rotary embedding calls rotary-embedding-torch with an argument
    # that its current version lacks)
    model = FastTransformer(num_tokens=VOCAB, dim=DIM, depth=2, max_seq_len=SEQ, heads=4,
                            dim_head=8, absolute_pos_emb=True)  # fmt: skip
    mask = torch.arange(SEQ) < torch.tensor([[SEQ], [5], [3]])  # (each example's length)
    return Example(model, (_tokens(), mask), token_ce, (_tokens(seed=1),))


@case("hrm", "HRM",
      "Hierarchical Reasoning Model: 2 x-transformers encoders, steps under no_grad, one not")  # fmt: skip
def _hrm() -> Example:
    from HRM import HRM

    torch.manual_seed(0)
    net = {"dim": DIM, "depth": 1, "heads": 2, "attn_dim_head": 8}
    return _lm_example(HRM(networks=[net, dict(net)], dim=DIM, num_tokens=VOCAB,
                           reasoning_steps=2, relative_period=2))  # fmt: skip


class CrossPair(nn.Module):
    """Two token sequences of different lengths, each embedded, attending to each other."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.embed, self.context = nn.Embedding(VOCAB, DIM), nn.Embedding(VOCAB, 16)
        self.layer, self.head = layer, nn.Linear(DIM + 16, CLASSES)

    def forward(self, ids: Tensor, context: Tensor) -> Tensor:
        x, c = self.layer(self.embed(ids), self.context(context))
        return self.head(torch.cat((x.mean(1), c.mean(1)), -1))


@case("bidirectional-cross-attention", "bidirectional_cross_attention",
      "bidirectional cross attention: one similarity matrix, softmaxed both ways")  # fmt: skip
def _bidirectional() -> Example:
    from bidirectional_cross_attention import BidirectionalCrossAttentionTransformer

    torch.manual_seed(0)
    layer = BidirectionalCrossAttentionTransformer(dim=DIM, context_dim=16, depth=2, heads=2,
                                                   dim_head=8, talking_heads=True)  # fmt: skip
    return Example(CrossPair(layer), (_tokens(), _tokens(5, seed=2)), class_ce, (_labels(),),
                   "mean")  # fmt: skip


@case("isab", "isab_pytorch", "Set Transformer's induced set attention: learned inducing points")
def _isab() -> Example:
    from isab_pytorch import ISAB

    torch.manual_seed(0)
    return Example(TokenClassifier(ISAB(dim=DIM, heads=4, num_induced_points=4)), (_tokens(),),
                   class_ce, (_labels(),), "mean")  # fmt: skip


# -- tensors let out of a call of a module without a rule: hyper-connections' streams in
# x-transformers, a residual FSQ, ST-MoE's block of feedforwards around its experts -------------


case("xt-hyper-connections-views", "x_transformers",
     "4 residual streams, queries, keys and values each read from a mix of their own")(
    lambda: _xt_lm("Decoder", num_residual_streams=4, qkv_receive_diff_residuals=True)
)  # fmt: skip


def _residual_fsq():
    from vector_quantize_pytorch import ResidualFSQ

    return ResidualFSQ(dim=8, levels=[5, 5, 3], num_quantizers=2)


case("residual-fsq", "vector_quantize_pytorch", "ResidualFSQ: 2 quantizers, scaled residuals")(
    lambda: _vq(_residual_fsq)
)


@case("st-moe-block", "st_moe_pytorch",
      "ST-MoE's SparseMoEBlock: feedforwards before and after the experts, its losses returned")  # fmt: skip
def _st_moe_block() -> Example:
    from st_moe_pytorch import MoE, SparseMoEBlock

    torch.manual_seed(0)
    moe = MoE(dim=16, num_experts=4, expert_hidden_mult=2, threshold_train=1e-30)
    return _moe_lm(SparseMoEBlock(moe, add_ff_before=True, add_ff_after=True))


# -- a sixth round: x-transformers' newer residuals and norms, vit-pytorch's other ViTs, a
# BiLSTM-CRF tagger, Stable-Baselines3's policies, the Segment Anything model, MMDiT,
# Taylor-series linear attention, invariant point attention, point transformers, SegFormer


XT_DECODERS_SIXTH = {
    "xt-dynamic-tanh": {"use_dynamic_tanh": True},
    "xt-head-scale": {"attn_head_scale": True, "ff_post_act_ln": True},
    "xt-unet-skips": {"unet_skips": True},
    "xt-integrate-layers": {"integrate_layers": True},
    "xt-reinject-input": {"reinject_input": True, "learned_reinject_input_gate": True},
    "xt-orthog-residual": {"orthog_residual": True},
    "xt-aggregated-residuals": {
        "attn_aggregated_residuals": True,
        "attn_aggregated_residual_kwargs": {"lora_rank": 8},
    },
    "xt-gated-multi-residual": {
        "gated_multi_residual": True,
        "num_residual_streams": 2,
        "residual_fn_kwargs": {"read_gate_rank": 4},
    },
    "xt-laser": {"attn_laser": True},
    "xt-data-dependent-alibi": {"attn_data_dependent_alibi": True},
    "xt-cope": {"attn_use_cope": True},
    "xt-selective": {"attn_selective": True},
    "xt-polar-pos": {"polar_pos_emb": True},
    "xt-pre-and-post-norm": {"pre_and_post_norm": True},
}
for _name, _kw in XT_DECODERS_SIXTH.items():
    case(_name, "x_transformers")(lambda _kw=_kw: _xt_lm("Decoder", **_kw))


@case("xt-adaptive-layernorm", "x_transformers",
      "adaptive LayerNorm and layerscale (DiT's ada-LN-zero) from a condition per example")  # fmt: skip
def _xt_adaptive() -> Example:
    import x_transformers as xt

    torch.manual_seed(0)
    layers = xt.Decoder(dim=DIM, depth=2, heads=4, attn_dim_head=8, use_adaptive_layernorm=True,
                        use_adaptive_layerscale=True, dim_condition=8)  # fmt: skip
    model = xt.TransformerWrapper(num_tokens=VOCAB, max_seq_len=16, attn_layers=layers)
    return Example(model, (_tokens(), _randn(BATCH, 8, seed=2)), token_ce, (_tokens(seed=1),),
                   call=lambda m, ids, cond: m(ids, condition=cond))  # fmt: skip


@case("xt-autoregressive-wrapper", "x_transformers",
      "AutoregressiveWrapper: the library's own next-token loss of the batch")  # fmt: skip
def _xt_autoregressive() -> Example:
    import x_transformers as xt

    torch.manual_seed(0)
    net = xt.TransformerWrapper(num_tokens=VOCAB, max_seq_len=16,
                                attn_layers=xt.Decoder(dim=DIM, depth=2, heads=4,
                                                       attn_dim_head=8))  # fmt: skip
    return Example(xt.AutoregressiveWrapper(net), (_tokens(SEQ + 1),), lambda loss: loss,
                   reduction="mean", batch_loss=True)  # fmt: skip


SIXTH_VITS = {
    # name: (module, class, extra arguments, input shape)
    "cait": ("cait", "CaiT", {"image_size": 16, "patch_size": 4, "cls_depth": 1}, (3, 16, 16)),
    "deepvit": ("deepvit", "DeepViT", {"image_size": 16, "patch_size": 4}, (3, 16, 16)),
    "xcit": (
        "xcit",
        "XCiT",
        {"image_size": 16, "patch_size": 4, "cls_depth": 1, "local_patch_kernel_size": 3},
        (3, 16, 16),
    ),  # fmt: skip
    "vit-small-dataset": (
        "vit_for_small_dataset",
        "ViT",
        {"image_size": 16, "patch_size": 4},
        (3, 16, 16),
    ),  # fmt: skip
    "simple-vit-registers": (
        "simple_vit_with_register_tokens",
        "SimpleViT",
        {"image_size": 16, "patch_size": 4, "num_register_tokens": 2},
        (3, 16, 16),
    ),  # fmt: skip
}
for _name, (_module, _cls, _kw, _shape) in SIXTH_VITS.items():
    case(_name, "vit_pytorch")(
        lambda m=_module, c=_cls, kw=_kw, shape=_shape: _vit_example(
            getattr(_vit_module(m), c)(**{**VIT, **kw}), *shape
        )
    )


@case("cross-vit", "vit_pytorch", "CrossViT: two patch sizes, their class tokens cross-attending")
def _cross_vit() -> Example:
    torch.manual_seed(0)
    model = _vit_module("cross_vit").CrossViT(
        image_size=16, num_classes=CLASSES, sm_dim=DIM, sm_patch_size=4, sm_enc_depth=1,
        sm_enc_heads=4, sm_enc_mlp_dim=64, sm_enc_dim_head=8, lg_dim=16, lg_patch_size=8,
        lg_enc_depth=1, lg_enc_heads=2, lg_enc_mlp_dim=32, lg_enc_dim_head=8, cross_attn_depth=1,
        cross_attn_heads=2, cross_attn_dim_head=8, depth=1, dropout=0.0, emb_dropout=0.0,
    )  # fmt: skip
    return _vit_example(model, 3, 16, 16)


@case("t2t-vit", "vit_pytorch", "T2T-ViT: tokens-to-token by nn.Unfold, soft splits")
def _t2t_vit() -> Example:
    torch.manual_seed(0)
    model = _vit_module("t2t").T2TViT(dim=DIM, image_size=16, depth=2, heads=4, mlp_dim=64,
                                       num_classes=CLASSES,
                                       t2t_layers=((3, 2), (3, 2)))  # fmt: skip
    return _vit_example(model, 3, 16, 16)


@case("cct", "vit_pytorch", "Compact Convolutional Transformer: conv tokenizer, sequence pooling")
def _cct() -> Example:
    torch.manual_seed(0)
    model = _vit_module("cct").CCT(img_size=(16, 16), embedding_dim=DIM, n_conv_layers=2,
                                   kernel_size=3, stride=1, padding=1, pooling_kernel_size=3,
                                   pooling_stride=2, pooling_padding=1, num_layers=2,
                                   num_heads=4, mlp_ratio=2.0, num_classes=CLASSES,
                                   positional_embedding="learnable")  # fmt: skip
    return _vit_example(model, 3, 16, 16)


@case("max-vit", "vit_pytorch", "MaxViT: MBConv (BatchNorm), block and grid attention")
def _max_vit() -> Example:
    torch.manual_seed(0)
    model = _vit_module("max_vit").MaxViT(num_classes=CLASSES, dim_conv_stem=8, dim=16,
                                          dim_head=8, depth=(1,), window_size=2)  # fmt: skip
    return _vit_example(model, 3, 16, 16)


class CRFTagger(nn.Module):
    """A BiLSTM-CRF tagger as pytorch-crf's users write it: embeddings, a bidirectional LSTM,
    emissions by a Linear, and the CRF's negative log-likelihood of the gold tags, each
    example's own (``reduction="none"``) over its unpadded tokens."""

    def __init__(self, tags: int = 5):
        super().__init__()
        from torchcrf import CRF

        self.embed = nn.Embedding(VOCAB, 16)
        self.lstm = nn.LSTM(16, 8, batch_first=True, bidirectional=True)
        self.emit, self.crf = nn.Linear(16, tags), CRF(tags, batch_first=True)

    def forward(self, ids: Tensor, tags: Tensor, mask: Tensor) -> Tensor:
        emissions = self.emit(self.lstm(self.embed(ids))[0])
        return -self.crf(emissions, tags, mask=mask, reduction="none")


@case("crf-bilstm", "torchcrf", "BiLSTM-CRF tagger: the CRF's log-likelihood, padded sequences")
def _crf() -> Example:
    torch.manual_seed(0)
    mask = torch.arange(SEQ) < torch.tensor([[SEQ], [5], [3]])
    tags = torch.randint(0, 5, (BATCH, SEQ), generator=_gen(1))
    return Example(CRFTagger(), (_tokens(), tags, mask), lambda nll: nll)


class PPOLoss(nn.Module):
    """PPO's clipped surrogate, value and entropy terms of each example, as Stable-Baselines3's
    ``PPO.train`` computes them from ``policy.evaluate_actions`` (old log-probabilities and
    advantages given)."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, obs, actions, old_log_prob, advantages, returns):
        values, log_prob, entropy = self.policy.evaluate_actions(obs, actions)
        ratio = torch.exp(log_prob - old_log_prob)
        surrogate = torch.min(advantages * ratio, advantages * ratio.clamp(0.8, 1.2))
        return -surrogate + 0.5 * (returns - values.flatten()).pow(2) - 0.01 * entropy


def _in_float64(policy: nn.Module) -> nn.Module:
    """Stable-Baselines3 casts the observations to float32 (``preprocess_obs``); a pre-hook on
    the features extractor brings them to the sweep's float64 (they hold no parameter)."""
    policy.features_extractor.register_forward_pre_hook(lambda _, args: (args[0].double(),))
    return policy


def _sb3_policy(obs_space, action_space, **kw) -> nn.Module:
    from stable_baselines3.common.policies import ActorCriticPolicy

    return _in_float64(ActorCriticPolicy(obs_space, action_space, lambda _: 3e-4, **kw))


def _ppo(policy: nn.Module, obs: Tensor, actions: Tensor) -> Example:
    extra = _randn(3, BATCH, seed=3)
    inputs = (obs, actions, extra[0] - 2.0, extra[1], extra[2])
    return Example(PPOLoss(policy), inputs, lambda loss: loss, reduction="mean")


@case("sb3-ppo-gaussian", "stable_baselines3",
      "PPO's loss of an ActorCriticPolicy: a diagonal Gaussian, its log_std a parameter")  # fmt: skip
def _sb3_gaussian() -> Example:
    from gymnasium import spaces

    torch.manual_seed(0)
    policy = _sb3_policy(spaces.Box(-1, 1, (6,)), spaces.Box(-1, 1, (2,)),
                         net_arch={"pi": [16, 16], "vf": [16, 16]})  # fmt: skip
    return _ppo(policy, _randn(BATCH, 6), _randn(BATCH, 2, seed=1))


@case(
    "sb3-ppo-gsde",
    "stable_baselines3",
    "the same with generalized state-dependent exploration: the std from the features, by mm",
)
def _sb3_gsde() -> Example:
    from gymnasium import spaces

    torch.manual_seed(0)
    policy = _sb3_policy(spaces.Box(-1, 1, (6,)), spaces.Box(-1, 1, (2,)), use_sde=True,
                         net_arch={"pi": [16], "vf": [16]})  # fmt: skip
    return _ppo(policy, _randn(BATCH, 6), _randn(BATCH, 2, seed=1))


@case("sb3-ppo-cnn", "stable_baselines3",
      "PPO's loss of a CnnPolicy: NatureCNN on images, a categorical, a shared extractor")  # fmt: skip
def _sb3_cnn() -> Example:
    from gymnasium import spaces
    from stable_baselines3.common.policies import ActorCriticCnnPolicy

    torch.manual_seed(0)
    obs_space = spaces.Box(0, 255, (3, 36, 36), dtype="uint8")
    policy = _in_float64(ActorCriticCnnPolicy(obs_space, spaces.Discrete(4), lambda _: 3e-4,
                                              features_extractor_kwargs={"features_dim": 16},
                                              normalize_images=True))  # fmt: skip
    obs = torch.randint(0, 256, (BATCH, 3, 36, 36), generator=_gen(0)).double()
    return _ppo(policy, obs, torch.randint(0, 4, (BATCH,), generator=_gen(1)))


def _pe_in_dtype(cls: type) -> type:
    """Segment Anything's random Fourier positions, their coordinates cast to the dtype of
    its (parameter-free) Gaussian matrix rather than to float32."""

    class InDtype(cls):
        def _pe_encoding(self, coords: Tensor) -> Tensor:
            return super()._pe_encoding(coords.to(self.positional_encoding_gaussian_matrix))

    return InDtype


class SamFineTune(nn.Module):
    """Segment Anything fine-tuned on boxes as MedSAM's users do: the image encoder on the
    batch, then, as ``Sam.forward`` does, the prompt encoder and mask decoder image by image
    (the decoder repeats its image for each prompt), the low-resolution mask logits stacked."""

    def __init__(self):
        super().__init__()
        from functools import partial

        from segment_anything.modeling import (
            ImageEncoderViT,
            MaskDecoder,
            PromptEncoder,
            TwoWayTransformer,
        )

        self.encoder = ImageEncoderViT(img_size=32, patch_size=8, embed_dim=DIM, depth=2,
                                       num_heads=2, mlp_ratio=2.0, out_chans=16, qkv_bias=True,
                                       norm_layer=partial(nn.LayerNorm, eps=1e-6),
                                       use_rel_pos=True, window_size=2,
                                       global_attn_indexes=(1,))  # fmt: skip
        self.prompts = PromptEncoder(embed_dim=16, image_embedding_size=(4, 4),
                                     input_image_size=(32, 32), mask_in_chans=4)  # fmt: skip
        self.prompts.pe_layer.__class__ = _pe_in_dtype(type(self.prompts.pe_layer))
        self.decoder = MaskDecoder(transformer_dim=16, num_multimask_outputs=3,
                                   transformer=TwoWayTransformer(depth=2, embedding_dim=16,
                                                                 mlp_dim=32, num_heads=2),
                                   iou_head_depth=2, iou_head_hidden_dim=16)  # fmt: skip

    def forward(self, images: Tensor, boxes: Tensor) -> Tensor:
        embeddings = self.encoder(images)
        masks = []
        for embedding, box in zip(embeddings, boxes):
            sparse, dense = self.prompts(points=None, boxes=box[None], masks=None)
            low_res, _ = self.decoder(embedding[None], self.prompts.get_dense_pe(), sparse,
                                      dense, multimask_output=False)  # fmt: skip
            masks.append(low_res)
        return torch.cat(masks)


@case("sam", "segment_anything",
      "Segment Anything: windowed ViT with relative positions, box prompts, image by image")  # fmt: skip
def _sam() -> Example:
    torch.manual_seed(0)
    boxes = torch.tensor([[2.0, 3.0, 20.0, 25.0], [0.0, 0.0, 31.0, 31.0], [8.0, 4.0, 16.0, 30.0]])
    target = (_randn(BATCH, 1, 16, 16, seed=1) > 0).double()

    def losses(logits: Tensor, target: Tensor) -> Tensor:
        bce = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
        return bce.flatten(1).mean(1)

    return Example(SamFineTune(), (_randn(BATCH, 3, 32, 32), boxes.double()), losses, (target,),
                   "mean")  # fmt: skip


class MMDiTDenoiser(nn.Module):
    """MMDiT's joint attention of text and image tokens, conditioned on each example's
    timestep embedding; the image tokens' output predicts the noise."""

    def __init__(self, **kw):
        super().__init__()
        from mmdit import MMDiT

        self.time = nn.Sequential(nn.Linear(1, 16), nn.SiLU())
        self.mmdit = MMDiT(depth=2, dim_text=16, dim_image=DIM, dim_cond=16, dim_head=8, heads=2,
                           qk_rmsnorm=True, **kw)  # fmt: skip

    def forward(self, text: Tensor, image: Tensor, t: Tensor, mask: Tensor) -> Tensor:
        _, image = self.mmdit(text_tokens=text, image_tokens=image, text_mask=mask,
                              time_cond=self.time(t[:, None]))  # fmt: skip
        return image


def _mmdit(**kw) -> Example:
    torch.manual_seed(0)
    mask = torch.arange(5) < torch.tensor([[5], [3], [4]])
    inputs = (_randn(BATCH, 5, 16), _randn(BATCH, SEQ, DIM, seed=1), _randn(BATCH, seed=2), mask)
    return Example(MMDiTDenoiser(**kw), inputs, mse, (_randn(BATCH, SEQ, DIM, seed=3),), "mean")


case("mmdit", "mmdit", "MMDiT: joint text-image attention, adaptive norms from the timestep")(
    lambda: _mmdit(num_residual_streams=1)
)
case("mmdit-hyper", "mmdit", "MMDiT with 4 residual streams (hyper-connections), registers")(
    lambda: _mmdit(num_register_tokens=2)
)


@case("taylor-linear-attention", "taylor_series_linear_attention",
      "Taylor series linear attention, rotary, in a token classifier")  # fmt: skip
def _taylor() -> Example:
    from taylor_series_linear_attention import TaylorSeriesLinearAttn

    torch.manual_seed(0)
    attn = TaylorSeriesLinearAttn(dim=DIM, dim_head=8, heads=4, rotary_emb=True)
    return Example(TokenClassifier(attn), (_tokens(),), class_ce, (_labels(),), "mean")


@case("taylor-vit", "taylor_series_linear_attention", "its ViT of Taylor series attention")
def _taylor_vit() -> Example:
    from taylor_series_linear_attention.vit import ViT

    torch.manual_seed(0)
    model = ViT(image_size=16, patch_size=4, num_classes=CLASSES, dim=DIM, depth=2, heads=4,
                dim_head=8, ff_mult=2)  # fmt: skip
    return _vit_example(model, 3, 16, 16)


class IPAFold(nn.Module):
    """Invariant point attention as AlphaFold2's structure module uses it: single and pair
    representations of each protein, its residues' frames (rotations, translations), two IPA
    blocks, each residue's point predicted in its frame and moved to global coordinates."""

    def __init__(self):
        super().__init__()
        from invariant_point_attention import IPABlock

        self.blocks = nn.ModuleList(IPABlock(dim=16, heads=2, scalar_key_dim=8,
                                             scalar_value_dim=8, point_key_dim=2,
                                             point_value_dim=2, pairwise_repr_dim=8,
                                             require_pairwise_repr=True)
                                    for _ in range(2))  # fmt: skip
        self.to_points = nn.Linear(16, 3)

    def forward(self, single, pair, rotations, translations, mask):
        for block in self.blocks:
            single = block(single, pairwise_repr=pair, rotations=rotations,
                           translations=translations, mask=mask)  # fmt: skip
        local = self.to_points(single)
        return torch.einsum("b n c, b n r c -> b n r", local, rotations) + translations


@case("ipa", "invariant_point_attention",
      "invariant point attention: residue frames, pair biases, points in the frames, masks")  # fmt: skip
def _ipa() -> Example:
    torch.manual_seed(0)
    n = 6
    mask = torch.arange(n) < torch.tensor([[n], [4], [5]])
    rotations = torch.linalg.qr(_randn(BATCH, n, 3, 3, seed=2)).Q  # (orthogonal frames)
    inputs = (_randn(BATCH, n, 16), _randn(BATCH, n, n, 8, seed=1), rotations,
              _randn(BATCH, n, 3, seed=3), mask)  # fmt: skip
    return Example(IPAFold(), inputs, mse, (_randn(BATCH, n, 3, seed=4),), "mean")


class PointClassifier(nn.Module):
    """Point features lifted, a point transformer layer (each point attending to its nearest
    neighbours of its own cloud), max-pooled over the points, a head."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.lift, self.layer, self.head = nn.Linear(3, DIM), layer, nn.Linear(DIM, CLASSES)

    def forward(self, feats: Tensor, pos: Tensor, mask: Tensor) -> Tensor:
        return self.head(self.layer(self.lift(feats), pos, mask=mask).amax(1))


def _points(layer: nn.Module) -> Example:
    torch.manual_seed(0)
    mask = torch.arange(10) < torch.tensor([[10], [7], [9]])
    inputs = (_randn(BATCH, 10, 3), _randn(BATCH, 10, 3, seed=1), mask)
    return Example(PointClassifier(layer), inputs, class_ce, (_labels(),), "mean")


@case("point-transformer", "point_transformer_pytorch",
      "Point Transformer: vector attention over each point's 4 nearest neighbours")  # fmt: skip
def _point_transformer() -> Example:
    from point_transformer_pytorch import PointTransformerLayer

    return _points(PointTransformerLayer(dim=DIM, pos_mlp_hidden_dim=16,
                                         attn_mlp_hidden_mult=2, num_neighbors=4))  # fmt: skip


@case("point-transformer-multihead", "point_transformer_pytorch",
      "multi-head Point Transformer, neighbours within a radius")  # fmt: skip
def _point_transformer_mh() -> Example:
    from point_transformer_pytorch import MultiheadPointTransformerLayer

    return _points(MultiheadPointTransformerLayer(dim=DIM, heads=4, dim_head=8,
                                                  num_neighbors=4))  # fmt: skip


@case("segformer", "segformer_pytorch",
      "SegFormer: overlapping patch merging by nn.Unfold, reduced keys, a per-pixel loss")  # fmt: skip
def _segformer() -> Example:
    from segformer_pytorch import Segformer

    torch.manual_seed(0)
    model = Segformer(dims=(8, 8, 16, 16), heads=(1, 1, 2, 2), ff_expansion=(2, 2, 2, 2),
                      reduction_ratio=(4, 2, 1, 1), num_layers=1, channels=3, decoder_dim=16,
                      num_classes=CLASSES)  # fmt: skip
    labels = torch.randint(0, CLASSES, (BATCH, 8, 8), generator=_gen(1))

    def losses(logits: Tensor, labels: Tensor) -> Tensor:  # (the logits at a quarter's size)
        return F.cross_entropy(logits, labels, reduction="none").flatten(1).mean(1)

    return Example(model, (_randn(BATCH, 3, 32, 32),), losses, (labels,), "mean")


class SEANetAutoencoder(nn.Module):
    """EnCodec's SEANet encoder and decoder without the quantizer between them (its codebooks
    are k-means-initialized from the batch and updated by EMA in every training forward):
    strided convolutions, residual units, an LSTM over the latent frames."""

    def __init__(self, **kw):
        super().__init__()
        from encodec.modules import SEANetDecoder, SEANetEncoder

        kw = dict(channels=1, dimension=8, n_filters=4, n_residual_layers=1, ratios=[4, 2],
                  lstm=1, **kw)  # fmt: skip
        self.encoder, self.decoder = SEANetEncoder(**kw), SEANetDecoder(**kw)

    def forward(self, audio: Tensor) -> Tensor:
        return self.decoder(self.encoder(audio))


def _encodec(**kw) -> Example:
    torch.manual_seed(0)
    audio = _randn(BATCH, 1, 64)

    def losses(out: Tensor, target: Tensor) -> Tensor:  # (EnCodec's time-domain L1, and L2)
        return (out - target).abs().flatten(1).mean(1) + mse(out, target)

    return Example(SEANetAutoencoder(**kw), (audio,), losses, (audio,), "mean")


case("encodec-seanet", "encodec",
     "EnCodec's SEANet autoencoder: torch.nn.utils.weight_norm (a pre-hook), reflect padding, "
     "an LSTM")(lambda: _encodec())  # fmt: skip
case("encodec-seanet-causal", "encodec", "the same, causal: padded on the left only")(
    lambda: _encodec(causal=True)
)
case("encodec-seanet-groupnorm", "encodec", "the same, a GroupNorm over time in each convolution")(
    lambda: _encodec(norm="time_group_norm")
)


def _rows(tensors: tuple[Tensor, ...], b: int) -> tuple[Tensor, ...]:
    return tuple(t[b : b + 1] for t in tensors)


def _output(ex: Example, inputs: tuple[Tensor, ...]) -> Tensor:
    out = ex.model(*inputs) if ex.call is None else ex.call(ex.model, *inputs)
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not isinstance(out, Tensor):
        raise Skip(f"{type(ex.model).__name__} returns no tensor: {type(out).__name__}")
    return out


def total_loss(ex: Example, inputs=None, targets=None) -> Tensor:
    inputs = ex.inputs if inputs is None else inputs
    targets = ex.targets if targets is None else targets
    losses = ex.losses(_output(ex, inputs), *targets)
    if ex.batch_loss:
        return losses
    return losses.sum() if ex.reduction == "sum" else losses.mean()


def prepare(model: nn.Module) -> nn.Module:
    model = model.double().train()
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
        if isinstance(getattr(m, "dropout_prob", None), float):
            m.dropout_prob = 0.0  # (diffusers' label dropout, for classifier-free guidance)
        if isinstance(getattr(m, "drop_prob", None), float):
            m.drop_prob = 0.0  # (stochastic depth: timm's DropPath and its copies)
    return model


def own_gradients(ex: Example) -> dict[str, Tensor]:
    """Each example's own gradient, ``{name: [batch, *shape]}``, by the oracle's loop."""
    n = len(ex.inputs)
    everything = (*ex.inputs, *ex.targets)

    class Whole(nn.Module):  # the loop slices every tensor, the model's and the loss's
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, *tensors):
            return total_loss(ex, tensors[:n], tensors[n:])

    grads = loop_grad(Whole(ex.model), lambda loss: loss, everything)
    return {name.removeprefix("model."): g for name, g in grads.items()}


def compare(
    res: Result, ex: Example, want: dict[str, Tensor], rtol: float, zero: float = 1e-12
) -> None:
    """:func:`bench.sweep.compare` of the case's trainable parameters (their ``grad1``
    deleted), with its loss's reduction."""
    params = [(n, p) for n, p in ex.model.named_parameters() if p.requires_grad]
    sweep.compare(res, params, want, rtol, mean=ex.reduction == "mean", zero=zero)


def build(name: str) -> Example:
    c = CASES[name]
    try:
        import_torchvision()
        if c.library in WITHOUT_INIT and importlib.util.find_spec("torchvision") is None:
            _package_without_init(c.library)
        importlib.import_module(c.library)
    except Exception as e:
        raise Skip(f"{c.library} is not installed: {first_line(e)}") from e
    try:
        ex = c.build()
    except Skip:
        raise
    except Exception as e:
        raise Skip(f"does not build: {first_line(e)}") from e
    ex.model = prepare(ex.model)
    return ex


class _LowPrecision(TorchFunctionMode):
    """Watches a forward for a tensor that depends on the parameters computed in a lower
    precision than theirs (x-transformers' float32 softmax; ``.float()`` of the activations
    in the hyper-connections of tab-transformer-pytorch): its gradients then carry float32
    rounding, however alike a batch of one and its row of the batch come out."""

    def __init__(self) -> None:
        super().__init__()
        self.found: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, Tensor) and t.requires_grad and t.dtype in LOW:
                self.found.add(str(t.dtype).removeprefix("torch."))
        return out


LOW = (torch.float32, torch.float16, torch.bfloat16)
# In such a model, an error below this fraction of its largest gradient entry is rounding.
FLOAT32_ZERO = 1e-9


def _low_precision(ex: Example) -> set[str]:
    """The lower precisions a forward of ``ex`` computes in (see :class:`_LowPrecision`)."""
    watch = _LowPrecision()
    with gradhooks.paused(), watch:
        _output(ex, ex.inputs)
    return watch.found


def _without_loop(res: Result, ex: Example, error: Exception) -> None:
    """A model whose batch of one fails (a BatchNorm in training mode, which needs more than
    one value per channel) has no loop to compare with; gradhooks must still refuse it: refused
    (or crash) where it does, skipped where it gives a ``grad1``."""
    ex.model.zero_grad(set_to_none=True)
    try:
        if hooked_backward(res, ex.model, lambda: total_loss(ex), ex.reduction):
            res.outcome = "skipped"
            res.detail = f"the loop of batches of one fails: {first_line(error)}"
    finally:
        for p in ex.model.parameters():
            if hasattr(p, "grad1"):
                del p.grad1


def _check(res: Result, name: str) -> None:
    ex = build(name)
    res.model = type(ex.model).__name__
    res.params = sum(p.numel() for p in ex.model.parameters())
    try:
        with torch.no_grad():
            first, again = _output(ex, ex.inputs), _output(ex, ex.inputs)
    except Skip:
        raise
    except Exception as e:
        raise Skip(f"does not run: {first_line(e)}") from e
    if not torch.equal(first, again):
        raise Skip("its training-mode forward draws random numbers")
    try:
        with torch.no_grad(), gradhooks.paused():
            ones = [_output(ex, _rows(ex.inputs, b)) for b in range(BATCH)]
    except Exception as e:
        _without_loop(res, ex, e)
        return
    if ex.batch_loss:  # (the mean of the examples' losses)
        ones, first = torch.stack(ones).mean(0, keepdim=True), first.reshape(1)
    else:
        ones = torch.cat(ones)
    if ones.shape != first.shape:
        raise Skip(f"outputs of a batch of one {tuple(ones.shape)} are no rows of {first.shape}")
    res.batch_vs_one = float((ones - first).abs().max() / first.abs().max().clamp_min(1e-300))
    rtol = FLOAT32_RTOL if res.batch_vs_one > ROUNDED else RTOL
    zero = 1e-12
    low = _low_precision(ex)
    if low:
        # (a float32 softmax, the 1/batch of a mean rounded in float32: where the model's
        # gradients add up to a value near zero, each example's differs from the loop's by
        # float32 rounding, about 1e-9 of the largest; the others are compared at rtol)
        zero = FLOAT32_ZERO
        res.detail = (
            f"computes in {', '.join(sorted(low))} inside: an error below {zero:g} of its "
            "largest gradient entry is taken as rounding"
        )
    try:
        want = own_gradients(ex)
    except Exception as e:
        _without_loop(res, ex, e)
        return
    ex.model.zero_grad(set_to_none=True)
    if not hooked_backward(res, ex.model, lambda: total_loss(ex), ex.reduction):
        return
    try:
        compare(res, ex, want, rtol, zero)  # (with the notes: float32 inside, the tolerance)
    finally:
        for p in ex.model.parameters():
            if hasattr(p, "grad1"):
                del p.grad1


def check(name: str, limit: float = 60.0) -> Result:
    """One model through the sweep: its :class:`~bench.sweep.Result` (``family`` is the
    case's name, ``task`` its library)."""
    res = Result(name, task=CASES[name].library)
    start = time.perf_counter()
    try:
        with time_limit(limit), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", gradhooks.GradhooksWarning)
            _check(res, name)
        res.warnings = sorted({str(w.message).splitlines()[0][:200] for w in caught
                               if issubclass(w.category, gradhooks.GradhooksWarning)})  # fmt: skip
    except (Skip, TimeLimit) as e:
        res.outcome, res.detail = "skipped", str(e)
    res.seconds = round(time.perf_counter() - start, 2)
    return res


# -- the same models in a training loop, under autocast, in a DP step --------------------------

# The models run in the other settings (each of another library or kind).
SETTINGS_MODELS = (
    "xt-rotary", "xt-gate-residual", "perceiver", "mlp-mixer", "unet2d", "dit", "linformer-lm",
    "mamba-pscan",
)  # fmt: skip
SETTINGS = sweep.SETTINGS


def subject(ex: Example) -> sweep.Subject:
    """``ex`` as the settings of :mod:`bench.sweep` run it."""

    def lowered() -> sweep.Subject:
        low = Example(copy.deepcopy(ex.model).float(), ex.inputs, ex.losses, ex.targets,
                      ex.reduction, ex.call)  # fmt: skip
        low.inputs = tuple(t.float() if t.is_floating_point() else t for t in ex.inputs)
        low.targets = tuple(t.float() if t.is_floating_point() else t for t in ex.targets)
        call = ex.call or (lambda m, *xs: m(*xs))
        low.call = lambda m, *xs: sweep.floated(call(m, *xs))
        return subject(low)

    return sweep.Subject(
        ex.model,
        loss=lambda: total_loss(ex),
        losses=lambda: ex.losses(_output(ex, ex.inputs), *ex.targets),
        own_gradients=lambda: own_gradients(ex),
        lowered=lowered,
        reduction=ex.reduction,
    )


def _setting(name: str, setting: str, limit: float) -> Result:
    res = Result(name, task=setting)
    start = time.perf_counter()
    try:
        with time_limit(limit):
            sweep.run_setting(res, setting, lambda: subject(build(name)))
    except (Skip, TimeLimit) as e:
        res.outcome, res.detail = "skipped", str(e)
    res.seconds = round(time.perf_counter() - start, 2)
    return res


def check_setting(name: str, setting: str, limit: float = 60.0) -> Result:
    """Model ``name`` in ``setting`` (a key of :data:`SETTINGS`): its result (``task`` is the
    setting)."""
    return _setting(name, setting, limit)


# -- the sweep and its report -------------------------------------------------------------------


@functools.cache
def _distribution(module: str) -> str:
    """The name of the distribution that installs ``module`` (``kan``: pykan)."""
    from importlib.metadata import packages_distributions

    found = packages_distributions().get(module)
    return found[0] if found else module.replace("_", "-")


def _version(module: str) -> str:
    try:
        from importlib.metadata import version

        return version(_distribution(module))
    except Exception:
        return "not installed"


def write(
    results: list[Result], out: Path, command: str, settings: list[Result] = ()
) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    counts = {o: sum(r.outcome == o for r in results) for o in OUTCOMES}
    libraries = sorted({CASES[r.family].library for r in results})
    versions = {lib: _version(lib) for lib in libraries}
    meta = {"command": command, "torch": torch.__version__, "libraries": versions,
            "batch": BATCH, "rtol": RTOL, "counts": counts}  # fmt: skip
    js = out / "lib-sweep.json"
    rows = {"results": [asdict(r) for r in results], "settings": [asdict(r) for r in settings]}
    js.write_text(json.dumps({**meta, **rows}, indent=1) + "\n")
    lines = [
        "# Models of pure-Python libraries against the per-example loop",
        "",
        f"`{command}`",
        "",
        f"torch {torch.__version__}; "
        + ", ".join(f"{_distribution(lib)} {v}" for lib, v in versions.items())
        + f". Tiny configurations in float64, training mode without dropout, batch {BATCH}, "
        "each with its users' loss; `grad1` of every trainable parameter against a loop of "
        f"batches of one, `rtol={RTOL:g}` (`{FLOAT32_RTOL:g}` where a row says so).",
        "",
        "| outcome | models |",
        "| --- | --- |",
        *(f"| {o} | {counts[o]} |" for o in OUTCOMES),
        "",
        "| model | library | class | parameters | outcome | detail | seconds |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    order = {o: i for i, o in enumerate(("mismatch", "crash", "refused", "match", "skipped"))}
    for r in sorted(results, key=lambda r: (order[r.outcome], r.task, r.family)):
        detail = r.detail.replace("|", "\\|").replace("\n", " ")
        if CASES[r.family].note:
            detail = CASES[r.family].note + ("; " + detail if detail else "")
        if r.warnings:
            detail += "; warned: " + "; ".join(r.warnings).replace("|", "\\|")
        lines.append(f"| {r.family} | {_distribution(r.task)} | {r.model} | {r.params:,} | "
                     f"{r.outcome} | {detail} | {r.seconds:.1f} |")  # fmt: skip
    if settings:
        lines += [
            "",
            "## Other settings",
            "",
            sweep.SETTINGS_NOTE,
            "",
            "| model | setting | outcome | detail | seconds |",
            "| --- | --- | --- | --- | --- |",
        ]
        for r in settings:
            detail = r.detail.replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {r.family} | {r.task} | {r.outcome} | {detail} | {r.seconds:.1f} |")
    md = out / "lib-sweep.md"
    md.write_text("\n".join(lines) + "\n")
    return js, md


def select(models: str | None, libraries: str | None) -> list[str]:
    names = list(CASES)
    if models:
        names = [n.strip() for n in models.split(",") if n.strip()]
        unknown = [n for n in names if n not in CASES]
        if unknown:
            raise SystemExit(f"no such model: {', '.join(unknown)} (see --list)")
    if libraries:
        wanted = {lib.strip().replace("-", "_") for lib in libraries.split(",")}
        names = [n for n in names if CASES[n].library in wanted]
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.lib_sweep", description=__doc__.split("\n")[0]
    )
    p.add_argument("--models", default=None, help="model names, comma-separated (default: all)")
    p.add_argument("--libraries", default=None, help="only these libraries' models")
    p.add_argument("--list", action="store_true", help="print the model names and exit")
    p.add_argument(
        "--settings", default=None,
        help="also run these models (comma-separated, 'default' for "
        f"{','.join(SETTINGS_MODELS)}) in a training loop, under bfloat16 autocast, under "
        "float16 autocast with a GradScaler and in a DP step",
    )  # fmt: skip
    p.add_argument("--limit", type=float, default=60.0, help="seconds per model before skipping")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), help="folder of the results")
    args = p.parse_args(argv)
    if args.list:
        for n, c in CASES.items():
            print(f"{n:28} {c.library:30} {c.note}")
        return 0
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    names = select(args.models, args.libraries)
    given = sys.argv[1:] if argv is None else argv
    command = "python -m bench.lib_sweep" + (" " + " ".join(given) if given else "")
    results = []
    bar = progress(names)
    for i, name in enumerate(names):
        if bar is None:
            print(f"[{i + 1}/{len(names)}] {name}", file=sys.stderr, flush=True)
        else:
            bar.set_postfix_str(name)
        results.append(check(name, args.limit))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    settings = []
    if args.settings:
        chosen = SETTINGS_MODELS if args.settings == "default" else select(args.settings, None)
        for name in chosen:
            for setting in SETTINGS:
                print(f"{name}: {setting}", file=sys.stderr, flush=True)
                settings.append(check_setting(name, setting, args.limit))
    js, md = write(results, Path(args.out), command, settings)
    counts = {o: sum(r.outcome == o for r in results) for o in OUTCOMES}
    print(", ".join(f"{n} {o}" for o, n in counts.items()))
    for r in [*results, *settings]:
        if r.outcome in ("mismatch", "crash"):
            print(f"{r.outcome}: {r.family} ({r.model}, {r.task}): {r.detail}")
    print(f"wrote {js} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

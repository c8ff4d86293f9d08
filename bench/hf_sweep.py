"""Hugging Face architectures, each tiny and random, against the per-example loop.

    python -m bench.hf_sweep                                # every architecture it can build
    python -m bench.hf_sweep --families llama,bert,vit      # some (model types of transformers)
    python -m bench.hf_sweep --popular                      # the widely used ones first, only
    python -m bench.hf_sweep --out /tmp/sweep --limit 60
    python -m bench.hf_sweep --task sequence-classification --padded   # right-padded batches
    python -m bench.hf_sweep --own-loss      # the model's own (averaged) loss of its labels
    python -m bench.hf_sweep --router-loss   # mixtures of experts with their balancing loss
    python -m bench.hf_sweep --popular --settings training,bf16-autocast   # as users train

For each model type of transformers' auto mappings (masked LM, causal LM, sequence
classification, image classification, audio classification: the first of those the type has),
a tiny random configuration (hidden size 32, 2 layers, 4 heads, vocabulary 99; the size
attributes the configuration has are set, lists of stage sizes shrunk), in float64, in training
mode with every dropout at 0, a batch of 3. The loss is a cross-entropy of the logits with
``reduction="sum"``; ``add_hooks(model, loss_reduction="sum")`` and one ``backward()`` give
``grad1``, compared parameter by parameter with each example's own gradient by a loop of
batches of one. Each architecture is then one of:

- **match**: every trainable parameter within ``rtol=1e-7`` (and ``1e-7`` of its largest entry;
  ``1e-4`` where the model computes in float32 inside, its logits of a batch of one differing
  from its rows of the batch, or where its own loss is taken in float32, as the row says; plus
  ten times the difference, without gradhooks, between autograd's batched gradient and the
  loop's, where the model's backward rounds differently for a batch and for one example, up
  to 1e-6 of the model's largest gradient entry);
- **refused**: gradhooks raised one of its own errors (its first line is kept);
- **mismatch**: a silently wrong ``grad1`` (the parameter, the largest absolute and relative
  error are kept), the worst outcome;
- **crash**: another exception raised from inside gradhooks;
- **skipped**: the configuration, the model or its inputs could not be made, the model does
  not run, draws random numbers in training mode, or took longer than ``--limit`` seconds.

With ``--settings`` (``training``, ``bf16-autocast``, ``fp16-scaler``, ``dp-step``, or ``all``), each
architecture that matches is also run, built afresh, in the settings of ``bench.sweep`` that
the library sweep runs too: 3 SGD steps under one ``add_hooks`` with ``zero_grad`` before each
backward, each step's ``grad1`` (left for ``zero_grad`` to reset) against the loop at that
step's parameters; the model in float32 under CPU bfloat16 autocast, ``grad1`` against the
float64 loop within 5e-2 of each parameter's largest entry (or, where the model's own bfloat16
loop without gradhooks is further off, 5e-2 plus twice its error; where autograd's own
per-example gradients of the batched bfloat16 forward are off the loop beyond that, the batch
computed otherwise than each example alone, against those instead); the same under float16
autocast with a ``GradScaler`` (``grad1`` divided by its scale, within 1e-2); ``dp_sgd_step`` by
book-keeping without noise, ``p.grad`` against the loop's clipped sum (within 1e-6 of its
largest term, or ten times autograd's own error there). Each gives one of the outcomes above.

Writes ``<out>/hf-sweep.json`` and ``<out>/hf-sweep.md`` (``<out>`` is ``bench/results``; with
``--padded``, ``--own-loss``, ``--router-loss``, ``--task`` or ``--settings``,
``hf-sweep-<those>.*``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import json
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python bench/hf_sweep.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"

import torch
import torch.nn.functional as F
from torch import nn

import gradhooks

from .sweep import (
    FLOAT32_RTOL,
    OUTCOMES,
    REPORT_ORDER,
    ROUNDED,
    RTOL,
    SETTINGS,
    SETTINGS_NOTE,
    Result,
    Skip,
    Subject,
    TimeLimit,
    compare,
    counts,
    detail_cell,
    first_line,
    hooked_backward,
    progress,
    run_setting,
    time_limit,
)

ROOT = Path(__file__).resolve().parent.parent
BATCH = 3
SEQ = 6
VOCAB = 99
IMAGE = 32
CLASSES = 3
PADDING = (0, 2, 1)  # tokens of padding of each example, with --padded
MAX_PARAMS = 3_000_000

# The widely used architectures, swept first (and alone with --popular).
POPULAR = (
    "llama mistral qwen2 qwen3 gemma gemma2 gemma3_text phi phi3 falcon gpt_neox gptj bloom "
    "codegen stablelm olmo olmo2 mpt gpt2 opt distilbert bert roberta deberta deberta-v2 electra "
    "xlm-roberta modernbert mobilebert longformer big_bird albert reformer whisper wav2vec2 "
    "hubert clip vit swin convnext resnet deit beit dinov2 segformer mobilevit efficientnet "
    "regnet mamba mamba2 rwkv t5 bart mixtral qwen2_moe granite cohere starcoder2 persimmon "
    "gpt_bigcode xglm biogpt camembert funnel xlnet ctrl squeezebert layoutlm nystromformer"
).split()

# (mapping name in transformers.models.auto.modeling_auto, task), in the order tried.
TASKS = (
    ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "masked-lm"),
    ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "causal-lm"),
    ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "sequence-classification"),
    ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "image-classification"),
    ("MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", "audio-classification"),
)

# Size attributes of configurations, and the tiny value each is given where a config has it.
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, HEAD_DIM = 32, 2, 4, 2, 64, 8
TINY_INTS = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "n_embed", "dim", "model_dim"), HIDDEN),
    **dict.fromkeys(("embed_dim", "word_embed_proj_dim", "projection_dim"), HIDDEN),
    **dict.fromkeys(
        (
            "num_hidden_layers",
            "n_layer",
            "n_layers",
            "num_layers",
            "encoder_layers",
            "decoder_layers",
            "num_decoder_layers",
            "num_encoder_layers",
            "num_hidden_groups_layers",
        ),
        LAYERS,
    ),  # fmt: skip
    **dict.fromkeys(
        (
            "num_attention_heads",
            "n_head",
            "n_heads",
            "encoder_attention_heads",
            "decoder_attention_heads",
            "num_heads",
            "attention_heads",
        ),
        HEADS,
    ),  # fmt: skip
    **dict.fromkeys(("num_key_value_heads", "multi_query_group_num", "n_kv_heads"), KV_HEADS),
    **dict.fromkeys(
        (
            "intermediate_size",
            "ffn_dim",
            "encoder_ffn_dim",
            "decoder_ffn_dim",
            "d_ff",
            "n_inner",
            "ffn_hidden_size",
            "inner_hidden_size",
            "d_inner",
            "mlp_dim",
            "ff_dim",
        ),
        FFN,
    ),  # fmt: skip
    **dict.fromkeys(("head_dim", "d_kv", "kv_channels", "attention_head_size"), HEAD_DIM),
    **dict.fromkeys(("vocab_size", "vocab_size_per_layer_input"), VOCAB),
    **dict.fromkeys(
        (
            "max_position_embeddings",
            "n_positions",
            "n_ctx",
            "max_seq_len",
            "seq_length",
            "max_sequence_length",
            "block_size",
        ),
        64,
    ),  # fmt: skip
    **dict.fromkeys(("embedding_size", "embedding_dim"), 16),
    **dict.fromkeys(("image_size",), IMAGE),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k"), 2),
    **dict.fromkeys(("moe_intermediate_size", "expert_intermediate_size"), 16),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts"), 1),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), 16),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim"), 4),
    **dict.fromkeys(("v_head_dim",), HEAD_DIM),
    **dict.fromkeys(("rotary_dim",), 4),
    **dict.fromkeys(("num_labels",), CLASSES),
    **dict.fromkeys(("state_size", "d_state"), 8),
    **dict.fromkeys(("num_mel_bins",), 16),
    **dict.fromkeys(("max_source_positions", "max_target_positions"), 16),
    **dict.fromkeys(("num_conv_pos_embeddings",), 8),
    **dict.fromkeys(("num_conv_pos_embedding_groups",), 2),
    **dict.fromkeys(("attention_window",), 4),
    **dict.fromkeys(("sliding_window",), 4),
    **dict.fromkeys(("codevector_dim", "proj_codevector_dim", "classifier_proj_size"), 16),
    **dict.fromkeys(("first_k_dense_replace",), 1),
    **dict.fromkeys(("pad_token_id",), 0),
    **dict.fromkeys(("bos_token_id",), 1),
    **dict.fromkeys(("eos_token_id",), 2),
    **dict.fromkeys(("decoder_start_token_id",), 0),
    **dict.fromkeys(("type_vocab_size",), 2),
}
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
TINY_LISTS = {  # a list attribute: a function of its length
    "depths": lambda n: [1] * n,
    "hidden_sizes": lambda n: [8 * (i + 1) for i in range(n)],
    "embed_dims": lambda n: [8 * (i + 1) for i in range(n)],
    "num_heads": lambda n: [1] * n,
    "num_attention_heads": lambda n: [1] * n,
    "conv_dim": lambda n: [16] * n,
    "encoder_hidden_sizes": lambda n: [8 * (i + 1) for i in range(n)],
    "decoder_hidden_sizes": lambda n: [8 * (i + 1) for i in range(n)],
    "num_layers": lambda n: [1] * n,
    "block_repeats": lambda n: [1] * n,
    "num_channels_list": lambda n: [8] * n,
    "attention_window": lambda n: [4] * n,
    "attn_layers": None,  # handled with the layer count (reformer); kept as its default
}
NO_RANDOMNESS = 0.0  # what every dropout-like float is set to
# Floats that switch on randomness in training mode: dropout, layer drop, stochastic depth,
# router jitter, SpecAugment's masks.
RANDOM_FLOATS = ("drop", "jitter", "mask_time_prob", "mask_feature_prob", "noise")
# The few configurations whose sizes are tied together beyond the attributes above.
OVERRIDES = {
    "mamba2": {"head_dim": 16, "n_groups": 1},
    "reformer": {"axial_pos_embds_dim": [16, 16], "axial_pos_shape": [2, 3]},  # 2 x 3 = SEQ
    "efficientnet": {"width_coefficient": 0.1, "depth_coefficient": 0.1, "hidden_dim": 128},
    # Multi-head latent attention: the rotary size is the rotated part of a head; one group
    # of experts for the router to pick from.
    "deepseek_v2": {"head_dim": 4, "num_experts_per_tok": 2},
    "deepseek_v3": {"head_dim": 4, "n_group": 1, "topk_group": 1},
    "axk1": {"head_dim": 4, "n_group": 1, "topk_group": 1},
    "youtu": {"head_dim": 4},
    "bailing_hybrid": {
        "head_dim": 4,
        "num_expert_group": 1,
        "topk_group": 1,
        "num_experts_per_token": 2,
    },
    # The same beside a sparse-attention indexer, with as many key heads as heads.
    **dict.fromkeys(
        ("axk2", "deepseek_v32", "glm_moe_dsa"),
        {
            "head_dim": 4,
            "num_key_value_heads": HEADS,
            "index_n_heads": HEADS,
            "n_group": 1,
            "topk_group": 1,
            "index_head_dim": HEAD_DIM,
        },
    ),
    "ernie4_5_moe": {"moe_k": 2},
    "zaya": {"num_experts_per_tok": 1},  # (the only count it takes)
    "esmc": {"num_key_value_heads": HEADS},  # (no grouped-query attention)
    "dots3_note_text": {"num_key_value_heads": HEADS},
    "bamba": {"mamba_n_heads": 4, "mamba_d_head": 16},  # 4 x 16 = 2 x HIDDEN
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "bit": {"num_groups": 2},
    "xmod": {"default_language": "en_XX"},
    # Layout embeddings of six coordinates sharing the hidden size: a multiple of 6.
    "lilt": {"hidden_size": 48},
    "layoutlmv3": {"hidden_size": 48, "coordinate_size": 8, "shape_size": 8, "visual_embed": False},
    "wav2vec2-bert": {"feature_projection_input_dim": 32},  # (the features as [batch, 16, 32])
    # Sizes whose default is None (left for a checkpoint to give).
    "nemotron": {"num_key_value_heads": KV_HEADS},
    "esm": {"vocab_size": VOCAB},
    "dots1": {"n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "cohere_compass_text": {
        "rope_parameters": {"full_attention": {"rope_theta": 10000.0, "rope_type": "default"}}
    },
    "granitemoehybrid": {
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
        "layer_types": ["linear_attention", "full_attention"],  # (one attention layer)
    },
    "swin": {"window_size": 2, "image_size": 64},
    "swinv2": {"window_size": 2, "image_size": 64},
    "donut-swin": {"window_size": 2, "image_size": 64},
}


# -- the configuration, the model, the inputs ---------------------------------------------------


def _tiny_kwargs(config, cut: bool = False) -> dict:
    """The tiny values of the size attributes ``config`` has (and of its parts' configurations),
    of the type it has them in; with ``cut``, its lists of one entry per layer cut to ``LAYERS``
    (the first and the last layer's) and its tables keyed by layer index to the first
    ``LAYERS`` (instead of its layer types left for the config to compute)."""
    from transformers import PretrainedConfig

    layers = next((v for k, v in vars(config).items() if k in LAYER_COUNTS and isinstance(v, int)
                   and not isinstance(v, bool)), None)  # fmt: skip
    kw = {}
    for name, value in vars(config).items():
        if name.startswith("_"):
            continue
        if isinstance(value, bool):
            continue
        if isinstance(value, int) and name in TINY_INTS:
            kw[name] = TINY_INTS[name]
        elif isinstance(value, float) and any(w in name for w in RANDOM_FLOATS):
            kw[name] = NO_RANDOMNESS
        elif isinstance(value, (list, tuple)) and TINY_LISTS.get(name) and value:
            if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                kw[name] = TINY_LISTS[name](len(value))
        elif (name.endswith("_config") or isinstance(value, PretrainedConfig)) and hasattr(
            value, "to_dict"
        ):
            sub = value.to_dict()
            sub.update(_tiny_kwargs(value, cut))
            kw[name] = sub
        if not cut or name in kw:
            continue
        if isinstance(value, (list, tuple)) and layers and layers > LAYERS and len(value) == layers:
            kw[name] = [*value[: LAYERS - 1], value[-1]]  # (the last: often the one that differs)
    table = config.to_dict().get("per_layer_config") if cut else None
    if isinstance(table, dict):
        kw["per_layer_config"] = {k: v for k, v in table.items() if int(k) < LAYERS}
    if "hidden_size" in kw and "head_dim" in vars(config) and vars(config)["head_dim"] is None:
        kw["head_dim"] = HEAD_DIM
    if "patch_size" in vars(config) and isinstance(config.patch_size, int):
        kw["patch_size"] = 8 if config.patch_size >= 8 else config.patch_size
    embedding = vars(config).get("embedding_size")
    if isinstance(embedding, int) and embedding == vars(config).get("hidden_size"):
        kw["embedding_size"] = HIDDEN  # kept equal where the default has them equal
    if "window_size" in vars(config) and isinstance(config.window_size, int):
        kw["window_size"] = min(config.window_size, 4)
    if "layer_types" in vars(config) and not (cut and "layer_types" in kw):
        kw["layer_types"] = None  # computed again from the layer count where the config can
    return kw


def tiny_config(family: str):
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[family]
    overrides = OVERRIDES.get(family, {})
    try:
        default = cls()
    except Exception as e:
        raise Skip(f"default config: {first_line(e)}") from e
    kw = {**_tiny_kwargs(default), **overrides}
    try:
        config = cls(**kw)
    except Exception:
        kw.pop("layer_types", None)
        try:
            config = cls(**kw)
        except Exception:  # the default's per-layer lists and tables cut to the layer count
            kw = {**_tiny_kwargs(default, cut=True), **overrides}
            try:
                config = cls(**kw)
            except Exception as e:
                raise Skip(f"tiny config: {first_line(e)}") from e
    layer_types = getattr(config, "layer_types", None)
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layer_types, list) and isinstance(layers, int) and len(layer_types) != layers:
        config.layer_types = list(layer_types[:layers])
    with contextlib.suppress(Exception):
        config.num_labels = CLASSES
    if (
        getattr(config, "is_encoder_decoder", False)
        and getattr(config, "decoder_start_token_id", None) is None
    ):
        config.decoder_start_token_id = 0
    if getattr(config, "pad_token_id", 0) is None:
        config.pad_token_id = 0  # (sequence classifiers find each example's last token by it)
    config._experts_implementation = "eager"  # (grouped_mm takes no float64 on CPU)
    for name, value in list(vars(config).items()):
        if isinstance(value, float) and any(w in name for w in RANDOM_FLOATS):
            setattr(config, name, NO_RANDOMNESS)
    return config


def model_class(family: str, task: str | None):
    import transformers
    from transformers.models.auto import modeling_auto

    for mapping, name in TASKS:
        if task is not None and name != task:
            continue
        classes = getattr(modeling_auto, mapping).get(family)
        if classes is None:
            continue
        cls_name = classes[0] if isinstance(classes, (list, tuple)) else classes
        cls = getattr(transformers, cls_name, None)
        if cls is not None:
            return name, cls
    raise Skip(f"no model class of the swept tasks{'' if task is None else f' ({task})'}")


def _meta_size(cls, config) -> int:
    """The number of parameters of ``cls(config)``, made on the meta device (no memory, no
    random numbers drawn); 0 where it cannot be made there (it is counted once made)."""
    try:
        with torch.device("meta"):
            return sum(p.numel() for p in cls(config).parameters())
    except Exception:
        return 0


def build(family: str, task: str | None, router_loss: bool = False):
    config = tiny_config(family)
    if router_loss:
        if not hasattr(config, "output_router_logits"):
            raise Skip("no router: no load-balancing loss")
        config.output_router_logits = True  # its own loss adds the load-balancing term
    name, cls = model_class(family, task)
    if not isinstance(config, cls.config_class):  # a text model of a composite configuration
        part = [v for v in vars(config).values() if isinstance(v, cls.config_class)]
        config = part[0] if part else config
    counted = _meta_size(cls, config)  # (before its memory is taken: T5Gemma's are 5.6 billion)
    torch.manual_seed(0)
    try:
        model = cls(config) if counted <= MAX_PARAMS else None
    except Exception as e:
        raise Skip(f"{cls.__name__}(tiny config): {first_line(e)}") from e
    size = counted if model is None else sum(p.numel() for p in model.parameters())
    if size > MAX_PARAMS:
        raise Skip(f"{cls.__name__}: {size:,} parameters at the tiniest config made")
    model = model.double().train()
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()  # in training mode it mixes the examples: fine-tuned with frozen statistics
    return name, model, config


def inputs(model, config, task: str, padded: bool = False) -> dict:
    """A batch of ``BATCH`` examples for ``model``'s main input (and an all-ones mask; with
    ``padded``, token ids padded on the right to different lengths, as a collator pads them)."""
    g = torch.Generator().manual_seed(0)
    main = getattr(model, "main_input_name", "input_ids")
    accepted = inspect.signature(model.forward).parameters
    batch = {}
    if main == "input_ids":
        vocab = getattr(config, "vocab_size", VOCAB) or VOCAB
        ids = torch.randint(3, min(vocab, VOCAB), (BATCH, SEQ), generator=g)
        eos = getattr(config, "eos_token_id", None)
        lengths = [SEQ - p for p in PADDING] if padded else [SEQ] * BATCH
        mask = torch.zeros_like(ids)
        for b, n in enumerate(lengths):
            mask[b, :n] = 1
            if isinstance(eos, int) and eos < vocab:
                ids[b, n - 1] = eos  # some models pool at the end-of-sequence token
            pad = getattr(config, "pad_token_id", None)
            ids[b, n:] = pad if isinstance(pad, int) and pad < vocab else 0
        batch["input_ids"] = ids
        if "attention_mask" in accepted:
            batch["attention_mask"] = mask
        elif padded:
            raise Skip("takes no attention_mask: no padded batch")
    elif main == "pixel_values":
        channels = getattr(config, "num_channels", 3)
        size = getattr(config, "image_size", IMAGE)
        size = size[0] if isinstance(size, (list, tuple)) else size
        if "spatial_shapes" in accepted:  # patches flattened, as its processor gives them
            vision = getattr(config, "vision_config", config)
            patch, channels = vision.patch_size, getattr(vision, "num_channels", channels)
            side = size // patch
            batch["pixel_values"] = torch.randn(
                BATCH, side * side, channels * patch * patch, generator=g, dtype=torch.float64
            )
            batch["pixel_attention_mask"] = torch.ones(BATCH, side * side, dtype=torch.long)
            batch["spatial_shapes"] = torch.tensor([[side, side]] * BATCH)
        else:
            batch["pixel_values"] = torch.randn(
                BATCH, channels, size, size, generator=g, dtype=torch.float64
            )
    elif main == "input_values":
        if hasattr(config, "max_length") and hasattr(config, "num_mel_bins"):  # spectrogram
            shape = (BATCH, config.max_length, config.num_mel_bins)
        else:  # a waveform
            shape = (BATCH, 4000)
        batch["input_values"] = torch.randn(*shape, generator=g, dtype=torch.float64)
    elif main == "input_features":
        bins = getattr(config, "num_mel_bins", 16)
        frames = 2 * getattr(config, "max_source_positions", 16)
        batch["input_features"] = torch.randn(BATCH, bins, frames, generator=g, dtype=torch.float64)
    else:
        raise Skip(f"main input {main!r} is not one the sweep makes")
    if "use_cache" in accepted:
        batch["use_cache"] = False  # as in training: no cache built
    return batch


def _logits(model, batch):
    out = model(**batch)
    logits = out.logits if hasattr(out, "logits") else out[0]
    if not isinstance(logits, torch.Tensor):
        raise Skip(f"{type(model).__name__} returns no logits tensor")
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()  # (under autocast: the loss in float32, as users take it)
    return logits


def _rows(batch: dict, b: int) -> dict:
    return {k: v[b : b + 1] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def summed_loss(model, batch, labels, own: bool):
    """A cross-entropy of the logits summed over positions and examples, or with ``own`` the
    model's own loss of ``labels`` (which averages them)."""
    if own:
        kw = {**batch, "labels": labels if task_of(model) != "lm" else batch["input_ids"]}
        return model(**kw).loss
    logits = _logits(model, batch)
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="sum")


def example_losses(model, batch, labels, own: bool) -> torch.Tensor:
    """Each example's cross-entropy of the logits summed over its positions, ``[batch]``."""
    if own:
        raise Skip("its own loss is the batch's mean, not each example's loss")
    logits = _logits(model, batch)
    losses = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none")
    return losses.reshape(labels.shape[0], -1).sum(1)


def task_of(model) -> str:
    name = type(model).__name__
    return "lm" if name.endswith(("LM", "LMHeadModel", "ForCausalLM")) else "classification"


def loop_grads(model, batch, labels, params, own: bool = False):
    """Each example's own gradient: a forward and backward of a batch of one at a time.

    Read from ``.grad`` after ``backward()`` (each parameter's ``.grad`` put back after), not
    from ``torch.autograd.grad``: a model whose own autograd.Function runs a backward inside
    its backward (Reformer's reversible layers) accumulates its parameters' gradients into
    ``.grad``, where ``autograd.grad`` would see them unused."""
    rows = []
    kept = [p.grad for _, p in params]
    try:
        with gradhooks.paused():
            for b in range(BATCH):
                for _, p in params:
                    p.grad = None
                summed_loss(model, _rows(batch, b), labels[b : b + 1], own).backward()
                rows.append([torch.zeros_like(p) if p.grad is None else p.grad for _, p in params])
    finally:
        for (_, p), g in zip(params, kept):
            p.grad = g
    return {n: torch.stack([r[i] for r in rows]) for i, (n, _) in enumerate(params)}


@dataclass
class Built:
    """A model of the sweep with its batch, its labels and its tolerance."""

    model: nn.Module
    batch: dict
    labels: torch.Tensor
    rtol: float
    own_loss: bool


def check(
    family: str,
    task: str | None = None,
    limit: float = 60.0,
    padded: bool = False,
    own_loss: bool = False,
    router_loss: bool = False,
    setting: str | None = None,
) -> Result:
    """One architecture through the sweep: its :class:`Result`; with ``setting`` (a key of
    :data:`bench.sweep.SETTINGS`), run in that setting instead of one backward (its ``task``
    is then the setting)."""
    res = Result(family)
    start = time.perf_counter()
    try:
        with time_limit(limit), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", gradhooks.GradhooksWarning)
            if setting is None:
                _check(res, family, task, padded, own_loss or router_loss, router_loss)
            else:
                own = own_loss or router_loss
                run_setting(res, setting, lambda: subject(
                    _built(res, family, task, padded, own, router_loss)))  # fmt: skip
        res.warnings = sorted({str(w.message).splitlines()[0][:200] for w in caught
                               if issubclass(w.category, gradhooks.GradhooksWarning)})  # fmt: skip
    except Skip as e:
        res.outcome, res.detail = "skipped", str(e)
    except TimeLimit as e:
        res.outcome, res.detail = "skipped", str(e)
    res.seconds = round(time.perf_counter() - start, 2)
    return res


def _built(
    res: Result, family: str, task: str | None, padded: bool, own_loss: bool, router_loss: bool
) -> Built:
    """The model of ``family``, checked to run the same twice and to give rows of its batch
    for a batch of one (``res`` notes its task, class, size, and how a batch of one differs)."""
    res.task, model, config = build(family, task, router_loss)
    res.model = type(model).__name__
    res.params = sum(p.numel() for p in model.parameters())
    batch = inputs(model, config, res.task, padded)
    try:
        with torch.no_grad():
            first = _logits(model, batch)
            again = _logits(model, batch)
    except Skip:
        raise
    except Exception as e:
        raise Skip(f"does not run: {first_line(e)}") from e
    if not torch.equal(first, again):
        raise Skip("its training-mode forward draws random numbers")
    with torch.no_grad(), gradhooks.paused():
        ones = torch.cat([_logits(model, _rows(batch, b)) for b in range(BATCH)])
    if ones.shape != first.shape:
        raise Skip(
            f"logits of a batch of one {tuple(ones.shape)} are not rows of {tuple(first.shape)}"
        )
    res.batch_vs_one = float((ones - first).abs().max() / first.abs().max().clamp_min(1e-300))
    rtol = FLOAT32_RTOL if res.batch_vs_one > ROUNDED else RTOL
    g = torch.Generator().manual_seed(1)
    classes = first.shape[-1]
    labels = torch.randint(0, classes, first.shape[:-1], generator=g)
    if own_loss and task_of(model) == "classification":
        labels = torch.randint(0, CLASSES, (BATCH,), generator=g)
    if own_loss:
        try:
            with torch.no_grad(), gradhooks.paused():
                dtype = summed_loss(model, batch, labels, own_loss).dtype
        except Exception as e:
            raise Skip(f"its own loss fails: {first_line(e)}") from e
        if dtype != torch.float64:  # (Hugging Face's language-model losses upcast to float32)
            rtol, res.detail = FLOAT32_RTOL, f"its own loss in {dtype}"
    return Built(model, batch, labels, rtol, own_loss)


def _check(
    res: Result, family: str, task: str | None, padded: bool, own_loss: bool, router_loss: bool
) -> None:
    b = _built(res, family, task, padded, own_loss, router_loss)
    params = [(n, p) for n, p in b.model.named_parameters() if p.requires_grad]
    try:
        want = loop_grads(b.model, b.batch, b.labels, params, own_loss)
    except Exception as e:
        raise Skip(f"the loop of batches of one fails: {first_line(e)}") from e
    b.model.zero_grad(set_to_none=True)
    reduction = "mean" if own_loss else "sum"
    loss = lambda: summed_loss(b.model, b.batch, b.labels, own_loss)  # noqa: E731
    if hooked_backward(res, b.model, loss, reduction):
        compare(res, params, want, b.rtol, mean=own_loss)


def subject(b: Built) -> Subject:
    """``b`` as the settings of :mod:`bench.sweep` run it (the loop's failure a skip)."""
    model, batch, labels, own = b.model, b.batch, b.labels, b.own_loss

    def own_gradients() -> dict[str, torch.Tensor]:
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        try:
            return loop_grads(model, batch, labels, params, own)
        except Exception as e:
            raise Skip(f"the loop of batches of one fails: {first_line(e)}") from e

    def lowered() -> Subject:
        low = copy.deepcopy(model).float()
        floats = {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                  for k, v in batch.items()}  # fmt: skip
        return subject(Built(low, floats, labels, b.rtol, own))

    return Subject(
        model,
        loss=lambda: summed_loss(model, batch, labels, own),
        losses=lambda: example_losses(model, batch, labels, own),
        own_gradients=own_gradients,
        lowered=lowered,
        reduction="mean" if own else "sum",
        rtol=b.rtol,
    )


# -- the sweep and its report -------------------------------------------------------------------


def families(selection: str | None, popular: bool, task: str | None = None) -> list[str]:
    from transformers.models.auto import modeling_auto

    swept = []
    for mapping, name in TASKS:
        if task is not None and name != task:
            continue
        for family in getattr(modeling_auto, mapping):
            if family not in swept:
                swept.append(family)
    if selection:
        names = [n.strip() for n in selection.split(",") if n.strip()]
        unknown = [n for n in names if n not in swept]
        if unknown:
            raise SystemExit(f"not a model type of the swept tasks: {', '.join(unknown)}")
        return names
    first = [f for f in POPULAR if f in swept]
    return first if popular else first + [f for f in swept if f not in first]


def write(
    results: list[Result],
    out: Path,
    command: str,
    name: str = "hf-sweep",
    loss: str = "a summed cross-entropy of the logits",
    settings: list[Result] = (),
) -> tuple[Path, Path]:
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    counted = counts(results)
    meta = {"command": command, "torch": torch.__version__, "transformers": transformers.__version__,
            "batch": BATCH, "sequence": SEQ, "rtol": RTOL, "counts": counted}  # fmt: skip
    js = out / f"{name}.json"
    rows = {"results": [asdict(r) for r in results]}
    if settings:
        ran = [t for t in SETTINGS if any(r.task == t for r in settings)]
        meta["settings_counts"] = {t: counts([r for r in settings if r.task == t]) for t in ran}
        rows["settings"] = [asdict(r) for r in settings]
    js.write_text(json.dumps({**meta, **rows}, indent=1) + "\n")
    lines = [
        "# Hugging Face architectures against the per-example loop",
        "",
        f"`{command}`",
        "",
        f"torch {torch.__version__}, transformers {transformers.__version__}; tiny random "
        f"configurations in float64, training mode without dropout, batch {BATCH}, "
        f"sequence {SEQ}, {loss}; `grad1` of every trainable parameter against "
        f"a loop of batches of one, `rtol={RTOL:g}` (`{FLOAT32_RTOL:g}` where a row says so).",
        "",
        "| outcome | architectures |",
        "| --- | --- |",
        *(f"| {o} | {counted[o]} |" for o in OUTCOMES),
        "",
        "| architecture | task | model | parameters | outcome | detail | seconds |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    order = {o: i for i, o in enumerate(REPORT_ORDER)}
    for r in sorted(results, key=lambda r: (order[r.outcome], r.family)):
        detail = detail_cell(r)
        lines.append(f"| {r.family} | {r.task} | {r.model} | {r.params:,} | {r.outcome} | "
                     f"{detail} | {r.seconds:.1f} |")  # fmt: skip
    if settings:
        chosen = meta["settings_counts"]
        lines += [
            "",
            "## Other settings",
            "",
            "The architectures that match above, each in these settings. " + SETTINGS_NOTE,
            "",
            "| outcome | " + " | ".join(chosen) + " |",
            "| --- | " + " | ".join("---" for _ in chosen) + " |",
            *(f"| {o} | " + " | ".join(str(c[o]) for c in chosen.values()) + " |"
              for o in OUTCOMES),
            "",
            "| architecture | setting | model | outcome | detail | seconds |",
            "| --- | --- | --- | --- | --- | --- |",
        ]  # fmt: skip
        for r in sorted(settings, key=lambda r: (order[r.outcome], r.family, r.task)):
            lines.append(f"| {r.family} | {r.task} | {r.model} | {r.outcome} | "
                         f"{detail_cell(r)} | {r.seconds:.1f} |")  # fmt: skip
    md = out / f"{name}.md"
    md.write_text("\n".join(lines) + "\n")
    return js, md


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.hf_sweep", description=__doc__.split("\n")[0])
    p.add_argument("--families", default=None, help="model types, comma-separated (default: all)")
    p.add_argument("--popular", action="store_true", help="only the widely used architectures")
    p.add_argument("--task", default=None, choices=[t for _, t in TASKS], help="one task only")
    p.add_argument(
        "--padded", action="store_true", help="token ids padded on the right, with their mask"
    )
    p.add_argument(
        "--own-loss", action="store_true",
        help="the model's own loss of labels (a mean: add_hooks(loss_reduction='mean'))",
    )  # fmt: skip
    p.add_argument(
        "--router-loss", action="store_true",
        help="mixtures of experts only, with output_router_logits=True: their own loss with "
        "its load-balancing term (implies --own-loss)",
    )  # fmt: skip
    p.add_argument(
        "--settings", default=None,
        help=f"also run each architecture that matches in these settings, comma-separated "
        f"({', '.join(SETTINGS)}, or all)",
    )  # fmt: skip
    p.add_argument("--limit", type=float, default=60.0, help="seconds per model before skipping")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), help="folder of the results")
    args = p.parse_args(argv)
    chosen = []
    if args.settings:
        chosen = list(SETTINGS) if args.settings == "all" else args.settings.split(",")
        unknown = [c for c in chosen if c not in SETTINGS]
        if unknown:
            p.error(f"no such setting: {', '.join(unknown)} (there are: {', '.join(SETTINGS)})")
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    names = families(args.families, args.popular, args.task)
    command = "python -m bench.hf_sweep" + (" " + " ".join(sys.argv[1:] if argv is None else argv)
                                            if (sys.argv[1:] if argv is None else argv) else "")  # fmt: skip
    results, settings = [], []
    bar = progress(names)
    for i, family in enumerate(names):
        if bar is None:
            print(f"[{i + 1}/{len(names)}] {family}", file=sys.stderr, flush=True)
        else:
            bar.set_postfix_str(family)
        results.append(
            check(family, args.task, args.limit, args.padded, args.own_loss, args.router_loss)
        )
        if results[-1].outcome == "match":
            settings += [check(family, args.task, args.limit, args.padded, args.own_loss,
                               args.router_loss, setting=c) for c in chosen]  # fmt: skip
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    modes = [args.task or "", "padded" * args.padded, "own-loss" * args.own_loss,
             "router-loss" * args.router_loss, "settings" * bool(chosen)]  # fmt: skip
    name = "-".join(["hf-sweep", *(m for m in modes if m)])
    loss = "a summed cross-entropy of the logits"
    if args.own_loss or args.router_loss:
        loss = "the model's own loss of its labels (averaged: loss_reduction='mean')"
    if args.router_loss:
        loss += " with its load-balancing term (output_router_logits=True)"
    if args.padded:
        loss += ", token ids padded on the right by 0, 2 and 1 tokens"
    js, md = write(results, Path(args.out), command, name, loss, settings)
    print(", ".join(f"{n} {o}" for o, n in counts(results).items()))
    for c in chosen:
        counted = counts([r for r in settings if r.task == c])
        print(f"{c}: " + ", ".join(f"{n} {o}" for o, n in counted.items()))
    for r in [*results, *settings]:
        if r.outcome in ("mismatch", "crash"):
            print(f"{r.outcome}: {r.family} ({r.model}, {r.task}): {r.detail}")
    print(f"wrote {js} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

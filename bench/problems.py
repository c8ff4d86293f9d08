"""The models the benchmark runs, each with its inputs and its (mean-reduced) loss.

A problem is a model factory, a batch factory and a loss. Every method of a run sees the same
weights (one seed) and the same batch. Example ``i``'s own loss is ``loss(model(x[i:i+1]),
y[i:i+1])``; the batch loss is the mean of those (for the language models: the mean over all
tokens, which is the mean over examples of each example's mean over its tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradhooks import models


def classify(out: Tensor, y: Tensor) -> Tensor:
    """Cross-entropy on ``[batch, classes]`` logits."""
    return F.cross_entropy(out, y)


def next_token(out: Tensor, y: Tensor) -> Tensor:
    """Cross-entropy on ``[batch, seq, vocab]`` logits against ``[batch, seq]`` tokens."""
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def classify_each(out: Tensor, y: Tensor) -> Tensor:
    """``[batch]`` per-example losses of :func:`classify` (whose mean it is)."""
    return F.cross_entropy(out, y, reduction="none")


def next_token_each(out: Tensor, y: Tensor) -> Tensor:
    """``[batch]`` per-example losses of :func:`next_token`: each example's mean over tokens."""
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none").view(y.shape).mean(1)


PER_EXAMPLE = {classify: classify_each, next_token: next_token_each}


@dataclass(frozen=True)
class Problem:
    name: str  # command-line name
    label: str  # what the table shows
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.Generator], tuple[Tensor, Tensor]]
    loss: Callable[[Tensor, Tensor], Tensor]
    workload: bool = False  # a real fine-tuning workload (its own goals: bench/report.py)
    # the batch this problem is run at where a suite asks for each model's own (``--batch
    # own``): the host-cost models, whose sizes are part of what they measure
    batch: int = 64
    host: bool = False  # a tiny model of the host suite (its own goals: bench/report.py)


def _images(shape: tuple[int, ...], classes: int = 10):
    def make(batch: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        return torch.randn(batch, *shape, generator=gen), torch.randint(
            classes, (batch,), generator=gen
        )

    return make


def _tokens(vocab: int, seq: int, classes: int | None = None):
    def make(batch: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        x = torch.randint(vocab, (batch, seq), generator=gen)
        if classes is not None:
            return x, torch.randint(classes, (batch,), generator=gen)
        return x, torch.randint(vocab, (batch, seq), generator=gen)

    return make


class HuggingFace(nn.Module):
    """A Hugging Face model called as its users call it: token ids (or pixels) in, logits out.
    ``expand_positions``: pass ``position_ids`` expanded to the batch, the workaround Opacus
    needs (its per-sample gradient of the position embedding otherwise has a batch of one);
    gradhooks needs none."""

    def __init__(self, model: nn.Module, pixels: bool = False) -> None:
        super().__init__()
        self.model, self.pixels, self.expand_positions = model, pixels, False

    def forward(self, x: Tensor) -> Tensor:
        if self.pixels:
            return self.model(pixel_values=x).logits
        kw = {}
        if self.expand_positions:
            kw["position_ids"] = torch.arange(x.shape[1], device=x.device).expand(x.shape)
        return self.model(input_ids=x, **kw).logits


class Unavailable(Exception):
    """The method cannot run here; ``status`` is ``"missing"`` or ``"unsupported"``."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status = status


def _transformers():
    from .timm_sweep import import_torchvision

    import_torchvision()
    try:
        import transformers
    except ImportError as e:
        raise Unavailable("missing", f"transformers is not installed: {e}") from e
    transformers.logging.set_verbosity_error()
    return transformers


GPT2_VOCAB = 50257  # GPT-2's own


def gpt2(lora: bool = False) -> nn.Module:
    """GPT-2, 2 layers of width 256 (GPT-2's vocabulary, tied output layer); ``lora``: a PEFT
    LoRA adapter (rank 8) on the attention's and MLP's projections, the rest frozen."""
    t = _transformers()
    config = t.GPT2Config(
        n_embd=256, n_layer=2, n_head=4, n_positions=1024, vocab_size=GPT2_VOCAB,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = t.GPT2LMHeadModel(config)
    if lora:
        import peft

        adapter = peft.LoraConfig(
            r=8, lora_alpha=16, lora_dropout=0.0, fan_in_fan_out=True,
            target_modules=["c_attn", "c_proj", "c_fc"],
        )  # fmt: skip
        model = peft.get_peft_model(model, adapter)
    return HuggingFace(model)


def bert() -> nn.Module:
    """A BERT classifier, 2 layers of width 256 (BERT's vocabulary), 2 classes."""
    t = _transformers()
    config = t.BertConfig(
        vocab_size=30522, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=1024, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        num_labels=2,
    )  # fmt: skip
    return HuggingFace(t.BertForSequenceClassification(config))


def vit() -> nn.Module:
    """A ViT classifier (Hugging Face's), 64x64 images in 8x8 patches, 4 layers of width 256."""
    t = _transformers()
    config = t.ViTConfig(
        image_size=64, patch_size=8, hidden_size=256, num_hidden_layers=4,
        num_attention_heads=4, intermediate_size=1024, num_labels=10,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return HuggingFace(t.ViTForImageClassification(config), pixels=True)


# -- tiny models: what each step costs the host (Python, hooks, kernel launches), not the maths --

TINY_VOCAB, TINY_SEQ = 256, 16


def tiny_cnn() -> nn.Module:
    """Two 3x3 convolutions (4 and 8 channels) on 1x8x8 images, ReLU, a linear head."""
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(8 * 8 * 8, 10),
    )  # fmt: skip


def tiny_gpt2() -> nn.Module:
    """GPT-2, 2 layers of width 32, 4 heads, a vocabulary of 256 (tied output layer)."""
    t = _transformers()
    config = t.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=TINY_VOCAB,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return HuggingFace(t.GPT2LMHeadModel(config))


def tiny_bert() -> nn.Module:
    """A BERT classifier, 2 layers of width 32, 4 heads, a vocabulary of 256, 2 classes."""
    t = _transformers()
    config = t.BertConfig(
        vocab_size=TINY_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=2,
    )  # fmt: skip
    return HuggingFace(t.BertForSequenceClassification(config))


def tiny_llama() -> nn.Module:
    """Llama, 2 layers of width 32, 4 heads sharing 2 key-value heads, a vocabulary of 256."""
    t = _transformers()
    config = t.LlamaConfig(
        vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return HuggingFace(t.LlamaForCausalLM(config))


def tiny_vit() -> nn.Module:
    """A ViT classifier, 16x16 images in 4x4 patches, 2 layers of width 32, 4 heads."""
    t = _transformers()
    config = t.ViTConfig(
        image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=128, num_labels=10,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return HuggingFace(t.ViTForImageClassification(config), pixels=True)


PROBLEMS: dict[str, Problem] = {
    p.name: p
    for p in [
        Problem("simplecnn", "SimpleCNN 1x28x28", models.SimpleCNN, _images((1, 28, 28)), classify),
        Problem(
            "mlp", "MLP 784-512-512-10", lambda: models.MLP(784, 512, 512, 10), _images((784,)),
            classify,
        ),
        Problem("cifarcnn", "CifarCNN 3x32x32", models.CifarCNN, _images((3, 32, 32)), classify),
        Problem("resnet18gn", "ResNet18GN 3x32x32", models.ResNet18GN, _images((3, 32, 32)), classify),
        Problem("tinygpt", "TinyGPT seq 128 (tied)", models.TinyGPT, _tokens(64, 128), next_token),
        Problem("lstm", "LSTM LM seq 64", models.LSTMLanguageModel, _tokens(64, 64), next_token),
        Problem(
            "embedblock", "EmbedBlock 64 tokens", models.EmbedBlock, _tokens(1000, 64, classes=10),
            classify,
        ),
        # real workloads (Hugging Face transformers, peft: pip install -e '.[bench]')
        Problem("gpt2-128", "HF GPT-2 2x256, seq 128", gpt2, _tokens(GPT2_VOCAB, 128), next_token,
                True),
        Problem("gpt2-512", "HF GPT-2 2x256, seq 512", gpt2, _tokens(GPT2_VOCAB, 512), next_token,
                True),
        Problem(
            "gpt2-lora-128", "HF GPT-2 2x256 LoRA r8, seq 128", lambda: gpt2(lora=True),
            _tokens(GPT2_VOCAB, 128), next_token, True,
        ),
        Problem("bert-128", "HF BERT classifier 2x256, seq 128", bert,
                _tokens(30522, 128, classes=2), classify, True),
        Problem("vit-64", "HF ViT 4x256, 64x64 images", vit, _images((3, 64, 64)), classify,
                True),
        # tiny models, each at its own batch (the host suite)
        Problem("tiny-mlp", "MLP 16-32-32-10, batch 8", lambda: models.MLP(16, 32, 32, 10),
                _images((16,)), classify, batch=8, host=True),
        Problem("tiny-cnn", "CNN 1x8x8 (4, 8 ch.), batch 8", tiny_cnn, _images((1, 8, 8)),
                classify, batch=8, host=True),
        Problem("tiny-gpt2", "HF GPT-2 2x32, seq 16, batch 4", tiny_gpt2,
                _tokens(TINY_VOCAB, TINY_SEQ), next_token, batch=4, host=True),
        Problem("tiny-bert", "HF BERT 2x32, seq 16, batch 4", tiny_bert,
                _tokens(TINY_VOCAB, TINY_SEQ, classes=2), classify, batch=4, host=True),
        Problem("tiny-llama", "HF Llama 2x32, seq 16, batch 4", tiny_llama,
                _tokens(TINY_VOCAB, TINY_SEQ), next_token, batch=4, host=True),
        Problem("tiny-vit", "HF ViT 2x32, 16x16 images, batch 4", tiny_vit, _images((3, 16, 16)),
                classify, batch=4, host=True),
    ]
}  # fmt: skip

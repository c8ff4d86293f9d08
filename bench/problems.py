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
    ]
}  # fmt: skip

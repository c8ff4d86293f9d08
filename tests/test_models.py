"""Whole in-tree models end to end against vmap(grad) and a per-example loop, in float64.

Layers without a rule here (Embedding, LayerNorm, GroupNorm, MultiheadAttention, LSTM,
ConvTranspose2d, the ViT's bare class token and positional embedding) go through whatever covers
them: a rule where one is registered, the torch.func fallback otherwise.
"""

import pytest
import torch

from gradhooks.models import (
    CifarCNN,
    EmbedBlock,
    LSTMLanguageModel,
    ResNet18GN,
    TinyGPT,
    TinyUNet,
    TinyViT,
)  # fmt: skip
from harness import Case, check, cross_entropy_sum


def tokens(vocab: int, seq: int):
    return lambda b: torch.randint(vocab, (b, seq))  # integer: the harness keeps it so


CASES = [
    Case(
        "cifar_cnn",
        lambda: CifarCNN(classes=3, width=2),
        lambda b: torch.randn(b, 3, 32, 32),
        lambda b: torch.randint(3, (b,)),
        cross_entropy_sum,
    ),
    Case("resnet18_gn", lambda: ResNet18GN(classes=3, width=4, groups=2), lambda b: torch.randn(b, 3, 8, 8)),
    Case("tiny_gpt_tied", lambda: TinyGPT(vocab=11, dim=8, heads=2, layers=2, max_seq=8), tokens(11, 5)),
    Case("tiny_vit", lambda: TinyViT(image=8, patch=4, dim=8, heads=2, layers=2, classes=3), lambda b: torch.randn(b, 3, 8, 8)),
    Case("tiny_unet", lambda: TinyUNet(channels=1, width=2, classes=2), lambda b: torch.randn(b, 1, 8, 8)),
    Case("embed_block", lambda: EmbedBlock(vocab=13, dim=4, classes=3), tokens(13, 5)),
]  # fmt: skip


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", CASES, ids=repr)
def test_model_matches_oracles(case, reduction):
    check(case, batch=3, reduction=reduction)


@pytest.mark.parametrize("case", CASES[2:4], ids=repr)
def test_model_batch_of_one(case):
    check(case, batch=1, reduction="mean")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_lstm_language_model(reduction):
    case = Case(
        "lstm_lm", lambda: LSTMLanguageModel(vocab=11, dim=4, hidden=5, layers=2), tokens(11, 5)
    )
    check(case, batch=3, reduction=reduction)

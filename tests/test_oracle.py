"""The float64 references themselves: ``gradhooks.oracle.loop_grad`` and ``vmap_grad``, checked
against an explicit per-example loop written here."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad, vmap_grad
from harness import assert_close, sq


class Keywords(nn.Module):
    """``model(**batch)``, as a tokenizer's batch is given: a table, a mask, and a flag that
    is no tensor."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 3)
        self.proj = nn.Linear(3, 2)

    def forward(self, input_ids, attention_mask, scale=1.0):
        h = self.emb(input_ids) * attention_mask.unsqueeze(-1)
        return self.proj(h).sum(1) * scale


def _batch(n: int = 4) -> dict:
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(n, 5, dtype=torch.float64)
    mask[0, 3:] = 0
    return {"input_ids": torch.randint(0, 7, (n, 5), generator=g), "attention_mask": mask,
            "scale": 2.0}  # fmt: skip


def _by_hand(model: nn.Module, batch: dict) -> dict:
    """Each example's gradients, one ``model(**example)`` and ``torch.autograd.grad`` each."""
    names = [n for n, p in model.named_parameters()]
    rows = []
    for i in range(batch["input_ids"].shape[0]):
        one = {k: v[i : i + 1] if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        rows.append(torch.autograd.grad(sq(model(**one)), list(model.parameters())))
    return {n: torch.stack([r[k] for r in rows]) for k, n in enumerate(names)}


@pytest.mark.parametrize("oracle", [loop_grad, vmap_grad], ids=["loop", "vmap"])
def test_a_mapping_of_inputs_is_given_as_keywords(oracle):
    torch.manual_seed(0)
    model = Keywords().double()
    batch = _batch()
    want = _by_hand(model, batch)
    got = oracle(model, sq, batch)
    assert set(got) == set(want)
    for n in want:
        assert_close(got[n], want[n], f"{oracle.__name__} {n}")


def test_grad1_of_a_model_called_with_keywords_matches_the_oracle():
    torch.manual_seed(0)
    model = Keywords().double()
    batch = _batch()
    want = loop_grad(model, sq, batch)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(**batch)).backward()
        for n, p in model.named_parameters():
            assert_close(p.grad1, want[n], n)


def test_a_mapping_without_tensors_is_refused():
    model = Keywords().double()
    with pytest.raises(gradhooks.errors.ConfigurationError):
        loop_grad(model, sq, {"scale": 2.0})

"""K-FAC of padded sequences, ``gradhooks.kfac(..., mask=attention_mask)``: ``A`` counts each
sequence's real positions alone, as the sequences unpadded, each run on its own, give it
(kronfluence's promise for a padded BERT batch); ``G`` is as without the mask (the padding's
output-gradients are zero where the labels leave it out). Compared in float64 with the factors
of each sequence run alone at its own length, for a model that treats positions one by one
and for a tiny Hugging Face BERT, expanded and reduced; a mask that is no mask, or that fits
no layer, is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradhooks
from harness import raised

LENGTHS = [5, 3, 4]


class Tagger(nn.Module):
    """Tokens tagged one position at a time: [batch, positions, 3] -> [batch, positions, 2]."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(3, 6), nn.Linear(6, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x)))


def _padded(lengths, features=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randn(n, features, generator=g, dtype=torch.float64) for n in lengths]
    labels = [torch.randint(2, (n,), generator=g) for n in lengths]
    width = max(lengths)
    x = torch.zeros(len(lengths), width, features, dtype=torch.float64)
    y = torch.full((len(lengths), width), -100)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, (s, lab) in enumerate(zip(seqs, labels, strict=True)):
        x[i, : len(s)], y[i, : len(s)], mask[i, : len(s)] = s, lab, 1
    return x, y, mask, seqs, labels


def _alone(model, seqs, labels, expand, **kw):
    """The factors of the sequences each run alone, combined: A as the positions (expanded)
    or the examples (reduced) of all of them, G summed."""
    parts = [
        gradhooks.kfac(model, s[None], lab[None], fisher="empirical", reduction="sum",
                       expand=expand, **kw)
        for s, lab in zip(seqs, labels, strict=True)
    ]  # fmt: skip
    weights = [len(s) if expand else 1 for s in seqs]
    total = sum(weights)
    return {
        name: (sum(w * p[name].A for w, p in zip(weights, parts, strict=True)) / total,
               sum(p[name].G for p in parts))
        for name in parts[0]
    }  # fmt: skip


@pytest.mark.parametrize("expand", [True, False], ids=["expanded", "reduced"])
@pytest.mark.parametrize("mask_dtype", [torch.long, torch.bool, torch.float64])
def test_a_counts_the_real_positions_alone(expand, mask_dtype):
    torch.manual_seed(0)
    model = Tagger().double()
    x, y, mask, seqs, labels = _padded(LENGTHS)
    got = gradhooks.kfac(model, x, y, fisher="empirical", reduction="sum", expand=expand,
                         mask=mask.to(mask_dtype))  # fmt: skip
    want = _alone(model, seqs, labels, expand)
    assert set(got) == set(want)
    for name, (a, g) in want.items():
        torch.testing.assert_close(got[name].A, a, msg=f"A of {name}")
        torch.testing.assert_close(got[name].G, g, msg=f"G of {name}")
    unmasked = gradhooks.kfac(model, x, y, fisher="empirical", reduction="sum", expand=expand)
    assert not torch.allclose(unmasked["inp.weight"].A, got["inp.weight"].A)  # (it matters)


def test_a_padded_hugging_face_bert_as_its_sequences_alone():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=24, max_position_embeddings=16, num_labels=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    bert = transformers.BertForTokenClassification(config).double().eval()

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, ids, attention_mask=None):
            return self.bert(input_ids=ids, attention_mask=attention_mask).logits

    model = Logits()
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(1, 40, (n,), generator=g) for n in LENGTHS]
    labels = [torch.randint(2, (n,), generator=g) for n in LENGTHS]
    width = max(LENGTHS)
    batch_ids = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    batch_y = torch.full((len(LENGTHS), width), -100)
    mask = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    for i, (s, lab) in enumerate(zip(ids, labels, strict=True)):
        batch_ids[i, : len(s)], batch_y[i, : len(s)], mask[i, : len(s)] = s, lab, 1
    got = gradhooks.kfac(model, batch_ids, batch_y, kwargs={"attention_mask": mask},
                         fisher="empirical", reduction="sum", mask=mask)  # fmt: skip
    want = _alone(model, ids, labels, expand=True)
    for name, (a, g_) in want.items():
        torch.testing.assert_close(got[name].A, a, rtol=1e-9, atol=1e-12, msg=f"A of {name}")
        torch.testing.assert_close(got[name].G, g_, rtol=1e-9, atol=1e-12, msg=f"G of {name}")
    unmasked = gradhooks.kfac(model, batch_ids, batch_y, kwargs={"attention_mask": mask},
                              fisher="empirical", reduction="sum")  # fmt: skip
    assert set(got) == set(want) and len(got) > 4
    name = "bert.bert.encoder.layer.0.attention.self.query.weight"
    assert not torch.allclose(unmasked[name].A, got[name].A)  # (the padding counted there)


def test_a_mask_that_is_none_or_fits_no_layer_is_refused():
    torch.manual_seed(0)
    model = Tagger().double()
    x, y, mask, _, _ = _padded(LENGTHS)
    kfac = gradhooks.kfac
    raised(gradhooks.ConfigurationError, ["mask has shape (3, 4)", "no layer sees 4"],
           lambda: kfac(model, x, y, fisher="empirical", mask=mask[:, :4]))  # fmt: skip
    raised(gradhooks.ConfigurationError, ["mask has shape (2, 5)", "one row per example"],
           lambda: kfac(model, x, y, fisher="empirical", mask=mask[:2]))  # fmt: skip
    raised(gradhooks.ConfigurationError, ["0s and 1s"],
           lambda: kfac(model, x, y, fisher="empirical", mask=mask * 2))  # fmt: skip
    raised(gradhooks.ConfigurationTypeError, ["mask must be a tensor", "list"],
           lambda: kfac(model, x, y, fisher="empirical", mask=mask.tolist()))  # fmt: skip

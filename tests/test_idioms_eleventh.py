"""Training-loop idioms, an eleventh set: learned queries, odd batches, and misuse.

Each test writes again, on a small model and over several steps (``zero_grad``, an optimizer's
step), an idiom the earlier sets do not run: DETR's object queries (an ``nn.Embedding``'s
weight repeated along the batch and attending, through ``nn.MultiheadAttention``, to each
image's features, matched to the targets by the Hungarian algorithm) and a Perceiver's latents
expanded to the batch.
Each is compared with each example's own gradient by a per-example loop in float64
(:func:`gradhooks.oracle.loop_grad`), or checked to stop with an error that says what went
wrong and leaves the model as it was.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_grad1

D = torch.float64


def norms_of(want: dict) -> torch.Tensor:
    """Each example's gradient norm over every parameter of ``want`` (the loop's rows)."""
    return torch.sqrt(sum(g.flatten(1).square().sum(1) for g in want.values()))


# -- learned queries expanded to the batch, attending to each example --------------------------


class _DETR(nn.Module):
    """DETR's head on a small backbone: the image's features, sequence-first ``[HW, B, C]``
    with DETR's learned positions (two ``nn.Embedding`` called on ``arange``) added; ``query_embed.weight.unsqueeze(1).repeat(1, bs, 1)``
    (the object queries, the same for every image) added to a zero target, decoded by an
    ``nn.TransformerDecoderLayer`` against the features (its padded positions masked), then
    a class head and a box head per query."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Conv2d(2, 8, 3, padding=1)
        self.row_embed, self.col_embed = nn.Embedding(4, 4), nn.Embedding(4, 4)
        self.query_embed = nn.Embedding(3, 8)
        self.decoder = nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0)
        self.class_embed = nn.Linear(8, 3)  # two classes and "no object"
        self.bbox_embed = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, img, mask):
        h, w = img.shape[-2:]
        pos = torch.cat(  # DETR's PositionEmbeddingLearned, [H, W, C]
            [
                self.col_embed(torch.arange(w)).unsqueeze(0).expand(h, -1, -1),
                self.row_embed(torch.arange(h)).unsqueeze(1).expand(-1, w, -1),
            ],
            -1,
        )
        src = self.backbone(img).flatten(2).permute(2, 0, 1) + pos.flatten(0, 1).unsqueeze(1)
        query = self.query_embed.weight.unsqueeze(1).repeat(1, img.shape[0], 1)
        h = self.decoder(torch.zeros_like(query) + query, src, memory_key_padding_mask=mask)
        h = h.transpose(0, 1)  # [B, queries, C]
        return torch.cat([self.class_embed(h), self.bbox_embed(h).sigmoid()], -1)


def _detr_loss(out, target):
    """DETR's set loss, per image: each query matched to a target box or to "no object" by the
    Hungarian algorithm on the detached costs (one image's matching reads only its own
    outputs), then cross-entropy over the queries' classes and L1 over the matched boxes; the
    mean over the images."""
    logits, boxes = out[..., :3], out[..., 3:]
    losses = []
    for b in range(out.shape[0]):
        labels, tboxes = target[b, :, 0].long(), target[b, :, 1:]
        cost = torch.cdist(boxes[b], tboxes, p=1) - logits[b].softmax(-1)[:, labels]
        rows, cols = linear_sum_assignment(cost.detach().numpy())
        classes = torch.full((out.shape[1],), 2)
        classes[rows] = labels[cols]
        l1 = (boxes[b, rows] - tboxes[cols]).abs().sum() / len(cols)
        losses.append(F.cross_entropy(logits[b], classes) + l1)
    return torch.stack(losses).mean()


def _images(step: int):
    g = torch.Generator().manual_seed(step)
    img = torch.randn(3, 2, 4, 4, generator=g, dtype=D)
    mask = torch.zeros(3, 16, dtype=torch.bool)
    mask[step % 3, -4:] = True  # one image padded by its last row
    target = torch.cat(
        [torch.randint(2, (3, 2, 1), generator=g).to(D), torch.rand(3, 2, 2, generator=g, dtype=D)],
        -1,
    )
    return img, mask, target


def test_detr_object_queries_repeated_along_the_batch_through_the_decoder():
    """DETR's training loop: AdamW, ``clip_grad_norm_(0.1)``, three steps. The object queries
    (an ``nn.Embedding`` whose weight is used directly, never called) are repeated along the
    sequence-first batch, so the decoder's self-attention sees a batch-free query and its
    cross-attention a batch-free query against each image's features. Before, the tracker did
    not follow ``multi_head_attention_forward`` past a batch-free query: the class head's rule
    was given the queries as examples (a BatchNotFoundError naming it, advising ``batch_dim``),
    and batch first, the queries' weight was refused. grad1 (the queries' weight's included:
    each image's share of their gradient) is the float64 loop's, and so are the norms."""
    model = _DETR().to(D)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as hooks:
        for step in range(3):
            img, mask, target = _images(step)
            want = loop_grad(model, _detr_loss, (img, mask), target)
            opt.zero_grad()
            _detr_loss(model(img, mask), target).backward()
            assert_grad1(model, want, f"step {step}")
            torch.testing.assert_close(hooks.norms(), norms_of(want), rtol=1e-9, atol=1e-12)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            opt.step()


class _Perceiver(nn.Module):
    """A Perceiver's cross-attention: learned latents (a submodule's parameter) expanded to the
    batch, ``latents.expand(B, -1, -1)``, as the query against each example's projected
    inputs, batch first or sequence first."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.latents = nn.ParameterDict({"z": nn.Parameter(torch.randn(3, 8))})
        self.inp = nn.Linear(2, 8)
        self.cross = nn.MultiheadAttention(8, 2, batch_first=batch_first)
        self.head = nn.Linear(8, 2)
        self.batch_first = batch_first

    def forward(self, x):
        kv = self.inp(x)  # [B, S, C]
        z = self.latents["z"]
        if self.batch_first:
            q = z.expand(x.shape[0], -1, -1)
            h, _ = self.cross(q, kv, kv, need_weights=False)
            return self.head((h + q).mean(1))
        kv = kv.transpose(0, 1)
        q = z.unsqueeze(1).expand(-1, x.shape[0], -1)
        h, _ = self.cross(q, kv, kv)
        return self.head((h + q).mean(0))


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch first", "sequence first"])
def test_perceiver_latents_expanded_to_the_batch_as_the_attentions_query(batch_first):
    """Three steps of Adam on batches of 4, 5 and 4: grad1 (the latents' each example's share)
    is the float64 loop's. Before, the latents were refused ('multi_head_attention_forward'
    combines it with the batch in a way gradhooks cannot follow), or, sequence first, the head
    was given the latents as examples."""
    model = _Perceiver(batch_first).to(D)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with gradhooks.add_hooks(model):
        for step, n in enumerate((4, 5, 4)):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(n, 6, 2, generator=g, dtype=D), torch.randint(2, (n,), generator=g)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()

"""microsoft/LoRA's ``loralib`` layers (registered by name: ``gradhooks.rules.lora``), with
LoRA's dropout drawing its mask in the forward: ``grad1`` against the float64 per-example loop
run with the same mask (each example's row of the mask the forward drew, seeded), in float64
and in a training loop under bfloat16 autocast.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_close

loralib = pytest.importorskip("loralib")

D = torch.float64
BF16 = torch.bfloat16


class _Mask(nn.Module):
    """LoRA's dropout replaced by the mask a forward drew (``mask[rows]``, scaled as dropout
    scales it): the oracle's per-example runs see each example's own row of it."""

    def __init__(self, mask: Tensor) -> None:
        super().__init__()
        self.mask, self.rows = mask, slice(None)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.mask[self.rows].to(x.dtype)


def _grouped_forward(self, x: Tensor) -> Tensor:
    """``MergedLinear.forward`` as the LoRA repository's later ``loralib/layers.py`` writes it
    (the released package forms the update ``B A`` first): ``lora_A`` by ``F.linear`` after
    the dropout, ``lora_B`` by a convolution grouped by part over the positions, the parts
    put in place among zeros."""
    weight = self.weight.T if self.fan_in_fan_out else self.weight
    result = nn.functional.linear(x, weight, bias=self.bias)
    after_a = nn.functional.linear(self.lora_dropout(x), self.lora_A)
    parts = sum(self.enable_lora)
    after_b = nn.functional.conv1d(
        after_a.transpose(-2, -1), self.lora_B.unsqueeze(-1), groups=parts
    ).transpose(-2, -1)
    padded = after_b.new_zeros((*after_b.shape[:-1], self.out_features))
    padded[..., self.lora_ind] = after_b
    return result + padded * self.scaling


@pytest.fixture(params=["merged", "merged_grouped", "linear"])
def kind(request, monkeypatch):
    """The loralib layer: ``MergedLinear`` as released, as the repository writes it now, or
    ``Linear``."""
    if request.param == "merged_grouped":
        monkeypatch.setattr(loralib.layers.MergedLinear, "forward", _grouped_forward)
    return request.param


def _layer(kind: str) -> nn.Module:
    if kind.startswith("merged"):  # (as GPT-2's c_attn in LoRA's NLG example: q and v updated)
        return loralib.MergedLinear(
            4, 6, r=2, lora_alpha=4, lora_dropout=0.5, enable_lora=[True, False, True],
            fan_in_fan_out=True, merge_weights=False,
        )  # fmt: skip
    return loralib.Linear(4, 6, r=2, lora_alpha=4, lora_dropout=0.5, merge_weights=False)


class _Model(nn.Module):
    """A loralib layer (its frozen weight, trainable bias and LoRA pair) under a Linear head."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lora = _layer(kind)
        nn.init.normal_(self.lora.lora_B)  # (zeros at first: no gradient to lora_A)
        self.head = nn.Linear(6, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.lora(x)))


def _loss(out: Tensor) -> Tensor:
    return (out.float() ** 2).sum()


def _masked_loop(model: _Model, x: Tensor, seed: int) -> dict[str, Tensor]:
    """The float64 per-example loop, each example with its row of the mask that a forward
    seeded with ``seed`` draws (dropout of a tensor of ones: the same draws)."""
    torch.manual_seed(seed)
    mask = nn.functional.dropout(torch.ones(x.shape, dtype=D), model.lora.lora_dropout.p)
    ref = copy.deepcopy(model).double()
    ref.lora.lora_dropout = _Mask(mask)
    rows: dict[str, list[Tensor]] = {}
    for b in range(x.shape[0]):
        ref.lora.lora_dropout.rows = slice(b, b + 1)
        for n, g in loop_grad(ref, _loss, x[b : b + 1].double()).items():
            rows.setdefault(n, []).append(g)
    return {n: torch.cat(g) for n, g in rows.items()}


def test_lora_layer_with_dropout(kind):
    """Refused before (no rule: the fallback cannot recompute a random dropout per example);
    now ``grad1`` of the bias and the LoRA pair is the loop's with the same mask, up to
    float64's rounding."""
    model = _Model(kind).double()
    x = torch.randn(3, 5, 4, dtype=D, generator=torch.Generator().manual_seed(1))
    want = _masked_loop(model, x, seed=7)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        torch.manual_seed(7)
        _loss(model(x)).backward()
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert_close(p.grad1, want[n], f"{kind}: {n}")
        else:
            assert not hasattr(p, "grad1"), n


def test_lora_layer_trains_under_bfloat16_autocast(kind):
    """Three SGD steps of the float32 model, each forward under bfloat16 autocast with a new
    mask: ``grad1`` within 16 units of bfloat16's eps of the largest entry of the float64
    loop's (same mask, that step's parameters); the run-time check passes every step."""
    model = _Model(kind)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    g = torch.Generator().manual_seed(2)
    with gradhooks.add_hooks(model, loss_reduction="mean"):
        for step in range(3):
            x = torch.randn(4, 5, 4, generator=g)
            want = _masked_loop(model, x, step)
            opt.zero_grad()
            torch.manual_seed(step)
            with torch.autocast("cpu", dtype=BF16):
                out = model(x)
            (_loss(out) / x.shape[0]).backward()
            largest = max(float(w.abs().max()) for w in want.values())
            for n, p in model.named_parameters():
                if p.requires_grad:
                    err = float((p.grad1.double() - want[n]).abs().max())
                    assert err <= 16 * torch.finfo(BF16).eps * largest, (step, n, err)
            opt.step()


def test_lora_dropout_under_activation_checkpointing_is_refused():
    """Under non-reentrant checkpointing the forward's saved tensors are not kept, so the
    dropped input cannot be read: refused (an UnsupportedError naming the layer), never a
    grad1 of another mask."""
    model = _Model("linear").double()
    x = torch.randn(3, 5, 4, dtype=D, generator=torch.Generator().manual_seed(1))
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        out = model.head(torch.tanh(checkpoint(model.lora, x, use_reentrant=False)))
        with pytest.raises(gradhooks.UnsupportedError, match="'lora'"):
            _loss(out).backward()


@pytest.mark.parametrize("kind", ["embedding", "conv2d"])
def test_lora_embedding_and_conv2d(kind):
    """loralib's ``Embedding`` (its dropout forced to 0) and ``Conv2d`` (whose forward does not
    use its dropout, 0.5 here) have no rule and go through the fallback: ``grad1`` is the
    float64 loop's."""
    torch.manual_seed(0)
    if kind == "embedding":
        layer = loralib.Embedding(7, 3, r=2, lora_alpha=2, merge_weights=False)
        x = torch.randint(7, (3, 4), generator=torch.Generator().manual_seed(1))
    else:
        layer = loralib.Conv2d(2, 3, 3, r=2, lora_alpha=2, lora_dropout=0.5, merge_weights=False)
        x = torch.randn(3, 2, 5, 5, dtype=D, generator=torch.Generator().manual_seed(1))
    nn.init.normal_(layer.lora_B)
    model = nn.Sequential(layer, nn.Flatten(), nn.LazyLinear(2)).double()
    model(x[:1])  # (the lazy head's size)
    want = loop_grad(model, _loss, x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        _loss(model(x)).backward()
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert_close(p.grad1, want[n], f"{kind}: {n}")

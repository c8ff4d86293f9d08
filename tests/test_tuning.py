"""The thresholds between equivalent paths (``gradhooks.TUNING``): at either extreme of every
one, grad1, the norms and the squared sums stay the oracles', in float64."""

import copy
import dataclasses

import pytest
import torch
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad, vmap_grad
from harness import assert_close

D = torch.float64


class Mixed(nn.Module):
    """A token table, a Linear over positions, a convolution over them, a tied head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.mix = nn.Linear(8, 8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        h = torch.tanh(self.mix(self.emb(tokens)))  # [batch, positions, 8]
        h = torch.tanh(self.conv(h.transpose(1, 2))).transpose(1, 2)
        return self.head(h).mean(1)  # [batch, 20]


def _one(out, y):
    return nn.functional.cross_entropy(out, y, reduction="sum")


FIELDS = [f.name for f in dataclasses.fields(gradhooks.Tuning)]
EXTREMES = {
    "rows_counted_max_shared": (0.0, 1.0),
}


@pytest.mark.parametrize("extreme", ["low", "high"])
@pytest.mark.parametrize("field", FIELDS)
def test_every_threshold_at_either_extreme_gives_the_oracles_numbers(field, extreme):
    low, high = EXTREMES.get(field, (1, 10**9))
    torch.manual_seed(0)
    model = Mixed().to(D)
    tokens, y = torch.randint(20, (3, 40)), torch.randint(20, (3,))
    want = vmap_grad(model, _one, tokens, y)
    loop = loop_grad(model, _one, tokens, y)
    ref = copy.deepcopy(model)
    nn.functional.cross_entropy(ref(tokens), y).backward()
    value = low if extreme == "low" else high
    with gradhooks.tuned(**{field: value}):
        quantities = ("grad1", "norms", "sum_grad_sq")
        with gradhooks.add_hooks(model, quantities=quantities) as h:
            nn.functional.cross_entropy(model(tokens), y).backward()
            norms, sums = h.param_norms(), h.sum_grad_sq()
    for name, p in model.named_parameters():
        assert_close(loop[name], want[name], f"{name}: loop vs vmap")
        assert_close(p.grad1, want[name], f"{field}={value}: grad1 of {name}")
        assert_close(norms[name], want[name].flatten(1).norm(dim=1), f"{field}={value}: norms")
        assert_close(sums[name], want[name].square().sum(0), f"{field}={value}: squared sums")
        assert_close(p.grad, ref.get_parameter(name).grad, f"{field}={value}: .grad of {name}")


def test_tuned_refuses_an_unknown_name_and_puts_every_value_back():
    before = dataclasses.asdict(gradhooks.TUNING)
    with pytest.raises(
        gradhooks.ConfigurationTypeError, match="no threshold named sum_grad1_position;"
    ):
        with gradhooks.tuned(sum_grad1_position=1):
            pass
    with pytest.raises(RuntimeError, match="inside"):
        with gradhooks.tuned(sum_grad1_positions=1, chunk_elements=7) as tuning:
            assert tuning.sum_grad1_positions == 1 and tuning.chunk_elements == 7
            raise RuntimeError("inside")
    assert dataclasses.asdict(gradhooks.TUNING) == before


class LowRank(nn.Module):
    """A LoRA-like pair over positions: 16 features down to a rank of 4 and up to 24, the up
    projection used twice (its second use adds into grad1 already written)."""

    def __init__(self) -> None:
        super().__init__()
        self.down, self.up = nn.Linear(16, 4, bias=False), nn.Linear(4, 24)

    def forward(self, x):
        h = self.down(x)
        return (self.up(h) + self.up(torch.tanh(h))).mean(1)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("narrow", [0, 8], ids=["batched matmul", "transposed product"])
def test_narrow_inputs_both_ways_and_added_into(narrow, reduction):
    """``narrow_in_features``: the up projection's grad1 (4 inputs, 24 outputs, 10 positions)
    formed either way, and added into by a second backward of the same examples (gradient
    accumulation), is the oracle's."""
    torch.manual_seed(0)
    model = LowRank().to(D)
    x, y = torch.randn(3, 10, 16, dtype=D), torch.randn(3, 24, dtype=D)
    loss = lambda out, y: (out - y).square().sum()  # noqa: E731
    want = vmap_grad(model, loss, x, y)
    scale = 3 if reduction == "mean" else 1
    with gradhooks.tuned(narrow_in_features=narrow):
        with gradhooks.add_hooks(model, loss_reduction=reduction):
            for _ in range(2):
                (loss(model(x), y) / scale).backward()
    for name, p in model.named_parameters():
        assert_close(p.grad1, 2 * want[name], f"narrow={narrow}: grad1 of {name}")

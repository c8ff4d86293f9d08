"""Models of more pure-Python libraries against the per-example loop, through
``bench.lib_sweep``, as ``tests/test_lib_sweep.py`` runs the first ones: hierarchical and agent
attention, hyper-connections' residual streams (and their Sinkhorn-projected kind), a
Mogrifier LSTM, FrEIA's invertible networks, vit-pytorch's looped and U-shaped ViTs; and
those refused, each by gradhooks' own error naming the layer (BatchNorm in training mode,
a log-determinant of no example, NaViT's list of images taken out of the batch one by one);
and, in plain torch, an auxiliary loss of the batch returned by a module without a rule
(mixture-of-experts' balance loss), split into the examples' shares by the fallback. A model
whose library is not installed is skipped."""

from __future__ import annotations

import pytest
import torch
from test_lib_sweep import (  # noqa: F401 (_quiet: a fixture, used by name)
    _quiet,
    assert_setting_match,
    assert_swept_match,
    assert_swept_refused,
)
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad

# The quicker ones of each library: bench.lib_sweep runs them all (H-Transformer-1D's
# bidirectional and causal kinds, Jumbo ViT, RegionViT too).
MODELS = [
    "h-transformer-1d-reversible",  # hierarchical attention, reversible layers
    "agent-transformer",  # agent tokens: a parameter repeated for the batch, attended to
    "hyper-connections",  # residual streams mixed by input-dependent weights
    "hyper-connections-mhc",  # the streams' mixing projected by Sinkhorn iterations
    "mogrifier-lstm",  # input and state modulating each other before an LSTMCell step
    "freia-all-in-one",  # affine couplings, a learned ActNorm, a log-determinant per example
    "simple-uvit",  # long skips between blocks, register tokens
    "looped-vit",  # blocks looped over, a loss at every loop
    "moe-top2",  # mixture-of-experts: top-2 gating, its balance loss returned by the gate
]


@pytest.mark.parametrize("name", MODELS)
def test_library_model_matches_the_loop(name):
    assert_swept_match(name)


@pytest.mark.parametrize(
    "name, error",
    [
        ("efficientnet", gradhooks.MixedExamplesError),  # BatchNorm2d in training mode
        ("botnet", gradhooks.MixedExamplesError),  # the same, between attention bottlenecks
        # ActNorm's log-determinant, the same row for every example: no example in it
        ("freia-glow", gradhooks.UnsupportedInputError),
        # each example's images taken out of the batch alone and packed into one sequence
        ("navit", gradhooks.MixedExamplesError),
    ],
)
def test_library_model_refused(name, error):
    assert_swept_refused(name, error)


@pytest.mark.parametrize(
    "name, setting",
    [
        ("hyper-connections", "bf16-autocast"),
        ("mogrifier-lstm", "training"),
        ("moe-top2", "bf16-autocast"),
    ],
)
def test_library_model_in_another_setting(name, setting):
    """bfloat16 autocast (against the float64 loop, at 5e-2), 3 SGD steps."""
    assert_setting_match(name, setting)


def test_batch_mapped_by_vmap_in_the_forward_is_refused_naming_it():
    """s5-pytorch maps its recurrence over the batch with torch.vmap inside its forward:
    gradhooks cannot follow the examples through it, and its refusal names that cause and
    what to do instead."""
    lib_sweep = pytest.importorskip("bench.lib_sweep")
    pytest.importorskip("s5")
    try:
        ex = lib_sweep.build("s5-block")
    except lib_sweep.Skip as e:
        # (its initialiser's torch.tensor of a list of one-entry tensors has failed in the
        # whole suite's process, after other files ran, with "len() of a 0-d tensor")
        pytest.skip(f"s5-pytorch's model does not build in this process: {e}")
    with pytest.raises(gradhooks.UnsupportedError, match=r"torch\.vmap") as caught:
        with gradhooks.add_hooks(ex.model, loss_reduction=ex.reduction):
            lib_sweep.total_loss(ex).backward()
    assert "'layer.s5.seq.Lambda'" in str(caught.value)


# -- a loss of the batch returned beside the outputs, in a module without a rule ----------------


class GateWithAuxLoss(nn.Module):
    """A gate whose weight it uses directly (so the fallback recomputes it) that returns its
    gated input and an auxiliary loss of the whole batch: each example's own, averaged
    (``reduce="mean"``) or summed, or the batch's variance of them (``"var"``, which mixes
    the examples). ``item`` reads a number of each example (data-dependent code that
    torch.vmap cannot run: the fallback then recomputes by a loop)."""

    def __init__(self, reduce: str = "mean", item: bool = False):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))
        self.reduce, self.item = reduce, item

    def forward(self, x):
        gates = torch.einsum("bnd,de->bne", x, self.w).softmax(-1)
        own = gates.mean(1).pow(2).sum(-1)  # [batch], each example's balance
        if self.item:
            own = own * (1.0 + 0 * float(x[0, 0, 0]))
        aux = {"mean": own.mean, "sum": own.sum, "var": own.var}[self.reduce]()
        return x * gates.max(-1, keepdim=True).values, aux


class AuxModel(nn.Module):
    def __init__(self, gate: GateWithAuxLoss):
        super().__init__()
        self.inp, self.gate, self.out = nn.Linear(4, 4), gate, nn.Linear(4, 2)

    def forward(self, x):
        h, aux = self.gate(self.inp(x))
        return self.out(h).pow(2).flatten(1).sum(1), aux


@pytest.mark.parametrize("reduce", ["mean", "sum"])
@pytest.mark.parametrize("item", [False, True], ids=["vmapped", "looped"])
def test_loss_of_the_batch_from_a_module_matches_the_loop(reduce, item):
    """The fallback recomputes each example alone; the batch's scalar, the mean or the sum of
    those examples' values, gives each example its share (float64, against the loop; the
    task's loss averaged or summed alike, so that the batch's loss is each example's, averaged
    or summed)."""
    torch.manual_seed(0)
    model = AuxModel(GateWithAuxLoss(reduce, item)).double()
    x = torch.randn(3, 5, 4, dtype=torch.float64)

    def loss(out):  # (the task's loss reduced over the batch as the auxiliary one is)
        task, aux = out
        return getattr(task, reduce)() + aux

    want = loop_grad(model, loss, x)
    with gradhooks.add_hooks(model, loss_reduction=reduce):
        loss(model(x)).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad1, want[name], rtol=1e-7, atol=1e-10, msg=name)


def test_statistic_of_the_batch_from_a_module_is_refused():
    """A variance over the examples is neither their mean nor their sum."""
    torch.manual_seed(0)
    model = AuxModel(GateWithAuxLoss("var")).double()
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    with pytest.raises(gradhooks.MixedExamplesError), gradhooks.add_hooks(model):
        task, aux = model(x)
        (task.mean() + aux).backward()

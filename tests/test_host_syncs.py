"""A training step that reads no value back from the device.

On a GPU, reading a tensor's value on the host (``.item()``, ``bool(t)``, ``float(t)``,
``.tolist()``, an operation whose result's size depends on the values: ``torch.unique``,
``nonzero``) waits until every kernel queued before it has run: the host can no longer queue
the next kernels while the device works. These tests count such reads made by gradhooks'
own code in a steady-state step (past the steps the run-time check verifies: the 1st, 2nd,
4th, 8th... backward) of grad1, the norms and the DP step, on CPU, where each one would be a
wait on a GPU.

One read per step is left, by design: a call that does not depend on the examples (position
embeddings looked up once for the whole batch) gets its per-example output-gradients from
where its output meets the batch, and those must add up to the gradient autograd gives it
(``verify.per_example_outputs``); the check's outcome decides whether the step raises.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
import gradhooks.devices
from gradhooks.oracle import loop_grad
from harness import assert_close

PACKAGE = str(Path(gradhooks.__file__).resolve().parent)

# what reads a value back, or makes a tensor whose size depends on the values
TENSOR_READS = ("item", "__bool__", "__float__", "__int__", "__index__", "tolist", "numpy",
                "nonzero", "unique")  # fmt: skip
TORCH_READS = ("unique", "nonzero", "masked_select", "argwhere", "allclose", "equal")


def _ours() -> bool:
    """Whether gradhooks' code is on the stack of the calling frame."""
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_filename.startswith(PACKAGE):
            return True
        f = f.f_back
    return False


class Reads:
    """Counts the reads of :data:`TENSOR_READS` and :data:`TORCH_READS` that gradhooks' code
    makes while ``on`` (where, by the innermost gradhooks frame)."""

    def __init__(self, monkeypatch) -> None:
        self.on = False
        self.where: list[str] = []
        for name in TENSOR_READS:
            monkeypatch.setattr(torch.Tensor, name, self._counted(getattr(torch.Tensor, name)))
        for name in TORCH_READS:
            monkeypatch.setattr(torch, name, self._counted(getattr(torch, name)))
        for name in ("__getitem__", "__setitem__"):  # (a boolean mask: its entries counted)
            monkeypatch.setattr(torch.Tensor, name, self._masked(getattr(torch.Tensor, name)))

    def _counted(self, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if self.on and _ours():
                self.where.append(f"{fn.__name__} at {_innermost()}")
            return fn(*args, **kwargs)

        return counted

    def _masked(self, fn):
        @functools.wraps(fn)
        def counted(t, index, *rest):
            if self.on and _mask_in(index) and _ours():
                self.where.append(f"{fn.__name__} with a mask at {_innermost()}")
            return fn(t, index, *rest)

        return counted


def _mask_in(index) -> bool:
    """Whether an index holds a boolean tensor (its entries decide the result's size)."""
    if isinstance(index, torch.Tensor):
        return index.dtype == torch.bool
    return isinstance(index, tuple | list) and any(_mask_in(i) for i in index)


def _innermost() -> str:
    f = sys._getframe(2)
    while f is not None and not f.f_code.co_filename.startswith(PACKAGE):
        f = f.f_back
    return "?" if f is None else f"{Path(f.f_code.co_filename).name}:{f.f_lineno}"


class Positions(nn.Module):
    """Token and position embeddings (the positions looked up once for every example, as
    GPT-2 and BERT do), a LayerNorm, a Linear over the positions and a head."""

    def __init__(self, vocab: int = 11, width: int = 8, length: int = 6) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(length, width)
        self.norm = nn.LayerNorm(width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = self.positions(torch.arange(ids.shape[1], device=ids.device))
        h = self.norm(self.tokens(ids) + pos)
        return self.head(torch.tanh(self.mix(h)))


def _mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    return model, torch.randn(5, 6), torch.randint(0, 3, (5,))


def _positions() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    # (token 3 twice in an example: rows of the table an example hits more than once)
    ids = torch.tensor([[1, 3, 3, 4, 5, 3], [2, 2, 7, 0, 9, 1], [3, 3, 3, 3, 3, 3]])
    return Positions(), ids, torch.randint(0, 11, (3, 6))


def _loss(out: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    if out.dim() == 2:
        return F.cross_entropy(out, y, reduction=reduction)
    per = F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none")
    per = per.view(y.shape).mean(1)
    return per.mean() if reduction == "mean" else per


def _steps(make, method: str, reads: Reads, steps: int = 8) -> None:
    """``steps`` training steps; reads counted in the 5th to 7th (none verified)."""
    model, x, y = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    quantities = ("grad1",) if method in ("grad1", "dp-grad1") else ("norms",)
    hooks = gradhooks.add_hooks(model, loss_reduction="mean", quantities=quantities)
    for step in range(1, steps + 1):
        reads.on = 5 <= step <= 7
        opt.zero_grad()
        if method == "grad1":
            _loss(model(x), y).backward()
        elif method == "norms":
            _loss(model(x), y).backward()
            hooks.norms()
        else:
            per = _loss(model(x), y, reduction="none")
            gradhooks.dp_sgd_step(hooks, per, max_norm=0.5, noise_multiplier=1.0,
                                  method=method.split("-")[1])  # fmt: skip
        opt.step()
        hooks.clear()
    reads.on = False
    hooks.remove()


@pytest.mark.parametrize("method", ["grad1", "norms", "dp-bookkeeping", "dp-ghost", "dp-grad1"])
def test_a_model_without_shared_calls_reads_nothing_back(monkeypatch, device_like, method):
    reads = Reads(monkeypatch)
    _steps(_mlp, method, reads)
    assert reads.where == []


@pytest.mark.parametrize("method", ["grad1", "norms", "dp-bookkeeping", "dp-ghost", "dp-grad1"])
def test_position_embeddings_read_back_one_check_per_step(monkeypatch, device_like, method):
    """The per-example output-gradients of the positions' call are checked against
    autograd's at every step (one read); the embeddings' norms over the rows each example
    hits (token 3 several times in an example) are formed without ``torch.unique``."""
    reads = Reads(monkeypatch)
    _steps(_positions, method, reads)
    assert len(reads.where) == 3, reads.where  # (steps 5, 6, 7)
    assert all("verify.py" in w for w in reads.where), reads.where


@pytest.mark.parametrize("free", [True, False], ids=["cpu", "device-like"])
def test_the_paths_that_read_nothing_back_give_the_loops_numbers(monkeypatch, free):
    """grad1 and the norms of the embeddings (rows hit several times by an example, every
    position once in order) by the paths a device takes, against a per-example loop in
    float64."""
    monkeypatch.setattr(gradhooks.devices, "reads_are_free", lambda t: free)
    model, ids, y = _positions()
    model = model.double()
    want = loop_grad(model, lambda out, t: _loss(out, t, "none").sum(), ids, y)
    for quantities in (("grad1",), ("norms",)):
        hooks = gradhooks.add_hooks(model, quantities=quantities, loss_reduction="sum")
        _loss(model(ids), y, "none").sum().backward()
        if quantities == ("grad1",):
            for name, p in model.named_parameters():
                assert_close(p.grad1, want[name], name)
        else:
            norms = torch.stack([w.flatten(1).square().sum(1) for w in want.values()]).sum(0)
            assert_close(hooks.norms().square(), norms, "norms")
        hooks.remove()
        model.zero_grad()


def test_a_loss_term_of_the_shared_output_alone_is_refused():
    """The check that read guards: a loss term that uses the positions' output by itself
    gives it a gradient that belongs to no example."""

    class Returns(Positions):
        def forward(self, ids):
            pos = self.positions(torch.arange(ids.shape[1]))
            return self.head(self.tokens(ids) + pos), pos

    torch.manual_seed(0)
    model = Returns().double()
    gradhooks.add_hooks(model)
    out, pos = model(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    with pytest.raises(gradhooks.BatchNotFoundError, match=r"'positions'.*reached it another way"):
        (out.sum() + pos.square().sum()).backward()


def test_non_finite_gradients_of_a_shared_call_are_carried_through():
    """NaN and Inf in the output-gradient of the positions' call are carried into grad1 as
    autograd carries them into ``.grad``, not taken for a gradient that reached it another
    way."""
    torch.manual_seed(0)
    model = Positions().double()
    hooks = gradhooks.add_hooks(model, verify=False)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    weights = torch.ones(2, 3, 11, dtype=torch.float64)
    weights[1, 0, 0] = float("nan")
    (model(ids) * weights).sum().backward()
    g1 = model.positions.weight.grad1
    assert torch.isnan(g1[1]).any() and not torch.isnan(g1[0]).any()
    assert torch.equal(torch.isnan(g1.sum(0)), torch.isnan(model.positions.weight.grad))
    hooks.remove()


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_hugging_face_models_of_the_host_suite(monkeypatch, device_like, name):
    """The DP step on the host suite's tiny Hugging Face models: GPT-2 looks its positions up
    once for the whole batch (one check a step), Llama (rotary positions) does not. (BERT
    reads as GPT-2 does, ViT and the CNN as Llama, for grad1, the norms and both DP methods:
    left out for the suite's time.)"""
    pytest.importorskip("transformers")
    from bench import measure
    from bench.problems import PROBLEMS

    problem = PROBLEMS[name]

    class Logits(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, x):
            out = self.model(x)
            return out.logits if hasattr(out, "logits") else out

    def make():
        model, x, y = measure.instance(problem, problem.batch, "cpu")
        return Logits(model), x, y

    reads = Reads(monkeypatch)
    _steps(make, "dp-bookkeeping", reads)
    assert len(reads.where) == (3 if name == "tiny-gpt2" else 0), reads.where

"""The spot check of the backwards between the run-time check's full ones (``verify=True``, on
the CPU, ``grad1`` in float32 or float64): some entries of one parameter's ``grad1``, a parameter
after another, against autograd's gradient. A loss term on the parameters that starts after the
first steps is refused where the spot check reaches a parameter it touches; an ordinary training
loop never is."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import cpu_only


def _mlp(dtype=torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(dtype)


def _batch(step: int, dtype=torch.float64, n: int = 5):
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 4, generator=g, dtype=dtype), torch.randint(0, 3, (n,), generator=g)


@cpu_only("the spot check between the full checks runs on the CPU alone")
def test_a_penalty_on_one_parameter_from_the_ninth_step_is_refused_at_its_turn():
    """A penalty on the last layer's bias alone, from the 9th backward on: the full checks run
    at the 1st, 2nd, 4th, 8th and 16th; every backward in between compares one parameter in
    turn, so the bias's turn comes within as many backwards as there are parameters (before the
    16th), and the error names it. Until then grad1 is the examples' own."""
    model = _mlp()
    params = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    refused_at = None
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for step in range(1, 17):
            x, y = _batch(step)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y, reduction="sum")
            if step >= 9:
                loss = loss + 10.0 * (model[2].bias ** 2).sum()
            try:
                loss.backward()
            except gradhooks.CheckFailedError as e:
                assert "'2.bias'" in str(e) and "does not add up" in str(e), str(e)
                refused_at = step
                break
            if step < 9:
                want = loop_grad(model, lambda o, t: F.cross_entropy(o, t, reduction="sum"), x, y)
                for name, p in model.named_parameters():
                    torch.testing.assert_close(p.grad1, want[name], rtol=1e-7, atol=1e-9)
            opt.step()
    assert refused_at is not None and 9 <= refused_at < 9 + len(params), refused_at


def test_without_verify_nothing_is_compared():
    """``verify=False``: neither the full checks nor the spot check (grad1 of the per-example
    terms alone, as documented)."""
    model = _mlp()
    with gradhooks.add_hooks(model, verify=False):
        for step in range(1, 6):
            x, y = _batch(step)
            model.zero_grad()
            (
                F.cross_entropy(model(x), y) + sum((p**2).sum() for p in model.parameters())
            ).backward()
    want = loop_grad(model, F.cross_entropy, x, y)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad1, want[name], rtol=1e-7, atol=1e-9)


@cpu_only("the spot check between the full checks runs on the CPU alone")
def test_micro_batches_accumulated_in_grad1_are_compared_by_what_each_added():
    """``grad1`` summed over micro-batches (no ``zero_grad`` between them): the spot check
    compares what the backward added, not the sum so far. Ten micro-batches pass; a penalty on
    every parameter in the 11th (the full checks' turns are the 8th and 16th) is refused there,
    and that backward's grad1 undone."""
    model = _mlp(torch.float32)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for step in range(1, 11):
            x, y = _batch(step, torch.float32, 4)
            F.cross_entropy(model(x), y, reduction="sum").backward()
        x, y = _batch(11, torch.float32, 4)
        g1 = {n: p.grad1.clone() for n, p in model.named_parameters()}
        loss = F.cross_entropy(model(x), y, reduction="sum")
        loss = loss + sum((p**2).sum() for p in model.parameters())
        with pytest.raises(gradhooks.CheckFailedError, match="does not add up"):
            loss.backward()
        for n, p in model.named_parameters():  # (that backward's grad1 undone)
            torch.testing.assert_close(p.grad1, g1[n], rtol=0, atol=0)


class _Encoder(nn.Module):
    """Embedding, a Transformer encoder layer (its in-projection holds the keys' bias, whose
    gradient is zero by symmetry) and a head, in float32."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 8)
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens):
        return self.head(self.layer(self.emb(tokens)).mean(1))


def test_an_ordinary_float32_training_loop_is_never_refused():
    """Thirty steps of Adam on a float32 encoder with an embedding and attention, every
    parameter compared by the spot check several times: no false alarm, and grad1 stays the
    examples' own (checked against the float64 loop at the last step)."""
    model = _Encoder()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    with gradhooks.add_hooks(model):
        for step in range(30):
            tokens = torch.randint(0, 11, (6, 5), generator=g)
            y = torch.randint(0, 3, (6,), generator=g)
            opt.zero_grad()
            F.cross_entropy(model(tokens), y).backward()
            if step < 29:
                opt.step()
    want = loop_grad(model.double(), F.cross_entropy, tokens, y)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad1.double(), want[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("order", ["before", "after"])
def test_a_scaling_hook_of_the_users_is_followed_at_every_step(order):
    """A hook that halves one weight's gradient, registered before or after ``add_hooks``:
    ``grad1`` is halved as ``.grad`` is, and the spot check compares it with the gradient
    ``.grad`` gets, at each of ten backwards (no false alarm)."""
    model = _mlp()
    first = model[0].weight
    if order == "before":
        first.register_hook(lambda g: g * 0.5)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        if order == "after":
            first.register_hook(lambda g: g * 0.5)
        for step in range(1, 11):
            x, y = _batch(step)
            model.zero_grad()
            F.cross_entropy(model(x), y, reduction="sum").backward()
            # (the loop's backwards run the hook too: its rows are halved)
            want = loop_grad(model, lambda o, t: F.cross_entropy(o, t, reduction="sum"), x, y)
            for name, p in model.named_parameters():
                torch.testing.assert_close(p.grad1, want[name], rtol=1e-7, atol=1e-9)
            torch.testing.assert_close(first.grad1.sum(0), first.grad, rtol=1e-7, atol=1e-9)


def test_an_empty_parameter_is_passed_over():
    """A parameter with no entries (``nn.Linear(6, 0)`` beside the head) has nothing to
    compare: ten backwards run, the spot check taking the others in turn."""
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {"body": nn.Linear(4, 6), "empty": nn.Linear(6, 0), "head": nn.Linear(6, 3)}
    )
    model = model.double()

    def run(x):
        h = torch.tanh(model["body"](x))
        return model["head"](h) + model["empty"](h).sum(-1, keepdim=True)

    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for step in range(1, 11):
            x, y = _batch(step)
            model.zero_grad()
            F.cross_entropy(run(x), y, reduction="sum").backward()
    assert model["empty"].weight.grad1.shape == (5, 0, 6)


@cpu_only("the spot check between the full checks runs on the CPU alone")
def test_batch_and_dtype_changed_between_steps_are_compared_and_refused():
    """The spot check keeps, per parameter, its entries' indices and a row of ones for each
    batch: with the batch's size changing at every step and the model turned from float64 to
    float32 after the 5th, every step's grad1 is the examples' own (no false alarm), and a
    penalty on every parameter from the 9th step is refused there, before the full check of
    the 16th."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    refused_at = None
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        for step in range(1, 17):
            dtype = torch.float64 if step <= 5 else torch.float32
            if step == 6:
                model.float()
            x, y = _batch(step, dtype, n=(5, 3, 7)[step % 3])
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y, reduction="sum")
            if step >= 9:
                loss = loss + 10.0 * sum((p**2).sum() for p in model.parameters())
            try:
                loss.backward()
            except gradhooks.CheckFailedError as e:
                assert "does not add up" in str(e), str(e)
                refused_at = step
                break
            want = loop_grad(model, lambda o, t: F.cross_entropy(o, t, reduction="sum"), x, y)
            tol = {"rtol": 1e-7, "atol": 1e-9} if step <= 5 else {"rtol": 1e-4, "atol": 1e-5}
            for name, p in model.named_parameters():
                assert p.grad1.shape[0] == x.shape[0]
                torch.testing.assert_close(p.grad1, want[name].to(p.dtype), **tol)
            opt.step()
    assert refused_at == 9, refused_at

"""Mistakes of a mixed-precision training loop, a thirteenth set.

The optimizer's step taken inside the ``torch.autocast`` block the forwards run in (the whole
loop under one ``with torch.autocast(...)``): autocast's cast cache keeps each weight's cast of
the block's first forward, and the later forwards run with it; found and fixed: the rules that
compute from the weights (the Transformer layers, ``MultiheadAttention``, the recurrent
layers, the fallback) computed from the stepped weights, so that ``grad1`` no longer reduced
to ``.grad`` (an LSTM's at the second step, a Transformer layer's 14% off at the third, in
silence; or refused as a mixing of the examples where the check ran), and are now refused with
a ``StateError`` naming the parameter, autocast's cache and the remedies, which train as the
per-example loop says (also where the hooks are added again at each step inside the block). Then: a weight changed in place between the forward and
its backward under autocast (autograd keeps the cast, not the weight); a validation forward
with grad left on; two scaled backwards without ``zero_grad``, then a batch of another size;
a loss that mixes the examples; a batch of one under a ``GradScaler`` (and in a train-mode
``BatchNorm``); ``loss_reduction="sum"`` declared for a mean loss under a ``GradScaler``
(found and fixed: ``check`` put the whole factor on the scaler, or on neither); ``grad1`` read
after the scaler's step and update; a model cast to bfloat16 between the forward and its
backward. Each gives the documented meaning, compared with each example's own gradient by the
per-example loop in float64 (:func:`gradhooks.oracle.loop_grad`) within the rounding of the
precision the step ran in, or stops with the typed error of its kind whose message names what
was refused and what to do (``tests/test_misuse.py`` to ``tests/test_misuse_twelfth.py`` hold
the earlier sets).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import (
    assert_untouched,
    model_state,
    one_thread,  # noqa: F401 (autouse in this module)
    raised,
)

D = torch.float64
BF16, FP16 = 5e-2, 1e-2  # the rounding allowed: of the largest entry, per parameter


def bf16(**kwargs):
    return torch.autocast("cpu", dtype=torch.bfloat16, **kwargs)


def batch(step: int, n: int = 4, shape: tuple = (4,), classes: int = 3):
    """``n`` float32 examples of ``shape`` and their labels, from a generator seeded with
    ``step``."""
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(n, *shape, generator=g), torch.randint(classes, (n,), generator=g)


def ce(out, y):
    return F.cross_entropy(out.float(), y)


def near(got, want, rel: float, what: str) -> None:
    """``got`` within ``rel`` of ``want``'s largest entry (and of the same shape)."""
    assert got.shape == want.shape, f"{what}: {tuple(got.shape)} != {tuple(want.shape)}"
    scale = want.abs().max().item()
    err = (got.double() - want.double()).abs().max().item()
    assert err <= rel * max(scale, 1e-12), f"{what}: {err:.3e} off, largest {scale:.3e}"


def loop(model: nn.Module, x, y, loss=ce) -> dict:
    """Each example's own gradient at ``model``'s weights now, by the float64 loop."""
    return loop_grad(copy.deepcopy(model).to(D), loss, (x.double(),), y)


def assert_step(model, want: dict, rel: float, what: str, scale: float = 1.0) -> None:
    """Every parameter's ``grad1 / scale`` against the loop, and its mean against ``.grad``."""
    for n, p in model.named_parameters():
        near(p.grad1 / scale, want[n], rel, f"{what}: {n}")
        near(p.grad1.mean(0), p.grad, rel, f"{what}: {n} mean vs .grad")


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


# -- the optimizer's step inside the autocast block ---------------------------------------------


class Weighted(nn.Module):
    """A layer without a rule (the fallback computes it): ``tanh(h @ w)``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) * 0.3)

    def forward(self, h):
        return torch.tanh(h @ self.w)


class Seq(nn.Module):
    """A projection (4 -> 8), a layer over a sequence of 5 that computes from its weights, a
    head on the mean over the sequence (8 -> 3)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind, self.proj, self.head = kind, nn.Linear(4, 8), nn.Linear(8, 3)
        self.mid = {
            "transformer": lambda: nn.TransformerEncoderLayer(
                8, 2, 16, dropout=0.0, activation="gelu", batch_first=True
            ),  # (smooth: a ReLU's unit rounded across zero changes an example's gradient)
            "attention": lambda: nn.MultiheadAttention(8, 2, batch_first=True),
            "lstm": lambda: nn.LSTM(8, 8, batch_first=True),
            "fallback": Weighted,
        }[kind]()

    def forward(self, x):
        h = self.proj(x)
        if self.kind == "attention":
            h = self.mid(h, h, h, need_weights=False)[0]
        elif self.kind == "lstm":
            h = self.mid(h)[0]
        else:
            h = self.mid(h)
        return self.head(h.mean(1))


KINDS = ["transformer", "attention", "lstm", "fallback"]
NAMED = {
    "transformer": "'self_attn.in_proj_weight'",
    "attention": "'out_proj.weight'",
    "lstm": "'weight_ih_l0'",
    "fallback": "'w'",
}


@pytest.mark.parametrize("kind", KINDS)
def test_the_optimizers_step_inside_the_autocast_block_is_refused_where_a_rule_reads_weights(
    kind,
):
    """The whole loop under one ``with torch.autocast(...)``: torch's cast cache keeps the
    weights cast at the first forward, and the second forward runs with them. The first step
    is each example's own gradient; the second backward is refused with a ``StateError``
    naming the layer, the parameter, autocast's cache and the remedies. The rule would compute
    from the stepped weights: the LSTM's ``grad1`` was off ``.grad`` in silence, the others
    were refused as though they mixed the examples (and where the check did not run, a
    Transformer layer's ``grad1`` was 14% off ``.grad`` at the third step, in silence)."""
    model = Seq(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with gradhooks.add_hooks(model), bf16():
        x, y = batch(0, shape=(5, 4))
        want = loop(model, x, y)
        ce(model(x), y).backward()
        assert_step(model, want, BF16, "the first step")
        optimizer.step()
        optimizer.zero_grad()
        x, y = batch(1, shape=(5, 4))
        loss = ce(model(x), y)
        raised(
            gradhooks.StateError,
            ["'mid'", NAMED[kind], "autocast's cast cache", "cache_enabled=False"],
            loss.backward,
        )


def test_hooks_added_again_at_each_step_inside_the_autocast_block_are_refused_too():
    """The same loop with ``with gradhooks.add_hooks(model):`` around each step, inside the one
    autocast block: the new handle knows the casts the earlier one saw (autocast's cache is
    the thread's, not a handle's), and the second step is refused as well."""
    model = Seq("transformer")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with bf16():
        for step in range(2):
            x, y = batch(step, shape=(5, 4))
            want = loop(model, x, y)
            optimizer.zero_grad()
            with gradhooks.add_hooks(model):
                loss = ce(model(x), y)
                if step == 0:
                    loss.backward()
                    assert_step(model, want, BF16, "the first step")
                else:
                    raised(gradhooks.StateError, ["'mid'", "autocast's cast cache"], loss.backward)
            optimizer.step()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("remedy", ["forward-in-block", "cache-off"])
def test_the_remedies_of_a_step_inside_the_autocast_block_train_as_the_loop(kind, remedy):
    """The message's two remedies: autocast around each forward and its loss alone, or the
    whole loop under ``torch.autocast(..., cache_enabled=False)``: every step's ``grad1`` is
    each example's own gradient at the weights of that step."""
    model = Seq(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    whole = bf16(cache_enabled=False) if remedy == "cache-off" else contextlib.nullcontext()
    forward = bf16 if remedy == "forward-in-block" else contextlib.nullcontext
    with gradhooks.add_hooks(model), whole:
        for step in range(3):
            x, y = batch(step, shape=(5, 4))
            want = loop(model, x, y)
            optimizer.zero_grad()
            with forward():
                loss = ce(model(x), y)
            loss.backward()
            assert_step(model, want, BF16, f"{remedy}, step {step}")
            optimizer.step()


def test_linear_layers_stepped_inside_the_autocast_block_give_the_gradient_of_their_forward():
    """The same loop on Linear layers, whose rule reads no weight: torch's forwards all run
    with the casts of the first step's weights, and ``grad1`` is each example's gradient at
    those, which is what autograd's ``.grad`` holds too: no refusal, ``grad1.mean(0)`` is
    ``.grad`` at every step."""
    model = mlp()
    first = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with gradhooks.add_hooks(model), bf16():
        for step in range(3):
            x, y = batch(step)
            want = loop(first, x, y)  # (the casts the forward ran with are of these)
            optimizer.zero_grad()
            ce(model(x), y).backward()
            assert_step(model, want, BF16, f"step {step}")
            optimizer.step()
    assert not torch.equal(model[0].weight, first[0].weight)


# -- the weights changed between the forward and its backward ----------------------------------


@pytest.mark.parametrize("kind", ["linear", "attention", "lstm"])
def test_a_weight_decayed_in_place_between_the_forward_and_the_backward_under_autocast(kind):
    """``w.mul_(0.9)`` under ``no_grad`` after a bfloat16 autocast forward: autograd kept the
    bfloat16 cast, not the weight, and does not object. A Linear's ``grad1`` is each example's
    gradient at the forward's weights, as ``.grad`` is; a layer whose rule reads the weight is
    refused with a ``StateError`` naming it and saying to change parameters after the
    backward."""
    model = mlp() if kind == "linear" else Seq(kind)
    shape = (4,) if kind == "linear" else (5, 4)
    x, y = batch(0, shape=shape)
    want = loop(model, x, y)
    target = model[2] if kind == "linear" else model.mid
    with gradhooks.add_hooks(model):
        with bf16():
            loss = ce(model(x), y)
        with torch.no_grad():
            for p in target.parameters():
                p.mul_(0.9)
        if kind == "linear":
            loss.backward()
            assert_step(model, want, BF16, "decayed after the forward")
        else:
            raised(
                gradhooks.StateError,
                [NAMED[kind], "modified by an inplace operation", "after the backward"],
                loss.backward,
            )


def test_a_model_cast_to_bfloat16_between_the_forward_and_the_backward():
    """``model.to(torch.bfloat16)`` after a bfloat16 autocast forward: torch's ``.grad`` stays
    float32 on the bfloat16 parameters, ``grad1`` takes the parameters' dtype and is each
    example's gradient at the forward's weights; the next step, the model in bfloat16, is
    each example's own again."""
    model = mlp()
    x, y = batch(0)
    want = loop(model, x, y)
    with gradhooks.add_hooks(model):
        with bf16():
            loss = ce(model(x), y)
        model.to(torch.bfloat16)
        loss.backward()
        for p in model.parameters():
            assert p.dtype == p.grad1.dtype == torch.bfloat16 and p.grad.dtype == torch.float32
        assert_step(model, want, BF16, "cast after the forward")
        model.zero_grad()
        x, y = batch(1)
        want = loop_grad(copy.deepcopy(model).to(D), ce, (x.bfloat16().double(),), y)
        ce(model(x.bfloat16()), y).backward()
        assert_step(model, want, BF16, "the next step")


# -- quantities read at the wrong moment -------------------------------------------------------


def test_grad1_after_a_validation_forward_with_grad_left_on_under_autocast():
    """A validation forward on 6 examples with grad left on (``torch.no_grad()`` forgotten)
    after the step's backward: ``grad1`` is still the step's 4 examples' own gradients; the
    next step after ``zero_grad`` starts afresh at its own batch size."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(2):
            x, y = batch(step)
            want = loop(model, x, y)
            optimizer.zero_grad()
            with bf16():
                ce(model(x), y).backward()
            with bf16():
                model(batch(10 + step, n=6)[0])  # (validation, grad on)
            assert_step(model, want, BF16, f"step {step}, after the validation forward")
            optimizer.step()


def test_two_scaled_backwards_without_zero_grad_add_up_and_another_batch_size_is_refused():
    """Two float16 micro-batches of 4 backpropagated through a ``GradScaler`` without
    ``zero_grad`` between them: ``grad1 / scale`` adds the two rows of each position, as
    ``.grad`` adds; a third micro-batch of 3 is refused with a ``StateError`` naming the
    parameter, the shapes and the remedy, leaving the model, ``.grad`` and ``grad1`` as they
    were."""
    model = mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scale = scaler.get_scale()
    with gradhooks.add_hooks(model) as h:
        want = {}
        for k in range(2):
            x, y = batch(k)
            for n, g in loop(model, x, y).items():
                want[n] = want.get(n, 0) + g
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            scaler.scale(ce(out, y)).backward()
        assert h.accumulated == 2
        assert_step(model, want, FP16, "two micro-batches", scale=scale)
        before = model_state(model)
        x, y = batch(2, n=3)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        raised(
            gradhooks.StateError,
            ["'2.weight'", "(4, 3, 8)", "(3, 3, 8)", "clear()"],
            lambda: scaler.scale(ce(out, y)).backward(),
        )
        assert_untouched(model, before)


def test_grad1_read_after_the_scalers_step_and_update_is_of_the_scale_the_backward_ran_with():
    """``grad1`` read after ``scaler.step`` and ``scaler.update`` (which doubled the scale,
    ``growth_interval=1``): it is the scale the backward ran with, read before the update,
    that divides it into each example's gradient at the weights of the forward; the scale
    read after is twice it."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    with gradhooks.add_hooks(model):
        x, y = batch(0)
        want = loop(model, x, y)
        ran_with = scaler.get_scale()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        scaler.scale(ce(out, y)).backward()
        scaler.step(optimizer)
        scaler.update()
        assert scaler.get_scale() == 2 * ran_with
        for n, p in model.named_parameters():
            near(p.grad1 / ran_with, want[n], FP16, n)


# -- losses and batches of the wrong kind -------------------------------------------------------


def test_a_loss_that_mixes_the_examples_under_bfloat16_is_told_by_check():
    """A loss of the outputs centred on the batch's mean: no example has a loss of its own.
    ``check`` with the loss says the loss couples the examples; with ``raise_on_error`` it
    stops with a ``CheckFailedError`` saying so."""
    model = mlp()

    def centred(out, y):
        out = out.float()
        return (out - out.mean(0)).pow(2).sum(1).mean()

    with gradhooks.add_hooks(model) as h:
        x, y = batch(0)
        with bf16():
            centred(model(x), y).backward()
        report = h.check(centred, x, y, raise_on_error=False)
        assert not report.ok and any("couples the examples" in p for p in report.problems)
        raised(gradhooks.CheckFailedError, "couples the examples", lambda: h.check(centred, x, y))


def test_a_batch_of_one_under_a_grad_scaler_and_in_a_train_mode_batch_norm():
    """A last batch of one example under float16 autocast and a ``GradScaler``: ``grad1`` has
    one row, its own gradient times the scale. Through a ``BatchNorm1d`` in training mode
    (where torch too refuses one value per channel) the forward is refused with a
    ``MixedExamplesError`` naming the layer and saying to put it in eval mode, leaving the
    model as it was, which then trains in eval mode on the next batch."""
    model = mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with gradhooks.add_hooks(model):
        x, y = batch(0, n=1)
        want = loop(model, x, y)
        scale = scaler.get_scale()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        scaler.scale(ce(out, y)).backward()
        assert model[0].weight.grad1.shape == (1, 8, 4)
        assert_step(model, want, FP16, "a batch of one", scale=scale)
    torch.manual_seed(0)
    normed = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    with gradhooks.add_hooks(normed):
        before = model_state(normed)
        with bf16():
            raised(
                gradhooks.MixedExamplesError, ["'1' (BatchNorm1d)", "eval mode"],
                lambda: normed(batch(1, n=1)[0]),
            )  # fmt: skip
        assert_untouched(normed, before)
        normed.eval()
        x, y = batch(2)
        want = loop(normed, x, y)
        with bf16():
            ce(normed(x), y).backward()
        assert_step(normed, want, BF16, "the next batch, in eval mode")


@pytest.mark.parametrize("n", [3, 4], ids=["batch-3", "batch-4"])
def test_sum_declared_for_a_mean_loss_under_a_grad_scaler_is_told_with_both_factors(n):
    """``add_hooks(model, loss_reduction="sum")`` for a mean loss, scaled by a
    ``GradScaler`` of 256: ``grad1`` is 256 / n times each example's gradient. ``check`` with
    the loss names the scaler and the reduction (with a batch of 3 it named neither; with a
    batch of 4 it put the whole factor, 64, on the scaler, whose advice left ``grad1`` n
    times too small); ``h.rescale("mean")`` then ``grad1 / 256`` is each example's own."""
    model = mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        x, y = batch(0, n=n)
        want = loop(model, x, y)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        scaler.scale(ce(out, y)).backward()
        report = h.check(ce, x, y, raise_on_error=False)
        (problem,) = report.problems
        assert "GradScaler" in problem and "h.rescale('mean')" in problem, problem
        if n == 3:
            assert report.reduction == "mean" and "256 (a power of two)" in problem
        else:
            assert "If the scale it ran with was 256, not 64" in problem
        h.rescale("mean")
        assert_step(model, want, FP16, "rescaled", scale=256.0)

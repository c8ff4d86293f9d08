"""Mistakes in how a model is trained, a sixth set: the model changed under what wraps it
(parameters replaced by ``load_state_dict(assign=True)`` or a new ``nn.Parameter`` after a
``DPOptimizer``, ``make_private`` or ``KFAC`` was built; hooks removed and added again under a
kept ``DPOptimizer``; every parameter frozen; a ``torch.jit.trace`` while hooked), DP-SGD steps
misfed (micro-batches one step each, integer losses, views concatenated on the batch, the
finite losses alone, a float16 model's norms past 256), ``Hooks.check`` given a loss it cannot
call, and legitimate changes between the backwards of one accumulation (the dtype, a
parameter, the parameters a backward reaches, the loss reduction) and batches whose tensors
hold the examples on different dimensions. Each gives the documented meaning, compared in
float64 with each example's own gradient by the per-example loop
(:func:`gradhooks.oracle.loop_grad`), or stops with the typed error of its kind, whose message
names the module, the parameter or the shapes and says what to do, leaving the parameters,
``.grad``, ``grad1`` and the hooks as they were (``tests/test_misuse.py``,
``tests/test_misuse_api.py``, ``tests/test_misuse_loops.py``, ``tests/test_misuse_fourth.py``
and ``tests/test_misuse_fifth.py`` hold the earlier sets)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_misuse_fifth import HALF, assert_grad1, clipped_mean, close, flat_norms, loop, near
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_untouched, labelled_batch, mlp, model_state, raised


def losses_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y, reduction="none")


def assigned(model: nn.Module) -> None:
    """A checkpoint loaded with ``assign=True`` (the memory-saving way, ``torch.load(...,
    mmap=True)``): every parameter becomes the checkpoint's tensor, the values unchanged."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)


# -- the model changed under an optimizer that wraps it -----------------------------------------


@pytest.mark.parametrize("when", ["between steps", "between the backward and the step"])
def test_a_dp_optimizer_over_parameters_replaced_since_is_refused(when):
    """``model.load_state_dict(ckpt, assign=True)`` after the ``DPOptimizer`` was built (a run
    resumed, the optimizer made first), or a layer's weight replaced by a new ``nn.Parameter``
    between the backward and the step: the wrapped optimizer still holds the old tensors, so
    its steps moved them and left the model as it was, every step recorded by the accountant,
    with no error. Refused now at the backward (or the step), naming the shape and what to do,
    nothing changed; an optimizer built again over the model's parameters steps with the
    loop's clipped mean."""
    model = mlp()
    x, y = labelled_batch(1)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        opt = gradhooks.DPOptimizer(
            sgd, h, max_grad_norm=0.5, noise_multiplier=0.0, expected_batch_size=5
        )
        if when == "between steps":
            assigned(model)
            before = model_state(model)
            call, where = (lambda: opt.backward(losses_of(model, x, y))), "DPOptimizer.backward"
        else:
            opt.backward(losses_of(model, x, y))
            model[0].weight = nn.Parameter(model[0].weight.detach().clone())
            before = model_state(model)
            call, where = opt.step, "DPOptimizer.step"
        raised(
            gradhooks.ConfigurationError,
            [where, "parameter of shape (5, 3)", "not one of the hooked model's (Sequential)",
             "assign=True", "Build the optimizer over model.parameters() again"],
            call,
        )  # fmt: skip
        assert_untouched(model, before)
        assert not sgd.state  # (the old tensors were not stepped either)
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), h, max_grad_norm=0.5,
            noise_multiplier=0.0, expected_batch_size=5,
        )  # fmt: skip
        want = loop(model, x, y)
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.backward(losses_of(model, x, y))
        opt.step()
    for name, p in model.named_parameters():
        close(p.grad, clipped_mean(want, 0.5)[name], name)
        close(p.detach(), weights[name] - 0.1 * clipped_mean(want, 0.5)[name], name)


def test_kfac_over_parameters_replaced_since_is_refused():
    """``load_state_dict(ckpt, assign=True)`` after ``KFAC(model, optimizer)`` was built: the
    base optimizer stepped the old tensors and zeroed their gradients, so the model never
    moved and its own ``.grad`` added up from step to step, silently. Refused at the step,
    naming the parameter, nothing changed (no factor, no step counted); built again, it
    steps the model."""
    model = mlp()
    x, y = labelled_batch(1)
    kfac = gradhooks.KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assigned(model)
    kfac.zero_grad()
    F.cross_entropy(model(x), y).backward()
    before = model_state(model)
    raised(
        gradhooks.ConfigurationError,
        ["KFAC.step", "'0.weight' (5, 3)", "(Sequential)", "assign=True",
         "Build the optimizer over model.parameters() again"],
        lambda: kfac.step(x),
    )  # fmt: skip
    assert_untouched(model, before)
    assert kfac.steps == 0 and not kfac.factors
    kfac = gradhooks.KFAC(model, torch.optim.SGD(model.parameters(), lr=0.1))
    kfac.step(x)
    assert kfac.steps == 1
    for name, p in model.named_parameters():
        assert not torch.equal(p.detach(), before["params"][name]), name


def test_make_private_after_parameters_replaced_is_refused():
    """A ``make_private`` run resumed by ``model.load_state_dict(ckpt, assign=True)`` after it
    was made: its optimizer held the old tensors, so every later step moved them and not the
    model, while the accountant spent the budget. Refused at the next ``backward``, nothing
    changed; made again, the run steps the model."""
    model = mlp()
    x, y = labelled_batch(1, n=40)
    data = torch.utils.data.TensorDataset(x, y)

    def private():
        return gradhooks.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.1), data, delta=1e-3,
            max_grad_norm=1.0, noise_multiplier=1.0, steps=4, expected_batch_size=8,
            generator=torch.Generator().manual_seed(0),
        )  # fmt: skip

    run = private()
    batches = iter(run.batches())
    xb, yb = next(batches)
    assigned(model)
    before = model_state(model)
    raised(
        gradhooks.ConfigurationError,
        ["DPOptimizer.backward", "not one of the hooked model's", "assign=True"],
        lambda: run.backward(losses_of(model, xb, yb)),
    )
    assert_untouched(model, before)
    assert run.steps_taken == 0
    run.close()
    run = private()
    for xb, yb in run.batches():
        run.backward(losses_of(model, xb, yb))
        if run.step():
            break
    assert run.steps_taken == 1
    for name, p in model.named_parameters():
        assert not torch.equal(p.detach(), before["params"][name]), name
    run.close()


@pytest.mark.parametrize("read", ["norms", "param_norms", "check"])
def test_quantities_of_a_model_frozen_whole_say_so(read):
    """``model.requires_grad_(False)`` (a backbone frozen, the head's unfreezing forgotten),
    then ``add_hooks`` and a backward that reaches only the input (an attack's step): the
    norms and the check said that no backward had been captured, and to run the forward and
    the backward with the hooks on, which the loop had done. They now say that the model has
    no trainable parameter and how to unfreeze one; the model as it was. With the head
    unfrozen, its ``grad1`` is the loop's."""
    model = mlp()
    model.requires_grad_(False)
    x, y = labelled_batch(1)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        F.cross_entropy(model(x.clone().requires_grad_()), y).backward()
        before = model_state(model)
        error = gradhooks.CheckFailedError if read == "check" else gradhooks.StateError
        raised(
            error,
            ["Sequential has no trainable parameter", "layer.requires_grad_(True)"],
            getattr(h, read),
        )
        assert_untouched(model, before)
        model[2].requires_grad_(True)
        F.cross_entropy(model(x), y).backward()
    want = loop_grad(model[2], F.cross_entropy, (torch.tanh(model[0](x)),), y)
    for name, p in model[2].named_parameters():
        close(p.grad1, want[name], name)
    assert not any(hasattr(p, "grad1") for p in model[0].parameters())


def test_a_dp_optimizer_kept_across_hooks_removed_and_added_again_says_to_rebuild_it():
    """The hooks removed for an evaluation (``h.remove()``) and added again as a new handle,
    the ``DPOptimizer`` built around the old one kept: its backward was refused as
    "dp_sgd_step needs an active handle (its model is gone or removed)", naming a function
    not called and no way out. It now names the model, how the hooks go, and to build the
    optimizer again with the new handle; the model as it was. So built, it steps with the
    loop's clipped mean."""
    model = mlp()
    x, y = labelled_batch(1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    h = gradhooks.add_hooks(model, quantities=("norms",))
    args = {"max_grad_norm": 0.5, "noise_multiplier": 0.0, "expected_batch_size": 5}
    opt = gradhooks.DPOptimizer(sgd, h, **args)
    h.remove()
    h = gradhooks.add_hooks(model, quantities=("norms",))
    losses = losses_of(model, x, y)
    before = model_state(model)
    raised(
        gradhooks.StateError,
        ["DPOptimizer.backward", "the hooks of Sequential were removed",
         "build it again around the same optimizer with the new handle"],
        lambda: opt.backward(losses),
    )  # fmt: skip
    assert_untouched(model, before)
    want = clipped_mean(loop(model, x, y), 0.5)
    opt = gradhooks.DPOptimizer(sgd, h, **args)
    opt.backward(losses)
    opt.step()
    h.remove()
    for name, p in model.named_parameters():
        close(p.grad, want[name], name)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::torch.jit.TracerWarning")
def test_a_model_traced_by_torch_jit_while_hooked_traces_the_model_alone():
    """``torch.jit.trace(model, x)`` in the middle of training with the hooks on (a
    TorchScript export at a checkpoint): the hooks captured the tracing call and their own
    operations entered the graph, so the trace failed torch's sanity check
    (``TracingCheckError: Graphs differed across invocations``, naming gradhooks' files).
    Capture is off while torch traces now: the trace computes what the model does, the last
    backward's ``grad1`` and the hooks are as they were, and the next step's ``grad1`` is
    the loop's."""
    model = mlp()
    (x, y), (x2, y2) = labelled_batch(1), labelled_batch(2)
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x), y).backward()
        before = model_state(model)
        traced = torch.jit.trace(model, x)
        assert_untouched(model, before)
        close(traced(x2), model(x2), "the traced model")
        model.zero_grad()
        F.cross_entropy(model(x2), y2).backward()
    assert_grad1(model, loop(model, x2, y2), "after the trace")


# -- the model changed between the backwards of one accumulation --------------------------------


def test_a_model_cast_to_float64_between_accumulated_backwards_adds_both():
    """``model.double()`` between two backwards of one accumulation (a precision switched
    for a debugging step): ``.grad`` is cast and added to, and so is ``grad1``, which holds
    the float32 backward's rows plus the float64 one's: the loop's sum of both, within
    float32's rounding, and ``grad1.mean(0)`` is ``.grad``."""
    model = mlp(torch.float32)
    (x, y), (x2, y2) = labelled_batch(1), labelled_batch(2)
    first = loop(copy.deepcopy(model).double(), x, y)
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x.float()), y).backward()
        model.double()
        F.cross_entropy(model(x2), y2).backward()
    second = loop(model, x2, y2)
    for name, p in model.named_parameters():
        assert p.grad1.dtype == torch.float64, name
        torch.testing.assert_close(p.grad1, first[name] + second[name], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(p.grad1.mean(0), p.grad, rtol=1e-5, atol=1e-6)


def test_a_parameter_replaced_between_accumulated_backwards_starts_its_own():
    """``layer.weight = nn.Parameter(...)`` between two backwards of one accumulation (a
    weight re-initialized mid-step): the new parameter's ``.grad`` holds the second backward
    alone, and so does its ``grad1``; the old one keeps the first's; every other parameter's
    ``grad1`` is the loop's sum of both."""
    model = mlp()
    (x, y), (x2, y2) = labelled_batch(1), labelled_batch(2)
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x), y).backward()
        first, old = loop(model, x, y), model[0].weight
        model[0].weight = nn.Parameter(old.detach() * 0.5)
        F.cross_entropy(model(x2), y2).backward()
    second = loop(model, x2, y2)
    close(old.grad1, first["0.weight"], "the old weight")
    for name, p in model.named_parameters():
        want = second[name] if name == "0.weight" else first[name] + second[name]
        close(p.grad1, want, name)
        close(p.grad1.mean(0), p.grad, name)


def test_backwards_for_two_sets_of_parameters_each_accumulate_their_own():
    """``loss.backward(inputs=body)`` then, on another batch, ``loss.backward(inputs=head)``
    (an alternating update of two parts of one model, without ``zero_grad`` between): each
    parameter's ``grad1`` is that of the backward that reached it, as its ``.grad`` is."""
    model = mlp()
    (x, y), (x2, y2) = labelled_batch(1), labelled_batch(2)
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x), y).backward(inputs=list(model[0].parameters()))
        F.cross_entropy(model(x2), y2).backward(inputs=list(model[2].parameters()))
    first, second = loop(model, x, y), loop(model, x2, y2)
    for name, p in model.named_parameters():
        close(p.grad1, (first if name.startswith("0.") else second)[name], name)
        close(p.grad1.mean(0), p.grad, name)


def test_loss_reduction_changed_between_accumulated_backwards_scales_each_its_own():
    """A mean loss, then ``h.loss_reduction = "sum"`` and a summed loss in the same
    accumulation (a second task whose loss is a sum): each backward's rows are scaled by the
    reduction set when it ran, so ``grad1`` is the loop's sum of both examples' own gradients,
    whatever the batch size."""
    model = mlp()
    (x, y), (x2, y2) = labelled_batch(1), labelled_batch(2, n=3)
    with gradhooks.add_hooks(model) as h:
        F.cross_entropy(model(x[:3]), y[:3]).backward()
        h.loss_reduction = "sum"
        F.cross_entropy(model(x2), y2, reduction="sum").backward()
    first, second = loop(model, x[:3], y[:3]), loop(model, x2, y2)
    assert_grad1(model, {n: first[n] + second[n] for n in first}, "mean, then sum")


# -- batches whose tensors hold the examples on different dimensions ---------------------------


def per_example(model: nn.Module, args: tuple, dims: tuple, y: torch.Tensor) -> dict:
    """Each example's own gradient of ``F.cross_entropy``, by a float64 loop that takes
    example ``i`` from dimension ``dims[k]`` of ``args[k]`` (the model called as is, unhooked)."""
    rows: dict[str, list] = {n: [] for n, _ in model.named_parameters()}
    for i in range(len(y)):
        out = model(*(a.narrow(d, i, 1) for a, d in zip(args, dims)))
        grads = torch.autograd.grad(F.cross_entropy(out, y[i : i + 1]), list(model.parameters()))
        for (name, _), g in zip(model.named_parameters(), grads):
            rows[name].append(g)
    return {n: torch.stack(g) for n, g in rows.items()}


class TimeMajorGRU(nn.Module):
    """A GRU over a time-major ``[time, batch, features]`` input from an initial state
    ``[layers, batch, hidden]`` (both with the examples on dimension 1), its last step's
    output classified."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn, self.head = nn.GRU(3, 4), nn.Linear(4, 2)

    def forward(self, x, h0):
        return self.head(self.rnn(x, h0)[0][-1])


class TimeMajorAttention(nn.Module):
    """Self-attention over a time-major ``[time, batch, features]`` input with a batch-first
    ``key_padding_mask`` ``[batch, time]``, its mean over time classified."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.attention, self.head = nn.MultiheadAttention(4, 2), nn.Linear(4, 2)

    def forward(self, x, mask):
        return self.head(self.attention(x, x, x, key_padding_mask=mask)[0].mean(0))


@pytest.mark.parametrize("steps", [6, 5], ids=["6-steps", "as-many-steps-as-examples"])
@pytest.mark.parametrize("kind", ["gru-and-state", "attention-and-mask"])
def test_a_time_major_batch_beside_other_tensors_needs_no_batch_dim(kind, steps):
    """A loader's batch of tensors with the examples on dimension 1 in one and 0 in another
    (a time-major sequence and its batch-first padding mask) or on dimension 1 in both (the
    sequence and the GRU's initial state), ``add_hooks`` left at its default ``batch_dim``,
    also where the sequence has as many steps as the batch has examples: ``grad1`` is each
    example's own gradient, by the loop that takes each example from its own dimension."""
    batch = 5
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps, batch, 3 if kind == "gru-and-state" else 4, generator=g)
    y = torch.randint(2, (batch,), generator=g)
    if kind == "gru-and-state":
        model = TimeMajorGRU().double()
        args, dims = (x.double(), torch.randn(1, batch, 4, generator=g).double()), (1, 1)
    else:
        model = TimeMajorAttention().double()
        mask = torch.zeros(batch, steps, dtype=torch.bool)
        mask[1, 3:], mask[3, 2:] = True, True
        args, dims = (x.double(), mask), (1, 0)
    want = per_example(model, args, dims, y)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        F.cross_entropy(model(*args), y, reduction="sum").backward()
    assert_grad1(model, want, kind)


# -- DP-SGD steps ------------------------------------------------------------------------------


def test_dp_steps_on_micro_batches_before_one_optimizer_step_warn():
    """A logical batch given to ``dp_sgd_step`` in micro-batches, ``optimizer.step()`` after
    every second one (gradient accumulation carried over from a non-private loop): each step
    writes ``.grad``, so the optimizer stepped on the last micro-batch alone, each one's noise
    drawn, with no word. Said once now, naming ``DPOptimizer``; ``.grad`` is the last
    micro-batch's clipped mean (the loop's), as documented. A loop that steps after every
    ``dp_sgd_step`` is not told."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [labelled_batch(step) for step in range(4)]
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        with pytest.warns(gradhooks.GradhooksWarning, match="no optimizer step used") as said:
            for k, (x, y) in enumerate(batches):
                want = loop(model, x, y)
                gradhooks.dp_sgd_step(h, losses_of(model, x, y), max_norm=0.5, noise_multiplier=0.0)
                if k % 2:
                    for name, p in model.named_parameters():
                        close(p.grad, clipped_mean(want, 0.5)[name], name)
                    opt.step()
        told = [w for w in said if issubclass(w.category, gradhooks.GradhooksWarning)]
        assert len(told) == 1 and "gradhooks.DPOptimizer" in str(told[0].message)
        with warnings.catch_warnings():
            warnings.simplefilter("error", gradhooks.GradhooksWarning)
            for x, y in batches:
                gradhooks.dp_sgd_step(h, losses_of(model, x, y), max_norm=0.5, noise_multiplier=0.0)
                opt.step()


@pytest.mark.parametrize("method", ["grad1", "bookkeeping", "ghost"])
def test_dp_step_of_a_float16_model_whose_example_norms_pass_256(method):
    """A model cast with ``model.half()`` (CPU or GPU, no autocast) whose examples' gradient
    norms are above 256 (early training, a loss scaled up): the ``grad1`` step squared the
    float16 ``grad1`` in float16, which overflows above 256, so each such norm came out Inf and
    its example was clipped to nothing, its row of ``.grad`` silently zero. Its squares are
    now summed in float32, as the book-keeping and ghost steps (and the norms quantity) did:
    the norms and the clipped mean are the float64 loop's within float16's rounding."""
    model = mlp(torch.float32)
    x, y = labelled_batch(1)

    def scaled(out, target):  # (each example's norm far above 256)
        return 3000 * F.cross_entropy(out.float(), target, reduction="none")

    want = loop_grad(copy.deepcopy(model).double(), lambda o, t: scaled(o, t).sum(), (x,), y)
    assert flat_norms(want).min() > 256
    model.half()
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        norms = gradhooks.dp_sgd_step(
            h, scaled(model(x.half()), y), max_norm=1.0, noise_multiplier=0.0, method=method
        )
    assert norms.isfinite().all(), norms
    near(norms, flat_norms(want), HALF, "norms")
    for name, p in model.named_parameters():
        near(p.grad, clipped_mean(want, 1.0)[name], HALF, name)


def test_dp_step_of_integer_losses_names_their_dtype():
    """The step given ``(out.argmax(1) == y).long()`` (a correct-or-not count where the
    losses belong, a logging line moved): refused as having "no autograd history (detached, or
    computed under torch.no_grad())", which sent the user looking for a ``no_grad``. It now
    names the dtype and what to pass; nothing is written."""
    model = mlp()
    x, y = labelled_batch(1)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        hits = (model(x).argmax(1) == y).long()
        before = model_state(model)
        raised(
            gradhooks.ConfigurationError,
            ["per_example_loss holds torch.int64 values", "reduction='none'"],
            lambda: gradhooks.dp_sgd_step(h, hits, max_norm=1.0, noise_multiplier=1.0),
        )
        assert_untouched(model, before)


def _views(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two augmented views of each example (a fixed shift either way)."""
    shift = torch.linspace(-0.2, 0.2, x.shape[1], dtype=x.dtype)
    return x + shift, x - shift


def test_dp_step_of_views_concatenated_along_the_batch_says_to_stack_them():
    """Augmentation multiplicity (each example's gradient averaged over its views before it
    is clipped) written as ``model(torch.cat([v1, v2]))`` and the two halves of the losses
    averaged: the forward's batch is twice the losses', refused, and the message now says
    how views are kept with their example; stacked, ``[batch, views, ...]``, the norms and
    the clipped mean are the loop's of each example's views averaged."""
    model = mlp()
    x, y = labelled_batch(1)
    v1, v2 = _views(x)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        both = F.cross_entropy(model(torch.cat([v1, v2])), torch.cat([y, y]), reduction="none")
        before = model_state(model)
        raised(
            gradhooks.ConfigurationError,
            ["per_example_loss has 5 entries", "a batch of 10 examples", "2 views",
             "torch.stack(views, 1) [5, 2, ...]"],
            lambda: gradhooks.dp_sgd_step(
                h, (both[:5] + both[5:]) / 2, max_norm=0.5, noise_multiplier=0.0
            ),
        )  # fmt: skip
        assert_untouched(model, before)
        out = model(torch.stack([v1, v2], 1))  # [batch, views, classes]
        losses = F.cross_entropy(out.flatten(0, 1), y.repeat_interleave(2), reduction="none")
        norms = gradhooks.dp_sgd_step(
            h, losses.view(5, 2).mean(1), max_norm=0.5, noise_multiplier=0.0
        )
    one, two = loop(model, v1, y), loop(model, v2, y)
    want = {n: (one[n] + two[n]) / 2 for n in one}
    close(norms, flat_norms(want), "norms")
    for name, p in model.named_parameters():
        close(p.grad, clipped_mean(want, 0.5)[name], name)


def test_dp_step_of_the_finite_losses_only_says_to_drop_the_examples_before_the_forward():
    """One example's input holds a NaN, and the loop keeps the finite losses alone,
    ``losses[torch.isfinite(losses)]``: the forward's batch still holds the example, so the
    step is refused as before, and the message now says to take it out of the batch before
    the forward; so taken out, the step is the loop's over the others."""
    model = mlp()
    x, y = labelled_batch(1)
    x[1, 0] = float("nan")
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        losses = losses_of(model, x, y)
        keep = torch.isfinite(losses)
        before = model_state(model)
        raised(
            gradhooks.ConfigurationError,
            ["per_example_loss has 4 entries", "a batch of 5 examples", "losses[keep]",
             "model(x[keep])"],
            lambda: gradhooks.dp_sgd_step(h, losses[keep], max_norm=0.5, noise_multiplier=0.0),
        )  # fmt: skip
        assert_untouched(model, before)
        norms = gradhooks.dp_sgd_step(
            h, losses_of(model, x[keep], y[keep]), max_norm=0.5, noise_multiplier=0.0
        )
    want = loop(model, x[keep], y[keep])
    close(norms, flat_norms(want), "norms")
    for name, p in model.named_parameters():
        close(p.grad, clipped_mean(want, 0.5)[name], name)


@pytest.mark.parametrize(
    "loss, target, says",
    [
        (F.cross_entropy, None,
         ["loss_fn(output) raised TypeError", "h.check(loss_fn, inputs, target)"]),
        (lambda out, t: F.cross_entropy(out, t).item(), "y",
         ["loss_fn(output, target) returned float", "not loss.item()"]),
        (lambda out: out.pow(2).sum(), "y",
         ["loss_fn(output, target) raised TypeError", "h.check(loss_fn, inputs)"]),
    ],
    ids=["target-left-out", "a-number", "a-target-too-many"],
)  # fmt: skip
def test_check_given_a_loss_it_cannot_call_says_how_to_call_it(loss, target, says):
    """``h.check(F.cross_entropy, x)`` (the target left out), a loss function that returns
    ``loss.item()``, or a loss of the output alone given a target: the loss's own
    ``TypeError`` or an ``AttributeError`` (``'float' object has no attribute 'backward'``)
    came out of the check's recomputation. Each is a ``ConfigurationTypeError`` now, naming
    how the loss was called and how to call check; ``.grad`` and ``grad1`` are as they were,
    and the check called right says the loss was a mean."""
    model = mlp()
    x, y = labelled_batch(1)
    with gradhooks.add_hooks(model) as h:
        F.cross_entropy(model(x), y).backward()
        before = model_state(model)
        raised(
            gradhooks.ConfigurationTypeError,
            says,
            lambda: h.check(loss, x, y if target == "y" else None),
        )
        assert_untouched(model, before)
        report = h.check(F.cross_entropy, x, y)
    assert report.ok and "mean" in str(report)

"""Mistakes in how a model is trained, a fifth set: mixed precision (a ``GradScaler``'s scaled
backward read without its scale, an overflow the scaler skips, float16 parameters given a
scaler or inputs of another dtype), the loop (two hooked models that share a parameter, tied
before or after their hooks, a model hooked around one already hooked, ``zero_grad`` or
``clear`` between a forward and its backward, an optimizer's step before the DP step, an
activation detached in place, a loss of one example, BatchNorm hooked in eval mode and trained)
and the arguments (a quantity named twice, a ``batch_dim`` beyond the input's dimensions).
Each gives the documented meaning, compared in float64 with each example's own gradient by
the per-example loop (:func:`gradhooks.oracle.loop_grad`), or stops with the typed error of its
kind, whose message names the module, the parameter and the shapes and says what to do,
leaving the parameters, ``.grad``, ``grad1``, the hooks, the buffers and the training flag as
they were (``tests/test_misuse.py``, ``tests/test_misuse_api.py``,
``tests/test_misuse_loops.py`` and ``tests/test_misuse_fourth.py`` hold the earlier sets)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_untouched, labelled_batch, mlp, model_state, raised

RTOL, ATOL = 1e-9, 1e-12  # float64
# float16 keeps 11 significant bits (docs/mixed-precision.md: within 1e-2 of the largest entry)
HALF = 1e-2


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=what)


def near(got: torch.Tensor, want: torch.Tensor, within: float, what: str) -> None:
    """``got`` within ``within`` of ``want``'s largest entry (a low precision's rounding)."""
    error = (got.double() - want).abs().max() / want.abs().max()
    assert error < within, (what, float(error))


def loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each example's own gradient of ``F.cross_entropy``, by the float64 loop."""
    return loop_grad(model, F.cross_entropy, (x,), y)


def assert_grad1(model: nn.Module, want: dict, what: str) -> None:
    for name, p in model.named_parameters():
        close(p.grad1, want[name], f"{what}: {name}")


def flat_norms(want: dict) -> torch.Tensor:
    return torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)


def clipped_mean(want: dict, max_norm: float) -> dict[str, torch.Tensor]:
    """Each parameter's mean over the examples of the loop's rows, each example's gradient
    clipped to ``max_norm`` over all parameters (the DP step's ``.grad`` without noise)."""
    factors = (max_norm / flat_norms(want)).clamp(max=1.0).nan_to_num(1.0)
    return {n: torch.einsum("b,b...->...", factors, g) / len(g) for n, g in want.items()}


def full_state(model: nn.Module) -> dict:
    """:func:`model_state` with the buffers and every module's training flag."""
    return {
        "model": model_state(model),
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "training": [m.training for m in model.modules()],
    }


def assert_all_untouched(model: nn.Module, before: dict) -> None:
    assert_untouched(model, before["model"])
    for name, was in before["buffers"].items():
        assert torch.equal(dict(model.named_buffers())[name], was), f"buffer {name} changed"
    assert [m.training for m in model.modules()] == before["training"], "the training flag"


# -- mixed precision -----------------------------------------------------------------------------


def test_check_after_a_scaled_backward_names_the_grad_scaler():
    """``h.check(loss_fn, x, y)`` after ``scaler.scale(loss).backward()``: ``grad1`` is the
    scale (65536) times each example's gradient, and the check said only "about 6.55e+04×
    it" among causes that do not apply (micro-batches, weights, coupled examples). It now
    names the ``GradScaler`` and says to divide by ``scaler.get_scale()``."""
    model = mlp(torch.float32)
    x, y = labelled_batch(1)
    scaler = torch.amp.GradScaler("cpu")
    with gradhooks.add_hooks(model) as h:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x.float())
        scaler.scale(F.cross_entropy(out.float(), y)).backward()
        before = model_state(model)
        raised(
            gradhooks.CheckFailedError,
            ["65536×", "GradScaler", "scaler.get_scale()", "dp_sgd_step(..., scaler=scaler)"],
            lambda: h.check(lambda o, t: F.cross_entropy(o.float(), t), x.float(), y),
        )
        assert_untouched(model, before)
        want = loop(copy.deepcopy(model).double(), x, y)
        for name, p in model.named_parameters():  # what the message says to do
            near(p.grad1 / scaler.get_scale(), want[name], HALF, name)


def test_dp_step_with_a_scaler_refuses_float16_parameters():
    """A model stored in float16 (``model.half()``) given to the DP step with a
    ``GradScaler``: the scaled float16 output-gradients overflowed at the first scale (65536),
    every norm Inf, ``.grad`` set to NaN, and ``scaler.step`` then raised torch's "Attempting
    to unscale FP16 gradients". Refused now before the backward, naming the parameter, its
    shape and dtype and what to do, the model as it was; without the scaler the step clips
    the float16 gradients (the norms within float16 of the loop's)."""
    model = mlp(torch.float16)
    x, y = labelled_batch(1)
    with gradhooks.add_hooks(model) as h:
        losses = F.cross_entropy(model(x.half()).float(), y, reduction="none")
        before = model_state(model)
        raised(
            gradhooks.ConfigurationError,
            ["'0.weight' (5, 3)", "float16", "torch.autocast", "No gradient was written"],
            lambda: gradhooks.dp_sgd_step(
                h, losses, max_norm=1.0, noise_multiplier=0.0,
                scaler=torch.amp.GradScaler("cpu"),
            ),
        )  # fmt: skip
        assert_untouched(model, before)
        norms = gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=0.0)
    want = loop(copy.deepcopy(model).double(), x.half().double(), y)
    near(norms, flat_norms(want), HALF, "norms")


# -- the loop: parameters shared between hooked models -------------------------------------------


def _tied() -> tuple[nn.Sequential, nn.Sequential]:
    """Two models whose first layers share one weight (a tied encoder and decoder)."""
    a, b = mlp(), mlp()
    b[2].weight.data.mul_(-1)  # (another head)
    b[0].weight = a[0].weight
    return a, b


def test_a_second_model_sharing_a_parameter_with_a_hooked_one_is_refused():
    """A model whose first layer's weight is that of a model already hooked, hooked by a
    handle of its own: each handle sees only its own model's calls, so the shared weight got
    no ``grad1`` from either (a warning that blamed a forward run before ``add_hooks``), or,
    with both models in one loss, the check stopped the backward blaming a use it did not see.
    Refused now, naming the parameter, its shape, the module and the way out; the first
    handle goes on giving the loop's ``grad1``."""
    a, b = _tied()
    x, y = labelled_batch(1)
    with gradhooks.add_hooks(a) as h:
        before = model_state(b)
        raised(
            gradhooks.StateError,
            ["parameter '0.weight' (5, 3)", "'0' (Linear)", "another gradhooks handle",
             "nn.ModuleList([model_a, model_b])", "requires_grad_(False)"],
            lambda: gradhooks.add_hooks(b),
        )  # fmt: skip
        assert_untouched(b, before)
        F.cross_entropy(a(x), y).backward()
        assert_grad1(a, loop(a, x, y), "the first handle")
        assert h.active


def test_a_parameter_tied_after_both_models_were_hooked_is_refused_at_the_next_forward():
    """Two hooked models, then tied (``b[0].weight = a[0].weight``) between steps: the next
    forward of ``b`` plans its hooks again and refuses the shared weight, its hooks left as
    they were (the plan was made before the old one came off); untied again, the next step
    gives the loop's ``grad1``."""
    a, b = mlp(), mlp()
    x, y = labelled_batch(1)
    with gradhooks.add_hooks(a), gradhooks.add_hooks(b):
        F.cross_entropy(b(x), y).backward()
        b[0].weight = a[0].weight
        b.zero_grad()
        before = model_state(b)
        raised(gradhooks.StateError, ["'0.weight' (5, 3)", "'0' (Linear)"], lambda: b(x))
        assert_untouched(b, before)
        b[0].weight = nn.Parameter(a[0].weight.detach().clone())
        F.cross_entropy(b(x), y).backward()
        assert_grad1(b, loop(b, x, y), "untied")


def test_two_models_sharing_a_parameter_hooked_as_one_module_list():
    """The way out the refusal names: one handle on ``nn.ModuleList([a, b])``, both models
    called on the batch and their losses backpropagated one after the other: the shared
    weight's ``grad1`` adds up both models' uses, each example's own gradient of the sum of
    its two losses, by the loop; the others' hold their model's."""
    a, b = _tied()
    x, y = labelled_batch(1)

    class Both(nn.Module):  # (the loop's model: both outputs of one call)
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = a, b

        def forward(self, x):
            return torch.stack([self.a(x), self.b(x)])

    def both_losses(out, y):
        return sum(F.cross_entropy(o, y, reduction="sum") for o in out)

    want = loop_grad(Both(), both_losses, (x,), y)
    want = {id(p): want[n] for n, p in Both().named_parameters()}
    pair = nn.ModuleList([a, b])
    with gradhooks.add_hooks(pair, loss_reduction="sum"):
        F.cross_entropy(a(x), y, reduction="sum").backward()
        F.cross_entropy(b(x), y, reduction="sum").backward()
    for name, p in pair.named_parameters():
        close(p.grad1, want[id(p)], name)


def test_a_frozen_parameter_shared_between_two_hooked_models_is_no_refusal():
    """A frozen embedding shared by two hooked models (a frozen backbone under two heads):
    no per-example gradient is asked of it, so both handles are added and each gives its
    model's trainable parameters the loop's ``grad1``."""
    a, b = _tied()
    a[0].weight.requires_grad_(False)
    x, y = labelled_batch(1)
    with gradhooks.add_hooks(a), gradhooks.add_hooks(b):
        for model in (a, b):
            F.cross_entropy(model(x), y).backward()
            want = loop(model, x, y)
            for name, p in model.named_parameters():
                if p.requires_grad:
                    close(p.grad1, want[name], name)
            assert not hasattr(model[0].weight, "grad1")


def test_a_model_hooked_around_a_hooked_one_is_refused_and_says_where_the_hooks_are():
    """``add_hooks(nn.Sequential(model, head))`` while ``model`` is hooked: refused, and the
    message no longer says only that the other handle is "on a model that contains this one"
    (it is on one inside it); the inner handle goes on giving the loop's ``grad1``."""
    model = mlp()
    x, y = labelled_batch(1)
    with gradhooks.add_hooks(model):
        outer = nn.Sequential(model, nn.Tanh(), nn.Linear(2, 2).double())
        before = model_state(outer)
        raised(
            gradhooks.StateError,
            ["'0.0' (Linear)", "one of its submodules", "remove()"],
            lambda: gradhooks.add_hooks(outer),
        )
        assert_untouched(outer, before)
        F.cross_entropy(model(x), y).backward()
        assert_grad1(model, loop(model, x, y), "the inner handle")


# -- the loop: between the forward and the backward ----------------------------------------------


@pytest.mark.parametrize("method", ["grad1", "bookkeeping", "ghost"])
def test_dp_step_called_under_no_grad(method):
    """``dp_sgd_step`` inside ``torch.no_grad()`` (beside ``optimizer.step()``, as an update
    is often wrapped), on losses of a forward with grad on: a plain ``backward()`` runs there,
    but the step's own products of the losses lost their graph and torch raised "element 0 of
    tensors does not require grad". The step now runs its backward with grad enabled: the
    loop's norms and clipped mean."""
    model = mlp()
    x, y = labelled_batch(1)
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        losses = F.cross_entropy(model(x), y, reduction="none")
        with torch.no_grad():
            norms = gradhooks.dp_sgd_step(
                h, losses, max_norm=0.5, noise_multiplier=0.0, method=method
            )
    want = loop(model, x, y)
    close(norms, flat_norms(want), "norms")
    for name, p in model.named_parameters():
        close(p.grad, clipped_mean(want, 0.5)[name], name)


@pytest.mark.parametrize("quantities", [("grad1",), ("norms",)])
def test_dp_step_of_a_model_with_every_parameter_frozen_is_refused(quantities):
    """Every parameter frozen (``model.requires_grad_(False)``, a fine-tuning setup that
    forgot to unfreeze its head) and the losses still differentiable through the input: the
    step failed in torch ("`inputs` argument to `grad()` cannot be empty"). Refused now,
    naming the model and what to do, with nothing written."""
    model = mlp()
    model.requires_grad_(False)
    x, y = labelled_batch(1)
    x.requires_grad_(True)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        losses = F.cross_entropy(model(x), y, reduction="none")
        before = model_state(model)
        raised(
            gradhooks.ConfigurationError,
            ["Sequential has no trainable parameter", "requires_grad", "requires_grad_(True)"],
            lambda: gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=1.0),
        )
        assert_untouched(model, before)
        assert x.grad is None


# -- the arguments -------------------------------------------------------------------------------


def test_a_quantity_named_twice_is_the_handle_of_it_named_once():
    """``quantities=("grad1", "grad1")`` (a list built by appending): the handle kept the
    duplicate, so it was not the handle of ``("grad1",)``: a MAML step with fast weights
    ``p - lr * g`` through ``functional_call`` was refused as if other quantities were asked
    for, with a message telling to use ``("grad1",)``. Now each name counts once: the step
    gives each query example's gradient through the fast weights (the loop's)."""
    model = mlp()
    own = dict(model.named_parameters())
    (sx, sy), (qx, qy) = labelled_batch(1), labelled_batch(2)
    with gradhooks.add_hooks(model, quantities=("grad1", "grad1")) as h:
        assert h.quantities == ("grad1",)
        with gradhooks.paused():
            grads = torch.autograd.grad(F.cross_entropy(model(sx), sy), list(own.values()))
        fast = {n: p - 0.3 * g for (n, p), g in zip(own.items(), grads)}
        F.cross_entropy(functional_call(model, fast, (qx,)), qy).backward()
    rows = []
    for i in range(len(qx)):
        loss = F.cross_entropy(functional_call(model, fast, (qx[i : i + 1],)), qy[i : i + 1])
        rows.append(torch.autograd.grad(loss, list(own.values()), retain_graph=True))
    for k, (name, p) in enumerate(own.items()):
        close(p.grad1, torch.stack([r[k] for r in rows]), name)


def test_batch_dim_beyond_the_inputs_dimensions_says_to_set_it():
    """``batch_dim=2`` on a ``[batch, features]`` input (a setting kept from an image
    model): the refusal said only to add a batch dimension for one example; it now names the
    setting, the shape, and where the examples usually are. Nothing is captured or written."""
    model = mlp()
    x, y = labelled_batch(1)
    with gradhooks.add_hooks(model, batch_dim=2):
        before = model_state(model)
        raised(
            gradhooks.UnbatchedInputError,
            ["(5, 3)", "add_hooks(model, batch_dim=2)", "time-major", "'auto'"],
            lambda: model(x),
        )
        assert_untouched(model, before)

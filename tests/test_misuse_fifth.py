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


def test_a_step_the_grad_scaler_skips_leaves_the_next_steps_quantities_right():
    """float16 autocast with a ``GradScaler`` whose first scale, 2²⁴, overflows the float16
    output-gradients: that step's ``grad1`` and norms hold Inf or NaN, as ``.grad`` does, and
    the scaler skips it. The next steps, at the scale lowered to 2¹⁶, give ``grad1 / S``, the
    norms ``/ S`` and the squared sums ``/ S²`` of the float64 loop at the weights they ran
    with: nothing of the skipped step is carried over."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, backoff_factor=2.0**-8)
    quantities = ("grad1", "norms", "sum_grad_sq")
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        for step in range(3):
            x, y = labelled_batch(step)
            want = loop(copy.deepcopy(model).double(), x, y)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x.float())
            scale = scaler.get_scale()
            scaler.scale(F.cross_entropy(out.float(), y)).backward()
            grad1 = {n: p.grad1 / scale for n, p in model.named_parameters()}
            if step == 0:
                assert scale == 2.0**24
                assert not all(g.isfinite().all() for g in grad1.values())
                assert not h.norms().isfinite().all()
            else:
                assert scale == 2.0**16, scale
                for name, g in want.items():
                    near(grad1[name], g, HALF, f"step {step}: grad1 of {name}")
                    near(h.sum_grad_sq()[name] / scale**2, g.pow(2).sum(0), 2 * HALF, name)
                near(h.norms() / scale, flat_norms(want), HALF, f"step {step}: norms")
            weights = [p.detach().clone() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
            stepped = any(not torch.equal(w, p) for w, p in zip(weights, model.parameters()))
            assert stepped == (step > 0), f"step {step} stepped: {stepped}"


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


def test_dp_step_with_a_scaler_under_bfloat16_autocast():
    """A ``GradScaler`` kept from a float16 recipe when the forward moved to bfloat16 (which
    needs none): the step still clips the unscaled gradients, the norms those of the loop
    within bfloat16, and writes ``.grad`` scaled by ``S`` for ``scaler.step`` to unscale; the
    step the scaler takes is the loop's clipped mean."""
    model = mlp(torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    x, y = labelled_batch(1)
    want = loop(copy.deepcopy(model).double(), x, y)
    start = {n: p.detach().double() for n, p in model.named_parameters()}
    scaler = torch.amp.GradScaler("cpu")
    with gradhooks.add_hooks(model) as h:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x.float())
        losses = F.cross_entropy(out.float(), y, reduction="none")
        norms = gradhooks.dp_sgd_step(h, losses, max_norm=0.5, noise_multiplier=0.0, scaler=scaler)
        scaler.step(opt)
        scaler.update()
    near(norms, flat_norms(want), 5e-2, "norms")
    for name, p in model.named_parameters():
        near(start[name] - p.detach(), clipped_mean(want, 0.5)[name], 5e-2, name)


@pytest.mark.parametrize(
    "params, inputs",
    [(torch.float16, torch.float32), (torch.bfloat16, torch.float32),
     (torch.float32, torch.float16)],
    ids=["half-model", "bf16-model", "half-input"],
)  # fmt: skip
def test_inputs_of_another_dtype_than_the_model_keep_torchs_error(params, inputs):
    """A model converted (``model.half()``) and fed the loader's float32 batch, or the
    reverse: torch's own dtype error, as without hooks (not a gradhooks refusal), nothing
    captured or written, and the next step, its inputs cast, gives the loop's ``grad1``
    within the parameters' precision."""
    model = mlp(params)
    x, y = labelled_batch(1)
    with gradhooks.add_hooks(model):
        before = model_state(model)
        with pytest.raises(RuntimeError, match="dtype") as info:
            F.cross_entropy(model(x.to(inputs)).float(), y).backward()
        assert not isinstance(info.value, gradhooks.GradhooksError)
        assert_untouched(model, before)
        F.cross_entropy(model(x.to(params)).float(), y).backward()
    want = loop(copy.deepcopy(model).double(), x.to(params).double(), y)
    within = {torch.float16: HALF, torch.bfloat16: 5e-2, torch.float32: 1e-5}[params]
    for name, p in model.named_parameters():
        assert p.grad1.dtype == params
        near(p.grad1, want[name], within, name)


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


def test_zero_grad_between_the_forward_and_the_backward_of_an_accumulating_loop():
    """A first micro-batch backpropagated, the second's forward, then ``zero_grad`` (a loop
    that zeroes where it should not): ``.grad`` holds the second batch alone, and so does
    ``grad1``, not both added."""
    model = mlp()
    (x, y), (x2, y2) = labelled_batch(1), labelled_batch(2)
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x), y).backward()
        out = model(x2)
        model.zero_grad()
        F.cross_entropy(out, y2).backward()
    want = loop(model, x2, y2)
    assert_grad1(model, want, "after zero_grad")
    for name, p in model.named_parameters():
        close(p.grad, want[name].mean(0), name)


@pytest.mark.parametrize("then", ["backward", "dp step"])
def test_clear_between_the_forward_and_the_backward(then):
    """``h.clear()`` after the forward (a logger's reset put in the wrong place): it drops
    the quantities of earlier backwards, not the forward's calls; the backward gives the
    loop's ``grad1`` and norms, the DP step the loop's norms and clipped mean."""
    model = mlp()
    (x, y), (x2, y2) = labelled_batch(1), labelled_batch(2)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        F.cross_entropy(model(x), y).backward()
        model.zero_grad()
        out = model(x2)
        h.clear()
        want = loop(model, x2, y2)
        if then == "backward":
            F.cross_entropy(out, y2).backward()
            assert_grad1(model, want, "after clear")
            close(h.norms(), flat_norms(want), "norms")
        else:
            losses = F.cross_entropy(out, y2, reduction="none")
            norms = gradhooks.dp_sgd_step(h, losses, max_norm=0.5, noise_multiplier=0.0)
            close(norms, flat_norms(want), "norms")
            for name, p in model.named_parameters():
                close(p.grad, clipped_mean(want, 0.5)[name], name)


def test_dp_step_after_an_optimizer_step_on_the_forwards_weights_keeps_torchs_error():
    """``optimizer.step()`` between the forward and the DP step (the step before, where the
    loop should have stepped after): the weights the forward used were changed in place, so
    torch refuses the backward with its own error; nothing is written, and the next forward's
    step gives the loop's clipped sum at the stepped weights."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    x, y = labelled_batch(1)
    with gradhooks.add_hooks(model) as h:
        losses = F.cross_entropy(model(x), y, reduction="none")
        opt.step()
        before = model_state(model)
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
            gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=0.0)
        assert not isinstance(info.value, gradhooks.GradhooksError)
        assert_untouched(model, before)
        losses = F.cross_entropy(model(x), y, reduction="none")
        norms = gradhooks.dp_sgd_step(h, losses, max_norm=0.5, noise_multiplier=0.0)
    want = loop(model, x, y)
    close(norms, flat_norms(want), "norms")
    for name, p in model.named_parameters():
        close(p.grad, clipped_mean(want, 0.5)[name], name)


def test_an_activation_detached_in_place_cuts_the_layers_before_it():
    """``a.detach_()`` on the first layer's output (a feature frozen in place): the first
    layer gets no ``.grad`` and no ``grad1``, without a warning about it, and the head gets
    the loop's ``grad1`` over the detached features."""
    model = mlp()
    x, y = labelled_batch(1)
    with gradhooks.add_hooks(model):
        a = model[0](x)
        a.detach_()
        F.cross_entropy(model[2](torch.tanh(a)), y).backward()
    for p in model[0].parameters():
        assert p.grad is None and not hasattr(p, "grad1")
    want = loop_grad(model[2], F.cross_entropy, (torch.tanh(a),), y)
    for name, p in model[2].named_parameters():
        close(p.grad1, want[name], name)


def test_a_loss_of_one_example_leaves_the_others_rows_zero():
    """``losses[0].backward()`` (a debugging step on the first example) under
    ``loss_reduction="sum"``: ``grad1[0]`` is that example's gradient, every other row is
    zero, and ``grad1.sum(0) == .grad``."""
    model = mlp()
    x, y = labelled_batch(1)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        F.cross_entropy(model(x), y, reduction="none")[0].backward()
    want = loop(model, x, y)
    for name, p in model.named_parameters():
        close(p.grad1[0], want[name][0], name)
        assert not p.grad1[1:].any(), name
        close(p.grad1.sum(0), p.grad, name)


def test_hooks_removed_then_quantities_read_are_the_last_backwards():
    """``h.remove()`` at the end of the block, then ``grad1`` and the norms read (the
    logger after the loop): both are the last backward's, the loop's."""
    model = mlp()
    x, y = labelled_batch(1)
    h = gradhooks.add_hooks(model, quantities=("grad1", "norms"))
    F.cross_entropy(model(x), y).backward()
    h.remove()
    want = loop(model, x, y)
    assert_grad1(model, want, "after remove")
    close(h.norms(), flat_norms(want), "norms")


@pytest.mark.parametrize("how", ["backward", "autograd.grad"])
def test_a_backward_run_under_no_grad_is_captured(how):
    """The backward (or ``torch.autograd.grad``) called inside ``torch.no_grad()`` (a loop
    that wraps its whole update in it), which torch runs as usual: ``grad1`` and the norms are
    the loop's, checked on this first backward as on any."""
    model = mlp()
    x, y = labelled_batch(1)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        loss = F.cross_entropy(model(x), y)
        with torch.no_grad():
            if how == "backward":
                loss.backward()
            else:
                torch.autograd.grad(loss, list(model.parameters()))
        want = loop(model, x, y)
        assert_grad1(model, want, how)
        close(h.norms(), flat_norms(want), "norms")


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


def _regression() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1)).double()


@pytest.mark.parametrize(
    "shape, says",
    [((5, 1), "per_example_loss must be [batch], got (5, 1)"),
     ((1,), "per_example_loss has 1 entries, but the hooked forward had a batch of 5")],
    ids=["batch-by-1", "mean-as-1"],
)  # fmt: skip
def test_dp_step_of_regression_losses_not_of_shape_batch(shape, says):
    """A regression head's ``F.mse_loss(out, y, reduction="none")``, ``[batch, 1]``, or its
    mean kept as ``[1]``: refused, naming the shape and what to do, nothing written; the
    losses ``.squeeze(1)`` give the loop's norms."""
    model = _regression()
    x, _ = labelled_batch(1)
    y = torch.linspace(-1, 1, 5, dtype=torch.float64).unsqueeze(1)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        losses = F.mse_loss(model(x), y, reduction="none")
        losses = losses if len(shape) == 2 else losses.mean().reshape(1)
        before = model_state(model)
        raised(
            gradhooks.ConfigurationError,
            [says, "reduction='none'"],
            lambda: gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=0.0),
        )
        assert_untouched(model, before)
        losses = F.mse_loss(model(x), y, reduction="none").squeeze(1)
        norms = gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=0.0)
    want = loop_grad(model, lambda o, t: F.mse_loss(o, t, reduction="sum"), (x,), y)
    close(norms, flat_norms(want), "norms")


def test_dp_step_of_losses_weighted_to_drop_padding_examples():
    """A fixed-size batch whose last two rows are padding, their losses multiplied by a
    mask of zeros (JAX-style code): those examples' norms are zero and they add nothing; the
    others are clipped as the loop's, their sum divided by their count, given as
    ``expected_batch_size=3``."""
    model = mlp()
    x, y = labelled_batch(1)
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        losses = F.cross_entropy(model(x), y, reduction="none") * mask
        norms = gradhooks.dp_sgd_step(
            h, losses, max_norm=0.5, noise_multiplier=0.0, expected_batch_size=3
        )
    want = {n: g * mask.view(-1, *[1] * (g.dim() - 1)) for n, g in loop(model, x, y).items()}
    close(norms, flat_norms(want), "norms")
    assert not norms[3:].any()
    for name, p in model.named_parameters():
        close(p.grad, clipped_mean(want, 0.5)[name] * 5 / 3, name)


def test_dp_step_of_float16_losses():
    """The per-example losses cast to float16 (a loss computed in the autocast's dtype) for
    a float32 model: the cast passes the gradient through unchanged, so the norms and the
    clipped mean are the loop's within float32."""
    model = mlp(torch.float32)
    x, y = labelled_batch(1)
    want = loop(copy.deepcopy(model).double(), x, y)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        losses = F.cross_entropy(model(x.float()), y, reduction="none").half()
        norms = gradhooks.dp_sgd_step(h, losses, max_norm=0.5, noise_multiplier=0.0)
    assert norms.dtype == torch.float32
    near(norms, flat_norms(want), 1e-5, "norms")
    for name, p in model.named_parameters():
        near(p.grad, clipped_mean(want, 0.5)[name], 1e-5, name)


def test_batch_norm_hooked_in_eval_mode_then_trained_is_refused():
    """A model with BatchNorm hooked in eval mode (its per-example gradients exist: the
    loop's), then ``model.train()`` for the next epoch: batch statistics mix the examples, so
    the forward is refused naming the layer and both ways out, the running statistics, the
    training flag and the gradients as they were; back in eval mode, the loop's ``grad1``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2))
    model = model.double()
    model(torch.randn(8, 3, dtype=torch.float64))  # (running statistics of their own)
    model.eval()
    x, y = labelled_batch(1)
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x), y).backward()
        assert_grad1(model, loop(model, x, y), "eval")
        model.train()
        before = full_state(model)
        raised(
            gradhooks.MixedExamplesError,
            ["'1' (BatchNorm1d)", "train mode", "model.eval()", "GroupNorm"],
            lambda: F.cross_entropy(model(x), y).backward(),
        )
        assert_all_untouched(model, before)
        model.eval()
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        assert_grad1(model, loop(model, x, y), "eval again")


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

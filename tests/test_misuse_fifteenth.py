"""Mistakes in a training loop, a fifteenth set: hooks, swaps and resets the loop gets wrong.

A module's full backward hook or backward pre-hook registered after ``add_hooks`` that changes the
gradient otherwise than by a factor (the batch's mean subtracted, each entry clamped; found and
fixed: such a hook, registered after ``add_hooks``, was not checked, and ``grad1`` of the layers
before it held the examples mixed, in silence, where one registered before was refused; the
refusal, either way, left the ``.grad`` of the layers the backward had reached written), also on a
model compiled after ``add_hooks``, and in the DP step of each method (which clipped and stepped
the mixed gradients); ``torch.func.functional_call`` given detached copies of the parameters, or a
parameter dict made before the head was replaced; an optimizer over the head alone, the body left
trainable and never reset, then a shorter last batch (its message now says that an optimizer's
``zero_grad`` resets only what it holds); a module without a rule swapped in after
``add_hooks(unsupported="error")`` (its message said that nothing was hooked); a loss made to
require grad after a forward run without grad (the anti-fix of torch's "does not require grad"
error); features computed under ``inference_mode`` fed to a hooked head; a batch of one given to a
model whose loss is ``F.cross_entropy(out.squeeze(), y)``; ``grad1`` read after a validation
forward of a batch of another size; the DP step of a model run through ``functional_call`` with its
parameters cast to bfloat16, and of a layer unfrozen between the forward and the step (both refused
with a message that said the parameters had no rule, hooked with ``unsupported='skip'``; it now
says what they are); a layer given by ``functional_call``, inside a reentrant checkpoint, a weight
made before it (found and fixed: the recomputation's per-example gradient of that tensor was
written as the parameter's own, in silence; now refused), and a refused recomputation (which left
the ``.grad`` of the layers the backward reached first). Each gives the documented meaning,
compared in float64 with each example's own gradient by the per-example loop
(:func:`gradhooks.oracle.loop_grad`), or stops with the typed error of its kind, whose message
names the module or the parameter, the shapes and the remedy, leaving the parameters, ``.grad``,
``grad1`` and the hooks as they were (``tests/test_misuse.py`` to
``tests/test_misuse_fourteenth.py`` hold the earlier sets).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_close, assert_untouched, model_state, one_thread, raised

D = torch.float64
assert one_thread  # (autouse: one intra-op thread for these tiny models)


def _net() -> nn.Sequential:
    """Linear-Tanh-Linear-Tanh-Linear (4 -> 8 -> 8 -> 3) in float64, seeded."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)
    ).to(D)


def _batch(seed: int, n: int = 4):
    g = torch.Generator().manual_seed(300 + seed)
    return torch.randn(n, 4, generator=g, dtype=D), torch.randint(3, (n,), generator=g)


def _assert_loop(model, want: dict, what: str) -> None:
    """Every parameter's ``grad1`` the loop's, and its mean ``.grad``."""
    for n, p in model.named_parameters():
        assert_close(p.grad1, want[n], f"{what}: {n}")
        assert_close(p.grad1.mean(0), p.grad, f"{what}: {n} .grad")


# -- found and fixed ---------------------------------------------------------------------------


def _mean_out(module, grad_input, grad_output):
    return (grad_input[0] - grad_input[0].mean(0, keepdim=True),)


def _clamp_in(module, grad_input, grad_output):
    return (grad_input[0].clamp(-1e-3, 1e-3),)


def _mean_out_pre(module, grad_output):
    return (grad_output[0] - grad_output[0].mean(0, keepdim=True),)


HOOKS = {
    "full hook, batch mean subtracted": ("register_full_backward_hook", _mean_out),
    "full hook, entries clamped": ("register_full_backward_hook", _clamp_in),
    "pre-hook, batch mean subtracted": ("register_full_backward_pre_hook", _mean_out_pre),
}


@pytest.mark.parametrize("when", ["before", "after", "in place of an observer"])
@pytest.mark.parametrize("kind", list(HOOKS))
def test_a_module_backward_hook_that_changes_the_gradient_is_refused_when_registered(kind, when):
    """A hook on the second layer that changes the gradient otherwise than by a factor,
    registered before ``add_hooks``, or between two steps after it (also in place of a hook
    that only looks, removed then: as many hooks as before): the batch mean subtracted
    mixes the examples, so that ``grad1`` of the first layer held each example's row of the
    mixed gradient (norms of 0.11 to 0.34 on the second step's batch, where the loop with the
    same hook gives zeros, one example's mean being itself; its mean still ``.grad``), in
    silence where the hook came after ``add_hooks``. Refused now either way, with an
    ``UnsupportedError`` naming the module and the hook, leaving the parameters and ``.grad``
    as ``zero_grad`` left them (the refusal of a hook registered before left the ``.grad`` of
    the layers the backward had reached written), and no ``grad1`` of it (the last step's,
    reset, is gone where the backward reached the layer before the refusal); with the hook
    removed, the next step is the loop's."""
    method, hook = HOOKS[kind]
    what = "backward pre-hook" if "pre" in kind else "full backward hook"
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if when == "before":
        handle = getattr(model[2], method)(hook)
    else:  # (one that looks, put there before add_hooks: the count of hooks stays the same)
        handle = getattr(model[2], method)(lambda *args: None) if when != "after" else None
    with gradhooks.add_hooks(model):
        for step in range(3):
            if step == 1 and when != "before":
                if handle is not None:
                    handle.remove()
                handle = getattr(model[2], method)(hook)
            if step == 2:
                handle.remove()
            x, y = _batch(step)
            optimizer.zero_grad(set_to_none=step != 1)
            if step == 2 or (step == 0 and when != "before"):
                want = loop_grad(copy.deepcopy(model), F.cross_entropy, x, y)
                F.cross_entropy(model(x), y).backward()
                _assert_loop(model, want, f"{kind}, {when}: step {step}, no hook")
                optimizer.step()
                continue
            out = model(x)
            before = model_state(model)
            raised(
                gradhooks.UnsupportedError,
                [f"a {what} of yours on '2' (Linear)", "otherwise than by a factor"],
                lambda out=out, y=y: F.cross_entropy(out, y).backward(),
            )
            for n, p in model.named_parameters():  # (no grad1 of this backward)
                if before["grad1"][n] is not None and "grad1" in p.__dict__:
                    assert torch.equal(p.grad1, before["grad1"][n]), n
                before["grad1"][n] = p.__dict__.get("grad1")
            assert_untouched(model, before)
            optimizer.step()  # (nothing to step: .grad as zero_grad left it)


def test_an_optimizer_over_the_head_alone_then_a_shorter_last_batch_says_why():
    """The head alone in the optimizer, the body left trainable: its ``.grad`` is never
    reset, so its ``grad1`` adds up over the steps as an accumulation's does, and the last
    batch, shorter, cannot be added to the rows of the earlier ones: a ``StateError`` naming
    the parameter and both shapes, which now says that an optimizer's ``zero_grad()`` resets
    only the parameters it holds, leaving the parameters, every ``.grad`` and the body's
    ``grad1`` as they were (the head's, whose ``.grad`` the optimizer reset, is gone with
    it). ``model.zero_grad()``, the remedy, makes that batch's step the loop's."""
    model = _net()
    optimizer = torch.optim.SGD(model[4].parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(2):
            x, y = _batch(step)
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        x, y = _batch(2, n=3)
        optimizer.zero_grad()
        out = model(x)
        before = model_state(model)
        raised(
            gradhooks.StateError,
            ["'2.weight'", "(4, 8, 8)", "(3, 8, 8)", "resets only the parameters it holds",
             "model.zero_grad()"],
            lambda: F.cross_entropy(out, y).backward(),
        )  # fmt: skip
        for n, p in model[4].named_parameters():
            assert p.grad is None and "grad1" not in p.__dict__, n
            before["grad1"][f"4.{n}"] = None
        assert_untouched(model, before)
        want = loop_grad(copy.deepcopy(model), F.cross_entropy, x, y)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        _assert_loop(model, want, "after model.zero_grad()")


class Scale(nn.Module):
    """A learned per-feature scale: a module without a rule."""

    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.ones(8, dtype=D))

    def forward(self, x):
        return x * self.s


def test_a_module_without_a_rule_swapped_in_after_add_hooks_with_unsupported_error():
    """``add_hooks(unsupported="error")``, then a ``Scale`` put in the model between steps: its
    next forward is refused with an ``UnsupportedModuleError`` naming the module and its
    parameter, which now says that the hooks stay as they were and that this forward did not
    run (it said that nothing was hooked); the model keeps its hooks, and with the scale
    frozen the step is the loop's."""
    model = _net()
    with gradhooks.add_hooks(model, unsupported="error"):
        x, y = _batch(0)
        F.cross_entropy(model(x), y).backward()
        model[1] = nn.Sequential(nn.Tanh(), Scale())
        model.zero_grad()
        before = model_state(model)
        error = raised(
            gradhooks.UnsupportedModuleError,
            ["'1.1' (Scale): s", "the hooks stay as they were", "this forward did not run"],
            lambda: model(x),
        )
        assert "Nothing was hooked" not in str(error)
        assert_untouched(model, before)
        model[1][1].requires_grad_(False)
        want = loop_grad(copy.deepcopy(model), F.cross_entropy, x, y)
        F.cross_entropy(model(x), y).backward()
        for n, p in model.named_parameters():
            if p.requires_grad:
                assert_close(p.grad1, want[n], n)
            else:
                assert "grad1" not in p.__dict__, n


# -- the documented meaning ----------------------------------------------------------------------


def test_functional_call_given_detached_copies_trains_the_copies():
    """``functional_call(model, {n: p.detach().clone().requires_grad_()})``: autograd gives the
    copies their ``.grad``, not the model's parameters, and so does gradhooks with ``grad1``:
    each copy's is the loop's (of the model at those weights), and the model's parameters get
    neither."""
    model = _net()
    with gradhooks.add_hooks(model):
        for step in range(2):
            x, y = _batch(step)
            copies = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
            want = loop_grad(copy.deepcopy(model), F.cross_entropy, x, y)
            F.cross_entropy(functional_call(model, copies, (x,)), y).backward()
            for n, p in model.named_parameters():
                assert p.grad is None and "grad1" not in p.__dict__, n
                assert_close(copies[n].grad1, want[n], f"step {step}: copy of {n}")
                assert_close(copies[n].grad1.mean(0), copies[n].grad, f"step {step}: {n}")


def test_a_parameter_dict_made_before_the_head_was_replaced():
    """``params = dict(model.named_parameters())`` made once, then the head replaced: the
    ``functional_call`` runs the old head's weights, so they get the gradient and ``grad1``
    (the loop's of the model with the old head), and the new head, never used, neither."""
    model = _net()
    params = dict(model.named_parameters())
    old = model[4]
    with gradhooks.add_hooks(model):
        model[4] = nn.Linear(8, 3).to(D)
        x, y = _batch(0)
        twin = copy.deepcopy(model)
        twin[4] = copy.deepcopy(old)
        want = loop_grad(twin, F.cross_entropy, x, y)
        F.cross_entropy(functional_call(model, params, (x,)), y).backward()
        for n, p in params.items():
            assert_close(p.grad1, want[n], n)
        assert all(p.grad is None and "grad1" not in p.__dict__ for p in model[4].parameters())


def test_a_loss_made_to_require_grad_after_a_forward_without_grad():
    """The forward run under ``torch.set_grad_enabled(False)`` (a phase flag the wrong way
    round), then ``loss.requires_grad_()`` to silence torch's error: the backward reaches no
    parameter. ``grad1`` stays the last step's, which ``check`` reports as older than the
    reset, and the DP step of such losses is refused, writing no gradient."""
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model) as h:
        x, y = _batch(0)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        kept = {n: p.grad1.clone() for n, p in model.named_parameters()}
        optimizer.zero_grad()
        x, y = _batch(1)
        with torch.set_grad_enabled(False):
            loss = F.cross_entropy(model(x), y)
        loss.requires_grad_()
        loss.backward()
        for n, p in model.named_parameters():
            assert p.grad is None and torch.equal(p.grad1, kept[n]), n
        report = h.check(raise_on_error=False)
        assert not report.ok and "grad1 is of an earlier backward" in str(report)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        with torch.no_grad():
            losses = F.cross_entropy(model(x), y, reduction="none")
        losses.requires_grad_()
        raised(
            gradhooks.StateError,
            ["does not depend on any trainable parameter", "No gradient was written"],
            lambda: gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=1.0),
        )
        assert all(p.grad is None for p in model.parameters())


def test_features_from_inference_mode_fed_to_a_hooked_head_keep_torchs_error():
    """A frozen backbone run under ``inference_mode``, its features given to the hooked head:
    torch refuses to save inference tensors for the backward, with the hooks as without them,
    and the head is left as it was; the features cloned (torch's advice), or computed under
    ``no_grad``, train the head as the loop does."""
    torch.manual_seed(0)
    backbone, head = nn.Linear(4, 8).to(D), nn.Linear(8, 3).to(D)
    x, y = _batch(0)
    with gradhooks.add_hooks(head):
        with torch.inference_mode():
            features = torch.tanh(backbone(x))
        before = model_state(head)
        with pytest.raises(RuntimeError, match="Inference tensors cannot be saved"):
            F.cross_entropy(head(features), y).backward()
        assert_untouched(head, before)
        for how in ("clone", "no_grad"):
            if how == "no_grad":
                with torch.no_grad():
                    features = torch.tanh(backbone(x))
            else:
                features = features.clone()
            want = loop_grad(copy.deepcopy(head), F.cross_entropy, features, y)
            head.zero_grad()
            F.cross_entropy(head(features), y).backward()
            _assert_loop(head, want, how)


def test_a_batch_of_one_squeezed_by_the_loss():
    """``F.cross_entropy(out.squeeze(), y)`` on a last batch of one: the logits lose their
    batch dimension and torch refuses them beside a label of shape ``[1]``, with the hooks as
    without them, leaving the model as it was; ``squeeze(-1)`` where it was meant (or no
    squeeze) gives the loop's ``[1, ...]`` rows."""
    model = _net()
    x, y = _batch(0, n=1)
    with gradhooks.add_hooks(model):
        out = model(x)
        before = model_state(model)
        with pytest.raises((RuntimeError, ValueError)):
            F.cross_entropy(out.squeeze(), y).backward()
        assert_untouched(model, before)
        want = loop_grad(copy.deepcopy(model), F.cross_entropy, x, y)
        F.cross_entropy(model(x), y).backward()
        _assert_loop(model, want, "a batch of one")
        assert model[0].weight.grad1.shape == (1, 8, 4)


def test_grad1_read_after_a_validation_forward_of_another_batch_size():
    """A training step on 4 examples, then a validation forward of 6 under ``no_grad`` and one
    of 5 with grad left on (no backward): ``grad1`` is still the training step's, its 4 rows
    the loop's; the next training step starts afresh after ``zero_grad``."""
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(2):
            x, y = _batch(step)
            want = loop_grad(copy.deepcopy(model), F.cross_entropy, x, y)
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            with torch.no_grad():
                model(_batch(10, n=6)[0])
            model(_batch(11, n=5)[0])  # (grad on, never backpropagated)
            _assert_loop(model, want, f"step {step}")
            optimizer.step()


def test_a_dp_step_of_a_model_run_through_functional_call_with_bfloat16_casts():
    """A mixed-precision policy written by hand, ``functional_call(model, {n: p.to(bf16)})``,
    given to the DP step: with norms, the forward is refused (a ``ConfigurationError``: the
    slots hold tensors computed from the parameters); with ``grad1``, the step is refused
    with an ``UnsupportedError`` that now names the parameters and ``functional_call`` (it
    said they had no rule, hooked with ``unsupported='skip'``, which they were not), leaving
    them without ``.grad``. The forward under ``torch.autocast`` in bfloat16, as advised, steps
    the loop's clipped sum within bfloat16's rounding."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = _batch(0)
    x = x.float()
    low = {n: p.to(torch.bfloat16) for n, p in model.named_parameters()}

    def losses():
        out = functional_call(model, low, (x.bfloat16(),))
        return F.cross_entropy(out.float(), y, reduction="none")

    with gradhooks.add_hooks(model, quantities=("norms",)):
        raised(gradhooks.ConfigurationError, ["'0.weight'", "functional_call"], losses)
    with gradhooks.add_hooks(model, quantities=("grad1",)) as h:
        per = losses()
        before = model_state(model)
        raised(
            gradhooks.UnsupportedError,
            ["['0.weight', '0.bias', '2.weight', '2.bias']", "functional_call",
             "torch.autocast", "Nothing was changed"],
            lambda: gradhooks.dp_sgd_step(h, per, max_norm=0.1, noise_multiplier=0.0),
        )  # fmt: skip
        assert_untouched(model, before)
        loop = loop_grad(copy.deepcopy(model).double(), F.cross_entropy, x.double(), y)
        norms = torch.cat([g.flatten(1) for g in loop.values()], 1).norm(dim=1)
        factor = (0.1 / norms).clamp(max=1.0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        per = F.cross_entropy(out.float(), y, reduction="none")
        gradhooks.dp_sgd_step(h, per, max_norm=0.1, noise_multiplier=0.0)
        for n, p in model.named_parameters():
            want = torch.einsum("b,b...->...", factor, loop[n]) / len(x)
            err = (p.grad.double() - want).abs().max().item()
            assert err <= 5e-2 * want.abs().max().item(), (n, err)


class _Scaled(nn.Sequential):
    """Linear, a learned per-feature scale (no rule: the fallback's), Linear."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(nn.Linear(4, 8), Scale(), nn.Linear(8, 3))
        self.to(D)


def test_a_layer_unfrozen_between_the_forward_and_the_dp_step_is_refused_saying_so():
    """The scale frozen at the forward, unfrozen before the DP step: the step has no
    per-example gradient of it, and refuses, naming it and that it was frozen at the forward
    (the message said it had no rule, hooked with ``unsupported='skip'``); nothing written. A
    forward with it trainable steps the loop's clipped sum."""
    model = _Scaled()
    model[1].requires_grad_(False)
    x, y = _batch(0)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        per = F.cross_entropy(model(x), y, reduction="none")
        model[1].requires_grad_(True)
        before = model_state(model)
        raised(
            gradhooks.UnsupportedError,
            ["['1.s']", "frozen then", "Nothing was changed"],
            lambda: gradhooks.dp_sgd_step(h, per, max_norm=0.1, noise_multiplier=0.0),
        )
        assert_untouched(model, before)
        loop = loop_grad(copy.deepcopy(model), F.cross_entropy, x, y)
        norms = torch.cat([g.flatten(1) for g in loop.values()], 1).norm(dim=1)
        factor = (0.1 / norms).clamp(max=1.0)
        per = F.cross_entropy(model(x), y, reduction="none")
        gradhooks.dp_sgd_step(h, per, max_norm=0.1, noise_multiplier=0.0)
        for n, p in model.named_parameters():
            assert_close(p.grad, torch.einsum("b,b...->...", factor, loop[n]) / len(x), n)


def test_a_compiled_models_layer_given_backward_hooks_after_add_hooks_and_compilation():
    """``torch.compile(model)`` after ``add_hooks``; between steps a gradient reversal is
    registered on its second layer (followed: ``grad1`` is the loop's with the same hook),
    then replaced by one that subtracts the batch's mean (refused at the backward, naming the
    layer, leaving ``.grad`` as ``zero_grad`` left it)."""
    model = _net()
    with gradhooks.add_hooks(model):
        compiled = torch.compile(model)
        handle = None
        for step in range(4):
            if step == 1:
                handle = model[2].register_full_backward_hook(lambda m, gi, go: (-0.5 * gi[0],))
            if step == 3:
                handle.remove()
                model[2].register_full_backward_hook(_mean_out)
            x, y = _batch(step)
            want = loop_grad(copy.deepcopy(model), F.cross_entropy, x, y)
            model.zero_grad()
            out = compiled(x)
            if step < 3:
                F.cross_entropy(out, y).backward()
                _assert_loop(model, want, f"step {step}")
                continue
            raised(
                gradhooks.UnsupportedError,
                ["a full backward hook of yours on '2' (Linear)", "otherwise than by a factor"],
                lambda out=out, y=y: F.cross_entropy(out, y).backward(),
            )
            assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_the_dp_step_through_a_hook_registered_after_add_hooks_that_mixes_the_examples(method):
    """The DP step of each method with a full backward hook that subtracts the batch's mean,
    registered on the second layer after ``add_hooks``: each example's clipped gradient held
    the others', in silence (the first layer's clipped sum up to 0.004 where the loop's, with
    the same hook, is zero, the rows' norms taking the others' in: no bound on what one
    example changes). Refused now, as where the hook was
    registered before, writing no ``.grad``; with a gradient reversal instead, the step is the
    loop's clipped sum."""
    for hook in (_mean_out, lambda m, gi, go: (-0.5 * gi[0],)):
        model = _net()
        quantity = "grad1" if method == "grad1" else "norms"
        with gradhooks.add_hooks(model, quantities=(quantity,)) as h:
            model[2].register_full_backward_hook(hook)
            x, y = _batch(0)
            per = loop_grad(copy.deepcopy(model), F.cross_entropy, x, y)
            losses = F.cross_entropy(model(x), y, reduction="none")

            def step(h=h, losses=losses):
                gradhooks.dp_sgd_step(h, losses, max_norm=0.1, noise_multiplier=0.0, method=method)

            if hook is _mean_out:
                raised(gradhooks.UnsupportedError, "'2' (Linear)", step)
                assert all(p.grad is None for p in model.parameters())
                continue
            step()
            norms = torch.cat([g.flatten(1) for g in per.values()], 1).norm(dim=1)
            factor = (0.1 / norms).clamp(max=1.0)
            for n, p in model.named_parameters():
                assert_close(p.grad, torch.einsum("b,b...->...", factor, per[n]) / len(x), n)


class _Hyper(nn.Module):
    """A layer run by ``functional_call`` inside a checkpointed function, with a weight made
    before it from the layer's own (``1.5 * weight``, a hypernetwork's scale)."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.reentrant = nn.Linear(4, 8), nn.Linear(8, 3), reentrant
        self.to(D)

    def forward(self, x):
        made = {"weight": 1.5 * self.a.weight, "bias": self.a.bias}

        def block(t):
            return torch.tanh(functional_call(self.a, made, (t,)))

        return self.b(checkpoint(block, x, use_reentrant=self.reentrant))


def test_weights_made_before_a_reentrant_checkpoint_and_swapped_in_inside_it():
    """Reentrant checkpointing runs the layer again in the backward, with ``1.5 * weight`` in
    its slot: its per-example gradient of that tensor was written as the weight's own, 1.5
    times too small (``grad1.mean(0)`` off ``.grad``), in silence. Refused now at that
    recomputation, with an ``UnsupportedError`` naming the layer, the slot, the parameter
    and the remedies, the model's gradients as they were; non-reentrant checkpointing, the
    first remedy, gives the loop's."""
    model = _Hyper(reentrant=True)
    x, y = _batch(0)
    x.requires_grad_(True)  # (for the reentrant form to recompute)
    with gradhooks.add_hooks(model):
        out = model(x)
        before = model_state(model)
        raised(
            gradhooks.UnsupportedError,
            ["'a' (Linear)", "its 'weight'", "'a.weight'", "use_reentrant=False"],
            lambda: F.cross_entropy(out, y).backward(),
        )
        assert_untouched(model, before)
        model.reentrant = False
        want = loop_grad(copy.deepcopy(model), F.cross_entropy, x, y)
        F.cross_entropy(model(x), y).backward()
        _assert_loop(model, want, "non-reentrant")


class _NormedBlock(nn.Module):
    """A ``weight_norm`` parametrized layer inside a reentrant checkpoint, then a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)
        torch.nn.utils.parametrizations.weight_norm(self.a)
        self.to(D)

    def forward(self, x):
        return self.b(checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=True))


def test_a_refused_recomputation_leaves_the_gradients_of_the_layers_after_it():
    """A parametrization run again in the backward by reentrant checkpointing is refused (a
    ``BatchNotFoundError`` naming it and ``use_reentrant=False``), as before; the head, which
    the backward reached first, kept the ``.grad`` and ``grad1`` of the refused backward. Now
    nothing of it is left."""
    model = _NormedBlock()
    x, y = _batch(0)
    x.requires_grad_(True)
    with gradhooks.add_hooks(model):
        out = model(x)
        before = model_state(model)
        raised(
            gradhooks.BatchNotFoundError,
            ["'a.parametrizations.weight'", "use_reentrant=False"],
            lambda: F.cross_entropy(out, y).backward(),
        )
        assert_untouched(model, before)

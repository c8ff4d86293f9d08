"""Misuse of the public API, an eleventh set: inputs that are no inputs (``None``, a number)
given to ``jacobians``, ``kfac`` and the oracles; the oracles given a loss of
``reduction="none"`` or a model with no trainable parameter; ``check_rule`` given no inputs
or the outputs for a loss, ``h.check`` a number for its inputs; ``kfac(fisher="mc")`` of an
output that holds NaN; a handle's ``with`` block entered again inside itself; and, kept as
they are, empty batches and batches of one in the DP step, the quantities and the Jacobians, a
handle's methods after ``remove()``, ``paused()`` and ``capturing()`` nested, a second handle
on a model or on its submodule, and a loss of ``reduction="none"`` given to ``backward()``
without ``.sum()``. Each gives the documented meaning, compared in float64 with each example's
own gradient by the per-example loop (:func:`gradhooks.oracle.loop_grad`), or stops with the
typed error of its kind, whose message names what was refused, leaving the parameters,
``.grad``, ``grad1``, the buffers and the hooks as they were (``tests/test_misuse.py`` to
``tests/test_misuse_tenth.py`` hold the earlier sets)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_misuse_fifth import assert_all_untouched, close, full_state, loop
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad, vmap_grad
from harness import assert_untouched, labelled_batch, mlp, model_state, one_thread, raised

D = torch.float64
assert one_thread  # (autouse: one intra-op thread for these tiny models)


def assert_grad1(model: nn.Module, want: dict, what: str) -> None:
    for name, p in model.named_parameters():
        close(p.grad1, want[name], f"{what}: {name}")


# -- found and fixed -------------------------------------------------------------------------------


def _jacobians(model, inputs, y):
    return gradhooks.jacobians(model, inputs)


def _kfac(model, inputs, y):
    return gradhooks.kfac(model, inputs, y)


def _loop(model, inputs, y):
    return loop_grad(model, F.cross_entropy, inputs, y)


def _vmap(model, inputs, y):
    return vmap_grad(model, F.cross_entropy, inputs, y)


@pytest.mark.parametrize("inputs", [None, 3], ids=["None", "int"])
@pytest.mark.parametrize(
    "call, says",
    [(_jacobians, "jacobians(): inputs must be"), (_kfac, "kfac(): inputs must be"),
     (_loop, "loop_grad: inputs must be"), (_vmap, "vmap_grad: inputs must be")],
    ids=["jacobians", "kfac", "loop_grad", "vmap_grad"],
)  # fmt: skip
def test_inputs_that_are_no_inputs_are_refused_naming_their_type(call, says, inputs):
    """``jacobians(model, None)`` (the inputs forgotten, the batch given by keyword
    elsewhere), ``kfac(model, 3, y)``, ``loop_grad(model, loss_fn, None, y)``: each failed
    inside gradhooks with a bare ``TypeError`` (``'NoneType' object is not iterable``, from
    ``tuple(inputs)``). Refused, naming the call and the type given, the model as it was."""
    model = mlp()
    x, y = labelled_batch(1)
    before = full_state(model)
    raised(gradhooks.ConfigurationTypeError, [says, type(inputs).__qualname__],
           lambda: call(model, inputs, y))  # fmt: skip
    assert_all_untouched(model, before)
    got = call(model, (x,), y)  # (a tuple of the positional inputs, as before)
    assert got


def test_hooks_check_given_a_number_for_its_inputs():
    """``h.check(loss_fn, 3, y)`` (the batch size given where the inputs go) failed inside
    gradhooks with a bare ``TypeError`` (``'int' object is not iterable``). Refused, naming the
    type, ``grad1`` and the hooks as they were; the inputs themselves give the check."""
    model = mlp()
    x, y = labelled_batch(1)
    h = gradhooks.add_hooks(model)
    F.cross_entropy(model(x), y).backward()
    before = full_state(model)
    raised(gradhooks.ConfigurationTypeError, ["check(loss_fn, inputs, target)", "got int"],
           lambda: h.check(F.cross_entropy, 3, y))  # fmt: skip
    assert_all_untouched(model, before)
    assert h.check(F.cross_entropy, x, y).ok
    h.remove()


def test_check_rule_given_no_inputs_or_a_loss_of_the_outputs_themselves():
    """``check_rule(layer, None)`` failed with a bare ``TypeError`` from the oracle's
    ``tuple(inputs)``; ``check_rule(layer, x, lambda out: out)`` (the output taken for its
    loss) with torch's bare ``RuntimeError`` from the backward ("grad can be implicitly created
    only for scalar outputs"). Both are refused, naming the type or the loss's shape, the layer
    as it was; the same layer and input with a summed loss pass."""
    layer = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    before = full_state(layer)
    raised(gradhooks.ConfigurationTypeError, ["check_rule: inputs must be", "NoneType"],
           lambda: gradhooks.check_rule(layer, None))  # fmt: skip
    raised(gradhooks.ConfigurationError, ["check_rule: loss_fn returned (4, 2)", "batch of 4"],
           lambda: gradhooks.check_rule(layer, x, lambda out: out))  # fmt: skip
    assert_all_untouched(layer, before)
    assert gradhooks.check_rule(layer, x, lambda out: out.pow(2).sum()).ok


@pytest.mark.parametrize("oracle", [loop_grad, vmap_grad], ids=["loop_grad", "vmap_grad"])
def test_the_oracles_given_a_loss_of_reduction_none(oracle):
    """The oracles given ``F.cross_entropy(..., reduction="none")``: each example's loss is
    then of shape ``[1]``, its own and only loss. ``loop_grad`` took it, ``vmap_grad`` failed
    with ``torch.func``'s bare ``RuntimeError`` ("Expected f(*args) to return a scalar
    Tensor"): both now give each example's gradient. A loss of more than one number per
    example (a sequence's, one per position, left unreduced) has no one gradient: torch's bare
    ``RuntimeError`` in both ("grad can be implicitly created only for scalar outputs"),
    refused now, naming the shape and saying to reduce it."""
    model = mlp()
    x, y = labelled_batch(1)
    got = oracle(model, lambda o, t: F.cross_entropy(o, t, reduction="none"), x, y)
    want = loop(model, x, y)
    for name in want:
        close(got[name], want[name], name)
    before = full_state(model)
    raised(gradhooks.ConfigurationError, [oracle.__name__, "returned (1, 2) for one example"],
           lambda: oracle(model, lambda o, t: F.mse_loss(o, o.detach() + 1, reduction="none"),
                          x, y))  # fmt: skip
    assert_all_untouched(model, before)


def test_loop_grad_of_a_model_with_no_trainable_parameter_is_empty_as_vmap_grad():
    """``loop_grad`` of a model frozen whole (a frozen feature extractor checked by itself)
    failed with torch's bare ``RuntimeError`` ("element 0 of tensors does not require grad")
    from its ``backward``; ``vmap_grad`` gave ``{}``, the gradient of no parameter. Both
    give ``{}``."""
    model = mlp().requires_grad_(False)
    x, y = labelled_batch(1)
    before = full_state(model)
    assert loop_grad(model, F.cross_entropy, x, y) == {}
    assert vmap_grad(model, F.cross_entropy, x, y) == {}
    assert_all_untouched(model, before)


def test_kfac_mc_of_an_output_holding_nan_names_the_examples():
    """``kfac(model, x, y)`` (``fisher="mc"``, labels drawn from the softmax) of a batch whose
    third example holds NaN: torch's bare ``RuntimeError`` from ``torch.multinomial``
    ("probability tensor contains either inf, nan or element < 0"). A ``NumericalError``
    now, naming the output's shape and the examples, the model as it was; the same batch
    without them gives the factors, and the K-FAC optimizer's own refusal (a ``.grad`` of NaN)
    is the same type."""
    model = mlp()
    x, y = labelled_batch(1)
    x[2] = float("nan")
    before = full_state(model)
    raised(gradhooks.NumericalError, ["kfac(fisher='mc')", "(5, 2)", "examples [2]"],
           lambda: gradhooks.kfac(model, x, y))  # fmt: skip
    assert_all_untouched(model, before)
    keep = torch.tensor([0, 1, 3, 4])
    factors = gradhooks.kfac(model, x[keep], y[keep])
    assert all(bool(f.A.isfinite().all() and f.G.isfinite().all()) for f in factors.values())


def test_a_handles_with_block_entered_again_inside_itself_is_refused():
    """``with h:`` written again inside ``with h:`` (a helper that wraps its step in the
    handle it is given): the inner block's end removed the hooks, and the rest of the outer
    block captured nothing, silently: the next backward left ``grad1`` at the inner block's
    batch while ``.grad`` moved on. The inner ``with`` is refused with a ``StateError``
    before it changes anything; the outer block's backward then gives the documented
    ``grad1``."""
    model = mlp()
    x, y = labelled_batch(1)
    h = gradhooks.add_hooks(model)
    with h:
        before = model_state(model)
        raised(gradhooks.StateError, ["already inside its with block", "h.paused()"],
               lambda: h.__enter__())  # fmt: skip
        assert_untouched(model, before)
        assert h.active
        F.cross_entropy(model(x), y).backward()
        assert_grad1(model, loop(model, x, y), "the outer block's backward")
    assert not h.active


# -- the documented meaning, kept --------------------------------------------------------------------


def test_a_dp_step_on_an_empty_poisson_batch_is_the_noise_alone():
    """Poisson sampling gives an empty batch now and then: ``dp_sgd_step`` of its losses
    ``[0]`` sets ``.grad`` to the noise alone, ``σ C / B`` (zero without noise), each of the
    parameter's shape, and returns no norm."""
    model = mlp()
    x, y = labelled_batch(1)
    with gradhooks.add_hooks(model) as h:
        losses = F.cross_entropy(model(x[:0]), y[:0], reduction="none")
        norms = gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=0.0,
                                      expected_batch_size=4)  # fmt: skip
    assert norms.shape == (0,)
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, torch.zeros_like(p)), name
    model.zero_grad()
    g = torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(model) as h:
        losses = F.cross_entropy(model(x[:0]), y[:0], reduction="none")
        gradhooks.dp_sgd_step(h, losses, max_norm=2.0, noise_multiplier=1.5,
                              expected_batch_size=4, generator=g)  # fmt: skip
    spread = torch.cat([p.grad.flatten() for p in model.parameters()]).std()
    assert 0.5 * 1.5 * 2.0 / 4 < spread < 1.5 * 1.5 * 2.0 / 4, float(spread)


def test_quantities_of_an_empty_batch_and_of_a_batch_of_one():
    """The norms, squared sums and variance of a backward of no example are empty and zero;
    the noise scale is refused (``B - 1`` in its denominator); of one example the norms are
    its gradient's, the variance zero (to rounding) and ``grad1`` that example's gradient."""
    model = mlp()
    x, y = labelled_batch(1)
    h = gradhooks.add_hooks(model, quantities=("grad1", "norms", "sum_grad_sq"))
    F.cross_entropy(model(x[:0]), y[:0], reduction="sum").backward()
    assert h.norms().shape == (0,)
    assert all(v.shape == (0,) for v in h.param_norms().values())
    for name, p in model.named_parameters():
        assert torch.equal(h.sum_grad_sq()[name], torch.zeros_like(p)), name
    raised(gradhooks.StateError, "0 example(s)", lambda: h.noise_scale())
    h.remove()
    model.zero_grad()
    h = gradhooks.add_hooks(model, quantities=("grad1", "norms", "sum_grad_sq"))
    F.cross_entropy(model(x[:1]), y[:1]).backward()
    want = loop(model, x[:1], y[:1])
    assert_grad1(model, want, "a batch of one")
    close(h.norms(), torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1), "norms")
    for name, var in h.grad_variance().items():
        assert var.abs().max() < 1e-15, name
    h.remove()


def test_jacobians_of_an_empty_batch_and_of_a_batch_of_one():
    """``jacobians`` of no example is empty, of the shapes of a full batch's; of one example
    it is that example's, as a batch's first row."""
    model = mlp()
    x, _ = labelled_batch(1)
    before = full_state(model)
    full = gradhooks.jacobians(model, x)
    empty = gradhooks.jacobians(model, x[:0])
    one = gradhooks.jacobians(model, x[:1])
    for name, jac in full.items():
        assert empty[name].shape == (0, *jac.shape[1:]), name
        close(one[name], jac[:1], name)
    assert_all_untouched(model, before)


def test_a_handles_methods_after_remove():
    """After ``remove()``: ``remove()`` again, ``clear()``, ``paused()`` and ``capturing()``
    do nothing (the hooks are gone); ``with h:``, ``check``, a DP step and new quantities are
    refused with a ``StateError`` naming the removal; ``grad1`` stays the last backward's."""
    model = mlp()
    x, y = labelled_batch(1)
    h = gradhooks.add_hooks(model)
    F.cross_entropy(model(x), y).backward()
    h.remove()
    before = model_state(model)
    h.remove()
    with h.paused(), h.capturing():
        pass
    h.clear()
    assert_untouched(model, before)
    raised(gradhooks.StateError, "hooks were removed", lambda: h.__enter__())
    raised(gradhooks.StateError, "the hooks are removed", lambda: h.check(F.cross_entropy, x, y))
    raised(gradhooks.StateError, "needs an active handle",
           lambda: gradhooks.dp_sgd_step(h, F.cross_entropy(model(x), y, reduction="none"),
                                         max_norm=1.0, noise_multiplier=0.0))  # fmt: skip
    raised(gradhooks.ConfigurationError, "quantities are chosen when the hooks are added",
           lambda: setattr(h, "quantities", ("norms",)))  # fmt: skip
    assert_untouched(model, before)
    assert_grad1(model, loop(model, x, y), "after remove")


def test_paused_and_capturing_nested():
    """``h.paused()`` nested in itself stays paused to the outer block's end;
    ``capture="marked"`` with ``h.capturing()`` inside ``h.paused()`` (or the other way)
    captures nothing: paused wins. ``grad1`` is then the captured backward's alone."""
    x, y = labelled_batch(1)
    x2, y2 = labelled_batch(2)
    model = mlp()
    h = gradhooks.add_hooks(model)
    with h.paused():
        with h.paused():
            pass
        F.cross_entropy(model(x2), y2).backward()
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    assert h.accumulated == 1
    assert_grad1(model, loop(model, x, y), "after the nested pauses")
    h.remove()
    for order in ("capturing-in-paused", "paused-in-capturing"):
        model = mlp()
        h = gradhooks.add_hooks(model, capture="marked")
        outer, inner = (h.paused, h.capturing) if order[0] == "c" else (h.capturing, h.paused)
        with outer(), inner():
            F.cross_entropy(model(x), y).backward()
        assert not h.captured, order
        assert "grad1" not in model[0].weight.__dict__, order
        h.remove()


def test_a_second_handle_on_the_model_or_on_a_submodule_is_refused():
    """``add_hooks(model)`` twice, or on one of a hooked model's layers: a ``StateError``
    naming the existing handle, the model's hooks as they were."""
    model = mlp()
    h = gradhooks.add_hooks(model)
    before = full_state(model)
    raised(gradhooks.StateError, "already has gradhooks hooks", lambda: gradhooks.add_hooks(model))
    raised(gradhooks.StateError, "already hooked by another gradhooks handle",
           lambda: gradhooks.add_hooks(model[0]))  # fmt: skip
    assert_all_untouched(model, before)
    h.remove()


def test_a_loss_of_reduction_none_given_to_backward():
    """``F.cross_entropy(..., reduction="none").backward()`` without ``.sum()``: torch's own
    error, before any hook runs, the model as it was; with ``backward(torch.ones(B))`` (the
    sum of the losses) under the default ``loss_reduction="mean"``, ``grad1`` is the sum's
    rows scaled as a mean's, ``B`` times each example's gradient of its own loss, as
    ``h.rescale("sum")`` documents."""
    model = mlp()
    x, y = labelled_batch(1)
    h = gradhooks.add_hooks(model)
    before = full_state(model)
    with pytest.raises(RuntimeError, match="scalar outputs"):
        F.cross_entropy(model(x), y, reduction="none").backward()
    assert_all_untouched(model, before)
    F.cross_entropy(model(x), y, reduction="none").backward(torch.ones(5, dtype=D))
    want = loop(model, x, y)
    assert_grad1(model, {n: 5 * g for n, g in want.items()}, "a sum taken for a mean")
    h.rescale("sum")
    assert_grad1(model, want, "rescaled to the sum")
    h.remove()

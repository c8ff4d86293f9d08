"""What a DP step says of the examples it does not protect.

A warning, from ``gradhooks.dp_sgd_step`` and from its variant across ranks,
``gradhooks.distributed.dp_sgd_step`` (here on a process group of one rank; two ranks in
``tests/distributed_worker.py``), checked on the step's numbers too (a float64 loop of
each example's gradient, clipped and averaged), where:

- losses that reach trainable parameters the hooks are not on (a head left out of
  ``add_hooks(model.l1)``, a learned temperature outside the model): those get no gradient
  from the step (``GradhooksWarning``, naming how many and their shapes);
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_idioms_fourteenth import one_rank  # noqa: F401  (a fixture)
from test_misuse_fifth import clipped_mean, close
from test_misuse_seventeenth import MAX_NORM, Scaled, Smoothed, _batch, _loop
from torch import nn

import gradhooks
from harness import one_thread

D = torch.float64
assert one_thread  # (autouse: one intra-op thread for these tiny models)

STEPS = {
    "one process": gradhooks.dp_sgd_step,
    "across ranks": gradhooks.distributed.dp_sgd_step,
}
WHERE = {
    "one process": "gradhooks.dp_sgd_step:",
    "across ranks": "gradhooks.distributed.dp_sgd_step:",
}


@pytest.fixture(params=list(STEPS))
def step(request):
    """``(name, dp_sgd_step)``: the step of one process, or that across ranks on a process
    group of one rank."""
    if request.param == "across ranks":
        request.getfixturevalue("one_rank")
    return request.param, STEPS[request.param]


def caught(kind: type[Warning], run) -> tuple[list[str], object]:
    """The messages of the warnings of class ``kind`` that ``run()`` issued (every warning
    recorded), and what it returned."""
    found, out = caught_all(run)
    return [m for c, m in found if issubclass(c, kind)], out


def caught_all(run) -> tuple[list[tuple[type[Warning], str]], object]:
    """Every warning ``run()`` issued, ``(class, message)``, and what it returned."""
    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        out = run()
    return [(w.category, str(w.message)) for w in found], out


def assert_step(model: nn.Module, want: dict, what: str, max_norm: float = MAX_NORM) -> None:
    """Every parameter's ``.grad`` is the DP step's without noise: the loop's gradients
    clipped to ``max_norm`` over the whole model, averaged."""
    mean = clipped_mean(want, max_norm)
    for n, p in model.named_parameters():
        close(p.grad, mean[n], f"{what}: {n}")


# -- parameters the hooks are not on --------------------------------------------------------


@pytest.mark.parametrize("outside", ["head", "temperature"])
def test_losses_through_parameters_the_hooks_are_not_on_warn_in_either_step(step, outside):
    """The hooks on ``model.l1`` alone and the losses through the head too, or the hooks on the
    model and the losses divided by a learned temperature outside it: each step clips the
    hooked parameters' gradients (the loop's, clipped by their norm over those alone), leaves
    the others' ``.grad`` as it was, and warns, naming the step, how many and their shapes.
    The step across ranks said nothing."""
    name, dp_sgd_step = step
    model, scale = Smoothed(), Scaled()
    scale.temperature.requires_grad_(outside == "temperature")
    hooked, left = (
        (model.l1, model.head.weight) if outside == "head" else (model, scale.temperature)
    )

    def own_loss(out, target):
        return F.cross_entropy(out / scale.temperature, target, reduction="none").sum()

    x, y = _batch(3)
    want = gradhooks.oracle.loop_grad(copy.deepcopy(model), own_loss, (x,), y)
    inside = {n: want[n] for n, p in model.named_parameters() if p in set(hooked.parameters())}
    left.grad = torch.full_like(left, 0.25)
    with gradhooks.add_hooks(hooked, quantities=("norms",)) as h:
        losses = F.cross_entropy(model(x) / scale.temperature, y, reduction="none")
        said, _ = caught(gradhooks.GradhooksWarning, lambda: dp_sgd_step(
            h, losses, max_norm=MAX_NORM, noise_multiplier=0.0
        ))  # fmt: skip
    assert len(said) == 1, said
    count, shapes = ("2", "(3, 6), (3,)") if outside == "head" else ("1", "()")
    for part in [WHERE[name], f"reach {count} trainable", shapes, "not the hooked model's"]:
        assert part in said[0], (part, said[0])
    mean = clipped_mean(inside, MAX_NORM)
    for n in inside:
        close(model.get_parameter(n).grad, mean[n], n)
    assert torch.equal(left.grad, torch.full_like(left, 0.25)), "the .grad left from before"


def test_the_whole_model_hooked_warns_of_nothing_in_either_step(step):
    """Hooked whole, nothing outside: no warning of gradhooks', and the step is the loop's."""
    _, dp_sgd_step = step
    model = Smoothed()
    x, y = _batch(4)
    want = _loop(model, x, y)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        losses = F.cross_entropy(model(x), y, reduction="none")
        said, _ = caught(gradhooks.GradhooksWarning, lambda: dp_sgd_step(
            h, losses, max_norm=MAX_NORM, noise_multiplier=0.0
        ))  # fmt: skip
    assert said == []
    assert_step(model, want, "hooked whole")


def test_the_check_of_parameters_outside_is_one_function_for_both_steps():
    """Both steps find and tell the parameters outside the hooks by the same two functions
    (no second copy to drift): a walk of the losses' graph before the backward, and the
    warning after the step, which names the step that warns."""
    from gradhooks.workflows import distributed, dp

    source = {f.__name__: f for f in (dp.dp_sgd_step, distributed.dp_sgd_step)}
    for name, f in source.items():
        names = f.__code__.co_names
        assert "reached_outside" in names and "warn_if_outside" in names, name
    model = Smoothed()
    x, y = _batch(5)
    with gradhooks.add_hooks(model.l1, quantities=("norms",)) as h:
        losses = F.cross_entropy(model(x), y, reduction="none")
        found = dp.reached_outside(h, losses)
        assert {id(p) for p in found} == {id(model.head.weight), id(model.head.bias)}
        said, _ = caught(
            gradhooks.GradhooksWarning, lambda: dp.warn_if_outside(h, found, "somewhere")
        )
    assert len(said) == 1 and said[0].startswith("somewhere: the losses reach 2 trainable")

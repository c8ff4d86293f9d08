"""LayerNorm, RMSNorm, GroupNorm, InstanceNorm1d/2d/3d, BatchNorm1d/2d/3d (eval; train is an
error) and PReLU, against both oracles."""

import contextlib
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call, grad, vmap

import gradhooks
from gradhooks import _torch
from gradhooks.oracle import loop_grad, vmap_grad
from harness import Case, assert_close, check, run_hooked, sum_of_squares

REDUCTIONS = pytest.mark.parametrize("reduction", ["mean", "sum"])
BATCHES = st.sampled_from([0, 1, 3])
INSTANCE = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}
BATCH = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


def perturbed(module: nn.Module) -> nn.Module:
    """Non-trivial affine parameters and running statistics (the defaults are 1, 0, 0, 1)."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if t.is_floating_point():
                t.add_(0.3 * torch.rand_like(t))
    return module


@REDUCTIONS
@settings(max_examples=10)
@given(
    lead=st.lists(st.integers(1, 3), max_size=2),
    norm=st.lists(st.integers(1, 3), min_size=1, max_size=2),
    affine=st.booleans(),
    bias=st.booleans(),
    eps=st.sampled_from([1e-5, 0.1]),
    batch=BATCHES,
)
def test_layer_norm(reduction, lead, norm, affine, bias, eps, batch):
    if not affine:
        norm_layer = lambda: nn.Sequential(
            nn.Linear(norm[-1], norm[-1]), nn.LayerNorm(norm, eps, False)
        )  # noqa: E731
    else:
        norm_layer = lambda: perturbed(nn.LayerNorm(norm, eps, bias=bias))  # noqa: E731
    case = Case(
        f"LayerNorm({norm}, {eps}, {affine}, bias={bias})",
        norm_layer,
        lambda b: torch.randn(b, *lead, *norm),
    )
    check(case, batch=batch, reduction=reduction)


@REDUCTIONS
@settings(max_examples=10)
@given(
    lead=st.lists(st.integers(1, 3), max_size=2),
    norm=st.lists(st.integers(1, 3), min_size=1, max_size=2),
    eps=st.sampled_from([None, 1e-3]),
    batch=BATCHES,
)
def test_rms_norm(reduction, lead, norm, eps, batch):
    case = Case(
        f"RMSNorm({norm}, {eps})",
        lambda: perturbed(nn.RMSNorm(norm, eps)),
        lambda b: torch.randn(b, *lead, *norm),
    )
    check(case, batch=batch, reduction=reduction)


@REDUCTIONS
@settings(max_examples=10)
@given(
    groups=st.integers(1, 3),
    per_group=st.integers(1, 2),
    spatial=st.lists(st.integers(1, 3), max_size=3),
    batch=BATCHES,
)
def test_group_norm(reduction, groups, per_group, spatial, batch):
    assume(per_group * math.prod(spatial) > 1)  # torch refuses groups of one value
    channels = groups * per_group
    case = Case(
        f"GroupNorm({groups}, {channels}) on {spatial}",
        lambda: perturbed(nn.GroupNorm(groups, channels)),
        lambda b: torch.randn(b, channels, *spatial),
    )
    check(case, batch=batch, reduction=reduction)


@pytest.mark.parametrize(
    "make, x_shape",
    [
        (lambda: nn.LayerNorm(6), (5, 4, 6)),
        (lambda: nn.LayerNorm((3, 4)), (5, 3, 4)),
        (lambda: nn.GroupNorm(2, 4), (5, 4, 3, 3)),
        (lambda: nn.GroupNorm(4, 4), (5, 4, 7)),
    ],
    ids=["layer", "layer-2d", "group", "group-instance"],
)
@pytest.mark.parametrize("input_grad", [True, False], ids=["inner", "first-layer"])
def test_normalized_input_comes_from_the_saved_statistics(make, x_shape, input_grad, monkeypatch):
    """LayerNorm and GroupNorm take x̂ (GroupNorm: its sums with g) from the mean and 1/std
    their forward's node saved, not from a second normalization; grad1 equals the oracle's and
    the recomputed x̂'s."""
    from gradhooks.rules import norm as rules

    torch.manual_seed(0)
    layer = perturbed(make()).double()
    x = torch.randn(*x_shape, dtype=torch.float64, requires_grad=input_grad)
    want = vmap_grad(layer, sum_of_squares, x.detach())
    seen = []
    # GroupNorm takes its pieces from the statistics without forming x̂
    reader = (
        "_group_norm_from_statistics" if isinstance(layer, nn.GroupNorm) else "_from_statistics"
    )
    taken = getattr(rules, reader)

    def spy(call, x):
        seen.append(taken(call, x) is not None)
        return taken(call, x)

    monkeypatch.setattr(rules, reader, spy)
    got = {}
    for forced in (False, True):  # forced: as on a torch that shows nothing saved
        off = _torch.disabled("autograd_saved") if forced else contextlib.nullcontext()
        with off, gradhooks.add_hooks(layer, loss_reduction="sum"):
            sum_of_squares(layer(x)).backward()
        got[forced] = {n: p.grad1 for n, p in layer.named_parameters()}
        for p in layer.parameters():
            del p.grad1
    assert seen == [True, False], seen
    for name in want:
        assert_close(got[False][name], want[name], f"{name}: saved statistics vs vmap(grad)")
        assert_close(got[True][name], want[name], f"{name}: recomputed vs vmap(grad)")


def test_group_norm_statistics_on_a_channels_last_input(monkeypatch):
    """GroupNorm after a convolution, both channels_last: the pieces from the saved statistics
    (of the channels_last input) equal the oracle's."""
    from gradhooks.rules import norm as rules

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), perturbed(nn.GroupNorm(3, 6))).double()
    model = model.to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64).to(memory_format=torch.channels_last)
    want = vmap_grad(model, sum_of_squares, x)
    taken = []
    original = rules._group_norm_from_statistics
    monkeypatch.setattr(
        rules,
        "_group_norm_from_statistics",
        lambda call, x: taken.append(original(call, x)) or taken[-1],
    )
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sum_of_squares(model(x)).backward()
    assert len(taken) == 1 and taken[0] is not None
    for name, p in model.named_parameters():
        assert_close(p.grad1, want[name], f"channels_last: {name}")


def test_saved_statistics_are_not_used_for_another_input():
    """Under autocast to bfloat16 the node normalizes a cast copy of the input: no statistics
    are taken from it (the rule recomputes)."""
    from gradhooks.rules.norm import saved_statistics

    layer = nn.LayerNorm(6)
    x = torch.randn(3, 6, requires_grad=True)
    assert saved_statistics(layer, (x,), {}, layer(x)) is not None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x.bfloat16())
    assert saved_statistics(layer, (x,), {}, y) is None  # another tensor than the one saved
    assert saved_statistics(layer, (x,), {}, y.detach()) is None  # no node


@REDUCTIONS
@settings(max_examples=12)
@given(
    dims=st.sampled_from([1, 2, 3]),
    track=st.booleans(),
    train=st.booleans(),
    size=st.integers(2, 3),
    batch=st.sampled_from([1, 3]),  # torch's instance_norm fails on an empty batch
)
def test_instance_norm(reduction, dims, track, train, size, batch):
    def model():
        m = perturbed(INSTANCE[dims](3, affine=True, track_running_stats=track))
        return m.train(train)

    case = Case(
        f"InstanceNorm{dims}d(track={track}, train={train})",
        model,
        lambda b: torch.randn(b, 3, *(size,) * dims),
    )
    if not (track and train):
        check(case, batch=batch, reduction=reduction)
        return
    # Train mode updates the running statistics in place, which vmap refuses: compare with the
    # per-example loop, and with the same layer untracked (the same function in train mode).
    x = torch.randn(batch, 3, *(size,) * dims, dtype=torch.float64)
    tracked = model().double()
    untracked = INSTANCE[dims](3, affine=True).double()
    untracked.load_state_dict(tracked.state_dict(), strict=False)
    want = loop_grad(tracked, sum_of_squares, x)
    for m in (tracked, untracked):
        run_hooked(m, case, x, None, reduction)
        for name, p in m.named_parameters():
            assert_close(p.grad1, want[name], f"{case.id} vs loop, {name}")


@REDUCTIONS
@settings(max_examples=10)
@given(
    dims=st.sampled_from([1, 2, 3]),
    flat=st.booleans(),
    size=st.integers(1, 3),
    batch=BATCHES,
)
def test_batch_norm_eval(reduction, dims, flat, size, batch):
    spatial = () if dims == 1 and flat else (size,) * dims
    case = Case(
        f"BatchNorm{dims}d.eval() on {spatial}",
        lambda: perturbed(BATCH[dims](4)).eval(),
        lambda b: torch.randn(b, 4, *spatial),
    )
    check(case, batch=batch, reduction=reduction)


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize(
    "setup, why",
    [
        (lambda m: m.train(), "it is in train mode"),
        (lambda m: m.eval(), "track_running_stats=False, so it uses batch statistics even in eval"),
    ],
    ids=["train", "untracked-eval"],
)
def test_batch_norm_batch_statistics_are_an_error_at_forward(dims, setup, why):
    track = why == "it is in train mode"
    model = nn.Sequential(nn.Linear(5, 5))
    model.add_module("bn", BATCH[dims](5, track_running_stats=track))
    setup(model)
    x = torch.randn(2, 5, *(3,) * dims) if dims > 1 else torch.randn(2, 5)
    if dims > 1:
        model[0] = nn.Identity()
    with gradhooks.add_hooks(model):
        with pytest.raises(
            gradhooks.MixedExamplesError, match=f"'bn' \\(BatchNorm{dims}d\\)"
        ) as info:
            model(x)
        with torch.no_grad():
            model(x)  # not capturing: nothing to refuse
    message = str(info.value)
    for expected in (
        why,
        "per-example gradients do not exist",
        "nn.GroupNorm(num_groups, 5)",
        "model.eval()",
    ):
        assert expected in message, message


def test_frozen_batch_norm_in_train_mode_is_refused_too():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    model[1].requires_grad_(False)
    with gradhooks.add_hooks(model), pytest.raises(gradhooks.MixedExamplesError):
        model(torch.randn(4, 3))


@pytest.mark.parametrize("affine", [True, False], ids=["frozen_affine", "no_affine"])
def test_batch_norm_in_train_mode_behind_a_frozen_prefix_is_refused_naming_it(affine):
    """A frozen prefix and a BatchNorm in train mode (its parameters frozen, or none), before
    a trainable head: the head's rows in the batch are not the examples' own gradients (each
    example's loss, alone, as the per-example loop runs it, normalizes with other statistics,
    checked here), so the refusal stands, for the whole model; it names the BatchNorm (or the
    batch_norm it runs, where it has no parameters and so no hooks) and the remedies. In eval
    mode, ``grad1`` is the loop's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3, affine=affine), nn.Flatten(),
                          nn.Linear(12, 2)).double()  # fmt: skip
    model[:2].requires_grad_(False)
    x = torch.randn(4, 2, 2, 2, dtype=torch.float64)
    loss = lambda out, target=None: out.pow(2).sum()  # noqa: E731
    rows = [torch.autograd.grad(loss(model(x)[b]), model[3].weight)[0] for b in range(4)]
    alone = loop_grad(model, loss, x)["3.weight"]
    assert not torch.allclose(torch.stack(rows), alone), "the batch's rows are the loop's"
    with gradhooks.add_hooks(model), pytest.raises(gradhooks.MixedExamplesError) as info:
        model(x)
    names = ["'1' (BatchNorm2d)"] if affine else ["batch_norm (in train mode", "'3' (Linear)"]
    for part in [*names, "eval", "convert_batch_norm"]:
        assert part in str(info.value), (part, str(info.value))
    model.eval()
    want = loop_grad(model, loss, x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        loss(model(x)).backward()
    assert_close(model[3].weight.grad1, want["3.weight"], "3.weight in eval mode")


@REDUCTIONS
@settings(max_examples=10)
@given(
    shape=st.lists(st.integers(1, 3), max_size=3),
    per_channel=st.booleans(),
    batch=BATCHES,
)
def test_prelu(reduction, shape, per_channel, batch):
    num = shape[0] if per_channel and shape else 1
    case = Case(
        f"PReLU({num}) on {shape}",
        lambda: perturbed(nn.PReLU(num, init=-0.2)),
        lambda b: torch.randn(b, *shape),
    )
    check(case, batch=batch, reduction=reduction)


@pytest.mark.parametrize(
    "module, shape",
    [
        (nn.LayerNorm([3, 4]), (5, 2, 3, 4)),
        (nn.RMSNorm(4), (5, 3, 4)),
        (nn.GroupNorm(2, 4), (5, 4, 3)),
        (nn.InstanceNorm1d(3, affine=True), (5, 3, 4)),
        (nn.InstanceNorm2d(3, affine=True, track_running_stats=True).eval(), (5, 3, 2, 2)),
        (nn.InstanceNorm3d(3, affine=True), (5, 3, 2, 2, 2)),
        (nn.BatchNorm1d(3).eval(), (5, 3)),
        (nn.BatchNorm2d(3).eval(), (5, 3, 2, 2)),
        (nn.BatchNorm3d(3).eval(), (5, 3, 2, 2, 2)),
        (nn.PReLU(3), (5, 3, 4)),
        (nn.PReLU(), (5,)),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else str(v),
)
def test_check_rule(module, shape):
    assert gradhooks.check_rule(perturbed(module), torch.randn(*shape)).ok


# -- x̂ times the output-gradient in place, and out of place where that is wrong ----------------
# The normalization rules multiply ``x̂`` by the output-gradient in ``x̂``'s own memory in a
# plain backward, and out of place where that would be wrong: a ``create_graph`` backward (grad1
# gets a graph) and under ``vmap`` (the Jacobians). Plain backwards and the Jacobians are checked
# for every norm layer above and in test_quantities.py; here, differentiating through grad1
# against torch.func, in float64.

D = torch.float64


def _sq(out):
    return 0.5 * out.pow(2).sum()


@pytest.mark.parametrize(
    "norm, shape",
    [(lambda: nn.LayerNorm(4), (3, 4)), (lambda: nn.GroupNorm(2, 4), (4, 3))],
    ids=["layer_norm", "group_norm"],
)
def test_differentiate_through_grad1_of_norm_layers(norm, shape):
    torch.manual_seed(0)
    model = nn.Sequential(norm(), nn.Tanh(), nn.Flatten(), nn.Linear(12, 2)).to(D)
    with torch.no_grad():  # not the default ones and zeros: every term counts
        model[0].weight.normal_()
        model[0].bias.normal_()
    x = torch.randn(5, *shape, dtype=D)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())

    def objective(ps):
        def one(ps, xi):
            return _sq(functional_call(model, ps, (xi[None],)))

        per_example = vmap(grad(one), in_dims=(None, 0))(ps, x)
        return sum(g.pow(2).sum() for g in per_example.values())

    want = grad(objective)({n: p.detach() for n, p in model.named_parameters()})
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        torch.autograd.grad(_sq(model(x)), params, create_graph=True)
        value = sum(p.grad1.pow(2).sum() for p in params)
        with h.paused():
            got = torch.autograd.grad(value, params)
    for n, g in zip(names, got, strict=True):
        assert_close(g, want[n], f"d Σ‖grad1‖² / d {n}")

"""Mistakes with the per-example quantities themselves, a fourth set: quantities read at the
wrong moment or mended the wrong way (``h.rescale`` after a loss of the other reduction),
autograd driven otherwise than by one ``backward()`` (a weighted ``backward(gradient=...)``,
a module the loss never reaches), the model changed between the forward and its backward (a
parameter frozen, a layer replaced, weights written in place, an optimizer's step), batches
that are wrong (labels of another size, no examples, a NaN in one example, a target that
broadcasts) and DP steps given their losses in another order or in pieces. Each gives the
documented meaning, compared in float64 with each example's own gradient by the per-example
loop (:func:`gradhooks.oracle.loop_grad`), or stops with the typed error of its kind, whose
message says what is wrong and what to do, leaving the parameters, ``.grad``, ``grad1`` and
the hooks as they were (``tests/test_misuse.py``, ``tests/test_misuse_api.py`` and
``tests/test_misuse_loops.py`` hold the earlier sets)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_untouched, labelled_batch, mlp, model_state, raised

RTOL, ATOL = 1e-9, 1e-12  # float64 throughout


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, equal_nan=True, msg=what)


def assert_grad1(model: nn.Module, want: dict, what: str, scale: float = 1.0) -> None:
    """Every parameter ``want`` names has ``grad1 == scale * want``."""
    for name, p in model.named_parameters():
        if name in want:
            close(p.grad1, scale * want[name], f"{what}: {name}")


def loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Each example's own gradient of ``F.cross_entropy``, by the float64 loop."""
    return loop_grad(model, F.cross_entropy, (x,), y)


def flat_norms(want: dict) -> torch.Tensor:
    return torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)


def trains(model: nn.Module) -> None:
    """A plain SGD step on a fresh batch lowers its loss (the model works without gradhooks)."""
    x, y = labelled_batch(7)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    assert F.cross_entropy(model(x), y) < loss, "the model no longer trains"


# -- quantities mended with rescale ---------------------------------------------------------------


def _quantities(h: gradhooks.Hooks, quantity: str) -> dict[str, torch.Tensor]:
    """What the handle gives of ``quantity``, by name."""
    if quantity == "norms":
        return {"norms": h.norms(), **h.param_norms()}
    if quantity == "sum_grad_sq":
        variance = {f"{n} variance": v for n, v in h.grad_variance().items()}
        scale = h.noise_scale()
        noise = {"trace": scale.trace, "grad_sq": scale.grad_sq, "simple": scale.simple}
        return {**h.sum_grad_sq(), **variance, **noise}
    return {n: f.G for n, f in h.kfac_factors("sum").items()}


@pytest.mark.parametrize("quantity", ["norms", "sum_grad_sq", "kfac"])
@pytest.mark.parametrize("loss", ["sum", "mean"])
def test_rescale_after_a_loss_of_the_other_reduction_rescales_every_quantity(loss, quantity):
    """A summed loss under the default ``loss_reduction="mean"`` (or a mean under ``"sum"``),
    mended as ``h.check`` says, by ``h.rescale(...)``: only ``grad1`` was rescaled. The norms
    stayed ``batch`` times too large (or small), the squared sums, the variance and K-FAC's
    ``G`` ``batch²`` times, with nothing to say so. Now every quantity is that of a handle
    hooked with the right reduction from the start (the norms, squared sums and variance the
    loop's)."""
    other = "mean" if loss == "sum" else "sum"
    x, y = labelled_batch(1)
    quantities = ("grad1", quantity)
    right = mlp()
    with gradhooks.add_hooks(right, quantities=quantities, loss_reduction=loss) as h:
        F.cross_entropy(right(x), y, reduction=loss).backward()
        want = _quantities(h, quantity)
    model = mlp()
    with gradhooks.add_hooks(model, quantities=quantities, loss_reduction=other) as h:
        F.cross_entropy(model(x), y, reduction=loss).backward()
        h.rescale(loss)
        got = _quantities(h, quantity)
        own = loop(model, x, y)
        assert_grad1(model, own, "rescaled")
    assert got.keys() == want.keys()
    for name in want:
        close(got[name], want[name], f"{quantity} {name}")
    if quantity == "norms":
        close(got["norms"], flat_norms(own), "norms against the loop")


@pytest.mark.parametrize("read_before", [False, True], ids=["unread", "read-before"])
def test_rescale_of_a_variance_whose_mean_is_formed_when_asked(read_before):
    """Layers of 16 by 16 over 4 examples, whose gradient mean the variance forms only when
    asked (from the inputs and output-gradients kept): ``h.rescale("sum")`` after the summed
    loss, the variance read before it or not, gives the loop's variance either way."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)).double()
    x, y = labelled_batch(4, n=4, features=16, classes=16)
    want = loop(model, x, y)
    with gradhooks.add_hooks(model, quantities=("sum_grad_sq",)) as h:
        F.cross_entropy(model(x), y, reduction="sum").backward()
        if read_before:
            h.grad_variance()
        h.rescale("sum")
        got = h.grad_variance()
    for name, g in want.items():
        close(got[name], g.var(0, unbiased=False), name)


def test_rescale_of_kfac_factors_over_batches_of_two_sizes_is_refused():
    """Two micro-batches of 5 and 3 examples summed into K-FAC's ``G``, each scaled by its own
    batch: no one factor rescales them, so ``h.rescale`` is refused, naming the weights and
    what to do, with the factors and the setting left as they were."""
    model = mlp()
    with gradhooks.add_hooks(model, quantities=("kfac",)) as h:
        for n in (5, 3):
            x, y = labelled_batch(n, n=n)
            F.cross_entropy(model(x), y, reduction="sum").backward()
        before = {n: f.G.clone() for n, f in h.kfac_factors("sum").items()}
        raised(
            gradhooks.StateError,
            [
                "K-FAC factors of",
                "'0.weight'",
                "'2.weight'",
                "batches of different sizes",
                "clear()",
            ],
            lambda: h.rescale("sum"),
        )
        assert h.loss_reduction == "mean"
        for n, f in h.kfac_factors("sum").items():
            assert torch.equal(f.G, before[n]), n


# -- reading quantities at the wrong moment ------------------------------------------------------


def test_grad1_read_after_the_optimizer_step_is_of_the_forward_weights():
    """``optimizer.step()`` first, ``grad1`` read after (to log it): it is, as ``.grad`` is,
    the gradient at the weights the forward ran with, not at the stepped ones."""
    model = mlp()
    x, y = labelled_batch(1)
    want = loop(model, x, y)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        assert_grad1(model, want, "after the step")
        for name, p in model.named_parameters():
            close(p.grad1.mean(0), p.grad, name)


def test_grad1_read_after_a_forward_without_its_backward_is_the_last_backwards():
    """A forward of another batch (of 7) with grad on and no backward (a logged prediction)
    before ``grad1`` is read: ``grad1`` is still the last backward's 5 examples; the next
    backward, of the 7, gives theirs."""
    model = mlp()
    (x, y), (x7, y7) = labelled_batch(1), labelled_batch(2, n=7)
    with gradhooks.add_hooks(model) as h:
        F.cross_entropy(model(x), y).backward()
        model(x7)
        assert_grad1(model, loop(model, x, y), "after the forward")
        model.zero_grad()
        F.cross_entropy(model(x7), y7).backward()
        assert_grad1(model, loop(model, x7, y7), "the next step")
        assert h.accumulated == 1


def test_quantities_read_after_clear_are_refused_and_grad1_waits_for_the_next_backward():
    """``h.clear()`` and then the norms read (a logger after the loop's reset): refused with a
    ``StateError`` rather than the norms of a batch cleared; ``grad1`` stays readable until the
    next backward, which replaces it rather than adding to it, though ``.grad`` adds up."""
    model = mlp()
    (x, y), (x2, y2) = labelled_batch(1), labelled_batch(2)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        F.cross_entropy(model(x), y).backward()
        h.clear()
        before = model_state(model)
        raised(gradhooks.StateError, "no backward has been captured", h.norms)
        assert_untouched(model, before)
        F.cross_entropy(model(x2), y2).backward()
        want = loop(model, x2, y2)
        assert_grad1(model, want, "after clear")
        close(h.norms(), flat_norms(want), "norms after clear")


def test_grad1_read_after_zero_grad_is_reported_stale_by_check():
    """``model.zero_grad()`` and then ``grad1`` read before the next backward: ``.grad`` is
    gone, ``grad1`` still holds the last backward's (as documented, until the next backward);
    ``h.check()`` says it is of an earlier backward rather than passing it."""
    model = mlp()
    x, y = labelled_batch(1)
    with gradhooks.add_hooks(model) as h:
        F.cross_entropy(model(x), y).backward()
        model.zero_grad()
        report = h.check(raise_on_error=False)
    assert not report.ok
    assert any("grad1 is of an earlier backward" in p for p in report.problems), report


def test_a_parameter_frozen_between_the_forward_and_the_backward_has_no_grad1():
    """``requires_grad_(False)`` on a weight after the loss is computed (a schedule that
    freezes it at this step): autograd leaves its ``.grad`` ``None``, and gradhooks its
    ``grad1`` absent; the others are the loop's."""
    model = mlp()
    x, y = labelled_batch(1)
    want = loop(model, x, y)
    with gradhooks.add_hooks(model):
        loss = F.cross_entropy(model(x), y)
        model[0].weight.requires_grad_(False)
        loss.backward()
    assert model[0].weight.grad is None and "grad1" not in model[0].weight.__dict__
    del want["0.weight"]
    assert_grad1(model, want, "frozen after the forward")


# -- autograd driven otherwise ----------------------------------------------------------------------


def test_per_example_weights_given_as_the_backwards_gradient():
    """``losses.backward(gradient=w)`` on the ``reduction="none"`` losses (importance weights
    put in the gradient instead of the loss), hooked with ``loss_reduction="sum"``: row ``i``
    of ``grad1`` is ``w_i`` times example ``i``'s own gradient, a zero weight a zero row, and
    ``grad1`` sums to ``.grad``."""
    model = mlp()
    x, y = labelled_batch(1)
    w = torch.tensor([1.0, 2.0, 0.0, 0.5, 3.0], dtype=torch.float64)
    want = loop(model, x, y)
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        F.cross_entropy(model(x), y, reduction="none").backward(gradient=w)
        assert not h.check().problems
    for name, p in model.named_parameters():
        close(p.grad1, w.view(-1, *[1] * p.dim()) * want[name], name)
        assert not p.grad1[2].any(), name


class TwoHeads(nn.Module):
    """A trunk and two heads, both computed at every forward (3 -> 4 -> 2 each)."""

    def __init__(self):
        super().__init__()
        self.trunk, self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return self.a(h), self.b(h)


def test_a_head_the_loss_does_not_reach_gets_no_quantities():
    """Both heads run, the loss takes one (the other logged): the unused head's parameters get
    neither ``.grad`` nor ``grad1``, the whole-model norms are those of the parameters the loss
    reaches (the loop's), and the next step's loss of the other head gives it its own."""
    torch.manual_seed(0)
    model = TwoHeads().double()
    x, y = labelled_batch(1)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        F.cross_entropy(model(x)[0], y).backward()
        for p in model.b.parameters():
            assert p.grad is None and "grad1" not in p.__dict__
        want = loop_grad(model, lambda out, t: F.cross_entropy(out[0], t), (x,), y)
        reached = {n: v for n, v in want.items() if not n.startswith("b.")}
        assert_grad1(model, reached, "head a")
        close(h.norms(), flat_norms(reached), "norms")
        model.zero_grad()
        F.cross_entropy(model(x)[1], y).backward()
        want = loop_grad(model, lambda out, t: F.cross_entropy(out[1], t), (x,), y)
        assert_grad1(model, {n: v for n, v in want.items() if not n.startswith("a.")}, "head b")
        for p in model.a.parameters():
            assert "grad1" not in p.__dict__


# -- the model changed between the forward and its backward -------------------------------------


class Scale(nn.Module):
    """``x * w + b`` over 5 features, with parameters of its own: no rule, so the fallback's."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 5, dtype=torch.float64))
        self.b = nn.Parameter(torch.linspace(-0.2, 0.2, 5, dtype=torch.float64))

    def forward(self, x):
        return x * self.w + self.b


def _with_scale() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), Scale(), nn.Linear(5, 2)).double()


def test_weights_written_in_place_that_autograd_does_not_keep():
    """``with torch.no_grad(): w.mul_(0.5)`` between the forward and the backward on weights
    autograd does not keep for the backward (the first layer's weight, the biases, one of a
    layer without a rule, whose fallback recomputes the call): autograd's ``.grad`` is that of
    the forward as it ran, and so is ``grad1``, the fallback's included."""
    model = _with_scale()
    x, y = labelled_batch(1)
    want = loop(copy.deepcopy(model), x, y)
    with gradhooks.add_hooks(model) as h:
        loss = F.cross_entropy(model(x), y)
        with torch.no_grad():
            for p in (model[0].weight, model[0].bias, model[2].b, model[3].bias):
                p.mul_(0.5)
        loss.backward()
        assert not h.check().problems
    assert_grad1(model, want, "weights halved after the forward")


def test_a_step_on_another_loss_between_the_forward_and_the_backward_keeps_torchs_error():
    """A GAN-like slip: the optimizer steps on another loss (capture paused) between this
    forward and its backward. Autograd refuses the backward (a weight it kept was changed in
    place); that stays torch's own error, not a gradhooks one. The ``grad1`` the backward
    wrote before it failed (the last layer's) is dropped at the next forward, whose step's
    ``grad1`` is the loop's, and the model trains on without the hooks."""
    model = mlp()
    (x, y), (x2, y2) = labelled_batch(1), labelled_batch(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with gradhooks.add_hooks(model) as h:
        loss = F.cross_entropy(model(x), y)
        with h.paused():
            F.cross_entropy(model(x2), y2).backward()
            opt.step()
        opt.zero_grad()
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
            loss.backward()
        assert not isinstance(info.value, gradhooks.GradhooksError)
        assert all(p.grad is None for p in model.parameters())
        out = model(x)  # (the next forward drops what the failed backward wrote)
        assert all("grad1" not in p.__dict__ for p in model.parameters())
        F.cross_entropy(out, y).backward()
        assert_grad1(model, loop(model, x, y), "the next step")
    trains(model)


def test_a_layer_replaced_between_the_forward_and_the_backward():
    """``model[2] = nn.Linear(...)`` after the loss (a head swapped mid-step): the backward
    reaches the replaced layer's parameters, which get their ``grad1``, the new layer's none;
    at the next step the new layer is captured as any other, against the loop."""
    model = mlp()
    x, y = labelled_batch(1)
    with gradhooks.add_hooks(model):
        loss = F.cross_entropy(model(x), y)
        old = model[2]
        want = loop(model, x, y)
        model[2] = nn.Linear(5, 2).double()
        loss.backward()
        close(old.weight.grad1, want["2.weight"], "the replaced layer")
        assert model[2].weight.grad is None and "grad1" not in model[2].weight.__dict__
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        assert_grad1(model, loop(model, x, y), "the new layer's step")


@pytest.mark.parametrize("name", ["weight", "bias"])
def test_a_parameter_replaced_between_the_forward_and_the_backward(name):
    """``layer.weight = nn.Parameter(...)`` after the loss (weights loaded into the layer
    mid-step): autograd gives the gradient to the parameter the forward used, and gradhooks
    its ``grad1`` with it (the loop's); the new parameter, which no call used yet, gets
    neither."""
    model = mlp()
    x, y = labelled_batch(1)
    want = loop(model, x, y)
    with gradhooks.add_hooks(model):
        loss = F.cross_entropy(model(x), y)
        old = getattr(model[2], name)
        setattr(model[2], name, nn.Parameter(old.detach() * 2))
        loss.backward()
    close(old.grad1, want[f"2.{name}"], "the parameter the forward used")
    new = getattr(model[2], name)
    assert new.grad is None and "grad1" not in new.__dict__
    assert_grad1(model, {n: v for n, v in want.items() if n != f"2.{name}"}, "the others")


def test_hooks_added_again_between_the_forward_and_the_backward():
    """``add_hooks`` called again on the model after its forward (a helper that hooks what it
    is given): refused with a ``StateError`` naming the existing handle, with nothing changed;
    the pending backward is still captured by the first handle, right."""
    model = mlp()
    x, y = labelled_batch(1)
    with gradhooks.add_hooks(model):
        loss = F.cross_entropy(model(x), y)
        before = model_state(model)
        raised(
            gradhooks.StateError,
            ["Sequential already has gradhooks hooks", "remove_hooks(model) first"],
            lambda: gradhooks.add_hooks(model),
        )
        assert_untouched(model, before)
        loss.backward()
        assert_grad1(model, loop(model, x, y), "after the refusal")


# -- batches that are wrong ------------------------------------------------------------------------


def test_labels_of_another_batch_size_keep_torchs_error_and_capture_nothing():
    """Labels of 4 for a batch of 5 (a loader that drops one label): ``F.cross_entropy``
    raises its own ``ValueError`` before any backward; no ``grad1`` is written, and the
    backward with the right labels afterwards, of the same forward, is the loop's."""
    model = mlp()
    x, y = labelled_batch(1)
    with gradhooks.add_hooks(model):
        out = model(x)
        with pytest.raises(ValueError, match="batch_size"):
            F.cross_entropy(out, y[:4])
        assert all("grad1" not in p.__dict__ for p in model.parameters())
        F.cross_entropy(out, y).backward()
        assert_grad1(model, loop(model, x, y), "the right labels")


def test_an_empty_batch_with_a_mean_loss():
    """A batch of no examples (a filtered loader's) whose mean loss is NaN: ``.grad`` is
    zeros, ``grad1`` has no rows (``[0, *shape]``) and the norms none, with no NaN anywhere,
    and the next batch is the loop's."""
    model = mlp()
    x, y = labelled_batch(1)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        loss = F.cross_entropy(model(x[:0]), y[:0])
        assert loss.isnan()
        loss.backward()
        for name, p in model.named_parameters():
            assert p.grad1.shape == (0, *p.shape), name
            assert not p.grad.any(), name
        assert h.norms().shape == (0,)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        assert_grad1(model, loop(model, x, y), "the next batch")


class Family(nn.Module):
    """A layer family after a Linear, over ``[batch, 6, 3]`` inputs, to 2 logits."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(3, 4)
        self.layer = {
            "conv": lambda: nn.Conv1d(4, 4, 3, padding=1),
            "layer_norm": lambda: nn.LayerNorm(4),
            "group_norm": lambda: nn.GroupNorm(2, 4),
            "attention": lambda: nn.MultiheadAttention(4, 2, batch_first=True),
            "lstm": lambda: nn.LSTM(4, 4, batch_first=True),
        }[kind]()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.lin(x))  # [batch, 6, 4]
        if self.kind == "conv":
            h = self.layer(h.transpose(1, 2)).transpose(1, 2)
        elif self.kind == "group_norm":
            h = self.layer(h.transpose(1, 2)).transpose(1, 2)
        elif self.kind == "attention":
            h = self.layer(h, h, h, need_weights=False)[0]
        elif self.kind == "lstm":
            h = self.layer(h)[0]
        else:
            h = self.layer(h)
        return self.head(h).mean(1)


@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("kind", ["conv", "layer_norm", "group_norm", "attention", "lstm"])
def test_a_non_finite_entry_in_one_example_stays_with_that_example(kind, bad):
    """One entry of one example's input NaN or Inf (a corrupt record), through a convolution,
    a norm layer, attention or an LSTM: the other examples' ``grad1`` and norms are the loop's,
    finite, and the corrupt example's are the loop's too, NaN where the loop's are. Nothing
    of it leaks across the batch (the norms' Gram forms, the LSTM's fused pieces)."""
    torch.manual_seed(0)
    model = Family(kind).double()
    x, y = labelled_batch(3, n=4)
    x = x[:, None, :].expand(4, 6, 3) * torch.linspace(0.5, 1.5, 6, dtype=torch.float64)[:, None]
    x = x.contiguous()
    x[2, 1, 1] = float(bad)
    want = loop(model, x, y)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms"), loss_reduction="sum") as h:
        F.cross_entropy(model(x), y, reduction="sum").backward()
        norms = h.norms()
    assert_grad1(model, want, f"{bad} in example 2")
    close(norms, flat_norms(want), "norms")
    assert torch.isfinite(norms[[0, 1, 3]]).all()
    assert not torch.isfinite(norms[2])


def test_a_target_that_broadcasts_over_the_batch_is_told_by_check():
    """``F.mse_loss`` of outputs ``[batch, 1]`` against targets ``[batch]`` (a squeeze
    forgotten): torch broadcasts them to ``[batch, batch]`` and only warns; every example's
    output meets every target, so ``grad1`` is not each example's own gradient.
    ``h.check`` with the loss says so, where the hooks alone cannot see it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1)).double()
    x, _ = labelled_batch(1)
    t = torch.linspace(-1, 1, 5, dtype=torch.float64)
    with gradhooks.add_hooks(model) as h:
        with pytest.warns(UserWarning, match="target size"):
            F.mse_loss(model(x), t).backward()
        with pytest.warns(UserWarning, match="target size"):
            report = h.check(F.mse_loss, x, t, raise_on_error=False)
    assert not report.ok
    assert any("is not their own gradient" in p for p in report.problems), report


# -- DP steps given their losses otherwise --------------------------------------------------------


def _dp_losses(model: nn.Module, x, y) -> torch.Tensor:
    return F.cross_entropy(model(x), y, reduction="none")


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_dp_step_of_losses_out_of_the_examples_order_is_refused_at_its_check(method):
    """``losses.flip(0)`` (or sorted, for a curriculum) given to ``dp_sgd_step``: entry ``i``
    is not example ``i``'s loss. The step's check refuses it, naming the order among the
    causes, with nothing written."""
    model = mlp()
    x, y = labelled_batch(1)
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        losses = _dp_losses(model, x, y).flip(0)
        before = model_state(model)
        raised(
            gradhooks.CheckFailedError,
            ["not in the order of the forward's examples", "no gradient was written"],
            lambda: gradhooks.dp_sgd_step(
                h, losses, max_norm=0.3, noise_multiplier=0.0, method=method
            ),
        )
        assert_untouched(model, before)


@pytest.mark.xfail(
    strict=True,
    reason="ghost clipping weights entry i of per_example_loss with the clipping factor of "
    "row i of the forward; losses out of the rows' order are refused only on the steps the "
    "check runs (the 1st, 2nd, 4th...), and between them each example is clipped with "
    "another's factor. Telling the order without the check's extra backward would take the "
    "tracker following the losses past the model's forward",
)
def test_ghost_dp_step_of_losses_out_of_order_between_the_checked_steps():
    """The third step, which the check skips, on flipped losses: each example's gradient
    should be clipped by its own factor (what the loop gives), and is clipped by another's."""
    model = mlp()
    x, y = labelled_batch(1)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        for _ in range(2):
            gradhooks.dp_sgd_step(
                h, _dp_losses(model, x, y), max_norm=0.3, noise_multiplier=0.0, method="ghost"
            )
        want = loop(model, x, y)
        factors = (0.3 / flat_norms(want)).clamp(max=1)
        flipped = _dp_losses(model, x, y).flip(0)
        try:
            gradhooks.dp_sgd_step(
                h, flipped, max_norm=0.3, noise_multiplier=0.0, method="ghost", reduction="sum"
            )
        except gradhooks.CheckFailedError:
            return  # (refused: what the fix would do)
    for name, p in model.named_parameters():
        clipped = (factors.view(-1, *[1] * p.dim()) * want[name]).sum(0)
        close(p.grad, clipped, name)


def test_dp_step_of_losses_of_two_forwards_of_the_batch_in_halves():
    """The batch run through the model in two halves (for memory) and the two halves' losses
    concatenated for one ``dp_sgd_step``: the step would take row ``i`` of each half for the
    same example. Refused with a ``MixedExamplesError`` that says to run the whole batch or
    one backward per half, with nothing written."""
    model = mlp()
    x, y = labelled_batch(1)
    with gradhooks.add_hooks(model, quantities=("grad1",)) as h:
        losses = torch.cat([_dp_losses(model, x[:3], y[:3]), _dp_losses(model, x[3:], y[3:])])
        before = model_state(model)
        raised(
            gradhooks.MixedExamplesError,
            ["two forwards of the model on other examples", "Run the model on the whole batch"],
            lambda: gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=0.0),
        )
        assert_untouched(model, before)


def test_dp_step_after_grad1_changed_in_place_by_hand():
    """A plain backward, its ``grad1`` clipped by hand in place (a DIY clipping tried
    first), then ``dp_sgd_step`` on the next batch without ``zero_grad``: the step's norms and
    clipped sum are of the new batch alone, as the loop gives them, and its ``grad1`` too."""
    model = mlp()
    (x, y), (x2, y2) = labelled_batch(1), labelled_batch(2)
    with gradhooks.add_hooks(model, quantities=("grad1",)) as h:
        F.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            p.grad1.mul_(0.1)
        norms = gradhooks.dp_sgd_step(
            h, _dp_losses(model, x2, y2), max_norm=0.3, noise_multiplier=0.0
        )
    want = loop(model, x2, y2)
    close(norms, flat_norms(want), "norms")
    factors = (0.3 / flat_norms(want)).clamp(max=1)
    for name, p in model.named_parameters():
        close(p.grad, (factors.view(-1, *[1] * p.dim()) * want[name]).mean(0), name)
    assert_grad1(model, want, "the step's grad1")


def test_dp_steps_with_a_generator_seeded_anew_at_every_step_warn():
    """``generator=torch.Generator().manual_seed(0)`` written inside the loop: every step
    draws the same noise, so the difference of two steps' gradients is noise-free. The second
    such step warns (once), naming the remedy; a generator made once before the loop, or
    none, does not."""
    (x, y), (x2, y2) = labelled_batch(1), labelled_batch(2)

    def step(h, model, xb, yb, generator):
        model.zero_grad(set_to_none=True)  # (the last step's .grad let go of, as a loop does)
        losses = _dp_losses(model, xb, yb)
        gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=1.0, generator=generator)
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    model = mlp()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        with pytest.warns(gradhooks.GradhooksWarning, match="Make the generator once") as seen:
            steps = [
                step(h, model, xb, yb, torch.Generator().manual_seed(0))
                for xb, yb in [(x, y), (x2, y2), (x, y)]
            ]
    assert sum("Make the generator once" in str(w.message) for w in seen) == 1
    for name in steps[0]:  # (the same batch again: the same noise, not drawn anew)
        assert torch.equal(steps[0][name], steps[2][name]), name
    model = mlp()
    once = torch.Generator().manual_seed(0)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h, warnings.catch_warnings():
        warnings.simplefilter("error", gradhooks.GradhooksWarning)
        for xb, yb in [(x, y), (x, y), (x2, y2)]:
            step(h, model, xb, yb, once)
            step(h, model, xb, yb, None)

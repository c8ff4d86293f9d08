"""More training-loop idioms, each step checked against the float64 per-example loop.

Adversarial training (an attack's backward to the input with the hooks on, then the training
backward; TRADES' two forwards of one batch in one loss; "free" adversarial training),
backwards with explicit gradients, losses that couple the examples (what ``grad1`` then holds,
what :meth:`gradhooks.Hooks.check` says, and the DP steps that refuse them), MixUp, CutMix,
R-Drop and distillation, pure half precision, and loops that change the model or its
parameters' hooks between steps. Each compares ``grad1`` with
:func:`gradhooks.oracle.loop_grad` (or a loop written out where each example is more than one
row), within a stated tolerance in half precision, or checks that a misuse stops with an error
that says what to do and leaves the model as it was.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
import harness
from gradhooks.oracle import loop_grad
from harness import assert_close

# (every check here also asks that a frozen parameter has no grad1)
assert_grad1 = functools.partial(harness.assert_grad1, frozen_clean=True)

D = torch.float64


def mlp(dtype: torch.dtype = D) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).to(dtype)


def batch(seed: int, n: int = 4, dtype: torch.dtype = D):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g, dtype=dtype), torch.randint(2, (n,), generator=g)


def prefixed(want: dict, prefix: str) -> dict:
    """The loop's gradients of a wrapper's ``prefix.*`` parameters, by the wrapped names."""
    return {n.removeprefix(prefix): g for n, g in want.items() if n.startswith(prefix)}


class Pair(nn.Module):
    """One example as two rows (a clean and a perturbed input, two views, two masks): the
    model run on each, for the per-example loop."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, a, b):
        return self.m(a), self.m(b)


# -- adversarial training ------------------------------------------------------------------------


def test_fgsm_by_autograd_grad_on_the_input_in_eval_mode_then_the_training_step():
    """advertorch's ``perturb``: ``model.eval()``, ``torch.autograd.grad(loss, x_adv)`` with the
    hooks on (no ``zero_grad`` around it), ``x + eps * sign``, ``model.train()``, the training
    backward: grad1 is the adversarial batch's own, nothing of the attack's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Dropout(0.0), nn.Tanh(), nn.Linear(5, 2)).to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step)
            model.eval()
            xa = x.clone().requires_grad_(True)
            (gx,) = torch.autograd.grad(F.cross_entropy(model(xa), y), xa)
            xa = (x + 0.1 * gx.sign()).detach()
            model.train()
            opt.zero_grad()
            F.cross_entropy(model(xa), y).backward()
            assert_grad1(model, loop_grad(model, F.cross_entropy, xa, y), f"step {step}")
            opt.step()


def test_pgd_steps_by_backward_with_inputs_of_the_perturbed_batch_leave_grad1_and_norms():
    """An attack whose steps call ``loss.backward(inputs=[x_adv])`` after the training
    backward (the adversarial batch scored for logging, no ``zero_grad``): they compute no
    parameter's gradient, so grad1 and the norms stay the training backward's."""
    model = mlp()
    x, y = batch(0)
    with gradhooks.add_hooks(model, quantities=("grad1", "norms")) as h:
        F.cross_entropy(model(x), y).backward()
        want = loop_grad(model, F.cross_entropy, x, y)
        norms = torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)
        xa = x.clone().requires_grad_(True)
        for _ in range(2):
            F.cross_entropy(model(xa), y).backward(inputs=[xa])
            with torch.no_grad():
                xa += 0.1 * xa.grad.sign()
            xa.grad = None
        assert_grad1(model, want, "after the attack")
        assert_close(h.norms(), norms, "norms after the attack")


def test_free_adversarial_training_one_backward_for_the_weights_and_the_input():
    """Shafahi et al.'s "free" adversarial training: each minibatch replayed ``m`` times, one
    backward giving both the parameters' gradients (an optimizer step) and the perturbation's
    (``delta += eps * delta.grad.sign()``), the perturbation carried to the next batch: each
    replay's grad1 is of its own batch ``x + delta``."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    delta = torch.zeros(4, 3, dtype=D)
    with gradhooks.add_hooks(model):
        for step in range(2):
            x, y = batch(step)
            for replay in range(2):
                d = delta.clone().requires_grad_(True)
                xa = x + d
                opt.zero_grad()
                F.cross_entropy(model(xa), y).backward()
                want = loop_grad(model, F.cross_entropy, xa.detach(), y)
                assert_grad1(model, want, f"step {step}, replay {replay}")
                opt.step()
                delta = (delta + 0.05 * d.grad.sign()).clamp(-0.1, 0.1)


def trades_loss(beta: float):
    """TRADES: the clean examples' cross-entropy plus ``beta`` times the KL divergence from
    each example's clean prediction to its adversarial one (a batch mean, as TRADES writes
    it: ``batchmean``)."""

    def loss(outs, y):
        clean, adv = outs
        kl = F.kl_div(F.log_softmax(adv, 1), F.softmax(clean, 1), reduction="batchmean")
        return F.cross_entropy(clean, y) + beta * kl

    return loss


def test_trades_two_forwards_of_one_batch_in_one_loss():
    """TRADES (Zhang et al.): the attack maximises the KL from the clean prediction (detached)
    by ``torch.autograd.grad`` on the input, with the hooks on; the training loss then runs the
    model on the clean and on the adversarial batch and couples each example's two rows. grad1
    holds each example's gradient through both of its forwards: example ``i``'s loss is a
    function of ``(x_i, x_adv_i)`` alone."""
    model = mlp()
    loss = trades_loss(beta=6.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step)
            with torch.no_grad():
                target = F.softmax(model(x), 1)
            xa = (x + 0.01 * torch.randn_like(x)).requires_grad_(True)
            kl = F.kl_div(F.log_softmax(model(xa), 1), target, reduction="sum")
            (gx,) = torch.autograd.grad(kl, xa)
            xa = (xa + 0.1 * gx.sign()).detach()
            opt.zero_grad()
            loss((model(x), model(xa)), y).backward()
            want = prefixed(loop_grad(Pair(model), loss, (x, xa), y), "m.")
            assert_grad1(model, want, f"step {step}")
            opt.step()


def trades_rows(outs, y):
    """TRADES' loss, each example's own: ``[batch]``."""
    clean, adv = outs
    kl = F.kl_div(F.log_softmax(adv, 1), F.softmax(clean, 1), reduction="none").sum(1)
    return F.cross_entropy(clean, y, reduction="none") + 6.0 * kl


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_trades_losses_into_the_dp_step(method):
    """DP adversarial training: TRADES' ``[batch]`` losses, each from the example's clean and
    adversarial forwards, into ``dp_sgd_step`` (noise 0): ``.grad`` is the mean of the
    examples' gradients through both forwards, each clipped to ``C`` as a whole, by every
    method (the ghost and book-keeping norms of a layer called twice include the cross
    terms of its two calls)."""
    x, y = batch(3, n=5)
    xa = x + 0.1 * torch.randn(5, 3, dtype=D, generator=torch.Generator().manual_seed(4))
    model = mlp()
    want = prefixed(loop_grad(Pair(model), lambda o, t: trades_rows(o, t).sum(), (x, xa), y), "m.")
    norms = torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)
    factor = (0.5 / norms).clamp(max=1.0)
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        got = gradhooks.dp_sgd_step(
            h, trades_rows((model(x), model(xa)), y), max_norm=0.5, noise_multiplier=0.0,
            method=method,
        )  # fmt: skip
    assert_close(got, norms, "norms")
    for n, p in model.named_parameters():
        clipped = (factor.view(-1, *[1] * (want[n].dim() - 1)) * want[n]).sum(0) / 5
        assert_close(p.grad, clipped, f"{method}: .grad of {n}")


# -- backwards with explicit gradients -----------------------------------------------------------


def test_autograd_backward_of_per_example_losses_with_their_weights_and_a_scalar():
    """``torch.autograd.backward([losses, penalty], [w / B, 0.5])``: a ``[batch]`` vector of
    per-example losses with importance weights as its gradient and a scalar with its own:
    under the default mean, grad1[i] is the gradient of ``w_i * loss_i + 0.5 * penalty_i``."""
    model = mlp()
    x, y = batch(0)
    w = torch.tensor([0.5, 2.0, 1.0, 3.0], dtype=D)

    def per_example(out, t):
        ce = F.cross_entropy(out, t[:, 0].long(), reduction="none")
        return (t[:, 1] * ce).mean() + 0.5 * out.pow(2).sum(1).mean()

    with gradhooks.add_hooks(model):
        out = model(x)
        losses = F.cross_entropy(out, y, reduction="none")
        penalty = out.pow(2).sum(1).mean()
        torch.autograd.backward([losses, penalty], [w / 4, torch.tensor(0.5, dtype=D)])
    want = loop_grad(model, per_example, x, torch.stack([y.to(D), w], 1))
    assert_grad1(model, want, "")
    for p in model.parameters():
        assert_close(p.grad1.mean(0), p.grad, ".grad")


def test_output_backward_with_a_per_example_gradient_under_the_mean():
    """``out.backward(gradient=w / B)``: a non-scalar output backpropagated with each example's
    own row of weights, averaged over the batch: grad1[i] is the gradient of ``w_i · out_i``."""
    model = mlp()
    x, _ = batch(0)
    w = torch.randn(4, 2, dtype=D, generator=torch.Generator().manual_seed(5))
    with gradhooks.add_hooks(model):
        model(x).backward(gradient=w / 4)
    want = loop_grad(model, lambda out, wi: (out * wi).sum(), x, w)
    assert_grad1(model, want, "")


def test_backward_with_inputs_of_a_weight_and_the_input():
    """``loss.backward(inputs=[first.weight, x])``: the weight gets grad1, its bias and the
    other layer neither ``.grad`` nor grad1, and the input its ``.grad``."""
    model = mlp()
    x, y = batch(0)
    x.requires_grad_(True)
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x), y).backward(inputs=[model[0].weight, x])
    want = loop_grad(model, F.cross_entropy, x.detach(), y)
    assert_close(model[0].weight.grad1, want["0.weight"], "0.weight")
    for n, p in model.named_parameters():
        if n != "0.weight":
            assert p.grad is None and not hasattr(p, "grad1"), n
    assert x.grad is not None


def test_norms_with_backward_inputs_cover_those_parameters_alone():
    """``h.norms()`` after ``loss.backward(inputs=[first.weight])``: the norms of that
    weight's per-example gradients alone, as grad1 is of it alone."""
    model = mlp()
    x, y = batch(0)
    want = loop_grad(model, F.cross_entropy, x, y)["0.weight"].flatten(1).norm(dim=1)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        F.cross_entropy(model(x), y).backward(inputs=[model[0].weight])
        assert_close(h.norms(), want, "norms of 0.weight alone")


# -- losses that couple the examples -------------------------------------------------------------


def nt_xent(temperature: float = 0.5):
    """SimCLR's NT-Xent over two views ``[batch, F]`` each: every example's positive is its
    other view, its negatives the other ``2·batch - 2`` rows; ``reduction="none"`` gives one
    loss per example (its two rows' mean), each a function of the whole batch."""

    def loss(outs, target=None, reduction="mean"):
        z = F.normalize(torch.cat(outs), dim=1)
        n = outs[0].shape[0]
        sim = (z @ z.T) / temperature
        sim = sim.masked_fill(torch.eye(2 * n, dtype=torch.bool), float("-inf"))
        positive = torch.cat([torch.arange(n, 2 * n), torch.arange(n)])
        rows = F.cross_entropy(sim, positive, reduction="none")
        per_example = 0.5 * (rows[:n] + rows[n:])
        return per_example if reduction == "none" else per_example.mean()

    return loss


def shares(model: nn.Module, loss_fn, inputs: tuple) -> dict:
    """What grad1 holds for a loss that couples the examples, by a float64 loop: example
    ``i``'s share of the batch gradient, the gradient of the whole batch's loss through
    example ``i``'s rows of the model's outputs alone (every other row detached); the shares
    sum to the batch gradient."""
    params = dict(model.named_parameters())
    rows: dict[str, list] = {n: [] for n in params}
    with gradhooks.paused():
        fixed = [model(x).detach() for x in inputs]
        for i in range(inputs[0].shape[0]):
            outs = []
            for x, out in zip(inputs, fixed):
                live = model(x[i : i + 1])
                outs.append(torch.cat([out[:i], live, out[i + 1 :]]))
            grads = torch.autograd.grad(loss_fn(tuple(outs)), list(params.values()))
            for n, g in zip(params, grads):
                rows[n].append(g)
    return {n: torch.stack(r) for n, r in rows.items()}


def views(seed: int, n: int = 6):
    x = torch.randn(n, 3, dtype=D, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 100)
    return x + 0.1 * torch.randn(n, 3, dtype=D, generator=g), x - 0.1 * torch.randn(
        n, 3, dtype=D, generator=g
    )


def test_simclr_grad1_holds_each_examples_share_and_check_says_the_loss_couples_them():
    """A contrastive loss (SimCLR's NT-Xent over two views) has no per-example gradient in
    the DP sense: no example has a loss of its own. With a plain backward, grad1[i] holds
    example ``i``'s share: the gradient of the batch's loss through its own rows of the
    model's outputs (both views), the shares summing to ``.grad`` (its documented meaning,
    checked against a float64 loop over several steps); ``h.check(loss_fn, ...)`` says the
    loss couples the examples."""
    model = mlp()
    loss = nt_xent()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        for step in range(2):
            a, b = views(step)
            want = shares(model, loss, (a, b))
            opt.zero_grad()
            loss((model(a), model(b))).backward()
            assert_grad1(model, want, f"step {step}")
            for p in model.parameters():
                assert_close(p.grad1.sum(0), p.grad, "the shares sum to .grad")
            opt.step()
        with pytest.raises(gradhooks.CheckFailedError, match="couples the examples"):
            h.check(lambda out, t=None: loss((out, model(b[: out.shape[0]]))), a)


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_simclr_per_example_losses_are_refused_by_the_dp_optimizer(method):
    """The same NT-Xent, ``reduction="none"``, handed to ``DPOptimizer.backward`` as if each
    row were an example's own loss: clipping cannot bound one example's influence on the
    others' losses, and the step is refused (naming the parameters) before anything is added
    to the clipped sum, the parameters and ``.grad`` untouched."""
    model = mlp()
    before = copy.deepcopy(model.state_dict())
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), h, max_grad_norm=1.0,
            noise_multiplier=0.0, expected_batch_size=6, method=method,
        )  # fmt: skip
        a, b = views(0)
        losses = nt_xent()((model(a), model(b)), reduction="none")
        with pytest.raises(gradhooks.CheckFailedError, match=r"'0\.weight'"):
            opt.backward(losses)
        assert opt.examples == 0
        with pytest.raises(gradhooks.StateError):
            opt.step()
    assert all(p.grad is None for p in model.parameters())
    for n, t in model.state_dict().items():
        assert torch.equal(t, before[n]), n


def batch_hard_triplet(out, y, margin: float = 0.5):
    """Batch-hard triplet loss (Hermans et al.): each anchor's farthest positive and nearest
    negative within the batch."""
    dist = torch.cdist(out, out)
    same = y[:, None] == y[None, :]
    hardest_positive = dist.masked_fill(~same, 0).amax(1)
    hardest_negative = dist.masked_fill(same, float("inf")).amin(1)
    return F.relu(hardest_positive - hardest_negative + margin)


def batch_normalized(out, y):
    """A loss normalised by the batch's own statistics: each example's squared error over
    the batch's mean square of the outputs."""
    return (out - F.one_hot(y, 2)).pow(2).sum(1) / out.pow(2).mean()


@pytest.mark.parametrize("loss", [batch_hard_triplet, batch_normalized], ids=["triplet", "stats"])
def test_batch_hard_triplet_and_batch_statistic_losses(loss):
    """Two more losses that couple the examples: batch-hard triplet mining and a loss divided
    by the batch's standard deviation. grad1 holds each example's share (checked against the
    loop), ``h.check`` says the loss couples the examples, and ``make_private``'s backward on
    their ``[batch]`` rows is refused with nothing stepped or spent."""
    model = mlp()
    x = torch.randn(6, 3, dtype=D, generator=torch.Generator().manual_seed(2))
    y = torch.tensor([0, 1, 0, 1, 1, 0])
    mean = lambda outs, y=y: loss(outs[0], y[: outs[0].shape[0]]).mean()  # noqa: E731
    want = shares(model, mean, (x,))
    with gradhooks.add_hooks(model) as h:
        mean((model(x),)).backward()
        assert_grad1(model, {n: g * 6 for n, g in want.items()}, "shares, under the mean")
        with pytest.raises(gradhooks.CheckFailedError, match="couples"):
            h.check(lambda out, t: loss(out, t).mean(), x, y)
    before = copy.deepcopy(model.state_dict())
    data = torch.utils.data.TensorDataset(x, y)
    private = gradhooks.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), data, noise_multiplier=1.0,
        delta=1e-5, epochs=1, expected_batch_size=6, max_grad_norm=1.0,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    with private:
        for xb, yb in private.batches():  # (a sampling rate of 1: the whole batch each time)
            with pytest.raises(gradhooks.CheckFailedError, match=r"'0\.weight'"):
                private.backward(loss(model(xb), yb))
            break
        assert private.steps_taken == 0
    for n, t in model.state_dict().items():
        assert torch.equal(t, before[n]), n


# -- MixUp, CutMix, R-Drop, distillation ----------------------------------------------------------


class MixInside(nn.Module):
    """timm's ``Mixup`` moved into the model's forward: the input mixed with its flip
    (``lam * x + (1 - lam) * x.flip(0)``), or the hidden features with a permutation of the
    batch (manifold MixUp), or the input with a permutation of the batch."""

    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.how = nn.Linear(3, 5), nn.Linear(5, 2), how

    def forward(self, x, perm=None):
        if self.how == "flip":
            x = 0.7 * x + 0.3 * x.flip(0)
        elif self.how == "input":
            x = 0.7 * x + 0.3 * x[perm]
        h = torch.tanh(self.a(x))
        if self.how == "hidden":
            h = 0.7 * h + 0.3 * h[perm]
        return self.b(h)


@pytest.mark.parametrize("how", ["flip", "hidden"])
def test_mixup_inside_the_forward_is_refused_naming_the_module(how):
    """Mixing the examples inside the model leaves no example a gradient of its own: refused
    (a :class:`gradhooks.MixedExamplesError` naming the layer, the shapes and what to do),
    and a loop that catches it finds the model as it was (no ``grad1``, no ``.grad``), the
    hooks working for an unmixed step after it."""
    model = MixInside(how).to(D)
    x, y = batch(0)
    perm = torch.tensor([2, 0, 3, 1])
    with gradhooks.add_hooks(model):
        with pytest.raises(gradhooks.MixedExamplesError, match=r"across the examples") as e:
            F.cross_entropy(model(x, perm), y).backward()
        assert "'a' (Linear)" in str(e.value) or "'b' (Linear)" in str(e.value), str(e.value)
        assert "(4, " in str(e.value), str(e.value)
        for p in model.parameters():
            assert p.grad is None and not hasattr(p, "grad1")
        model.how = "none"
        F.cross_entropy(model(x), y).backward()
    assert_grad1(model, loop_grad(model, F.cross_entropy, x, y), "the next, unmixed step")


def test_mixup_of_the_input_by_a_permutation_inside_the_forward_is_mixing_outside():
    """``x = lam * x + (1 - lam) * x[perm]`` as the forward's first line, before any layer:
    the same as mixing outside the model (``docs/guarantees.md``): grad1[i] is the gradient
    of mixed example ``i``'s loss, checked over steps against the loop on the mixed batch."""
    model = MixInside("input").to(D)
    plain = MixInside("none").to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step)
            perm = torch.randperm(4, generator=torch.Generator().manual_seed(step))
            plain.load_state_dict(model.state_dict())
            want = loop_grad(plain, F.cross_entropy, 0.7 * x + 0.3 * x[perm], y)
            opt.zero_grad()
            F.cross_entropy(model(x, perm), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


class SortedByKey(nn.Module):
    """The batch sorted by a key before a layer (as by length before packing) and put back in
    order after it: the layer's rows are the examples in another order."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(3, 5), nn.Linear(5, 2)

    def forward(self, x):
        order = torch.argsort(x[:, 0])
        return self.b(torch.tanh(self.a(x[order]))[order.argsort()])


@pytest.mark.parametrize("verify", [True, False])
def test_a_layer_on_the_input_sorted_by_a_key_matches_the_loop(verify):
    """``a(x[order])`` with ``x`` the model's input (no gradient of its own): the layer's row
    ``r`` is example ``order[r]``. Once, the reordering of a tensor without a gradient was not
    followed, and grad1 of ``a`` gave each example another's gradient (seen up to 0.49 off);
    then the layer was refused; now the rows' examples are followed through the layer (each
    row its example's, :class:`gradhooks.tracking.layout.Owners`), and grad1 is the loop's."""
    model = SortedByKey().to(D)
    x, y = batch(0, n=5)
    assert not torch.equal(torch.argsort(x[:, 0]), torch.arange(5))  # (another order)
    want = loop_grad(model, F.cross_entropy, x, y)
    with gradhooks.add_hooks(model, verify=verify):
        F.cross_entropy(model(x), y).backward()
    assert_grad1(model, want, "sorted by a key")


class SortedThenScaled(SortedByKey):
    def forward(self, x):
        order = torch.argsort(x[:, 0])
        return self.b(torch.tanh(self.a(x[order] * 2)))[order.argsort()]


@pytest.mark.parametrize("verify", [True, False])
def test_a_layer_on_the_sorted_input_after_an_operation_matches_the_loop(verify):
    """``a(x[order] * 2)``: the rows' examples are carried through the operations after the
    reordering until they are put back in order. Once, the mark was carried to the next
    operation only, and with ``verify=False`` grad1 of ``a`` gave each example another's
    gradient."""
    model = SortedThenScaled().to(D)
    x, y = batch(0, n=5)
    want = loop_grad(model, F.cross_entropy, x, y)
    with gradhooks.add_hooks(model, verify=verify):
        F.cross_entropy(model(x), y).backward()
    assert_grad1(model, want, "sorted, then scaled")


class SortedScaledPutBack(SortedByKey):
    def forward(self, x):
        order = torch.argsort(x[:, 0])
        h = torch.tanh(x[order] * 2)
        back = order.argsort() if self.back else order.flip(0)
        return self.b(torch.tanh(self.a(h[back])))


@pytest.mark.parametrize("verify", [True, False])
def test_the_sorted_input_put_back_in_order_before_the_layer_matches_the_loop(verify):
    """``x[order] * 2``, then ``[order.argsort()]`` before the layer: the rows are put back in
    order (the two permutations compose to the identity), so grad1 is the loop's; put back by
    another permutation, the model's output holds the examples in another order than its
    targets, and it is refused."""
    model = SortedScaledPutBack().to(D)
    x, y = batch(0, n=5)
    model.back = True
    want = loop_grad(model, F.cross_entropy, x, y)
    with gradhooks.add_hooks(model, verify=verify):
        F.cross_entropy(model(x), y).backward()
        assert_grad1(model, want, "put back")
        model.back = False
        with pytest.raises(gradhooks.BatchNotFoundError, match=r"output .* another order"):
            F.cross_entropy(model(x), y).backward()


class PutBackThenBatchMean(nn.Module):
    """The batch permuted and put back in order through a layer, then scaled by its batch
    mean, detached (no backward shows that it mixes the examples)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        order = torch.arange(h.shape[0]).roll(1)
        h = torch.tanh(self.b(h[order][order.argsort()]))
        return self.c(h * h.detach().mean(0))


def test_a_batch_mean_after_the_batch_is_put_back_in_order_is_refused():
    """``h[order][order.argsort()]`` holds the examples where they were: a mean over them
    after, even of a detached copy, makes each example's output depend on the others'. (On
    ``[batch, time, features]``, where each Linear's output is a view, which the hooks replace
    by an output of its own.)"""
    model = PutBackThenBatchMean().to(D)
    x = torch.randn(5, 7, 3, dtype=D)
    with gradhooks.add_hooks(model), pytest.raises(gradhooks.MixedExamplesError, match="'c'"):
        model(x).pow(2).sum().backward()


class MoCo(nn.Module):
    """MoCo: a query encoder, a momentum key encoder (frozen, under ``no_grad``) run on the
    batch shuffled and put back in order (MoCo's shuffled BatchNorm), a queue of negatives."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder_q = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 4))
        self.encoder_k = copy.deepcopy(self.encoder_q).requires_grad_(False)
        self.register_buffer("queue", F.normalize(torch.randn(8, 4), dim=1))

    def forward(self, xq, xk):
        q = F.normalize(self.encoder_q(xq), dim=1)
        with torch.no_grad():
            idx = torch.randperm(xk.shape[0], generator=torch.Generator().manual_seed(0))
            k = F.normalize(self.encoder_k(xk[idx]), dim=1)[idx.argsort()]
        return torch.cat([(q * k).sum(1, keepdim=True), q @ self.queue.T], 1) / 0.2


def moco_loss(logits, target=None):
    return F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long))


def test_moco_queue_and_a_shuffled_key_encoder_over_steps():
    """MoCo's InfoNCE against a queue: each query's loss uses its own key and the queue (no
    other example of the batch), so it has a per-example gradient; the key encoder shuffles
    the batch and puts it back. grad1 equals the loop over steps (the key encoder updated by
    momentum, the queue pushed), and ``h.check`` finds each step a mean of per-example losses."""
    model = MoCo().to(D)
    opt = torch.optim.SGD(model.encoder_q.parameters(), lr=0.1)
    with gradhooks.add_hooks(model) as h:
        for step in range(3):
            xq = torch.randn(5, 3, dtype=D, generator=torch.Generator().manual_seed(step))
            xk = xq + 0.1 * torch.randn(5, 3, dtype=D, generator=torch.Generator().manual_seed(9))
            want = loop_grad(model, moco_loss, (xq, xk))
            opt.zero_grad()
            moco_loss(model(xq, xk)).backward()
            assert_grad1(model, want, f"step {step}")
            assert "mean" in str(h.check(moco_loss, (xq, xk)))
            opt.step()
            with torch.no_grad():
                for pk, pq in zip(model.encoder_k.parameters(), model.encoder_q.parameters()):
                    pk.mul_(0.9).add_(0.1 * pq)
                k = F.normalize(model.encoder_k(xk), dim=1)
                model.queue.copy_(torch.cat([k, model.queue])[: model.queue.shape[0]])


def test_cutmix_outside_the_model_over_steps():
    """timm's loop with CutMix applied to the batch before the forward (a box of each image
    pasted from its permuted partner, the targets mixed by the box's area): each mixed image
    is one example to gradhooks, and grad1[i] is the gradient of mixed example ``i``'s loss,
    ``lam · CE(out_i, y_i) + (1 - lam) · CE(out_i, y_perm(i))``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(48, 3))
    model.to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def mixed(out, t):
        return t[:, 2] * F.cross_entropy(out, t[:, 0].long(), reduction="none") + (
            1 - t[:, 2]
        ) * F.cross_entropy(out, t[:, 1].long(), reduction="none")

    with gradhooks.add_hooks(model):
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(5, 1, 6, 6, dtype=D, generator=g)
            y = torch.randint(3, (5,), generator=g)
            perm = torch.randperm(5, generator=g)
            x = x.clone()
            x[:, :, 1:4, 2:5] = x[perm][:, :, 1:4, 2:5]
            lam = 1 - 9 / 36
            t = torch.stack([y.to(D), y[perm].to(D), torch.full((5,), lam, dtype=D)], 1)
            opt.zero_grad()
            mixed(model(x), t).mean().backward()
            assert_grad1(model, loop_grad(model, lambda o, t: mixed(o, t).sum(), x, t), f"{step}")
            opt.step()


class MaskedNet(nn.Module):
    """A model whose dropout mask is an input, so that the loop can replay R-Drop's two
    masks example by example."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(3, 6), nn.Linear(6, 2)

    def forward(self, x, mask):
        return self.b(torch.tanh(self.a(x)) * mask)


class RDropPair(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, x, m1, m2):
        return self.m(x, m1), self.m(x, m2)


def r_drop(outs, y, alpha: float = 4.0):
    """R-Drop: both passes' cross-entropies and ``alpha`` times the symmetric KL between
    them, each example's own (``batchmean``)."""
    p, q = F.log_softmax(outs[0], 1), F.log_softmax(outs[1], 1)
    ce = 0.5 * (F.cross_entropy(outs[0], y) + F.cross_entropy(outs[1], y))
    kl = 0.5 * (
        F.kl_div(p, q, log_target=True, reduction="batchmean")
        + F.kl_div(q, p, log_target=True, reduction="batchmean")
    )
    return ce + alpha * kl


def test_r_drop_two_forwards_with_their_own_dropout_and_a_kl_between_them():
    """R-Drop (Liang et al.): the batch through the model twice, two dropout masks, the loss
    the mean cross-entropy plus the symmetric KL between the two passes' predictions: each
    example's loss depends on its own two passes alone, and grad1 is its gradient."""
    model = MaskedNet().to(D)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step)
            g = torch.Generator().manual_seed(10 + step)
            m1, m2 = ((torch.rand(4, 6, generator=g) > 0.3).to(D) / 0.7 for _ in range(2))
            want = prefixed(loop_grad(RDropPair(model), r_drop, (x, m1, m2), y), "m.")
            opt.zero_grad()
            r_drop((model(x, m1), model(x, m2)), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


class Distiller(nn.Module):
    """Knowledge distillation as a wrapper holds it: a frozen teacher run under ``no_grad``
    inside the forward, the student trained on a mix of the hard targets and the teacher's
    soft ones."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.teacher = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2)).requires_grad_(
            False
        )
        self.student = mlp()

    def forward(self, x):
        with torch.no_grad():
            soft = F.softmax(self.teacher(x) / 2.0, 1)
        return self.student(x), soft


def distillation(outs, y):
    student, soft = outs
    kd = F.kl_div(F.log_softmax(student / 2.0, 1), soft, reduction="batchmean") * 4.0
    return 0.5 * F.cross_entropy(student, y) + 0.5 * kd


def test_knowledge_distillation_with_the_teacher_under_no_grad_inside_the_model():
    """The teacher's parameters get no grad1, the student's grad1 is each example's gradient
    of its own distillation loss, over steps with the teacher in eval mode."""
    model = Distiller().to(D)
    model.teacher.eval()
    opt = torch.optim.SGD(model.student.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step)
            want = loop_grad(model, distillation, x, y)
            opt.zero_grad()
            distillation(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


# -- pure low precision ---------------------------------------------------------------------------


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.to(want.dtype) - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_parameters_set_after_add_hooks_over_steps(dtype):
    """``model.to(bfloat16)`` / ``.half()`` after ``add_hooks``, no autocast, an SGD loop:
    grad1 is in the parameters' dtype and each step's equals the float64 loop at the same
    (half-precision) weights and inputs to within the precision: a Linear's per-example
    gradient is one product of rounded numbers after a short chain of rounded ones, so a few
    units of the format's epsilon (bf16 2^-8, fp16 2^-11) of the largest entry; tolerance
    8 epsilons (seen below 2 here)."""
    model = mlp(torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eps = torch.finfo(dtype).eps
    with gradhooks.add_hooks(model):
        model.to(dtype)
        for step in range(3):
            x, y = batch(step, dtype=dtype)
            ref = copy.deepcopy(model).to(D)
            want = loop_grad(ref, F.cross_entropy, x.to(D), y)
            opt.zero_grad()
            F.cross_entropy(model(x).float(), y).backward()
            for n, p in model.named_parameters():
                assert p.grad1.dtype == dtype, n
                err = relative_error(p.grad1, want[n])
                assert err < 8 * eps, f"step {step}: {n} off by {err:.2e} ({err / eps:.1f} eps)"
            opt.step()


def test_bfloat16_autocast_with_accumulation_and_the_dp_optimizer():
    """bf16 autocast over two micro-batches of one logical batch, ``DPOptimizer.backward`` on
    each and one ``step``: ``.grad`` is the clipped sum over both micro-batches (noise 0) over
    the expected batch size, as the float64 loop's clipped gradients give it; bf16's 8 bits
    of mantissa in the forward (seen 4e-3 of the largest entry): tolerance 3e-2."""
    model = mlp(torch.float32)
    ref = copy.deepcopy(model).to(D)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), h, max_grad_norm=0.5,
            noise_multiplier=0.0, expected_batch_size=8,
        )  # fmt: skip
        for step in range(2):
            clipped: dict = {}
            for micro in range(2):
                x, y = batch(10 * step + micro, dtype=torch.float32)
                want = loop_grad(ref, F.cross_entropy, x.to(D), y)
                norms = torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)
                factor = (0.5 / norms).clamp(max=1.0)
                for n, g in want.items():
                    c = (factor.view(-1, *[1] * (g.dim() - 1)) * g).sum(0)
                    clipped[n] = clipped.get(n, 0) + c
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(x)
                got = opt.backward(F.cross_entropy(out.float(), y, reduction="none"))
                assert relative_error(got, norms) < 3e-2, f"step {step}.{micro}: norms"
            opt.step()
            for n, p in model.named_parameters():
                err = relative_error(p.grad, clipped[n] / 8)
                assert err < 3e-2, f"step {step}: .grad of {n} off by {err:.2e}"
            opt.zero_grad()
            ref.load_state_dict({n: t.to(D) for n, t in model.state_dict().items()})


# -- MAML, stateless calls ----------------------------------------------------------------------


def test_stateless_functional_call_with_fast_weights_over_meta_steps():
    """``torch.nn.utils.stateless.functional_call`` (the older spelling, as ``higher``-style
    code calls it) with first-order fast weights ``p - lr * g`` from a support batch, the
    meta-optimizer stepping the model's parameters: grad1 of the parameters is each query
    example's gradient through the fast weights, step after step, and gradhooks reads no
    ``.grad`` of the fast weights (torch warns on reading a non-leaf tensor's)."""
    import warnings

    from torch.nn.utils import stateless

    model = mlp()
    meta = torch.optim.Adam(model.parameters(), lr=1e-2)
    own = dict(model.named_parameters())

    def fast(support):
        with gradhooks.paused():
            loss = 0.5 * stateless.functional_call(model, own, (support,)).pow(2).sum()
            grads = torch.autograd.grad(loss, list(own.values()))
        return {n: p - 0.3 * g.detach() for (n, p), g in zip(own.items(), grads)}

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradhooks.add_hooks(model, loss_reduction="sum"):
            for step in range(2):
                support, query = batch(step, n=6)[0], batch(50 + step)[0]
                weights = fast(support)
                with gradhooks.paused():
                    rows = []
                    for i in range(4):
                        out = stateless.functional_call(model, weights, (query[i : i + 1],))
                        loss = 0.5 * out.pow(2).sum()
                        rows.append(torch.autograd.grad(loss, list(own.values())))
                want = {n: torch.stack([r[k] for r in rows]) for k, n in enumerate(own)}
                meta.zero_grad()
                weights = fast(support)
                (0.5 * stateless.functional_call(model, weights, (query,)).pow(2).sum()).backward()
                assert_grad1(model, want, f"meta step {step}")
                meta.step()
    leaf = [str(w.message) for w in caught if "not a leaf" in str(w.message)]
    assert not leaf, leaf[0]


# -- hooks on parameters, parametrizations, surgery -----------------------------------------------


def test_optimizer_in_backward_with_gradient_accumulation():
    """An optimizer step fused into the backward by ``register_post_accumulate_grad_hook``
    that steps and zeroes only every second micro-batch (accumulation), reading grad1 in the
    hook: grad1 adds up over the two micro-batches as ``.grad`` does, and starts afresh after
    the fused step."""
    model = mlp()
    plain = mlp()  # (the loop's own copy: no hook of the loop steps it)
    opts = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}
    names = {p: n for n, p in model.named_parameters()}
    count = {"n": 0}
    seen: dict = {}

    def hook(p):
        seen[names[p]] = p.grad1.clone()
        if count["n"] % 2 == 1:
            opts[p].step()
            opts[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)
    with gradhooks.add_hooks(model):
        total: dict = {}
        for micro in range(4):
            x, y = batch(micro)
            plain.load_state_dict(model.state_dict())
            want = loop_grad(plain, F.cross_entropy, x, y)
            total = {n: want[n] + (total[n] if micro % 2 else 0) for n in want}
            F.cross_entropy(model(x), y).backward()
            assert seen.keys() == total.keys()
            for n, g in seen.items():
                assert_close(g, total[n], f"micro-batch {micro}: {n}")
            count["n"] += 1


def test_orthogonal_parametrization_trained_with_adam_over_steps():
    """``parametrizations.orthogonal`` on a square layer, Adam on the original: each step's
    grad1 of ``parametrizations.weight.original`` equals the float64 loop, and the weight
    stays orthogonal."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    nn.utils.parametrizations.orthogonal(model[0])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with gradhooks.add_hooks(model):
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(5, 4, dtype=D, generator=g), torch.randint(2, (5,), generator=g)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()
            w = model[0].weight
            assert_close(w @ w.T, torch.eye(4, dtype=D), "orthogonal")


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(3, 3) for _ in range(3)])
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def test_model_surgery_between_steps():
    """A head replaced (``model.head = nn.Linear(...)``), a block deleted from a
    ``ModuleList``, a branch added by ``add_module`` and used: each step's grad1 follows the
    model as it is, the removed layers' parameters keep no grad1 of a later step."""
    model = Blocks().to(D)
    with gradhooks.add_hooks(model) as h:
        for step in range(4):
            if step == 1:
                old = model.head
                model.head = nn.Linear(3, 2).to(D)
            if step == 2:
                gone = model.blocks[1]
                del model.blocks[1]
            if step == 3:
                model.blocks.add_module("3", nn.Linear(3, 3).to(D))
            x, y = batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            model.zero_grad(set_to_none=True)
            h.clear()
            F.cross_entropy(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
    for p in [*old.parameters(), *gone.parameters()]:  # (nothing of a step after removal)
        assert not hasattr(p, "grad1")


def test_non_reentrant_checkpointing_with_gradient_accumulation():
    """``torch.utils.checkpoint`` (``use_reentrant=False``) around each block, two
    micro-batches accumulated before each step: grad1 sums the two micro-batches' rows as
    ``.grad`` sums them, counted once."""
    from torch.utils.checkpoint import checkpoint

    class Ckpt(Blocks):
        def forward(self, x):
            for b in self.blocks:
                x = checkpoint(lambda t, b=b: torch.tanh(b(t)), x, use_reentrant=False)
            return self.head(x)

    model = Ckpt().to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(2):
            total: dict = {}
            opt.zero_grad()
            for micro in range(2):
                x, y = batch(10 * step + micro)
                want = loop_grad(model, F.cross_entropy, x, y)
                total = {n: total.get(n, 0) + g / 2 for n, g in want.items()}
                (F.cross_entropy(model(x), y) / 2).backward()
            assert_grad1(model, total, f"step {step}")
            for p in model.parameters():
                assert_close(p.grad1.mean(0), p.grad, ".grad")
            opt.step()


def test_torch_compile_with_frozen_parameters_toggled_between_steps():
    """``torch.compile(model)`` made inside the loop's setup after ``add_hooks``, ``zero_grad``
    at each step and the first layer frozen at step 1, unfrozen at step 2: each step's grad1
    follows the trainable parameters, the frozen ones have none after ``h.clear()``."""
    torch._dynamo.reset()
    model = mlp()
    with gradhooks.add_hooks(model) as h:
        compiled = torch.compile(model, backend="eager")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            model[0].requires_grad_(step != 1)
            x, y = batch(step)
            want = loop_grad(model, F.cross_entropy, x, y)
            opt.zero_grad()
            h.clear()
            F.cross_entropy(compiled(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()


def test_float16_grad_scaler_with_accumulation_and_a_skipped_step():
    """float16 autocast, ``GradScaler("cpu")``, two micro-batches per step (each loss halved):
    grad1 is the scaled loss's, ``S`` times the two micro-batches' per-example gradients
    added row by row as ``.grad`` adds them; at step 0 the second micro-batch overflows (a
    huge input), the scaler skips the step and lowers the scale, and the next steps are exact
    up to float16 (10 bits of mantissa in the forward: tolerance 1e-2 of the largest entry)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
    ref = copy.deepcopy(model).to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with gradhooks.add_hooks(model):
        for step in range(3):
            total: dict = {}
            scale = scaler.get_scale()
            for micro in range(2):
                x, y = batch(10 * step + micro, dtype=torch.float32)
                if step == 0 and micro == 1:
                    x = x * 1e30  # (an overflow: inf in the forward)
                else:
                    want = loop_grad(ref, F.cross_entropy, x.to(D), y)
                    total = {n: total.get(n, 0) + g / 2 for n, g in want.items()}
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(x)
                scaler.scale(F.cross_entropy(out.float(), y) / 2).backward()
            finite = all(torch.isfinite(p.grad1).all() for p in model.parameters())
            assert finite == (step != 0), f"step {step}"
            if finite:
                for n, p in model.named_parameters():
                    err = relative_error(p.grad1.double() / scale, total[n])
                    assert err < 1e-2, f"step {step}: {n} off by {err:.2e}"
            scaler.step(opt)
            scaler.update()
            assert (scaler.get_scale() < scale) == (not finite)
            ref.load_state_dict({n: t.to(D) for n, t in model.state_dict().items()})
            opt.zero_grad()


class TwoTasks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.h1, self.h2 = nn.Linear(3, 5), nn.Linear(5, 2), nn.Linear(5, 1)

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return self.h1(h), self.h2(h)


def task1(out, t):
    return F.cross_entropy(out[0], t[:, 0].long())


def task2(out, t):
    return F.mse_loss(out[1].squeeze(1), t[:, 1])


def test_pcgrad_task_gradients_by_autograd_grad_with_clear_between_them():
    """PCGrad-style gradient surgery: each task's gradient of the shared trunk by
    ``torch.autograd.grad(..., retain_graph=True)`` from one forward, projected, and assigned
    to ``.grad`` before the step. ``torch.autograd.grad`` adds to grad1 over the backwards of
    one forward (``docs/training.md``), so ``h.clear()`` before each task's backward gives
    each task's per-example gradients, step after step."""
    model = TwoTasks().to(D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shared = list(model.trunk.parameters())
    with gradhooks.add_hooks(model) as h:
        for step in range(2):
            x = torch.randn(4, 3, dtype=D, generator=torch.Generator().manual_seed(step))
            t = torch.stack([torch.tensor([0.0, 1, 1, 0]), torch.randn(4).to(D)], 1)
            opt.zero_grad()
            out = model(x)
            grads = []
            for task in (task1, task2):
                want = loop_grad(model, task, x, t)
                h.clear()
                grads.append(torch.autograd.grad(task(out, t), shared, retain_graph=True))
                for n, p in model.trunk.named_parameters():
                    assert_close(p.grad1, want[f"trunk.{n}"], f"step {step}, {task.__name__}")
            for p, g1, g2 in zip(shared, *grads):  # (the projection of PCGrad, simplified)
                dot = (g1 * g2).sum()
                p.grad = g1 + g2 - (dot.clamp(max=0) / g2.pow(2).sum()) * g2
            opt.step()

"""Training-loop idioms and misuses, each step checked against the float64 oracle.

Copies of a hooked model (an EMA copy, per-client copies in federated learning, a whole model
saved with ``torch.save`` and loaded), models hooked again, backwards that do not reach the
hooked model, and other idioms of published training code: every step's ``grad1`` is compared
with each example's own gradient by a per-example loop in float64
(:func:`gradhooks.oracle.loop_grad`), or a misuse is checked to stop with an error that names
what went wrong and leaves the model as it was.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_close

D = torch.float64


class TwoHeads(nn.Module):
    """A trunk and two heads; ``head`` (or the attribute ``head``) picks the one a batch goes
    through."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.b, self.c = nn.Linear(3, 5), nn.Linear(5, 2), nn.Linear(5, 2)
        self.head = "b"
        self.to(D)

    def forward(self, x, head: str | None = None):
        return getattr(self, head or self.head)(torch.tanh(self.trunk(x)))


def batch(seed: int, n: int = 4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g, dtype=D), torch.randint(2, (n,), generator=g)


def ce(out, y):
    return F.cross_entropy(out, y)


def assert_grad1(model, want: dict, what: str) -> None:
    """Every parameter in ``want`` has that ``grad1``; every other one has none."""
    for n, p in model.named_parameters():
        if n in want and want[n] is not None:
            assert hasattr(p, "grad1"), f"{what}: {n} has no grad1"
            assert_close(p.grad1, want[n], f"{what}: {n}")
        else:
            assert not hasattr(p, "grad1"), f"{what}: {n} has a grad1 it should not have"


def reached(want: dict, *prefixes: str) -> dict:
    return {n: g for n, g in want.items() if n.startswith(prefixes)}


def saved_and_loaded(model, how: str):
    if how == "pickle":
        return pickle.loads(pickle.dumps(model))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


# -- gradients taken with torch.autograd.grad --------------------------------------------------


@pytest.mark.parametrize("zero", [False, True], ids=["assigned", "zero_grad-then-assigned"])
def test_autograd_grad_then_grad_assigned_by_hand_before_the_step(zero):
    """A loop that takes the gradients with ``torch.autograd.grad`` and assigns them,
    ``p.grad = g``, before ``optimizer.step()`` (gradient surgery, custom clipping), with or
    without ``zero_grad``: the assignment says nothing of an accumulation, so every step's
    ``grad1`` is that step's forward's own."""
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step)
            want = reached(loop_grad(model, ce, x, y), "trunk", "b")
            if zero:
                opt.zero_grad()
            trainable = [p for n, p in model.named_parameters() if n in want]
            grads = torch.autograd.grad(ce(model(x), y), trainable)
            assert_grad1(model, want, f"step {step}")
            for p, g in zip(trainable, grads):
                p.grad = g
            opt.step()


def test_a_handle_per_step_around_autograd_grad_then_grad_assigned_by_hand():
    """The same loop with ``with gradhooks.add_hooks(model):`` around each step's
    ``torch.autograd.grad``: a new handle does not go on from the ``grad1`` the last one left
    (its backward added nothing to ``.grad``; the ``.grad`` there is the loop's own)."""
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x, y = batch(step)
        want = reached(loop_grad(model, ce, x, y), "trunk", "b")
        trainable = [p for n, p in model.named_parameters() if n in want]
        with gradhooks.add_hooks(model):
            grads = torch.autograd.grad(ce(model(x), y), trainable)
        assert_grad1(model, want, f"step {step}")
        for p, g in zip(trainable, grads):
            p.grad = g
        opt.step()


def test_autograd_grad_of_a_new_forward_after_a_backward_starts_afresh():
    """``backward()`` of one forward, then (no ``zero_grad``) ``torch.autograd.grad`` of
    another: the latter returns its gradients and leaves ``.grad`` alone, so its ``grad1`` is
    its own forward's, not added to the ``backward()``'s."""
    model = TwoHeads()
    with gradhooks.add_hooks(model):
        x, y = batch(0)
        ce(model(x), y).backward()
        x, y = batch(1)
        want = reached(loop_grad(model, ce, x, y), "trunk", "b")
        torch.autograd.grad(ce(model(x), y), [model.trunk.weight, model.trunk.bias])
        assert_close(model.trunk.weight.grad1, want["trunk.weight"], "trunk.weight")


# -- copies of a hooked model ----------------------------------------------------------------


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_loaded_copy_trained_without_hooks_never_shows_the_originals_grad1(how):
    """A whole model pickled after a backward carries its parameters' ``grad1`` (the
    original's, of that backward): readable as saved until the copy computes, then gone, so
    that the copy's own training never shows the original's per-example gradients as its
    own. The original's ``grad1`` is untouched."""
    model = TwoHeads()
    x, y = batch(0)
    with gradhooks.add_hooks(model):
        ce(model(x), y).backward()
        want = reached(loop_grad(model, ce, x, y), "trunk", "b")
        copied = saved_and_loaded(model, how)
        assert_grad1(copied, want, "as saved")  # (before it computes anything)
        with torch.no_grad():
            copied(x)  # an evaluation leaves it
        assert_grad1(copied, want, "after an evaluation")
        x2, y2 = batch(1, 6)
        opt = torch.optim.SGD(copied.parameters(), lr=0.1)
        opt.zero_grad()
        ce(copied(x2), y2).backward()  # trained without hooks
        opt.step()
        assert all(p.grad is not None for p in copied.trunk.parameters())
        assert_grad1(copied, {}, "trained copy")
        assert_grad1(model, want, "original")


@pytest.mark.parametrize("how", ["pickle", "torch.save", "deepcopy"])
def test_a_copy_hooked_after_the_original_gets_its_own_grad1_and_leaves_the_originals(how):
    """``add_hooks(copy)`` on a copy made after a backward of the hooked original: its steps
    give the copy's own per-example gradients (a head its batch does not reach has none, not
    the original's carried over), and the original's steps go on as before."""
    model = TwoHeads()
    x, y = batch(0)
    with gradhooks.add_hooks(model) as h:
        want0 = reached(loop_grad(model, ce, x, y), "trunk", "b")
        ce(model(x), y).backward()
        copied = copy.deepcopy(model) if how == "deepcopy" else saved_and_loaded(model, how)
        copied.head = "c"
        opt = torch.optim.SGD(copied.parameters(), lr=0.1)
        with gradhooks.add_hooks(copied):
            for step in range(2):
                x2, y2 = batch(10 + step, 6)
                want = reached(loop_grad(copied, ce, x2, y2), "trunk", "c")
                opt.zero_grad()
                ce(copied(x2), y2).backward()
                assert_grad1(copied, want, f"copy, step {step}")
                opt.step()
        assert_grad1(model, want0, "original")
        x3, y3 = batch(3)
        model.zero_grad()
        want3 = reached(loop_grad(model, ce, x3, y3), "trunk", "b")
        ce(model(x3), y3).backward()
        assert_grad1(model, want3, "original, next step")
        assert h.active


class Holds(TwoHeads):
    """A model that hooks itself and keeps the handle."""

    def __init__(self) -> None:
        super().__init__()
        self.hooks = gradhooks.add_hooks(self)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_model_that_holds_its_own_handle_copies_and_saves(how):
    """``self.hooks = gradhooks.add_hooks(self)`` in a model's ``__init__``: the model
    deep-copies (an EMA) and saves whole; in the copy the handle is inert (``active`` False,
    ``remove()`` a no-op, anything else a ``StateError`` saying to hook the copy), the copy
    trains without ``grad1``, and the original's steps are as before."""
    model = Holds()
    try:
        x, y = batch(0)
        want = reached(loop_grad(model, ce, x, y), "trunk", "b")
        ce(model(x), y).backward()
        copied = copy.deepcopy(model) if how == "deepcopy" else saved_and_loaded(model, how)
        assert not copied.hooks.active and "not hooked" in repr(copied.hooks)
        with pytest.raises(gradhooks.StateError, match=r"copied with.*Holds.*add_hooks\(copy\)"):
            copied.hooks.norms()
        copied.hooks.remove()
        x2, y2 = batch(1, 6)
        ce(copied(x2), y2).backward()
        assert_grad1(copied, {}, "copy")
        assert_grad1(model, want, "original")
        model.zero_grad()
        want = reached(loop_grad(model, ce, x2, y2), "trunk", "b")
        ce(model(x2), y2).backward()
        assert_grad1(model, want, "original, next step")
        assert model.hooks.active
    finally:
        model.hooks.remove()


def test_hooks_added_again_replace_a_grad1_left_by_earlier_hooks():
    """``remove()`` leaves ``grad1`` (as ``.grad``); hooks added again start afresh: a
    parameter their first backward does not reach loses the ``grad1`` left from before, as
    after ``zero_grad``."""
    model = TwoHeads()
    x, y = batch(0)
    with gradhooks.add_hooks(model):
        ce(model(x, "c"), y).backward()
    assert hasattr(model.c.weight, "grad1")
    model.zero_grad()
    x2, y2 = batch(1, 6)
    want = reached(loop_grad(model, ce, x2, y2), "trunk", "b")
    with gradhooks.add_hooks(model):
        ce(model(x2), y2).backward()
    assert_grad1(model, want, "hooked again")


@pytest.mark.parametrize("reset", ["zero_grad", "set_to_none=False", "none"])
def test_hooks_added_around_each_micro_batch_accumulate_as_grad_does(reset):
    """The README's ``with add_hooks(model): loss.backward()`` written inside an accumulation
    loop, a handle per micro-batch: ``grad1`` adds up over the micro-batches as ``.grad`` does
    (each handle goes on from the ``grad1`` the last one left), and starts afresh where
    ``.grad`` was reset (either way) before the next step; never reset, both keep adding."""
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    total = None
    for step in range(2):
        if reset != "none":
            opt.zero_grad(set_to_none=reset == "zero_grad")
            total = None
        for micro in range(3):
            x, y = batch(10 * step + micro)
            want = reached(loop_grad(model, ce, x, y), "trunk", "b")
            with gradhooks.add_hooks(model):
                (ce(model(x), y) / 3).backward()
            want = {n: g / 3 for n, g in want.items()}
            total = want if total is None else {n: total[n] + want[n] for n in want}
            assert_grad1(model, total, f"step {step}, micro-batch {micro}")
            for n, p in model.named_parameters():
                if n in total:
                    assert_close(p.grad1.mean(0), p.grad, f"{n}: grad1.mean(0) is .grad")
        opt.step()


def test_a_handle_per_step_with_the_trunk_frozen_between_steps():
    """Progressive freezing with a handle per step: a parameter frozen since the last handle
    loses the ``grad1`` it had when trainable at the next step's backward, as with one
    handle after ``zero_grad``; the others get that step's own."""
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        if step == 1:
            model.trunk.requires_grad_(False)
        x, y = batch(step)
        want = reached(loop_grad(model, ce, x, y), "trunk", "b")
        opt.zero_grad()
        with gradhooks.add_hooks(model):
            ce(model(x), y).backward()
        assert_grad1(model, want, f"step {step}")
        opt.step()


def test_hooks_without_grad1_added_after_hooks_with_it_drop_the_grad1_left():
    """A handle that computes only the norms does not keep up a ``grad1`` left by earlier
    hooks (``.grad`` not reset): its first backward deletes it rather than leave a number
    of another backward beside the new ``.grad``."""
    model = TwoHeads()
    x, y = batch(0)
    with gradhooks.add_hooks(model):
        ce(model(x), y).backward()
    x2, y2 = batch(1, 6)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        ce(model(x2), y2).backward()
        assert h.norms().shape == (6,)
    assert_grad1(model, {}, "norms only")


def test_an_ema_copy_updated_with_lerp_and_evaluated_under_no_grad():
    """An EMA of the weights kept as ``ema = copy.deepcopy(model)`` (not hooked), updated with
    ``lerp_`` after every step and evaluated under ``no_grad``: the training steps' ``grad1``
    is each example's own, the EMA's weights are what the update made them, and the EMA never
    gets a ``grad1``."""
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with gradhooks.add_hooks(model):
        ema = copy.deepcopy(model).requires_grad_(False)
        expected = {n: p.detach().clone() for n, p in model.named_parameters()}
        for step in range(3):
            x, y = batch(step)
            want = reached(loop_grad(model, ce, x, y), "trunk", "b")
            opt.zero_grad()
            ce(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()
            with torch.no_grad():
                for (n, p), q in zip(model.named_parameters(), ema.parameters()):
                    q.lerp_(p, 0.1)
                    expected[n].lerp_(p, 0.1)
                ema(x).argmax(1)
        for n, q in ema.named_parameters():
            assert_close(q, expected[n], f"ema {n}")
            assert not hasattr(q, "grad1"), n


def test_federated_clients_each_train_a_copy_of_the_global_model():
    """Federated averaging with per-example gradients on the clients: each round every client
    trains ``local = copy.deepcopy(global_model)`` hooked by its own ``add_hooks``, its
    ``grad1`` checked against the oracle at every local step; the server averages the local
    weights into the global model. A client that forgets ``add_hooks`` gets no ``grad1`` (an
    ``AttributeError``), never another model's, and asking for its handle says to hook it."""
    global_model = TwoHeads()
    gradhooks.add_hooks(global_model)  # (hooked too: its hooks must not reach the copies)
    try:
        for rnd in range(2):
            states = []
            for client in range(2):
                local = copy.deepcopy(global_model)
                opt = torch.optim.SGD(local.parameters(), lr=0.1)
                with gradhooks.add_hooks(local):
                    for step in range(2):
                        x, y = batch(100 * rnd + 10 * client + step)
                        want = reached(loop_grad(local, ce, x, y), "trunk", "b")
                        opt.zero_grad()
                        ce(local(x), y).backward()
                        assert_grad1(local, want, f"round {rnd} client {client} step {step}")
                        opt.step()
                states.append(local.state_dict())
            with torch.no_grad():
                for n, p in global_model.named_parameters():
                    p.copy_(sum(s[n] for s in states) / len(states))
        forgot = copy.deepcopy(global_model)
        x, y = batch(7)
        ce(forgot(x), y).backward()
        with pytest.raises(AttributeError, match="grad1"):
            forgot.trunk.weight.grad1  # noqa: B018
        with pytest.raises(gradhooks.ConfigurationError, match="add_hooks"):
            gradhooks.hooks_of(forgot)  # (what dp_sgd_step and make_private are given)
        assert all(not hasattr(p, "grad1") for p in global_model.parameters())
    finally:
        gradhooks.remove_hooks(global_model)


# -- loss modules with parameters ------------------------------------------------------------


@pytest.mark.skipif(not hasattr(nn, "LinearCrossEntropyLoss"), reason="torch without it")
def test_linear_cross_entropy_loss_is_refused_with_advice_that_works():
    """``nn.LinearCrossEntropyLoss`` fuses the output projection with the loss, and no rule
    covers the fusion yet: the refusal names the parameter and the fused operation, and says to
    compute the logits with an ``nn.Linear`` and ``F.cross_entropy`` instead (which the test
    then does, with the same weights: ``grad1`` matches the oracle), or to freeze it. The model
    is left as it was."""

    class Model(nn.Module):
        def __init__(self, fused: bool) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body = nn.Linear(3, 4)
            self.fused = fused
            if fused:
                self.head = nn.LinearCrossEntropyLoss(4, 5, dtype=D)
            else:
                self.head = nn.Linear(4, 5, bias=False, dtype=D)
            self.to(D)

        def forward(self, x, y):
            h = torch.tanh(self.body(x))
            return self.head(h, y) if self.fused else F.cross_entropy(self.head(h), y)

    fused = Model(True)
    x, y = torch.randn(6, 3, dtype=D), torch.randint(5, (6,))
    before = {n: p.detach().clone() for n, p in fused.named_parameters()}
    with gradhooks.add_hooks(fused):
        with pytest.raises(gradhooks.UnsupportedError) as err:
            fused(x, y).backward()
    msg = str(err.value)
    for part in (
        "'head.linear.weight'", "'linear_cross_entropy' is a fused operation no rule covers yet",
        "nn.Linear", "F.cross_entropy", "freeze it",
    ):  # fmt: skip
        assert part in msg, (part, msg)
    assert "Use it through its module" not in msg
    for n, p in fused.named_parameters():
        assert torch.equal(p.detach(), before[n]) and not hasattr(p, "grad1"), n
    plain = Model(False)
    plain.load_state_dict({n.replace("head.linear.", "head."): t for n, t in before.items()})
    with gradhooks.add_hooks(plain):
        fused_loss = fused(x, y)
        plain(x, y).backward()
    torch.testing.assert_close(plain(x, y), fused_loss)
    want = loop_grad(plain, lambda loss: loss, (x, y))
    assert_grad1(plain, want, "unfused")


# -- losses that are not a plain mean over the examples --------------------------------------


def test_a_weighted_cross_entropy_mean_gives_each_example_its_share_and_check_says_so():
    """``F.cross_entropy`` with class weights and ``ignore_index`` under ``reduction="mean"``
    divides by the batch's total weight: ``grad1[i]`` is ``B·w[y_i] / Σ_j w[y_j]`` times the
    gradient of example ``i``'s own loss (zeros where ignored), consistent with ``.grad``;
    ``check`` says the loss is a weighted mean. Summed ``reduction="none"`` losses give each
    example's own (weighted) loss gradient."""
    model = TwoHeads()
    x, y = batch(0, 6)
    y[1] = -100
    w = torch.tensor([0.5, 2.0], dtype=D)

    def weighted(out, t):
        return F.cross_entropy(out, t, weight=w)

    def own(out, t):  # example i's own loss, weighted: w[y_i]·ℓ_i (0 where ignored)
        return F.cross_entropy(out, t, weight=w, reduction="sum")

    per = reached(loop_grad(model, own, x, y), "trunk", "b")
    valid = y != -100
    share = torch.where(valid, w[y.clamp_min(0)], 0.0)
    share = len(y) * share / share.sum() / torch.where(valid, w[y.clamp_min(0)], 1.0)
    with gradhooks.add_hooks(model) as h:
        weighted(model(x), y).backward()
        want = {n: share.view(-1, *[1] * (g.dim() - 1)) * g for n, g in per.items()}
        assert_grad1(model, want, "weighted mean")
        report = h.check(weighted, x, y, examples=6, raise_on_error=False)
        assert not report.ok and "weighted mean" in str(report), str(report)
    model.zero_grad()
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        F.cross_entropy(model(x), y, weight=w, reduction="none").sum().backward()
        assert_grad1(model, per, "summed per-example losses")
        assert h.check(own, x, y, examples=6).ok


# -- backwards that do not reach the hooked model --------------------------------------------


def test_gan_steps_with_the_generator_hooked_and_a_discriminator_step_between():
    """A GAN whose generator alone is hooked (DP on the generator): the generator's step gives
    each example's own gradient; the discriminator's step, on the detached fake, reaches no
    hooked parameter and is not seen by the hooks, so it leaves the generator's ``grad1`` as
    its step left it, also after one ``zero_grad()`` over both models reset ``.grad``: then
    ``check()`` says that ``grad1`` is of an earlier backward, and the next generator step
    starts afresh."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 4)).to(D)
    disc = nn.Sequential(nn.Linear(4, 5), nn.LeakyReLU(0.2), nn.Linear(5, 1)).to(D)
    both = nn.ModuleList([gen, disc])
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-2)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-2)
    real_of = torch.Generator().manual_seed(1)

    def g_loss(fake):
        return F.softplus(-disc(fake)).mean()

    with gradhooks.add_hooks(gen) as h:
        for step in range(3):
            z = torch.randn(4, 3, generator=real_of, dtype=D)
            real = torch.randn(4, 4, generator=real_of, dtype=D)
            fake = gen(z)
            both.zero_grad()  # (.grad of both reset)
            d_loss = F.softplus(-disc(real)).mean() + F.softplus(disc(fake.detach())).mean()
            d_loss.backward()
            opt_d.step()
            if step:
                assert all(p.grad is None for p in gen.parameters())
                report = h.check(raise_on_error=False)
                assert "grad1 is of an earlier backward" in str(report.problems), str(report)
            want = loop_grad(gen, g_loss, z)
            both.zero_grad()
            g_loss(fake).backward()
            assert_grad1(gen, want, f"generator step {step}")
            assert not h.check(raise_on_error=False).problems
            opt_g.step()
    assert not any(hasattr(p, "grad1") for p in disc.parameters())


# -- models that copy themselves, and mixing the examples ------------------------------------


class Byol(nn.Module):
    """BYOL as lucidrains' ``byol-pytorch`` writes it: the target network is a deep copy of the
    online one made lazily inside the first forward (of the hooked model), frozen, run under
    ``no_grad`` and moved towards the online one by ``lerp_`` after every step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.online = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 4))
        self.predictor = nn.Linear(4, 4)
        self.target = None
        self.to(D)

    def forward(self, v1, v2):
        p1, p2 = self.predictor(self.online(v1)), self.predictor(self.online(v2))
        with torch.no_grad():
            if self.target is None:
                self.target = copy.deepcopy(self.online).requires_grad_(False)
            t1, t2 = self.target(v1), self.target(v2)

        def loss(p, z):
            return 2 - 2 * F.cosine_similarity(p, z, dim=-1)

        return (loss(p1, t2) + loss(p2, t1)).mean()


def test_byol_target_network_deep_copied_inside_the_hooked_forward():
    model = Byol()
    g = torch.Generator().manual_seed(0)
    opt = None
    with gradhooks.add_hooks(model):
        for step in range(3):
            v1 = torch.randn(5, 3, generator=g, dtype=D)
            v2 = v1 + 0.1 * torch.randn(5, 3, generator=g, dtype=D)
            model.zero_grad()
            model(v1, v2).backward()
            want = loop_grad(model, lambda loss: loss, (v1, v2))  # (the target exists by now)
            assert_grad1(model, {n: g for n, g in want.items() if g is not None}, f"step {step}")
            trainable = [p for n, p in model.named_parameters() if p.requires_grad]
            opt = opt or torch.optim.SGD(trainable, lr=0.1)
            opt.step()
            with torch.no_grad():
                for q, p in zip(model.target.parameters(), model.online.parameters()):
                    q.lerp_(p, 0.01)


def test_a_head_deep_copied_into_the_hooked_model_gets_its_own_grad1():
    """Continual learning's growing heads: ``model.heads.append(copy.deepcopy(model.heads[0]))``
    after some steps (the copy carries inert copies of the hooks, and the handle hooks it as a
    new layer): every step after has each head's own per-example gradients."""

    class Grown(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.trunk, self.heads = nn.Linear(3, 6), nn.ModuleList([nn.Linear(6, 2)])
            self.to(D)

        def forward(self, x):
            h = torch.tanh(self.trunk(x))
            return torch.cat([head(h) for head in self.heads], 1)

    model = Grown()
    x, y = batch(0, 5)
    with gradhooks.add_hooks(model):
        ce(model(x), y).backward()
        model.heads.append(copy.deepcopy(model.heads[0]))
        with torch.no_grad():
            model.heads[1].weight.mul_(0.5)
        for step in range(2):
            x, y = batch(step + 1, 5)
            y = y + 2 * (y % 2)  # (labels of both heads)
            want = loop_grad(model, ce, x, y)
            model.zero_grad()
            ce(model(x), y).backward()
            assert_grad1(model, want, f"step {step}")


def test_features_mixed_by_the_loop_between_two_submodule_calls_are_refused():
    """Each submodule call made by the loop is a forward of its own, followed from its inputs:
    what the loop computes across the batch between two of them (here centering the features)
    is not seen by the tracker, and the trunk's grad1 was formed from mixed output-gradients
    in silence. The run-time check now compares the trunk's grad1 against autograd's gradient
    from the head's output rows (docs/guarantees.md, 'Examples mixed outside the model')."""
    model = TwoHeads()
    x, y = batch(0)
    with gradhooks.add_hooks(model):
        h = torch.tanh(model.trunk(x))
        h = h - h.mean(0)  # across the examples
        with pytest.raises(gradhooks.GradhooksError, match="trunk"):
            ce(model.b(h), y).backward()
        for n, p in model.named_parameters():
            assert p.grad is None and not hasattr(p, "grad1"), n


class _RowNormedHead(nn.Module):
    """What the loop below computes, as one forward (for the per-example loop)."""

    def __init__(self, model: TwoHeads) -> None:
        super().__init__()
        self.trunk, self.b = model.trunk, model.b

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return self.b(h / h.norm(dim=1, keepdim=True))


def test_features_changed_row_by_row_between_two_submodule_calls_are_the_loops():
    """The same loop with an operation on each example's row alone between the two calls (each
    row scaled to norm 1): the check passes, and grad1 of both calls is the float64 loop's, at
    every step of SGD."""
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradhooks.add_hooks(model):
        for step in range(3):
            x, y = batch(step)
            with gradhooks.paused():
                want = loop_grad(_RowNormedHead(model), ce, x, y)
            opt.zero_grad()
            h = torch.tanh(model.trunk(x))
            ce(model.b(h / h.norm(dim=1, keepdim=True)), y).backward()
            assert_grad1(model, want, f"step {step}")
            opt.step()

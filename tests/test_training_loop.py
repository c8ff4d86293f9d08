"""grad1 in the ordinary training loop, as a DP or K-FAC researcher writes it: zero_grad,
forward, backward, step, over several steps, with no call to ``h.clear()``.

Every test runs the loop twice in float64: on the hooked model, and on an unhooked twin (a deep
copy made before the hooks) that takes the same steps. At each step the per-example gradients
of the twin by a loop over the examples (:func:`gradhooks.oracle.loop_grad`) are what
``grad1`` must hold: the sum over the backwards since ``.grad`` was last reset, as ``.grad`` is;
and where the twin's ``.grad`` is ``None`` the hooked parameter has no ``grad1`` (zeros where it
is zeros). ``.grad`` and the parameters are compared with the twin's too.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_close

D = torch.float64


def ce(out, y):
    return F.cross_entropy(out, y)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).to(D)


def batch(n: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g, dtype=D), torch.randint(2, (n,), generator=g)


def per_example(twin, x, y, scale: float = 1.0, loss=ce) -> dict[str, torch.Tensor]:
    """Each example's own gradient (of ``scale`` times its loss), in float64."""
    return {n: scale * g for n, g in loop_grad(twin, loss, x, y).items()}


def add(a: dict | None, b: dict) -> dict:
    return dict(b) if a is None else {n: a[n] + b[n] for n in b}


def assert_like_grad(model, twin, want: dict | None, what: str) -> None:
    """grad1 mirrors .grad: absent where the twin's .grad is None, else ``want`` (the
    per-example gradients accumulated since the last reset; zeros for a parameter the
    accumulation did not reach); .grad equals the twin's."""
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        if q.grad is None:
            assert p.grad is None, f"{what}: {n} .grad"
            assert not hasattr(p, "grad1"), f"{what}: {n} keeps a grad1 its .grad does not have"
            continue
        assert_close(p.grad, q.grad, f"{what}: {n} .grad")
        if not p.requires_grad:
            continue
        assert hasattr(p, "grad1"), f"{what}: {n} has no grad1"
        assert_close(p.grad1, want[n], f"{what}: {n} grad1")


def assert_same_params(model, twin) -> None:
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        assert_close(p.detach(), q.detach(), f"parameter {n}")


OPTIMIZERS = {
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "Adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
}


def pair(model: nn.Module, optimizer: str = "SGD", **hook_kwargs):
    twin = copy.deepcopy(model)
    opts = [OPTIMIZERS[optimizer](m.parameters()) for m in (model, twin)]
    return twin, opts, gradhooks.add_hooks(model, **hook_kwargs)


# -- the plain loop ------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeros"])
@pytest.mark.parametrize("zero", ["optimizer", "model"])
def test_plain_loop(optimizer, set_to_none, zero):
    """The loop of the tutorials, several steps, nothing but zero_grad between them."""
    model = mlp()
    twin, opts, h = pair(model, optimizer)
    with h:
        for step in range(3):
            x, y = batch(seed=step)
            want = per_example(twin, x, y)
            for m, opt in zip((model, twin), opts):
                (opt if zero == "optimizer" else m).zero_grad(set_to_none=set_to_none)
                ce(m(x), y).backward()
            assert_like_grad(model, twin, want, f"step {step}")
            assert h.accumulated == 1
            for opt in opts:
                opt.step()
            assert_same_params(model, twin)


def test_the_loop_from_the_report():
    """``grad1.mean(0)`` is ``.grad`` at every step (it was 2-3 off from the second step on)."""
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    opt = torch.optim.SGD(m.parameters(), 0.1)
    with gradhooks.add_hooks(m):
        for _ in range(3):
            opt.zero_grad()
            m(torch.randn(4, 3)).sum().backward()
            torch.testing.assert_close(m.weight.grad1.mean(0), m.weight.grad)
            opt.step()


# -- accumulation --------------------------------------------------------------------------------


@pytest.mark.parametrize("scaled", [True, False], ids=["loss/k", "loss"])
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeros"])
def test_gradient_accumulation_over_micro_batches(scaled, set_to_none):
    """k micro-batches per step without zero_grad between them: grad1 adds up as .grad does
    (row i: the sum of row i of each micro-batch), scaled by 1/k where the loss is; the next
    step's zero_grad starts afresh."""
    k = 3
    model = mlp()
    twin, opts, h = pair(model, "Adam")
    with h:
        for step in range(2):
            for opt in opts:
                opt.zero_grad(set_to_none=set_to_none)
            want = None
            for j in range(k):
                x, y = batch(seed=10 * step + j)
                c = 1 / k if scaled else 1.0
                want = add(want, per_example(twin, x, y, c))
                for m in (model, twin):
                    (c * ce(m(x), y)).backward()
                assert_like_grad(model, twin, want, f"step {step}, micro-batch {j}")
                assert h.accumulated == j + 1
            for opt in opts:
                opt.step()
            assert_same_params(model, twin)


def test_a_smaller_last_micro_batch_is_refused():
    model = mlp()
    with gradhooks.add_hooks(model):
        x, y = batch(4)
        ce(model(x), y).backward()
        with pytest.raises(RuntimeError, match="batch size changed"):
            ce(model(x[:3]), y[:3]).backward()
        model.zero_grad()  # a new step: any size
        ce(model(x[:3]), y[:3]).backward()
        assert model[0].weight.grad1.shape[0] == 3


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeros"])
def test_retain_graph_backward_twice(set_to_none):
    model = mlp()
    twin, opts, h = pair(model)
    with h:
        for step in range(2):
            x, y = batch(seed=step)
            want = per_example(twin, x, y, 2.0)
            for m, opt in zip((model, twin), opts):
                opt.zero_grad(set_to_none=set_to_none)
                loss = ce(m(x), y)
                loss.backward(retain_graph=True)
                loss.backward()
            assert_like_grad(model, twin, want, f"step {step}")
            assert h.accumulated == 2
            for opt in opts:
                opt.step()


def test_clip_grad_norm_after_backward_and_between_micro_batches():
    """Clipping changes .grad in place after the backward: grad1 stays the per-example
    gradients (not clipped), the next zero_grad starts afresh. Clipping between micro-batches
    is post-processing too: the next micro-batch still adds to grad1."""
    model = mlp()
    twin, opts, h = pair(model)
    with h:
        for step in range(2):
            x, y = batch(seed=step)
            x2, y2 = batch(seed=step + 7)
            want = per_example(twin, x, y)
            want2 = per_example(twin, x2, y2)
            for m, opt in zip((model, twin), opts):
                opt.zero_grad()
                ce(m(x), y).backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            for n, p in model.named_parameters():
                assert_close(p.grad1, want[n], f"step {step}: {n} grad1 after clipping")
            for m in (model, twin):
                ce(m(x2), y2).backward()
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            assert_like_grad(model, twin, add(want, want2), f"step {step}, second micro-batch")
            for opt in opts:
                opt.step()
            assert_same_params(model, twin)


def test_clear_without_zero_grad_and_both():
    """h.clear() still starts grad1 afresh while .grad accumulates (the documented way to keep
    each micro-batch's own grad1); with zero_grad too, as before."""
    model = mlp()
    twin, opts, h = pair(model)
    with h:
        for step in range(3):
            x, y = batch(seed=step)
            want = per_example(twin, x, y)
            h.clear()
            if step == 2:
                for opt in opts:
                    opt.zero_grad()
            for m in (model, twin):
                ce(m(x), y).backward()
            for n, p in model.named_parameters():
                assert_close(p.grad1, want[n], f"step {step}: {n}")
            assert h.accumulated == 1
        for p, q in zip(model.parameters(), twin.parameters()):
            assert_close(p.grad, q.grad, ".grad")


def test_deleting_grad1_or_grad_starts_that_parameter_afresh():
    model = mlp()
    twin, opts, h = pair(model)
    x, y = batch(seed=0)
    x2, y2 = batch(seed=1)
    with h:
        want = per_example(twin, x, y)
        want2 = per_example(twin, x2, y2)
        for m in (model, twin):
            ce(m(x), y).backward()
        del model[0].weight.grad1
        model[2].bias.grad = None
        twin[2].bias.grad = None
        for m in (model, twin):
            ce(m(x2), y2).backward()
        for n, p in model.named_parameters():
            fresh = n in ("0.weight", "2.bias")
            assert_close(p.grad1, want2[n] if fresh else want[n] + want2[n], n)


def test_set_to_none_then_a_paused_backward_then_a_captured_one():
    """A backward that is not captured after zero_grad (a saliency map under h.paused()) puts
    a gradient in .grad but leaves grad1 alone; the next captured backward still starts afresh
    rather than add to the grad1 of before the zero_grad."""
    model = mlp()
    x, y = batch(seed=0)
    x2, y2 = batch(seed=1)
    with gradhooks.add_hooks(model) as h:
        ce(model(x), y).backward()
        before = {n: p.grad1.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        with h.paused():
            ce(model(x2), y2).backward()
        for n, p in model.named_parameters():
            assert_close(p.grad1, before[n], f"{n} after the paused backward")
        model.zero_grad()
        want = per_example(model, x2, y2)
        ce(model(x2), y2).backward()
        for n, p in model.named_parameters():
            assert_close(p.grad1, want[n], n)


# -- parameters a step does not reach ------------------------------------------------------------


class Heads(nn.Module):
    """A trunk and three task heads, one chosen per step (``self.task``); head 2 never."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(3, 5)
        self.heads = nn.ModuleList(nn.Linear(5, 2) for _ in range(3))
        self.task = 0

    def forward(self, x):
        return self.heads[self.task](torch.tanh(self.trunk(x)))


class LayerDrop(nn.Module):
    """Three residual blocks; ``self.keep`` says which run this step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(3, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.out = nn.Linear(4, 2)
        self.keep = (True, True, True)

    def forward(self, x):
        h = self.inp(x)
        for block, keep in zip(self.blocks, self.keep):
            if keep:
                h = h + torch.tanh(block(h))
        return self.out(h)


class Experts(nn.Module):
    """Top-1 routing of every token to one of three experts (no rule: the fallback)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(4, 3)
        self.w0, self.w1, self.w2 = (nn.Parameter(torch.randn(4, 4) / 2) for _ in range(3))

    def forward(self, h):
        flat = h.reshape(-1, 4)
        choice = self.router(flat).argmax(-1)
        mixed = torch.zeros_like(flat)
        for e, w in enumerate((self.w0, self.w1, self.w2)):
            rows = (choice == e).nonzero().flatten()
            if rows.numel():
                mixed = mixed.index_add(0, rows, torch.tanh(flat[rows] @ w))
        return mixed.reshape(h.shape) + torch.softmax(self.router(h), -1)[..., :1] * h


class MoE(nn.Module):
    """Tokens [batch, 5, 3] through a Linear, the experts, a Linear, then averaged."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.moe, self.out = nn.Linear(3, 4), Experts(), nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.moe(self.inp(x))).mean(1)


def _heads(model, twin, step):
    for m in (model, twin):
        m.task = step % 2


def _layerdrop(model, twin, step):
    for m in (model, twin):
        m.keep = [(True, False, True), (False, True, True), (True, True, False)][step % 3]


def _experts(model, twin, step):
    """Expert ``step % 3`` gets no token this step (its router bias far below the others')."""
    with torch.no_grad():
        for m in (model, twin):
            m.moe.router.bias.copy_(torch.zeros(3, dtype=D))
            m.moe.router.bias[step % 3] = -100.0


UNREACHED = {
    "head": (Heads, _heads, lambda n, step: n.startswith("heads.") and n[6] != str(step % 2)),
    "layerdrop": (
        LayerDrop,
        _layerdrop,
        lambda n, step: n.startswith(f"blocks.{(1, 0, 2)[step % 3]}."),
    ),
    "expert": (MoE, _experts, lambda n, step: n == f"moe.w{step % 3}"),
}


@pytest.mark.parametrize("kind", sorted(UNREACHED))
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeros"])
def test_a_parameter_the_step_does_not_reach(kind, set_to_none):
    """A head not picked, a layer dropped, an expert that got no token: its grad1 goes as its
    .grad goes after zero_grad, None (set_to_none) or zeros, never the earlier step's."""
    make, choose, unreached = UNREACHED[kind]
    model = make().to(D)
    twin, opts, h = pair(model)
    x = torch.randn(4, 5, 3, dtype=D) if kind == "expert" else batch()[0]
    y = torch.randint(2, (4,), generator=torch.Generator().manual_seed(1))
    with h:
        for step in range(4):
            choose(model, twin, step)
            want = per_example(twin, x, y)
            for opt, m in zip(opts, (model, twin)):
                opt.zero_grad(set_to_none=set_to_none)
                ce(m(x), y).backward()
            skipped = [n for n, _ in model.named_parameters() if unreached(n, step)]
            assert skipped and all(not want[n].any() for n in skipped), "the step reaches all"
            assert_like_grad(model, twin, want, f"{kind}, step {step}")
            for opt in opts:
                opt.step()
            assert_same_params(model, twin)


def test_frozen_then_unfrozen_then_frozen_again():
    model = mlp()
    twin, opts, h = pair(model)
    with h:
        for step, frozen in enumerate([True, False, True, False]):
            for m in (model, twin):
                m[0].requires_grad_(not frozen)
            x, y = batch(seed=step)
            want = per_example(twin, x, y)
            for opt, m in zip(opts, (model, twin)):
                opt.zero_grad()
                ce(m(x), y).backward()
            assert_like_grad(model, twin, want, f"step {step}")
            if frozen:
                assert not hasattr(model[0].weight, "grad1")
            for opt in opts:
                opt.step()


def test_two_optimizers_zero_their_own_parameters():
    """A GAN-style pair of optimizers: zeroing one resets its parameters' grad1 only; the
    other's keeps adding up, as its .grad does."""
    model = mlp()
    twin = copy.deepcopy(model)
    x, y = batch(seed=0)
    x2, y2 = batch(seed=1)
    with gradhooks.add_hooks(model):
        want = per_example(twin, x, y)
        want2 = per_example(twin, x2, y2)
        for m in (model, twin):
            ce(m(x), y).backward()
            torch.optim.SGD(m[0].parameters(), lr=0.1).zero_grad()
            ce(m(x2), y2).backward()
        expected = {n: want2[n] if n.startswith("0.") else want[n] + want2[n] for n in want}
        assert_like_grad(model, twin, expected, "second backward")


# -- the rest of a training script ---------------------------------------------------------------


class Dropped(nn.Module):
    """Linear, tanh, dropout, Linear; ``mask`` replays a dropout mask (for the oracle)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.drop, self.l2 = nn.Linear(3, 6), nn.Dropout(0.5), nn.Linear(6, 2)

    def forward(self, x, mask=None):
        h = torch.tanh(self.l1(x))
        h = self.drop(h) if mask is None else h * mask * 2
        return self.l2(h)


def test_scheduler_train_eval_switches_and_an_evaluation_between_steps():
    """StepLR, dropout in train mode, and a no_grad evaluation pass in eval mode on another
    batch size between the steps. The oracle replays each step's dropout mask."""
    model = Dropped().to(D)
    twin, opts, h = pair(model, "SGD")
    scheds = [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) for opt in opts]
    masks = []
    model.drop.register_forward_hook(lambda mod, a, out: masks.append((out != 0).to(D)))
    with h:
        for step in range(3):
            x, y = batch(seed=step)
            model.train()
            masks.clear()
            for opt in opts[:1]:
                opt.zero_grad()
            ce(model(x), y).backward()
            (mask,) = masks
            want = per_example(twin, (x, mask), y)
            opts[1].zero_grad()
            ce(twin(x, mask), y).backward()
            assert_like_grad(model, twin, want, f"step {step}")
            for opt, sched in zip(opts, scheds):
                opt.step()
                sched.step()
            assert_same_params(model, twin)
            model.eval()
            with torch.no_grad():
                model(torch.randn(7, 3, dtype=D))  # evaluation: nothing captured
            for n, p in model.named_parameters():
                assert p.grad1.shape[0] == 4, n


def test_deepcopy_and_state_dict_mid_training():
    """A deep copy taken mid-training has no hooks and no grad1; saving and loading the
    model's and optimizer's state mid-training and redoing a step gives that step's grad1."""
    model = mlp()
    twin, opts, h = pair(model, "Adam")

    def step(seed):
        x, y = batch(seed=seed)
        want = per_example(twin, x, y)
        for opt, m in zip(opts, (model, twin)):
            opt.zero_grad()
            ce(m(x), y).backward()
        assert_like_grad(model, twin, want, f"step {seed}")
        for opt in opts:
            opt.step()

    with h:
        step(0)
        clone = copy.deepcopy(model)
        assert all(not hasattr(p, "grad1") for p in clone.parameters())
        ce(clone(batch()[0]), batch()[1]).backward()
        assert all(not hasattr(p, "grad1") for p in clone.parameters())
        saved = []
        for m, opt in zip((model, twin), opts):
            buf = io.BytesIO()
            torch.save({"model": m.state_dict(), "opt": opt.state_dict()}, buf)
            saved.append(buf)
        step(1)
        for m, opt, buf in zip((model, twin), opts, saved):
            buf.seek(0)
            state = torch.load(buf)
            m.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
        step(1)
        step(2)


def test_functional_gradients_without_grad():
    """torch.autograd.grad leaves .grad None: grad1 adds up over the backwards of one forward
    (retain_graph) and starts afresh at the next forward's."""
    model = mlp()
    params = list(model.parameters())
    with gradhooks.add_hooks(model) as h:
        for step in range(3):
            x, y = batch(seed=step)
            want = per_example(model, x, y)
            loss = ce(model(x), y)
            torch.autograd.grad(loss, params, retain_graph=True)
            for n, p in model.named_parameters():
                assert_close(p.grad1, want[n], f"step {step}: {n}")
            torch.autograd.grad(loss, params)
            for n, p in model.named_parameters():
                assert_close(p.grad1, 2 * want[n], f"step {step}, twice: {n}")
            assert h.accumulated == 2
            with torch.no_grad():
                for p in params:
                    p -= 0.1 * p.grad1.mean(0)
            assert all(p.grad is None for p in params)


# -- the other quantities ------------------------------------------------------------------------


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeros"])
def test_norms_and_squared_sums_follow_the_loop(set_to_none):
    """norms, sum_grad_sq and the variance are each backward's own: at every step those of the
    step's examples; a head the step does not reach has none; after a second micro-batch
    without zero_grad, the second's alone (grad1 holds the sum: norms of a sum cannot be
    formed from its parts)."""
    model = Heads().to(D)
    twin, opts, h = pair(model, quantities=("grad1", "norms", "sum_grad_sq"))
    x, y = batch()
    with h:
        for step in range(3):
            _heads(model, twin, step)
            want = per_example(twin, x, y)
            for opt, m in zip(opts, (model, twin)):
                opt.zero_grad(set_to_none=set_to_none)
                ce(m(x), y).backward()
            reached = {n for n, g in want.items() if g.any()}
            _assert_quantities(h, want, reached, f"step {step}")
            x2, y2 = batch(seed=step + 5)
            want2 = per_example(twin, x2, y2)
            for m in (model, twin):
                ce(m(x2), y2).backward()
            _assert_quantities(h, want2, reached, f"step {step}, second micro-batch")
            for n, p in model.named_parameters():
                if n in reached:
                    assert_close(p.grad1, want[n] + want2[n], f"step {step}: {n} grad1")
            for opt in opts:
                opt.step()


def _assert_quantities(h, want, reached, what):
    norms = h.param_norms()
    assert set(norms) == reached, what
    for n in reached:
        g = want[n].flatten(1)
        assert_close(norms[n], g.norm(dim=1), f"{what}: norm of {n}")
        assert_close(h.sum_grad_sq()[n], want[n].square().sum(0), f"{what}: sum_grad_sq {n}")
        var = (want[n].square().mean(0) - want[n].mean(0).square()).clamp_min(0)
        assert_close(h.grad_variance()[n], var, f"{what}: variance of {n}")
    total = torch.stack([want[n].flatten(1).square().sum(1) for n in reached]).sum(0).sqrt()
    assert_close(h.norms(), total, f"{what}: norms")


def test_kfac_factors_start_afresh_with_zero_grad():
    """kfac_factors sum over the backwards since the weights' .grad was reset: after
    zero_grad, those of the new step's backward alone (as a fresh handle gives them)."""
    model = mlp()
    x, y = batch(seed=0)
    x2, y2 = batch(seed=1)
    with gradhooks.add_hooks(model, quantities=("kfac",)) as h:
        ce(model(x), y).backward()
        ce(model(x2), y2).backward()  # no zero_grad: both
        both = h.kfac_factors()
        model.zero_grad()
        ce(model(x2), y2).backward()
        after = h.kfac_factors()
    fresh = copy.deepcopy(model)
    with gradhooks.add_hooks(fresh, quantities=("kfac",)) as h:
        ce(fresh(x2), y2).backward()
        want = h.kfac_factors()
    for name, f in want.items():
        assert_close(after[name].A, f.A, f"A of {name}")
        assert_close(after[name].G, f.G, f"G of {name}")
        assert not torch.allclose(both[name].A, f.A), "the first step's factors were not in"


F64, F32 = torch.float64, torch.float32


@pytest.mark.parametrize(
    "convert",
    [
        lambda m: m.double(),
        lambda m: m.to(torch.float64),
        lambda m: m.to(torch.bfloat16),
        lambda m: m.half().float(),
        lambda m: [setattr(m[0].weight, "data", m[0].weight.data.to(t)) for t in (F64, F32)],
    ],
    ids=["double", "to-float64", "to-bfloat16", "half-and-back", "one-parameter-and-back"],
)
def test_accumulation_after_the_model_is_converted_after_add_hooks(convert):
    """``add_hooks(model)`` then ``model.double()`` (or ``.to(dtype)``, ``.to(device)``, as
    PyTorch Lightning's precision plugins and ``model.cuda()`` do): torch gives each parameter a
    new ``AccumulateGrad`` node, so the hook that saw a backward add into ``.grad`` is put on
    the new one, and micro-batches still add up in grad1 as in ``.grad`` (grad1 started afresh
    at each one, silently, before). Also after a conversion there and back, whose data may
    land where it was."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    h = gradhooks.add_hooks(model)
    convert(model)
    dtype = next(model.parameters()).dtype
    xs = [torch.randn(5, 6, dtype=dtype) for _ in range(3)]
    ys = [torch.randint(0, 3, (5,)) for _ in range(3)]
    ref = copy.deepcopy(model).double()
    want = None
    for x, y in zip(xs, ys):
        ce(model(x), y).backward()
        one = loop_grad(ref, ce, x.double(), y)
        want = one if want is None else {n: want[n] + one[n] for n in one}
    tol = {"rtol": 1e-9, "atol": 1e-11} if dtype == torch.float64 else {"rtol": 5e-2, "atol": 5e-2}
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad1.double(), want[n], **tol)
    assert h.accumulated == 3

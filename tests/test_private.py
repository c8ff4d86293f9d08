"""DP-SGD training by gradhooks.DPOptimizer and gradhooks.make_private, against the float64
per-example loop with the noise drawn by hand from a generator of the same seed: each step's
``p.grad`` is (the clipped per-example gradients summed over every physical batch of the
logical batch + σ·C · the same Gaussian draw) / the expected batch size, and the optimizer's
step on it is that of the same torch optimizer given that gradient."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_close

C, SIGMA, E = 1.5, 0.8, 6.0  # clipping norm (between the examples' norms), σ, expected batch


def net(dtype=torch.float64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def examples(n: int, seed: int = 1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g, dtype=dtype), torch.randint(3, (n,), generator=g)


def losses_of(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def reference_grads(model, x, y, noise_gen, *, clip=C, sigma=SIGMA, expected=E):
    """(Σ_i min(1, C/‖g_i‖) g_i + σ·C·z) / E per parameter, g_i by the per-example loop,
    z drawn from ``noise_gen`` parameter after parameter."""
    loop = loop_grad(model, F.cross_entropy, x, y)
    norms = torch.cat([g.flatten(1) for g in loop.values()], 1).norm(dim=1)
    factors = torch.clamp(clip / norms, max=1.0)
    out = {}
    for (name, g), p in zip(loop.items(), model.parameters(), strict=True):
        z = torch.randn(p.shape, generator=noise_gen, dtype=p.dtype)
        out[name] = (torch.einsum("b,b...->...", factors, g) + sigma * clip * z) / expected
    return out, norms


def make_opt(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


# -- DPOptimizer ----------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["grad1", "bookkeeping", "ghost"])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_dp_optimizer_steps_on_clipped_sum_plus_noise_over_expected_batch(kind, method):
    model, ref = net(), net()
    quantity = "grad1" if method == "grad1" else "norms"
    hooks = gradhooks.add_hooks(model, quantities=(quantity,))
    accountant = gradhooks.PrivacyAccountant()
    opt = gradhooks.DPOptimizer(
        make_opt(kind, model.parameters()), hooks, max_grad_norm=C, noise_multiplier=SIGMA,
        expected_batch_size=E, sample_rate=0.1, accountant=accountant, method=method,
        generator=torch.Generator().manual_seed(7),
    )  # fmt: skip
    ref_opt = make_opt(kind, ref.parameters())
    ref_gen = torch.Generator().manual_seed(7)
    for step, sizes in enumerate([(3, 4), (5,), (2, 0, 3)]):  # physical batches of a logical one
        x, y = examples(sum(sizes), seed=step)
        start = 0
        for size in sizes:
            opt.backward(losses_of(model, x[start : start + size], y[start : start + size]))
            start += size
        assert opt.examples == sum(sizes)
        want, norms = reference_grads(ref, x, y, ref_gen)
        assert (norms > C).any() and (norms < C).any() or step > 0
        assert opt.step() is True
        for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert_close(p.grad, want[name], f"{kind}/{method} step {step}: p.grad of {name}")
            r.grad = want[name]
        ref_opt.step()
        for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert_close(p.detach(), r.detach(), f"{kind}/{method} step {step}: {name} stepped")
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
    assert accountant.history == [(SIGMA, 0.1, 3)]
    hooks.remove()


def test_dp_optimizer_accumulation_equals_one_physical_batch():
    """One logical batch in k physical batches gives the update of one physical batch of the
    same examples, up to float32 rounding of the sums' order."""
    x, y = examples(12, dtype=torch.float32)
    params = {}
    for split in ((12,), (5, 5, 2), (1,) * 12):
        model = net(torch.float32)
        with gradhooks.add_hooks(model, quantities=("norms",)) as h:
            opt = gradhooks.DPOptimizer(
                torch.optim.AdamW(model.parameters(), lr=0.01), h, max_grad_norm=C,
                noise_multiplier=SIGMA, expected_batch_size=E,
                generator=torch.Generator().manual_seed(3),
            )  # fmt: skip
            for xs, ys in zip(x.split(split), y.split(split), strict=True):
                opt.backward(losses_of(model, xs, ys))
            opt.step()
        params[split] = [p.detach().clone() for p in model.parameters()]
    one = params[(12,)]
    for split, got in params.items():
        for a, b in zip(got, one, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"split {split}")


@pytest.mark.parametrize(
    "make",
    [
        lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
        lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=3),
        lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda k: 1.0 / (k + 1)),
        lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=6),
    ],
    ids=["StepLR", "OneCycleLR", "LambdaLR", "CosineAnnealingLR"],
)
def test_any_lr_scheduler_drives_the_dp_optimizer(make):
    model, ref = net(), net()
    hooks = gradhooks.add_hooks(model, quantities=("norms",))
    opt = gradhooks.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), hooks, max_grad_norm=C,
        noise_multiplier=SIGMA, expected_batch_size=E,
        generator=torch.Generator().manual_seed(2),
    )  # fmt: skip
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    sched, ref_sched = make(opt), make(ref_opt)
    ref_gen = torch.Generator().manual_seed(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (torch warns of a scheduler stepped before its optimizer)
        for step in range(3):
            x, y = examples(5, seed=step)
            opt.backward(losses_of(model, x, y))
            opt.step()
            want, _ = reference_grads(ref, x, y, ref_gen)
            for r in ref.parameters():
                r.grad = want[next(k for k, v in ref.named_parameters() if v is r)]
            ref_opt.step()
            sched.step()
            ref_sched.step()
            opt.zero_grad()
            assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        assert_close(p.detach(), r.detach(), "parameters after 3 scheduled steps")
    assert opt.state_dict()["param_groups"][0]["lr"] == ref_opt.param_groups[0]["lr"]
    lr = ref_opt.param_groups[0]["lr"]
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
    plateau.step(1.0)
    plateau.step(2.0)  # (no better: the rate is cut, in the wrapped optimizer)
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * lr)
    hooks.remove()


def test_dp_optimizer_refuses_misuse_and_changes_nothing():
    model = net()
    hooks = gradhooks.add_hooks(model, quantities=("norms",))
    kwargs = dict(max_grad_norm=C, noise_multiplier=SIGMA, expected_batch_size=E)
    opt = gradhooks.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), hooks, **kwargs)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="no backward"):
        opt.step()
    x, y = examples(4)
    with pytest.raises(ValueError, match=r"must be \[batch\]"):
        opt.backward(F.cross_entropy(model(x), y))  # a mean, not per-example losses
    with pytest.raises(ValueError, match="2 entries"):
        opt.backward(losses_of(model, x, y)[:2])  # not one loss per example of the forward
    with pytest.raises(RuntimeError, match="no backward"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    other = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="do not clip"):
        gradhooks.DPOptimizer(
            torch.optim.SGD([*model.parameters(), other.weight], lr=0.1), hooks, **kwargs
        )
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        gradhooks.DPOptimizer(opt, hooks, **kwargs)
    with pytest.raises(ValueError, match="sample_rate"):
        gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), hooks,
            accountant=gradhooks.PrivacyAccountant(), **kwargs,
        )  # fmt: skip
    with pytest.raises(ValueError, match="expected_batch_size"):
        gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), hooks,
            max_grad_norm=C, noise_multiplier=SIGMA, expected_batch_size=0,
        )  # fmt: skip
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: None)
    hooks.remove()
    with gradhooks.add_hooks(model, quantities=("sum_grad_sq",)) as h:
        with pytest.raises(ValueError, match="norms"):
            gradhooks.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), h, **kwargs)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), h, **kwargs)
        handle = model[0].weight.register_post_accumulate_grad_hook(lambda p: None)
        with pytest.raises(ValueError, match="post-accumulate-grad"):
            opt.backward(losses_of(model, x, y))
        handle.remove()


def test_dp_optimizer_skips_and_does_not_record_a_float16_overflow():
    """A GradScaler whose scale overflows float16's output-gradients: the step is skipped
    (parameters unchanged), the scale lowered, nothing recorded; the next step runs."""
    model = net(torch.float32)
    accountant = gradhooks.PrivacyAccountant()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, backoff_factor=2.0**-30)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), h, max_grad_norm=C,
            noise_multiplier=SIGMA, expected_batch_size=E, sample_rate=0.1,
            accountant=accountant, scaler=scaler, generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
        x, y = examples(6, dtype=torch.float32)
        before = [p.detach().clone() for p in model.parameters()]
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
        opt.backward(F.cross_entropy(logits.float(), y, reduction="none"))
        assert opt.step() is False
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
        assert accountant.steps == 0 and scaler.get_scale() == 2.0**10
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
        opt.backward(F.cross_entropy(logits.float(), y, reduction="none"))
        assert opt.step() is True
        assert accountant.steps == 1
        assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))

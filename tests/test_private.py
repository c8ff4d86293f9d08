"""DP-SGD training by gradhooks.DPOptimizer and gradhooks.make_private, against the float64
per-example loop with the noise drawn by hand from a generator of the same seed: each step's
``p.grad`` is (the clipped per-example gradients summed over every physical batch of the
logical batch + σ·C · the same Gaussian draw) / the expected batch size, and the optimizer's
step on it is that of the same torch optimizer given that gradient."""

from __future__ import annotations

import copy
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
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    return x.to(dtype), torch.randint(3, (n,), generator=g)


def losses_of(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def reference_grads(model, x, y, noise_gen, *, clip=C, sigma=SIGMA, expected=E, automatic=False):
    """(Σ_i min(1, C/‖g_i‖) g_i + σ·C·z) / E per parameter (``automatic``: C/(‖g_i‖ + 0.01)
    in place of the min), g_i by the per-example loop, z drawn from ``noise_gen`` parameter
    after parameter."""
    loop = loop_grad(model, F.cross_entropy, x, y)
    norms = torch.cat([g.flatten(1) for g in loop.values()], 1).norm(dim=1)
    factors = clip / (norms + 0.01) if automatic else torch.clamp(clip / norms, max=1.0)
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
        lambda o: torch.optim.lr_scheduler.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=2),
        lambda o: torch.optim.lr_scheduler.SequentialLR(
            o,
            [
                torch.optim.lr_scheduler.ConstantLR(o, factor=0.5, total_iters=1),
                torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9),
            ],
            milestones=[1],
        ),  # fmt: skip
    ],
    ids=["StepLR", "OneCycleLR", "LambdaLR", "CosineAnnealingLR", "CyclicLR", "SequentialLR"],
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
    steps_seen = []  # (a step hook of the DPOptimizer: the wrapped optimizer runs it)
    opt.register_step_post_hook(lambda o, args, kwargs: steps_seen.append(o))
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
            assert opt.param_groups[0].get("momentum") == ref_opt.param_groups[0].get("momentum")
    assert steps_seen == [opt.optimizer] * 3
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
    with pytest.raises(gradhooks.StateError):
        opt.step()
    x, y = examples(4)
    with pytest.raises(gradhooks.ConfigurationError):
        opt.backward(F.cross_entropy(model(x), y))  # a mean, not per-example losses
    with pytest.raises(gradhooks.ConfigurationError):
        opt.backward(losses_of(model, x, y)[:2])  # not one loss per example of the forward
    with pytest.raises(gradhooks.StateError):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    other = nn.Linear(2, 2)
    with pytest.raises(gradhooks.ConfigurationError):
        gradhooks.DPOptimizer(
            torch.optim.SGD([*model.parameters(), other.weight], lr=0.1), hooks, **kwargs
        )
    with pytest.raises(gradhooks.ConfigurationTypeError):
        gradhooks.DPOptimizer(opt, hooks, **kwargs)
    with pytest.raises(gradhooks.ConfigurationError):
        gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), hooks,
            accountant=gradhooks.PrivacyAccountant(), **kwargs,
        )  # fmt: skip
    with pytest.raises(gradhooks.ConfigurationError):
        gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), hooks,
            max_grad_norm=C, noise_multiplier=SIGMA, expected_batch_size=0,
        )  # fmt: skip
    with pytest.raises(gradhooks.StateError, match="no backward"):
        opt.step(lambda: None)  # (a closure that runs no backward(losses): nothing to step)
    hooks.remove()
    with gradhooks.add_hooks(model, quantities=("sum_grad_sq",)) as h:
        with pytest.raises(gradhooks.ConfigurationError):
            gradhooks.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), h, **kwargs)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), h, **kwargs)
        handle = model[0].weight.register_post_accumulate_grad_hook(lambda p: None)
        with pytest.raises(gradhooks.ConfigurationError):
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


def test_fused_and_foreach_optimizers_with_a_grad_scaler_step_as_the_plain_one():
    """A fused AdamW unscales inside its kernel (GradScaler hands it the scale) and skips on
    the overflow flag: the same steps, skipped and taken, as the plain loop's (float32
    rounding apart)."""

    def train(**kwargs):
        model = net(torch.float32)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, backoff_factor=2.0**-30)
        with gradhooks.add_hooks(model, quantities=("norms",)) as h:
            opt = gradhooks.DPOptimizer(
                torch.optim.AdamW(model.parameters(), lr=0.01, **kwargs), h, max_grad_norm=C,
                noise_multiplier=SIGMA, expected_batch_size=E, scaler=scaler,
                generator=torch.Generator().manual_seed(0),
            )  # fmt: skip
            stepped = []
            for seed in range(3):
                x, y = examples(6, seed=seed, dtype=torch.float32)
                with torch.autocast("cpu", dtype=torch.float16):
                    logits = model(x)
                opt.backward(F.cross_entropy(logits.float(), y, reduction="none"))
                stepped.append(opt.step())
                opt.zero_grad()
        return stepped, [p.detach() for p in model.parameters()]

    plain_steps, plain = train(foreach=False)
    assert plain_steps == [False, True, True]
    for kwargs in ({"foreach": True}, {"fused": True}):
        steps, params = train(**kwargs)
        assert steps == plain_steps, kwargs
        for a, b in zip(params, plain, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=str(kwargs))


# -- make_private ---------------------------------------------------------------------------------

N = 30  # examples


def dataset(dtype=torch.float64):
    """(x, y, index) triples: the index tells the test which examples a batch held."""
    x, y = examples(N, seed=4, dtype=dtype)
    return torch.utils.data.TensorDataset(x, y, torch.arange(N))


def grads_at_step(optimizer):
    """Records every ``p.grad`` the wrapped optimizer steps on (a step pre-hook)."""
    seen: list[list[torch.Tensor]] = []
    optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append(
            [p.grad.clone() for g in opt.param_groups for p in g["params"]]
        )
    )
    return seen


def run(private, model, *, stop_after=None, autocast=None, noise_states=None, logical=None):
    """The loop of make_private's docstring; returns the physical batch sizes."""
    sizes, current = [], []
    for x, y, i in private.batches():
        sizes.append(len(i))
        current.append(i)
        if noise_states is not None and len(current) == 1:
            noise_states.append(private.optimizer.generator.get_state())
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            out = model(x)
        out = out if autocast is None else out.float()
        private.backward(F.cross_entropy(out, y, reduction="none"))
        if private.step():
            if logical is not None:
                logical.append(torch.cat(current))
            current = []
            if stop_after is not None and private.steps_taken == stop_after:
                break
    return sizes


@pytest.mark.parametrize("physical", [None, 4])
def test_make_private_steps_are_the_clipped_poisson_batch_plus_noise(physical):
    model, ref = net(), net()
    inner = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    seen = grads_at_step(inner)
    private = gradhooks.make_private(
        model, inner, dataset(), noise_multiplier=SIGMA, delta=1e-5, steps=6,
        expected_batch_size=E, max_grad_norm=C, max_physical_batch_size=physical,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    scheduler = torch.optim.lr_scheduler.StepLR(private.optimizer, step_size=2, gamma=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.3, momentum=0.9)
    ref_scheduler = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    states, logical, sizes = [], [], []
    current = []
    x_all, y_all, _ = dataset().tensors
    for x, y, i in private.batches():
        sizes.append(len(i))
        if not current:
            states.append(private.optimizer.generator.get_state())
        current.append(i)
        private.backward(F.cross_entropy(model(x), y, reduction="none"))
        if private.step():
            scheduler.step()
            logical.append(torch.cat(current))
            current = []
            idx = logical[-1]
            want, _ = reference_grads(
                ref, x_all[idx], y_all[idx], torch.Generator().set_state(states[-1])
            )
            for (name, r), got in zip(ref.named_parameters(), seen[-1], strict=True):
                assert_close(got, want[name], f"step {len(logical)}: p.grad of {name}")
                r.grad = want[name]
            ref_opt.step()
            ref_scheduler.step()
    assert private.steps_taken == len(logical) == 6
    assert len({len(b) for b in logical}) > 1, "Poisson batches vary in size"
    if physical:
        assert max(sizes) <= physical and len(sizes) > 6, sizes
    # the batches are the Poisson sampler's on the batch stream drawn from the generator
    seeds = torch.randint(2**62, (2,), generator=torch.Generator().manual_seed(0)).tolist()
    sampler = gradhooks.PoissonSampler(
        N, E, steps=6, generator=torch.Generator().manual_seed(seeds[0])
    )
    assert [b.tolist() for b in logical] == list(sampler)
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        assert_close(p.detach(), r.detach(), "parameters after 6 steps")
    accountant = gradhooks.PrivacyAccountant()
    accountant.step(noise_multiplier=SIGMA, sample_rate=E / N, steps=6)
    assert private.epsilon == accountant.epsilon(1e-5)
    assert private.accountant.history == [(SIGMA, E / N, 6)]
    private.close()


def test_make_private_accumulation_gives_the_update_of_whole_logical_batches():
    got = {}
    for physical in (None, 3, 1):
        model = net(torch.float32)
        private = gradhooks.make_private(
            model, torch.optim.AdamW(model.parameters(), lr=0.01), dataset(torch.float32),
            noise_multiplier=SIGMA, delta=1e-5, steps=4, expected_batch_size=E,
            max_grad_norm=C, max_physical_batch_size=physical,
            generator=torch.Generator().manual_seed(5),
        )  # fmt: skip
        sizes = run(private, model)
        private.close()
        assert len(sizes) >= 4 and (physical is None or max(sizes) <= physical)
        got[physical] = [p.detach().clone() for p in model.parameters()]
    for physical in (3, 1):
        for a, b in zip(got[physical], got[None], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"physical {physical}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_make_private_under_autocast_against_the_float64_loop(dtype):
    """The clipped sum of a step under autocast (the noise, known, taken out) against the
    float64 loop of the same weights: within 5e-2 of its largest entry for bfloat16 (8
    significant bits; the per-example gradients themselves are held to that in
    test_autocast), 1e-2 for float16 (11 bits), as docs/mixed-precision.md measures."""
    model = net(torch.float32)
    ref = net()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = grads_at_step(inner)
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    private = gradhooks.make_private(
        model, inner, dataset(torch.float32), noise_multiplier=SIGMA, delta=1e-5, steps=1,
        expected_batch_size=12, max_grad_norm=C, max_physical_batch_size=5, scaler=scaler,
        generator=torch.Generator().manual_seed(1),
    )  # fmt: skip
    states, logical = [], []
    run(private, model, autocast=dtype, noise_states=states, logical=logical)
    x_all, y_all, _ = dataset().tensors
    idx = logical[0]
    clean, _ = reference_grads(
        ref, x_all[idx], y_all[idx], torch.Generator(), sigma=0.0, expected=12
    )
    noise = torch.Generator().set_state(states[0])
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-2
    want = torch.cat([w.flatten() for w in clean.values()])
    got = torch.cat([
        (g.double() - SIGMA * C * torch.randn(g.shape, generator=noise).double() / 12).flatten()
        for g in seen[0]
    ])  # fmt: skip
    error = (got - want).abs().max() / want.abs().max()
    assert error < tol, f"{dtype}: relative error {error:.2e}"
    assert private.steps_taken == 1
    private.close()


def test_make_private_float16_overflow_is_skipped_and_not_accounted():
    model = net(torch.float32)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, backoff_factor=2.0**-30)
    private = gradhooks.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), dataset(torch.float32),
        noise_multiplier=SIGMA, delta=1e-5, steps=3, expected_batch_size=E, max_grad_norm=C,
        scaler=scaler, generator=torch.Generator().manual_seed(2),
    )  # fmt: skip
    logical = []
    run(private, model, autocast=torch.float16, logical=logical)
    assert len(logical) == 4, "one logical batch skipped, another drawn in its place"
    assert private.steps_taken == 3 and private.accountant.history == [(SIGMA, E / N, 3)]
    assert scaler.get_scale() == 2.0**10
    private.close()


def test_make_private_calibrates_sigma_to_the_target_and_refuses_past_the_budget():
    model = net()
    private = gradhooks.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), dataset(), target_epsilon=3.0,
        delta=1e-5, epochs=2, expected_batch_size=E, max_grad_norm=C,
        generator=torch.Generator().manual_seed(3),
    )  # fmt: skip
    assert private.steps == 2 * round(N / E)
    run(private, model)
    assert private.steps_taken == private.steps
    eps = private.epsilon
    assert 0.995 * 3.0 < eps <= 3.0, eps
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(gradhooks.PrivacyBudgetExceeded) as refused:
        next(iter(private.batches()))
    message = str(refused.value)
    assert "ε = 3" in message and "δ = 1e-05" in message and "10 of 10" in message, message
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert private.epsilon == eps
    private.close()


def stack(batch):
    """A collate function of the user's (make_private keeps it)."""
    return tuple(torch.stack([e[k] for e in batch]) for k in range(3))


@pytest.mark.parametrize(
    "where, workers",
    [("between steps", 0), ("inside a logical batch", 0), ("inside a logical batch", 2)],
)
def test_make_private_resumes_from_a_checkpoint_exactly(where, workers, tmp_path):
    """From a checkpoint, the same weights and ε as the run that was not interrupted, also
    where the loader's workers had drawn batches ahead of the training."""

    def start(seed, workers=0):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
        data = torch.utils.data.DataLoader(
            [(x, y, i) for x, y, i in dataset()], batch_size=5, shuffle=True,
            collate_fn=stack, num_workers=workers,
        )  # fmt: skip
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        private = gradhooks.make_private(
            model, opt, data, noise_multiplier=SIGMA, delta=1e-5, steps=8,
            expected_batch_size=E, max_grad_norm=C, max_physical_batch_size=3,
            generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
        return model, private

    model, whole = start(0)
    run(whole, model)
    want = [p.detach().clone() for p in model.parameters()]

    model, first = start(0, workers)
    if where == "between steps":
        run(first, model, stop_after=3)
    else:  # after the first physical batch of logical batch 4
        for x, y, _ in first.batches():
            first.backward(F.cross_entropy(model(x), y, reduction="none"))
            first.step()
            if first.steps_taken == 3 and first.optimizer.examples > 0:
                break
    torch.save(first.state_dict(), tmp_path / "ckpt.pt")
    first.close()

    model, resumed = start(123, workers)  # other weights, other seeds: all from the checkpoint
    resumed.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=False))
    assert resumed.steps_taken == 3
    run(resumed, model)
    for p, w in zip(model.parameters(), want, strict=True):
        assert torch.equal(p.detach(), w), "the resumed run's weights are the whole run's"
    assert resumed.accountant.history == whole.accountant.history
    assert resumed.epsilon == whole.epsilon


def test_make_private_refuses_a_checkpoint_of_another_plan():
    model = net()
    a = gradhooks.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), dataset(), noise_multiplier=SIGMA,
        delta=1e-5, steps=4, expected_batch_size=E, max_grad_norm=C,
    )  # fmt: skip
    state = a.state_dict()
    a.close()
    b = gradhooks.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), dataset(), noise_multiplier=1.0,
        delta=1e-5, steps=4, expected_batch_size=E, max_grad_norm=C,
    )  # fmt: skip
    with pytest.raises(gradhooks.ConfigurationError, match="noise_multiplier"):
        b.load_state_dict(state)
    b.close()


def hook_state(model):
    """Everything hooks or a run could leave on a model: the modules' hook dicts and
    attributes, the parameters' attributes, gradients and hooks."""
    out = []
    for name, m in model.named_modules():
        out.append((name, sorted(vars(m)), [
            len(getattr(m, k)) for k in sorted(vars(m)) if k.endswith("hooks")
            and hasattr(getattr(m, k), "__len__")
        ]))  # fmt: skip
    for name, p in model.named_parameters():
        out.append((name, sorted(vars(p)), p.grad is None, len(p._backward_hooks or {})))
    return out


def test_make_private_leaves_the_model_as_it_was_when_closed():
    model = net()
    before = hook_state(model)
    with gradhooks.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), dataset(), noise_multiplier=SIGMA,
        delta=1e-5, steps=2, expected_batch_size=E, max_grad_norm=C,
    ) as private:  # fmt: skip
        assert hook_state(model) != before, "the hooks are on while it runs"
        run(private, model)
    assert hook_state(model) == before
    with pytest.raises(gradhooks.StateError):
        next(iter(private.batches()))
    gradhooks.add_hooks(model).remove()  # (hooks can be added again)


def test_make_private_refuses_misuse():
    model = net()
    kwargs = dict(delta=1e-5, max_grad_norm=C, expected_batch_size=E, steps=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(gradhooks.ConfigurationError):
        gradhooks.make_private(model, opt, dataset(), **kwargs)
    with pytest.raises(gradhooks.ConfigurationError):
        gradhooks.make_private(model, opt, dataset(), noise_multiplier=1.0, epochs=1, **kwargs)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(dataset())

    with pytest.raises(gradhooks.ConfigurationTypeError):
        gradhooks.make_private(model, opt, Stream(), noise_multiplier=1.0, **kwargs)
    private = gradhooks.make_private(model, opt, dataset(), noise_multiplier=1.0, **kwargs)
    x, y, _ = dataset().tensors
    with pytest.raises(gradhooks.StateError):
        private.backward(F.cross_entropy(model(x), y, reduction="none"))
    batches = private.batches()
    xb, yb, _ = next(batches)
    with pytest.raises(gradhooks.StateError):
        private.step()
    with pytest.raises(gradhooks.ConfigurationError):
        private.backward(F.cross_entropy(model(x), y, reduction="none"))
    with pytest.raises(gradhooks.StateError, match="private.step"):
        private.optimizer.step()  # (around the owner: no budget, no logical batch)
    private.backward(F.cross_entropy(model(xb), yb, reduction="none"))
    with pytest.raises(gradhooks.StateError):
        next(batches)  # step() forgotten
    first = private.batches()
    xb, yb, _ = next(first)
    second = private.batches()
    next(second)  # (restarts the logical batch: the first loop may not go on)
    with pytest.raises(gradhooks.StateError):
        next(first)
    private.close()


def test_accountant_state_dict_round_trips_and_refuses_another_method():
    acc = gradhooks.PrivacyAccountant()
    acc.step(noise_multiplier=1.1, sample_rate=0.01, steps=5)
    acc.step(noise_multiplier=0.9, sample_rate=0.02)
    again = gradhooks.PrivacyAccountant()
    again.load_state_dict(acc.state_dict())
    assert again.history == acc.history and again.epsilon(1e-5) == acc.epsilon(1e-5)
    with pytest.raises(gradhooks.ConfigurationError):
        gradhooks.PrivacyAccountant("pld").load_state_dict(acc.state_dict())


# -- dp_sgd_step given pieces that do not fit -----------------------------------------------------


@pytest.mark.parametrize(
    "batch, expected",
    [(16, 16 / 1000), (8, 1000.0)],
    ids=["the sampling rate for the expected size", "the dataset's size for it"],
)
def test_dp_sgd_step_refuses_a_batch_no_sampler_of_that_expected_size_draws(batch, expected):
    model = net()
    x, y = examples(batch)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        with pytest.raises(gradhooks.ConfigurationError):
            gradhooks.dp_sgd_step(
                h, losses_of(model, x, y), max_norm=C, noise_multiplier=SIGMA,
                expected_batch_size=expected,
            )  # fmt: skip
    assert all(p.grad is None for p in model.parameters()), "nothing written"
    # at the edge of what a Poisson batch of that size does, no refusal
    x, y = examples(30)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        gradhooks.dp_sgd_step(
            h, losses_of(model, x, y), max_norm=C, noise_multiplier=SIGMA,
            expected_batch_size=12.0,  # 30 - 12 = 18 < 7·√12 + 7 = 31
        )  # fmt: skip


def test_dp_optimizer_refuses_a_logical_batch_far_from_its_expected_size():
    model = net()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), h, max_grad_norm=C,
            noise_multiplier=SIGMA, expected_batch_size=2.0,
        )  # fmt: skip
        for seed in range(3):  # 36 examples, where 2 are expected: 36 - 2 > 7·√2 + 7
            x, y = examples(12, seed=seed)
            opt.backward(losses_of(model, x, y))
        with pytest.raises(gradhooks.ConfigurationError):
            opt.step()
        assert all(p.grad is None for p in model.parameters())


def test_make_private_steps_on_the_noise_alone_for_an_empty_logical_batch():
    """Expected batch 0.5 of 30 examples: most logical batches are empty; each still gives a
    physical batch of 0 rows, whose step is σ·C·z / expected batch size, exactly."""
    model = net()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = grads_at_step(inner)
    private = gradhooks.make_private(
        model, inner, dataset(), noise_multiplier=SIGMA, delta=1e-5, steps=10,
        expected_batch_size=0.5, max_grad_norm=C, max_physical_batch_size=4,
        generator=torch.Generator().manual_seed(4),
    )  # fmt: skip
    states, logical = [], []
    sizes = run(private, model, noise_states=states, logical=logical)
    empty = [k for k, b in enumerate(logical) if len(b) == 0]
    assert len(empty) >= 2 and sizes.count(0) == len(empty), sizes
    for k in empty:
        noise = torch.Generator().set_state(states[k])
        for got in seen[k]:
            want = SIGMA * C * torch.randn(got.shape, generator=noise, dtype=got.dtype) / 0.5
            assert torch.equal(got, want), f"logical batch {k}: the noise alone"
    private.close()


def test_make_private_with_the_pld_accountant_records_for_it():
    model = net()
    private = gradhooks.make_private(
        model, torch.optim.SGD(model.parameters(), lr=0.1), dataset(), noise_multiplier=SIGMA,
        delta=1e-5, steps=2, sample_rate=0.2, max_grad_norm=C, accountant="pld",
    )  # fmt: skip
    assert private.expected_batch_size == pytest.approx(6.0)
    run(private, model)
    want = gradhooks.PrivacyAccountant("pld")
    want.step(noise_multiplier=SIGMA, sample_rate=0.2, steps=2)
    assert private.accountant.method == "pld"
    assert private.epsilon == want.epsilon(1e-5)
    private.close()


def test_automatic_clipping_over_physical_batches_and_its_checkpoint():
    """make_private(clipping="automatic") (AUTO-S, fastDP's default): each logical batch's
    p.grad is (Σ_i C/(‖g_i‖ + 0.01)·g_i + σ·C·z) / E over its physical batches, against the
    float64 loop, over several SGD steps; a checkpoint of it does not resume a flat-clipping
    run, and one from before the choice resumes as flat."""
    model, ref = net(), net()
    inner = torch.optim.SGD(model.parameters(), lr=0.3)
    seen = grads_at_step(inner)
    private = gradhooks.make_private(
        model, inner, dataset(), noise_multiplier=SIGMA, delta=1e-5, steps=3,
        expected_batch_size=E, max_grad_norm=C, max_physical_batch_size=4,
        generator=torch.Generator().manual_seed(0), clipping="automatic",
    )  # fmt: skip
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.3)
    states, logical = [], []
    run(private, model, noise_states=states, logical=logical)
    x_all, y_all, _ = dataset().tensors
    for step, idx in enumerate(logical):
        want, norms = reference_grads(
            ref, x_all[idx], y_all[idx], torch.Generator().set_state(states[step]),
            automatic=True,
        )  # fmt: skip
        assert (norms > 0.1).all(), "flat clipping's factors differ from these by 1e-3 or more"
        for (name, r), got in zip(ref.named_parameters(), seen[step], strict=True):
            assert_close(got, want[name], f"step {step}: p.grad of {name}")
            r.grad = want[name]
        ref_opt.step()
    state = private.state_dict()
    private.close()
    other = net()
    flat = gradhooks.make_private(
        other, torch.optim.SGD(other.parameters(), lr=0.3), dataset(), noise_multiplier=SIGMA,
        delta=1e-5, steps=3, expected_batch_size=E, max_grad_norm=C, max_physical_batch_size=4,
    )  # fmt: skip
    with pytest.raises(gradhooks.ConfigurationError, match="clipping is 'automatic'"):
        flat.load_state_dict(state)
    del state["plan"]["clipping"]
    flat.load_state_dict(state)
    flat.close()
    with pytest.raises(gradhooks.ConfigurationError, match="clipping must be one of"):
        gradhooks.make_private(
            other, torch.optim.SGD(other.parameters(), lr=0.3), dataset(),
            noise_multiplier=SIGMA, delta=1e-5, steps=3, expected_batch_size=E,
            max_grad_norm=C, clipping="per_layer",
        )  # fmt: skip


def test_dp_optimizer_step_runs_a_closure_that_backpropagates_the_losses():
    """``opt.step(closure)`` as torch's optimizers take it (PyTorch Lightning's manual
    optimization passes one): the closure runs first, with gradients enabled, and its
    ``opt.backward(losses)`` is the step's; the gradient the wrapped optimizer steps with is
    the clipped, noised sum, as without a closure."""
    model = net()
    x, y = examples(5)
    want, _ = reference_grads(copy.deepcopy(model), x, y, torch.Generator().manual_seed(3))
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), h, max_grad_norm=C,
            noise_multiplier=SIGMA, expected_batch_size=E,
            generator=torch.Generator().manual_seed(3),
        )  # fmt: skip
        with torch.no_grad():  # (an optimizer's step runs without gradients)
            assert opt.step(lambda: opt.backward(losses_of(model, x, y)))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-9, atol=1e-12)

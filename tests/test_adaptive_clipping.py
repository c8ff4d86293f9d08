"""Adaptive clipping (:class:`gradhooks.AdaptiveClipping`): the clipping bound follows a quantile
of the per-example gradient norms, updated from a noised count of the unclipped examples
(Andrew et al., NeurIPS 2021).

Checked against a float64 reference written out from the paper's update (the per-example
gradients by the loop, the noise drawn from a copy of the generator in the same order), against
Opacus' ``AdaClipDPOptimizer`` on the same model and data, for the accountant's record, the
checkpoints of :class:`gradhooks.DPOptimizer` and :func:`gradhooks.make_private`, a skipped
float16 step, and the settings it refuses.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks import AdaptiveClipping
from gradhooks.oracle import loop_grad

SIGMA, B, LR = 0.8, 6, 0.1  # noise multiplier, batch size (= expected), SGD step


def net(dtype=torch.float64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def batch(step: int, n: int = B, dtype=torch.float64):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64) * (1 + step)
    return x.to(dtype), torch.randint(3, (n,), generator=g)


def losses_of(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def reference_run(model, steps, bound, adaptive, seed, noise_dtype=None):
    """The paper's DP-SGD with adaptive clipping, written out in float64: per-example gradients
    by the loop, ``min(1, C/‖g_i‖)``, the gradient's noise with ``σ_g = (σ⁻² - (2σ_b)⁻²)^-½``,
    then the count's noise, from one generator (the gradient's drawn in ``noise_dtype``, by
    default the parameters', as the optimizer draws it in its model's); SGD by hand. Returns
    the bounds used at each step and the parameters after each."""
    gen = torch.Generator().manual_seed(seed)
    sigma_b = adaptive.count_noise if adaptive.count_noise is not None else B / 20
    sigma_g = (SIGMA**-2 - (2 * sigma_b) ** -2) ** -0.5
    bounds, params = [], []
    for step in range(steps):
        x, y = batch(step)
        loop = loop_grad(model, F.cross_entropy, x, y)
        norms = torch.cat([g.flatten(1) for g in loop.values()], 1).norm(dim=1)
        factors = torch.clamp(bound / norms, max=1.0)
        grads = []
        for g, p in zip(loop.values(), model.parameters(), strict=True):
            z = torch.randn(p.shape, generator=gen, dtype=noise_dtype or p.dtype).to(p.dtype)
            grads.append((torch.einsum("b,b...->...", factors, g) + sigma_g * bound * z) / B)
        z_b = float(torch.randn((), generator=gen, dtype=torch.float64))
        count = float((norms <= bound).sum()) + sigma_b * z_b
        bounds.append(bound)
        bound = bound * math.exp(-adaptive.learning_rate * (count / B - adaptive.target_quantile))
        bound = min(max(bound, adaptive.min_bound), adaptive.max_bound)
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads, strict=True):
                p -= LR * g
        params.append([p.detach().clone() for p in model.parameters()])
    return bounds, params, bound


def adaptive_optimizer(model, hooks, adaptive, seed, **kwargs):
    """A DPOptimizer over SGD with the tests' settings (σ, B, LR, bound 1.5) and ``adaptive``."""
    return gradhooks.DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR), hooks, max_grad_norm=1.5,
        noise_multiplier=SIGMA, expected_batch_size=B, adaptive_clipping=adaptive,
        generator=torch.Generator().manual_seed(seed), **kwargs,
    )  # fmt: skip


def dp_run(model, steps, bound, adaptive, seed, accountant=None):
    """The same with gradhooks' DPOptimizer; the bound used at each step and the parameters
    after each."""
    bounds, params = [], []
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=LR), h, max_grad_norm=bound,
            noise_multiplier=SIGMA, expected_batch_size=B, adaptive_clipping=adaptive,
            generator=torch.Generator().manual_seed(seed), accountant=accountant,
            sample_rate=None if accountant is None else 0.1,
        )  # fmt: skip
        for step in range(steps):
            x, y = batch(step)
            bounds.append(opt.max_grad_norm)
            opt.backward(losses_of(model, x, y))
            assert opt.step()
            opt.zero_grad()
            params.append([p.detach().clone() for p in model.parameters()])
        return bounds, params, opt.max_grad_norm


@pytest.mark.parametrize(
    "adaptive",
    [
        AdaptiveClipping(count_noise=1.0),
        AdaptiveClipping(target_quantile=0.8, learning_rate=0.5, count_noise=0.7),
        AdaptiveClipping(target_quantile=0.2, count_noise=2.0, min_bound=0.9, max_bound=1.6),
        AdaptiveClipping(),  # σ_b = B / 20 = 0.3 < σ / 2: refused, see the test below
    ],
    ids=["median", "0.8 fast", "clamped", "default noise"],
)
def test_the_bound_and_the_steps_follow_the_papers_update(adaptive):
    """Five steps: the bound at each step and the weights after it are the float64
    reference's, the bound moving (and, clamped, staying in its range)."""
    if adaptive.count_noise is None:
        with pytest.raises(gradhooks.ConfigurationError, match="count_noise"):
            dp_run(net(), 1, 1.5, adaptive, seed=3)
        return
    want_bounds, want_params, want_last = reference_run(net(), 5, 1.5, adaptive, seed=3)
    got_bounds, got_params, got_last = dp_run(net(), 5, 1.5, adaptive, seed=3)
    assert len(set(want_bounds)) > 1, "the bound should move in this test"
    for k, (got, want) in enumerate(zip(got_bounds + [got_last], want_bounds + [want_last])):
        assert got == pytest.approx(want, rel=1e-12), f"bound at step {k}"
        assert adaptive.min_bound <= got <= adaptive.max_bound
    for k, (got, want) in enumerate(zip(got_params, want_params, strict=True)):
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=f"step {k}")


def test_the_bound_moves_towards_the_target_quantile_of_the_norms():
    """With little noise, no learning (lr 0: the norms stay) and many steps, the bound ends near
    the target quantile of the examples' norms, from above and from below."""
    x, y = batch(0, n=40)
    model = net()
    norms = torch.cat([g.flatten(1) for g in loop_grad(model, F.cross_entropy, x, y).values()], 1)
    norms = norms.norm(dim=1)
    for quantile in (0.25, 0.75):
        want = float(norms.quantile(quantile))
        for start in (want / 20, want * 20):
            with gradhooks.add_hooks(model, quantities=("norms",)) as h:
                opt = gradhooks.DPOptimizer(
                    torch.optim.SGD(model.parameters(), lr=0.0), h, max_grad_norm=start,
                    noise_multiplier=0.0, expected_batch_size=40,
                    adaptive_clipping=AdaptiveClipping(quantile, 0.3, count_noise=1e-3),
                    generator=torch.Generator().manual_seed(0),
                )  # fmt: skip
                for _ in range(60):
                    opt.backward(losses_of(model, x, y))
                    opt.step()
                    opt.zero_grad()
            unclipped = float((norms <= opt.max_grad_norm).double().mean())
            assert abs(unclipped - quantile) <= 1 / 40 + 1e-9, (quantile, start, unclipped)


def test_the_accountant_records_the_noise_multiplier_asked_for():
    """The step's σ (gradient and count together) is recorded; the gradient's own noise is
    larger."""
    accountant = gradhooks.PrivacyAccountant()
    dp_run(net(), 3, 1.5, AdaptiveClipping(count_noise=1.0), seed=0, accountant=accountant)
    assert accountant.history == [(SIGMA, 0.1, 3)]
    adaptive = AdaptiveClipping(count_noise=1.0)
    assert adaptive.gradient_noise_multiplier(SIGMA, B) == pytest.approx(
        (SIGMA**-2 - 2.0**-2) ** -0.5
    )
    assert adaptive.gradient_noise_multiplier(SIGMA, B) > SIGMA
    assert adaptive.gradient_noise_multiplier(0.0, B) == 0.0


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_the_bound_follows_opacus_adaclip():
    """Opacus' AdaClipDPOptimizer on the same model and batches (no gradient noise, the count's
    std tiny, SGD with lr 0 so the norms stay): the same bounds step after step, and the same
    clipped gradients (Opacus divides the count by the batch's own size, here the expected
    one; its clipping factor is C/(‖g‖ + 1e-6): compared at 1e-5)."""
    opacus = pytest.importorskip("opacus")
    from opacus.optimizers import AdaClipDPOptimizer

    adaptive = AdaptiveClipping(target_quantile=0.6, learning_rate=0.3, count_noise=1e-8)
    ours, theirs = net(), net()
    theirs = opacus.GradSampleModule(theirs, loss_reduction="mean")
    opacus_opt = AdaClipDPOptimizer(
        torch.optim.SGD(theirs.parameters(), lr=0.0), noise_multiplier=0.0,
        target_unclipped_quantile=0.6, clipbound_learning_rate=0.3, max_clipbound=1e6,
        min_clipbound=0.0, unclipped_num_std=1e-8, max_grad_norm=0.2, expected_batch_size=B,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    with gradhooks.add_hooks(ours, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(ours.parameters(), lr=0.0), h, max_grad_norm=0.2,
            noise_multiplier=0.0, expected_batch_size=B, adaptive_clipping=adaptive,
            generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
        moved = set()
        for step in range(8):
            x, y = batch(step % 3)
            assert opt.max_grad_norm == pytest.approx(float(opacus_opt.max_grad_norm), rel=1e-5)
            moved.add(round(opt.max_grad_norm, 6))
            opt.backward(losses_of(ours, x, y))
            opt.step()
            F.cross_entropy(theirs(x), y).backward()
            opacus_opt.step()
            for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-9)
            opt.zero_grad()
            opacus_opt.zero_grad()
    assert len(moved) > 4, "the bound should move in this test"


def test_a_step_skipped_by_the_scaler_leaves_the_bound():
    """A float16 overflow skips the step: no count is released, the bound stays; the next step
    moves it."""
    model = net(torch.float32)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, backoff_factor=2.0**-30)
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), h, max_grad_norm=1.5,
            noise_multiplier=SIGMA, expected_batch_size=B, scaler=scaler,
            adaptive_clipping=AdaptiveClipping(count_noise=1.0),
            generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
        x, y = batch(0, dtype=torch.float32)
        state = opt.generator.get_state()
        for expected in (False, True):
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(x)
            opt.backward(F.cross_entropy(logits.float(), y, reduction="none"))
            assert opt.step() is expected
            if not expected:
                assert opt.max_grad_norm == 1.5
                assert torch.equal(opt.generator.get_state(), state), "nothing drawn"
            opt.zero_grad()
        assert opt.max_grad_norm != 1.5


def test_physical_batches_count_together():
    """A logical batch in two physical ones: one count, one update, the same as in one."""
    adaptive = AdaptiveClipping(count_noise=1.0)
    runs = []
    for split in (False, True):
        model = net()
        with gradhooks.add_hooks(model, quantities=("norms",)) as h:
            opt = adaptive_optimizer(model, h, adaptive, seed=5)
            for step in range(3):
                x, y = batch(step)
                parts = [(x[:2], y[:2]), (x[2:], y[2:])] if split else [(x, y)]
                for xs, ys in parts:
                    opt.backward(losses_of(model, xs, ys))
                opt.step()
                opt.zero_grad()
            runs.append((opt.max_grad_norm, [p.detach().clone() for p in model.parameters()]))
    assert runs[0][0] == pytest.approx(runs[1][0], rel=1e-12)
    for a, b in zip(runs[0][1], runs[1][1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_the_optimizers_state_dict_keeps_the_bound():
    """A resumed DPOptimizer continues from the bound it had (saved with the wrapped
    optimizer's state); a state without one, or one given to an optimizer without adaptive
    clipping, is refused."""
    adaptive = AdaptiveClipping(count_noise=1.0)

    def make(model, h, **kw):
        return gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), h, max_grad_norm=1.5,
            noise_multiplier=SIGMA, expected_batch_size=B,
            generator=torch.Generator().manual_seed(0), **kw,
        )  # fmt: skip

    model = net()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = make(model, h, adaptive_clipping=adaptive)
        for step in range(3):
            opt.backward(losses_of(model, *batch(step)))
            opt.step()
            opt.zero_grad()
        state = copy.deepcopy(opt.state_dict())
        assert state["adaptive_clipping_bound"] == opt.max_grad_norm != 1.5
        other = make(model, h, adaptive_clipping=adaptive)
        other.load_state_dict(state)
        assert other.max_grad_norm == opt.max_grad_norm
        assert (
            other.optimizer.state_dict()["state"].keys()
            == opt.optimizer.state_dict()["state"].keys()
        )
        plain = make(model, h)
        with pytest.raises(gradhooks.ConfigurationError, match="adaptive"):
            plain.load_state_dict(state)
        with pytest.raises(gradhooks.ConfigurationError, match="no bound"):
            other.load_state_dict(plain.state_dict())


def stack(batch):
    return tuple(torch.stack([e[k] for e in batch]) for k in range(2))


def test_make_private_resumes_with_the_bound_it_had(tmp_path):
    """make_private with adaptive clipping: a run resumed from a checkpoint ends with the
    weights and the bound of the run that was not interrupted; another adaptive setting is
    refused."""
    x, y = batch(0, n=60)
    data = torch.utils.data.TensorDataset(x, y)
    adaptive = AdaptiveClipping(target_quantile=0.7, count_noise=1.0)

    def start(seed, adaptive=adaptive):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
        private = gradhooks.make_private(
            model, torch.optim.SGD(model.parameters(), lr=0.2), data, noise_multiplier=SIGMA,
            delta=1e-5, steps=8, expected_batch_size=B, max_grad_norm=1.5,
            adaptive_clipping=adaptive, generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
        return model, private

    def run(private, model, stop_after=None):
        for xb, yb in private.batches():
            private.backward(F.cross_entropy(model(xb), yb, reduction="none"))
            if private.step() and private.steps_taken == stop_after:
                return

    model, whole = start(0)
    run(whole, model)
    want = [p.detach().clone() for p in model.parameters()]
    assert whole.max_grad_norm != 1.5
    model, first = start(0)
    run(first, model, stop_after=3)
    torch.save(first.state_dict(), tmp_path / "ckpt.pt")
    first.close()
    model, resumed = start(7)
    resumed.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=False))
    run(resumed, model)
    assert resumed.max_grad_norm == whole.max_grad_norm
    for p, w in zip(model.parameters(), want, strict=True):
        assert torch.equal(p.detach(), w)
    resumed.close()
    whole.close()
    model, other = start(0, AdaptiveClipping(target_quantile=0.5, count_noise=1.0))
    with pytest.raises(gradhooks.ConfigurationError, match="adaptive_clipping"):
        other.load_state_dict(torch.load(tmp_path / "ckpt.pt", weights_only=False))
    other.close()


def hooks_left(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) + sum(
        len(p._backward_hooks or {}) for p in model.parameters()
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(adaptive_clipping=AdaptiveClipping(count_noise=0.3)), "2 · count_noise"),
        (dict(adaptive_clipping=AdaptiveClipping(count_noise=1.0), clipping="automatic"),
         "clipping='flat'"),
        (dict(adaptive_clipping=AdaptiveClipping(count_noise=1.0), clipping_groups="parameter",
              max_grad_norm=[1.0, 1.0, 1.0, 1.0]), "one bound"),
        (dict(adaptive_clipping=AdaptiveClipping(count_noise=1.0, min_bound=2.0)),
         "outside"),
        (dict(adaptive_clipping=AdaptiveClipping(count_noise=1.0, min_bound=2.0,
                                                 max_bound=1.0)), "min_bound < max_bound"),
        (dict(adaptive_clipping=AdaptiveClipping(target_quantile=1.5, count_noise=1.0)),
         "target_quantile"),
        (dict(adaptive_clipping=AdaptiveClipping(learning_rate=0.0, count_noise=1.0)),
         "learning_rate"),
        (dict(adaptive_clipping=AdaptiveClipping(count_noise=-1.0)), "count_noise"),
        (dict(adaptive_clipping=AdaptiveClipping(target_quantile="half", count_noise=1.0)),
         "must be a number"),
        (dict(adaptive_clipping=dict(target_quantile=0.5)), "AdaptiveClipping or None"),
    ],
    ids=["count noise too small", "automatic", "groups", "bound outside", "empty range",
         "quantile", "learning rate", "negative noise", "not a number", "a dict"],
)  # fmt: skip
def test_settings_it_cannot_follow_are_refused(kwargs, match):
    """Each refused before anything changes: DPOptimizer leaves the handle as it was, and
    make_private leaves no hook on the model."""
    kwargs = {"max_grad_norm": 1.5, **kwargs}
    model = net()
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        with pytest.raises((gradhooks.ConfigurationError, gradhooks.ConfigurationTypeError),
                           match=match):  # fmt: skip
            gradhooks.DPOptimizer(
                torch.optim.SGD(model.parameters(), lr=LR), h, noise_multiplier=SIGMA,
                expected_batch_size=B, **kwargs,
            )  # fmt: skip
        assert h.active
    before = hooks_left(model)
    x, y = batch(0, n=30)
    with pytest.raises((gradhooks.ConfigurationError, gradhooks.ConfigurationTypeError),
                       match=match):  # fmt: skip
        gradhooks.make_private(
            model, torch.optim.SGD(model.parameters(), lr=LR), torch.utils.data.TensorDataset(x, y),
            noise_multiplier=SIGMA, delta=1e-5, steps=2, expected_batch_size=B, **kwargs,
        )  # fmt: skip
    assert hooks_left(model) == before == 0


def test_under_bfloat16_autocast_the_bound_and_weights_follow_the_float64_reference():
    """The model in float32 under CPU bfloat16 autocast: the same counts as the float64
    reference (no norm within 2% of the bound, ten times bfloat16's roundoff: checked), so the same bounds to
    float32 rounding, and weights within 5e-2 of the reference's change (bfloat16's unit
    roundoff is 2e-3, over a few layers)."""
    adaptive = AdaptiveClipping(target_quantile=0.6, count_noise=1.0)
    want_bounds, want_params, _ = reference_run(
        net(), 4, 1.5, adaptive, seed=2, noise_dtype=torch.float32
    )
    # (the reference's norms at each step, against its bound: a margin bfloat16 cannot cross)
    model = net()
    for step, (bound, params) in enumerate(zip(want_bounds, [None, *want_params[:-1]])):
        if params is not None:
            with torch.no_grad():
                for p, w in zip(model.parameters(), params, strict=True):
                    p.copy_(w)
        loop = loop_grad(model, F.cross_entropy, *batch(step))
        norms = torch.cat([g.flatten(1) for g in loop.values()], 1).norm(dim=1)
        assert float(((norms - bound).abs() / bound).min()) > 0.02, f"step {step}"
    start = [p.detach().clone() for p in net().parameters()]
    model = net(torch.float32)
    bounds = []
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = adaptive_optimizer(model, h, adaptive, seed=2)
        for step in range(4):
            x, y = batch(step, dtype=torch.float32)
            bounds.append(opt.max_grad_norm)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x)
            opt.backward(F.cross_entropy(logits.float(), y, reduction="none"))
            opt.step()
            opt.zero_grad()
    assert bounds == pytest.approx(want_bounds, rel=1e-5)
    for p, w, s in zip(model.parameters(), want_params[-1], start, strict=True):
        change = (w - s).abs().max()
        assert float((p.detach().double() - w).abs().max()) <= 5e-2 * float(change)

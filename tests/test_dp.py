"""The DP-SGD path around the step: privacy accounting (against Google's dp-accounting called
directly, and a published value), Poisson sampling (its statistics, its seed, its empty
batches), and the step on Poisson batches (the expected batch size) against a float64
per-example loop with the noise drawn by hand."""

from __future__ import annotations

import copy
import math
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradhooks
from gradhooks import _torch
from gradhooks.oracle import loop_grad
from harness import assert_close

# -- privacy accounting ---------------------------------------------------------------------------


def direct_accountant(schedule, method):
    """dp-accounting's own accountant, each run of equal steps composed with the library's
    ``count``, or step by step."""
    dpa = pytest.importorskip("dp_accounting")
    acc = dpa.rdp.RdpAccountant() if method == "rdp" else dpa.pld.PLDAccountant()
    for sigma, q, n, one_by_one in schedule:
        event = dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma))
        for _ in range(n if one_by_one else 1):
            acc.compose(event, 1 if one_by_one else n)
    return acc


@pytest.mark.parametrize(
    "method, schedule",
    [
        ("rdp", [(1.1, 0.01, 1000, False)]),
        ("rdp", [(1.1, 0.01, 2, True), (0.8, 0.02, 1, True), (1.1, 0.01, 1, True)]),
        ("pld", [(1.1, 0.01, 1000, False)]),
    ],
    ids=["rdp-1000-steps", "rdp-step-by-step", "pld-1000-steps"],
)
def test_epsilon_equals_dp_accounting_called_directly(method, schedule):
    acc = gradhooks.PrivacyAccountant(method)
    for sigma, q, n, _ in schedule:
        for _ in range(n):
            acc.step(noise_multiplier=sigma, sample_rate=q)
    assert acc.steps == sum(n for *_, n, _ in schedule)
    assert len(acc.history) == len(schedule), f"equal consecutive steps merge: {acc.history}"
    direct = direct_accountant(schedule, method)
    for delta in (1e-5, 1e-3):
        want = direct.get_epsilon(delta)
        got = acc.epsilon(delta)
        assert math.isclose(got, want, rel_tol=1e-9), f"{method} δ={delta}: {got} != {want}"


def test_epsilon_reproduces_tensorflow_privacys_mnist_tutorial():
    """TensorFlow Privacy's tutorials/README.md ("Select Parameters", first row): MNIST (60,000
    examples), batch 256, noise multiplier 1.12, 60 epochs: ε = 2.92 at δ = 1e-5, by its RDP
    accountant of then, which turned RDP into (ε, δ) by ε = min_α RDP(α) + log(1/δ)/(α − 1).
    The same RDP curve from our ledger gives 2.92 that way; our ε uses dp-accounting's current
    conversion (Canonne, Kamath and Steinke, 2020), which is tighter, so it lies below."""
    dpa = pytest.importorskip("dp_accounting")
    q, steps, delta, published = 256 / 60000, 60 * 60000 // 256, 1e-5, 2.92
    acc = gradhooks.PrivacyAccountant()
    acc.step(noise_multiplier=1.12, sample_rate=q, steps=steps)
    rdp = dpa.rdp.RdpAccountant()
    rdp.compose(acc.dp_event())
    classic = np.min(rdp.rdp + np.log(1 / delta) / (rdp.orders - 1))
    assert abs(classic - published) < 0.005, f"classic conversion {classic:.4f} != {published}"
    eps = acc.epsilon(delta)
    assert 0.8 * published < eps < published, f"ε {eps:.3f} against the published {published}"


def test_noise_multiplier_for_is_the_smallest_within_budget():
    pytest.importorskip("dp_accounting")
    q, steps, delta, target = 0.01, 1000, 1e-5, 2.0
    sigma = gradhooks.noise_multiplier_for(target, delta, q, steps, tol=1e-4)

    def eps(s):
        acc = gradhooks.PrivacyAccountant()
        acc.step(noise_multiplier=s, sample_rate=q, steps=steps)
        return acc.epsilon(delta)

    assert eps(sigma) <= target, f"σ={sigma}: ε {eps(sigma)} over the target {target}"
    assert eps(sigma - 3e-4) > target, f"σ={sigma} is not the smallest: {eps(sigma - 3e-4)}"


def test_accountant_edge_values_and_errors():
    pytest.importorskip("dp_accounting")
    acc = gradhooks.PrivacyAccountant()
    assert acc.epsilon(1e-5) == 0.0, "no step, no privacy spent"
    acc.step(noise_multiplier=1.0, sample_rate=0.0, steps=10)
    assert acc.epsilon(1e-5) == 0.0, "a step that samples nobody spends nothing"
    acc.step(noise_multiplier=0.0, sample_rate=0.01)
    assert acc.epsilon(1e-5) == math.inf, "a step without noise spends everything"
    with pytest.raises(gradhooks.ConfigurationError):
        acc.epsilon(0.0)
    with pytest.raises(gradhooks.ConfigurationError):
        acc.step(noise_multiplier=1.0, sample_rate=64)  # a batch size, not a rate
    with pytest.raises(gradhooks.ConfigurationError):
        acc.step(noise_multiplier=-1.0, sample_rate=0.1)
    with pytest.raises(gradhooks.ConfigurationError):
        gradhooks.PrivacyAccountant("moments")
    with pytest.raises(gradhooks.ConfigurationError):
        gradhooks.noise_multiplier_for(1.0, 1e-5, sample_rate=0.0, steps=10)


def test_without_dp_accounting_recording_works_and_epsilon_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # import dp_accounting fails
    acc = gradhooks.PrivacyAccountant()
    acc.step(noise_multiplier=1.0, sample_rate=0.01, steps=3)
    assert acc.history == [(1.0, 0.01, 3)]
    with pytest.raises(gradhooks.MissingDependencyError, match=r'pip install "gradhooks\[dp\]"'):
        acc.epsilon(1e-5)
    with pytest.raises(gradhooks.MissingDependencyError):
        gradhooks.noise_multiplier_for(1.0, 1e-5, 0.01, 100)


# -- Poisson sampling -----------------------------------------------------------------------------


def inclusion(batches, n):
    """[steps, n] 0/1: whether example j is in batch t."""
    m = torch.zeros(len(batches), n, dtype=torch.float64)
    for t, idx in enumerate(batches):
        m[t, idx] = 1.0
    return m


def test_poisson_batches_have_the_binomial_statistics():
    """n = 200, q = 0.1, 2,000 batches (seeded, so the test is deterministic; the bounds are 5
    standard errors of each statistic): sizes with mean nq and variance nq(1 - q) (a fixed-size
    batch has variance 0), each example in a fraction q of the batches, no correlation between
    two examples (sampling without replacement gives -1/(n - 1) to every pair) nor between
    consecutive batches."""
    n, expected, steps = 200, 20.0, 2000
    q = expected / n
    sampler = gradhooks.PoissonSampler(
        n, expected, steps=steps, generator=torch.Generator().manual_seed(0)
    )
    batches = list(sampler)
    assert len(batches) == steps == len(sampler)
    for idx in batches:
        assert idx == sorted(set(idx)) and all(0 <= i < n for i in idx), idx
    m = inclusion(batches, n)
    sizes = m.sum(1)
    var = n * q * (1 - q)
    assert abs(sizes.mean() - expected) < 5 * math.sqrt(var / steps), sizes.mean()
    # the sample variance's standard error: var·sqrt(2/steps) for a near-normal binomial
    assert abs(sizes.var() - var) < 5 * var * math.sqrt(2 / steps), sizes.var()
    freq = m.mean(0)
    assert (freq - q).abs().max() < 5 * math.sqrt(q * (1 - q) / steps), freq
    corr = torch.corrcoef(m.T)
    off = corr[~torch.eye(n, dtype=torch.bool)]
    # the mean of n(n-1) correlations, each with standard error 1/sqrt(steps)
    assert abs(off.mean()) < 5 / math.sqrt(steps) / math.sqrt(n), off.mean()
    lag = torch.corrcoef(torch.stack([sizes[:-1], sizes[1:]]))[0, 1]
    assert abs(lag) < 5 / math.sqrt(steps), f"consecutive batch sizes correlate: {lag}"


def test_poisson_batches_may_be_empty_as_often_as_the_binomial_says():
    n, expected, steps = 10, 0.5, 2000
    p_empty = (1 - expected / n) ** n  # 0.599
    with pytest.warns(gradhooks.GradhooksWarning, match="less than one example"):
        sampler = gradhooks.PoissonSampler(
            n, expected, steps=steps, generator=torch.Generator().manual_seed(1)
        )
    empty = sum(len(idx) == 0 for idx in sampler) / steps
    assert abs(empty - p_empty) < 5 * math.sqrt(p_empty * (1 - p_empty) / steps), empty


def test_poisson_sampler_is_reproducible_by_its_seed():
    def draw(seed, epochs=2):
        sampler = gradhooks.PoissonSampler(50, 5, generator=torch.Generator().manual_seed(seed))
        return [list(sampler) for _ in range(epochs)]

    first, second = draw(3)
    assert draw(3) == [first, second], "the same seed must give the same batches"
    assert first != second, "a second epoch continues the generator: other batches"
    assert draw(4)[0] != first, "another seed must give other batches"
    assert len(first) == 10, "by default one epoch in expectation: n / expected batches"


def test_poisson_sampler_warns_of_a_sampling_rate_given_as_the_expected_batch():
    """``PoissonSampler(1000, 0.032)``, Opacus' ``sample_rate`` in the place of the expected
    batch size: about 31,250 nearly empty batches an epoch, each of 0.032 examples expected.
    It warns, naming both readings; an expected batch of one or more does not."""
    with pytest.warns(gradhooks.GradhooksWarning, match="not a sampling rate") as caught:
        sampler = gradhooks.PoissonSampler(1000, 0.032)
    assert "expected_batch_size=q * num_examples" in str(caught[0].message)
    assert len(sampler) == 31250
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(gradhooks.PoissonSampler(1000, 32)) == 31


def test_poisson_sampler_refuses_a_rate_out_of_range():
    with pytest.raises(gradhooks.ConfigurationError):
        gradhooks.PoissonSampler(10, 20)
    with pytest.raises(gradhooks.ConfigurationError):
        gradhooks.PoissonSampler(10, 0)


def test_poisson_loader_batches_and_empty_batches():
    x, y = torch.randn(30, 3), torch.arange(30)
    data = TensorDataset(x, y)
    seed = lambda: torch.Generator().manual_seed(2)
    loader = gradhooks.poisson_loader(data, 1.0, steps=60, generator=seed())
    indices = list(gradhooks.PoissonSampler(30, 1.0, steps=60, generator=seed()))
    assert loader.batch_sampler.sample_rate == 1 / 30
    batches = list(loader)
    assert len(batches) == len(loader) == 60
    assert any(len(i) == 0 for i in indices) and any(len(i) > 1 for i in indices), indices
    for (xb, yb), idx in zip(batches, indices, strict=True):
        assert torch.equal(xb, x[idx]) and torch.equal(yb, y[idx]), idx
        assert xb.shape == (len(idx), 3) and yb.shape == (len(idx),)
    # the plain DataLoader fails on the same empty batch: what poisson_loader is for
    plain = DataLoader(data, batch_sampler=[[]])
    with pytest.raises(IndexError):
        next(iter(plain))


# -- the DP step on Poisson batches ---------------------------------------------------------------


def small_net():
    return nn.Sequential(
        nn.Conv2d(1, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 3 * 3, 4)
    ).double()


def dp_step(model, x, y, method, **kwargs):
    quantity = "grad1" if method == "grad1" else "norms"
    with gradhooks.add_hooks(model, quantities=(quantity,)) as h:
        losses = F.cross_entropy(model(x), y, reduction="none")
        norms = gradhooks.dp_sgd_step(h, losses, method=method, **kwargs)
    return norms, [p.grad.clone() for p in model.parameters()]


def hand_noise(model, seed, std):
    """std · N(0, 1) per parameter, drawn in parameter order from a generator seeded ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return [std * torch.randn(p.shape, generator=gen, dtype=p.dtype) for p in model.parameters()]


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_step_with_expected_batch_size_equals_clipped_sum_plus_noise_over_it(method):
    torch.manual_seed(0)
    model = small_net()
    n, expected = 40, 8.0
    x = torch.randn(n, 1, 5, 5, dtype=torch.float64)
    y = torch.randint(4, (n,))
    sampler = gradhooks.PoissonSampler(n, expected, generator=torch.Generator().manual_seed(5))
    idx = next(iter(sampler))
    xb, yb = x[idx], y[idx]
    assert len(idx) != expected, "a batch whose size is not the expected one"
    loop = loop_grad(model, F.cross_entropy, xb, yb)
    norms = torch.cat([g.flatten(1) for g in loop.values()], 1).norm(dim=1)
    max_norm = norms.median().item()
    assert (norms > max_norm).any() and (norms < max_norm).any(), norms
    factors = torch.clamp(max_norm / norms, max=1.0)
    sigma, seed = 0.7, 11
    got_norms, grads = dp_step(
        model, xb, yb, method, max_norm=max_norm, noise_multiplier=sigma,
        generator=torch.Generator().manual_seed(seed), expected_batch_size=expected,
    )  # fmt: skip
    assert_close(got_norms, norms, f"{method}: norms")
    noise = hand_noise(model, seed, sigma * max_norm)
    for (name, g), z, got in zip(loop.items(), noise, grads, strict=True):
        want = (torch.einsum("b,b...->...", factors, g) + z) / expected
        assert_close(got, want, f"{method}: (clipped sum + noise) / expected batch, {name}")
    _, summed = dp_step(
        model, xb, yb, method, max_norm=max_norm, noise_multiplier=sigma,
        generator=torch.Generator().manual_seed(seed), reduction="sum",
    )  # fmt: skip
    for got, s in zip(grads, summed, strict=True):
        assert_close(got, s / expected, f"{method}: reduction='sum' / expected batch size")


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_automatic_clipping_normalizes_every_example_within_the_bound(method):
    """clipping="automatic" (AUTO-S, Bu et al. 2023; fastDP's default): each example's gradient
    times C/(‖g_i‖ + 0.01), against the float64 loop, the noise as for flat clipping; every
    clipped norm stays below C (the same sensitivity), small gradients are scaled up; under
    bf16 autocast within bfloat16's rounding of the float64 sum."""
    torch.manual_seed(0)
    model = small_net()
    x = torch.randn(6, 1, 5, 5, dtype=torch.float64)
    y = torch.randint(4, (6,))
    loop = loop_grad(model, F.cross_entropy, x, y)
    norms = torch.cat([g.flatten(1) for g in loop.values()], 1).norm(dim=1)
    max_norm, sigma, seed = norms.median().item(), 0.5, 3
    factors = max_norm / (norms + 0.01)
    assert (factors > 1).any() and (factors * norms < max_norm).all()
    got_norms, grads = dp_step(
        model, x, y, method, max_norm=max_norm, noise_multiplier=sigma, clipping="automatic",
        generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip
    assert_close(got_norms, norms, f"{method}: norms")
    noise = hand_noise(model, seed, sigma * max_norm)
    for (name, g), z, got in zip(loop.items(), noise, grads, strict=True):
        want = (torch.einsum("b,b...->...", factors, g) + z) / 6
        assert_close(got, want, f"{method}: automatic clipping, {name}")
    low = copy.deepcopy(model).float()
    quantity = "grad1" if method == "grad1" else "norms"
    with gradhooks.add_hooks(low, quantities=(quantity,)) as h:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = F.cross_entropy(low(x.float()), y, reduction="none")
        gradhooks.dp_sgd_step(h, losses.float(), max_norm=max_norm, noise_multiplier=0.0,
                              method=method, clipping="automatic")  # fmt: skip
    want = torch.cat([torch.einsum("b,b...->...", factors, g).flatten() / 6 for g in loop.values()])
    got = torch.cat([p.grad.double().flatten() for p in low.parameters()])
    assert (got - want).abs().max() / want.abs().max() < 5e-2, "bf16 (8 significant bits)"
    with pytest.raises(gradhooks.ConfigurationError, match="clipping must be one of"):
        dp_step(model, x, y, method, max_norm=1.0, noise_multiplier=0.0, clipping="adaptive")


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_step_on_an_empty_batch_gives_the_noise_alone(method):
    model = small_net()
    x, y = torch.zeros(0, 1, 5, 5, dtype=torch.float64), torch.zeros(0, dtype=torch.long)
    sigma, clip, expected, seed = 1.3, 0.5, 8.0, 3
    norms, grads = dp_step(
        model, x, y, method, max_norm=clip, noise_multiplier=sigma,
        generator=torch.Generator().manual_seed(seed), expected_batch_size=expected,
    )  # fmt: skip
    assert norms.shape == (0,)
    noise = hand_noise(model, seed, sigma * clip)
    for (name, _), z, got in zip(model.named_parameters(), noise, grads, strict=True):
        assert_close(got, z / expected, f"{method}: empty batch, {name}: noise / expected batch")
    _, clean = dp_step(model, x, y, method, max_norm=clip, noise_multiplier=0.0)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in clean), "no noise, no examples: 0"


class _NoZeroRows(nn.Module):
    """A model that cannot run a batch of 0 rows (a Hugging Face attention's ``reshape(B, T,
    -1, d)`` fails on it), with a frozen layer and a sparse embedding."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 3, sparse=True)
        self.frozen = nn.Linear(3, 3).requires_grad_(False)
        self.head = nn.Linear(3, 4)

    def forward(self, ids):
        h = self.emb(ids).reshape(ids.shape[0], ids.shape[1], -1, 3).sum(2)
        return self.head(torch.tanh(self.frozen(h))).mean(1)


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_an_empty_draw_without_a_forward_steps_on_the_noise_alone(method):
    """Losses of no example and of no forward, ``torch.zeros(0)`` (the model cannot run 0
    rows): the sum over no example is zero, so every trainable parameter's gradient is its
    noise over the expected batch size, as after a forward of 0 rows, sparse where autograd's
    would be; the frozen layer's ``.grad`` stays None. Then a real batch steps as usual."""
    torch.manual_seed(0)
    model = _NoZeroRows().double()
    with pytest.raises(RuntimeError):
        model(torch.zeros(0, 5, dtype=torch.long))  # (the case meant)
    sigma, clip, expected, seed = 1.3, 0.5, 2.5, 3
    trainable = [p for p in model.parameters() if p.requires_grad]
    quantity = "grad1" if method == "grad1" else "norms"
    with gradhooks.add_hooks(model, quantities=(quantity,)) as h:
        norms = gradhooks.dp_sgd_step(
            h, torch.zeros(0, dtype=torch.float64), max_norm=clip, noise_multiplier=sigma,
            method=method, generator=torch.Generator().manual_seed(seed),
            expected_batch_size=expected,
        )  # fmt: skip
        assert norms.shape == (0,)
        gen = torch.Generator().manual_seed(seed)
        for p in trainable:
            z = sigma * clip * torch.randn(p.shape, generator=gen, dtype=p.dtype)
            assert p.grad.is_sparse == (p is model.emb.weight)
            assert_close(p.grad.to_dense(), z / expected, f"{method}: noise / expected batch")
        assert model.frozen.weight.grad is None
        for p in trainable:
            p.grad = None
        ids, y = torch.randint(7, (3, 5)), torch.randint(4, (3,))
        losses = F.cross_entropy(model(ids), y, reduction="none")
        gradhooks.dp_sgd_step(h, losses, max_norm=1e6, noise_multiplier=0.0, method=method)
        want = loop_grad(copy.deepcopy(model), lambda o, t: F.cross_entropy(o, t, reduction="sum"),
                         ids, y)  # fmt: skip
        for n, p in model.named_parameters():
            if p.requires_grad:
                assert_close(p.grad.to_dense(), want[n].sum(0) / 3, f"{method}: then {n}")


def test_an_empty_draw_without_a_forward_in_the_dp_optimizer():
    """``DPOptimizer.backward(torch.zeros(0))`` for one physical batch of a logical batch adds
    nothing to its sum: the step is the other batches' clipped sum and the noise."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.randint(2, (3,))
    want = loop_grad(copy.deepcopy(model), lambda o, t: F.cross_entropy(o, t, reduction="sum"),
                     x, y)  # fmt: skip
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        opt = gradhooks.DPOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0), h, max_grad_norm=1e6,
            noise_multiplier=0.0, expected_batch_size=4.0,
        )  # fmt: skip
        assert opt.backward(torch.zeros(0, dtype=torch.float64)).shape == (0,)
        opt.backward(F.cross_entropy(model(x), y, reduction="none"))
        opt.backward(torch.zeros(0, dtype=torch.float64))
        opt.step()
    for n, p in model.named_parameters():
        assert_close(p.grad, want[n].sum(0) / 4.0, f"the empty batches add nothing: {n}")


def test_expected_batch_size_refuses_reduction_sum_and_bad_values():
    model = nn.Linear(3, 2)
    for kwargs, match in (
        ({"reduction": "sum", "expected_batch_size": 4.0}, "contradicts reduction='sum'"),
        ({"expected_batch_size": 0.0}, "expected_batch_size must be > 0"),
    ):
        with gradhooks.add_hooks(model, quantities=("norms",)) as h:
            losses = model(torch.randn(4, 3)).sum(1)
            with pytest.raises(gradhooks.ConfigurationError, match=match):
                gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=1.0, **kwargs)


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_losses_without_a_graph_or_stepped_on_are_refused(method):
    """Detached losses (no graph to backpropagate) and losses a step already ran its backward
    through (their graph freed) are refused by name, before anything is written."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    quantities = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities) as h:
        losses = F.cross_entropy(model(x), y, reduction="none")
        with pytest.raises(gradhooks.ConfigurationError):
            gradhooks.dp_sgd_step(
                h, losses.detach(), max_norm=1.0, noise_multiplier=0.0, method=method
            )
        gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=0.0, method=method)
        stepped = [p.grad.clone() for p in model.parameters()]
        with pytest.raises(gradhooks.ConfigurationError):
            gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=0.0, method=method)
    for p, g in zip(model.parameters(), stepped):
        assert torch.equal(p.grad, g), "the refused step left .grad as the first step wrote it"


def test_varying_batch_sizes_without_expected_batch_size_warn_once():
    """Poisson batches normalised each by its own size are another mechanism than the one
    accounted: said once, naming the fix; with expected_batch_size, or fixed sizes, silent."""

    def steps(sizes, **kwargs):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with gradhooks.add_hooks(model, quantities=("norms",)) as h:
            for n in sizes:
                losses = model(torch.randn(n, 3)).pow(2).sum(1)
                gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=0.0, **kwargs)
                opt.step()

    with pytest.warns(gradhooks.GradhooksWarning, match="expected_batch_size") as said:
        steps([4, 5, 3, 6])
    assert len([w for w in said if issubclass(w.category, gradhooks.GradhooksWarning)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", gradhooks.GradhooksWarning)
        steps([4, 5, 3, 6], expected_batch_size=4.5)
        steps([4, 4, 4])
        steps([4, 5, 3], reduction="sum")


# -- the step's plan: made once per structure of the model, re-checked at every step --------------


def _want_step(model, x, y, max_norm, sigma, seed):
    """The DP step by a float64 per-example loop: per trainable parameter (in
    ``named_parameters()`` order, that of the noise), the clipped sum plus the noise drawn by
    hand, over the batch size."""
    loop = loop_grad(model, F.cross_entropy, x, y)
    norms = torch.cat([g.flatten(1) for g in loop.values()], 1).norm(dim=1)
    factors = torch.clamp(max_norm / norms, max=1.0)
    gen = torch.Generator().manual_seed(seed)
    return {
        name: (torch.einsum("b,b...->...", factors, g)
               + sigma * max_norm * torch.randn(g.shape[1:], generator=gen, dtype=g.dtype))
        / x.shape[0]
        for name, g in loop.items()
    }  # fmt: skip


class _FrozenTableThenLinear(nn.Module):
    """A LoRA-like model: the only trainable layer a Linear over the positions, behind a frozen
    table (its calls run detached where the positions are many: autograd gives no parameter a
    gradient in the book-keeping step)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(10, 6).requires_grad_(False)
        self.lin = nn.Linear(6, 3)

    def forward(self, x):
        return self.lin(self.table(x)).mean(1)


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_a_step_whose_every_parameter_runs_detached_is_not_refused(method):
    """Every trainable parameter in calls run detached (a Linear over many positions, as LoRA's
    adapters on a long sequence): the book-keeping backward gives autograd's gradient to none
    of them, and the step is still the float64 loop's, three steps in a row. (A step whose
    losses reach no hooked parameter at all is refused: tests/test_real_loops.py.)"""
    torch.manual_seed(0)
    model = _FrozenTableThenLinear().double()
    x, y = torch.randint(0, 10, (4, 8)), torch.randint(3, (4,))
    quantity = "grad1" if method == "grad1" else "norms"
    with (
        gradhooks.tuned(sum_grad1_positions=2),
        gradhooks.add_hooks(model, quantities=(quantity,)) as h,
    ):
        for seed in range(3):
            model.zero_grad(set_to_none=True)
            want = _want_step(model, x, y, 0.5, 0.3, seed)
            losses = F.cross_entropy(model(x), y, reduction="none")
            gradhooks.dp_sgd_step(
                h, losses, max_norm=0.5, noise_multiplier=0.3, method=method,
                generator=torch.Generator().manual_seed(seed),
            )  # fmt: skip
            for name, p in model.named_parameters():
                if p.requires_grad:
                    assert_close(p.grad, want[name], f"{method}, step {seed}: '{name}'")
                else:
                    assert p.grad is None, name


class _ConvThenMLP(nn.Module):
    """A convolution over positions, then Linears on one position each (an MLP's)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 3)
        self.mlp = nn.Sequential(nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 4))

    def forward(self, x):
        return self.mlp(torch.tanh(self.conv(x)).flatten(1))


def _products(step) -> int:
    """How many matrix products (``mm``, ``addmm``, ``bmm``) and convolution backwards ``step()``
    dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("mm", "addmm", "bmm", "convolution_backward"):
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step()
    return Count.n


def test_book_keeping_steps_form_no_batch_gradient_to_throw_away():
    """After a book-keeping step, the forwards run detached the Linears and convolutions whose
    batch gradient is large (``unused_grad_macs``: here every one), so that the next
    book-keeping backward forms none of the batch weight gradients autograd would throw away:
    three products fewer on an unchecked step than with the threshold out of reach. Every step
    is the float64 loop's either way, and a plain backward after them (the calls still run
    detached) gives autograd's ``.grad`` and the loop's norms."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 2, 6, dtype=torch.float64), torch.randint(4, (4,))
    counts = {}
    for reach in (1, 10**18):
        model = _ConvThenMLP().double()
        plain = copy.deepcopy(model)
        with (
            gradhooks.tuned(
                unused_grad_macs=reach, unused_grad_macs_device=reach, sum_grad1_positions=10**9
            ),
            gradhooks.add_hooks(model, quantities=("norms",)) as h,
        ):
            for seed in range(6):  # (the 5th and 6th: unchecked steps)
                model.zero_grad(set_to_none=True)
                # (on a copy: the loop's backwards would take the parameters' gradients)
                want = _want_step(copy.deepcopy(model), x, y, 0.5, 0.3, seed)

                def step(seed=seed, model=model) -> None:
                    losses = F.cross_entropy(model(x), y, reduction="none")
                    gradhooks.dp_sgd_step(
                        h, losses, max_norm=0.5, noise_multiplier=0.3, method="bookkeeping",
                        generator=torch.Generator().manual_seed(seed),
                    )  # fmt: skip

                counts[reach] = _products(step)
                for name, p in model.named_parameters():
                    assert_close(p.grad, want[name], f"reach {reach}, step {seed}: '{name}'")
                with torch.no_grad():
                    for p in model.parameters():
                        p -= p.grad
            plain.load_state_dict(model.state_dict())
            model.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            F.cross_entropy(plain(x), y).backward()
            loop = loop_grad(plain, F.cross_entropy, x, y)
            norms = torch.cat([g.flatten(1) for g in loop.values()], 1).norm(dim=1)
            assert_close(h.norms(), norms, f"reach {reach}: norms after the steps")
            for (name, p), q in zip(model.named_parameters(), plain.parameters()):
                assert_close(p.grad, q.grad, f"reach {reach}: .grad of '{name}' after the steps")
    assert counts[10**18] - counts[1] == 3, counts


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_a_parameter_frozen_added_replaced_or_removed_between_steps_is_seen(method):
    """The step's parameters are planned once per structure of the model: a change between
    two steps (a parameter frozen or unfrozen, a layer added or removed, a parameter replaced)
    gives the next step the parameters of the model as it is then, each clipped with the
    others and noised in the order of ``named_parameters()``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randint(3, (6,))
    max_norm, sigma = 0.5, 0.3
    changes = [
        ("as it is", lambda: None),
        ("a weight frozen", lambda: model[0].weight.requires_grad_(False)),
        ("a layer added", lambda: model.append(nn.Linear(3, 3).double())),
        ("a weight replaced", lambda: setattr(
            model[3], "weight", nn.Parameter(torch.randn(3, 3, dtype=torch.float64)))),
        ("a layer removed", lambda: model.__delitem__(3)),
        ("the weight unfrozen", lambda: model[0].weight.requires_grad_(True)),
    ]  # fmt: skip
    quantity = "grad1" if method == "grad1" else "norms"
    with gradhooks.add_hooks(model, quantities=(quantity,)) as h:
        for seed, (what, change) in enumerate(changes):
            change()
            model.zero_grad(set_to_none=True)
            want = _want_step(model, x, y, max_norm, sigma, seed)
            losses = F.cross_entropy(model(x), y, reduction="none")
            gradhooks.dp_sgd_step(
                h, losses, max_norm=max_norm, noise_multiplier=sigma, method=method,
                generator=torch.Generator().manual_seed(seed),
            )  # fmt: skip
            for name, p in model.named_parameters():
                if not p.requires_grad:
                    assert p.grad is None, f"{method}, {what}: frozen '{name}' got a gradient"
                    continue
                assert p.grad is not None, f"{method}, {what}: '{name}' got no gradient"
                assert_close(p.grad, want[name], f"{method}, {what}: '{name}'")


def test_the_noise_is_torch_randn_per_parameter_in_order_bit_for_bit():
    """The numbers a seeded step adds are those of ``torch.randn`` of each trainable parameter's
    shape, one after the other from the generator, times σ·C, over the batch size: exactly."""
    model = small_net()
    model[0].bias.requires_grad_(False)
    x, y = torch.zeros(0, 1, 5, 5, dtype=torch.float64), torch.zeros(0, dtype=torch.long)
    sigma, clip, expected, seed = 1.3, 0.5, 8.0, 3
    with gradhooks.add_hooks(model, quantities=("norms",)) as h:
        gradhooks.dp_sgd_step(
            h, F.cross_entropy(model(x), y, reduction="none"), max_norm=clip,
            noise_multiplier=sigma, generator=torch.Generator().manual_seed(seed),
            expected_batch_size=expected,
        )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.requires_grad:
            z = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            assert torch.equal(p.grad, z.mul_(sigma * clip).div_(expected)), name
        else:
            assert p.grad is None, name


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
def test_the_noised_step_is_the_clipped_sum_plus_the_noise_bit_for_bit(method):
    """On a batch, each parameter's noise is drawn around its clipped sum (one operation):
    the numbers of ``torch.randn`` of its shape, times σ·C, plus the clipped sum
    (:func:`gradhooks.clipped_sum`), over the batch size: exactly."""
    torch.manual_seed(0)
    x, y = torch.randn(6, 1, 5, 5, dtype=torch.float64), torch.randint(4, (6,))
    model = small_net()
    other = copy.deepcopy(model)
    sigma, clip, seed = 0.7, 0.05, 4
    _, grads = dp_step(
        model, x, y, method, max_norm=clip, noise_multiplier=sigma,
        generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip
    quantity = "grad1" if method == "grad1" else "norms"
    with gradhooks.add_hooks(other, quantities=(quantity,)) as h:
        losses = F.cross_entropy(other(x), y, reduction="none")
        sums = gradhooks.clipped_sum(h, losses, max_norm=clip, method=method).sums
    gen = torch.Generator().manual_seed(seed)
    for (name, p), s, got in zip(other.named_parameters(), sums, grads, strict=True):
        z = torch.randn(p.shape, generator=gen, dtype=p.dtype).mul_(sigma * clip)
        assert torch.equal(got, z.add_(s).div_(len(x))), name


@pytest.mark.parametrize("method", ["grad1", "ghost", "bookkeeping"])
@pytest.mark.parametrize("sigma", [0.0, 0.7])
def test_the_step_without_foreach_functions_gives_the_same_numbers(method, sigma):
    """Where torch lacks ``torch._foreach_*``, the step loops over the parameters: the same
    numbers, bit for bit."""
    torch.manual_seed(0)
    x, y = torch.randn(6, 1, 5, 5, dtype=torch.float64), torch.randint(4, (6,))
    kwargs = dict(max_norm=0.05, noise_multiplier=sigma)
    model = small_net()
    other = copy.deepcopy(model)
    _, fast = dp_step(model, x, y, method, generator=torch.Generator().manual_seed(1), **kwargs)
    with _torch.disabled("foreach"):
        _, slow = dp_step(other, x, y, method, generator=torch.Generator().manual_seed(1), **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(fast, slow, strict=True))

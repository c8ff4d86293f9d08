"""An audit of the privacy claim: what a DP-SGD step adds, and an empirical lower bound on ε.

The statistical tests state their false-alarm rate: the probability that a correct mechanism
fails them. Every test draws from fixed seeds, so a pass is repeatable; the rate says how
unlikely a failure would be on another seed. Each test also runs a broken mechanism that the
same statistic must catch, so that none of them can pass by lacking power.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import gradhooks
from gradhooks.audit import epsilon_lower_bound, one_run_p_value

stats = pytest.importorskip("scipy.stats", reason="the statistical tests use SciPy")

ALARM = 1e-4  # false-alarm rate of each statistical test below
METHODS = ["grad1", "ghost", "bookkeeping"]


def _hooked(model: nn.Module, method: str) -> gradhooks.Hooks:
    return gradhooks.add_hooks(model, quantities=("grad1",) if method == "grad1" else ("norms",))


def _variance_consistent(sample: torch.Tensor, std: float) -> bool:
    """Two-sided χ² test that ``sample`` (i.i.d. normal, mean 0) has standard deviation ``std``."""
    n = sample.numel()
    statistic = float((sample.double() ** 2).sum()) / std**2  # χ²(n) under the claim
    low, high = stats.chi2.ppf(ALARM / 2, n), stats.chi2.isf(ALARM / 2, n)
    return low <= statistic <= high


# -- the noise ------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_noise_is_sigma_times_c_per_coordinate(method):
    """With every example's gradient zero, the step's ``.grad`` (reduction "sum") is the noise
    alone: mean 0 and standard deviation σ·C in each of its 4,000 coordinates."""
    torch.manual_seed(0)
    sigma, c = 1.3, 0.5
    model = nn.Linear(400, 10, bias=False)
    h = _hooked(model, method)
    losses = model(torch.randn(8, 400)).sum(1) * 0.0  # zero gradients, a graph all the same
    gradhooks.dp_sgd_step(
        h, losses, max_norm=c, noise_multiplier=sigma, reduction="sum", method=method,
        generator=torch.Generator().manual_seed(1),
    )  # fmt: skip
    h.remove()
    noise = model.weight.grad.flatten()
    assert _variance_consistent(noise, sigma * c)
    z = float(noise.double().mean()) / (sigma * c / math.sqrt(noise.numel()))
    assert abs(z) <= stats.norm.isf(ALARM / 2)
    # the statistic has power: noise of std σ (C forgotten), or σ·C/2, is refused
    assert not _variance_consistent(noise * 2, sigma * c)
    assert not _variance_consistent(noise / 2, sigma * c)


# -- the clipping ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_each_example_contributes_at_most_c(method):
    """Example ``i``'s gradient is ``-L_i`` on coordinate ``i`` alone; without noise, the step's
    sum holds each example's clipped contribution on its own coordinate: ``min(L_i, C)``."""
    c = 1.0
    lengths = torch.tensor([0.25, 0.999, 1.0, 1.001, 3.0, 100.0, 1e4, 0.0], dtype=torch.float64)
    m = lengths.numel()
    model = nn.Linear(m, 1, bias=False).double()
    nn.init.zeros_(model.weight)
    h = _hooked(model, method)
    x = torch.diag(lengths)
    gradhooks.dp_sgd_step(
        h, -model(x).squeeze(1), max_norm=c, noise_multiplier=0.0, reduction="sum",
        method=method,
    )  # fmt: skip
    h.remove()
    contribution = -model.weight.grad.squeeze(0)
    torch.testing.assert_close(contribution, lengths.clamp(max=c), rtol=1e-12, atol=0)
    # what clipping the sum instead would give: the sum's norm cut to C, not each example's
    summed = lengths * min(1.0, c / float(lengths.norm()))
    assert not torch.allclose(contribution, summed)


# -- the sampling ---------------------------------------------------------------------------


def test_poisson_sampling_rate_is_the_accounted_one():
    """Over 400 batches of 2,000 examples at q = 0.02, the inclusions are Binomial(n·T, q) in
    total, and spread evenly over the examples (χ² over 20 blocks of 100)."""
    n, batch, steps = 2000, 40, 400
    sampler = gradhooks.PoissonSampler(
        n, batch, steps=steps, generator=torch.Generator().manual_seed(0)
    )
    q = sampler.sample_rate
    counts = torch.zeros(n)
    for idx in sampler:
        counts[idx] += 1
    total = int(counts.sum())
    assert stats.binomtest(total, n * steps, q).pvalue >= ALARM
    blocks = counts.view(20, 100).sum(1).numpy()
    assert stats.chisquare(blocks).pvalue >= ALARM
    # power: the same totals drawn at the rate of a batch one example larger are refused
    assert stats.binomtest(total, n * steps, (batch + 4) / n).pvalue < ALARM


# -- the bound ------------------------------------------------------------------------------


def test_one_run_p_value_is_the_binomial_tail_and_grows_with_delta():
    for guesses, correct, eps in [(100, 70, 0.5), (100, 100, 3.0), (40, 21, 0.0), (10, 0, 1.0)]:
        q = 1 / (1 + math.exp(-eps))
        expected = float(stats.binom.sf(correct - 1, guesses, q))
        assert one_run_p_value(1000, guesses, correct, eps, 0.0) == pytest.approx(expected)
        assert one_run_p_value(1000, guesses, correct, eps, 1e-5) >= expected
    with pytest.raises(gradhooks.ConfigurationError):
        one_run_p_value(10, 5, 6, 1.0, 0.0)


def _canary_run(mechanism: str, *, sigma: float, steps: int, seed: int, m: int = 1000):
    """One DP training run of a linear model on canaries: canary ``i``'s input is ``L·e_i``
    and its loss ``-w·x``, so its gradient is ``-L·e_i`` (``L = 100 C``), and it moves its own
    weight alone. Each is in the training set by a fair coin; every step takes the whole set
    (q = 1). Returns the weights' final values (the scores) and the coins."""
    c, length = 1.0, 100.0
    g = torch.Generator().manual_seed(seed)
    included = torch.rand(m, generator=g) < 0.5
    members = included.nonzero().squeeze(1)
    n = members.numel()
    x = torch.zeros(n, m)
    x[torch.arange(n), members] = length
    model = nn.Linear(m, 1, bias=False)
    nn.init.zeros_(model.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    h = gradhooks.add_hooks(model, quantities=("grad1",) if mechanism == "grad1" else ("norms",))
    for _ in range(steps):
        optimizer.zero_grad()
        losses = -model(x).squeeze(1)
        if mechanism in ("bookkeeping", "grad1"):
            gradhooks.dp_sgd_step(
                h, losses, max_norm=c, noise_multiplier=sigma, expected_batch_size=n,
                generator=g,
            )  # fmt: skip
        elif mechanism == "noise too small":  # σ/10 drawn, σ accounted
            gradhooks.dp_sgd_step(
                h, losses, max_norm=c, noise_multiplier=sigma / 10, expected_batch_size=n,
                generator=g,
            )  # fmt: skip
        elif mechanism == "clipping after the sum":  # the mean gradient clipped, not each
            with h.paused():
                losses.mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), c)
            model.weight.grad += torch.randn(model.weight.shape, generator=g) * sigma * c / n
        optimizer.step()
    h.remove()
    return model.weight.detach().squeeze(0), included


SIGMA, STEPS, DELTA = 10.0, 25, 1e-5


@pytest.fixture(scope="module")
def claimed_epsilon():
    pytest.importorskip("dp_accounting")
    accountant = gradhooks.PrivacyAccountant()
    accountant.step(noise_multiplier=SIGMA, sample_rate=1.0, steps=STEPS)
    return accountant.epsilon(DELTA)  # 2.17 by RDP (PLD: 1.99)


@pytest.mark.parametrize("mechanism", ["bookkeeping", "grad1"])
def test_one_run_audit_stays_below_the_accounted_epsilon(mechanism, claimed_epsilon):
    """1,000 canaries, 100 guesses, 95% confidence: the real mechanism's empirical lower bound
    is below the accountant's ε (a failure would have probability at most 5% on a new seed)."""
    scores, included = _canary_run(mechanism, sigma=SIGMA, steps=STEPS, seed=0)
    bound = epsilon_lower_bound(scores, included, guesses=100, delta=DELTA)
    assert bound < claimed_epsilon
    # and the run did leave a trace: the auditor's guesses beat chance
    top = torch.argsort(scores, descending=True)[:50]
    assert included[top].float().mean() > 0.5


@pytest.mark.parametrize("mechanism", ["noise too small", "clipping after the sum"])
def test_one_run_audit_catches_a_broken_mechanism(mechanism, claimed_epsilon):
    scores, included = _canary_run(mechanism, sigma=SIGMA, steps=STEPS, seed=0)
    bound = epsilon_lower_bound(scores, included, guesses=100, delta=DELTA)
    assert bound > claimed_epsilon, f"{mechanism}: bound {bound:.2f}, claimed {claimed_epsilon:.2f}"


def test_epsilon_lower_bound_checks_its_arguments():
    with pytest.raises(gradhooks.ConfigurationError):
        epsilon_lower_bound(torch.zeros(10), torch.zeros(9, dtype=torch.bool), guesses=4, delta=0)
    with pytest.raises(gradhooks.ConfigurationError):
        epsilon_lower_bound(torch.zeros(10), torch.zeros(10, dtype=torch.bool), guesses=12, delta=0)
    # no signal, no bound
    coins = torch.rand(1000, generator=torch.Generator().manual_seed(0)) < 0.5
    noise = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    assert epsilon_lower_bound(noise, coins, guesses=100, delta=1e-5) == 0.0

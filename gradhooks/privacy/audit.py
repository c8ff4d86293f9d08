"""Empirical privacy auditing: a lower bound on ε from one training run with canaries.

A DP library's promise is its ε, and a wrong clipping order or a wrong noise scale still trains
a model: nothing a user sees shows it. An audit measures the mechanism itself. Before training,
each of ``m`` canary examples is put into the training set or left out by a fair coin. After
training, the auditor scores every canary (how strongly the model remembers it), guesses "in"
for the ``k`` highest scores and "out" for the ``k`` lowest, and counts its correct guesses.
If the run was (ε, δ)-DP, so many correct guesses are unlikely; :func:`epsilon_lower_bound` is
the largest ε that the count refutes at the given confidence (Steinke, Nasr and Jagielski,
"Privacy auditing with one (1) training run", NeurIPS 2023, Theorem 3.1 and its δ > 0 form).

A correct mechanism gives a bound below the accountant's ε (with probability at least the
confidence); a bound above it proves that the run was not as private as accounted.
One run's bound is loose: it shows gross errors (noise too small, no per-example clipping), not
a few percent. docs/privacy-audit.md runs it on ``dp_sgd_step``.

Example::

    >>> import torch, gradhooks
    >>> included = torch.rand(1000) < 0.5              # the coins
    >>> scores = included.double() * 3 + torch.randn(1000)  # what an auditor measured
    >>> gradhooks.audit.epsilon_lower_bound(scores, included, guesses=100, delta=1e-5) > 2
    True
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..errors import ConfigurationError, require_number

__all__ = ["one_run_p_value", "epsilon_lower_bound"]


def _binomial_tail(n: int, p: float, k: int) -> float:
    """``P[Binomial(n, p) >= k]``, summed in log space."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    logs = [
        math.lgamma(n + 1) - math.lgamma(j + 1) - math.lgamma(n - j + 1)
        + j * math.log(p) + (n - j) * math.log1p(-p)
        for j in range(k, n + 1)
    ]  # fmt: skip
    top = max(logs)
    return min(1.0, math.exp(top) * sum(math.exp(v - top) for v in logs))


def _whole(where: str, **counts: float) -> None:
    """Counts are whole numbers (10.5 canaries would give a p-value of no experiment)."""
    for name, value in counts.items():
        if value != int(value):
            raise ConfigurationError(
                f"{where}: {name} counts canaries: a whole number, got {value!r}"
            )


def one_run_p_value(
    canaries: int, guesses: int, correct: int, epsilon: float, delta: float
) -> float:
    """The probability that an (ε, δ)-DP run lets an auditor make ``correct`` or more correct
    guesses out of ``guesses`` about ``canaries`` canaries, each included by a fair coin.

    For δ = 0 the count is dominated by ``Binomial(guesses, e^ε / (1 + e^ε))``, so the value is
    its tail ``β``. For δ > 0 it is ``β + 2·canaries·δ·α`` with
    ``α = max_{1<=i<=correct} (P[Binomial >= correct - i] - β) / i`` (Steinke, Nasr and
    Jagielski, 2023), at most 1.
    """
    for name, value in (("canaries", canaries), ("guesses", guesses), ("correct", correct),
                        ("epsilon", epsilon), ("delta", delta)):  # fmt: skip
        require_number(name, value, "one_run_p_value")
    _whole("one_run_p_value", canaries=canaries, guesses=guesses, correct=correct)
    if not 0 <= correct <= guesses <= canaries:
        raise ConfigurationError(
            f"need 0 <= correct <= guesses <= canaries, got correct={correct}, "
            f"guesses={guesses}, canaries={canaries}"
        )
    if not 0 <= epsilon <= math.inf or not 0 <= delta < 1:  # (NaN: neither)
        raise ConfigurationError(f"need epsilon >= 0 and delta in [0, 1), got {epsilon}, {delta}")
    q = 1.0 / (1.0 + math.exp(-epsilon))
    beta = _binomial_tail(guesses, q, correct)
    if delta == 0:
        return beta
    alpha = max(
        ((_binomial_tail(guesses, q, correct - i) - beta) / i for i in range(1, correct + 1)),
        default=0.0,
    )
    return min(1.0, beta + alpha * 2 * canaries * delta)


def epsilon_lower_bound(
    scores: Tensor,
    included: Tensor,
    *,
    guesses: int,
    delta: float,
    confidence: float = 0.95,
) -> float:
    """The largest ε for which one run's canaries refute (ε, δ)-DP at ``confidence``; ``0.0``
    where they refute none.

    Args:
        scores: ``[canaries]``, higher where the trained model remembers the canary more
            (for example the decrease of its loss, or the step of its parameter along it).
        included: ``[canaries]`` booleans, the fair coins: was the canary in the training set.
        guesses: how many canaries to guess about: ``"in"`` for the ``guesses // 2`` highest
            scores, ``"out"`` for as many lowest. Fix it before looking at the scores (a
            choice made after looking needs a union bound over the choices).
        delta: the δ of the claim being audited.
        confidence: the probability, for a run that is (ε, δ)-DP, that the bound returned is
            at most ε (so ``1 - confidence`` is the false-alarm rate of "not private").
    """
    for name, value in (("guesses", guesses), ("delta", delta), ("confidence", confidence)):
        require_number(name, value, "epsilon_lower_bound")
    _whole("epsilon_lower_bound", guesses=guesses)
    scores = torch.as_tensor(scores).detach().flatten().double().cpu()
    if not bool(torch.isfinite(scores).all()):  # (NaN sorts anywhere: the guesses arbitrary)
        bad = scores[~torch.isfinite(scores)][:3].tolist()
        raise ConfigurationError(
            f"epsilon_lower_bound: scores must be finite, got {bad} among them: score the "
            "canaries of a run that did not diverge"
        )
    coins = torch.as_tensor(included).detach().flatten().cpu()
    if coins.dtype != torch.bool and not bool(((coins == 0) | (coins == 1)).all()):
        raise ConfigurationError(
            "epsilon_lower_bound: included must hold booleans (or 0 and 1), one fair coin per "
            f"canary; got values such as {coins[(coins != 0) & (coins != 1)][:3].tolist()} "
            "(taken as True, silently, before)"
        )
    included = coins.bool()
    m = scores.numel()
    if included.numel() != m:
        raise ConfigurationError(
            f"scores has {m} canaries and included {included.numel()}: one coin per canary"
        )
    half = guesses // 2
    if half < 1 or 2 * half > m:
        raise ConfigurationError(
            f"guesses must be in [2, {m}] (the number of canaries), got {guesses}"
        )
    if not 0 < confidence < 1:
        raise ConfigurationError(f"confidence must be in (0, 1), got {confidence}")
    order = torch.argsort(scores, descending=True, stable=True)
    correct = int(included[order[:half]].sum()) + int((~included[order[m - half :]]).sum())
    r, significance = 2 * half, 1 - confidence

    def refuted(eps: float) -> bool:
        return one_run_p_value(m, r, correct, eps, delta) <= significance

    if not refuted(0.0):
        return 0.0
    lo, hi = 0.0, 1.0
    while refuted(hi):
        lo, hi = hi, 2 * hi
        if hi > 1e3:  # every guess right with a huge margin: no finite bound from this count
            return math.inf
    for _ in range(60):  # bisection to well below the bound's own resolution
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if refuted(mid) else (lo, mid)
    return lo

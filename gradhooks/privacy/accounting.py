"""Privacy accounting for DP-SGD: the ε spent so far, for a given δ, by Google's dp-accounting.

The accountant itself is Google's ``dp-accounting`` library (``pip install "gradhooks[dp]"``),
imported only when a number is asked for; gradhooks only records what the training loop did.
Each DP-SGD step that samples every example independently with probability ``q`` (Poisson
sampling, :class:`gradhooks.PoissonSampler`) and adds Gaussian noise of standard deviation
``σ·C`` to the sum of gradients clipped to norm ``C`` is the library's
``PoissonSampledDpEvent(q, GaussianDpEvent(σ))``; ``T`` such steps compose into
``SelfComposedDpEvent(..., T)``. The neighbouring datasets differ by adding or removing one
example (the relation that Poisson sampling's analysis uses).

Two accountants:

- ``"rdp"`` (default): Rényi DP (Mironov, 2017; the sampled Gaussian of Mironov, Talwar and
  Zhang, 2019), converted to (ε, δ) by Canonne, Kamath and Steinke's bound (2020). Fast (0.04
  to 0.07 s per setting of ``(σ, q)``, whatever the number of steps), an upper bound that is a
  little loose.
- ``"pld"``: privacy loss distributions (discretized as in Doroshenko et al., 2022): tighter
  (8-9% lower ε for σ = 1.1 at MNIST's usual q = 256/60000 over 60 epochs, and in
  ``examples/dp_sgd_digits.py``'s setting), slower (about 0.5 s per setting).

:meth:`PrivacyAccountant.epsilon` composes the history only when it has changed: several δ
for the same steps cost one composition. Importing the library takes about 1 s (SciPy). Its
notices about its own numerics (absl warnings about Rényi orders left out) are silenced while
it computes. docs/privacy-accounting.md compares the accountants, with Opacus' PRV, on the same
runs (``python -m bench.accountants``).

Example::

    >>> import gradhooks
    >>> acc = gradhooks.PrivacyAccountant()
    >>> for _ in range(1000):
    ...     acc.step(noise_multiplier=1.1, sample_rate=256 / 60000)
    >>> round(acc.epsilon(delta=1e-5), 2)
    0.89
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from ..errors import (
    ConfigurationError,
    ConfigurationTypeError,
    GradhooksWarning,
    MissingDependencyError,
    is_whole,
    require_number,
)

__all__ = ["PrivacyAccountant", "noise_multiplier_for", "warn_if_delta_not_small"]


def warn_if_delta_not_small(delta: float, examples: int, where: str) -> None:
    """Warn where ``delta`` is not below ``1 / examples``: an (ε, δ) guarantee with δ >= 1/n
    is met by publishing one example in the clear, so it promises nothing (Opacus warns
    too). ``where``: the call, for the message."""
    if delta >= 1 / examples:
        warnings.warn(
            f"{where}: delta={delta:g} is not below 1 / len(dataset) = 1/{examples} ({examples} "
            "examples): an (ε, δ) guarantee with δ >= 1/n is met by publishing one example in "
            "the clear, so it promises nothing. Take δ well below 1/n (1e-5 for up to about "
            "10^5 examples; 1/n^1.1 is common).",
            GradhooksWarning,
            stacklevel=3,
        )


Method = Literal["rdp", "pld"]


def _dp_accounting(what: str) -> Any:
    """The ``dp_accounting`` module, or an ImportError that says how to install it."""
    try:
        import dp_accounting
    except ImportError as e:
        raise MissingDependencyError(
            f"{what} needs Google's dp-accounting library, which is not installed: "
            'pip install "gradhooks[dp]" (or pip install dp-accounting)'
        ) from e
    return dp_accounting


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No notices from dp-accounting while it computes. Its RDP accountant logs, through
    absl, each fractional Rényi order whose series does not converge (at low noise or high
    sampling rates, several per call) and leaves that order out of the minimum, which only
    makes ε an upper bound over fewer orders: information for the library's developers, not
    for a user reading ε."""
    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"dp_accounting(\.|$)")
            yield
    finally:
        log.setLevel(level)


def _check_step(noise_multiplier: float, sample_rate: float, steps: int) -> None:
    for name, value in [
        ("noise_multiplier", noise_multiplier),
        ("sample_rate", sample_rate),
        ("steps", steps),
    ]:
        require_number(name, value)
    if not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
        raise ConfigurationError(
            f"noise_multiplier must be finite and >= 0, got {noise_multiplier!r}"
        )
    if not 0 <= sample_rate <= 1:
        raise ConfigurationError(
            f"sample_rate must be in [0, 1] (expected batch size / number of examples), "
            f"got {sample_rate!r}"
        )
    if not is_whole(steps) or steps < 0:
        raise ConfigurationError(f"steps must be a whole number >= 0, got {steps!r}")


def _check_delta(delta: float) -> None:
    require_number("delta", delta)
    if not 0 < delta < 1:
        raise ConfigurationError(
            f"delta must be in (0, 1), got {delta!r} (usually well below 1 / number of examples)"
        )


def _new_accountant(dpa: Any, method: str) -> Any:
    if method == "rdp":
        return dpa.rdp.RdpAccountant()
    if method == "pld":
        return dpa.pld.PLDAccountant()
    raise ConfigurationError(f"method must be 'rdp' or 'pld', got {method!r}")


def _event(dpa: Any, noise_multiplier: float, sample_rate: float, steps: int) -> Any:
    one = dpa.PoissonSampledDpEvent(sample_rate, dpa.GaussianDpEvent(noise_multiplier))
    return dpa.SelfComposedDpEvent(one, int(steps))


class PrivacyAccountant:
    """Records DP-SGD steps and reports the privacy they spent.

    Call :meth:`step` once per :func:`gradhooks.dp_sgd_step` (with the noise multiplier it
    used and the sampling rate ``q = expected batch size / number of examples`` of the Poisson
    sampler that drew its batch), and :meth:`epsilon` for the ε of the whole run so far at a
    given δ. Recording needs nothing but Python; :meth:`epsilon` needs the ``dp`` extra.

    Args:
        method: ``"rdp"`` (Rényi DP, the default) or ``"pld"`` (privacy loss distributions:
            tighter, slower); see :mod:`gradhooks.privacy.accounting`.

    Attributes:
        history: ``[(noise_multiplier, sample_rate, steps), ...]``, consecutive steps with the
            same noise multiplier and sampling rate merged into one entry.

    Example::

        acc = gradhooks.PrivacyAccountant()
        for x, y in loader:  # gradhooks.poisson_loader(dataset, expected_batch_size, ...)
            ...
            gradhooks.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=1.1, ...)
            acc.step(noise_multiplier=1.1, sample_rate=loader.batch_sampler.sample_rate)
        acc.epsilon(delta=1e-5)
    """

    def __init__(self, method: Method = "rdp") -> None:
        if method not in ("rdp", "pld"):
            raise ConfigurationError(f"method must be 'rdp' or 'pld', got {method!r}")
        self.method = method
        self.history: list[tuple[float, float, int]] = []
        self._composed: tuple[list[tuple[float, float, int]], Any] | None = None

    def step(self, *, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        """Record ``steps`` DP-SGD steps, each with noise ``noise_multiplier · max_norm`` on a
        batch that held every example independently with probability ``sample_rate``."""
        _check_step(noise_multiplier, sample_rate, steps)
        steps = int(steps)
        if steps == 0:
            return
        if self.history and self.history[-1][:2] == (noise_multiplier, sample_rate):
            self.history[-1] = (noise_multiplier, sample_rate, self.history[-1][2] + steps)
        else:
            self.history.append((float(noise_multiplier), float(sample_rate), steps))

    def state_dict(self) -> dict[str, Any]:
        """The method and the history, for a checkpoint (:meth:`load_state_dict`)."""
        return {"method": self.method, "history": [list(entry) for entry in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the history by a checkpoint's (:meth:`state_dict`) of the same method."""
        if not isinstance(state, Mapping):
            raise ConfigurationTypeError(
                "PrivacyAccountant.load_state_dict takes the dictionary that "
                f"PrivacyAccountant.state_dict() returned, got {type(state).__qualname__}"
            )
        if state.get("method") != self.method:
            raise ConfigurationError(
                f"this accountant's method is {self.method!r}, the checkpoint's is "
                f"{state.get('method')!r}: ε by another accountant would not continue it"
            )
        entries = state.get("history")
        if not isinstance(entries, list | tuple) or not all(
            isinstance(e, list | tuple) and len(e) == 3 for e in entries
        ):
            raise ConfigurationError(
                "the checkpoint holds no history of (noise_multiplier, sample_rate, steps) "
                f"entries (its 'history' is {entries!r}): give load_state_dict the dictionary "
                "that PrivacyAccountant.state_dict() returned"
            )
        for entry in entries:
            _check_step(*entry)
        self.history = [(float(s), float(q), int(n)) for s, q, n in entries]
        self._composed = None

    @property
    def steps(self) -> int:
        """The number of steps recorded."""
        return sum(n for _, _, n in self.history)

    def dp_event(self) -> Any:
        """The recorded steps as one ``dp_accounting.DpEvent`` (``ComposedDpEvent`` of a
        ``SelfComposedDpEvent`` per history entry), for any of the library's own accountants."""
        dpa = _dp_accounting("PrivacyAccountant.dp_event")
        return dpa.ComposedDpEvent([_event(dpa, *entry) for entry in self.history])

    def epsilon(self, delta: float) -> float:
        """ε of (ε, δ)-differential privacy for the steps recorded so far: ``0.0`` before any
        step, ``inf`` if a step had no noise (``noise_multiplier=0``) and a sampling rate
        above 0."""
        _check_delta(delta)
        dpa = _dp_accounting("PrivacyAccountant.epsilon")
        with _quiet():
            if self._composed is None or self._composed[0] != self.history:
                accountant = _new_accountant(dpa, self.method)
                accountant.compose(self.dp_event())
                self._composed = (list(self.history), accountant)  # other deltas: no recompose
            return float(self._composed[1].get_epsilon(delta))

    def __repr__(self) -> str:
        return f"PrivacyAccountant(method={self.method!r}, steps={self.steps})"


def noise_multiplier_for(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    *,
    method: Method = "rdp",
    tol: float = 1e-4,
) -> float:
    """The smallest noise multiplier ``σ`` (within ``tol``) with which ``steps`` DP-SGD steps
    at sampling rate ``sample_rate`` spend at most ``target_epsilon`` at ``delta``.

    The search is ``dp_accounting.calibrate_dp_mechanism`` (Brent's method on the library's
    accountant); the returned ``σ`` is on the private side: its ε is ``<= target_epsilon``.
    About 0.3-1 s with ``method="rdp"``; ``"pld"`` can take tens of seconds.

    Example::

        sigma = gradhooks.noise_multiplier_for(3.0, 1e-5, sample_rate=256 / 60000, steps=14062)
    """
    _check_step(0.0, sample_rate, steps)
    _check_delta(delta)
    require_number("target_epsilon", target_epsilon, "noise_multiplier_for")
    if not 0 < target_epsilon < math.inf:  # (inf: the search's bracket fails in dp_accounting)
        raise ConfigurationError(
            f"target_epsilon must be > 0, got {target_epsilon!r} (and finite: for no privacy "
            "at all, train without noise, noise_multiplier=0)"
        )
    require_number("tol", tol, "noise_multiplier_for")
    if not 0 < tol < math.inf:
        raise ConfigurationError(
            f"noise_multiplier_for: tol is the precision of the noise multiplier searched for "
            f"and must be > 0 and finite, got {tol!r}"
        )
    if steps == 0 or sample_rate == 0:
        raise ConfigurationError(
            f"with steps={steps} and sample_rate={sample_rate} no example is ever used: any "
            "noise multiplier, even 0, spends no privacy"
        )
    dpa = _dp_accounting("noise_multiplier_for")
    with _quiet():
        return float(
            dpa.calibrate_dp_mechanism(
                lambda: _new_accountant(dpa, method),
                lambda sigma: _event(dpa, sigma, sample_rate, steps),
                target_epsilon,
                delta,
                tol=tol,
            )
        )

"""Accounting is quiet: dp-accounting's notices about its own numerics never reach the user.

At low noise and high sampling rates its RDP accountant cannot sum the series of several
fractional Rényi orders; it logs each one (through absl) and leaves it out. ε is unchanged by
the silence: the number is dp-accounting's own, which tests/test_dp.py checks.
"""

from __future__ import annotations

import logging
import warnings

import pytest

import gradhooks

# σ = 0.6 at q = 0.05: orders 1.1 to 1.5 do not converge (dp-accounting 0.4 to 0.6)
LOUD = dict(noise_multiplier=0.6, sample_rate=0.05, steps=100)


def _loud_without_gradhooks(dpa) -> bool:
    """Whether dp-accounting itself logs for LOUD (else the test below proves nothing)."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("absl")
    log.addHandler(handler)
    try:
        acc = dpa.rdp.RdpAccountant()
        one = dpa.PoissonSampledDpEvent(LOUD["sample_rate"], dpa.GaussianDpEvent(0.6))
        acc.compose(dpa.SelfComposedDpEvent(one, LOUD["steps"]))
        acc.get_epsilon(1e-5)
    finally:
        log.removeHandler(handler)
    return any(r.levelno >= logging.WARNING for r in records)


@pytest.mark.parametrize("method", ["rdp", "pld"])
def test_epsilon_and_calibration_print_nothing(method, capfd):
    dpa = pytest.importorskip("dp_accounting")
    if method == "rdp" and not _loud_without_gradhooks(dpa):
        pytest.skip("this dp-accounting version does not log for the setting")
    capfd.readouterr()
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger().addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            acc = gradhooks.PrivacyAccountant(method)
            acc.step(**LOUD)
            eps = acc.epsilon(1e-5)
            if method == "rdp":
                gradhooks.noise_multiplier_for(eps, 1e-5, LOUD["sample_rate"], LOUD["steps"])
    finally:
        logging.getLogger().removeHandler(handler)
    assert eps > 0
    assert [r.getMessage() for r in records] == []
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")
    assert logging.getLogger("absl").level == logging.NOTSET  # left as it was

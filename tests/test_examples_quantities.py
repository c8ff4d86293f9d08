"""The DP-SGD and K-FAC examples run and learn (skipped without scikit-learn)."""

import os
import sys

import pytest

pytest.importorskip(
    "sklearn", reason="the examples need scikit-learn: pip install -e '.[examples]'"
)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))


def test_dp_sgd_digits_learns_and_both_paths_agree():
    import dp_sgd_digits as ex

    grad1, _, _ = ex.train(private=True, epochs=2, noise_multiplier=0.5)
    ghost, _, _ = ex.train(private=True, epochs=2, noise_multiplier=0.5, ghost=True)
    assert grad1 > 0.5, f"DP-SGD did not learn: test accuracy {grad1:.3f}"
    assert abs(grad1 - ghost) < 0.02, f"grad1 path {grad1:.3f} vs ghost path {ghost:.3f}"


def test_kfac_digits_beats_sgd_at_the_same_learning_rate():
    import kfac_digits as ex

    kfac = ex.train(kfac=True, epochs=1, lr=0.05)
    sgd = ex.train(kfac=False, epochs=1, lr=0.05)
    assert kfac > 0.8 and kfac > sgd, f"K-FAC {kfac:.3f} vs SGD {sgd:.3f}"

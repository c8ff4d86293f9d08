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


def test_kfac_digits_beats_the_best_sgd_reports_it_and_plots(tmp_path, capsys):
    pytest.importorskip(
        "matplotlib", reason="the K-FAC example's plot: pip install -e '.[examples]'"
    )
    import kfac_digits as ex

    out = tmp_path / "curves.png"
    curves = ex.main(["--epochs", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    kfac = curves.pop("K-FAC").accuracy
    best = max(c.accuracy[-1] for c in curves.values())
    assert len(kfac) == 2 and kfac[-1] > 0.8 and kfac[-1] > best, (kfac, best, printed)
    assert "epoch  1/1:" in printed and "K-FAC's gain over the best SGD: +" in printed
    assert f"the best of {', '.join(map(str, ex.SGD_LEARNING_RATES))}" in printed
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "no PNG plot written"

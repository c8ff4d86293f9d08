"""The DP-SGD and K-FAC examples run and learn (skipped without scikit-learn)."""

import os
import sys

import pytest

import gradhooks

pytest.importorskip(
    "sklearn", reason="the examples need scikit-learn: pip install -e '.[examples]'"
)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))


def test_dp_sgd_digits_learns_and_both_paths_agree():
    import dp_sgd_digits as ex

    grad1 = ex.train(private=True, epochs=2, noise_multiplier=0.5).accuracy[-1]
    ghost = ex.train(private=True, epochs=2, noise_multiplier=0.5, ghost=True).accuracy[-1]
    assert grad1 > 0.5, f"DP-SGD did not learn: test accuracy {grad1:.3f}"
    assert abs(grad1 - ghost) < 0.02, f"grad1 path {grad1:.3f} vs ghost path {ghost:.3f}"


@pytest.mark.parametrize("accountant", ["dp-accounting", "missing"])
def test_dp_sgd_digits_quick_prints_each_epoch_epsilon_and_writes_the_plot(
    accountant, tmp_path, capsys, monkeypatch
):
    pytest.importorskip("matplotlib", reason="the example's plot needs matplotlib")
    if accountant == "missing":
        monkeypatch.setitem(sys.modules, "dp_accounting", None)  # import dp_accounting fails
    else:
        pytest.importorskip("dp_accounting", reason='the dp extra: pip install "gradhooks[dp]"')
    import dp_sgd_digits as ex

    out = tmp_path / "dp.png"
    result = ex.main(["--quick", "--out", str(out)])
    text = capsys.readouterr().out
    assert result["plot"] == str(out) and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", text
    lines = [line for line in text.splitlines() if "epoch" in line]
    assert len(lines) == 4, f"a line per epoch of both runs:\n{text}"
    if accountant == "missing":
        assert result["epsilon"] is None, result
        assert "ε will not be computed: PrivacyAccountant.epsilon needs" in text, text
        assert 'pip install "gradhooks[dp]"' in text, text
        return
    acc = gradhooks.PrivacyAccountant()  # the steps the run took, recorded here
    acc.step(noise_multiplier=1.0, sample_rate=64 / 1437, steps=2 * round(1437 / 64))
    assert result["epsilon"] == pytest.approx(acc.epsilon(1e-5), rel=1e-12), text
    assert all("ε" in line for line in lines if "DP-SGD" in line), text


def test_kfac_digits_beats_the_best_sgd_and_adam_reports_it_and_plots(tmp_path, capsys):
    pytest.importorskip(
        "matplotlib", reason="the K-FAC example's plot: pip install -e '.[examples]'"
    )
    import kfac_digits as ex

    out = tmp_path / "curves.png"
    curves = ex.main(["--epochs", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    kfac = curves.pop("K-FAC")
    best = max(c.accuracy[-1] for c in curves.values())
    assert len(kfac.accuracy) == 2 and kfac.accuracy[-1] > 0.8, (kfac.accuracy, printed)
    assert kfac.accuracy[-1] > best, (kfac.accuracy, best, printed)
    assert len(kfac.loss) == len(kfac.seconds) > 10 and kfac.seconds == sorted(kfac.seconds)
    assert "epoch  1/1:" in printed
    assert "K-FAC's gain over the best SGD: +" in printed, printed
    assert "K-FAC's gain over the best Adam: +" in printed, printed
    assert f"the best of {', '.join(map(str, ex.SGD_LEARNING_RATES))}" in printed
    assert f"the best of {', '.join(map(str, ex.ADAM_LEARNING_RATES))}" in printed
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "no PNG plot written"

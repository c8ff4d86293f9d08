"""The DP-SGD, DPTrainer and K-FAC examples run and learn (skipped without scikit-learn)."""

import math
import os
import sys

import pytest

import gradhooks

pytest.importorskip(
    "sklearn", reason="the examples need scikit-learn: pip install -e '.[examples]'"
)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))


def test_dp_sgd_digits_private_run_learns_and_spends_what_its_accountant_says():
    pytest.importorskip("dp_accounting", reason='the dp extra: pip install "gradhooks[dp]"')
    import dp_sgd_digits as ex

    run = ex.train(private=True, epochs=2, noise_multiplier=0.5, with_epsilon=True)
    steps = 2 * round(1437 / 64)  # make_private's 2 epochs of round(1 / q) Poisson batches
    assert run.steps == steps and run.sample_rate == 64 / 1437, (run.steps, run.sample_rate)
    assert len(run.accuracy) == len(run.epsilon) == len(run.loss) == 2, run
    acc = gradhooks.PrivacyAccountant()  # the steps the run took, recorded here
    acc.step(noise_multiplier=0.5, sample_rate=64 / 1437, steps=steps // 2)
    first = acc.epsilon(1e-5)
    acc.step(noise_multiplier=0.5, sample_rate=64 / 1437, steps=steps // 2)
    assert run.epsilon == pytest.approx([first, acc.epsilon(1e-5)], rel=1e-12), run.epsilon
    assert 0 < run.epsilon[0] < run.epsilon[1] < math.inf, run.epsilon
    assert run.accuracy[-1] > 0.5, f"DP-SGD did not learn: test accuracy {run.accuracy[-1]:.3f}"


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
    assert result["dp"] > 0.3, f"the private run is no better than chance (0.1):\n{text}"
    if accountant == "missing":
        assert result["epsilon"] is None, result
        assert "ε will not be computed: PrivacyAccountant.epsilon needs" in text, text
        assert 'pip install "gradhooks[dp]"' in text, text
        return
    acc = gradhooks.PrivacyAccountant()  # the steps the run took, recorded here
    acc.step(noise_multiplier=1.0, sample_rate=64 / 1437, steps=2 * round(1437 / 64))
    assert result["epsilon"] == pytest.approx(acc.epsilon(1e-5), rel=1e-12), text
    assert 0 < result["epsilon"] < math.inf, text
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


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("adapter", ["whole model", "LoRA adapter"])
def test_dp_trainer_quick_logs_the_accountants_epsilon_at_each_step(adapter, capsys):
    transformers = pytest.importorskip(
        "transformers", reason='the DPTrainer example needs transformers: "gradhooks[hf]"'
    )
    pytest.importorskip("dp_accounting", reason='the dp extra: pip install "gradhooks[dp]"')
    argv = ["--quick"]
    if adapter == "LoRA adapter":
        pytest.importorskip("peft", reason='the --lora run needs peft: "gradhooks[hf]"')
        argv.append("--lora")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    import dp_trainer as ex

    result = ex.main(argv)
    text = capsys.readouterr().out
    q = 32 / 1024  # L = 16 x 2 gradient accumulation steps, over 1024 sequences
    assert result["steps"] == 4 and result["sample_rate"] == q, (result, text)
    acc = gradhooks.PrivacyAccountant()  # the budget the run was calibrated to: ε = 8 at 4 steps
    acc.step(noise_multiplier=result["noise_multiplier"], sample_rate=q, steps=4)
    assert 7.9 < acc.epsilon(1e-5) <= 8.0, (acc.epsilon(1e-5), text)
    expected = []
    acc = gradhooks.PrivacyAccountant()
    for step in range(1, 5):
        acc.step(noise_multiplier=result["noise_multiplier"], sample_rate=q)
        expected.append((step, acc.epsilon(1e-5)))
    assert [s for s, _ in result["logged"]] == [1, 2, 3, 4], (result["logged"], text)
    assert [e for _, e in result["logged"]] == pytest.approx([e for _, e in expected], rel=1e-9)
    assert result["epsilon"] == pytest.approx(expected[-1][1], rel=1e-12)
    lines = [line for line in text.splitlines() if line.startswith("step ")]
    assert len(lines) == 4 and all("loss" in line and "ε" in line for line in lines), text
    assert f"{adapter}: 4 steps" in text and "checked:" in text, text
    assert "{'loss'" not in text, f"the Trainer's own log dicts were printed too:\n{text}"
    if adapter == "whole model":  # (4 noisy steps: measured 3.50 -> 3.00, seeded)
        assert result["loss_after"] < result["loss_before"] - 0.2, (result, text)

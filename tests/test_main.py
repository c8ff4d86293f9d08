"""The main job (``python -m gradhooks``): it times the three methods, judges their agreement
in float64, exits 0 when they agree and 1 when they do not, and explains every flag."""

import pytest
import torch

import gradhooks.__main__ as main

QUICK = ["--batch", "3", "--repeats", "1", "--device", "cpu"]


def test_main_job_agrees(capsys):
    assert main.main(QUICK) == 0
    out = capsys.readouterr().out
    assert "Time, float32" in out and "Agreement, float64" in out
    assert "vmap(grad)" in out and "per-example loop" in out
    assert "agree: in float64" in out and "tolerance 1e-10" in out


def test_main_job_exits_1_when_the_hooks_disagree(monkeypatch, capsys):
    """The last example's gradient of one weight off by 1e-6 of the largest gradient: below
    what float32 could tell apart from its rounding, far above the float64 tolerance. (The
    timing, which this test does not need, is skipped.)"""
    right = main.hooks_grad1

    def wrong(model, data, targets):
        grad1 = right(model, data, targets)
        assert grad1["conv2.weight"].dtype == torch.float64, "agreement is judged in float64"
        scale = max(g.abs().max() for g in grad1.values())
        grad1["conv2.weight"][-1, 0, 0, 0, 0] += 1e-6 * scale
        return grad1

    monkeypatch.setattr(main, "hooks_grad1", wrong)
    monkeypatch.setattr(main, "_timed", lambda fn, repeats, device: 1.0)
    assert main.main(QUICK) == 1
    out = capsys.readouterr().out
    assert "DISAGREE: in float64" in out and "agree:" not in out
    assert "from vmap(grad)'s by 1.0e-06 and from the loop's by 1.0e-06" in out, out


def test_help_explains_every_flag(capsys):
    for action in main.parser()._actions:
        assert action.help, f"python -m gradhooks {'/'.join(action.option_strings)} has no help"
    with pytest.raises(SystemExit) as exit_:
        main.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out, "the description shows the docstring's RST markup"
    assert "float64" in out and "Exit status" in out
    for flag in ("--batch", "--device", "--repeats", "--loop-repeats"):
        assert flag in out

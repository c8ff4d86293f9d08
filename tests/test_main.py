"""The main job (`python -m gradhooks`) runs and reports agreement."""

import gradhooks.__main__ as main


def test_main_job_agrees(capsys):
    assert main.main(["--batch", "8", "--repeats", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "agree:" in out and "vmap(grad)" in out and "per-example loop" in out

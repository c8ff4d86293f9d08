"""The benchmark suite runs, checks every method against vmap(grad), and reports peers that
cannot run instead of crashing. No timings are asserted."""

import json
import os

import pytest

pytest.importorskip("bench.run")

from bench import measure, methods, report  # noqa: E402
from bench.problems import PROBLEMS  # noqa: E402
from bench.run import main  # noqa: E402


def test_bench_runs_and_writes_table_and_json(tmp_path, capsys):
    argv = ["--models", "mlp", "--methods", "plain,floor,vmap,ew,grad1", "--batch", "3"]
    argv += ["--reps", "1", "--out", str(tmp_path), "--no-plot", "--no-memory"]
    assert main(argv) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    by_method = {r["method"]: r for r in data["records"]}
    assert set(by_method) == {"plain", "floor", "vmap", "ew", "grad1"}
    for name in ("vmap", "ew", "grad1"):
        assert by_method[name]["status"] == "ok", by_method[name]
        assert by_method[name]["rel_err"] < 1e-4
    assert all(len(r["times_s"]) == 1 for r in data["records"])
    table = (tmp_path / "results.md").read_text()
    assert "gradhooks grad1" in table and "MLP 784-512-512-10" in table
    assert table in capsys.readouterr().out


def test_suite_names_its_files_and_flags_override_it(tmp_path):
    from bench.suites import SUITES

    for suite in SUITES.values():  # every table names models and methods the bench has
        assert set(suite.models.split(",")) <= set(PROBLEMS)
        assert set(suite.methods.split(",")) <= set(methods.METHODS)
    argv = ["--suite", "dp", "--models", "mlp", "--methods", "plain,plain-sgd,dp-bk"]
    argv += ["--batch", "3", "--reps", "1", "--out", str(tmp_path), "--no-plot", "--no-memory"]
    assert main(argv) == 0
    data = json.loads((tmp_path / "dp-cpu.json").read_text())
    assert data["suite"] == "dp" and data["title"] == SUITES["dp"].title
    assert {r["method"] for r in data["records"]} == {"plain", "plain-sgd", "dp-bk"}
    assert {r["batch"] for r in data["records"]} == {3}
    assert (tmp_path / "dp-cpu.md").read_text().startswith(f"# {SUITES['dp'].title}")


def _fails(setup):
    raise RuntimeError("this peer does not like the model")


def _missing(setup):
    methods._need("no_such_peer_package")


@pytest.mark.parametrize(
    "make, status", [(_fails, "unsupported"), (_missing, "missing")], ids=["fails", "missing"]
)
def test_failing_or_missing_peer_is_reported(make, status):
    problem = PROBLEMS["mlp"]
    model, x, y = measure.instance(problem, 2, "cpu")
    method = methods.Method("peer", "a peer", "grad1", make)
    rec, runner = measure.prepare(problem, method, model, x, y, None, "cpu")
    assert runner is None and rec.status == status and rec.reason
    data = {
        "command": "test", "reps": 1,
        "machine": {"cpu": "cpu", "cores": 1, "torch_threads": 1, "torch": "t", "python": "p"},
        "records": [rec.as_dict()],
    }  # fmt: skip
    assert f"{status} [1]" in report.markdown(data)


def test_wrong_result_is_flagged():
    problem = PROBLEMS["mlp"]
    model, x, y = measure.instance(problem, 2, "cpu")
    ref = measure.reference(problem, model, x, y)

    def off_by_one(setup):
        runner = methods.gradhooks_grad1(setup)
        good = runner.result
        return methods.Runner(
            runner.step, lambda: {n: g + 1 for n, g in good().items()}, reset=runner.reset
        )

    method = methods.Method("bad", "bad", "grad1", off_by_one)
    rec, _ = measure.prepare(problem, method, model, x, y, ref, "cpu")
    assert rec.status == "wrong" and rec.rel_err > 1e-3


def test_keep_freed_memory_flag(tmp_path):
    """``--keep-freed-memory`` (in a subprocess: it changes the process's allocator) runs the
    bench; on glibc it takes effect, elsewhere it says that nothing changed."""
    import platform
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    argv = ["--models", "mlp", "--methods", "plain,grad1", "--batch", "3", "--reps", "1"]
    argv += ["--no-plot", "--no-memory", "--keep-freed-memory", "--out", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-m", "bench", *argv], cwd=root, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert {r["method"]: r["status"] for r in data["records"]} == {"plain": "ok", "grad1": "ok"}
    glibc = platform.libc_ver()[0] == "glibc"
    assert ("nothing changed" in done.stdout) is not glibc, done.stdout[-2000:]


def test_ab_runs_each_version_in_its_own_process(capsys):
    """``python -m bench.ab`` times a method against plain for two versions (the last commit
    and the working tree), one process per run, and reports both."""
    import subprocess
    from pathlib import Path

    from bench import ab

    root = Path(__file__).resolve().parent.parent
    if subprocess.run(
        ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True
    ).returncode:
        pytest.skip("not a git checkout")
    argv = ["--revs", "HEAD,.", "--model", "mlp", "--method", "grad1", "--batch", "3"]
    assert ab.main([*argv, "--rounds", "1", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "mlp, grad1 / plain, batch 3, 1 processes each:" in out
    for rev in ("HEAD", "."):
        assert f"{rev}: median" in out, out


def test_sum_grad_sq_and_kfac_methods(tmp_path):
    """The squared sums are checked against vmap(grad); BackPACK's exact K-FAC factors (where
    BackPACK is installed) against gradhooks' on the Linear layers."""
    names = ["plain", "vmap-sgs", "opacus-sgs", "ew-sgs", "sgs", "backpack-sgs", "kfac"]
    names += ["kfac-mc", "backpack-kflr"]
    argv = ["--models", "mlp,cifarcnn", "--methods", ",".join(names), "--batch", "3"]
    argv += ["--reps", "1", "--out", str(tmp_path), "--no-plot", "--no-memory"]
    assert main(argv) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    for r in data["records"]:
        if r["method"].startswith(("backpack", "opacus")) and r["status"] == "missing":
            continue
        assert r["status"] == "ok", r
        if r["method"] in (
            "vmap-sgs",
            "opacus-sgs",
            "ew-sgs",
            "sgs",
            "backpack-sgs",
            "backpack-kflr",
        ):
            assert r["rel_err"] < 1e-4, r


def test_wrong_kfac_factors_are_flagged():
    import gradhooks

    problem = PROBLEMS["mlp"]
    model, x, y = measure.instance(problem, 4, "cpu")

    def doubled(setup):
        def result():
            f = gradhooks.kfac(setup.model, setup.x, fisher="exact", bias=False)
            return {n: (2 * k.G, k.A) for n, k in f.items()}

        return methods.Runner(lambda: None, result)

    method = methods.Method("bad", "bad", "kfac", doubled)
    rec, _ = measure.prepare(problem, method, model, x, y, None, "cpu")
    assert rec.status == "wrong" and rec.rel_err > 0.5, rec


def test_fsdp_bench_times_three_methods(tmp_path, capsys):
    """``python -m bench.fsdp`` at its tiniest (2 gloo processes, one example each, 4 tokens,
    one step, no memory pass): the three methods in the JSON, gradhooks' DP step timed, and,
    where Opacus ran, the check agreeing."""
    pytest.importorskip("opacus")
    pytest.importorskip("transformers")
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("no gloo backend")
    from bench import fsdp

    argv = ["--procs", "2", "--batch", "1", "--seq", "4", "--reps", "1", "--no-memory"]
    assert fsdp.main([*argv, "--timeout", "120", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "fsdp-cpu.json").read_text())
    by_method = {r["method"]: r for r in data["records"]}
    assert set(by_method) == {"plain", "dp-bk", "opacus-ghost-fsdp"}
    for name in ("plain", "dp-bk"):
        assert by_method[name]["status"] == "ok", by_method[name]
        assert len(by_method[name]["times_s"]) == 1
        assert len(by_method[name]["rank_times_s"]) == 2
    if by_method["opacus-ghost-fsdp"]["status"] == "ok":
        assert data["check"]["agree"] is True, data["check"]
    assert (tmp_path / "fsdp-cpu.md").read_text() in capsys.readouterr().out


def test_host_suite_smoke(tmp_path):
    """``--suite host`` at one step: each tiny model at its own batch, at one thread, and every
    cell of the table either timed (gradhooks' always, checked against vmap(grad)) or a peer
    that could not run with its reason."""
    import torch

    from bench.suites import SUITES

    pytest.importorskip("transformers")
    threads = torch.get_num_threads()
    try:
        assert main(["--suite", "host", "--reps", "1", "--out", str(tmp_path), "--no-plot"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    data = json.loads((tmp_path / "host-cpu.json").read_text())
    suite = SUITES["host"]
    assert data["batch"] == "own" and data["clock"] == "cpu"
    cells = {(r["model"], r["method"]): r for r in data["records"]}
    assert set(cells) == {(m, x) for m in suite.models.split(",") for x in suite.methods.split(",")}
    for (model, method), r in cells.items():
        assert r["batch"] == PROBLEMS[model].batch
        if r["status"] == "ok":
            assert len(r["times_s"]) == 1 and r["median_s"] > 0, r
        else:
            assert r["status"] in ("unsupported", "missing") and r["reason"], r
            assert method.startswith("opacus") or method == "vmap", r
        if method in ("grad1", "norms"):
            assert r["status"] == "ok" and r["rel_err"] < 1e-4, r
    table = (tmp_path / "host-cpu.md").read_text()
    assert "each model at its own batch" in table
    for model in suite.models.split(","):
        row = next(
            line for line in table.splitlines() if line.startswith(f"| {PROBLEMS[model].label} |")
        )
        assert "grad1 " in row and "norms " in row and "DP step " in row, row


def test_host_goals_and_ratios_to_a_base():
    """The host goals (at most 2.5x plain and 0.7x Opacus' fastest mode giving as much), and
    the compiled methods' ratios taken to compiled plain."""

    def rec(method, seconds, status="ok"):
        return {"model": "tiny-mlp", "method": method, "status": status, "median_s": seconds}

    records = [
        rec("plain", 1.0), rec("opacus", 4.0), rec("opacus-ghost", 3.0), rec("grad1", 2.0),
        rec("norms", 2.2), rec("opacus-dp", 5.0), rec("opacus-dp-ghost", None, "unsupported"),
        rec("dp-bk", 3.6), rec("compile-plain", 0.5), rec("compile-grad1", 4.0),
    ]  # fmt: skip
    goals = report.host_goals(records, "tiny-mlp")
    assert "grad1 met (2.00x plain, 0.50x Opacus' fastest)" in goals
    assert "norms missed (2.20x plain, 0.73x Opacus' fastest)" in goals  # (ghost: 3.0)
    assert "DP step missed (3.60x plain, 0.72x Opacus' fastest)" in goals
    t = report.ratios(records, "tiny-mlp", "median_s")
    assert t["compile-grad1"] == 8.0 and t["compile-plain"] == 0.5 and t["grad1"] == 2.0
    assert "opacus-dp-ghost" not in t


def test_graph_break_kinds():
    kind = methods.graph_break_kind
    assert (
        kind(
            "Attempted to inline function marked as skipped\n  Explanation: Dynamo developers have "
            "intentionally marked that the function `WeakIdKeyDictionary.get` should not be traced."
        )
        == "Attempted to inline function marked as skipped (WeakIdKeyDictionary.get)"
    )
    assert (
        kind(
            "Skip calling `torch.compiler.disable()`d function Explanation: Skip calling function "
            "`<function Forwards._on_root_pre at 0x7f0b52519ee0>` since it was wrapped"
        )
        == "Skip calling `torch.compiler.disable()`d function (Forwards._on_root_pre)"
    )
    assert kind("Read uninitialized cell. Explanation: Attempted to read") == (
        "Read uninitialized cell"
    )


@pytest.mark.slow  # (compiling two models' steps: ~1 min here)
def test_compiled_methods(tmp_path):
    """``--compile``: grad1 and the DP step on torch.compile(model) run (grad1 checked against
    vmap(grad)), their notes say how torch.compile broke the graph."""
    pytest.importorskip("torch._dynamo")
    argv = ["--models", "tiny-mlp", "--methods", "plain,grad1", "--compile", "--batch", "own"]
    argv += ["--reps", "1", "--threads", "1", "--out", str(tmp_path), "--no-plot", "--no-memory"]
    import torch

    threads = torch.get_num_threads()
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    data = json.loads((tmp_path / "results.json").read_text())
    by_method = {r["method"]: r for r in data["records"]}
    assert set(by_method) == {"plain", "grad1", "compile-plain", "compile-grad1", "compile-dp"}
    for r in by_method.values():
        assert r["status"] == "ok", r
    assert by_method["compile-grad1"]["rel_err"] < 1e-4
    assert "graphs compiled" in by_method["compile-grad1"]["notes"]


def test_gpu_script_without_cuda(capsys, monkeypatch):
    """``python -m bench.gpu`` lists its stages (the host, grad1 and workloads suites on
    cuda), and where there is no CUDA device says so and measures nothing."""
    import torch

    from bench import gpu

    assert gpu.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    for suite in ("host", "grad1", "workloads"):
        assert f"--suite {suite}" in out
    assert "tests/test_cuda.py" in out and out.count("--device cuda") == 7
    assert sum(limit for _, _, limit in gpu.stages(gpu.ROOT)) == gpu.BUDGET <= 10 * 60
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu.main([]) == 1
    assert gpu.NO_DEVICE in capsys.readouterr().err


def test_gpu_script_keeps_to_its_budget_and_packs_each_stage(tmp_path, monkeypatch):
    """Each stage's limit is cut to what is left of ``--budget``; a stage past it is stopped
    and the next reported as not run; after every stage the results folder (the summary and
    the log among it) is packed into ``--pack``'s archive."""
    import sys
    import tarfile

    from bench import gpu

    py = sys.executable
    plan = [
        ("quick", [py, "-c", "pass"], 30),
        ("slow", [py, "-c", "import time; time.sleep(60)"], 60),
        ("late", [py, "-c", "pass"], 30),
    ]
    monkeypatch.setattr(gpu, "stages", lambda out, device: plan)
    monkeypatch.setattr(gpu, "WHEELS", tmp_path / "no-wheels")
    out, archive = tmp_path / "results", tmp_path / "back" / "gpu-results.tar.gz"
    args = ["--device", "cpu", "--out", str(out), "--pack", str(archive), "--budget", "12"]
    assert gpu.main(args) == 1
    summary = (out / "gpu-summary.txt").read_text().splitlines()
    assert summary[1].startswith("quick: ok,")
    assert summary[2].startswith("slow: stopped after its limit of ")
    assert int(summary[2].split("limit of ")[1].split(" s")[0]) < 12
    assert summary[3] == "late: not run, the budget of 12 s spent"
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert {"results/gpu-summary.txt", "results/gpu-log.txt"} <= names


def _tiny_wheel(folder, name: str = "gh_peer_probe") -> None:
    """A wheel of one module, ``name``, with ``VALUE = 7``, written by hand (no build)."""
    import zipfile

    info = f"{name}-0.1.dist-info"
    files = {
        f"{name}.py": "VALUE = 7\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(folder / f"{name}-0.1-py3-none-any.whl", "w") as z:
        for f, text in files.items():
            z.writestr(f, text)


def test_gpu_script_installs_the_carried_wheels(tmp_path):
    """On the device machine the peers come as wheels in ``.whl/``: installed into a folder of
    their own, first on the stages' ``PYTHONPATH``; without wheels the environment is as it
    was. ``--fetch-wheels`` asks pip for the peers, for the device's Python, without their
    dependencies."""
    import subprocess
    import sys

    from bench import gpu

    assert gpu.install_wheels(tmp_path / "none", tmp_path / "site") == dict(os.environ)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _tiny_wheel(wheels)
    env = gpu.install_wheels(wheels, tmp_path / "site")
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path / "site")
    out = subprocess.run([sys.executable, "-c", "import gh_peer_probe as m; print(m.VALUE)"],
                         env=env, capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert out.strip() == "7"
    cmd = gpu.fetch_wheels_command(tmp_path)
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
    assert cmd[cmd.index("--python-version") + 1] == gpu.DEVICE_PYTHON
    assert any(w.startswith("opacus==") for w in cmd)


def test_host_profile_counts_the_tracker(tmp_path):
    """``python -m bench.host_profile`` on the tiny MLP: the tracker's calls are counted (it
    finds the tracker where the package keeps it), the dispatched operations are counted (the
    backward's among them, and a DP step's), and the profile has a gradhooks share."""
    import torch

    from bench import host_profile

    threads = torch.get_num_threads()
    try:
        assert (
            host_profile.main(["--models", "tiny-mlp", "--reps", "2", "--out", str(tmp_path)]) == 0
        )
    finally:
        torch.set_num_threads(threads)
    (model,) = json.loads((tmp_path / "host-profile-cpu.json").read_text())["models"]
    assert model["torch_functions_plain_forward"] > 0
    assert model["tracker_calls_forward"] > 0
    ops = model["dispatched_ops"]
    assert ops["plain fwd+bwd"]["aten::mm"] > 0  # (the backward's, by the autograd engine)
    assert sum(ops["grad1 fwd+bwd"].values()) > sum(ops["plain fwd+bwd"].values())
    assert ops["dp step"]["aten::normal"] > 0  # (the DP step's noise: one draw per parameter)
    assert 0 < model["profile"]["tracker_share"] <= model["profile"]["gradhooks_share"] <= 1
    # every stage the MLP's step passes through was timed, within the step's own time
    st = model["stages_us"]
    labels = [label for label, _ in host_profile.STAGES]
    assert all(st[k] > 0 for k in labels if k != "parameters' hooks")
    assert sum(st[k] for k in labels) <= st["grad1 step"] and st["plain fwd+bwd"] > 0
    assert host_profile.Hook.__call__ is host_profile.HOOK_CALL  # (put back)


def test_stage_clock_counts_a_stage_once_where_nested():
    """A stage entered inside another (a hook run by the engine's own backward) counts to the
    outer one only."""
    from bench import host_profile

    with host_profile.StageClock() as clock:
        clock._timed("forward starts", lambda: clock._timed("backward ends", sum, range(10**5)))
    assert clock.ns["forward starts"] > 0 and clock.ns["backward ends"] == 0


def test_check_memory_steps_and_table(capsys):
    """``bench.check_memory``: every step's peak and time, in a fresh process per model and
    method, with the check and without; the checked steps (1, 2, 4) marked."""
    from bench import check_memory, measure

    if not measure.cpu_memory_supported():
        pytest.skip("CPU peak memory needs Linux /proc")
    assert [k for k in range(1, 9) if check_memory._checked(k)] == [1, 2, 4, 8]
    assert check_memory.main(["--models", "mlp", "--methods", "norms", "--steps", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "| model | method | verify | step 1* | step 2* | step 3 |"
    rows = [line for line in lines if line.startswith("| mlp | norms |")]
    assert [r.split(" | ")[2] for r in rows] == ["True", "False"]
    for r in rows:
        assert r.count("MiB") == 3 and r.count(" s") >= 3, r


def test_unhandled_ops_finds_no_silent_wrong_grad1(capsys):
    """``python -m bench.unhandled_ops`` on operations without a handler whose rows are not the
    batch's (``kron``, ``combinations``, ``cartesian_prod``, those torch's OpInfo database samples): each
    refused or right."""
    pytest.importorskip("expecttest")
    from bench import unhandled_ops

    unhandled_ops.main(["--only", "kron,combinations,cartesian_prod"])
    said = capsys.readouterr().out
    assert "operations probed: 0" not in said, said
    assert "silent wrong:\n  none" in said and "crashes:\n  none" in said, said

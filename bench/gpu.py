"""On a machine with a CUDA device: the CUDA tests, then the benchmark's host, workloads,
compiled, grad1 and DP suites and the host profile on it, in one short run (9 minutes: its
``--budget``).

    python -m bench.gpu --fetch-wheels    # here, before: the peers' wheels into .whl/
    python -m bench.gpu                   # there: results in bench/results/ (or --out)
    python -m bench.gpu --dry-run         # the commands, run nothing

The device machine's Python has torch, transformers, peft, timm and einops, but not the peers
the suites compare with (Opacus, BackPACK), and nothing can be fetched there. ``--fetch-wheels``
downloads their wheels (pure Python, for the device's Python 3.12) into ``.whl/`` at the
repository's root (ignored by git: name it in the device tool's ``carry``); on the device,
``python -m bench.gpu`` installs what ``.whl/`` holds into a folder of its own and puts it on
the stages' ``PYTHONPATH``. A peer still missing is reported by the suites as unavailable.

Each stage is a process of its own with a time limit, cut to what is left of the budget; a
stage that fails or runs out of time is reported in ``gpu-summary.txt`` (its output in
``gpu-log.txt``) and the next one runs. The stages run in the order of what they are worth
when the time runs out: correctness first, then the tables of the host cost and the real
workloads. ``--pack FILE`` packs the results folder into one ``.tar.gz`` after every stage, so
that a run stopped from outside still leaves what the finished stages wrote. The suites use
few repetitions (the GPU's steps are short, and the point is the ratios, not their third
digit), wall clock. The compiled methods (``--compile``) run on the MLP and GPT-2 of the host
suite, in a folder of their own (``compile/``), so as not to overwrite the host table; the
workloads run again at batch 64 (``batch64/``), where the device's work outweighs the host's.
Last, the test suite runs with torch's default device on the GPU
(``GRADHOOKS_TEST_DEFAULT_DEVICE``, 12 processes by pytest-xdist; ``suite.xml`` lists what
failed). Without a CUDA device it says so and exits with status 1, measuring nothing (``--device cpu``
runs the same stages on the CPU, to try the script).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

NO_DEVICE = "no CUDA device: nothing to measure"
WHEELS = ROOT / ".whl"
# the peers' wheels (pure Python; their other needs are on the device machine)
PEER_WHEELS = ("opacus==1.6.0", "backpack-for-pytorch==1.7.1", "unfoldNd==0.2.3")
DEVICE_PYTHON = "3.12"


def fetch_wheels_command(into: Path = WHEELS) -> list[str]:
    """pip's download of :data:`PEER_WHEELS` for the device machine's Python, without their
    dependencies (torch and numpy are there)."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--python-version", DEVICE_PYTHON, "--implementation", "cp",
            "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64",
            "-d", str(into), *PEER_WHEELS]  # fmt: skip


def install_wheels(wheels: Path, site: Path) -> dict[str, str]:
    """Install the wheels in ``wheels`` (if any) into ``site``; the environment for the stages,
    with ``site`` first on ``PYTHONPATH``."""
    env = dict(os.environ)
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        return env
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
         "--upgrade", "--target", str(site), *map(str, found)],
        check=True,
    )  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return env


BUDGET = 540  # seconds for all the stages together
# the test files the device's run of the suite leaves out: those that start processes of their
# own (benchmarks, sweeps, two-process training, installs) or run the documents' commands
SUITE_LEFT_OUT = ("test_bench.py", "test_distributed.py", "test_package.py", "test_readme.py",
                  "test_hf_sweep.py", "test_timm_sweep.py", "test_lib_sweep.py")  # fmt: skip


def stages(out: Path, device: str = "cuda") -> list[tuple[str, list[str], int]]:
    """(name, command, time limit in seconds), in the order they run; the limits add up to
    :data:`BUDGET`."""
    py = sys.executable
    bench = [py, "-m", "bench", "--device", device, "--clock", "wall"]
    host = "tiny-mlp,tiny-cnn,tiny-gpt2,tiny-bert,tiny-llama,tiny-vit"
    return [
        ("CUDA tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda",
                        "tests/test_cuda.py", "tests/test_robust_setups.py"], 30),
        ("host suite", [*bench, "--suite", "host", "--reps", "21", "--out", str(out)], 50),
        ("workloads suite", [*bench, "--suite", "workloads", "--reps", "9", "--out", str(out)],
         55),
        ("host profile", [py, "-m", "bench.host_profile", "--device", device, "--models", host,
                          "--reps", "21", "--out", str(out)], 55),
        ("host suite, compiled", [*bench, "--suite", "host", "--models", "tiny-mlp,tiny-gpt2",
                                  "--methods", "plain,grad1,dp-bk", "--compile", "--reps", "11",
                                  "--out", str(out / "compile")], 50),
        ("grad1 suite", [*bench, "--suite", "grad1", "--reps", "5", "--slow-reps", "1",
                         "--out", str(out)], 55),
        ("workloads suite, batch 64", [*bench, "--suite", "workloads", "--batch", "64",
                                       "--reps", "5", "--out", str(out / "batch64")], 50),
        ("DP suite", [*bench, "--suite", "dp", "--reps", "5", "--out", str(out)], 45),
        ("the suite on the device", ["env", f"GRADHOOKS_TEST_DEFAULT_DEVICE={device}", py, "-m",
                                     "pytest", "tests", "-q", "-p", "no:cacheprovider",
                                     "-o", "addopts=", "-rfE", "--tb=line", "-n", "12",
                                     "--timeout", "120", f"--junitxml={out / 'suite.xml'}",
                                     *(f"--ignore=tests/{f}" for f in SUITE_LEFT_OUT)], 150),
    ]  # fmt: skip


def pack(folder: Path, into: Path) -> None:
    """``folder``'s files into the archive ``into`` (written beside it, then moved over it)."""
    import tarfile

    into.parent.mkdir(parents=True, exist_ok=True)
    part = into.with_name(into.name + ".part")
    with tarfile.open(part, "w:gz") as tar:
        tar.add(folder, arcname=folder.name)
    part.replace(into)


def run(name: str, cmd: list[str], limit: int, log, env: dict | None = None) -> str:
    """One stage, its output into ``log``. Near its limit (10 s before, or at nine tenths) it
    is interrupted (SIGINT: pytest then prints what failed so far), and killed at the limit."""
    import signal

    log.write(f"\n==== {name}: {' '.join(cmd)} (limit {limit} s)\n")
    log.flush()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        code = proc.wait(timeout=max(limit - 10, 0.9 * limit))
        verdict = "ok" if code == 0 else f"failed (status {code})"
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=limit - (time.perf_counter() - start))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        verdict = f"stopped after its limit of {limit} s"
    return f"{name}: {verdict}, {time.perf_counter() - start:.0f} s"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), help="results folder")
    p.add_argument("--pack", default=None,
                   help="a .tar.gz to pack the results folder into after every stage")  # fmt: skip
    p.add_argument("--budget", type=int, default=BUDGET,
                   help=f"seconds for all the stages ({BUDGET}); each stage's limit is cut to "
                   "what is left")  # fmt: skip
    p.add_argument("--device", default="cuda", help="cuda; cpu to try the script")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--fetch-wheels", action="store_true",
                   help=f"download the peers' wheels into {WHEELS.name}/ (run where pip can)")  # fmt: skip
    args = p.parse_args(argv)
    if args.fetch_wheels:
        return subprocess.run(fetch_wheels_command()).returncode
    out = Path(args.out)
    plan = stages(out, args.device)
    if args.dry_run:
        for name, cmd, limit in plan:
            print(f"{name} (limit {limit} s): {' '.join(cmd)}")
        return 0
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(NO_DEVICE, file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    env = install_wheels(WHEELS, Path(os.environ.get("TMPDIR", "/tmp")) / "gradhooks-peers")
    start = time.perf_counter()
    env["PYTHONUNBUFFERED"] = "1"
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    lines = [f"device: {device}; torch {torch.__version__}"]
    summary = out / "gpu-summary.txt"
    with open(out / "gpu-log.txt", "w") as log:
        for name, cmd, limit in plan:
            left = int(args.budget - (time.perf_counter() - start))
            if left < 10:
                lines.append(f"{name}: not run, the budget of {args.budget} s spent")
            else:
                lines.append(run(name, cmd, min(limit, left), log, env))
            print(lines[-1], flush=True)
            summary.write_text("\n".join(lines) + "\n")
            log.flush()
            if args.pack:
                pack(out, Path(args.pack))
    return 0 if all(line.endswith(" s") and ": ok," in line for line in lines[1:]) else 1


if __name__ == "__main__":
    sys.exit(main())

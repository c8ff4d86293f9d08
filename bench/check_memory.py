"""Peak memory and time of each step, checked or not by gradhooks' run-time check.

    python -m bench.check_memory --models gpt2-128,bert-128 --methods norms,dp-bk --steps 4

``add_hooks(verify=True)`` (the default) checks the 1st, 2nd, 4th, 8th... backward of a handle
against autograd (the probe); the DP step checks its own steps alike. For each model and method,
in a fresh process each (``bench.measure``'s CPU method: ``MALLOC_MMAP_THRESHOLD_=65536``,
``VmHWM`` after the step minus ``VmRSS`` before it, plus what the method holds between steps),
every step of ``--steps`` from a reset: its peak and its CPU time (all threads), with the check
on, and with ``verify=False`` (``--no-unchecked``: not). A row per model and method; a step
the check ran on is marked ``*``. The 2nd step is the one ``--suite workloads`` measures.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

import gradhooks
from bench import measure
from bench.methods import METHODS, Setup
from bench.problems import PROBLEMS

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20


def _checked(step: int) -> bool:
    """Whether the check runs on backward ``step`` (1-based) of a handle: 1, 2, 4, 8..."""
    return step & (step - 1) == 0


def steps_of(model: str, method: str, batch: int, steps: int, verify: bool) -> list[dict]:
    """Each step's peak bytes and CPU seconds, in this process (run it in a fresh one)."""
    problem = PROBLEMS[model]
    base, x, y = measure.instance(problem, batch, "cpu")
    setup = Setup(copy.deepcopy(base), x, y, problem.loss)
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner = METHODS[method].make(setup)
        if not verify:
            gradhooks.hooks_of(setup.model).verify = False
        for _ in range(steps):
            runner.reset()
            gc.collect()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # (VmHWM back to the current RSS)
            before = measure._proc_kib("VmRSS")
            start = time.process_time()
            runner.step()
            seconds = time.process_time() - start
            peak = (measure._proc_kib("VmHWM") - before) * 1024 + runner.held_bytes()
            rows.append({"peak_bytes": peak, "cpu_s": seconds})
    return rows


def _in_subprocess(model: str, method: str, args, verify: bool) -> list[dict]:
    cmd = [
        sys.executable, "-m", "bench.check_memory", "--worker", "--models", model,
        "--methods", method, "--batch", str(args.batch), "--steps", str(args.steps),
        "--threads", str(args.threads),
    ] + ([] if verify else ["--no-verify"])  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=measure.memory_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{model}, {method}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: list[dict], steps: int) -> str:
    """Markdown: per model and method, each step's peak (MiB) and CPU time (s)."""
    head = " | ".join(f"step {k}{'*' if _checked(k) else ''}" for k in range(1, steps + 1))
    lines = [f"| model | method | verify | {head} |", "| --- " * (steps + 3) + "|"]
    for r in results:
        cells = " | ".join(
            f"{s['peak_bytes'] / MIB:,.0f} MiB, {s['cpu_s']:.2f} s" for s in r["steps"]
        )
        lines.append(f"| {r['model']} | {r['method']} | {r['verify']} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt2-128,bert-128")
    p.add_argument("--methods", default="norms,dp-bk")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-unchecked", action="store_true", help="skip the verify=False runs")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-verify", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    models, methods = args.models.split(","), args.methods.split(",")
    if args.worker:
        print(json.dumps(steps_of(models[0], methods[0], args.batch, args.steps,
                                  not args.no_verify)))  # fmt: skip
        return 0
    if not measure.cpu_memory_supported():
        print("CPU peak memory needs Linux /proc (VmHWM, clear_refs): not measured here")
        return 1
    results = []
    for model in models:
        for method in methods:
            for verify in (True,) if args.no_unchecked else (True, False):
                print(f"{model}, {method}, verify={verify} ...", file=sys.stderr, flush=True)
                steps = _in_subprocess(model, method, args, verify)
                results.append({"model": model, "method": method, "verify": verify,
                                "steps": steps})  # fmt: skip
    print(table(results, args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())

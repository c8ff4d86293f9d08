"""Per-example gradients, side by side: gradhooks, its peers, plain training and the floor.

    python -m bench --suite grad1                     # one table of bench/RESULTS.md
    python -m bench --suite host --compile            # tiny models, 1 thread; torch.compile too
    python -m bench                                   # every model and method, batch 64, CPU
    python -m bench --models mlp,simplecnn --methods plain,floor,vmap,grad1 --reps 9
    python -m bench --device cuda --batch 32,128
    python bench/run.py --help

Writes a table (ratios to plain forward+backward) to stdout and ``<out>/results.md``, every
measurement to ``<out>/results.json``, and a plot of time and peak memory to
``<out>/results.png`` (when matplotlib is installed); ``<out>`` is ``bench/out/`` unless
``--out`` says otherwise. With ``--suite NAME`` (:mod:`bench.suites`) the files are
``bench/results/NAME-<device>.*``. Peers (``pip install -e '.[bench]'``) that are missing or
refuse a model are reported as such. On a machine shared with other work, ``--threads 1
--clock cpu`` gives steadier ratios than the default wall clock.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python bench/run.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"

import torch

from bench import measure, report
from bench.methods import COMPILED, METHODS
from bench.problems import PROBLEMS
from bench.suites import SUITES

ROOT = Path(__file__).resolve().parent.parent


def _names(text: str, known: dict, what: str) -> list[str]:
    if text == "all":
        return list(known)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown {what}: {', '.join(unknown)}; choose from {', '.join(known)}")
    return names


def parse(argv: list[str] | None):
    p = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"models: {', '.join(PROBLEMS)}\nmethods: {', '.join(METHODS)}",
    )  # fmt: skip
    p.add_argument(
        "--suite", choices=list(SUITES), default=None,
        help="one table of bench/RESULTS.md: its models, methods, batch and steps (flags given "
        "as well override them); written to bench/results/<suite>-<device>.*",
    )  # fmt: skip
    p.add_argument("--models", default=None, help="comma-separated, or 'all' (the default)")
    p.add_argument("--methods", default=None, help="comma-separated, or 'all' (the default)")
    p.add_argument(
        "--batch", default=None,
        help="batch sizes, comma-separated (default 64), or 'own': each model's own",
    )  # fmt: skip
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--reps", type=int, default=None, help="timed steps per method (median; 5)")
    p.add_argument("--slow-reps", type=int, default=None, help="timed steps of the slow loop (1)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default=None,
        help="wall: elapsed time (the default); cpu: process CPU time (steadier on a loaded "
        "machine)",
    )
    p.add_argument(
        "--compile", action="store_true",
        help=f"add the methods on torch.compile(model): {COMPILED}",
    )  # fmt: skip
    p.add_argument(
        "--settle", type=int, default=0,
        help="untimed steps of a method right before each of its timed steps (0: none)",
    )  # fmt: skip
    p.add_argument(
        "--keep-freed-memory", action="store_true",
        help="glibc only: the timing process keeps the memory it frees (no trimming, large "
        "blocks from the heap), so steps do not page-fault fresh buffers in again (peak memory "
        "is still measured with the default allocator)",
    )  # fmt: skip
    p.add_argument(
        "--no-memory", dest="memory", action="store_const", const=False, default=None,
        help="skip the peak-memory pass",
    )  # fmt: skip
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--out", default=None, help="output folder (bench/out, or bench/results "
                   "with --suite)")  # fmt: skip
    p.add_argument("--memory-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    suite = SUITES.get(args.suite)
    for name, default in (("models", "all"), ("methods", "all"), ("batch", "64"),
                          ("reps", 5), ("slow_reps", 1), ("threads", None), ("clock", "wall"),
                          ("memory", True)):  # fmt: skip
        if getattr(args, name) is None:
            setattr(args, name, getattr(suite, name) if suite else default)
    if args.out is None:
        args.out = str(ROOT / "bench" / ("results" if suite else "out"))
    args.stem = f"{args.suite}-{args.device.split(':')[0]}" if suite else "results"
    args.models = _names(args.models, PROBLEMS, "models")
    if args.methods == "all":  # (the methods on a compiled model only with --compile)
        args.methods = ",".join(m for m in METHODS if m not in COMPILED.split(","))
    args.methods = _names(args.methods, METHODS, "methods")
    if args.compile:
        args.methods += [m for m in COMPILED.split(",") if m not in args.methods]
    args.own_batch = args.batch == "own"
    args.batch = [None] if args.own_batch else [int(b) for b in args.batch.split(",")]
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    return args


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, width: int = 30) -> None:
        self.total, self.done, self.width, self.start = total, 0, width, time.perf_counter()

    def show(self, label: str) -> None:
        filled = self.width * self.done // max(self.total, 1)
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = time.perf_counter() - self.start
        line = f"\r[{bar}] {self.done}/{self.total} {elapsed:5.0f}s {label}"
        sys.stderr.write(f"{line:<100.100}")
        sys.stderr.flush()

    def advance(self) -> None:
        self.done += 1

    def close(self) -> None:
        self.show("done")
        sys.stderr.write("\n")


def _memory_in_subprocess(model: str, method: str, batch: int, args) -> int | None:
    """CPU peak of ``method`` on ``model``, measured in a fresh process (see measure.py): one
    process per method, since a method run after another in the same process reuses the heap
    memory the earlier one left behind, and its peak reads too low."""
    cmd = [
        sys.executable, "-m", "bench", "--memory-worker", "--models", model,
        "--methods", method, "--batch", str(batch), "--device", args.device,
    ]  # fmt: skip
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    done = subprocess.run(
        cmd, cwd=ROOT, env=measure.memory_env(), capture_output=True, text=True, timeout=3600
    )
    if done.returncode != 0:
        sys.stderr.write(f"\nmemory pass for {model}, {method} failed:\n{done.stderr[-2000:]}\n")
        return None
    return json.loads(done.stdout.strip().splitlines()[-1]).get(method)


def memory_worker(args) -> None:
    (model,) = args.models
    (batch,) = args.batch
    problem = PROBLEMS[model]
    base, x, y = measure.instance(problem, batch, args.device)
    peaks = {}
    for name in args.methods:  # the caller passes one method per process
        rec, runner = measure.prepare(problem, METHODS[name], base, x, y, None, args.device)
        if runner is not None:
            measure.measure_peak(rec, runner, args.device)
        peaks[name] = rec.peak_bytes
        del runner
    print(json.dumps(peaks))


def run_model(problem, batch: int, args, memory_here: bool, progress: Progress):
    """Every method on one model: set up and warmed up, then timed in rounds (each round
    steps every method once, so that load from elsewhere on the machine hits all alike; the
    order rotates from round to round)."""
    progress.show(f"{problem.name}: reference")
    base, x, y = measure.instance(problem, batch, args.device)
    try:
        ref = measure.reference(problem, base, x, y)
    except Exception as e:
        sys.stderr.write(f"\nno reference for {problem.name}: {e}\n")
        ref = None
    cells = []
    for name in args.methods:
        progress.show(f"{problem.name}: {name} (set up)")
        cells.append(measure.prepare(problem, METHODS[name], base, x, y, ref, args.device))
        progress.advance()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    pairs = list(zip(cells, args.methods, strict=True))
    for round_ in range(max(args.reps, args.slow_reps)):
        # each round starts one method later: what a step inherits from the step before it
        # (memory the previous method freed, caches) falls on every method alike
        shift = round_ % len(pairs)
        for (rec, runner), name in pairs[shift:] + pairs[:shift]:
            reps = args.slow_reps if METHODS[name].slow else args.reps
            if round_ >= reps:
                continue
            progress.show(f"{problem.name}: {name} ({round_ + 1}/{reps})")
            if runner is not None and rec.status in ("ok", "wrong"):
                try:
                    for _ in range(args.settle):  # untimed: as in a training loop, the timed
                        measure.step_once(runner, args.device)  # step follows its own
                    measure.timed_step(rec, runner, args.device, clock)
                except Exception as e:
                    measure._unsupported(rec, e)
            progress.advance()
    for rec, runner in cells:
        if memory_here and runner is not None:
            measure.measure_peak(rec, runner, args.device)
    return [rec for rec, _ in cells]


def keep_freed_memory() -> bool:
    """Have glibc keep what this process frees: blocks up to its ceiling (32 MiB) come from the
    heap rather than their own mapping, and the heap's top is never handed back. A buffer
    freed at the end of one step is then reused, not faulted in page by page at the next.
    Returns False where the C library is not glibc (nothing changed)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, 32 * 2**20)) and bool(
        mallopt(m_trim_threshold, 2**31 - 1)
    )


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {
        "cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(),
    }  # fmt: skip
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    for peer, dist in (("opacus", "opacus"), ("backpack", "backpack-for-pytorch")):
        try:
            info[peer] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            info[peer] = None
    return info


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_worker:
        memory_worker(args)
        return 0
    if args.keep_freed_memory and not keep_freed_memory():
        print("--keep-freed-memory: the C library is not glibc, nothing changed")
        args.keep_freed_memory = False
    memory = args.memory
    if memory and args.device == "cpu" and not measure.cpu_memory_supported():
        print("CPU peak memory needs Linux /proc (VmHWM, clear_refs): not measured here")
        memory = False
    memory_subprocess = memory and args.device == "cpu"

    per_model = sum(1 + (args.slow_reps if METHODS[m].slow else args.reps) for m in args.methods)
    cells = len(args.batch) * len(args.models) * (per_model + memory_subprocess)
    progress = Progress(cells)
    records: list[measure.Record] = []
    for given in args.batch:
        for model_name in args.models:
            problem = PROBLEMS[model_name]
            batch = problem.batch if given is None else given
            mine = run_model(problem, batch, args, memory and not memory_subprocess, progress)
            if memory_subprocess:
                for r in mine:
                    if r.status in ("ok", "wrong"):
                        progress.show(f"{model_name}: peak memory of {r.method} (subprocess)")
                        r.peak_bytes = _memory_in_subprocess(model_name, r.method, batch, args)
                progress.advance()
            records.extend(mine)
    progress.close()

    command = "python -m bench " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    meta = {
        "command": command.strip(),
        "machine": machine(),
        "reps": args.reps,
        "clock": args.clock,
    }
    if args.own_batch:
        meta["batch"] = "own"
    if args.suite:
        meta["suite"] = args.suite
        meta["title"] = SUITES[args.suite].title
    data = {**meta, "records": [r.as_dict() for r in records]}
    stem = report.write_results(args.out, args.stem, data, report.markdown(data))
    print(f"written: {stem.with_suffix('.json')}, {stem.with_suffix('.md')}", end="")
    if args.no_plot:
        print()
    else:
        png = report.plot(data, stem.with_suffix(".png"))
        print(f", {png}" if png else "\n(no plot: matplotlib is not installed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

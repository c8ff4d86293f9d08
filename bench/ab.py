"""Two versions of the code, one method, side by side: is a change faster?

    python -m bench.ab --revs HEAD~1,. --model tinygpt --method grad1 --rounds 6

Each version (a git revision, or ``.`` for the working tree) is exported to a folder of its
own, and every round runs ``python -m bench`` once per version, in a fresh process each and
in alternating order, timing the method and plain forward+backward. It reports, per version,
the method's time as a ratio to plain (median and range over the rounds) and the ratio of
those medians. One process per measurement matters: two versions alternated inside one
process read several percent apart even when they are the same code (each step inherits what
the step before it left: memory just freed, caches); a process at a time does not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse(argv: list[str] | None):
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n")[0])
    p.add_argument("--revs", required=True, help="two or more git revisions, comma-separated; "
                   "'.' is the working tree")  # fmt: skip
    p.add_argument("--model", required=True)
    p.add_argument("--method", required=True, help="timed against plain")
    p.add_argument("--batch", default="64")
    p.add_argument("--rounds", type=int, default=5, help="processes per version")
    p.add_argument("--reps", type=int, default=9, help="timed steps per process (median)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--extra", default="", help="more flags for python -m bench, quoted")
    args = p.parse_args(argv)
    args.revs = [r.strip() for r in args.revs.split(",") if r.strip()]
    if len(args.revs) < 2:
        p.error("--revs needs at least two versions")
    return args


def export(rev: str, into: Path) -> Path:
    """The tree of ``rev`` (``.``: this working tree) as a folder to run from."""
    if rev == ".":
        return ROOT
    folder = into / rev.replace("/", "_").replace("~", "-").replace("^", "-")
    folder.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def one_run(tree: Path, args, out: Path) -> float:
    """One process of ``python -m bench`` in ``tree``: the method's median over plain's."""
    cmd = [
        sys.executable, "-m", "bench", "--models", args.model,
        "--methods", f"plain,{args.method}", "--batch", args.batch, "--reps", str(args.reps),
        "--no-memory", "--no-plot", "--out", str(out), *args.extra.split(),
    ]  # fmt: skip
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"python -m bench failed in {tree}:\n{done.stderr[-3000:]}")
    records = json.loads((out / "results.json").read_text())["records"]
    times = {r["method"]: r["median_s"] for r in records}
    if not times.get(args.method) or not times.get("plain"):
        raise SystemExit(f"no time for {args.method} or plain in {tree}: {records}")
    return times[args.method] / times["plain"]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    with tempfile.TemporaryDirectory(prefix="gradhooks-ab-") as tmp:
        tmp_path = Path(tmp)
        trees = {rev: export(rev, tmp_path) for rev in args.revs}
        ratios: dict[str, list[float]] = {rev: [] for rev in args.revs}
        for round_ in range(args.rounds):
            order = args.revs if round_ % 2 == 0 else args.revs[::-1]
            for rev in order:
                out = tmp_path / f"out-{len(ratios[rev])}-{abs(hash(rev))}"
                ratios[rev].append(one_run(trees[rev], args, out))
                print(f"round {round_ + 1}/{args.rounds}, {rev}: {ratios[rev][-1]:.3f}x plain",
                      flush=True)  # fmt: skip
    first = statistics.median(ratios[args.revs[0]])
    print(
        f"\n{args.model}, {args.method} / plain, batch {args.batch}, {args.rounds} processes each:"
    )
    for rev, rs in ratios.items():
        med = statistics.median(rs)
        print(f"  {rev:>12}: median {med:.3f}x (range {min(rs):.3f}-{max(rs):.3f}), "
              f"{med / first:.3f} of {args.revs[0]}'s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

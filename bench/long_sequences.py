"""Per-example norms of the benchmark's GPT-2 (2 layers, width 256) at long sequences: peak
memory and time of one step, against a plain step, each in a fresh process.

    python -m bench.long_sequences --seq 1024,2048 --batch 8

``plain``: the mean of the examples' losses, backward. ``norms``: the same with
``add_hooks(model, quantities=("norms",))`` and ``h.norms()``. ``dp``: gradhooks' book-keeping
DP step (``dp_sgd_step``) in place of the backward. The peak is the process's resident
high-water mark (``ru_maxrss``), the model and the batch included.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

METHODS = ("plain", "norms", "dp")


def step(seq: int, batch: int, method: str) -> dict:
    """One step of ``method`` at ``seq`` positions, in this process."""
    import torch
    import transformers

    import gradhooks
    from bench.problems import HuggingFace, next_token_each

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_embd=256, n_layer=2, n_head=4, n_positions=max(1024, seq), vocab_size=50257,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = HuggingFace(transformers.GPT2LMHeadModel(cfg))
    x = torch.randint(0, cfg.vocab_size, (batch, seq))
    y = torch.randint(0, cfg.vocab_size, (batch, seq))
    hooks = gradhooks.add_hooks(model, quantities=("norms",)) if method != "plain" else None
    start = time.perf_counter()
    losses = next_token_each(model(x), y)
    if method == "dp":
        gradhooks.dp_sgd_step(hooks, losses, max_norm=1.0, noise_multiplier=1.0)
    else:
        losses.mean().backward()
        if hooks is not None:
            hooks.norms()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (KiB on Linux)
    return {"seq": seq, "batch": batch, "method": method, "seconds": seconds, "peak_bytes": peak}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.long_sequences", description=__doc__.split("\n")[0]
    )
    p.add_argument("--seq", default="1024", help="sequence lengths, comma-separated")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--methods", default="plain,norms", help=f"of {', '.join(METHODS)}")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # (the child process)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(step(int(args.seq), args.batch, args.methods)))
        return 0
    print("| seq | method | time (s) | peak memory (GiB) |\n| --- | --- | --- | --- |")
    for seq in (int(s) for s in args.seq.split(",")):
        for method in args.methods.split(","):
            cmd = [sys.executable, "-m", "bench.long_sequences", "--one", "--seq", str(seq),
                   "--batch", str(args.batch), "--methods", method]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                tail = (done.stderr.strip().splitlines() or ["killed"])[-1]
                print(f"| {seq} | {method} | failed: {tail} | |", flush=True)
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            print(
                f"| {seq} | {method} | {r['seconds']:.1f} | {r['peak_bytes'] / 2**30:.2f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

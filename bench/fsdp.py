"""DP-SGD under FSDP2 across processes: gradhooks against Opacus' FSDP ghost clipping.

gradhooks' book-keeping step and Opacus' FSDP ghost clipping, side by side with a plain FSDP
training step, on the same model.

    python -m bench.fsdp                    # 2 processes (gloo, CPU), batch 8 per rank, seq 128
    python -m bench.fsdp --procs 2 --batch 8 --seq 128 --reps 5 --out bench/results

Starts ``--procs`` processes (gloo on 127.0.0.1, a free port, the environment torchrun would
give them) and writes ``<out>/fsdp-cpu.json`` and ``<out>/fsdp-cpu.md`` (the table, printed too).

The model: the Hugging Face BERT classifier of ``bench.problems.bert`` (2 layers of width 256,
BERT's vocabulary, 2 classes; its output layer is its own, which Opacus' FSDP clipping needs),
called with ``position_ids`` and ``token_type_ids`` given as contiguous ``[batch, seq]`` tensors
(Opacus' embedding norms need them so). Every module with parameters of its own is sharded
(``fully_shard``), then the root: the layout Opacus' ``FSDP2Wrapper`` gives this model, and the
one gradhooks asks for. (Not GPT-2: Opacus refuses its ``Conv1D`` layers under FSDP, since its
functorch fallback deep-copies the sharded layer, which FSDP forbids.) Every method builds it
from the same seed, and every rank takes its own ``--batch`` examples of one global batch
(seed 1). Each rank runs ``--threads`` torch threads.

The methods, each a step from forward to the SGD update:

- ``plain``: cross-entropy, backward (FSDP's reduce-scatter), SGD step.
- ``dp-bk``: gradhooks, ``add_hooks(model, quantities=("norms",))`` and
  ``gradhooks.distributed.dp_sgd_step(method="bookkeeping")``: one backward, the clipped sums,
  one all-reduce, the noise drawn once on rank 0; SGD step.
- ``opacus-ghost-fsdp``: what ``make_private(grad_sample_mode="ghost_fsdp")`` builds:
  ``GradSampleModuleFastGradientClippingFSDP``, ``FSDPOptimizerFastGradientClipping`` over SGD,
  ``DPLossFastGradientClipping``: forward, loss, the two backwards, noise, SGD step.

The DP steps clip to ``max_norm`` 1 and add noise of multiplier 1 (``bench.methods``).

Time: after one warm-up step per method, ``--reps`` rounds; each round steps every method once
(the order rotating from round to round, so that drift falls on all alike). Before each step
every rank waits at a barrier (untimed); a step's time is its slowest rank's (wall clock); the
table gives the median over the rounds. Peak memory: per method, in fresh processes (one per
rank) with ``bench.measure``'s CPU method (``VmHWM`` after one step minus ``VmRSS`` before it,
after a warm-up step, large allocations returned to the system when freed); the table gives the
largest rank's. A method that fails is reported with its error, never a crash.

The check (once, before the timing, not timed): with noise 0 and ``max_norm`` the median
per-example norm (so that about half the examples are clipped), gradhooks' and Opacus' averaged
clipped gradients (full, gathered from the shards) against each other and against a loop over
the examples in one process (rank 0, an unsharded copy of the model).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bench import measure
from bench.methods import MAX_NORM, NOISE, Runner, _need
from bench.report import MIB, ratios, write_results

ROOT = Path(__file__).resolve().parent.parent
MODEL = "HF BERT classifier 2x256"
LABELS = {
    "plain": "plain FSDP step (SGD)",
    "dp-bk": "gradhooks DP step (book-keeping)",
    "opacus-ghost-fsdp": "Opacus DP step (ghost, FSDP)",
}
AGREE_TOLERANCE = 1e-4  # float32: the largest |difference| over the largest |value|
OPACUS = "opacus-ghost-fsdp"


def parse(argv: list[str] | None):
    p = argparse.ArgumentParser(prog="python -m bench.fsdp", description=__doc__.split("\n")[0])
    p.add_argument("--procs", type=int, default=2, help="processes (ranks), gloo on CPU")
    p.add_argument("--batch", type=int, default=8, help="examples per rank")
    p.add_argument("--seq", type=int, default=128, help="tokens per example (at most 512)")
    p.add_argument("--reps", type=int, default=5, help="timed steps per method (median)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per rank (default: cores / procs)")  # fmt: skip
    p.add_argument("--methods", default=",".join(LABELS), help="comma-separated")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory pass")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per launch of the ranks")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), help="output folder")
    p.add_argument("--worker", choices=["time", "memory"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if m not in LABELS]
    if unknown:
        p.error(f"unknown methods: {', '.join(unknown)}; choose from {', '.join(LABELS)}")
    if "plain" not in args.methods and args.worker is None:
        args.methods.insert(0, "plain")  # the ratios' base
    if not 1 <= args.seq <= 512:
        p.error("--seq: BERT takes 1 to 512 tokens")
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.procs)
    return args


# -- the model, its shards and the batch ---------------------------------------------------------


class Classifier(nn.Module):
    """A Hugging Face sequence classifier called with token ids, contiguous ``position_ids`` and
    ``token_type_ids`` (Opacus' embedding norms view them flat), returning the logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        positions = torch.arange(x.shape[1], device=x.device).expand(x.shape).contiguous()
        kinds = torch.zeros_like(x)
        return self.model(input_ids=x, position_ids=positions, token_type_ids=kinds).logits


def make_model() -> nn.Module:
    """The model (seed 0), unsharded."""
    from bench.problems import bert

    torch.manual_seed(0)
    return Classifier(bert().model)


def shard(model: nn.Module) -> nn.Module:
    """FSDP2 on every module with parameters of its own, then on the root."""
    from torch.distributed.fsdp import fully_shard

    for m in model.modules():
        if m is not model and any(True for _ in m.parameters(recurse=False)):
            fully_shard(m)
    return fully_shard(model)


def global_batch(args) -> tuple[Tensor, Tensor]:
    """Token ids ``[procs * batch, seq]`` and labels (seed 1), the same on every rank."""
    from bench.problems import _tokens

    gen = torch.Generator().manual_seed(1)
    return _tokens(30522, args.seq, classes=2)(args.procs * args.batch, gen)


def local(x: Tensor, y: Tensor, rank: int, batch: int) -> tuple[Tensor, Tensor]:
    return x[rank * batch : (rank + 1) * batch], y[rank * batch : (rank + 1) * batch]


# -- the methods ---------------------------------------------------------------------------------


@dataclass
class Step(Runner):
    """A method's runner; ``result()`` gives every parameter's whole gradient (collective)."""

    norms: list[Tensor] = field(default_factory=list)  # a DP step's last norms (this rank's)


def plain(model: nn.Module, x: Tensor, y: Tensor, max_norm: float, noise: float) -> Step:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return Step(step, lambda: _full_grads(model), reset=lambda: opt.zero_grad(set_to_none=True))


def gradhooks_dp(model: nn.Module, x: Tensor, y: Tensor, max_norm: float, noise: float) -> Step:
    import gradhooks
    import gradhooks.distributed

    hooks = gradhooks.add_hooks(model, quantities=("norms",))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)  # used on rank 0 only

    def step() -> None:
        losses = F.cross_entropy(model(x), y, reduction="none")
        runner.norms[:] = [gradhooks.distributed.dp_sgd_step(
            hooks, losses, max_norm=max_norm, noise_multiplier=noise, generator=gen,
            method="bookkeeping",
        )]  # fmt: skip
        opt.step()

    def reset() -> None:
        hooks.clear()
        opt.zero_grad(set_to_none=True)

    runner = Step(step, lambda: _full_grads(model), reset=reset)
    return runner


def opacus_dp(model: nn.Module, x: Tensor, y: Tensor, max_norm: float, noise: float) -> Step:
    _need("opacus")
    from opacus.grad_sample import GradSampleModuleFastGradientClippingFSDP
    from opacus.optimizers import FSDPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    wrapped = GradSampleModuleFastGradientClippingFSDP(
        model, loss_reduction="mean", max_grad_norm=max_norm
    )
    # the mean over this rank's examples: FSDP's reduce-scatter averages over the ranks
    opt = FSDPOptimizerFastGradientClipping(
        torch.optim.SGD(model.parameters(), lr=1e-3), noise_multiplier=noise,
        max_grad_norm=max_norm, expected_batch_size=x.shape[0], loss_reduction="mean",
    )  # fmt: skip
    criterion = DPLossFastGradientClipping(wrapped, opt, nn.CrossEntropyLoss(), "mean")

    def step() -> None:
        criterion(wrapped(x), y).backward()
        runner.norms[:] = [wrapped.per_sample_gradient_norms.detach()]
        opt.step()

    runner = Step(step, lambda: _full_grads(model), reset=lambda: opt.zero_grad(set_to_none=True))
    return runner


MAKERS: dict[str, Callable[..., Step]] = {
    "plain": plain, "dp-bk": gradhooks_dp, OPACUS: opacus_dp,
}  # fmt: skip


def _full_grads(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter's whole gradient (gathered from the shards: collective)."""
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        out[n] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return out


# -- one rank ------------------------------------------------------------------------------------


def _agree(status: str, reason: str) -> tuple[str, str]:
    """The first failing rank's ``(status, reason)`` (``("ok", "")`` where none failed), the
    same on every rank."""
    import torch.distributed as dist

    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (status, reason))
    return next((s for s in every if s[0] != "ok"), ("ok", ""))


def _failure(e: Exception) -> tuple[str, str]:
    rec = measure.Record("", "", 0, "cpu")
    measure._unsupported(rec, e)
    return rec.status, rec.reason


def prepare(name: str, x: Tensor, y: Tensor) -> tuple[measure.Record, Step | None]:
    """``name`` set up on its own sharded model and warmed up by one step; the runner is
    ``None`` where it failed on any rank (the record says why)."""
    rec = measure.Record(MODEL, name, x.shape[0], "cpu")
    runner, status = None, ("ok", "")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runner = MAKERS[name](shard(make_model()), x, y, MAX_NORM, NOISE)
            runner.reset()
            runner.step()
            runner.reset()
    except Exception as e:
        status = _failure(e)
    rec.status, rec.reason = _agree(*status)
    return rec, runner if rec.status == "ok" else None


def timed(cells: list[tuple[measure.Record, Step | None]], reps: int) -> list[list[float]]:
    """``reps`` rounds of one step per method (rotating order), each after a barrier; this
    rank's times per method (the failed ones: empty)."""
    import torch.distributed as dist

    times: list[list[float]] = [[] for _ in cells]
    order = list(range(len(cells)))
    for round_ in range(reps):
        shift = round_ % len(order)
        for i in order[shift:] + order[:shift]:
            rec, runner = cells[i]
            if rec.status != "ok":
                continue
            dist.barrier()
            status = ("ok", "")
            try:
                times[i].append(measure.step_once(runner, "cpu"))
            except Exception as e:
                status = _failure(e)
            rec.status, rec.reason = _agree(*status)
    return times


def _gather(value):
    import torch.distributed as dist

    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def time_worker(args, rank: int) -> dict:
    """The check, then every method timed; rank 0's result holds every rank's times."""
    x_all, y_all = global_batch(args)
    x, y = local(x_all, y_all, rank, args.batch)
    check = agreement(x_all, y_all, x, y) if OPACUS in args.methods else None
    cells = [prepare(name, x, y) for name in args.methods]
    every = _gather(timed(cells, args.reps))
    records = []
    for i, (rec, _) in enumerate(cells):
        per_rank = [t[i] for t in every]
        if rec.status == "ok":
            rec.times_s = [max(ts) for ts in zip(*per_rank)]  # a step ends with its slowest rank
        records.append({**rec.as_dict(), "rank_times_s": per_rank})
    return {"records": records, "check": check}


def memory_worker(args, rank: int) -> dict:
    """One method's peak memory of one step on every rank (a fresh process each)."""
    (name,) = args.methods
    x, y = local(*global_batch(args), rank, args.batch)
    rec, runner = prepare(name, x, y)
    peak = None
    if runner is not None:
        import torch.distributed as dist

        dist.barrier()
        measure.measure_peak(rec, runner, "cpu")
        peak = rec.peak_bytes
    return {"rank_peak_bytes": _gather(peak)}


def worker(args) -> None:
    """One rank (the environment holds RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    try:
        result = (time_worker if args.worker == "time" else memory_worker)(args, rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(args.result).write_text(json.dumps(result))
    # torch 2.13's gloo threads now and then abort the interpreter's teardown ("terminate
    # called without an active exception") after the process group was destroyed: skip it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- the check -----------------------------------------------------------------------------------


def agreement(x_all: Tensor, y_all: Tensor, x: Tensor, y: Tensor) -> dict:
    """gradhooks' and Opacus' clipped, un-noised averaged gradients (max_norm: the median
    per-example norm) against each other and against a loop in one process; the line to print
    and its numbers, the same on every rank."""
    import torch.distributed as dist

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        probe, error = _one_step("dp-bk", x, y, 1e9)
        if probe is None:
            return {"agree": None, "line": f"agreement: not checked, {LABELS['dp-bk']}: {error}"}
        norms = probe[1]
        max_norm = norms.median().item()
        results = {name: _one_step(name, x, y, max_norm) for name in ("dp-bk", OPACUS)}
        loop = loop_reference(x_all, y_all, max_norm) if dist.get_rank() == 0 else None
        loop = _gather(loop)[0]
    return _agreement_line(results, loop, norms, max_norm)


def _one_step(name: str, x: Tensor, y: Tensor, max_norm: float) -> tuple[tuple | None, str]:
    """One un-noised step of ``name`` on a fresh model: ``((its whole gradients, every rank's
    norms), "")``, or ``(None, why it failed)`` (the same on every rank)."""
    status, out = ("ok", ""), None
    try:
        runner = MAKERS[name](shard(make_model()), x, y, max_norm, 0.0)
        runner.step()
        out = runner.result(), runner.norms[0]
    except Exception as e:
        status = _failure(e)
    status = _agree(*status)
    if status[0] != "ok":
        return None, status[1]
    return (out[0], torch.cat(_gather(out[1]))), ""


def loop_reference(x: Tensor, y: Tensor, max_norm: float) -> tuple[dict, Tensor]:
    """The averaged clipped gradient and the per-example norms, one example at a time, on an
    unsharded copy of the model."""
    model = make_model()
    params = dict(model.named_parameters())
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    norms = []
    for i in range(x.shape[0]):
        loss = F.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params.values())]
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        factor = min(1.0, max_norm / norm.item()) if norm > 0 else 1.0
        for n, g in zip(params, grads, strict=True):
            total[n] += factor * g
        norms.append(norm)
    return {n: t / x.shape[0] for n, t in total.items()}, torch.stack(norms)


def _rel(got: dict[str, Tensor], want: dict[str, Tensor]) -> float:
    """The largest |difference| over all parameters, over the largest |value| of ``want``."""
    scale = max(w.abs().max().item() for w in want.values())
    return max((got[n] - w).abs().max().item() for n, w in want.items()) / scale


def _agreement_line(results: dict, loop, norms: Tensor, max_norm: float) -> dict:
    clipped = int((norms > max_norm).sum())
    head = (
        f"agreement (noise 0, max_norm {max_norm:.4g}: the median norm, {clipped} of "
        f"{norms.numel()} examples clipped; float32)"
    )
    errors = {n: e for n, (_, e) in results.items() if e}
    out = {"max_norm": max_norm, "clipped": clipped, "examples": norms.numel(), "errors": errors}
    if errors:
        text = "; ".join(f"{LABELS[n]} failed: {e}" for n, e in errors.items())
        return {**out, "agree": None, "line": f"{head}: {text}"}
    (gh, gh_norms), (op, op_norms) = results["dp-bk"][0], results[OPACUS][0]
    loop_grads, loop_norms = loop
    rel = {
        "gradhooks_vs_opacus": _rel(gh, op),
        "gradhooks_vs_loop": _rel(gh, loop_grads),
        "opacus_vs_loop": _rel(op, loop_grads),
        "norms_gradhooks_vs_loop": _rel({"": gh_norms}, {"": loop_norms}),
        "norms_opacus_vs_loop": _rel({"": op_norms}, {"": loop_norms}),
    }
    agree = rel["gradhooks_vs_opacus"] <= AGREE_TOLERANCE
    verdict = "agree" if agree else "DISAGREE"
    line = (
        f"{head}: gradhooks vs Opacus {rel['gradhooks_vs_opacus']:.1e} ({verdict}, tolerance "
        f"{AGREE_TOLERANCE:g}); vs a per-example loop: gradhooks {rel['gradhooks_vs_loop']:.1e}, "
        f"Opacus {rel['opacus_vs_loop']:.1e}; norms vs the loop's: gradhooks "
        f"{rel['norms_gradhooks_vs_loop']:.1e}, Opacus {rel['norms_opacus_vs_loop']:.1e}"
    )
    return {**out, **rel, "agree": agree, "line": line}


# -- the launcher --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_argv(args, kind: str, methods: list[str], result: Path) -> list[str]:
    return [
        sys.executable, "-m", "bench.fsdp", "--worker", kind, "--result", str(result),
        "--procs", str(args.procs), "--batch", str(args.batch), "--seq", str(args.seq),
        "--reps", str(args.reps), "--threads", str(args.threads), "--timeout", str(args.timeout),
        "--methods", ",".join(methods),
    ]  # fmt: skip


class LaunchError(RuntimeError):
    """A launch of the ranks that died (a crash, or killed at ``--timeout``)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason  # one line: the first failing rank's last words


def launch(args, kind: str, methods: list[str], env: dict[str, str] | None = None) -> dict:
    """Run a worker on ``--procs`` ranks; rank 0's result. Raises :class:`LaunchError` with the
    ranks' output where one fails or the launch outlasts ``--timeout``."""
    for attempt in range(2):
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "result.json"
            logs = _run_ranks(_worker_argv(args, kind, methods, result), args, env, Path(tmp))
            if result.exists() and all(code == 0 for code, _ in logs):
                return json.loads(result.read_text())
        if attempt == 0 and any("address already in use" in out.lower() for _, out in logs):
            continue  # the free port was taken meanwhile: once more
        tails = "\n".join(f"--- rank {r} (exit {c}):\n{out[-3000:]}" for r, (c, out) in
                          enumerate(logs))  # fmt: skip
        message = f"bench.fsdp {kind} worker ({','.join(methods)}) failed:\n{tails}"
        raise LaunchError(message, _last_words(logs, args.timeout))
    raise AssertionError("unreachable")


def _last_words(logs: list[tuple[int | None, str]], timeout: int) -> str:
    for code, out in logs:
        if code is None:
            return f"killed after {timeout} s (hung)"
        if code != 0:
            lines = [line.strip() for line in out.splitlines() if line.strip()]
            return measure._short(f"exit {code}" + (f": {lines[-1]}" if lines else ""))
    return "no result"


def time_all(args) -> dict:
    """The timing launch. Where it dies with Opacus among the methods (a crash or a hang: an
    exception the ranks report themselves), once more without Opacus, whose result is then
    that failure."""
    try:
        return launch(args, "time", args.methods)
    except LaunchError as e:
        if OPACUS not in args.methods:
            raise
        sys.stderr.write(f"{e}\nonce more without Opacus\n")
        reason = f"the ranks died: {e.reason}"
    result = launch(args, "time", [m for m in args.methods if m != OPACUS])
    rec = measure.Record(MODEL, OPACUS, args.batch, "cpu", "unsupported", reason)
    result["records"].append({**rec.as_dict(), "rank_times_s": []})
    result["check"] = {"agree": None, "line": f"agreement: not checked, {LABELS[OPACUS]}: {reason}"}
    return result


def _run_ranks(argv: list[str], args, env: dict | None, tmp: Path) -> list[tuple[int | None, str]]:
    """(exit status, None when killed at the deadline; output) per rank."""
    port = free_port()
    procs, logs = [], []
    for rank in range(args.procs):
        rank_env = {
            **(env or os.environ), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "WORLD_SIZE": str(args.procs), "RANK": str(rank), "LOCAL_RANK": str(rank),
            "OMP_NUM_THREADS": str(args.threads),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }  # fmt: skip
        if sys.platform.startswith("linux"):
            rank_env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        log = open(tmp / f"rank{rank}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen(argv, env=rank_env, stdout=log, stderr=subprocess.STDOUT,
                                      cwd=ROOT))  # fmt: skip
    deadline = time.monotonic() + args.timeout
    codes: list[int | None] = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(deadline - time.monotonic(), 0.1)))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            codes.append(None)
    out = []
    for code, log in zip(codes, logs, strict=True):
        log.seek(0)
        out.append((code, log.read()))
        log.close()
    return out


# -- the report ----------------------------------------------------------------------------------


def markdown(data: dict) -> str:
    """The time and peak-memory tables (ratios to the plain FSDP step), the failures' notes and
    the check's line."""
    m, records = data["machine"], data["records"]
    methods = [r["method"] for r in records if r["method"] != "plain"]
    plain = next((r for r in records if r["method"] == "plain"), {})
    notes: list[str] = []

    def cell(r: dict, values: dict[str, float]) -> str:
        if r["status"] == "ok":
            return f"{values[r['method']]:.2f}x" if r["method"] in values else "n/a"
        note = f"{LABELS.get(r['method'], r['method'])}: {r['reason']}"
        if note not in notes:
            notes.append(note)
        return f"{r['status']} [{notes.index(note) + 1}]"

    def table(what: str, first: str, value: str) -> list[str]:
        values = ratios(records, MODEL, what)
        cols = ["model", first, *(LABELS.get(x, x) for x in methods)]
        row = [MODEL, value, *(cell(r, values) for r in records if r["method"] != "plain")]
        return ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols),
                "| " + " | ".join(row) + " |"]  # fmt: skip

    ms = f"{plain['median_s'] * 1e3:.1f}" if plain.get("median_s") else "n/a"
    lines = [
        f"# {data['title']}", "", f"`{data['command']}`", "",
        f"{m['cpu']}, {m['cores']} cores; {data['procs']} processes (gloo), "
        f"{data['threads']} torch thread{'s' if data['threads'] != 1 else ''} each; torch {m['torch']}, Python {m['python']}, opacus "
        f"{m.get('opacus')}. Batch {data['batch']} per rank ({data['procs'] * data['batch']} in "
        f"all), seq {data['seq']}. Median of {data['reps']} steps, each its slowest rank's, "
        "wall clock.",
        "", f"## cpu, {data['procs']} processes, batch {data['batch']} per rank", "",
        "Time, as a ratio to the plain FSDP step's:", "",
        *table("median_s", "plain step (ms)", ms),
    ]  # fmt: skip
    if any(r.get("peak_bytes") is not None for r in records):
        peak = plain.get("peak_bytes")
        mib = f"{peak / MIB:.1f}" if peak else "n/a"
        lines += ["", "Peak memory of one step (the largest rank's), as a ratio to the plain "
                  "FSDP step's:", "", *table("peak_bytes", "plain step (MiB)", mib)]  # fmt: skip
    if notes:
        lines += ["", *(f"[{i}] {n}" for i, n in enumerate(notes, 1))]
    if data.get("check"):
        lines += ["", data["check"]["line"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
        return 0
    from bench.run import machine

    memory = not args.no_memory and measure.cpu_memory_supported()
    if not args.no_memory and not memory:
        print("CPU peak memory needs Linux /proc (VmHWM, clear_refs): not measured here")
    print(f"timing {', '.join(args.methods)} on {args.procs} processes ...", flush=True)
    result = time_all(args)
    records = result["records"]
    for r in records:
        if memory and r["status"] == "ok":
            print(f"peak memory of {r['method']} (fresh processes) ...", flush=True)
            try:
                peaks = launch(args, "memory", [r["method"]], env=measure.memory_env())
                r["rank_peak_bytes"] = peaks["rank_peak_bytes"]
                r["peak_bytes"] = max(peaks["rank_peak_bytes"])
            except LaunchError as e:
                sys.stderr.write(f"{e}\n")
    info = machine()
    info["torch_threads"] = args.threads
    given = argv if argv is not None else sys.argv[1:]
    data = {
        "title": "DP-SGD under FSDP2: gradhooks and Opacus",
        "command": " ".join(["python -m bench.fsdp", *map(shlex.quote, given)]).strip(),
        "machine": info, "procs": args.procs, "batch": args.batch, "seq": args.seq,
        "reps": args.reps, "threads": args.threads, "model": MODEL,
        "check": result["check"], "records": records,
    }  # fmt: skip
    stem = write_results(args.out, "fsdp-cpu", data, markdown(data))
    print(f"written: {stem.with_suffix('.json')}, {stem.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

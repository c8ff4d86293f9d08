"""Where a hooked step's host time goes, on the host suite's tiny models (1 thread).

    python -m bench.host_profile --models tiny-mlp,tiny-gpt2

For each model, at its own batch:

- **calls**: torch functions in one plain forward (a counting ``TorchFunctionMode``), how
  many times the batch tracker's ``__torch_function__`` (:class:`gradhooks.tracking.tracker.Tracker`)
  runs in one step of gradhooks' grad1 (forward and backward), and the operations through
  torch's dispatcher in one step of plain forward+backward and of grad1 (``torch.profiler``,
  those no other operation calls, by name), and in one book-keeping DP step (the norms, with
  an SGD update): the host work a GPU pays per kernel launched, a count the machine's load
  does not change;
- **time**: medians of interleaved repetitions (process CPU time) of the plain forward, the
  hooked forward, plain forward+backward and gradhooks' grad1 step;
- **profile**: ``cProfile`` over the same steps of grad1: the tracker's share of the step (its
  ``__torch_function__`` inclusive of what it calls, less the torch functions it hands on: what
  following the batch adds), the forward's share, and the gradhooks functions with the most
  time of their own. cProfile slows Python more than C, so shares are upper bounds;
- **stages**: where the grad1 step's CPU time goes by the engine's entry points, timed by the
  thread's CPU clock around each (the outermost only): the hooks torch calls
  (:class:`gradhooks.engine.records.Hook`, by the function each wraps: the root's pre- and
  post-hook, each hooked call's pre-hooks and forward hook), a hooked call's backward from its
  output-gradient (:meth:`~gradhooks.engine.backward.BackwardWriter.output_grads`: the rule, the
  pieces, ``grad1``), the parameters' gradient hooks and the backward's end (the checks, the
  spot check); the rest is the model's own work (its torch functions, the tracker following
  them, autograd's backward), beside plain forward+backward's;
- **graph breaks** (``--explain``): ``torch._dynamo.explain`` of the hooked model (the default
  backend, not fullgraph): how many graphs and why the forward breaks, by kind and where.

Writes ``bench/results/host-profile-cpu.{json,md}`` (``--out`` for another folder;
``--device cuda``: the same on a CUDA device, the host's CPU time, ``host-profile-cuda``).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

import gradhooks
from bench import measure
from bench.methods import graph_break_kind
from bench.module_cost import Count, tracker_calls
from bench.problems import PROBLEMS
from bench.report import write_results
from gradhooks.engine.records import Hook

HOOK_CALL = Hook.__call__  # (StageClock wraps it for its block only)

ROOT = Path(__file__).resolve().parent.parent
GRADHOOKS = str(Path(gradhooks.__file__).resolve().parent)
# where the tracker hands the model's torch functions on: its mode, and its short way
_HANDS_ON = {("tracker.py", "__torch_function__"), ("quick.py", "quick_follow")}


def _setup(name: str, device: str = "cpu"):
    problem = PROBLEMS[name]
    base, x, y = measure.instance(problem, problem.batch, device)
    plain, hooked = copy.deepcopy(base), copy.deepcopy(base)
    hooks = gradhooks.add_hooks(hooked, loss_reduction="mean")

    def clear(model) -> None:
        for p in model.parameters():
            p.grad = None
        hooks.clear()

    steps = {
        "plain forward": lambda: plain(x),
        "hooked forward": lambda: (hooked(x), hooks.clear()),
        "plain fwd+bwd": lambda: problem.loss(plain(x), y).backward(),
        "grad1 fwd+bwd": lambda: problem.loss(hooked(x), y).backward(),
    }
    resets = {k: (lambda m=(hooked if "hooked" in k or "grad1" in k else plain): clear(m))
              for k in steps}  # fmt: skip
    return problem, plain, hooked, hooks, x, y, steps, resets


def _is_torch_function(func: tuple) -> bool:
    """A cProfile entry that is a torch function the tracker hands on (the model's operation),
    not a helper of its own bookkeeping (``torch.utils.weak``, builtins)."""
    file, _, name = func
    if file == "~":
        return "torch" in name or "TensorBase" in name
    return file.endswith(("torch/nn/functional.py", "torch/functional.py", "torch/_tensor.py"))


def _share(stats: pstats.Stats, total: float) -> dict:
    """The tracker's share (its ``__torch_function__`` inclusive, less the torch functions it
    hands on), gradhooks' share (every gradhooks function entered from outside gradhooks,
    inclusive, less the same), and the gradhooks functions with the most time of their own."""
    tracker = entered = handed_on = 0.0
    own: dict[str, float] = {}
    for func, (_, _, tt, ct, callers) in stats.stats.items():
        file, _, fname = func
        mine = file.startswith(GRADHOOKS)
        if mine:
            key = f"{Path(file).name}:{fname}"
            own[key] = own.get(key, 0.0) + tt
            if fname == "__torch_function__" and file.endswith("tracker.py"):
                tracker += ct
        for caller, (_, _, _, cct) in callers.items():
            if mine and not caller[0].startswith(GRADHOOKS):
                entered += cct
            if (Path(caller[0]).name, caller[2]) in _HANDS_ON and _is_torch_function(func):
                handed_on += cct
    top = sorted(own.items(), key=lambda kv: -kv[1])[:8]
    return {
        "tracker_share": (tracker - handed_on) / total,
        "gradhooks_share": (entered - handed_on) / total,
        "top_own": [(k, v / total) for k, v in top],
    }


def dispatched(step, reset) -> dict[str, int]:
    """The operations through torch's dispatcher in one ``step`` (after ``reset``), by name:
    those ``torch.profiler`` records outside any other operation (the autograd engine's
    included)."""
    from torch.profiler import ProfilerActivity, profile

    reset()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    found: dict[str, int] = {}
    for e in prof.events():
        parent = e.cpu_parent
        if e.name.startswith("aten::") and (parent is None or not parent.name.startswith("aten::")):
            found[e.name] = found.get(e.name, 0) + 1
    return dict(sorted(found.items(), key=lambda kv: (-kv[1], kv[0])))


def _dp_step(problem, base, x, y):
    """One book-keeping DP step (``dp_sgd_step`` with the norms, an SGD update: the host
    suite's) on a copy of ``base``, run past the steps the run-time check verifies: (step,
    reset, hooks)."""
    from bench.methods import PER_EXAMPLE

    model = copy.deepcopy(base)
    hooks = gradhooks.add_hooks(model, quantities=("norms",))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-3)
    gen = torch.Generator(device=x.device).manual_seed(0)
    each = PER_EXAMPLE[problem.loss]

    def step() -> None:
        losses = each(model(x), y)
        gradhooks.dp_sgd_step(hooks, losses, max_norm=1.0, noise_multiplier=1.0, generator=gen)
        opt.step()

    def reset() -> None:
        hooks.clear()
        for p in params:
            p.grad = None

    for _ in range(9):  # (the 1st, 2nd, 4th and 8th backwards are checked)
        reset()
        step()
    return step, reset, hooks


def device_side(step, reset, reps: int) -> dict[str, float]:
    """On a CUDA device, one steady ``step`` (after ``reset``) seen from the device: the
    times the host waits for it (torch's ``set_sync_debug_mode`` warnings), the kernels
    launched and their summed time (``torch.profiler``), beside the step's wall time (median
    of ``reps``, synchronized on both sides). A device busy for a small part of the wall time
    waits for the host: the step is host-bound."""
    from torch.profiler import ProfilerActivity, profile

    reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    waits = sum("synchroniz" in str(w.message) for w in caught)
    reset()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    walls = []
    for _ in range(reps):
        reset()
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
    return {
        "waits": waits,
        "kernels": len(kernels),
        "kernel_us": sum(e.time_range.elapsed_us() for e in kernels),
        "wall_us": statistics.median(walls) * 1e6,
    }


# The engine's entry points a hooked step passes through, by stage: (label, what each times:
# a Hook's function by a part of its qualified name, or a BackwardWriter method)
STAGES = (
    ("forward starts", ("on_root_pre", "entry_hooks.<locals>.pre")),
    ("a call's pre-hooks", ("enter_hook",)),
    ("a call's forward hook", ("_forward_then", "forward_hook")),
    ("forward ends", ("on_root_post", "entry_hooks.<locals>.post")),
    ("a call's backward", ("output_grads", "node_grads")),
    ("parameters' hooks", ("_param_grad",)),
    ("backward ends", ("_end_backward",)),
)


class StageClock:
    """Within the block, the CPU time (``time.thread_time_ns``: autograd runs a CPU backward
    on the calling thread) spent in each of :data:`STAGES`, by wrapping ``Hook.__call__`` and
    the :class:`~gradhooks.engine.backward.BackwardWriter` methods; a stage entered inside
    another (a hook run by a backward of the engine's own) counts to the outer one."""

    def __init__(self) -> None:
        self.ns = {label: 0 for label, _ in STAGES}
        self._depth = 0
        self._undo: list = []
        self._labels: dict[str, str | None] = {}

    def _stage_of(self, name: str) -> str | None:
        found = self._labels.get(name, self)
        if found is self:  # (looked up once per name: the clock's own work stays small)
            found = self._labels[name] = next(
                (label for label, parts in STAGES if any(p in name for p in parts)), None
            )
        return found

    def _timed(self, label: str | None, call, *args, **kwargs):
        if label is None or self._depth:
            return call(*args, **kwargs)
        self._depth += 1
        start = time.thread_time_ns()
        try:
            return call(*args, **kwargs)
        finally:
            self.ns[label] += time.thread_time_ns() - start
            self._depth -= 1

    def __enter__(self) -> StageClock:
        from gradhooks.engine.backward import BackwardWriter

        clock, hook_call = self, Hook.__call__

        def timed_hook(hook, *args):
            name = getattr(hook.fn, "__qualname__", "")
            return clock._timed(clock._stage_of(name), hook_call, hook, *args)

        self._undo.append((Hook, "__call__", hook_call))
        Hook.__call__ = timed_hook
        for label, parts in STAGES[4:]:
            for part in parts:
                method = getattr(BackwardWriter, part)

                def timed_method(writer, *args, _m=method, _label=label):
                    return clock._timed(_label, _m, writer, *args)

                self._undo.append((BackwardWriter, part, method))
                setattr(BackwardWriter, part, timed_method)
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)
        self._undo.clear()


def stages(step, reset, plain_step, plain_reset, reps: int) -> dict:
    """µs of CPU time per grad1 step in each of :data:`STAGES`, the rest of the step, the whole
    step and plain forward+backward (medians over ``reps`` interleaved steps). The whole steps
    by the process's CPU time: on a CUDA device autograd runs the backward on a thread of its
    own, which the stages' thread clock follows but the calling thread's would miss."""
    per: dict[str, list[float]] = {label: [] for label, _ in STAGES}
    whole, plain = [], []
    for _ in range(reps):
        plain_reset()
        start = time.process_time_ns()
        plain_step()
        plain.append((time.process_time_ns() - start) / 1e3)
        reset()
        with StageClock() as clock:
            start = time.process_time_ns()
            step()
            whole.append((time.process_time_ns() - start) / 1e3)
        for label, ns in clock.ns.items():
            per[label].append(ns / 1e3)
    out = {label: statistics.median(v) for label, v in per.items()}
    out["the rest"] = max(0.0, statistics.median(whole) - sum(out.values()))
    out["grad1 step"] = statistics.median(whole)
    out["plain fwd+bwd"] = statistics.median(plain)
    return out


def profile_model(name: str, reps: int, explain: bool, device: str = "cpu") -> dict:
    problem, plain, hooked, hooks, x, y, steps, resets = _setup(name, device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for k, step in steps.items():  # warm-up (and the first backwards' checks)
            for _ in range(3):
                resets[k]()
                step()
        counter = Count()
        with torch.enable_grad(), counter:
            plain(x)
        resets["grad1 fwd+bwd"]()
        tracker_step = tracker_calls(steps["grad1 fwd+bwd"])
        resets["grad1 fwd+bwd"]()
        tracker_forward = tracker_calls(steps["hooked forward"])
        for _ in range(len(list(hooked.parameters()))):  # (the spot check's first round:
            resets["grad1 fwd+bwd"]()  # each parameter's entries chosen once)
            steps["grad1 fwd+bwd"]()
        ops = {k: dispatched(steps[k], resets[k]) for k in ("plain fwd+bwd", "grad1 fwd+bwd")}
        dp_step, dp_reset, dp_hooks = _dp_step(problem, plain, x, y)
        ops["dp step"] = dispatched(dp_step, dp_reset)
        times: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(reps):
            for k, step in steps.items():
                resets[k]()
                start = time.process_time()
                step()
                times[k].append(time.process_time() - start)
        median = {k: statistics.median(v) for k, v in times.items()}
        profiler = cProfile.Profile()
        resets["grad1 fwd+bwd"]()
        for _ in range(reps):
            resets["grad1 fwd+bwd"]()
            profiler.enable()
            steps["grad1 fwd+bwd"]()
            profiler.disable()
        stats = pstats.Stats(profiler)
        total = stats.total_tt
        share = _share(stats, total)
        # (after the profile: its steps are the same backwards of the handle as before, the
        # 1st, 2nd, 4th... of which the run-time check verifies)
        staged = stages(
            steps["grad1 fwd+bwd"], resets["grad1 fwd+bwd"],
            steps["plain fwd+bwd"], resets["plain fwd+bwd"], reps,
        )  # fmt: skip
        seen = {}
        if x.is_cuda:
            runs = {k: (steps[k], resets[k]) for k in ("plain fwd+bwd", "grad1 fwd+bwd")}
            runs["dp step"] = (dp_step, dp_reset)
            for k, (step, reset) in runs.items():
                try:
                    seen[k] = device_side(step, reset, reps)
                except Exception as e:  # (a measurement, not a check: say why, go on)
                    seen[k] = {"error": f"{type(e).__name__}: {e}"[:200]}
    dp_hooks.remove()
    out = {
        "model": name,
        "label": problem.label,
        "torch_functions_plain_forward": counter.calls,
        "tracker_calls_step": tracker_step,
        "tracker_calls_forward": tracker_forward,
        "dispatched_ops": ops,
        "median_s": median,
        "stages_us": staged,
        "profile": {**share, "profiled_s": total / reps},
    }
    if seen:
        out["device_side"] = seen
    if explain:
        out["graph_breaks"] = _explain(hooked, hooks, x)
    hooks.remove()
    return out


def _explain(hooked, hooks, x) -> dict:
    import torch._dynamo
    from torch._dynamo.utils import counters

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hooks.clear()
        counters.clear()
        result = torch._dynamo.explain(hooked)(x)
        hooks.clear()
    kinds: dict[str, int] = {}  # (dynamo's counters: every frame it compiled, resumed ones too)
    for reason, n in counters["graph_break"].items():
        kind = graph_break_kind(reason)
        kinds[kind] = kinds.get(kind, 0) + n
    where: dict[str, int] = {}
    for br in result.break_reasons:
        frame = br.user_stack[-1] if br.user_stack else None
        if frame is not None:
            at = f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"
            where[at] = where.get(at, 0) + 1
    return {
        "graphs": result.graph_count,
        "graph_breaks": len(result.break_reasons),  # (graph_break_count: graphs - 1)
        "ops_in_graphs": result.op_count,
        "kinds": sorted(kinds.items(), key=lambda kv: -kv[1]),
        "where": sorted(where.items(), key=lambda kv: -kv[1])[:8],
    }


def markdown(data: dict) -> str:
    lines = [
        "# Where a hooked step's host time goes (tiny models, 1 thread)",
        "",
        f"`{data['command']}`",
        "",
        "| model | torch functions, plain forward | tracker calls, grad1 step (forward) "
        "| dispatched operations, plain fwd+bwd / grad1 step / DP step | plain fwd (ms) | hooked fwd (ms) | plain fwd+bwd (ms) | grad1 step (ms) "
        "| hooked fwd / grad1 step | tracker / grad1 step (cProfile) "
        "| gradhooks / grad1 step (cProfile) |",
        "|" + " --- |" * 11,
    ]
    for r in data["models"]:
        m, p, ops = r["median_s"], r["profile"], r["dispatched_ops"]
        lines.append(
            f"| {r['label']} | {r['torch_functions_plain_forward']} "
            f"| {r['tracker_calls_step']} ({r['tracker_calls_forward']}) "
            f"| {sum(ops['plain fwd+bwd'].values())} / {sum(ops['grad1 fwd+bwd'].values())} / "
            f"{sum(ops['dp step'].values())} "
            f"| {m['plain forward'] * 1e3:.2f} | {m['hooked forward'] * 1e3:.2f} "
            f"| {m['plain fwd+bwd'] * 1e3:.2f} | {m['grad1 fwd+bwd'] * 1e3:.2f} "
            f"| {m['hooked forward'] / m['grad1 fwd+bwd']:.0%} | {p['tracker_share']:.0%} "
            f"| {p['gradhooks_share']:.0%} |"
        )
    labels = [label for label, _ in STAGES] + ["the rest"]
    lines += [
        "",
        "Where the grad1 step's CPU time goes, µs per step (medians; the share of the step):",
        "",
        "| model | plain fwd+bwd | grad1 step | " + " | ".join(labels) + " |",
        "|" + " --- |" * (3 + len(labels)),
    ]
    for r in data["models"]:
        st = r["stages_us"]
        cells = " | ".join(f"{st[k]:.0f} ({st[k] / st['grad1 step']:.0%})" for k in labels)
        lines.append(
            f"| {r['label']} | {st['plain fwd+bwd']:.0f} | {st['grad1 step']:.0f} | {cells} |"
        )
    seen = [r for r in data["models"] if "device_side" in r]
    if seen:
        lines += [
            "",
            "Seen from the device, one steady step: the times the host waits for the device, "
            "the kernels launched, the device's busy time (the kernels' summed time) against "
            "the step's wall time (a device busy a small part of the step waits for the host):",
            "",
            "| model | step | waits for the device | kernels | kernels' time (µs) "
            "| wall time (µs) | device busy |",
            "|" + " --- |" * 7,
        ]
        for r in seen:
            for k, d in r["device_side"].items():
                if "error" in d:
                    lines.append(f"| {r['label']} | {k} | {d['error']} | | | | |")
                    continue
                lines.append(
                    f"| {r['label']} | {k} | {d['waits']} | {d['kernels']} "
                    f"| {d['kernel_us']:.0f} | {d['wall_us']:.0f} "
                    f"| {d['kernel_us'] / d['wall_us']:.0%} |"
                )
    for r in data["models"]:
        top = ", ".join(f"{k} {v:.0%}" for k, v in r["profile"]["top_own"])
        lines += ["", f"{r['label']}, gradhooks functions by own time (cProfile): {top}"]
        plain, hooked = r["dispatched_ops"]["plain fwd+bwd"], r["dispatched_ops"]["grad1 fwd+bwd"]
        more = {k: n - plain.get(k, 0) for k, n in hooked.items() if n > plain.get(k, 0)}
        listed = ", ".join(f"{n}x {k.removeprefix('aten::')}" for k, n in more.items())
        lines += ["", f"{r['label']}, operations a grad1 step dispatches beyond plain's: {listed}"]
        dp = r["dispatched_ops"]["dp step"]
        listed = ", ".join(f"{n}x {k.removeprefix('aten::')}" for k, n in dp.items())
        lines += ["", f"{r['label']}, operations of a DP step (book-keeping, SGD update): {listed}"]
        if "graph_breaks" in r:
            g = r["graph_breaks"]
            kinds = "; ".join(f"{n}x {k}" for k, n in g["kinds"])
            where = "; ".join(f"{n}x {k}" for k, n in g["where"])
            lines += [
                "",
                f"{r['label']}, torch._dynamo.explain of the hooked model: {g['graphs']} graphs "
                f"({g['ops_in_graphs']} operations in them), {g['graph_breaks']} graph breaks: "
                f"{kinds}. Where: {where}.",
            ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.host_profile",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--models", default="tiny-mlp,tiny-gpt2")
    p.add_argument("--reps", type=int, default=31)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--explain", action="store_true", help="the graph breaks under torch.compile")
    p.add_argument("--device", default="cpu", help="cpu or cuda (the host's CPU time either way)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in PROBLEMS]
    if unknown:
        raise SystemExit(f"unknown models: {', '.join(unknown)}")
    data = {
        "command": "python -m bench.host_profile " + " ".join(argv or sys.argv[1:]),
        "models": [profile_model(n, args.reps, args.explain, args.device) for n in names],
    }
    write_results(args.out, f"host-profile-{args.device.split(':')[0]}", data, markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a hooked module costs the host per step, as a function of the torch calls in its forward.

    python -m bench.module_cost --ks 0,4,16,64 --ns 2,8

The model is a stack of ``N`` blocks, each an ``nn.Linear(w, w)`` followed by ``k`` cheap
pointwise torch calls (``h * a``, ``h + b``, alternately) in the block's forward; tiny width
(``w = 8``), a batch of 4, 1 thread, so that a step's time is the host's Python, not its
arithmetic. For every ``(N, k)`` and every method (``plain``: forward and backward without hooks;
``grad1``, ``norms``: the same step under ``gradhooks.add_hooks`` with that quantity), the step's
process CPU time is taken over interleaved rounds (every configuration and method in turn, each
round, so that a slow spell of the machine falls on all of them), and the median kept.

Per method the medians are fitted (least squares) with

    t(N, k) = fixed + N · (per_module + k · per_call)

``per_module`` (us): what one hooked block costs with no torch call of its own besides its
Linear (the intercept per module); ``per_call`` (us): what each torch call inside the forward
adds (the slope). gradhooks' overhead is the difference with ``plain``: the peers pay per hooked
module, a tracker that sees every torch function pays per call. The torch functions of one plain
forward (a counting ``TorchFunctionMode``) and the batch tracker's calls in one grad1 step are
counted for each configuration too.

Besides gradhooks' methods, for comparison (``--methods``):

- ``opacus``: Opacus' ``GradSampleModule`` (hooks; its per-example gradients in
  ``grad_sample``), where Opacus is installed;
- ``floor``: the least a design by hooks does per hooked Linear (:class:`Floor`): a forward hook
  keeps the input and puts a gradient hook on the output, which forms the weight's and the
  bias's per-example gradients; no check, no following of the batch;
- ``floor+mode``: the same, with a ``TorchFunctionMode`` that does nothing but pass each torch
  function on, entered for the model's forward: what seeing every torch function of the
  forward costs by itself, as a batch tracker must.

Writes ``module-cost-cpu.{json,md}`` under ``--out`` (default ``bench/results``).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

import gradhooks
from bench.report import write_results
from gradhooks.tracking import tracker as tracker_module

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("plain", "grad1", "norms")
# measured for comparison, where asked for (see the module's docstring)
COMPARED = ("floor", "floor+mode", "opacus")


class Block(nn.Module):
    """``nn.Linear(w, w)``, then ``k`` pointwise torch calls (a scale and a shift, alternately,
    which keep the values bounded whatever ``k``)."""

    def __init__(self, width: int, k: int) -> None:
        super().__init__()
        self.linear, self.k = nn.Linear(width, width), k

    def forward(self, x: Tensor) -> Tensor:
        h = self.linear(x)
        for i in range(self.k):
            h = h * 0.5 if i % 2 == 0 else h + 0.25
        return h


def stack(n: int, k: int, width: int = 8) -> nn.Sequential:
    """``n`` blocks of ``k`` calls each, seeded."""
    torch.manual_seed(0)
    return nn.Sequential(*(Block(width, k) for _ in range(n)))


class Count(TorchFunctionMode):
    """Counts the torch functions called inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


class Floor:
    """The least a design by hooks does per hooked ``nn.Linear``, for comparison: its forward
    hook keeps the input, detached, and puts a hook on the output's gradient that writes
    ``grad1`` of the weight and the bias (``batch ·`` the outer products: the loss is a mean
    over the examples). ``mode``: a :class:`Passing` mode is entered for the model's forward."""

    def __init__(self, model: nn.Module, mode: bool) -> None:
        self.handles = [
            m.register_forward_hook(self._forward)
            for m in model.modules()
            if isinstance(m, nn.Linear)
        ]
        if mode:
            self.mode = Passing()
            self.handles.append(model.register_forward_pre_hook(self._enter))
            self.handles.append(model.register_forward_hook(self._exit))

    def _enter(self, module: nn.Module, args: tuple) -> None:
        self.mode.__enter__()  # (it returns the mode: never the pre-hook's result)

    def _exit(self, module: nn.Module, args: tuple, output: Tensor) -> None:
        self.mode.__exit__(None, None, None)

    @staticmethod
    def _forward(module: nn.Linear, args: tuple, output: Tensor) -> None:
        a = args[0].detach()

        def backward(g: Tensor) -> None:
            g = g * a.shape[0]
            module.weight.grad1 = torch.mul(g.unsqueeze(2), a.unsqueeze(1))
            module.bias.grad1 = g

        output.register_hook(backward)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class Passing(TorchFunctionMode):
    """Passes every torch function on, unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def torch_calls(model: nn.Module, x: Tensor) -> int:
    """The torch functions one plain forward of ``model`` calls."""
    counter = Count()
    with counter:
        model(x)
    return counter.calls


def tracker_calls(step: Callable[[], None]) -> int:
    """How many times the batch tracker's ``__torch_function__`` runs in ``step()``."""
    original = tracker_module.Tracker.__torch_function__
    count = [0]

    def counted(self, func, types, args=(), kwargs=None):
        count[0] += 1
        return original(self, func, types, args, kwargs)

    tracker_module.Tracker.__torch_function__ = counted
    try:
        step()
    finally:
        tracker_module.Tracker.__torch_function__ = original
    return count[0]


def _loss(out: Tensor) -> Tensor:
    return out.pow(2).sum(1).mean()


class Config:
    """One ``(N, k)``: a model per method (the hooked ones under their own hooks), one batch,
    and each method's step and reset."""

    def __init__(self, n: int, k: int, width: int, batch: int, methods: tuple[str, ...]) -> None:
        self.n, self.k = n, k
        self.x = torch.randn(batch, width, generator=torch.Generator().manual_seed(1))
        self.models = {m: stack(n, k, width) for m in methods}
        self.hooks = {}
        for m, model in self.models.items():
            if m in METHODS and m != "plain":
                self.hooks[m] = gradhooks.add_hooks(model, quantities=(m,))
            elif m in ("floor", "floor+mode"):
                self.hooks[m] = Floor(model, mode=m == "floor+mode")
            elif m == "opacus":
                from opacus import GradSampleModule

                self.models[m] = GradSampleModule(model)

    def step(self, method: str) -> None:
        _loss(self.models[method](self.x)).backward()

    def reset(self, method: str) -> None:
        for p in self.models[method].parameters():
            p.grad = None
            if method == "opacus":
                p.grad_sample = None
            elif method in ("floor", "floor+mode"):
                p.__dict__.pop("grad1", None)
        if method in METHODS and method in self.hooks:
            self.hooks[method].clear()

    def per_example(self, method: str) -> list[Tensor]:
        """Each parameter's per-example gradients after a step of ``method``."""
        attr = "grad_sample" if method == "opacus" else "grad1"
        return [getattr(p, attr) for p in self.models[method].parameters()]

    def close(self) -> None:
        for h in self.hooks.values():
            h.remove()
        if "opacus" in self.models:
            self.models["opacus"].remove_hooks()


def check(config: Config, methods: tuple[str, ...]) -> None:
    """The per-example gradients of the methods compared, after their last step, against
    gradhooks' ``grad1`` (or the per-example loop where grad1 is not measured): each measured
    method computes what the others do."""
    compared = [m for m in methods if m in COMPARED]
    if not compared:
        return
    if "grad1" in methods:
        want = config.per_example("grad1")
    else:
        model = config.models[methods[0]]
        want = [
            torch.stack(list(g))
            for g in zip(*(
                torch.autograd.grad(_loss(model(config.x[i : i + 1])), list(model.parameters()))
                for i in range(config.x.shape[0])
            ))
        ]  # fmt: skip
    for m in compared:
        for got, expected in zip(config.per_example(m), want):
            if not torch.allclose(got, expected, rtol=1e-4, atol=1e-6):
                raise RuntimeError(f"{m}'s per-example gradients differ from grad1's")


def fit(rows: list[dict], method: str) -> dict:
    """Least squares of ``t = fixed + N·per_module + N·k·per_call`` over ``rows`` (each with
    ``n``, ``k`` and ``median_us[method]``); with the largest relative residual."""
    n = np.array([r["n"] for r in rows], dtype=float)
    k = np.array([r["k"] for r in rows], dtype=float)
    t = np.array([r["median_us"][method] for r in rows], dtype=float)
    a = np.stack([np.ones_like(n), n, n * k], axis=1)
    coef, *_ = np.linalg.lstsq(a, t, rcond=None)
    residual = np.abs(a @ coef - t) / t
    fixed, per_module, per_call = (float(c) for c in coef)
    return {
        "fixed_us": fixed,
        "per_module_us": per_module,
        "per_call_us": per_call,
        "max_rel_residual": float(residual.max()),
    }


def measure(
    ns: list[int],
    ks: list[int],
    *,
    width: int = 8,
    batch: int = 4,
    rounds: int = 5,
    reps: int = 10,
    warmup: int = 3,
    methods: tuple[str, ...] = METHODS,
) -> dict:
    """Median step CPU time (us) per ``(N, k)`` and method over interleaved rounds, the counts,
    and the fits."""
    configs = [Config(n, k, width, batch, methods) for n in ns for k in ks]
    times: dict[tuple[int, str], list[float]] = {
        (i, m): [] for i in range(len(configs)) for m in methods
    }
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for c in configs:  # warm-up: the first backwards of new calls are checked
                for m in methods:
                    for _ in range(warmup):
                        c.reset(m)
                        c.step(m)
                check(c, methods)
            for _ in range(rounds):
                for i, c in enumerate(configs):
                    for m in methods:
                        for _ in range(reps):
                            c.reset(m)
                            start = time.process_time()
                            c.step(m)
                            times[i, m].append(time.process_time() - start)
            rows = []
            for i, c in enumerate(configs):
                row = {
                    "n": c.n,
                    "k": c.k,
                    "torch_calls_forward": torch_calls(c.models[methods[0]], c.x),
                    "median_us": {m: statistics.median(times[i, m]) * 1e6 for m in methods},
                }
                if "grad1" in methods:
                    c.reset("grad1")
                    row["tracker_calls_step"] = tracker_calls(lambda c=c: c.step("grad1"))
                rows.append(row)
    finally:
        for c in configs:
            c.close()
    fits = {m: fit(rows, m) for m in methods}
    if "plain" in methods:
        for m in methods:
            if m != "plain":
                fits[f"{m} - plain"] = {
                    key: fits[m][key] - fits["plain"][key]
                    for key in ("fixed_us", "per_module_us", "per_call_us")
                }
    return {
        "setup": {"width": width, "batch": batch, "rounds": rounds, "reps": reps,
                  "threads": torch.get_num_threads(), "clock": "process CPU time"},
        "rows": rows,
        "fit": fits,
    }  # fmt: skip


def markdown(data: dict) -> str:
    s = data["setup"]
    methods = list(data["rows"][0]["median_us"])
    lines = [
        "# Host cost per hooked module and per torch call (CPU)",
        "",
        f"`{data['command']}`",
        "",
        f"A stack of N blocks (`nn.Linear({s['width']}, {s['width']})` then k pointwise calls), "
        f"batch {s['batch']}, {s['threads']} thread(s); median step time ({s['clock']}) over "
        f"{s['rounds']} interleaved rounds of {s['reps']} steps.",
        "",
        "| N | k | torch calls, plain fwd | tracker calls, grad1 step | "
        + " | ".join(f"{m} (us)" for m in methods)
        + " | "
        + " | ".join(f"{m} / plain" for m in methods if m != "plain")
        + " |",
        "|" + " --- |" * (4 + len(methods) + len(methods) - ("plain" in methods)),
    ]
    for r in data["rows"]:
        t = r["median_us"]
        ratios = [f"{t[m] / t['plain']:.1f}x" for m in methods if m != "plain" and "plain" in t]
        lines.append(
            f"| {r['n']} | {r['k']} | {r['torch_calls_forward']} | "
            f"{r.get('tracker_calls_step', '-')} | "
            + " | ".join(f"{t[m]:.0f}" for m in methods)
            + (" | " + " | ".join(ratios) if ratios else "")
            + " |"
        )
    lines += [
        "",
        "Fit `t = fixed + N · (per_module + k · per_call)`:",
        "",
        "| method | fixed (us) | per hooked module (us) | per torch call in a forward (us) "
        "| max relative residual |",
        "| --- | --- | --- | --- | --- |",
    ]
    for m, f in data["fit"].items():
        res = f"{f['max_rel_residual']:.0%}" if "max_rel_residual" in f else "-"
        lines.append(
            f"| {m} | {f['fixed_us']:.0f} | {f['per_module_us']:.1f} | {f['per_call_us']:.2f} "
            f"| {res} |"
        )
    return "\n".join(lines) + "\n"


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.module_cost",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--ns", default="2,8", help="blocks in the stack, comma-separated")
    p.add_argument("--ks", default="0,4,16,64", help="pointwise calls per block")
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=10, help="steps per method per round")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    unknown = [m for m in methods if m not in METHODS + COMPARED]
    if unknown:
        known = ", ".join(METHODS + COMPARED)
        raise SystemExit(f"unknown methods: {', '.join(unknown)} (known: {known})")
    if "opacus" in methods and importlib.util.find_spec("opacus") is None:
        raise SystemExit("--methods opacus needs Opacus (pip install opacus)")
    ns, ks = _ints(args.ns), _ints(args.ks)
    if len(set(ns)) < 2 or len(set(ks)) < 2:
        raise SystemExit("the fit needs at least two values of --ns and two of --ks")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        data = measure(ns, ks, width=args.width, batch=args.batch, rounds=args.rounds,
                       reps=args.reps, methods=methods)  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    given = sys.argv[1:] if argv is None else argv
    data["command"] = " ".join(["python -m bench.module_cost", *given])
    write_results(args.out, "module-cost-cpu", data, markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Timing, peak memory and the correctness check of one method on one model.

Time: wall clock of ``step()`` (CUDA synchronized on both sides), after one untimed warm-up
step; every repetition starts from ``reset()`` (the previous results freed, untimed).

Peak memory: what the step adds at its peak over what was live just before it.

- CUDA: ``torch.cuda.max_memory_allocated()`` minus ``memory_allocated()`` before the step.
- CPU: the resident set size (RSS). torch's CPU allocator takes memory from malloc, which keeps
  freed memory for reuse, so an RSS delta within one long process undercounts. The memory pass
  therefore runs in a fresh subprocess per (model, batch, method) with
  ``MALLOC_MMAP_THRESHOLD_=65536`` (every allocation over 64 KiB is its own mapping, returned
  to the system when freed), runs one warm-up step, resets the high-water mark
  (``/proc/self/clear_refs``), and reports ``VmHWM`` after the step minus ``VmRSS`` before it.
  Granularity is a page; small allocations and allocator slack are included, which is honest
  for "how much RAM does this need".
  Where ``/proc`` is not available (not Linux) CPU memory is not measured.

Both add ``Runner.held_bytes()``: memory a method holds between steps (the floor's buffer,
gradhooks' ``grad1``, whose memory the next backward reuses).
"""

from __future__ import annotations

import copy
import gc
import os
import re
import time
import warnings
from dataclasses import dataclass, field

import torch

from .methods import Method, Runner, Setup, Unavailable
from .problems import Problem

# largest |difference| / largest |reference|, in float32: deep float32 models (ResNet18GN) differ
# from vmap(grad) by up to ~1e-2 in every method; a wrong scaling or a missing term gives O(1).
WRONG_TOLERANCE = 3e-2


@dataclass
class Record:
    model: str
    method: str
    batch: int
    device: str
    status: str = "ok"  # ok | missing | unsupported | wrong
    reason: str = ""
    times_s: list[float] = field(default_factory=list)
    peak_bytes: int | None = None
    rel_err: float | None = None
    notes: str = ""  # what the method said of its warm-up step (Runner.notes)

    @property
    def median_s(self) -> float | None:
        if not self.times_s:
            return None
        t = sorted(self.times_s)
        mid = len(t) // 2
        return t[mid] if len(t) % 2 else (t[mid - 1] + t[mid]) / 2

    def as_dict(self) -> dict:
        return {**self.__dict__, "median_s": self.median_s}


# -- the inputs and the reference ----------------------------------------------------------------


def instance(problem: Problem, batch: int, device: str):
    """The model (seed 0) and one batch (seed 1) that every method of a run shares."""
    torch.manual_seed(0)
    model = problem.make_model().to(device)
    gen = torch.Generator().manual_seed(1)
    x, y = problem.make_batch(batch, gen)
    return model, x.to(device), y.to(device)


def reference(problem: Problem, model, x, y) -> dict[str, torch.Tensor]:
    """Per-example gradients by ``vmap(grad)``, or by the loop where vmap fails, with TF32 off
    (cuDNN's convolutions take it by default on a GPU: the reference then differs by up to a few
    percent from methods that form the same products in float32)."""
    from gradhooks.oracle import loop_grad, vmap_grad

    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    before = matmul.allow_tf32
    matmul.allow_tf32 = False
    try:  # (cuDNN's flags through their context manager: a test may have frozen them)
        with cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark,
                         deterministic=cudnn.deterministic, allow_tf32=False):  # fmt: skip
            try:
                return vmap_grad(model, problem.loss, x, y)
            except Exception:
                return loop_grad(model, problem.loss, x, y)
    finally:
        matmul.allow_tf32 = before


def _rel_err(method: Method, got, ref: dict[str, torch.Tensor]) -> float:
    if method.quantity == "norms":
        want = torch.stack([r.flatten(1).pow(2).sum(1) for r in ref.values()]).sum(0).sqrt()
        return ((got.flatten() - want).abs().max() / want.abs().max()).item()
    if method.quantity == "sum_grad_sq":
        ref = {n: r.square().sum(0, keepdim=True) for n, r in ref.items()}
        got = {n: g.unsqueeze(0) for n, g in got.items()}
    scale = max(r.abs().max().item() for r in ref.values())
    worst = 0.0
    for name, r in ref.items():
        g = got.get(name)
        if g is None:
            raise Unavailable("unsupported", f"no per-example gradient for {name}")
        if tuple(g.shape) != tuple(r.shape):
            raise Unavailable(
                "unsupported", f"{name}: shape {tuple(g.shape)}, want {tuple(r.shape)}"
            )
        worst = max(worst, (g.detach().to(r.dtype) - r).abs().max().item())
    return worst / scale


def _kfac_rel_err(factors: dict[str, tuple], base_model, x) -> float:
    """``factors``: ``{weight: (G, A)}`` (BackPACK's order) of Linear layers, against
    :func:`gradhooks.kfac`'s exact factors (tested against their definitions), without the
    bias column; the worst of the two factors' relative errors."""
    import gradhooks

    want = gradhooks.kfac(copy.deepcopy(base_model), x, fisher="exact", bias=False)
    worst = 0.0
    for name, (G, A) in factors.items():
        for got, ref in ((G, want[name].G), (A, want[name].A)):
            if tuple(got.shape) != tuple(ref.shape):
                raise Unavailable(
                    "unsupported", f"{name}: factor {tuple(got.shape)}, want {tuple(ref.shape)}"
                )
            worst = max(worst, ((got - ref).abs().max() / ref.abs().max()).item())
    return worst


# -- memory --------------------------------------------------------------------------------------


def _proc_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field_name}:\s+(\d+) kB", f.read(), re.M).group(1))


def cpu_memory_supported() -> bool:
    try:
        _proc_kib("VmHWM")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_of_step(runner: Runner, device: str) -> int:
    runner.reset()
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        runner.step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        before = _proc_kib("VmRSS")
        runner.step()
        peak = (_proc_kib("VmHWM") - before) * 1024
    return peak + runner.held_bytes()


# -- one method on one model ---------------------------------------------------------------------


def _unsupported(rec: Record, e: Exception) -> None:
    if isinstance(e, Unavailable):
        rec.status, rec.reason = e.status, _short(str(e))
    else:  # a peer that fails on a model is reported, never a crash
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        rec.status, rec.reason = "unsupported", _short(f"{type(e).__name__}: {first}")


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def prepare(
    problem: Problem, method: Method, base_model, x, y, ref: dict | None, device: str
) -> tuple[Record, Runner | None]:
    """Set ``method`` up on a copy of ``base_model`` and run one warm-up step, checking its
    result against ``ref``. The runner is ``None`` where the method cannot run."""
    rec = Record(problem.name, method.name, x.shape[0], device)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runner = method.make(Setup(copy.deepcopy(base_model), x, y, problem.loss))
            runner.reset()
            runner.step()
        checked = None
        rec.notes = runner.notes()
        if ref is not None and method.quantity in ("grad1", "norms", "sum_grad_sq"):
            rec.rel_err, checked = _rel_err(method, runner.result(), ref), "vmap(grad)"
        elif method.quantity == "kfac" and (factors := runner.result()) is not None:
            rec.rel_err, checked = _kfac_rel_err(factors, base_model, x), "gradhooks' exact K-FAC"
        if checked and not rec.rel_err <= WRONG_TOLERANCE:
            rec.status, rec.reason = "wrong", f"relative error {rec.rel_err:.1e} vs {checked}"
        runner.reset()
        return rec, runner
    except Exception as e:
        _unsupported(rec, e)
        gc.collect()
        return rec, None


def step_once(runner: Runner, device: str, clock=time.perf_counter) -> float:
    """One step from ``reset()`` to ``reset()``; returns its time (the resets untimed).
    ``clock``: ``time.perf_counter`` (wall) or ``time.process_time`` (CPU time of all threads,
    steadier on a shared machine)."""
    cuda = device.startswith("cuda")
    runner.reset()
    if cuda:
        torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = clock()
        runner.step()
        if cuda:
            torch.cuda.synchronize()
        elapsed = clock() - start
    runner.reset()
    return elapsed


def timed_step(rec: Record, runner: Runner, device: str, clock=time.perf_counter) -> None:
    """Time one step (:func:`step_once`), appended to ``rec.times_s``."""
    rec.times_s.append(step_once(runner, device, clock))


def measure_peak(rec: Record, runner: Runner, device: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rec.peak_bytes = _peak_of_step(runner, device)
    runner.reset()


def memory_env() -> dict[str, str]:
    """Environment of the CPU memory subprocess (see the module docstring)."""
    return {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}

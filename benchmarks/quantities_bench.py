"""Peak memory of a norms-only backward vs a plain one (and vs grad1), and the time of
gradhooks.jacobians vs torch.func vmap(jacrev).

    python benchmarks/quantities_bench.py memory     # CPU: peak RSS (VmHWM) per mode, own process
    python benchmarks/quantities_bench.py jacobians

CPU peak memory is read from /proc/self/status (VmHWM, reset through /proc/self/clear_refs)
after the model and data exist, so it counts the forward's activations and the backward; on
CUDA, torch.cuda.max_memory_allocated is used instead.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.models import MLP, CifarCNN, SimpleCNN

MODELS = {
    "mlp": (lambda: MLP(784, 1024, 1024, 10), (128, 784)),
    "cifar_cnn": (lambda: CifarCNN(width=32), (64, 3, 32, 32)),
}


def _rss_peak_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure(model_name: str, mode: str, device: str = "cpu") -> dict:
    torch.manual_seed(0)
    factory, shape = MODELS[model_name]
    net = factory().to(device)
    x, y = torch.randn(shape, device=device), torch.randint(10, (shape[0],), device=device)
    quantities = {"plain": None, "norms": ("norms",), "grad1": ("grad1",)}[mode]
    for _ in range(2):  # warm up allocator and kernels
        h = gradhooks.add_hooks(net, quantities=quantities) if quantities else None
        F.cross_entropy(net(x), y).backward()
        net.zero_grad(set_to_none=True)
        gradhooks.clear_grad1(net)
        if h:
            h.remove()
    h = gradhooks.add_hooks(net, quantities=quantities) if quantities else None
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _rss_peak_mb()
        _reset_peak()
        base = _rss_peak_mb()
    t0 = time.perf_counter()
    F.cross_entropy(net(x), y).backward()
    if mode == "norms":
        h.norms()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = _rss_peak_mb()
    return {"model": model_name, "mode": mode, "peak_over_setup_mb": round(peak - base, 1),
            "seconds": round(time.perf_counter() - t0, 3)}  # fmt: skip


def memory() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for model_name in MODELS:
        for mode in ("plain", "norms", "grad1"):
            out = subprocess.run(
                [sys.executable, __file__, "_one", model_name, mode, device],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            print(out.stdout.strip())


def vmap_jacrev(net, x):
    params = {k: v.detach() for k, v in net.named_parameters()}
    buffers = {k: v.detach() for k, v in net.named_buffers()}

    def one(sample):
        call = lambda p: torch.func.functional_call(net, (p, buffers), (sample[None],))[0]
        return torch.cat([v.flatten(1) for v in torch.func.jacrev(call)(params).values()], -1)

    return torch.vmap(one)(x)


class SeedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.relu, self.fc2 = nn.Linear(784, 20), nn.ReLU(), nn.Linear(20, 10)

    def forward(self, x):
        return self.fc2(self.relu(self.fc1(x)))


def jacobians(repeats: int = 7) -> None:
    """Interleaved runs, the median of each (shared machines are noisy)."""
    cases = [
        ("seed003_mlp b2", SeedMLP(), torch.randn(2, 784), 20),
        ("seed003_mlp b64", SeedMLP(), torch.randn(64, 784), 5),
        ("simple_cnn b8", SimpleCNN(), torch.randn(8, 1, 28, 28), 1),
    ]
    for name, net, x, inner in cases:
        ref, ours = vmap_jacrev(net, x), gradhooks.jacobians(net, x, flatten=True)
        assert torch.allclose(ref, ours, atol=1e-5), name
        times = {"vmap(jacrev)": [], "gradhooks.jacobians": []}
        for _ in range(repeats):
            for label, fn in (("vmap(jacrev)", lambda: vmap_jacrev(net, x)),
                              ("gradhooks.jacobians", lambda: gradhooks.jacobians(net, x, flatten=True))):  # fmt: skip
                t0 = time.perf_counter()
                for _ in range(inner):
                    fn()
                times[label].append((time.perf_counter() - t0) / inner)
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        ratio = med["gradhooks.jacobians"] / med["vmap(jacrev)"]
        print(json.dumps({"case": name, **{k: round(v * 1e3, 2) for k, v in med.items()},
                          "unit": "ms", "ratio": round(ratio, 2)}))  # fmt: skip


if __name__ == "__main__":
    torch.set_num_threads(2)
    if sys.argv[1] == "_one":
        print(json.dumps(measure(sys.argv[2], sys.argv[3], sys.argv[4])))
    elif sys.argv[1] == "memory":
        memory()
    else:
        jacobians()

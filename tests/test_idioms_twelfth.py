"""Training-loop idioms, a twelfth set: how people train on GPUs and in modern loops, on the CPU.

Each test writes again, on a small model and over several steps (``zero_grad``, an optimizer's
step), an idiom the earlier sets do not run: bfloat16 autocast entered as a decorator on
``forward``, switched on by ``torch.set_autocast_enabled`` / ``set_autocast_dtype`` by hand, or
without its weight cache (``cache_enabled=False``); one submodule cast to bfloat16 while the rest
stays in float32; ``torch.func.functional_call`` with a batch norm's running statistics
replaced at every step (``strict=True``; also under ``save_on_cpu``) and with
``tie_weights=False`` splitting a tied weight; a forward whose output is never backpropagated
before the step's own; micro-batches of unequal sizes read and cleared one by one; a
``DistributedDataParallel`` model in one process accumulating under ``no_sync()``; an input
that requires grad (a universal adversarial perturbation updated from its ``.grad``); batches
of one example through the norms and the DP step. And misuse: ``backward()`` twice without
``retain_graph``, hooks removed in the middle of an accumulation and added again.
Each is compared with each example's own gradient by a per-example loop in float64
(:func:`gradhooks.oracle.loop_grad`), within bfloat16's rounding where the model ran in it, or
checked to stop with an error that says what went wrong and leaves the model as it was.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import assert_grad1

D = torch.float64
STEPS = 3


def batch(step: int, n: int = 5, dtype: torch.dtype = D, features: int = 3):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n, features, generator=g, dtype=dtype)
    return x, torch.randint(2, (n,), generator=g)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).to(D)


def norms_of(want: dict) -> torch.Tensor:
    """Each example's gradient norm over every parameter of ``want`` (the loop's rows)."""
    return torch.sqrt(sum(g.flatten(1).square().sum(1) for g in want.values()))


def assert_within(model: nn.Module, want: dict, rel: float, what: str) -> None:
    """Every trainable parameter's ``grad1``, in its own dtype, within ``rel`` of the largest
    entry of the float64 loop's (bfloat16's 8 bits: ``5e-2``, as docs/mixed-precision.md
    allows)."""
    for n, p in model.named_parameters():
        got, ref = p.grad1.to(D), want[n]
        assert got.shape == ref.shape, f"{what} {n}: {tuple(got.shape)} != {tuple(ref.shape)}"
        err = (got - ref).abs().max() / ref.abs().max()
        assert err < rel, f"{what} {n}: {err:.2e} of the largest entry"


# -- functional_call with a batch norm's running statistics replaced ---------------------------


class _NormedNet(nn.Module):
    """A Linear at each of 4 positions, a batch or instance norm over its 6 channels in eval
    mode (its running statistics), a mean over the positions, a Linear."""

    def __init__(self, norm: type[nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(3, 6), nn.Linear(6, 2)
        self.norm = norm(6, affine=True, track_running_stats=True)

    def forward(self, x):
        return self.b(torch.tanh(self.norm(self.a(x).transpose(1, 2))).mean(-1))


def _statistics(step: int) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    return {
        "norm.running_mean": torch.randn(6, generator=g, dtype=D),
        "norm.running_var": torch.rand(6, generator=g, dtype=D) + 0.5,
        "norm.num_batches_tracked": torch.tensor(step),
    }


@pytest.mark.parametrize("offload", [False, True], ids=["plain", "save_on_cpu"])
@pytest.mark.parametrize("norm", [nn.BatchNorm1d, nn.InstanceNorm1d], ids=["batch", "instance"])
def test_functional_call_with_the_norms_running_statistics_replaced_at_each_step(norm, offload):
    """``functional_call(model, (params, buffers), (x,), strict=True)`` with other running
    statistics at every step (statistics of another domain, a model soup's): the batch or
    instance norm, in eval mode, normalizes with the statistics it was handed. Before, its
    rule read the module's own at the backward: the norm's grad1 came from statistics the
    forward never used (the guard caught it where it ran, a CheckFailedError blaming "a use
    of the parameter the hooks did not see"; without it, silently wrong), and likewise under
    saved-tensor hooks (``torch.autograd.graph.save_on_cpu``). grad1 is the float64 loop's of
    the model loaded with those statistics, and the module's own are untouched."""
    model = _NormedNet(norm).to(D).eval()
    own = {n: b.clone() for n, b in model.named_buffers()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    offloaded = torch.autograd.graph.save_on_cpu if offload else contextlib.nullcontext
    with gradhooks.add_hooks(model) as hooks:
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(5, 4, 3, generator=g, dtype=D), torch.randint(2, (5,), generator=g)
            stats = _statistics(step)
            params = dict(model.named_parameters())
            reference = copy.deepcopy(model)
            reference.load_state_dict({**params, **stats}, strict=True)
            want = loop_grad(reference, F.cross_entropy, x, y)
            opt.zero_grad()
            with offloaded():
                out = torch.func.functional_call(model, (params, stats), (x,), strict=True)
                F.cross_entropy(out, y).backward()
            assert_grad1(model, want, f"step {step}")
            hooks.check()
            opt.step()
    for n, b in model.named_buffers():
        assert torch.equal(b, own[n]), n

"""What gradhooks asks of the device a tensor is on, in one place.

Two questions, with the same answer today (the CPU or not), asked for different reasons:

- :func:`reads_are_free`: whether a value read back on the host (a count, a flag) costs no
  wait. On the CPU a step may branch on values and size tensors by them; elsewhere a step's
  shapes and branches must not depend on values (each read would let the device run dry while
  the host waits).
- :func:`cpu_trade_offs`: whether the paths measured faster on torch's CPU kernels apply (a
  Linear or convolution over many positions run detached, the narrow-input product, a
  convolution's grouped form; the thresholds of :mod:`gradhooks.tuning` marked CPU). Every
  path gives the same numbers; this chooses the faster one.

Both ask :func:`on_cpu`. Replacing it with ``lambda t: False`` makes gradhooks take, on CPU
tensors, every path it takes on a GPU (the tests do so with ``GRADHOOKS_TEST_DEVICE_LIKE=1``:
``docs/development.md``). A question of fact about what ran (the rounding of torch's CPU
LayerNorm kernel, a device's memory, a generator's device) is not one of these: it asks the
tensor itself.
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["on_cpu", "reads_are_free", "cpu_trade_offs"]


def on_cpu(t: Tensor) -> bool:
    """Whether ``t`` is taken for a CPU tensor by the paths that depend on the device
    (``is_cpu``: asked at many calls of a step, it makes no ``torch.device`` as ``t.device``
    does)."""
    return t.is_cpu


def reads_are_free(t: Tensor) -> bool:
    """Whether a value of ``t`` read back on the host costs no wait for its device: on the
    CPU."""
    return on_cpu(t)


def cpu_trade_offs(t: Tensor) -> bool:
    """Whether the paths measured faster on torch's CPU kernels are taken for ``t``: on the
    CPU."""
    return on_cpu(t)

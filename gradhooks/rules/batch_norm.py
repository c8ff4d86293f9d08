"""nn.BatchNorm1d / 2d / 3d, in eval mode only.

In eval mode (with ``track_running_stats=True``, the default) batch norm is a fixed per-channel
affine map of each example, ``x̂ = (x - running_mean) / sqrt(running_var + eps)``, so per
example

    grad1[b] weight = Σ_spatial x̂[b] · g[b],      grad1[b] bias = Σ_spatial g[b]

:class:`Direct` pieces ``[batch, channels]``. Rules never scale: the engine applies mean/sum.

In train mode (or with ``track_running_stats=False``, which always uses batch statistics) each
example's output depends on every other example of the batch through the batch mean and
variance: an example's "own" loss, and so its gradient, does not exist. That is an error at the
forward of the module, before any gradient is computed.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from ..errors import MixedExamplesError
from ..pieces import Direct
from .norm import RunningStatistics, _need_batch, channel_affine, running_statistics
from .registry import Call, register

TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def uses_batch_statistics(module: nn.BatchNorm1d | nn.BatchNorm2d | nn.BatchNorm3d) -> bool:
    """Whether torch normalizes this call with the statistics of the batch (as its batch
    norm's forward decides)."""
    return module.training or module.running_mean is None or module.running_var is None


def refuse_batch_statistics(module: nn.Module, name: str) -> None:
    if not uses_batch_statistics(module):
        return
    kind = type(module).__qualname__
    why = (
        "it is in train mode"
        if module.track_running_stats
        else "it has track_running_stats=False, so it uses batch statistics even in eval mode"
    )
    raise MixedExamplesError(
        f"'{name or '<model>'}' ({kind}) normalizes with the statistics of the whole batch "
        f"because {why}: every example's output depends on the other examples, so per-example "
        f"gradients do not exist (for any layer of the model). Either replace it with a "
        f"per-example normalization, e.g. nn.GroupNorm(num_groups, {module.num_features}) "
        "(model = gradhooks.convert_batch_norm(model) replaces every batch norm so, as "
        "Opacus' ModuleValidator.fix does), or put it in eval mode (model.eval(), or "
        "module.eval() on the batch-norm layers) so that it uses its running statistics. A "
        "forward that needs no per-example gradient can run under hooks.paused(): one that "
        "only refreshes the running statistics (or under torch.no_grad(), with no backward), "
        "or a plain training step of a model hooked for per-example gradients it takes in "
        "eval mode elsewhere."
    )


@register(*TYPES, on_forward=refuse_batch_statistics, saved=running_statistics)
def batch_norm(call: Call) -> dict[str, Direct]:
    """``x``: ``[batch, channels, *spatial]`` (``[batch, channels]`` for BatchNorm1d);
    weight, bias: ``[channels]``. Normalized with the running statistics the call ran with
    (``call.saved``: ``torch.func.functional_call`` may have handed it others than the
    module's own)."""
    m = call.module
    stats = call.saved  # (none where the call did not keep it: the module's own)
    if not isinstance(stats, RunningStatistics):
        stats = RunningStatistics(m.running_mean, m.running_var)
    if stats.mean is None or stats.var is None:  # on_forward has refused it already
        refuse_batch_statistics(m, call.name)
    x = call.inputs[0]
    _need_batch(call, x, 1, "[batch, channels, *spatial]")
    xhat = F.batch_norm(x, stats.mean, stats.var, None, None, False, 0.0, m.eps)
    return channel_affine(xhat, call.grad_output)

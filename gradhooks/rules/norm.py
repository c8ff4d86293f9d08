"""Normalization layers without batch statistics: nn.LayerNorm, nn.RMSNorm, nn.GroupNorm,
nn.InstanceNorm1d/2d/3d.

Each computes ``y = x̂ · weight + bias`` where ``x̂`` (the normalized input) depends on one
example only. LayerNorm and GroupNorm form ``x̂ = (x - mean) · rstd`` from the mean and 1/std
their forward's autograd node saved (:func:`saved_statistics`, the rule's ``saved``);
otherwise the rule recomputes ``x̂`` from ``call.inputs`` with the module's own settings
(``torch.nn.functional`` with no affine parameters). Then, per example,

    grad1[b] weight = Σ_shared x̂[b] · g[b],      grad1[b] bias = Σ_shared g[b]

where ``shared`` is every axis the parameter is broadcast over: the leading (non-normalized)
axes for LayerNorm / RMSNorm (parameters ``[*normalized_shape]``), the spatial axes for
GroupNorm / InstanceNorm (parameters ``[channels]``). Elementwise products, so the pieces are
:class:`Direct` ``[batch, *param.shape]``. Rules never scale: the engine applies mean/sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _torch
from ..engine.records import half_precision
from ..errors import UnbatchedInputError, describe_module
from ..pieces import Direct
from .registry import Call, ModuleState, register


def _need_batch(call: Call, x: Tensor, unbatched_dim: int, layout: str) -> None:
    if x.dim() <= unbatched_dim:
        raise UnbatchedInputError(
            f"{describe_module(call.name, call.module)} got an input of shape "
            f"{tuple(x.shape)} without a batch dimension: per-example gradients need {layout}"
        )


def _times(xhat: Tensor, g: Tensor) -> Tensor:
    """``xhat * g``, written into ``xhat`` (the rule's own temporary; a third less memory
    traffic) unless autograd records it (a ``create_graph`` backward), under ``vmap`` (the
    Jacobians: ``g`` is batched, ``xhat`` may not be), or the product has another dtype or
    shape (autocast)."""
    if (
        torch.is_grad_enabled()
        or _torch.in_transform(xhat, g)
        or xhat.dtype != g.dtype
        or xhat.shape != g.shape
    ):
        return xhat * g
    return xhat.mul_(g)


def trailing_affine(xhat: Tensor, g: Tensor, param_dims: int) -> dict[str, Direct]:
    """Parameters ``[*x.shape[-param_dims:]]`` broadcast over the axes between batch and them.
    ``xhat`` is overwritten."""
    shape = g.shape[g.dim() - param_dims :]
    lead = (g.shape[0], math.prod(g.shape[1 : g.dim() - param_dims]), *shape)

    def folded(t: Tensor) -> Tensor:  # (no view of the same shape)
        return t if t.shape == lead else t.reshape(lead)

    return {
        "weight": Direct(folded(_times(xhat, g)).sum(1)),
        "bias": Direct(folded(g).sum(1)),
    }


def channel_affine(xhat: Tensor, g: Tensor) -> dict[str, Direct]:
    """Parameters ``[channels]`` on axis 1, broadcast over the spatial axes. ``xhat`` is
    overwritten."""
    shape = (*g.shape[:2], math.prod(g.shape[2:]))
    return {
        "weight": Direct(_times(xhat, g).reshape(shape).sum(-1)),
        "bias": Direct(g.reshape(shape).sum(-1)),
    }


class _Statistics:
    """What a LayerNorm / GroupNorm call's autograd node saved: the mean and 1/std (``rstd``)
    of each normalized group, ``[*lead, 1, ...]`` (LayerNorm) or ``[batch, groups]``
    (GroupNorm)."""

    def __init__(self, mean: Tensor, rstd: Tensor) -> None:
        self.mean = mean
        self.rstd = rstd


_SAVES_STATISTICS = ("NativeLayerNormBackward0", "NativeGroupNormBackward0")


def saved_statistics(module: nn.Module, args: tuple, kwargs: dict, output) -> _Statistics | None:
    """The mean and 1/std torch's forward saved for its backward, read off the output's node
    (they live as long as the graph does); ``None`` where the node is not torch's own
    normalization of this very input (autocast casts it first, a subclass may transform it)."""
    if _torch.saved_tensor_hooks_active():  # (reading them would run the forward again)
        return None
    node = getattr(output, "grad_fn", None)
    kind = type(node).__name__
    if kind not in _SAVES_STATISTICS or not args or not isinstance(args[0], Tensor):
        return None
    x, saved = args[0], _torch.saved(node, "input")
    if saved is None:
        return None
    if saved.data_ptr() != x.data_ptr() or saved.shape != x.shape or saved.dtype != x.dtype:
        return None
    mean, rstd = _torch.saved(node, "result1"), _torch.saved(node, "result2")
    if mean is None or rstd is None:
        return None
    return _Statistics(_detached(mean), _detached(rstd))


def _detached(t: Tensor) -> Tensor:
    """``t`` without a graph (itself where it has none)."""
    return t.detach() if t.requires_grad else t


@dataclass(frozen=True)
class RunningStatistics(ModuleState):
    """The running mean and variance a batch or instance norm's call normalized with, as the
    module held them at the forward (``torch.func.functional_call`` may have handed it others
    for that call alone), ``[channels]``; both ``None`` where the call used its own
    statistics (an instance norm in training mode or without ``track_running_stats``)."""

    mean: Tensor | None
    var: Tensor | None


def running_statistics(module: nn.Module, args: tuple, kwargs: dict, output) -> RunningStatistics:
    """The rule's ``saved`` of a batch or instance norm: the running statistics its call used
    (references: in eval mode the forward does not change them)."""
    if module.training or module.running_mean is None or module.running_var is None:
        return RunningStatistics(None, None)
    return RunningStatistics(module.running_mean.detach(), module.running_var.detach())


def _from_statistics(call: Call, x: Tensor) -> Tensor | None:
    """LayerNorm's ``(x - mean) · rstd`` from the saved statistics; ``None`` where there are
    none, or where the result must carry a graph (a ``create_graph`` backward: the saved
    statistics do not)."""
    stats = call.saved
    if not isinstance(stats, _Statistics) or torch.is_grad_enabled():
        return None
    return (x - stats.mean).mul_(stats.rstd)


@register(nn.LayerNorm, saved=saved_statistics, batch_dim="positions")
def layer_norm(call: Call) -> dict[str, Direct]:
    """``x``: ``[batch, *, *normalized_shape]``; weight, bias: ``[*normalized_shape]``."""
    m: nn.LayerNorm = call.module
    x = call.inputs[0]
    _need_batch(call, x, len(m.normalized_shape), "[batch, *, *normalized_shape]")
    xhat = _from_statistics(call, x)
    if xhat is None:
        # With a weight of ones: x̂ · 1 is x̂ exactly, and torch's CPU kernel is about twice as
        # fast with a weight as without.
        ones = x.new_ones(m.normalized_shape)
        xhat = F.layer_norm(x, m.normalized_shape, ones, None, m.eps)
    pieces = trailing_affine(xhat, call.grad_output, len(m.normalized_shape))
    if half_precision(x.dtype) and x.device.type == "cpu":
        # torch's CPU LayerNorm backward of a bfloat16 / float16 input adds the rows' terms of
        # the weight's and the bias's gradient one by one in that precision: .grad is off by
        # up to 49 of its units (eps) of its largest entry at 4096 rows of 32 to 64 features, 609
        # at 65536 rows in float16 (where a partial sum stops growing), while Linear, Conv,
        # GroupNorm and RMSNorm accumulate in float32 (under 1 unit). grad1 is summed in
        # float32 (one rounding); the check against .grad allows the kernel's rounding. (The
        # kernel that ran, not a path chosen: asked of the tensor, not gradhooks.devices.)
        rows = call.grad_output.numel() // max(1, math.prod(m.normalized_shape))
        for piece in pieces.values():
            piece.rounded_terms = rows
    return pieces


@register(nn.RMSNorm, batch_dim="positions")
def rms_norm(call: Call) -> dict[str, Direct]:
    """``x``: ``[batch, *, *normalized_shape]``; weight: ``[*normalized_shape]``. ``eps=None``
    is the input dtype's machine epsilon, as in torch."""
    m: nn.RMSNorm = call.module
    x = call.inputs[0]
    _need_batch(call, x, len(m.normalized_shape), "[batch, *, *normalized_shape]")
    xhat = F.rms_norm(x, m.normalized_shape, None, m.eps)
    return trailing_affine(xhat, call.grad_output, len(m.normalized_shape))


@register(nn.GroupNorm, saved=saved_statistics)
def group_norm(call: Call) -> dict[str, Direct]:
    """``x``: ``[batch, channels, *spatial]``; weight, bias: ``[channels]``."""
    m: nn.GroupNorm = call.module
    x = call.inputs[0]
    _need_batch(call, x, 1, "[batch, channels, *spatial]")
    pieces = _group_norm_from_statistics(call, x)
    if pieces is not None:
        return pieces
    xhat = F.group_norm(x, m.num_groups, None, None, m.eps)
    return channel_affine(xhat, call.grad_output)


def _group_norm_from_statistics(call: Call, x: Tensor) -> dict[str, Direct] | None:
    """GroupNorm's pieces from the mean and 1/std its forward saved, without forming ``x̂``: per
    example and channel, ``Σ_s x̂ g = rstd · (Σ_s x g - mean · Σ_s g)`` (over the spatial
    positions ``s``; ``mean`` and ``rstd`` those of the channel's group), as torch's own
    GroupNorm backward forms the weight's gradient: one pass over ``x`` and ``g`` instead of
    four. ``None`` where :func:`_from_statistics` would give none."""
    stats = call.saved
    if not isinstance(stats, _Statistics) or torch.is_grad_enabled():
        return None
    g = call.grad_output
    batch, groups = stats.mean.shape
    shape = (batch, g.shape[1], math.prod(g.shape[2:]))
    g = g.reshape(shape)
    g_sum = g.sum(-1)  # [batch, channels]
    gx = torch.linalg.vecdot(x.reshape(shape), g)
    mean, rstd = (s.repeat_interleave(shape[1] // groups, dim=1) for s in (stats.mean, stats.rstd))
    return {"weight": Direct((gx - mean * g_sum).mul_(rstd)), "bias": Direct(g_sum)}


# the input dimensions of an unbatched call, by layer (InstanceNorm's own, private, count)
_INSTANCE_UNBATCHED = {nn.InstanceNorm1d: 2, nn.InstanceNorm2d: 3, nn.InstanceNorm3d: 4}


@register(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, saved=running_statistics)
def instance_norm(call: Call) -> dict[str, Direct]:
    """``x``: ``[batch, channels, *spatial]``; weight, bias: ``[channels]``. Normalized with each
    example's own statistics, or with the running statistics in eval mode when
    ``track_running_stats=True`` (as torch does); either way one example at a time."""
    m = call.module
    x = call.inputs[0]
    unbatched = next((d for k, d in _INSTANCE_UNBATCHED.items() if isinstance(m, k)), 2)
    _need_batch(call, x, unbatched, "[batch, channels, *spatial]")
    stats = call.saved  # (none where the call did not keep it: the module's own)
    if not isinstance(stats, RunningStatistics):
        stats = running_statistics(m, call.inputs, call.kwargs, None)
    if stats.mean is None:
        xhat = F.instance_norm(x, None, None, None, None, True, 0.0, m.eps)
    else:
        xhat = F.instance_norm(x, stats.mean, stats.var, None, None, False, 0.0, m.eps)
    return channel_affine(xhat, call.grad_output)

"""Data-parallel training over ``torch.distributed``: DP-SGD and K-FAC with the batch split across
ranks, giving what one process would give on the whole batch.

Each rank runs the same model on its own shard of the batch. Everything per-example stays local
(a rank's ``grad1``, norms and clipping factors are those of its shard); what is summed over the
batch is summed over the ranks with one ``all_reduce`` per dtype:

- ``grad1`` needs nothing: hook the model (or its ``DistributedDataParallel`` wrapper, whose
  parameters are then named ``module.*``) as usual; ``p.grad1`` holds the rank's own examples,
  and DDP's all-reduce of ``p.grad`` runs as it would without the hooks.
- :func:`dp_sgd_step`: every rank clips its own examples and sums them; the sums are
  all-reduced; the Gaussian noise is drawn **on group rank 0 only** (from its ``generator``) and
  added to its sum before the all-reduce, so it enters the result exactly once; the result is
  divided by the *global* batch size (``reduction="mean"``). Every rank ends with the same
  ``p.grad``, equal to :func:`gradhooks.dp_sgd_step` on the whole batch with rank 0's generator.
  The other ranks' generators are not used.
- :func:`kfac_factors` / :func:`kfac`: the unnormalized sums ``Σ a aᵀ``, ``Σ g gᵀ`` and their
  counts are all-reduced, then divided: the factors are those of the whole batch, whatever the
  shard sizes.

Every rank must hold the same parameters (same names, shapes, dtypes, in the same order):
``DistributedDataParallel`` makes sure of that; without it, start from the same seed or call
:func:`broadcast_parameters`. These functions are collective: every rank of ``group`` must call
them, in the same order.

Run with ``torchrun --nproc-per-node=N script.py`` and ``dist.init_process_group("nccl")`` (GPUs,
one per rank, ``torch.cuda.set_device(local_rank)``) or ``"gloo"`` (CPUs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..engine.api import engine_of
from ..engine.handle import Hooks
from ..errors import ConfigurationError, StateError
from ..quantities.kfac import KfacAccumulator, KFactors
from . import clipping as _clip
from . import dp as _dp
from . import kfac as _kfac

__all__ = ["dp_sgd_step", "kfac_factors", "kfac", "broadcast_parameters"]

if TYPE_CHECKING:
    Group = dist.ProcessGroup | None


def dp_sgd_step(
    hooks: Hooks,
    per_example_loss: Tensor,
    *,
    max_norm: float | Sequence[float],
    noise_multiplier: float,
    generator: torch.Generator | None = None,
    reduction: Literal["mean", "sum"] = "mean",
    method: Literal["grad1", "ghost", "bookkeeping"] | None = None,
    expected_batch_size: float | None = None,
    group: Group = None,
    scaler: torch.amp.GradScaler | None = None,
    clipping: Literal["flat", "automatic"] = "flat",
    clipping_groups: _clip.ClippingGroups = None,
) -> Tensor:
    """:func:`gradhooks.dp_sgd_step` with the batch split across the ranks of ``group``.

    Sets, on every rank, for every trainable parameter of the hooked model,

        p.grad = (Σ_ranks Σ_i min(1, C / ‖g_i‖) · g_i  +  N(0, (σ·C)² I)) / D

    where ``i`` runs over each rank's own examples, the noise is drawn once, on group rank 0 from
    its ``generator``, and ``D`` is the total batch size over all ranks (``"mean"``), ``1``
    (``"sum"``), or ``expected_batch_size`` when given (Poisson sampling: the expected size of
    the whole batch, over all ranks). The model may be wrapped in ``DistributedDataParallel`` or
    not: the backward(s) here use ``torch.autograd.grad``, which DDP's all-reduce does not see.
    It warns where :func:`gradhooks.dp_sgd_step` does of what it does not protect, on every
    rank: losses that reach trainable parameters the hooks are not on, and a forward that took
    an input as long as the rank's batch as shared by every example.

    Args:
        hooks, per_example_loss, max_norm, noise_multiplier, reduction, method,
            expected_batch_size: as for :func:`gradhooks.dp_sgd_step`; ``per_example_loss`` is
            this rank's shard, ``[local_batch]`` (shards may differ in size, or be empty).
        generator: used on group rank 0 only (a ``torch.Generator`` on the parameters' device);
            seed it differently every step, and keep the seed secret, as in one process.
        group: the process group (default: the whole world).
        scaler: a ``torch.amp.GradScaler``, as for :func:`gradhooks.dp_sgd_step` (the same
            scale on every rank, as every rank's scaler sees the same ``p.grad``). A rank whose
            gradients overflow sends NaN into the sum, so that every rank's ``p.grad`` holds
            NaN and every rank's ``scaler.step`` skips the step (rank 0 may have drawn its noise
            for it: discarded). Whether the step was skipped is the same on every rank:
            ``scaler.get_scale()`` went down at ``scaler.update()``.
        clipping: as for :func:`gradhooks.dp_sgd_step` (``"flat"`` or ``"automatic"``).
        clipping_groups: as for :func:`gradhooks.dp_sgd_step`: each rank clips each group of
            its own examples' gradients to the group's bound; the noise std is ``σ`` times the
            total bound ``√(Σ_k C_k²)``.

    A model sharded with FSDP2 (``fully_shard``: the root, and any of its modules before it;
    hook it, once sharded, with ``quantities=("norms",)``) works the same with ``method="bookkeeping"``: the norms are
    exact, the clipped sums are formed whole from the kept layer inputs and output-gradients,
    all-reduced, and each rank keeps its shard as the sharded parameter's ``.grad``.

    Returns:
        This rank's per-example gradient norms before clipping, ``[local_batch]``.

    Example (run under ``torchrun``; each rank feeds its own shard)::

        h = gradhooks.add_hooks(model, quantities=("norms",))
        losses = F.cross_entropy(model(x_shard), y_shard, reduction="none")
        gradhooks.distributed.dp_sgd_step(h, losses, max_norm=1.0, noise_multiplier=1.1,
                                          generator=gen)  # gen: used on rank 0 only
        optimizer.step()                                  # the same step on every rank
    """
    method = _dp._checked(hooks, per_example_loss, method, reduction, expected_batch_size)
    _require_process_group("dp_sgd_step", "gradhooks.dp_sgd_step")
    _clip.check_bounds(max_norm, clipping_groups, "gradhooks.distributed.dp_sgd_step")
    total = _clip.total_bound(max_norm)
    _dp._check_clipping(total, noise_multiplier, generator, clipping)
    _dp.check_scaler(scaler)
    outside = _dp.reached_outside(hooks, per_example_loss)
    params = _dp.steppable_params(hooks, method, "gradhooks.distributed.dp_sgd_step")
    if engine_of(hooks).sharded and method == "ghost":
        raise ConfigurationError(
            "gradhooks.distributed.dp_sgd_step(method='ghost') on a model sharded by FSDP2: "
            "use method='bookkeeping' (one backward, the clipped sums from the kept layer "
            "inputs and output-gradients)"
        )
    groups = _dp.grouped(
        hooks, method, params, max_norm, clipping_groups, "gradhooks.distributed.dp_sgd_step"
    )
    total = _dp.noise_bound(max_norm, groups)
    norms, grads, scale, sparse = _dp._clipped_sums(
        hooks, per_example_loss, max_norm, method, params, scaler, clipping=clipping,
        groups=groups,
    )  # fmt: skip
    # (autograd's clipped sum of a sparse table, under ghost clipping: dense for the noise and
    # the sum over the ranks, sparse again in .grad)
    grads = [g.to_dense() if g.is_sparse else g for g in grads]
    overflow = scale is not None and not _dp.finite(norms, grads)
    if overflow:  # (NaN in the sum: every rank's p.grad, and every rank's scaler skips)
        for g in grads:
            g.fill_(float("nan"))
    std = noise_multiplier * total * (scale or 1.0)  # (the sums are scaled by it)
    if std > 0 and not overflow and dist.get_rank(group) == 0:  # once, before the sum
        for p, g in zip(params, grads, strict=True):
            g.add_(_dp.gaussian(p, generator), alpha=std)
    total_batch = _all_reduce_sums(
        grads, per_example_loss.shape[0], group, "dp_sgd_step", _names(hooks, params)
    )
    denom = _dp._denominator(total_batch, reduction, expected_batch_size)
    for p, g, layout in zip(params, grads, sparse, strict=True):
        _dp.write_grad(p, _like(p, _dp.as_grad((g / denom).detach(), layout)))
    _dp.drop_stale_grads(hooks, params)
    _dp.warn_if_outside(hooks, outside, "gradhooks.distributed.dp_sgd_step")
    _dp.warn_if_shared_inputs(hooks, "gradhooks.distributed.dp_sgd_step")
    return norms.detach()


def _like(p: Tensor, full: Tensor) -> Tensor:
    """``full`` (the same on every rank) as ``p``'s gradient: itself, or, for a parameter
    sharded by FSDP2 (a DTensor), this rank's shard of it, placed like ``p``."""
    mesh = getattr(p, "device_mesh", None)
    if mesh is None:
        return full
    from torch.distributed.tensor import distribute_tensor

    # every rank holds the whole sum: each keeps its own shard, no communication
    return distribute_tensor(full.to(p.dtype), mesh, p.placements, src_data_rank=None)


def _names(hooks: Hooks, params: Sequence[nn.Parameter]) -> list[str]:
    model = hooks.model
    by_id = {}
    if model is not None:
        for n, p in engine_of(hooks).named_parameters():
            by_id.setdefault(id(p), n)
    return [by_id.get(id(p), "?") for p in params]


def _all_reduce_sums(
    tensors: Sequence[Tensor], count: int, group: Group, what: str, names: Sequence[str]
) -> int:
    """Sum ``tensors`` (in place) and ``count`` over the ranks; returns the summed count.

    One ``all_reduce`` for the counts and a check that every rank sends the same layout, then one
    per (dtype, device) of the tensors, flattened together."""
    n = len(tensors)
    layout = sum((t.numel() + 1) * (i + 1) for i, t in enumerate(tensors)) % 1_000_003
    device = tensors[0].device if tensors else torch.device("cpu")
    # Σ v and Σ v² over the ranks: all ranks hold the same v iff world · Σ v² == (Σ v)², a test
    # whose answer is the same on every rank (so that all raise together, none hangs)
    meta = torch.tensor([count, n, n * n, layout, layout * layout], dtype=torch.int64)
    meta = meta.to(device)
    dist.all_reduce(meta, group=group)
    world = dist.get_world_size(group)
    total, n_sum, n_sq, lay_sum, lay_sq = meta.tolist()
    if world * n_sq != n_sum * n_sum or world * lay_sq != lay_sum * lay_sum:
        raise StateError(
            f"gradhooks.distributed.{what}: the ranks hold different tensors to reduce (this "
            f"rank, {dist.get_rank(group)}: {len(tensors)} tensors, {list(names)[:8]}...): every "
            "rank must run the same model (same parameter names, shapes and order) and the same "
            "quantities"
        )
    buckets: dict[tuple, list[Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.dtype, t.device), []).append(t)
    for ts in buckets.values():
        flat = torch.cat([t.reshape(-1) for t in ts])
        dist.all_reduce(flat, group=group)
        offset = 0
        for t in ts:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
    return int(total)


def kfac_factors(
    hooks: Hooks, reduction: Literal["mean", "sum"] = "mean", group: Group = None
) -> dict[str, KFactors]:
    """:meth:`Hooks.kfac_factors` over the examples of every rank of ``group``.

    The sums ``Σ a aᵀ``, ``Σ g gᵀ`` accumulated on each rank since the last ``clear()`` and
    their counts (examples, and positions for ``expand``) are all-reduced before dividing, so
    the factors equal those of one process on the whole batch, whatever the shard sizes. The
    handle's own (local) sums are left as they are: calling this twice gives the same result.

    Args:
        hooks: a handle of ``add_hooks(model, quantities=("kfac", ...))`` after the backward(s),
            on the model or its ``DistributedDataParallel`` wrapper (names ``module.*``).
        reduction: ``"mean"`` divides ``G`` by the number of examples of all ranks; ``"sum"``
            keeps the sum (conventions of :mod:`gradhooks.workflows.kfac`).
        group: the process group (default: the whole world).

    Returns:
        ``{weight_name: KFactors}``, the same on every rank.
    """
    _require_process_group("kfac_factors", "h.kfac_factors()")
    return _reduced(engine_of(hooks).results("kfac").kfac, group).factors(reduction, last=True)


def kfac(
    model: nn.Module,
    inputs: Tensor,
    target: Tensor | None = None,
    *,
    fisher: _kfac.Fisher = "mc",
    loss: _kfac.LossName | _kfac.LossFn = "cross_entropy",
    reduction: Literal["mean", "sum"] = "mean",
    expand: bool = True,
    bias: bool = True,
    mc_samples: int = 1,
    generator: torch.Generator | None = None,
    sample_target: _kfac.Sampler | None = None,
    output_grads: _kfac.Sampler | None = None,
    group: Group = None,
) -> dict[str, KFactors]:
    """:func:`gradhooks.kfac` with ``inputs`` (and ``target``) this rank's shard: the factors of
    the whole batch, the same on every rank. For ``fisher="mc"``, give each rank a differently
    seeded ``generator`` (the same seed on every rank samples correlated labels)."""
    _require_process_group("kfac", "gradhooks.kfac")
    acc = _kfac._accumulate(
        model, inputs, target, fisher, loss, expand, bias, mc_samples, generator,
        sample_target, output_grads, shard=True,
    )  # fmt: skip
    return _reduced(acc, group).factors(reduction, last=True)


def _require_process_group(name: str, alone: str | None) -> None:
    """Refuse a collective call without ``torch.distributed`` initialized (before any backward
    runs: torch's own refusal came at the first all-reduce, after the step's backward)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigurationError(
            f"gradhooks.distributed.{name} is collective over the ranks of a process group, and "
            "torch.distributed is not initialized: call dist.init_process_group(...) on every "
            "rank first (under torchrun)"
            + (f", or use {alone} in a single process" if alone else "")
        )


def _reduced(acc: KfacAccumulator, group: Group) -> KfacAccumulator:
    """A copy of ``acc`` whose sums and counts are summed over the ranks."""
    keys = sorted(acc._a)
    out = KfacAccumulator(acc.names)
    out.expand, out.bias = acc.expand, acc.bias
    out._a = {k: acc._a[k].clone() for k in keys}
    out._g = {k: acc._g[k].clone() for k in keys}
    out._biased = {k: acc._biased[k] for k in keys}
    out._bias_name = {k: acc._bias_name.get(k) for k in keys}
    out._layout = {k: acc._layout.get(k, "out_in") for k in keys}
    out._unfactored, out._other = dict(acc._unfactored), dict(acc._other)
    out._inputs_in_g = set(acc._inputs_in_g)
    tensors = [out._a[k] for k in keys] + [out._g[k] for k in keys]
    # A's counts per group (one where the module has no groups), the same layout on every rank
    # whether or not its groups counted alike
    n_a = [
        torch.as_tensor(acc._n_a[k], dtype=torch.int64)
        .cpu()
        .expand(math.prod(acc._a[k].shape[:-2]))
        for k in keys
    ]
    sizes = [t.numel() for t in n_a]
    n_g = torch.tensor([acc._n_g.get(k, 0) for k in keys], dtype=torch.int64)
    counts = torch.cat([*n_a, n_g])
    if tensors:
        counts = counts.to(tensors[0].device)
    _all_reduce_sums([*tensors, counts], 0, group, "kfac_factors", keys)
    split = counts.cpu().split([*sizes, len(keys)])
    out._n_a = {k: t if bool((t != t[0]).any()) else int(t[0]) for k, t in zip(keys, split)}
    out._n_g = dict(zip(keys, split[-1].tolist()))
    return out


def broadcast_parameters(model: nn.Module, src: int = 0, group: Group = None) -> None:
    """Copy ``src``'s parameters and buffers to every rank of ``group`` (in place), so that the
    replicas of a model that is not wrapped in ``DistributedDataParallel`` start identical
    (DDP does this itself when it wraps the model). ``src`` is a global rank."""
    _require_process_group("broadcast_parameters", None)
    for t in [*model.parameters(), *model.buffers()]:
        dist.broadcast(t.data, src=src, group=group)

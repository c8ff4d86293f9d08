"""``gradhooks.distributed``: per-example gradients across processes (DDP, FSDP2).

The public name of :mod:`gradhooks.workflows.distributed`, where the functions and their
documentation live: ``import gradhooks.distributed`` and ``gradhooks.distributed.dp_sgd_step``.
"""

from .workflows.distributed import broadcast_parameters, dp_sgd_step, kfac, kfac_factors

__all__ = ["dp_sgd_step", "kfac_factors", "kfac", "broadcast_parameters"]

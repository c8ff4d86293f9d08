"""A model's batch normalization replaced by a per-example one, for per-example gradients.

Batch norm in train mode normalizes each example with the statistics of the whole batch, so an
example's output, and its loss, depend on the other examples: per-example gradients do not
exist, and gradhooks refuses such a layer at its forward. DP-SGD on a convolutional network
(a ResNet from torchvision or timm, a model of one's own) therefore trains it with a
normalization of each example alone, most often ``nn.GroupNorm`` (Group Normalization, Wu and
He, 2018), as Opacus' ``ModuleValidator.fix`` makes it. :func:`convert_batch_norm` does the same
here, in place, keeping what the batch norm had learned of its scale and shift.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import ConfigurationError, ConfigurationTypeError, UnsupportedModuleError

__all__ = ["convert_batch_norm"]

# the batch norms converted: torch's own classes exactly (a subclass's forward may do more)
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def convert_batch_norm(module: nn.Module, num_groups: int | None = None) -> nn.Module:
    """Replace every batch norm of ``module`` (``nn.BatchNorm1d/2d/3d``, ``nn.SyncBatchNorm``)
    by an ``nn.GroupNorm`` over the same channels, in place; return ``module``, or the new
    layer where ``module`` itself is a batch norm.

    Each ``GroupNorm`` has ``num_groups`` groups (default: ``gcd(32, channels)``, Opacus'
    choice: 32 groups where the channels allow, one channel per group for fewer than 32
    channels that do not divide it), the batch norm's ``eps`` and ``affine``, its ``weight`` and
    ``bias`` copied (with their ``requires_grad``), its device, dtype and train/eval mode. The
    running statistics are dropped: a group norm has none. Hooks registered on a batch norm
    go with it. A model under :func:`gradhooks.add_hooks` is followed at its next forward.
    The group norms' ``weight`` and ``bias`` are new parameters: convert before making the
    optimizer (one made before still holds the batch norms', and never steps or zeroes these).

    Nothing is changed where a batch norm cannot be converted (every one is checked first):
    a subclass of a batch norm (its forward may do more than normalize: timm's
    ``BatchNormAct2d`` applies an activation too; build the model with another ``norm_layer``,
    or replace it yourself), a lazy one not yet initialized (run one forward first), or
    ``num_groups`` that does not divide its channels."""
    if not isinstance(module, nn.Module):
        raise ConfigurationTypeError(
            f"convert_batch_norm takes an nn.Module, got {type(module).__qualname__}"
        )
    if isinstance(num_groups, bool):  # (True was one group)
        raise ConfigurationTypeError(
            f"convert_batch_norm: num_groups must be a positive int or None, got {num_groups!r}"
        )
    if num_groups is not None and (not isinstance(num_groups, int) or num_groups < 1):
        raise ConfigurationError(
            f"convert_batch_norm: num_groups must be a positive int or None, got {num_groups!r}"
        )
    found = [(name, m) for name, m in module.named_modules() if _is_batch_norm(m)]
    for name, m in found:
        _check(name or "<model>", m, num_groups)
    if type(module) in BATCH_NORMS:
        return _group_norm(module, num_groups)
    for name, m in found:
        parent_name, _, leaf = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, leaf, _group_norm(m, num_groups))
    return module


def _is_batch_norm(m: nn.Module) -> bool:
    return isinstance(m, BATCH_NORMS) or (
        isinstance(m, nn.modules.lazy.LazyModuleMixin)
        and any(type(m).__name__ == f"Lazy{t.__name__}" for t in BATCH_NORMS)
    )


def _check(name: str, m: nn.Module, num_groups: int | None) -> None:
    kind = type(m).__qualname__
    if isinstance(m, nn.modules.lazy.LazyModuleMixin) and m.has_uninitialized_params():
        raise UnsupportedModuleError(
            f"convert_batch_norm: '{name}' ({kind}) has not seen an input yet, so its number "
            "of channels is unknown: run one forward of the model first (its lazy layers then "
            "become ordinary ones), and convert after. Nothing was changed."
        )
    if type(m) not in BATCH_NORMS:
        base = next(t.__name__ for t in BATCH_NORMS if isinstance(m, t))
        raise UnsupportedModuleError(
            f"convert_batch_norm: '{name}' ({type(m).__module__}.{kind}) is a subclass of "
            f"nn.{base}, whose forward may do more than normalize (timm's BatchNormAct2d "
            "applies an activation too), so it is not replaced by a GroupNorm alone. Build "
            "the model with another normalization layer (timm and torchvision models take a "
            "norm_layer argument), or replace this layer yourself. Nothing was changed."
        )
    channels = m.num_features
    if num_groups is not None and channels % num_groups:
        raise ConfigurationError(
            f"convert_batch_norm: num_groups={num_groups} does not divide the {channels} "
            f"channels of '{name}' ({kind}): GroupNorm needs whole groups. Pass a divisor of "
            "every batch norm's channels, or num_groups=None (gcd(32, channels) for each). "
            "Nothing was changed."
        )


def _group_norm(m: nn.Module, num_groups: int | None) -> nn.GroupNorm:
    channels = m.num_features
    groups = math.gcd(32, channels) if num_groups is None else num_groups
    like = m.weight if m.weight is not None else m.running_mean
    factory = {} if like is None else {"device": like.device, "dtype": like.dtype}
    new = nn.GroupNorm(groups, channels, eps=m.eps, affine=m.affine, **factory)
    if m.affine:
        with torch.no_grad():
            new.weight.copy_(m.weight)
            new.bias.copy_(m.bias)
        new.weight.requires_grad_(m.weight.requires_grad)
        new.bias.requires_grad_(m.bias.requires_grad)
    return new.train(m.training)

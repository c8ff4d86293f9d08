"""Parameters replaced by their aliases in every torch function (see
:attr:`gradhooks.tracking.Tracker.aliases`)."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.overrides import TorchFunctionMode


def _alias(aliases: dict[int, Tensor], a: Any) -> Any:
    if isinstance(a, Tensor):
        return aliases.get(id(a), a)
    if type(a) in (list, tuple) and any(id(x) in aliases for x in a if isinstance(x, Tensor)):
        return type(a)(aliases.get(id(x), x) if isinstance(x, Tensor) else x for x in a)
    return a


def aliased(aliases: dict[int, Tensor], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with each tensor whose ``id`` is in ``aliases`` replaced by its
    alias (also inside a list or tuple argument: ``torch.cat([x, w])``)."""
    return (
        tuple(_alias(aliases, a) for a in args),
        {k: _alias(aliases, v) for k, v in kwargs.items()},
    )


class Aliases(TorchFunctionMode):
    """While on, every torch function receives ``aliases[id(t)]`` in place of a tensor ``t``
    (see :attr:`Tracker.aliases`)."""

    def __init__(self, aliases: dict[int, Tensor]) -> None:
        super().__init__()
        self.aliases = aliases

    def __torch_function__(self, func, types, args=(), kwargs=None):
        args, kwargs = aliased(self.aliases, args, kwargs or {})
        return func(*args, **kwargs)

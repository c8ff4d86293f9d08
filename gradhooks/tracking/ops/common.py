"""The table of handlers, keyed by torch function name, and what handlers share."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from torch import Tensor

from ... import _torch
from ..layout import Layout

# A handler gets (args, kwargs, out, layout_of) and returns the layout of the operation's tensor
# outputs: one Layout for all of them, a list (one per tensor output, in order), or UNKNOWN.
Handler = Callable[[tuple, dict, Any, Callable[[Any], Layout | None]], Any]
HANDLERS: dict[str, Handler] = {}


def handles(*names: str):
    def decorate(fn: Handler) -> Handler:
        for n in names:
            HANDLERS[n] = fn
        return fn

    return decorate


def first_tensor(out: Any) -> Tensor | None:
    if isinstance(out, Tensor):
        return out
    if isinstance(out, list | tuple):
        for o in out:
            if isinstance(o, Tensor):
                return o
    return None


def tensor_args(args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensors among ``args`` and then ``kwargs``' values, and inside a list or tuple
    among them (``torch.cat([x, y])``), in order."""
    found = []
    for a in args:
        if isinstance(a, Tensor):
            found.append(a)
        elif type(a) in (list, tuple):
            found += [x for x in a if isinstance(x, Tensor)]
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, Tensor):
                found.append(a)
            elif type(a) in (list, tuple):
                found += [x for x in a if isinstance(x, Tensor)]
    return found


def out_tensors(out: Any) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, list | tuple):
        return [o for o in out if isinstance(o, Tensor)]
    return []


def arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def norm_dim(d: int, n: int) -> int:
    return d + n if d < 0 else d


def normalized_dims(dims: Any, n: int) -> set[int] | None:
    """Normalized dims of a ``dim`` argument (``None``: all)."""
    if dims is None:
        return None
    if isinstance(dims, int):
        return {norm_dim(dims, n)}
    return {norm_dim(int(d), n) for d in dims}


def single_input(args, kwargs, layout_of) -> tuple[Tensor, Layout] | tuple[None, None]:
    """The first tensor argument and its layout, if it is the only one with a layout."""
    found = None
    for t in tensor_args(args, kwargs):
        lay = layout_of(t)
        if lay is not None:
            if found is not None:
                return None, None
            found = (t, lay)
    return found if found is not None else (None, None)


class NeedsBatch:
    """A handler that needs the batch size (reshapes): called with it bound."""

    def __init__(self, fn) -> None:
        self.fn = fn


def is_inplace(name: str) -> bool:
    """Whether torch function ``name`` changes its first argument in place and gives it back
    (``x.add_(y)``, ``x += y``, ``x[i] = v``): as the aten operator of that name's schema
    says (``Tensor(a!) self -> Tensor(a!)``), or, where there is none (``__setitem__``, a
    method of Python's own) or it cannot be read, as its name does."""
    table = _INPLACE[_torch.available("op_schema")]
    found = table.get(name)
    if found is None:  # (reading the schemas is slow: once per name)
        schema = _torch.writes_first(name)
        found = table[name] = named_inplace(name) if schema is None else schema
    return found


# is_inplace's answers by name, with the schemas read and without (``_torch.disabled``)
_INPLACE: tuple[dict[str, bool], dict[str, bool]] = ({}, {})


_TRAILING_UNDERSCORE = re.compile(r"^[a-z][a-z0-9_]*_$")


def named_inplace(name: str) -> bool:
    """Whether ``name`` is that of an in-place operation by torch's naming: a trailing
    underscore (``add_``), Python's in-place operators (``__iadd__``), ``__setitem__``. Not
    the other methods of Python's whose names start so (``__int__``, ``__index__``: reads)."""
    return (
        name == "__setitem__"
        or bool(_TRAILING_UNDERSCORE.match(name))
        or (name.startswith("__i") and name.endswith("__") and name not in _NOT_INPLACE)
    )


# Python's methods named as its in-place operators are (``__i...__``) that are none
_NOT_INPLACE = frozenset({"__invert__", "__int__", "__index__", "__iter__", "__init__"})


def op_name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property: Tensor.T, .mT, .data
        owner = getattr(func, "__self__", None)
        return "." + getattr(owner, "__name__", "?")
    if name in _SPATIAL and getattr(func, "__module__", None) == "torch.nn.functional":
        return _SPATIAL[name]  # (F.unfold is not Tensor.unfold)
    return name


# functions of torch.nn.functional named as a Tensor method that does something else
_SPATIAL = {"unfold": "im2col", "fold": "col2im"}


def carries(t: Tensor) -> bool:
    """Whether what ``t`` holds, computed across the examples, makes one example's result
    depend on another's: its gradient flows back, or its values are computed with (a batch mean
    of the data, a detached statistic). An index or mask is taken as selecting only."""
    return t.requires_grad or t.is_floating_point() or t.is_complex()

"""A hooked model under ``torch.compile``: its forward runs eagerly, every torch function seen.

The batch tracker must see each torch function of a hooked forward (it finds where the
examples are), and the hooks run on real tensors. Traced by dynamo, the tracker (a
``TorchFunctionMode`` keeping its layouts by tensor identity) breaks the graph at nearly every
torch function, and the forward ends up slower than eager. So the first of gradhooks' hooks a
compiled call reaches (the model's own forward pre-hook, for ``torch.compile(model)``) is a
graph break, and from there the rest of that compiled call runs eagerly
(:func:`gradhooks._torch.leave_compiled`): the forward, its hooks, and whatever the compiled
function does after it. ``torch.compile`` sets its frame evaluation again when the call
returns; once the hooks are removed, the model compiles as before.

``fullgraph=True`` allows no graph break, and gradhooks' hooks are one: refused with
:data:`FULLGRAPH`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import _torch

FULLGRAPH = (
    "gradhooks' hooks run eagerly, and its batch tracker must see every torch function of a "
    "hooked forward, so a hooked model cannot be compiled with torch.compile(..., "
    "fullgraph=True): compile it without fullgraph=True (the call then runs eagerly from "
    "gradhooks' first hook on: one graph break, and as fast as the eager model), or remove the "
    "hooks (gradhooks.remove_hooks(model)) to compile the whole model as one graph without grad1"
)


def eager(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run through ``torch.compiler.disable``: for code dynamo traces where
    :func:`leave` cannot turn compilation off (``fn`` alone runs eagerly, and dynamo traces on
    after it)."""
    return _disable(fn, recursive=True)


_BREAK: list = [None]  # the graph break of leave(), made by prepare()


def prepare() -> None:
    """Make :func:`leave`'s graph break, once torch's compiler is loaded, outside any
    compilation (made while torch.compile traces, fullgraph=True would fail naming
    ``torch.compiler.disable`` itself rather than why)."""
    if _BREAK[0] is None:
        _BREAK[0] = _disable(_leave_compiled, recursive=False)


def leave() -> bool:
    """In code dynamo traces: a graph break, after which the rest of the compiled call runs
    eagerly; whether it will (not where :func:`gradhooks._torch.leave_compiled` is missing or
    off, or before :func:`prepare`)."""
    if _BREAK[0] is None or not _torch.available("eval_frame"):
        return False
    _BREAK[0]()
    return True


def _leave_compiled() -> None:
    # (no tensor in its frame, nor in its wrapper's: dynamo runs them as they are)
    _torch.leave_compiled()


def _disable(fn: Callable[..., Any], recursive: bool) -> Callable[..., Any]:
    try:
        return torch.compiler.disable(fn, recursive=recursive, reason=FULLGRAPH)
    except TypeError:  # (a torch whose disable takes no reason)
        return torch.compiler.disable(fn, recursive=recursive)

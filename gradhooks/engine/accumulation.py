"""When a backward adds to what earlier backwards left, and when it starts afresh: the rule
``grad1`` and the accumulating quantities share with ``.grad``.

autograd adds each backward's gradient to ``p.grad``, and ``optimizer.zero_grad()`` /
``model.zero_grad()`` start it afresh: ``p.grad`` becomes ``None`` (``set_to_none=True``, torch's
default) or zeros (``set_to_none=False``). gradhooks does not see the ``zero_grad`` call, only
its result, so :class:`GradTrail` records, at the end of every captured backward, the
``.grad`` each parameter was left with (the tensor and its version counter); at the start of
the next captured backward, before autograd adds anything to it, a parameter whose ``.grad``
is ``None`` (and was not), or is all zeros, was reset: its ``grad1`` starts afresh. A
``.grad`` left as it was (gradient accumulation over micro-batches, a second backward with
``retain_graph``), or changed but not zeroed (``clip_grad_norm_``, a ``GradScaler``'s
``unscale_``, DDP's all-reduce: post-processing of the sum, not a new start; a backward that
was not captured adding to it), continues the accumulation, unless a backward that was not
captured saw it reset at its own start (``zero_grad``, then a paused backward).

A backward that leaves ``.grad`` alone (``torch.autograd.grad``, which returns its gradients
instead of adding them up) gives no such sign: there the engine adds to ``grad1`` over the
backwards of one forward (several ``retain_graph`` backwards, as K-FAC's sampled labels take
them) and starts afresh at a new forward's. The ``grad1`` such a backward found, where it was
``.grad``'s rows, is set aside: a backward that adds into ``.grad`` after it puts it back
before adding (``BackwardWriter.set_aside``), so that ``grad1`` is ``.grad``'s rows again.

The values are read (one transfer per device, at the start of each captured backward) for
every ``.grad`` that is not ``None``: a ``.grad`` left as it was and one zeroed through
``.data`` (``p.grad.data.zero_()``, which torch does not count as a change) look alike
otherwise. A ``.grad`` the last backward left all zeros (examples whose shares cancel
exactly: a WGAN critic's last bias) looks like one zeroed so: its ``grad1``, whose rows add up
to zero, tells it apart (:func:`zeroed_since`). After the default ``zero_grad()`` (``set_to_none=True``) nothing is read.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from .. import _torch

__all__ = ["GradTrail", "all_zero"]


class GradTrail:
    """The ``.grad`` each parameter was left with by the last backward that saw it."""

    def __init__(self) -> None:
        # id(param) -> (param, a weak reference to its .grad or None, that .grad's version)
        self._left: dict[int, tuple[nn.Parameter, weakref.ref | None, int]] = {}
        # seen by a backward that was not captured, by id: whether .grad was None then (so
        # that the tensor the last captured backward left, on .grad again, was put back)
        self._reset_seen: dict[int, bool] = {}
        # computed without adding to .grad by the last captured backward that computed them
        # (torch.autograd.grad), by id
        self._not_added: set[int] = set()
        # left None by the last captured backward and still None at this one's start, by id
        self._alone: set[int] = set()
        # added into .grad by the last captured backward that computed them, yet None at its
        # end, and since (an optimizer step fused into the backward: the step, then
        # zero_grad, in a post-accumulate-grad hook), by id
        self._emptied: set[int] = set()

    def __contains__(self, pid: int) -> bool:
        return pid in self._left

    def __len__(self) -> int:
        return len(self._left)

    def record(
        self, params: Iterable[nn.Parameter] | dict[int, nn.Parameter],
        computed: Iterable[int] = (), added: Iterable[int] = (),
    ) -> None:  # fmt: skip
        """At the end of a backward (every gradient accumulated): what ``.grad`` holds now;
        ``params``: the parameters (or ``{id: parameter}``); ``computed``, ``added``: the ids of
        the parameters whose gradient it computed, and of those it added into ``.grad``."""
        added, computed = set(added), set(computed)
        not_added = self._not_added
        for pid in computed:
            if pid in added:
                not_added.discard(pid)
            else:
                not_added.add(pid)
        items = params.items() if isinstance(params, dict) else ((id(p), p) for p in params)
        left, seen, emptied = self._left, self._reset_seen, self._emptied
        for pid, p in items:
            g = grad_of(p)
            left[pid] = (p, None, -1) if g is None else (p, weakref.ref(g), _torch.version(g))
            if g is None and pid in added:
                emptied.add(pid)
            elif g is not None or pid in computed:
                emptied.discard(pid)
            if seen:
                seen.pop(pid, None)

    def left_alone(self, p: nn.Parameter) -> bool:
        """Whether the last captured backward left ``p.grad`` ``None`` and it still is, or
        computed ``p``'s gradient without adding it into ``.grad`` (a ``torch.autograd.grad``,
        which returns its gradients instead of adding them up, whatever the loop does with
        ``.grad`` afterwards: ``p.grad = g`` before ``optimizer.step()``). ``.grad`` as this
        backward found it at its start (:meth:`restarted`): autograd may have added to it
        since, before the call that asks (a bias accumulated before its layer's backward hook)."""
        found = self._left.get(id(p))
        if found is None:
            return False
        return id(p) in self._alone or id(p) in self._not_added

    def emptied(self) -> list[nn.Parameter]:
        """At the start of a captured backward (after :meth:`restarted`): the parameters whose
        ``.grad`` the last captured backward that computed them added to and left ``None``
        (an optimizer step fused into it, ``zero_grad`` in a post-accumulate-grad hook), and
        that is ``None`` still. That was a reset, which their ``.grad`` does not show at this
        start: this backward starts their ``grad1`` afresh where it computes their gradient (a
        new forward's, :meth:`left_alone`), and leaves them none where it does not, as after a
        ``zero_grad``."""
        left = self._left
        return [
            left[pid][0] for pid in self._emptied if pid in left and grad_of(left[pid][0]) is None
        ]

    def params(self) -> list[nn.Parameter]:
        return [p for p, _, _ in self._left.values()]

    def _reset(self, seen: bool) -> list[nn.Parameter]:
        """The recorded parameters whose ``.grad`` is ``None`` now, or is all zeros (or,
        ``seen``, changed since a reset was seen). A ``.grad`` whose tensor and version are
        those recorded is read too: ``p.grad.data.zero_()`` (the manual loops' reset) zeroes
        it without counting a version. So is the recorded tensor put back on ``.grad`` after a
        reset to ``None`` was seen (``.grad`` set aside around a per-example loop, as
        ``check(loss_fn, ...)`` and ``loop_grad`` do), also where it was changed in place
        since (``clip_grad_norm_``, a paused backward adding to it): autograd never gives
        back a tensor it dropped, so the reset was undone."""
        reset, read, same = [], [], set()
        for p, ref, version in self._left.values():
            g = grad_of(p)
            if g is None:
                if ref is not None:  # (None then and now: a backward that leaves .grad alone)
                    reset.append(p)
                continue
            changed = ref is None or ref() is not g or _torch.version(g) != version
            put_back = self._reset_seen.get(id(p), False) and ref is not None and ref() is g
            if changed and seen and id(p) in self._reset_seen and not put_back:
                reset.append(p)
            else:
                read.append(p)
                if not changed and not put_back:
                    same.add(id(p))
        if read:
            zero = all_zero([p.grad for p in read])
            reset += zeroed_since([p for p, z in zip(read, zero) if z], same)
        return reset

    def restarted(self) -> list[nn.Parameter]:
        """At the start of a captured backward (nothing accumulated yet): the recorded
        parameters whose ``.grad`` was reset since the last captured backward. They are
        forgotten."""
        reset = self._reset(seen=True)
        for p in reset:
            del self._left[id(p)]
            self._emptied.discard(id(p))
            self._reset_seen.pop(id(p), None)
        self._alone = {
            id(p) for p, ref, _ in self._left.values() if ref is None and grad_of(p) is None
        }
        return reset

    def reset_since(self) -> list[nn.Parameter]:
        """The recorded parameters whose ``.grad`` was reset since the last captured backward
        (read only: nothing is forgotten), for :meth:`gradhooks.Hooks.check`."""
        return self._reset(seen=False)

    def observe(self) -> None:
        """At the start of a backward that is not captured: note the resets it sees (its own
        gradient then makes ``.grad`` nonzero again; the next captured backward starts afresh
        all the same, unless ``.grad`` is put back as the last captured backward left it)."""
        for p in self._reset(seen=True):
            self._reset_seen[id(p)] = grad_of(p) is None

    def added_last(self, p: nn.Parameter) -> bool:
        """Whether the last captured backward that computed ``p``'s gradient added it into
        ``.grad`` (a ``backward()``, not a ``torch.autograd.grad``)."""
        return id(p) in self._left and id(p) not in self._not_added

    def forget(self, pids: Iterable[int]) -> None:
        for pid in pids:
            self._left.pop(pid, None)
            self._emptied.discard(pid)
            self._reset_seen.pop(pid, None)
            self._not_added.discard(pid)

    def clear(self) -> None:
        self._left.clear()
        self._emptied.clear()
        self._reset_seen.clear()
        self._not_added.clear()
        self._alone.clear()


def zeroed_since(zeros: list[nn.Parameter], same: set[int]) -> list[nn.Parameter]:
    """Of the parameters whose ``.grad`` is all zeros now (``zeros``): those reset since the
    last captured backward. One whose ``.grad`` is the tensor, at the version, that backward
    left (``same``, by id) was zeroed through ``.data`` (``p.grad.data.zero_()``), or was left
    all zeros by it: a gradient of exactly zero from examples whose shares cancel (a WGAN
    critic's last bias, the batch's real and fake halves). Their ``grad1`` tells, its rows
    having added up to what ``.grad`` held: where one's rows do not add up to zero, the loop
    zeroed them; where every one's do, nothing was reset. Where one has no ``grad1`` to tell
    (or rows of zeros alone), they count as reset."""
    unsure = [p for p in zeros if id(p) in same]
    if not unsure:
        return zeros
    for p in unsure:
        if not _rows_cancel(p):
            return zeros
    return [p for p in zeros if id(p) not in same]


def _rows_cancel(p: nn.Parameter) -> bool:
    """Whether ``p.grad1``'s rows, not all zero, add up to zero (to their rounding)."""
    rows = p.__dict__.get("grad1")
    if (
        not isinstance(rows, Tensor)
        or rows.layout != torch.strided
        or not rows.is_floating_point()
        or rows.dim() != p.dim() + 1
    ):
        return False
    rows = rows.detach()
    spread = rows.abs().sum(0)
    bound = torch.finfo(rows.dtype).eps ** 0.5 * spread
    return bool(spread.any() and (rows.sum(0).abs() <= bound).all())


def grad_of(t: Tensor) -> Tensor | None:
    """``t.grad``, without torch's warning for a tensor computed from the parameters that
    holds a ``grad1`` (MAML's fast weights): autograd gives such a tensor no ``.grad`` unless
    it retains it."""
    return t.grad if t.is_leaf or t.retains_grad else None


def all_zero(tensors: list[Tensor]) -> list[bool]:
    """Whether each tensor (dense or sparse) holds only zeros; one transfer per device."""
    flags: dict[torch.device, list[tuple[int, Tensor]]] = {}
    for i, t in enumerate(tensors):
        t = t.detach()
        if t.is_sparse:
            t = t.coalesce().values()
        elif t.layout != torch.strided:
            t = t.to_dense()
        flags.setdefault(t.device, []).append((i, t.any()))
    out = [False] * len(tensors)
    for found in flags.values():
        anys = torch.stack([f for _, f in found]).tolist()
        for (i, _), a in zip(found, anys):
            out[i] = not a
    return out


def _grad1_refs(owner: Any) -> int:
    t = owner.__dict__.get("grad1")
    return sys.getrefcount(t)


def _sole_refs() -> int | None:
    """What :func:`_grad1_refs` counts for a ``grad1`` that nothing else refers to, or ``None``
    where one more reference would not show (then ``grad1`` is never written in place)."""
    try:
        owner = nn.Parameter(torch.zeros(2))
        owner.grad1 = torch.zeros(1, 2)
        alone = _grad1_refs(owner)
        kept = owner.grad1  # noqa: F841  (one more reference)
        return alone if _grad1_refs(owner) == alone + 1 else None
    except Exception:
        return None


_SOLE_REFS = _sole_refs()


def sole_grad1(p: nn.Parameter) -> Tensor | None:
    """``p.grad1`` if it is a plain contiguous tensor that only ``p`` refers to: no other
    Python reference, no view or other tensor on its memory, not saved by autograd."""
    if _SOLE_REFS is None or type(p.__dict__.get("grad1")) is not Tensor:
        return None
    if _grad1_refs(p) != _SOLE_REFS:
        return None
    t = p.grad1
    return t if t.is_contiguous() and _torch.unshared(t) else None

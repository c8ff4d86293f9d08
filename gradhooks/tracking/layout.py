"""The layout of a tensor that holds the examples: which dimension holds them, and how.

See :mod:`gradhooks.tracking` for how the tracker follows them through a forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import UnsupportedInputError


class Owners:
    """The example of each entry of a layout's dimension, one by one: ``rows[r]`` (int64,
    ``[entries]``) owns entry ``r``. Rows picked from the batch by an index (the tokens a
    mixture-of-experts layer routes to one expert, ``h[top_x]``; the unpadded tokens of a
    batch, ``h[mask]``) are laid out so: each still belongs to one example, but how many each
    example has, and where, is data. ``base``: the layout of the tensor they were picked from
    (where they are written back to, ``out.index_add_(0, top_x, y)``). ``shuffled``: the
    examples put in another order by an index of their dimension, ``x[perm]`` (where no
    gradient flows, mixed with the batch in order, ``lam * x + (1 - lam) * x[perm]``, that is
    MixUp of the inputs: mixed before the model). ``placed``: the rows were picked by their
    place in the batch, not by data (a slice or a split of it, ``x[:2]``, ``x.narrow(0, 1,
    2)``, one example taken out alone and given its batch dimension back, ``x[i][None]``),
    and kept so by what only reshapes, repeats or joins them: a per-example loop, which runs
    the model on each example alone, gives every example what such rows get only where the
    forward picks every example alike (see :mod:`gradhooks.tracking.rows`). Two are equal
    where their rows are."""

    __slots__ = ("rows", "base", "shuffled", "placed")

    def __init__(self, rows: Tensor, base: Layout | None = None, placed: bool = False) -> None:
        self.rows, self.base, self.shuffled, self.placed = rows, base, False, placed

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Owners) or self.rows.shape != other.rows.shape:
            return False
        return self.rows.device == other.rows.device and torch.equal(self.rows, other.rows)

    def __hash__(self) -> int:
        return hash(self.rows.numel())

    def __repr__(self) -> str:
        return f"Owners({self.rows.numel()} rows)"


@dataclass(frozen=True)
class Layout:
    """Dimension ``dim`` holds ``outer · batch · inner`` entries; entry ``(a · batch + b) · inner
    + c`` belongs to example ``b``. With ``owners``, dimension ``dim`` holds as many entries as
    it has rows, and entry ``r`` belongs to example ``owners.rows[r]`` (see :class:`Owners`)."""

    dim: int
    outer: int = 1
    inner: int = 1
    owners: Owners | None = None

    def size(self, batch: int) -> int:
        if self.owners is not None:
            return self.owners.rows.numel()
        return self.outer * batch * self.inner

    @property
    def plain(self) -> bool:
        return self.outer == 1 and self.inner == 1 and self.owners is None

    def at(self, dim: int) -> Layout:
        return Layout(dim, self.outer, self.inner, self.owners)

    def describe(self, batch: int) -> str:
        if self is PACKED:
            return "packed (a PackedSequence)"
        if self is MIXED:
            return "mixed (entries depend on several examples)"
        if self is UNKNOWN or self.dim < 0:
            return "unknown"
        if self.owners is not None:
            return f"dimension {self.dim}, rows picked from the batch by an index"
        if self.plain:
            return f"dimension {self.dim}"
        parts = [str(self.outer)] if self.outer > 1 else []
        parts.append(f"batch {batch}")
        if self.inner > 1:
            parts.append(str(self.inner))
        return f"dimension {self.dim} as {' x '.join(parts)}"


UNKNOWN = Layout(-1)
# a PackedSequence's data: the examples' time steps packed along dimension 0 (the RNN rules read
# them from its batch sizes)
PACKED = Layout(-2)
# (a handler's answer, never a tensor's layout: the examples reordered along the batch, by a
# permutation; the tracker marks the result as reordered, see Tracker.reordered)
REORDER = Layout(-4)
# a tensor whose entries depend on several examples at once (a reduction over the batch, a roll
# along it, a product of two examples): per-example gradients through it do not exist
MIXED = Layout(-3)
# (a handler's answer, never a tensor's layout: the examples' dimension contracted, a Linear's
# features or a LayerNorm's normalized dimensions; the tracker makes the result mixed, or, on
# the model's first input as the engine took it, unknown: there the examples may not be where
# they were presumed (a 1-d input, a batch_dim on the features), which the engine names)
CONTRACTED = Layout(-5)
# (a handler's answer, never a tensor's layout: the result does not depend on the examples,
# though some of its arguments do; the tracker leaves it without a layout)
FREE = Layout(-6)


def is_followed(lay: Layout | None) -> bool:
    return lay is not None and lay.dim >= 0


def batch_rows(t: Tensor, layout: Layout, batch: int) -> Tensor:
    """``t`` with its examples on a new leading dimension: ``[batch, ...]``, the layout's
    dimension keeping ``outer · inner`` entries (``outer`` before ``inner``). Not for rows
    picked by an index (:class:`Owners`: the examples have different numbers of rows)."""
    if layout.owners is not None:
        raise UnsupportedInputError(
            f"a tensor of shape {tuple(t.shape)} holds rows picked from the batch by an index "
            f"on dimension {layout.dim} (tokens routed to experts, unpadded tokens): the "
            "examples have different numbers of rows there, so they cannot be split along a "
            "new dimension. Give the rows to nn.Linear (or another layer with a rule) rather "
            "than to a module without a rule, or freeze its parameters."
        )
    d = layout.dim
    t = t.unflatten(d, (layout.outer, batch, layout.inner)).movedim(d + 1, 0)
    return t.flatten(d + 1, d + 2)


def example_mask(shape: Sequence[int], layout: Layout, batch: int, device) -> Tensor:
    """``[batch, *shape]`` of 0/1 (bool): entry ``[b, ...]`` is 1 where that entry of a tensor
    of ``shape`` with ``layout`` belongs to example ``b``."""
    d = layout.dim
    owner = owner_vector(layout, batch, device)  # [size]
    mask = owner[None, :] == torch.arange(batch, device=device)[:, None]  # [batch, size]
    view = [batch] + [1] * len(shape)
    view[d + 1] = layout.size(batch)
    return mask.reshape(view).expand(batch, *shape)


def sole_owner(layouts) -> int | None:
    """The example that owns every row where each of ``layouts`` that holds examples (``None``:
    none) holds rows picked from the batch (:class:`Owners`) of that one example alone (an
    image's rows, ``x[i : i + 1]`` or ``x[i].unsqueeze(0)``, in a loop over the batch);
    ``None`` where any holds another example's, or the batch itself, or none does."""
    owner = None
    for lay in layouts:
        if lay is None:
            continue
        if lay.owners is None or lay.dim < 0:
            return None
        rows = lay.owners.rows
        if rows.numel() == 0 or not bool((rows == rows[0]).all()):
            return None
        k = int(rows[0])
        if owner not in (None, k):
            return None
        owner = k
    return owner


def owner_vector(layout: Layout, batch: int, device) -> Tensor:
    """``[size]`` (int64): the example that owns each entry of the layout's dimension."""
    if layout.owners is not None:
        return layout.owners.rows.to(device)
    index = torch.arange(layout.size(batch), device=device)
    return (index // layout.inner) % batch


def owner_map(t: Tensor, layout: Layout, batch: int) -> Tensor:
    """The owner of every entry of ``t`` (laid out as ``layout``), as a tensor of ``t.dim()``
    dimensions of size 1 but the layout's (expand it to ``t.shape``)."""
    shape = [1] * t.dim()
    shape[layout.dim] = t.shape[layout.dim]
    return owner_vector(layout, batch, t.device).view(shape)


def owned(dim: int, rows: Tensor, base: Layout | None, batch: int, placed: bool = False) -> Layout:
    """The layout of a dimension whose entry ``r`` belongs to example ``rows[r]``: ``base``
    (at ``dim``; for rows picked from rows picked, the layout those were picked from) where
    ``rows`` is its own (every row picked in place, or put back in place: ``x[perm]
    [perm.argsort()]``), else an :class:`Owners` layout (``placed``: see :class:`Owners`)."""
    rows = rows.reshape(-1).to(torch.int64)
    if base is not None and base.owners is not None:
        base = base.owners.base  # (rows picked from rows picked: the batch they came from)
    if (
        base is not None
        and base.owners is None
        and base.dim >= 0
        and base.size(batch) == rows.numel()
        and torch.equal(owner_vector(base, batch, rows.device), rows)
    ):
        return Layout(dim, base.outer, base.inner)
    return Layout(dim, owners=Owners(rows, base, placed))


def owner_dim(ow: Tensor, o: Tensor, base: Layout | None, batch: int) -> Layout | None:
    """The layout of ``o`` whose entries' owners are ``ow`` (broadcastable to ``o.shape``, as
    many dimensions): the dimension along which alone they vary (the longest where several
    do), or ``None`` where there is none (an entry of each row of several examples)."""
    if ow.dim() != o.dim() or o.dim() == 0:
        return None
    best = None
    for e in range(o.dim()):
        if ow.shape[e] != o.shape[e]:
            continue
        if o.numel() == 0:
            if o.shape[e] == 0:
                return Layout(e, owners=Owners(ow.new_zeros(0), base))
            continue
        flat = ow.movedim(e, 0).reshape(ow.shape[e], -1)
        if flat.shape[1] > 1 and not bool((flat == flat[:, :1]).all()):
            continue
        if best is None or o.shape[e] > o.shape[best[0]]:
            best = (e, flat[:, 0])
    if best is None:
        return None
    return owned(best[0], best[1], base, batch)


def slice_layout(lay: Layout, size: int, start: int, stop: int, step: int) -> Layout | None:
    """The layout of entries ``start:stop:step`` of a dimension of ``size`` entries laid out as
    ``lay``: all of them, or whole blocks of the ``outer`` copies of the batch (the halves of
    ``cat([x1, x2])``); ``None`` where the slice picks some examples."""
    if step == 1 and start == 0 and stop >= size:
        return lay
    block = size // lay.outer
    if step != 1 or lay.outer == 1 or start % block or stop % block or stop <= start:
        return None
    return Layout(lay.dim, (stop - start) // block, lay.inner)


def slice_rows(lay: Layout, size: int, start: int, stop: int, step: int, device) -> Layout:
    """The layout of entries ``start:stop:step`` of a dimension of ``size`` entries laid out as
    ``lay``, where :func:`slice_layout` has none (the slice picks some examples: a chunk of
    ``x.split(1)``, ``x[1:3]``): the rows it picks, as :class:`Owners`, which is what an index
    of those positions (``x[torch.arange(start, stop, step)]``) gives. Rows picked by an index
    cut by position are :data:`MIXED` (``h[token][:capacity]``: where the cut falls depends
    on the other examples' rows; :func:`split_rows` follows a split into whole examples)."""
    if lay.owners is not None:
        return MIXED
    rows = owner_vector(lay, size // (lay.outer * lay.inner), device)[start:stop:step]
    return Layout(lay.dim, owners=Owners(rows, lay, placed=True))


def split_rows(lay: Layout, sizes: Sequence[int]) -> list[Layout]:
    """The layouts of the parts of ``sizes`` rows, in turn, that rows picked by an index
    (``lay``, with :class:`Owners`) are split into: each part's rows where every part holds
    every row of one example (a varlen batch split by its sequences' lengths), else every part
    :data:`MIXED` (a split elsewhere cuts an example's rows, or groups examples by where the
    other examples' rows fall)."""
    every, found, start = lay.owners.rows, [], 0
    for n in sizes:
        rows = every[start : start + n]
        start += n
        if n and (not bool((rows == rows[0]).all()) or int((every == rows[0]).sum()) != n):
            return [MIXED] * len(sizes)
        found.append(Layout(lay.dim, owners=Owners(rows, lay.owners.base, lay.owners.placed)))
    return found

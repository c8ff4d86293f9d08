"""Where the examples are: the batch followed through a forward, one torch function at a time.

A rule reads the batch from one dimension of its layer's input. In the models people train that
is not always so: a learned position embedding is looked up with ``arange(T)`` and broadcast into
the batch afterwards; Swin folds the windows of every image into dimension 0 (``[B * windows,
...]``); a sequence-first model keeps the batch on dimension 1. Sizes cannot tell these apart (a
sequence as long as the batch is large looks like a batch), so the engine follows the batch
itself: while a hooked model's forward runs, a :class:`Tracker` (a ``TorchFunctionMode``) sees
every torch function call and records, for each tensor that depends on the examples, a
:class:`Layout`: the dimension that holds them and how they are laid out in it. Tensors that do
not depend on the examples (parameters, buffers, positions from ``arange``, masks) carry none.

A layout ``Layout(dim, outer, inner)`` says that dimension ``dim`` has ``outer · batch · inner``
entries and that entry ``(a · batch + b) · inner + c`` belongs to example ``b``: ``[B, T, C]`` is
``Layout(0)``, Swin's windows ``[B * W, N, C]`` are ``Layout(0, inner=W)``, a sequence-first
``[T, B, C]`` is ``Layout(1)``. :data:`UNKNOWN` marks a tensor that depends on the examples
through an operation whose effect on the layout is not known here.

Batch-free inputs that meet the batch. A hooked call (or a parameter used outside its module's
call) whose inputs carry no layout is *batch-free*: its output is the same for every example and
is broadcast into the batch later (the position embedding). Its per-example gradient is defined,
but autograd sums it over the batch where the broadcast happens, so the output's gradient the
hooks see is already summed. The tracker therefore marks such outputs as *sources* and, where a
tensor derived from them meets a tensor with a layout (the *meeting* operation), recovers each
example's share of the gradient:

- an elementwise operation that broadcasts the batch-free operand along the batch (``x + pos``,
  ``scores + bias``) runs with that operand expanded along the batch dimension; the gradient of the
  expanded operand is then per example, at no extra cost;
- any other operation (``torch.bmm`` of a repeated table, ``torch.cat``) is differentiated again at
  the backward, one example's part of the output-gradient at a time (batched with
  ``is_grads_batched``).

The per-example gradient of the meeting operand is taken back to the sources through the
batch-free operations between them (``torch.autograd.grad`` with ``is_grads_batched``). A source's
per-example output-gradients, summed over the examples, must equal the gradient autograd gives
its output; where they do not (a gradient reached it without passing the batch), the engine
raises rather than give a wrong number.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from .. import _torch, loop
from .link import EngineLink

__all__ = [
    "Layout",
    "UNKNOWN",
    "PACKED",
    "MIXED",
    "Tracker",
    "Source",
    "Aliases",
    "aliased",
    "note",
]


class Owners:
    """The example of each entry of a layout's dimension, one by one: ``rows[r]`` (int64,
    ``[entries]``) owns entry ``r``. Rows picked from the batch by an index (the tokens a
    mixture-of-experts layer routes to one expert, ``h[top_x]``; the unpadded tokens of a
    batch, ``h[mask]``) are laid out so: each still belongs to one example, but how many each
    example has, and where, is data. ``base``: the layout of the tensor they were picked from
    (where they are written back to, ``out.index_add_(0, top_x, y)``). Two are equal where
    their rows are."""

    __slots__ = ("rows", "base")

    def __init__(self, rows: Tensor, base: Layout | None = None) -> None:
        self.rows, self.base = rows, base

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
_REORDER = Layout(-4)
# operations that take a reordered batch with the order it was put in (a PackedSequence keeps
# its sorted_indices, and the RNN rules read them)
_TAKES_ORDER = {"_pack_padded_sequence"}
# a tensor whose entries depend on several examples at once (a reduction over the batch, a roll
# along it, a product of two examples): per-example gradients through it do not exist
MIXED = Layout(-3)


def _followed(lay: Layout | None) -> bool:
    return lay is not None and lay.dim >= 0


def batch_rows(t: Tensor, layout: Layout, batch: int) -> Tensor:
    """``t`` with its examples on a new leading dimension: ``[batch, ...]``, the layout's
    dimension keeping ``outer · inner`` entries (``outer`` before ``inner``). Not for rows
    picked by an index (:class:`Owners`: the examples have different numbers of rows)."""
    if layout.owners is not None:
        raise ValueError(
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


def owner_vector(layout: Layout, batch: int, device) -> Tensor:
    """``[size]`` (int64): the example that owns each entry of the layout's dimension."""
    if layout.owners is not None:
        return layout.owners.rows.to(device)
    index = torch.arange(layout.size(batch), device=device)
    return (index // layout.inner) % batch


def _owner_map(t: Tensor, layout: Layout, batch: int) -> Tensor:
    """The owner of every entry of ``t`` (laid out as ``layout``), as a tensor of ``t.dim()``
    dimensions of size 1 but the layout's (expand it to ``t.shape``)."""
    shape = [1] * t.dim()
    shape[layout.dim] = t.shape[layout.dim]
    return owner_vector(layout, batch, t.device).view(shape)


def _owned(dim: int, rows: Tensor, base: Layout | None, batch: int) -> Layout:
    """The layout of a dimension whose entry ``r`` belongs to example ``rows[r]``: ``base``
    (at ``dim``) where ``rows`` is its own (every row picked in place), else an
    :class:`Owners` layout."""
    rows = rows.reshape(-1).to(torch.int64)
    if (
        base is not None
        and base.owners is None
        and base.dim >= 0
        and base.size(batch) == rows.numel()
        and torch.equal(owner_vector(base, batch, rows.device), rows)
    ):
        return Layout(dim, base.outer, base.inner)
    if base is not None and base.owners is not None:
        base = base.owners.base
    return Layout(dim, owners=Owners(rows, base))


def _owner_dim(ow: Tensor, o: Tensor, base: Layout | None, batch: int) -> Layout | None:
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
    return _owned(best[0], best[1], base, batch)


# -- how operations move the batch -----------------------------------------------------------------

# A handler gets (args, kwargs, out, layout_of) and returns the layout of the operation's tensor
# outputs: one Layout for all of them, a list (one per tensor output, in order), or UNKNOWN.
Handler = Callable[[tuple, dict, Any, Callable[[Any], Layout | None]], Any]
_HANDLERS: dict[str, Handler] = {}


def _handles(*names: str):
    def decorate(fn: Handler) -> Handler:
        for n in names:
            _HANDLERS[n] = fn
        return fn

    return decorate


def _first_tensor(out: Any) -> Tensor | None:
    if isinstance(out, Tensor):
        return out
    if isinstance(out, list | tuple):
        for o in out:
            if isinstance(o, Tensor):
                return o
    return None


def _tensors(args: tuple, kwargs: dict) -> list[Tensor]:
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            found.append(a)
        elif type(a) in (list, tuple):
            found.extend(x for x in a if isinstance(x, Tensor))
    return found


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


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def _norm_dim(d: int, n: int) -> int:
    return d + n if d < 0 else d


_POINTWISE = """
    add sub mul div true_divide floor_divide remainder fmod pow float_power atan2 hypot
    copysign xlogy logaddexp logaddexp2 maximum minimum fmax fmin lerp addcmul addcdiv where
    masked_fill bitwise_and bitwise_or bitwise_xor bitwise_not logical_and logical_or
    logical_xor logical_not eq ne lt le gt ge equal isclose clamp clip clamp_min clamp_max
    neg negative abs absolute sign sgn exp exp2 expm1 log log2 log10 log1p sqrt rsqrt square
    reciprocal sin cos tan asin acos atan sinh cosh tanh asinh acosh atanh erf erfc erfinv
    sigmoid logit relu relu6 gelu silu mish elu selu celu leaky_relu rrelu hardtanh hardswish
    hardsigmoid hardshrink softshrink tanhshrink softplus softsign threshold logsigmoid
    log_sigmoid special_expit lgamma digamma sinc xlog1py heaviside deg2rad rad2deg i0
    prelu floor ceil round trunc frac isnan isinf isfinite isneginf isposinf nan_to_num
    dropout alpha_dropout feature_alpha_dropout dropout1d dropout2d dropout3d
    to type type_as float double half bfloat16 int long bool short char byte cpu cuda
    contiguous clone detach requires_grad_ pin_memory conj real imag positive polar complex
    angle conj_physical resolve_conj resolve_neg
    fill_ zero_ normal_ uniform_ bernoulli bernoulli_ exponential_ random_ copy_ set_
    masked_fill_ masked_scatter masked_scatter_ where_ clamp_ clip_ nan_to_num_
    __add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__
    __truediv__ __rtruediv__ __itruediv__ __div__ __rdiv__ __idiv__ __floordiv__
    __rfloordiv__ __ifloordiv__ __mod__ __rmod__ __imod__ __pow__ __rpow__ __ipow__
    __neg__ __pos__ __abs__ __invert__ __and__ __rand__ __iand__ __or__ __ror__ __ior__
    __xor__ __rxor__ __ixor__ __eq__ __ne__ __lt__ __le__ __gt__ __ge__ __lshift__
    __rshift__ new_tensor .data .real .imag
""".split()
# in-place forms: the name with a trailing underscore
_POINTWISE += [n + "_" for n in _POINTWISE if n.isidentifier() and not n.startswith("_")]
_POINTWISE_SET = frozenset(_POINTWISE)
# operations that make a batch-free tensor batch-sized, and those that then use it row by row
# along the batch (elementwise, concatenation along another dimension, batched matrix products)
_SPREADS = frozenset({"expand", "expand_as", "broadcast_to", "repeat"})
_COPIES = frozenset({"contiguous", "clone"})  # (the same values: an expansion stays one)
_ROWWISE = _POINTWISE_SET | {"cat", "concat", "concatenate", "bmm", "matmul", "__matmul__",
                              "baddbmm"}  # fmt: skip


@_handles(*_POINTWISE)
def _pointwise(args, kwargs, out, layout_of):
    """Broadcasting operations: a layout keeps its dimension counted from the right."""
    o = _first_tensor(out)
    if o is None:
        return None
    n, result = o.dim(), None
    for t in _tensors(args, kwargs):
        lay = layout_of(t)
        if lay is None:
            continue
        if lay is UNKNOWN:
            return UNKNOWN
        d = lay.dim + n - t.dim()
        if d < 0 or o.shape[d] != t.shape[lay.dim]:
            return UNKNOWN
        cand = lay.at(d)
        if result is None:
            result = cand
        elif result != cand:
            return MIXED  # two examples' entries combined
    return result


def _along(dims: Any, n: int) -> set[int] | None:
    """Normalized dims of a ``dim`` argument (``None``: all)."""
    if dims is None:
        return None
    if isinstance(dims, int):
        return {_norm_dim(dims, n)}
    return {_norm_dim(int(d), n) for d in dims}


def _single_input(args, kwargs, layout_of) -> tuple[Tensor, Layout] | tuple[None, None]:
    """The first tensor argument and its layout, if it is the only one with a layout."""
    found = None
    for t in _tensors(args, kwargs):
        lay = layout_of(t)
        if lay is not None:
            if found is not None:
                return None, None
            found = (t, lay)
    return found if found is not None else (None, None)


def _dim_op(default_dim: Any, pos: int = 1, name: str = "dim") -> Handler:
    """A shape-keeping operation along ``dim`` (softmax, cumsum, flip): the layout stays, unless
    it works along the batch dimension (it mixes the examples)."""

    def handler(args, kwargs, out, layout_of):
        t, lay = _single_input(args, kwargs, layout_of)
        if t is None or lay is UNKNOWN:
            return UNKNOWN
        dims = _along(_arg(args, kwargs, pos, name, default_dim), t.dim())
        if dims is None or lay.dim in dims:
            return MIXED
        return lay

    return handler


for _n in ("softmax", "log_softmax", "softmin", "cumsum", "cumprod", "logcumsumexp",
           "cummax", "cummin", "sort", "argsort", "glu", "topk", "kthvalue", "msort"):  # fmt: skip
    _HANDLERS[_n] = _dim_op(-1 if _n in ("sort", "argsort", "glu", "topk", "kthvalue") else None)
_HANDLERS["topk"] = _dim_op(-1, pos=2)
_HANDLERS["kthvalue"] = _dim_op(-1, pos=2)
_HANDLERS["normalize"] = _dim_op(1, pos=2)
_HANDLERS["flip"] = _dim_op(None, name="dims")
_HANDLERS["roll"] = _dim_op(None, pos=2, name="dims")
_HANDLERS["diff"] = _dim_op(-1, pos=2)


_REDUCTIONS = """sum mean nansum nanmean prod amax amin max min std var std_mean var_mean
    logsumexp all any argmax argmin median nanmedian mode count_nonzero norm vector_norm
    aminmax""".split()


@_handles(*_REDUCTIONS)
def _reduction(args, kwargs, out, layout_of):
    t, lay = _single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN:
        return UNKNOWN
    n = t.dim()
    dim = kwargs.get("dim", kwargs.get("axis"))
    if dim is None:
        # positional: norm(input, p, dim), vector_norm(x, ord, dim); else (input, dim)
        for a in args[1:]:
            if (
                isinstance(a, int)
                and not isinstance(a, bool)
                or (isinstance(a, list | tuple) and a and all(isinstance(x, int) for x in a))
            ):
                dim = a
                break
    dims = _along(dim, n)
    if dims is None or lay.dim in dims:
        return MIXED  # a reduction over the examples
    keepdim = kwargs.get("keepdim", False) or any(a is True for a in args[2:])
    if keepdim:
        return lay
    return lay.at(lay.dim - sum(1 for d in dims if d < lay.dim))


@_handles("max", "min")
def _max_min(args, kwargs, out, layout_of):
    """``max(a, b)`` and ``min(a, b)`` of two tensors are elementwise (``torch.maximum``, as
    XGLM clamps its attention scores with a 0-d tensor); with a ``dim``, or none, a reduction."""
    if isinstance(_arg(args, kwargs, 1, "other"), Tensor):
        return _pointwise(args, kwargs, out, layout_of)
    return _reduction(args, kwargs, out, layout_of)


def _reshaped(lay: Layout, before: Sequence[int], after: Sequence[int], batch: int) -> Layout:
    """The layout of a tensor of shape ``before`` viewed as ``after`` (row-major)."""
    inner = lay.inner * math.prod(before[lay.dim + 1 :])
    block = inner * batch
    for e in range(len(after)):  # the outermost dimension that holds the batch whole
        post = math.prod(after[e + 1 :])
        if post > inner:
            continue
        if inner % post == 0 and (after[e] * post) % block == 0:
            return Layout(e, after[e] * post // block, inner // post)
    return UNKNOWN


def _reshaped_rows(lay: Layout, before: Sequence[int], after: Sequence[int], batch: int) -> Layout:
    """:func:`_reshaped` for rows picked by an index (:class:`Owners`): the dimension that
    holds them kept whole (``[1, n, F]`` to ``[n, F]``, ``[n, H * D]`` to ``[n, H, D]``), or
    merged with what follows it (``[n, F]`` to ``[n * F]``); else mixed."""
    d, rows = lay.dim, lay.owners.rows
    outer, inner = math.prod(before[:d]), math.prod(before[d + 1 :])
    for e in range(len(after)):
        post = math.prod(after[e + 1 :])
        if math.prod(after[:e]) != outer or after[e] * post != rows.numel() * inner:
            continue
        if post == 0 or inner % post:
            continue
        times = inner // post
        return _owned(e, rows.repeat_interleave(times) if times > 1 else rows,
                      lay.owners.base, batch)  # fmt: skip
    return MIXED


class _NeedsBatch:
    """A handler that needs the batch size (reshapes): called with it bound."""

    def __init__(self, fn) -> None:
        self.fn = fn


def _reshape_like(args, kwargs, out, layout_of, batch):
    t, lay = _single_input(args, kwargs, layout_of)
    o = _first_tensor(out)
    if t is None or lay is UNKNOWN or o is None:
        return UNKNOWN
    if o.shape == t.shape:
        return lay
    if lay.owners is not None:
        return _reshaped_rows(lay, t.shape, o.shape, batch)
    found = _reshaped(lay, t.shape, o.shape, batch)
    # (no dimension holds each example's entries together: a row of the result has entries of
    # several examples, as h.t().reshape(B, F) or rows regrouped by view(2, B, F) give)
    return MIXED if found is UNKNOWN and lay.dim >= 0 else found


for _n in ("view", "reshape", "view_as", "reshape_as", "flatten", "unflatten", "ravel",
           "squeeze", "unsqueeze", "atleast_1d", "atleast_2d", "atleast_3d", "squeeze_",
           "unsqueeze_", "resize_", "view_copy", "reshape_copy"):  # fmt: skip
    _HANDLERS[_n] = _NeedsBatch(_reshape_like)


@_handles("repeat_interleave")
def _repeat_interleave(args, kwargs, out, layout_of):
    """``x.repeat_interleave(k, dim)``: along the layout's dimension each entry is repeated
    ``k`` times in place, so every example's entries stay together (``inner`` times ``k``);
    along another dimension the layout stays. Per-entry counts (a tensor), or no ``dim`` (the
    input flattened): not followed."""
    t, lay = _single_input(args, kwargs, layout_of)
    repeats, dim = _arg(args, kwargs, 1, "repeats"), _arg(args, kwargs, 2, "dim")
    if t is None or lay is UNKNOWN or dim is None or not isinstance(repeats, int):
        return UNKNOWN
    if _norm_dim(int(dim), t.dim()) != lay.dim:
        return lay
    return Layout(lay.dim, lay.outer, lay.inner * repeats)


@_handles("expand", "expand_as", "broadcast_to", "expand_copy")
def _expand(args, kwargs, out, layout_of):
    t, lay = _single_input(args, kwargs, layout_of)
    o = _first_tensor(out)
    if t is None or lay is UNKNOWN or o is None:
        return UNKNOWN
    d = lay.dim + o.dim() - t.dim()
    return lay.at(d) if o.shape[d] == t.shape[lay.dim] else UNKNOWN


@_handles("repeat", "tile")
def _repeat(args, kwargs, out, layout_of):
    t, lay = _single_input(args, kwargs, layout_of)
    o = _first_tensor(out)
    if t is None or lay is UNKNOWN or o is None:
        return UNKNOWN
    d = lay.dim + o.dim() - t.dim()
    times = o.shape[d] // max(t.shape[lay.dim], 1)
    return Layout(d, lay.outer * times, lay.inner)


@_handles("permute")
def _permute(args, kwargs, out, layout_of):
    t, lay = _single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN:
        return UNKNOWN
    dims = args[1:] if len(args) > 1 else kwargs.get("dims")
    if len(dims) == 1 and isinstance(dims[0], list | tuple):
        dims = dims[0]
    order = [_norm_dim(int(d), t.dim()) for d in dims]
    return lay.at(order.index(lay.dim))


@_handles("transpose", "swapaxes", "swapdims", "transpose_", "swapaxes_", "swapdims_")
def _transpose(args, kwargs, out, layout_of):
    t, lay = _single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN:
        return UNKNOWN
    n = t.dim()
    d0 = _norm_dim(int(_arg(args, kwargs, 1, "dim0")), n)
    d1 = _norm_dim(int(_arg(args, kwargs, 2, "dim1")), n)
    return lay.at({d0: d1, d1: d0}.get(lay.dim, lay.dim))


@_handles("t", "t_", ".T", ".H")
def _t(args, kwargs, out, layout_of):
    """``t()`` of a 2-d tensor swaps its dimensions; ``.T`` of an n-d one reverses them."""
    t, lay = _single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN:
        return UNKNOWN
    return lay.at(t.dim() - 1 - lay.dim) if t.dim() >= 2 else lay


@_handles(".mT", ".mH", "adjoint")
def _mt(args, kwargs, out, layout_of):
    t, lay = _single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN:
        return UNKNOWN
    n = t.dim()
    return lay.at({n - 1: n - 2, n - 2: n - 1}.get(lay.dim, lay.dim))


@_handles("movedim", "moveaxis")
def _movedim(args, kwargs, out, layout_of):
    t, lay = _single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN:
        return UNKNOWN
    n = t.dim()
    src = _arg(args, kwargs, 1, "source")
    dst = _arg(args, kwargs, 2, "destination")
    src = [src] if isinstance(src, int) else list(src)
    dst = [dst] if isinstance(dst, int) else list(dst)
    src = [_norm_dim(s, n) for s in src]
    dst = [_norm_dim(d, n) for d in dst]
    order = [None] * n
    for s, d in zip(src, dst):
        order[d] = s
    rest = iter(d for d in range(n) if d not in src)
    order = [next(rest) if o is None else o for o in order]
    return lay.at(order.index(lay.dim))


@_handles("diagonal", "diagonal_copy")
def _diagonal(args, kwargs, out, layout_of):
    """``x.diagonal(offset, dim1, dim2)``: the two dimensions go, the diagonal comes last."""
    t, lay = _single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN:
        return UNKNOWN
    n = t.dim()
    d1 = _norm_dim(int(_arg(args, kwargs, 2, "dim1", 0)), n)
    d2 = _norm_dim(int(_arg(args, kwargs, 3, "dim2", 1)), n)
    if lay.dim in (d1, d2):
        return MIXED  # (the examples' entries paired with another dimension's)
    return lay.at(lay.dim - (d1 < lay.dim) - (d2 < lay.dim))


@_handles("narrow", "select", "unfold", "narrow_copy", "select_copy")
def _select(args, kwargs, out, layout_of):
    t, lay = _single_input(args, kwargs, layout_of)
    o = _first_tensor(out)
    if t is None or lay is UNKNOWN or o is None:
        return UNKNOWN
    n = t.dim()
    dim = _arg(args, kwargs, 1, "dim", None)
    if dim is None:  # (Tensor.unfold's keyword)
        dim = kwargs.get("dimension", 0)
    dim = _norm_dim(int(dim), n)
    if dim == lay.dim:
        return MIXED  # (some examples picked out of the batch)
    if o.dim() == n - 1:  # select removes the dimension
        return lay.at(lay.dim - (dim < lay.dim))
    return lay


@_handles("im2col", "col2im")
def _patches(args, kwargs, out, layout_of):
    """``F.unfold`` / ``F.fold``: ``[N, C, *spatial]`` to and from ``[N, C·k, L]``, each
    example's own along dimension 0 (also folded with others there)."""
    t, lay = _single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN or lay.dim != 0:
        return UNKNOWN
    return lay


@_handles("tril", "triu", "tril_", "triu_", "diag_embed", "matrix_exp", "inverse",
          "cholesky", "det", "logdet", "slogdet", "trace")  # fmt: skip
def _matrices(args, kwargs, out, layout_of):
    """Operations on the last two dimensions: a layout among the leading ones stays."""
    t, lay = _single_input(args, kwargs, layout_of)
    o = _first_tensor(out)
    if t is None or lay is UNKNOWN or o is None or lay.dim >= t.dim() - 2:
        return UNKNOWN
    return lay.at(lay.dim + o.dim() - t.dim())


@_handles("fft_fft", "fft_ifft", "fft_rfft", "fft_irfft", "fft_hfft", "fft_ihfft")
def _fft(args, kwargs, out, layout_of):
    """A Fourier transform along one dimension (``dim``, the last by default): along the
    batch it mixes the examples; along another, the layout stays (an FFT convolution along
    the sequence, as Hyena's)."""
    t, lay = _single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN:
        return UNKNOWN
    dim = _arg(args, kwargs, 2, "dim", -1)
    return MIXED if _norm_dim(int(dim), t.dim()) == lay.dim else lay


def _fft_along(default: tuple[int, ...] | None) -> Handler:
    """A Fourier transform along several dimensions (``dim``; by default the last two for the
    2-d ones, the last ``len(s)`` or all for the n-d ones, ``default=None``)."""

    def handler(args, kwargs, out, layout_of):
        t, lay = _single_input(args, kwargs, layout_of)
        if t is None or lay is UNKNOWN:
            return UNKNOWN
        dim, s = _arg(args, kwargs, 2, "dim", default), _arg(args, kwargs, 1, "s")
        if dim is None:
            n = len(s) if s is not None else t.dim()
            dims = list(range(t.dim() - n, t.dim()))
        else:
            items = dim if isinstance(dim, list | tuple) else [dim]
            dims = [_norm_dim(int(d), t.dim()) for d in items]
        return MIXED if lay.dim in dims else lay

    return handler


for _n in ("fft_fft2", "fft_ifft2", "fft_rfft2", "fft_irfft2"):
    _HANDLERS[_n] = _fft_along((-2, -1))
for _n in ("fft_fftn", "fft_ifftn", "fft_rfftn", "fft_irfftn"):
    _HANDLERS[_n] = _fft_along(None)


@_handles("view_as_complex", "view_as_real")
def _complex_view(args, kwargs, out, layout_of):
    """``view_as_complex`` drops a last dimension of 2, ``view_as_real`` adds one (rotary
    embeddings as complex products): a layout before it stays."""
    t, lay = _single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN or lay.dim >= t.dim() - 1:
        return UNKNOWN
    return lay


@_handles("linalg_solve_triangular", "linalg_solve", "cholesky_solve", "triangular_solve")
def _solves(args, kwargs, out, layout_of):
    """Batched solves of two operands (``[..., n, n]`` and ``[..., n, k]``): a layout among the
    leading dimensions of each, the same in both (or one operand without examples), stays."""
    ts = [a for a in args[:2] if isinstance(a, Tensor)]
    o = _first_tensor(out)
    lays = {layout_of(t) for t in ts} - {None}
    if len(ts) != 2 or o is None or len(lays) != 1:
        return UNKNOWN
    (lay,) = lays
    if lay is UNKNOWN or ts[0].dim() != ts[1].dim() or lay.dim >= ts[0].dim() - 2:
        return UNKNOWN
    return lay


def _blocks(lay: Layout, size: int, start: int, stop: int, step: int) -> Layout | None:
    """The layout of entries ``start:stop:step`` of a dimension of ``size`` entries laid out as
    ``lay``: all of them, or whole blocks of the ``outer`` copies of the batch (the halves of
    ``cat([x1, x2])``); ``None`` where the slice picks some examples."""
    if step == 1 and start == 0 and stop >= size:
        return lay
    block = size // lay.outer
    if step != 1 or lay.outer == 1 or start % block or stop % block or stop <= start:
        return None
    return Layout(lay.dim, (stop - start) // block, lay.inner)


@_handles("split", "chunk", "tensor_split", "split_with_sizes", "unsafe_split", "hsplit",
          "vsplit", "unsafe_chunk")  # fmt: skip
def _split(args, kwargs, out, layout_of):
    t, lay = _single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN:
        return UNKNOWN
    dim = _norm_dim(int(_arg(args, kwargs, 2, "dim", 0)), t.dim())
    if dim != lay.dim:
        return lay
    found, start = [], 0
    for o in _out_tensors(out):
        n = o.shape[dim]
        found.append(_blocks(lay, t.shape[dim], start, start + n, 1) or MIXED)
        start += n
    return found


@_handles("unbind")
def _unbind(args, kwargs, out, layout_of):
    t, lay = _single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN:
        return UNKNOWN
    dim = _norm_dim(int(_arg(args, kwargs, 1, "dim", 0)), t.dim())
    return MIXED if dim == lay.dim else lay.at(lay.dim - (dim < lay.dim))


@_handles("cat", "concat", "concatenate")
def _cat(args, kwargs, out, layout_of):
    tensors = list(_arg(args, kwargs, 0, "tensors"))
    o = _first_tensor(out)
    if o is None:
        return UNKNOWN
    dim = _norm_dim(int(_arg(args, kwargs, 1, "dim", 0)), o.dim())
    parts = [t for t in tensors if isinstance(t, Tensor) and t.numel() > 0]  # (empty: no rows)
    lays = [layout_of(t) for t in parts]
    known = [x for x in lays if x is not None]
    firm = [x for x in known if x is not UNKNOWN]
    if not firm or (UNKNOWN in known and dim != firm[0].dim):
        return UNKNOWN
    if dim != known[0].dim:
        return known[0] if all(x == known[0] for x in known) else UNKNOWN
    if any(x.owners is not None for x in firm):
        if len(firm) != len(lays) or any(x.dim != dim for x in firm):
            return MIXED
        return _cat_rows(dim, parts, firm)
    if len(firm) != len(lays) or any(x.inner != known[0].inner for x in known):
        # rows that are not the examples put among them along their dimension: which row is
        # whose is lost, and what is computed across the rows next (a shift, a sum, attention
        # over them) could not be told from what keeps the examples apart
        return MIXED
    return Layout(dim, sum(x.outer for x in known), known[0].inner)


def _cat_rows(dim: int, parts: list[Tensor], lays: list[Layout]) -> Layout:
    """Rows picked by an index concatenated along their dimension (each expert's outputs in
    turn): their owners in turn. Another layout among them (the whole batch) is mixed: its
    number of examples is not known here."""
    if any(x.owners is None for x in lays):
        return MIXED
    rows = torch.cat([x.owners.rows for x in lays])
    bases = {x.owners.base for x in lays}
    return Layout(dim, owners=Owners(rows, bases.pop() if len(bases) == 1 else None))


@_handles("stack", "hstack", "vstack", "dstack", "column_stack")
def _stack(args, kwargs, out, layout_of):
    tensors = list(_arg(args, kwargs, 0, "tensors"))
    o = _first_tensor(out)
    lays = [layout_of(t) for t in tensors if isinstance(t, Tensor)]
    known = [x for x in lays if x is not None]
    if o is None or not known or UNKNOWN in known or any(x != known[0] for x in known):
        return UNKNOWN
    first = next(t for t in tensors if isinstance(t, Tensor))
    if o.dim() == first.dim():  # hstack / vstack of >= 2-d: a cat
        return _cat((tensors, 0 if o.shape[0] != first.shape[0] else 1), {}, out, layout_of)
    dim = _norm_dim(int(_arg(args, kwargs, 1, "dim", 0)), o.dim())
    lay = known[0]
    return lay.at(lay.dim + (dim <= lay.dim))


def _mm_side(lay: Layout, n: int, is_left: bool, out_n: int, other_n: int) -> Layout | None:
    """Where a layout of one operand of ``matmul`` goes (``None``: it is contracted)."""
    if is_left:
        if n == 1 or lay.dim == n - 1:
            return None
        if lay.dim == n - 2:
            return lay.at(out_n - (2 if other_n >= 2 else 1))
    else:
        if n == 1 or lay.dim == n - 2:
            return None
        if lay.dim == n - 1:
            return lay.at(out_n - 1)
    lead = n - 2  # batch dimensions of this operand, right-aligned with the output's
    out_lead = out_n - (2 if (n >= 2 and other_n >= 2) else 1)
    return lay.at(lay.dim + out_lead - lead)


@_handles("matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "mv", "dot", "inner", "vdot")
def _matmul(args, kwargs, out, layout_of):
    a, b = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "other")
    if not isinstance(b, Tensor):
        b = _arg(args, kwargs, 1, "mat2")
    o = _first_tensor(out)
    if o is None or not isinstance(a, Tensor) or not isinstance(b, Tensor):
        return UNKNOWN
    found = None
    for t, left, other in ((a, True, b), (b, False, a)):
        lay = layout_of(t)
        if lay is None:
            continue
        if lay is UNKNOWN:
            return UNKNOWN
        where = _mm_side(lay, t.dim(), left, o.dim(), other.dim())
        if where is None or found not in (None, where):
            return MIXED  # the examples contracted, or two examples' rows multiplied
        found = where
    return found


@_handles("cdist")
def _cdist(args, kwargs, out, layout_of):
    """``cdist(x1 [*, P, M], x2 [*, R, M]) -> [*, P, R]``: as ``x1 @ x2.mT`` (the features
    ``M`` contracted; the rows of ``x1`` on ``P``, those of ``x2`` on ``R``)."""
    a, b = _arg(args, kwargs, 0, "x1"), _arg(args, kwargs, 1, "x2")
    o = _first_tensor(out)
    if o is None or not isinstance(a, Tensor) or not isinstance(b, Tensor):
        return UNKNOWN
    found = None
    for t, row in ((a, o.dim() - 2), (b, o.dim() - 1)):
        lay = layout_of(t)
        if lay is None:
            continue
        if lay is UNKNOWN:
            return UNKNOWN
        n = t.dim()
        if lay.dim == n - 1:
            return MIXED  # the examples among the features a distance sums over
        where = lay.at(row if lay.dim == n - 2 else lay.dim + (o.dim() - 2) - (n - 2))
        if found not in (None, where):
            return MIXED  # two examples' rows compared
        found = where
    return found


@_handles("baddbmm", "addmm", "addmv", "addbmm", "addr")
def _addmm(args, kwargs, out, layout_of):
    """``input + m1 @ m2``: the product's layout, which the added input must share."""
    o = _first_tensor(out)
    m1, m2 = _arg(args, kwargs, 1, "mat1"), _arg(args, kwargs, 2, "mat2")
    if not (isinstance(m1, Tensor) and isinstance(m2, Tensor)):
        m1, m2 = _arg(args, kwargs, 1, "batch1"), _arg(args, kwargs, 2, "batch2")
    if o is None or not (isinstance(m1, Tensor) and isinstance(m2, Tensor)):
        return UNKNOWN
    prod = _matmul((m1, m2), {}, o, layout_of)
    base = _arg(args, kwargs, 0, "input")
    lay = layout_of(base) if isinstance(base, Tensor) else None
    if lay is not None:
        added = _pointwise((base,), {}, o, layout_of)
        if prod is not None and added != prod:
            return UNKNOWN
        return added
    return prod


@_handles("linear", "bilinear")
def _linear(args, kwargs, out, layout_of):
    x = args[0]
    o = _first_tensor(out)
    w = _arg(args, kwargs, 1, "weight")
    if o is None or (isinstance(w, Tensor) and layout_of(w) is not None):
        return UNKNOWN
    lay = layout_of(x)
    if lay is None or lay is UNKNOWN or lay.dim == x.dim() - 1:
        return UNKNOWN
    return lay


@_handles("einsum")
def _einsum(args, kwargs, out, layout_of):
    eq = args[0]
    ops = args[1:]
    if len(ops) == 1 and isinstance(ops[0], list | tuple):
        ops = tuple(ops[0])
    o = _first_tensor(out)
    if not isinstance(eq, str) or o is None:
        return UNKNOWN
    eq = eq.replace(" ", "")
    if "->" in eq:
        lhs, rhs = eq.split("->")
    else:
        lhs = eq
        letters = [c for c in lhs if c.isalpha()]
        rhs = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
        if "..." in lhs:
            rhs = "..." + rhs
    terms = lhs.split(",")
    if len(terms) != len(ops):
        return UNKNOWN
    ell = max((t.dim() - len(term.replace("...", "")) for term, t in zip(terms, ops)
               if "..." in term), default=0)  # fmt: skip

    def expand(term: str, ndim: int) -> list[str]:
        if "..." not in term:
            return list(term)
        head, tail = term.split("...")
        k = ndim - len(head) - len(tail)
        return list(head) + [f"_{ell - k + j}" for j in range(k)] + list(tail)

    out_letters = expand(rhs, o.dim()) if "..." in rhs else list(rhs)
    if "..." in rhs:
        head, tail = rhs.split("...")
        out_letters = list(head) + [f"_{j}" for j in range(ell)] + list(tail)
    found = None
    for term, t in zip(terms, ops):
        lay = layout_of(t) if isinstance(t, Tensor) else None
        if lay is None:
            continue
        if lay is UNKNOWN:
            return UNKNOWN
        letter = expand(term, t.dim())[lay.dim]
        if letter not in out_letters:
            return MIXED  # summed over the examples
        where = lay.at(out_letters.index(letter))
        if found not in (None, where):
            return MIXED
        found = where
    return found


@_handles("scaled_dot_product_attention")
def _sdpa(args, kwargs, out, layout_of):
    o = _first_tensor(out)
    if o is None:
        return UNKNOWN
    found = None
    names = ("query", "key", "value", "attn_mask")
    for i, name in enumerate(names):
        t = _arg(args, kwargs, i, name)
        lay = layout_of(t) if isinstance(t, Tensor) else None
        if lay is None:
            continue
        if lay is UNKNOWN or lay.dim >= t.dim() - 2:
            return UNKNOWN
        where = lay.at(lay.dim + o.dim() - t.dim())
        if found not in (None, where):
            return UNKNOWN
        found = where
    return found


@_handles("multi_head_attention_forward")
def _mha(args, kwargs, out, layout_of):
    """``nn.MultiheadAttention``'s functional form: sequence-first ``[L, N, E]`` (or unbatched
    ``[L, E]``); the output ``[L, N, E]`` and the weights ``[N, (H,) L, S]``."""
    q = args[0]
    lay = layout_of(q)
    if lay is None or lay is UNKNOWN or q.dim() != 3 or lay.dim != 1:
        return UNKNOWN
    outs = [o for o in (out if isinstance(out, tuple | list) else (out,)) if isinstance(o, Tensor)]
    return [lay] + [lay.at(0) for _ in outs[1:]]


@_handles("lstm", "gru", "rnn_tanh", "rnn_relu")
def _rnn(args, kwargs, out, layout_of):
    """torch's fused recurrent layers: padded ``(input, hx, params, ..., batch_first)`` or
    packed ``(data, batch_sizes, hx, params, ...)``; outputs ``(output, h_n[, c_n])``, the
    states ``[layers * dirs, batch, hidden]``."""
    x = args[0]
    lay = layout_of(x)
    outs = _out_tensors(out)
    if lay is None or not outs:
        return UNKNOWN
    packed = isinstance(args[1], Tensor) and isinstance(args[3], list | tuple)
    if packed:
        if lay is not PACKED:
            return UNKNOWN
        # the states are in the packed order (longest first), which the module's forward
        # undoes with an index_select along the batch where the sequences were not sorted
        return [PACKED] + [UNKNOWN for _ in outs[1:]]
    batch_first = bool(args[-1])
    if lay is UNKNOWN or lay.dim != (0 if batch_first else 1):
        return UNKNOWN
    # (each row of the batch dimension runs alone: the examples stay where they were, also
    # folded with other rows, [batch * rows, time, features], as in Sequencer2d)
    return [lay] + [lay.at(1) for _ in outs[1:]]


@_handles("_pack_padded_sequence")
def _pack(args, kwargs, out, layout_of):
    x, batch_first = args[0], bool(_arg(args, kwargs, 2, "batch_first"))
    lay = layout_of(x)
    if lay is None or lay is UNKNOWN or lay.dim != (0 if batch_first else 1) or not lay.plain:
        return UNKNOWN
    return [PACKED, None]


@_handles("_pad_packed_sequence")
def _unpack(args, kwargs, out, layout_of):
    if layout_of(args[0]) is not PACKED:
        return UNKNOWN
    return [Layout(0 if bool(_arg(args, kwargs, 2, "batch_first")) else 1), None]


# operations that work on each example's own slice along dimension 0 ([N, C, ...]): convolutions,
# pooling, resampling, per-example normalizations
_SAMPLEWISE = """conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d
    convolution max_pool1d max_pool2d max_pool3d max_pool1d_with_indices max_pool2d_with_indices
    max_pool3d_with_indices avg_pool1d avg_pool2d avg_pool3d adaptive_avg_pool1d
    adaptive_avg_pool2d adaptive_avg_pool3d adaptive_max_pool1d adaptive_max_pool2d
    adaptive_max_pool3d adaptive_max_pool1d_with_indices adaptive_max_pool2d_with_indices
    lp_pool1d lp_pool2d lp_pool3d interpolate upsample upsample_nearest upsample_bilinear
    pixel_shuffle pixel_unshuffle channel_shuffle native_channel_shuffle group_norm
    instance_norm local_response_norm grid_sample affine_grid fractional_max_pool2d
    fractional_max_pool3d max_unpool1d max_unpool2d max_unpool3d embedding_bag""".split()


@_handles(*_SAMPLEWISE)
def _samplewise(args, kwargs, out, layout_of):
    found = None
    for t in _tensors(args, kwargs):
        lay = layout_of(t)
        if lay is None:
            continue
        if lay is UNKNOWN or lay.dim != 0:
            return UNKNOWN
        if found not in (None, lay):
            return UNKNOWN
        found = lay
    return found


@_handles("pad")
def _pad(args, kwargs, out, layout_of):
    """``F.pad`` pads the last ``len(pad) // 2`` dimensions."""
    t, lay = _single_input(args, kwargs, layout_of)
    if t is None or lay is UNKNOWN:
        return UNKNOWN
    pad = list(_arg(args, kwargs, 1, "pad"))
    j = t.dim() - 1 - lay.dim  # (pad lists the last dimension first)
    if 2 * j + 1 < len(pad) and (pad[2 * j] or pad[2 * j + 1]):
        return MIXED  # the batch dimension itself padded (or cropped): as cat with other rows
    return lay


@_handles("batch_norm")
def _batch_norm(args, kwargs, out, layout_of):
    training = _arg(args, kwargs, 5, "training", False)
    return MIXED if training else _samplewise(args[:1], {}, out, layout_of)


@_handles("layer_norm", "rms_norm")
def _layer_norm(args, kwargs, out, layout_of):
    x = args[0]
    shape = _arg(args, kwargs, 1, "normalized_shape")
    lay = layout_of(x)
    for w in _tensors(args[2:], {k: v for k, v in kwargs.items() if k != "input"}):
        if layout_of(w) is not None:
            return UNKNOWN
    if lay is None or lay is UNKNOWN:
        return UNKNOWN
    k = 1 if isinstance(shape, int) else len(shape)
    return UNKNOWN if lay.dim >= x.dim() - k else lay


@_handles("embedding", "one_hot")
def _embedding(args, kwargs, out, layout_of):
    idx = args[0]
    lay = layout_of(idx)
    w = _arg(args, kwargs, 1, "weight")
    if isinstance(w, Tensor) and layout_of(w) is not None:
        return UNKNOWN
    return UNKNOWN if lay is None or lay is UNKNOWN else lay


@_handles("cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
          "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div",
          "poisson_nll_loss", "gaussian_nll_loss", "soft_margin_loss", "multilabel_margin_loss",
          "multilabel_soft_margin_loss", "hinge_embedding_loss", "margin_ranking_loss",
          "cosine_embedding_loss", "triplet_margin_loss", "multi_margin_loss")  # fmt: skip
def _loss(args, kwargs, out, layout_of):
    o = _first_tensor(out)
    reduction = kwargs.get("reduction", "mean")
    if o is None or reduction != "none":
        return MIXED  # a reduction over the batch: the loss itself
    found = None
    for t in _tensors(args, kwargs):
        lay = layout_of(t)
        if lay is None:
            continue
        if lay is UNKNOWN or lay.dim != 0:
            return UNKNOWN
        found = lay
    return found


@_handles("gather", "take_along_dim", "index_select", "scatter", "scatter_add", "scatter_reduce",
          "index_add", "index_copy", "index_fill", "index_put", "gather_", "scatter_",
          "scatter_add_", "scatter_reduce_", "index_add_", "index_copy_", "index_fill_",
          "index_put_", "masked_select")  # fmt: skip
def _indexed(args, kwargs, out, layout_of):
    """Indexing along one dimension: a layout of the indexed tensor stays if the indexing is
    along another dimension (and any index or source tensor shares it)."""
    x = args[0]
    o = _first_tensor(out)
    if o is None or not isinstance(x, Tensor):
        return UNKNOWN
    n = x.dim()
    dim = _arg(args, kwargs, 1, "dim")
    if not isinstance(dim, int):  # take_along_dim(x, idx, dim), index_put(x, indices, v)
        dim = _arg(args, kwargs, 2, "dim")
    found = None
    for t in _tensors(args, kwargs):
        lay = layout_of(t)
        if lay is None:
            continue
        if lay is UNKNOWN or t.dim() != n:
            return UNKNOWN
        if isinstance(dim, int) and lay.dim == _norm_dim(dim, n):
            if _permutes(args, kwargs, x.shape[lay.dim]) and t is x:
                return _REORDER  # (the examples reordered, as sorting for packing does)
            return MIXED  # gathered or scattered along the examples
        if found not in (None, lay):
            return UNKNOWN
        found = lay
    if found is None or o.dim() != n:
        return UNKNOWN
    return found


def _is_permutation(index: Any, size: int) -> bool:
    """Whether ``index`` is a 1-D integer tensor holding ``0, ..., size - 1`` in some order."""
    if not isinstance(index, Tensor) or index.dim() != 1 or index.numel() != size:
        return False
    if index.dtype in (torch.bool, torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return False
    return torch.equal(index.sort().values, torch.arange(size, device=index.device))


def _permutes(args, kwargs, size: int) -> bool:
    """``index_select(x, dim, index)`` (three arguments: nothing written) with ``index`` a
    permutation of the batch."""
    if len(args) + len(kwargs) != 3:
        return False
    return _is_permutation(_arg(args, kwargs, 2, "index"), size)


def _getitem(args, kwargs, out, layout_of, batch):
    x, index = args[0], args[1]
    lay = layout_of(x)
    o = _first_tensor(out)
    if o is None:
        return UNKNOWN
    if lay is None:  # a batch-free tensor indexed by one with a layout (a lookup)
        items = index if isinstance(index, tuple) else (index,)
        found = [layout_of(i) for i in items if isinstance(i, Tensor) and layout_of(i)]
        if len(found) == 1 and len(items) == 1 and found[0].dim >= 0:
            mask = items[0]
            if mask.dtype == torch.bool:  # (the rows a mask with examples picks: theirs)
                with torch.no_grad():
                    rows = _owner_map(mask, found[0], batch).expand(mask.shape)[mask]
                return _owned(0, rows, found[0], batch) if o.dim() >= 1 else UNKNOWN
            return found[0]
        return UNKNOWN
    if lay.dim < 0:
        return lay
    where = _index_map(x, lay, index, o)
    if where is None and lay.dim == 0 and lay.plain:
        where = _masked_rows(x, index, o)
    if (
        where is None
        and lay.dim == 0
        and lay.plain
        and _is_permutation(index[0] if isinstance(index, tuple) and index else index, x.shape[0])
    ):
        return _REORDER  # (the examples reordered: x[perm])
    if where is None:
        where = _picked(x, lay, index, o, batch)
    return where if where is not None else MIXED


_HANDLERS["__getitem__"] = _NeedsBatch(_getitem)


def _index_items(index: Any) -> list | None:
    """The items of an index of integer or boolean tensors, ints, slices, ``None`` and
    ``...`` (``None``: another kind of index)."""
    items = list(index) if isinstance(index, tuple) else [index]
    for i in items:
        if isinstance(i, Tensor):
            if i.is_floating_point() or i.is_complex() or i.requires_grad:
                return None
        elif not (i is None or i is Ellipsis or isinstance(i, int | slice)):
            return None
    return items


def _tensor_dims(items: list, n: int) -> set[int]:
    """The dimensions of a tensor of ``n`` dimensions that the index tensors among ``items``
    index."""
    widths = [i.dim() if isinstance(i, Tensor) and i.dtype == torch.bool else
              0 if i is None or i is Ellipsis else 1 for i in items]  # fmt: skip
    found, src = set(), 0
    for i, w in zip(items, widths):
        if i is Ellipsis:
            src += n - sum(widths)
        elif isinstance(i, Tensor):
            found |= set(range(src, src + w))
        src += w
    return found


def _picked(x: Tensor, lay: Layout, index: Any, o: Tensor, batch: int) -> Layout | None:
    """``x[index]`` where the index picks entries along the examples' dimension (rows routed to
    an expert, ``h[top_x]``, ``h[None, top_x]``, ``h[mask]``): where every row of the result
    belongs to one example, an :class:`Owners` layout saying which (``None`` otherwise)."""
    items = _index_items(index)
    if items is None or not any(isinstance(i, Tensor) for i in items):
        return None
    if lay.owners is None and lay.inner == 1 and _tensor_dims(items, x.dim()) == {lay.dim}:
        return None  # (whole examples picked: the batch itself changed, x[[1, 0, 0]])
    while items and (
        items[-1] is Ellipsis or isinstance(items[-1], slice) and items[-1] == slice(None)
    ):
        items.pop()  # (trailing dimensions taken whole: their owners are not formed)
    shape = list(x.shape)
    if Ellipsis not in items:
        covered = sum(i.dim() if isinstance(i, Tensor) and i.dtype == torch.bool else
                      0 if i is None else 1 for i in items)  # fmt: skip
        shape[covered:] = [1 if j != lay.dim else n for j, n in
                           enumerate(x.shape[covered:], covered)]  # fmt: skip
    with torch.no_grad():
        owners = _owner_map(x, lay, batch).expand(shape)[tuple(items)]
    return _owner_dim(owners, o, lay, batch)


def _masked_rows(x: Tensor, index: Any, o: Tensor) -> Layout | None:
    """``x[mask]`` with a boolean ``mask`` over the leading dimensions of ``x``, the batch first
    (the end-of-sequence tokens of each example, the patches not masked out): the rows it picks
    come example by example; where every example has as many, they are ``Layout(0, inner=k)``
    (``None`` otherwise: some examples have more rows than others)."""
    if (
        isinstance(index, tuple)
        and index
        and all(i is Ellipsis or i == slice(None) for i in index[1:])
    ):  # (x[mask, :], x[mask, ...])
        index = index[0]
    if not (isinstance(index, Tensor) and index.dtype == torch.bool and index.dim() >= 1):
        return None
    if tuple(index.shape) != tuple(x.shape[: index.dim()]) or o.dim() < 1:
        return None
    counts = index.reshape(index.shape[0], -1).sum(1)
    batch = index.shape[0]
    if batch == 0 or o.shape[0] != int(counts.sum()) or not bool((counts == counts[0]).all()):
        return None
    k = int(counts[0])
    return Layout(0, inner=k) if k else None


def _setitem(args, kwargs, out, layout_of, batch):
    """``x[index] = value``: ``x`` (the output) keeps its layout where it has one; a batch-free
    ``x`` that takes the examples (a buffer filled with shifted tokens, ``new_zeros`` then
    ``x[:, 1:] = ids[:, :-1]``) takes the layout that ``x[index]`` would give ``value``'s."""
    x, index, value = args[0], args[1], args[2]
    lay, vlay = layout_of(x), layout_of(value) if isinstance(value, Tensor) else None
    if vlay is None:
        return lay  # (batch-free values written: x keeps its layout, or has none)
    if MIXED in (lay, vlay):
        return MIXED
    if lay is not None and lay.dim < 0 or vlay.dim < 0:
        return UNKNOWN
    if vlay.owners is not None or lay is not None and lay.owners is not None:
        return _set_rows(x, lay, index, value, vlay, batch)
    with torch.no_grad():
        view = x.detach()[index]  # (the shape x[index] has: a view, or a small copy)
    want = vlay.at(vlay.dim + view.dim() - value.dim())
    if lay is not None:  # each example's values written into its own rows, or not
        return lay if _index_map(x, lay, index, view) == want else MIXED
    for d in range(x.dim()):
        cand = Layout(d, vlay.outer, vlay.inner)
        if x.shape[d] == cand.size(batch) and _index_map(x, cand, index, view) == want:
            return cand
    return UNKNOWN


_HANDLERS["__setitem__"] = _NeedsBatch(_setitem)


def _row_candidates(x: Tensor, lay: Layout | None, vlay: Layout, batch: int) -> list[Layout]:
    """Where the examples may be in ``x`` after rows laid out as ``vlay`` are written into it:
    its own layout, or, for a tensor that did not depend on them (``zeros``), the layout the
    rows were picked from, or the plain batch, on any dimension of the right size."""
    if lay is not None:
        return [lay]
    base = vlay.owners.base if vlay.owners is not None else vlay
    found = []
    for d in range(x.dim()):
        for c in (base, Layout(0)):
            if c is None or c.owners is not None or c.dim < 0:
                continue
            cand = Layout(d, c.outer, c.inner)
            if x.shape[d] == cand.size(batch) and cand not in found:
                found.append(cand)
    return found


def _set_rows(x: Tensor, lay: Layout | None, index: Any, value: Tensor, vlay: Layout,
              batch: int) -> Layout:  # fmt: skip
    """``x[index] = value`` (or ``index_put_``) where ``value`` or ``x`` holds rows picked by an
    index (tokens put back after their expert): the layout of ``x`` if every entry written
    belongs to the example that owns its place there, else mixed."""
    items = _index_items(index)
    if items is None:
        return MIXED
    with torch.no_grad():
        view = x.detach()[tuple(items)]
        vo = _owner_map(value, vlay, batch)
        if vo.dim() > view.dim():
            return MIXED
        vo = vo.reshape((1,) * (view.dim() - vo.dim()) + tuple(vo.shape))
        for cand in _row_candidates(x, lay, vlay, batch):
            got = _owner_map(x, cand, batch).expand(x.shape)[tuple(items)]
            if got.dim() == vo.dim() and bool((got == vo).all()):
                return cand
    return MIXED


def _indexed_rows(kind: str, args, kwargs, out, layout_of, batch) -> Layout | None:
    """Indexing along the dimension of rows that are parts of examples (tokens): picked
    (``index_select``, ``gather``: an :class:`Owners` layout), or written back (``index_add_``,
    ``index_copy_``, ``scatter_add_``, ``index_put_``: the layout of the tensor written into,
    where each row lands in its own example's place, else mixed). ``None``: not such an
    operation (the other handlers decide)."""
    x = args[0]
    o = _first_tensor(out)
    if not isinstance(x, Tensor) or o is None:
        return None
    xlay = layout_of(x)
    if kind == "put":
        indices = _arg(args, kwargs, 1, "indices")
        values = _arg(args, kwargs, 2, "values")
        vlay = layout_of(values) if isinstance(values, Tensor) else None
        if vlay is None or vlay.dim < 0 or xlay is not None and xlay.dim < 0:
            return None
        if vlay.owners is None and (xlay is None or xlay.owners is None):
            return None
        return _set_rows(x, xlay, tuple(indices), values, vlay, batch)
    dim = _arg(args, kwargs, 1, "dim")
    index = _arg(args, kwargs, 2, "index")
    if not isinstance(dim, int) or not isinstance(index, Tensor) or index.is_floating_point():
        return None
    dim = _norm_dim(dim, x.dim())
    if kind == "select" and xlay is None:
        # a table that does not depend on the examples looked up by an index that does (NLLB's
        # sinusoidal positions, weights.index_select(0, position_ids.view(-1))): its rows
        ilay = layout_of(index)
        if ilay is None or ilay.dim != 0 or index.dim() != 1:
            return None
        return ilay.at(dim)
    if kind in ("select", "gather"):
        if xlay is None or xlay.dim != dim:
            return None
        if xlay.owners is None and xlay.inner == 1:
            return None  # (whole examples picked: the batch itself changed)
        with torch.no_grad():
            if kind == "select":
                rows = owner_vector(xlay, batch, x.device)[index.reshape(-1)]
                return _owned(dim, rows, xlay, batch)
            owners = _owner_map(x, xlay, batch).expand(x.shape).gather(dim, index)
            return _owner_dim(owners, o, xlay, batch) or MIXED
    src = _arg(args, kwargs, 3, "source" if kind == "add" else "src")
    if src is None and kind == "scatter":
        src = kwargs.get("value")
    slay = layout_of(src) if isinstance(src, Tensor) else None
    if slay is None or slay.dim < 0 or xlay is not None and xlay.dim < 0:
        return None
    if slay.dim != dim and slay.owners is None and (xlay is None or xlay.owners is None):
        return None
    if slay.dim != dim or src.dim() != x.dim():
        return MIXED
    with torch.no_grad():
        if kind == "add":
            vo = owner_vector(slay, batch, x.device)
            for cand in _row_candidates(x, xlay, slay, batch):
                if cand.dim != dim:
                    continue
                got = owner_vector(cand, batch, x.device)[index.reshape(-1)]
                if got.shape == vo.shape and torch.equal(got, vo):
                    return cand
            return MIXED
        part = tuple(slice(0, k) for k in index.shape)
        vo = _owner_map(src, slay, batch).expand(src.shape)[part]
        for cand in _row_candidates(x, xlay, slay, batch):
            got = _owner_map(x, cand, batch).expand(x.shape).gather(dim, index)
            if torch.equal(got, vo):
                return cand
    return MIXED


def _rows_then(kind: str) -> _NeedsBatch:
    def handler(args, kwargs, out, layout_of, batch):
        found = _indexed_rows(kind, args, kwargs, out, layout_of, batch)
        return _indexed(args, kwargs, out, layout_of) if found is None else found

    return _NeedsBatch(handler)


for _n, _kind in (("index_select", "select"), ("gather", "gather"), ("index_add", "add"),
                  ("index_add_", "add"), ("index_copy", "add"), ("index_copy_", "add"),
                  ("scatter", "scatter"), ("scatter_", "scatter"), ("scatter_add", "scatter"),
                  ("scatter_add_", "scatter"), ("index_put", "put"),
                  ("index_put_", "put")):  # fmt: skip
    _HANDLERS[_n] = _rows_then(_kind)

# the operations that follow rows picked by an index (:class:`Owners`): every other one makes
# them mixed (see output_layout)
_OWNER_AWARE = (
    (_POINTWISE_SET - {"masked_scatter", "masked_scatter_", "set_"})
    | set(_REDUCTIONS)
    | {
        "softmax",
        "log_softmax",
        "softmin",
        "cumsum",
        "cumprod",
        "logcumsumexp",
        "cummax",
        "cummin",
        "sort",
        "argsort",
        "topk",
        "kthvalue",
        "msort",
        "glu",
        "normalize",
        "flip",
        "roll",
        "diff",
        "max",
        "min",
        "view",
        "reshape",
        "view_as",
        "reshape_as",
        "flatten",
        "unflatten",
        "ravel",
        "squeeze",
        "unsqueeze",
        "squeeze_",
        "unsqueeze_",
        "expand",
        "expand_as",
        "broadcast_to",
        "permute",
        "transpose",
        "swapaxes",
        "swapdims",
        "t",
        ".T",
        ".mT",
        "movedim",
        "moveaxis",
        "matmul",
        "__matmul__",
        "__rmatmul__",
        "mm",
        "bmm",
        "baddbmm",
        "addmm",
        "linear",
        "__getitem__",
        "__setitem__",
        "unbind",
        "stack",
        "split",
        "chunk",
        "split_with_sizes",
        "cat",
        "concat",
        "concatenate",
        "layer_norm",
        "rms_norm",
        "embedding",
        "one_hot",
        "index_fill",
        "index_fill_",
        "masked_select",
    }  # fmt: skip
    | set(_HANDLERS)
    & {
        "index_select",
        "gather",
        "index_add",
        "index_add_",
        "index_copy",
        "index_copy_",
        "scatter",
        "scatter_",
        "scatter_add",
        "scatter_add_",
        "index_put",
        "index_put_",
    }  # fmt: skip
)


def _arange_dim(t: Tensor, size: int) -> int | None:
    """The dimension of index tensor ``t`` along which it is ``0, 1, ..., size - 1`` (every
    other dimension of size 1): an index that keeps each example in its place."""
    if t.dtype in (torch.bool, torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return None
    dims = [d for d, n in enumerate(t.shape) if n != 1]
    if len(dims) != 1 or t.shape[dims[0]] != size:
        return (
            None
            if not (size == 1 and t.numel() == 1 and int(t.reshape(())) == 0)
            else (t.dim() - 1 if t.dim() else None)
        )
    flat = t.reshape(-1)
    if not torch.equal(flat, torch.arange(size, device=t.device, dtype=flat.dtype)):
        return None
    return dims[0]


def _index_map(x: Tensor, lay: Layout, index: Any, o: Tensor) -> Layout | None:
    """Where ``x[index]`` puts the batch dimension of ``x`` (``None``: the index picks or
    reorders examples)."""
    items = list(index) if isinstance(index, tuple) else [index]
    n = x.dim()

    def width(i) -> int:
        if i is None or i is Ellipsis or isinstance(i, bool):
            return 0
        if isinstance(i, Tensor) and i.dtype == torch.bool:
            return i.dim()
        return 1

    rest = n - sum(width(i) for i in items)
    if any(i is Ellipsis for i in items):
        k = next(j for j, i in enumerate(items) if i is Ellipsis)
        items[k : k + 1] = [slice(None)] * rest
    else:
        items += [slice(None)] * rest
    is_adv = [isinstance(i, Tensor | list) and not isinstance(i, bool) for i in items]
    adv = [j for j, a in enumerate(is_adv) if a]
    tensors = [torch.as_tensor(items[j]) for j in adv]
    if adv:
        if any(t.dtype == torch.bool for t in tensors):
            # a mask: keeps a layout before it (as one dimension of the masked entries)
            first = adv[0]
            src = sum(width(items[j]) for j in range(first))
            if lay.dim < src and all(
                not isinstance(items[j], int) and items[j] is not None for j in range(first)
            ):  # fmt: skip
                return _index_map(x, lay, tuple(items[:first]), o)
            return None
        try:
            bshape = torch.broadcast_shapes(*(t.shape for t in tensors))
        except RuntimeError:
            return None
        adjacent = adv == list(range(adv[0], adv[-1] + 1))
    src = dst = 0
    block_done = False
    for j, i in enumerate(items):
        if is_adv[j]:
            t = tensors[adv.index(j)]
            start = dst if adjacent else 0
            if src == lay.dim:  # (an arange over the whole dimension: every entry in place,
                k = _arange_dim(t, x.shape[src])  # also where heads are folded in: Informer)
                if k is None:
                    return None
                return lay.at(start + k + len(bshape) - t.dim())
            src += 1
            if not block_done:
                block_done = True
                if adjacent:
                    dst += len(bshape)
            continue
        if i is None or isinstance(i, bool):
            dst += 1
        elif isinstance(i, int):
            if src == lay.dim:
                return None
            src += 1
        elif isinstance(i, slice):
            if src == lay.dim:
                shift = len(bshape) if adv and not adjacent else 0
                blocks = _blocks(lay, x.shape[src], *i.indices(x.shape[src]))
                return None if blocks is None else blocks.at(dst + shift)
            src += 1
            dst += 1
        else:
            return None
    return None


# operations whose outputs never depend on the examples (creation, shape queries)
_FREE = """arange range zeros ones full empty eye linspace logspace rand randn randint
    randperm tensor as_tensor from_numpy zeros_like ones_like empty_like full_like rand_like
    randn_like randint_like new_zeros new_ones new_empty new_full tril_indices triu_indices
    empty_strided scalar_tensor""".split()
_HANDLERS.update({n: (lambda *a: None) for n in _FREE})

# what reads a tensor's metadata, not its values: a parameter handed to one of these is not used
# (by a hook reading ``p.dtype`` inside a call, or the engine reading ``p.requires_grad``)
_METADATA = frozenset(
    """.requires_grad .dtype .device .shape .ndim .is_leaf .grad_fn .layout .names .is_cuda
    .is_sparse .is_quantized .is_meta .itemsize .nbytes dim size numel nelement
    element_size is_floating_point is_complex is_contiguous stride storage_offset data_ptr
    get_device""".split()
)

# operations that read only the dtype and device, or the shape, of their tensor arguments after
# the first (``w.to(x)``, ``w.type_as(x)``, ``w.view_as(x)``): their result holds the first
# argument's values alone, so a batch in the others is not the result's
_LIKE = frozenset({"to", "type_as", "view_as", "reshape_as", "expand_as"})


def _data_args(name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments whose values ``name`` computes with: for :data:`_LIKE`, the first alone."""
    if name in _LIKE and args and isinstance(args[0], Tensor):
        return args[:1], {k: v for k, v in kwargs.items() if not isinstance(v, Tensor)}
    return args, kwargs


def output_layout(name: str, args: tuple, kwargs: dict, out: Any, layout_of, batch: int):
    """The layout(s) of ``out``, the result of the torch function ``name`` on ``args``, some of
    which have layouts (``layout_of``). Rows picked by an index (:class:`Owners`) are followed
    only through the operations that know them (:data:`_OWNER_AWARE`), and never lost: where
    one of these cannot say where they went, its result is mixed (refused where it is used),
    never of unknown layout (which a rule would read as the batch). (An index or mask computed
    from them, which selects only, may be of unknown layout.)"""
    lays = [lay for t in _tensors(args, kwargs) if (lay := layout_of(t)) is not None]
    if any(lay.owners is not None for lay in lays):
        lost = MIXED if any(map(_carries, _out_tensors(out))) else UNKNOWN
        if name not in _OWNER_AWARE:
            return lost
        found = _output_layout(name, args, kwargs, out, layout_of, batch)
        if found is UNKNOWN or (isinstance(found, list) and UNKNOWN in found):
            return lost
        return found
    return _output_layout(name, args, kwargs, out, layout_of, batch)


def _output_layout(name: str, args: tuple, kwargs: dict, out: Any, layout_of, batch: int):
    handler = _HANDLERS.get(name)
    if handler is None:
        return UNKNOWN
    try:
        return _handle(handler, args, kwargs, out, layout_of, batch)
    except Exception:
        pass
    moved = _torch.positional(name, args, kwargs)  # (F.linear(input=x, weight=w))
    if moved[0] is not args:
        try:
            return _handle(handler, *moved, out, layout_of, batch)
        except Exception:
            pass
    return UNKNOWN  # an argument form the handler does not know: say nothing of the layout


def _handle(handler, args: tuple, kwargs: dict, out: Any, layout_of, batch: int):
    if isinstance(handler, _NeedsBatch):
        return handler.fn(args, kwargs, out, layout_of, batch)
    return handler(args, kwargs, out, layout_of)


# -- sources: batch-free tensors whose per-example gradients are wanted ------------------------------


@dataclass(eq=False)
class Source:
    """A batch-free tensor whose per-example output-gradients are collected: the output of a
    batch-free hooked call, or a parameter used outside its module's call. ``grads`` holds, per
    running backward (graph task), ``[batch, *shape]``: each example's part of the gradient of
    its tensor, summed over the meetings seen so far. It holds nothing of the autograd graph
    (the meetings hold its tensor's gradient edge), so a hook may keep it."""

    name: str
    shape: torch.Size
    grads: dict[int, Tensor] = field(default_factory=dict)
    uses: list = field(default_factory=list)  # (kind, info) of every operation that used it
    problem: str | None = None  # why its per-example gradients cannot be formed
    aligned: Layout | None = None  # every use took it row by row with the batch: its layout
    needs_fallback: bool = False  # soft: a use only its module's fallback can handle
    discarded: bool = False  # soft: its module's fallback took it over


_TRAILING_UNDERSCORE = re.compile(r"^[a-z][a-z0-9_]*_$")


def _is_inplace(name: str) -> bool:
    return (
        name == "__setitem__"
        or bool(_TRAILING_UNDERSCORE.match(name))
        or (name.startswith("__i") and name.endswith("__") and name not in ("__invert__",))
    )


# elementwise operations through which a batch-free operand may be expanded along the batch
_EXPANDABLE = frozenset(
    """add sub mul div true_divide addcmul addcdiv lerp where masked_fill maximum minimum pow
    atan2 hypot fmod remainder clamp float_power xlogy logaddexp copysign
    __add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__
    __truediv__ __rtruediv__ __itruediv__ __pow__ __rpow__ add_ sub_ mul_ div_ addcmul_
    addcdiv_ lerp_ masked_fill_ clamp_ pow_""".split()
)


def _name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property: Tensor.T, .mT, .data
        owner = getattr(func, "__self__", None)
        return "." + getattr(owner, "__name__", "?")
    if name in _SPATIAL and getattr(func, "__module__", None) == "torch.nn.functional":
        return _SPATIAL[name]  # (F.unfold is not Tensor.unfold)
    return name


# functions of torch.nn.functional named as a Tensor method that does something else
_SPATIAL = {"unfold": "im2col", "fold": "col2im"}


@dataclass
class _Use:
    """What one hooked call's operations did: the ids of the parameters it covers that they
    used, and the ids of the hooked modules called inside it."""

    params: set[int] = field(default_factory=set)
    called: set[int] = field(default_factory=set)
    soft: bool = False
    sources: dict[int, Source] = field(default_factory=dict)  # soft: per parameter id
    functional: set[int] = field(default_factory=set)  # soft: captured as a function's call
    # soft: the operations of its own that mixed rows of the batch (see Tracker.absorb)
    mixing: set[str] = field(default_factory=set)
    mixed: bool = False  # soft: an operation of its own gave a tensor with mixed rows


def _unselected(name: str, args: tuple, layouts) -> set[int]:
    """``torch.where(cond, x, y)``: the ids of ``x`` or ``y`` where they mix the examples and
    ``cond`` takes none of their entries (Hugging Face's time-series mean scaler: a scale
    from the whole batch, used only for a series with no observation)."""
    if name != "where" or len(args) < 3:
        return set()
    cond, x, y = args[:3]
    if not isinstance(cond, Tensor) or cond.dtype != torch.bool:
        return set()
    found = set()
    if isinstance(x, Tensor) and layouts.get(x) is MIXED and not bool(cond.any()):
        found.add(id(x))
    if isinstance(y, Tensor) and layouts.get(y) is MIXED and bool(cond.all()):
        found.add(id(y))
    return found


def _carries(t: Tensor) -> bool:
    """Whether what ``t`` holds, computed across the examples, makes one example's result
    depend on another's: its gradient flows back, or its values are computed with (a batch mean
    of the data, a detached statistic). An index or mask is taken as selecting only."""
    return t.requires_grad or t.is_floating_point() or t.is_complex()


class Tracker(TorchFunctionMode):
    """Follows the batch through one forward of a hooked model (see the module docstring).

    ``batch``: the number of examples. ``params``: ``{id(p): (name, p)}`` of the parameters the
    hooks cover. ``engine``: the engine, told about what the forward does that it acts on
    (:class:`gradhooks.tracking.link.EngineLink`); ``None`` in tests of the layouts alone.
    """

    def __init__(
        self,
        batch: int,
        params: dict[int, tuple[str, Tensor]],
        engine: EngineLink | None = None,
    ):
        super().__init__()
        self.batch = batch
        self.params = params
        self.engine = engine
        self.layouts: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.taints: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> frozenset[Source]
        self.covered: list[
            frozenset[int]
        ] = []  # parameter ids of the calls running, innermost last
        self.used: list[_Use] = []  # per running call
        self.param_sources: dict[int, Source] = {}
        self.edges: dict[Source, Any] = {}  # each source's tensor's gradient edge
        self.spread: WeakIdKeyDictionary = WeakIdKeyDictionary()  # expanded -> (from, how)
        self.meetings: list[_Meeting] = []
        self.unmet: set[Source] = set()  # sources used in place, as they are, with the batch
        self.unknown: dict[str, None] = {}  # operations that lost the layout, for messages
        self.mixed: dict[str, None] = {}  # operations that mixed the examples, for messages
        # tensors whose rows along the batch are the examples in another order (x[perm]), with
        # the operation that reordered them
        self.reordered: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # tensors of unknown layout whose examples are presumed where they were (:meth:`_presume`)
        self.presumed: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # tensors every torch function gets in place of others, by the others' ids: the
        # detached parameters of a call whose rule gives their batch gradients itself
        self.aliases: dict[int, Tensor] = {}
        # the model's inputs taken as holding the examples by their size alone (not its first
        # input): an operation that would mix the examples only because of one of them, or of
        # what was computed from them alone, takes them as shared by every example instead
        # (:meth:`_without_candidates`)
        self.candidates: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # tensor -> the ids of the candidates its layout comes from, where it comes from them
        # alone (a candidate itself, a hooked call on one, what was computed from those)
        self.lineage: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # the hooked calls on such tensors alone, which become batch-free calls (their outputs
        # sources) where their candidates are taken as shared (:meth:`note_call`)
        self.pending: list[_Pending] = []
        # tensor -> the indices in ``pending`` of the calls it was computed from
        self.would: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # the ids of candidates already combined with the examples row by row, or met by a
        # parameter as batched: never taken as shared afterwards (the forward so far assumed
        # they held the examples)
        self.joined: set[int] = set()
        self.func: Any = None  # the torch function being followed (a meeting formed later)
        # tensors computed across the examples that carry no gradient and no values computed
        # with (indices, masks), with the operation that did (see _coupling)
        self.coupled: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # positions of rows that nonzero found in a tensor with examples (see _row_indices)
        self.row_index: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.off = 0

    # -- what the engine asks ---------------------------------------------------------------------

    def layout(self, t: Any) -> Layout | None:
        """``t``'s layout, or ``None`` where it does not depend on the examples."""
        if not isinstance(t, Tensor):
            return None
        return self.layouts.get(t)

    def sources_of(self, t: Any) -> frozenset[Source]:
        return self.taints.get(t, frozenset()) if isinstance(t, Tensor) else frozenset()

    def set_layout(self, t: Tensor, layout: Layout | None) -> None:
        if layout is None:
            self.layouts.pop(t, None)
        else:
            self.layouts[t] = layout

    def add_candidate(self, t: Tensor, layout: Layout) -> None:
        """``t``, an input of the model other than its first, is taken as holding the examples
        on ``layout`` by its size alone (:attr:`candidates`)."""
        self.set_layout(t, layout)
        self.candidates[t] = True
        self.lineage[t] = frozenset({id(t)})

    def note_call(self, inputs: list, outputs: list, shared: Callable[[list], list]) -> None:
        """A hooked call whose examples are where its rule reads them: where its inputs with
        examples come from candidates alone, it is kept, and ``shared(outputs)`` (which makes
        the call batch-free and returns its outputs' sources) is called where those candidates
        are taken as shared after all."""
        if not self.lineage:
            return
        found = [self.lineage.get(t) for t in inputs
                 if isinstance(t, Tensor) and self._layout_of(t) is not None]  # fmt: skip
        every = frozenset().union(*(f for f in found if f))
        if not every:
            return
        if None in found:  # (also the examples of the first input: batched for good)
            self.joined |= every
            return
        key = len(self.pending)
        outs = [o for o in outputs if isinstance(o, Tensor)]
        self.pending.append(_Pending(every, outs, shared))
        for o in outs:
            if self._layout_of(o) is not None:
                self.lineage[o] = every
            self.would[o] = frozenset({key})

    def carry(self, old: Tensor, new: Tensor) -> None:
        """``new`` replaces ``old``, a hooked call's output: its layout, sources and lineage."""
        self.set_layout(new, self.layout(old))
        self.taint(new, self.sources_of(old))
        if old in self.lineage:
            self.lineage[new] = self.lineage[old]
        if old in self.would:
            self.would[new] = self.would[old]
            for k in self.would[old]:
                outs = self.pending[k].outputs
                self.pending[k].outputs = [new if o is old else o for o in outs]

    def add_source(self, t: Tensor, source: Source) -> None:
        """``t`` (the output of a batch-free hooked call) is a source from now on."""
        self.edges[source] = torch.autograd.graph.get_gradient_edge(t)
        self.taint(t, frozenset({source}))

    def taint(self, t: Tensor, sources: frozenset[Source]) -> None:
        if sources:
            self.taints[t] = sources | self.taints.get(t, frozenset())

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The engine's own operations inside a forward are not the model's."""
        self.off += 1
        try:
            yield
        finally:
            self.off -= 1

    def enter_call(self, params: Sequence[Tensor], module: Any = None, soft: bool = False) -> None:
        """A hooked call starts; it covers ``params``: an operation inside it (and not inside
        an inner call that covers them) uses them as that call's own. ``soft`` (a module
        without a rule): its parameters' uses are still followed as direct uses, and its call
        takes over (the ``torch.func`` fallback) only those the tracker cannot handle."""
        for record in self.used:
            record.called.add(id(module))
        self.covered.append(frozenset(id(p) for p in params))
        self.used.append(_Use(soft=soft))

    def absorb(self, used: _Use, inputs: list, outputs: list) -> bool:
        """A call of a module without a rule (``used``, just left) whose own operations mixed
        rows of the batch: rows picked by a data-dependent index and put back (a
        mixture-of-experts layer routing each token), which the tracker cannot follow. Its
        ``torch.func`` fallback recomputes it one example at a time (checking that this
        reproduces its output, so a module that truly mixes the examples is an error there):
        its outputs are taken to hold the examples as its first input with examples does,
        where their shapes agree, and its parameters' uses go to the fallback. Returns whether
        it did."""
        if not used.mixing or not used.mixing <= _PICKS:
            return False  # (a reduction or product across the batch: truly mixed)
        if any(self._layout_of(t) is MIXED for t in inputs):
            return False  # (mixed before the call)
        first = next((lay for t in inputs if (lay := self.presumed_of(t)) is not None), None)
        if first is None or first.dim < 0:
            return False
        size = first.size(self.batch)
        lays = [self._layout_of(o) for o in outputs]
        if not any(lay is MIXED for lay in lays) or any(
            lay is MIXED and (o.dim() <= first.dim or o.shape[first.dim] != size)
            for o, lay in zip(outputs, lays)
        ):
            return False
        for o, lay in zip(outputs, lays):
            if lay is MIXED:
                self.layouts[o] = first
        for s in used.sources.values():
            s.needs_fallback = True
        return True

    def exit_call(self) -> _Use:
        """Leave the innermost call: which of its parameters its operations used, and which
        hooked modules it called."""
        self.covered.pop()
        return self.used.pop()

    # -- the mode ---------------------------------------------------------------------------------

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        if _ACTIVE and _ACTIVE[-1] is self:
            _ACTIVE.pop()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.aliases:
            args, kwargs = aliased(self.aliases, args, kwargs)
        if self.off:
            return func(*args, **kwargs)
        tensors = _tensors(args, kwargs)
        if not tensors:
            return func(*args, **kwargs)
        if len(tensors) > 1 and _name(func) in _LIKE:
            tensors = _tensors(*_data_args(_name(func), args, kwargs))
        layouts, sources, direct = [], set(), []
        metadata = None  # (asked once a parameter is among the arguments)
        for t in tensors:
            lay = self.layouts.get(t)
            if lay is not None:
                layouts.append((t, lay))
            s = self.taints.get(t)
            if s:
                sources |= s
            if id(t) in self.params:
                if metadata is None:
                    metadata = _name(func) in _METADATA
                if metadata:
                    continue  # (reading p.dtype or p.requires_grad is no use of its values)
                where = self._covering(id(t))
                if where is None:
                    direct.append(t)
                else:
                    self.used[where].params.add(id(t))
                    if self.used[where].soft:
                        direct.append(t)
        if not layouts and not sources and not direct:
            return func(*args, **kwargs)
        name = _name(func)
        if direct and name in _MAYBE_SAME and isinstance(args[0], Tensor):
            out = func(*args, **kwargs)
            if out is args[0]:
                return out  # (a parameter converted to what it is: no use of it, as module.to())
        self.off += 1
        try:
            if not sources and not direct:
                out = func(*args, **kwargs)
                self.func = func
                try:
                    self._propagate(name, args, kwargs, out)
                finally:
                    self.func = None
                return out
            if layouts:
                out = self._meeting(func, name, args, kwargs, tensors, direct)
                self._hold(direct, args, out)
                return out
            for p in direct:
                sources.add(self._param_source(p))
            if True:  # batch-free: the sources flow on
                out = func(*args, **kwargs)
                self._hold(direct, args, out)
                frozen = frozenset(sources)
                outs = _out_tensors(out)
                if not outs and _is_inplace(name) and isinstance(args[0], Tensor):
                    outs = [args[0]]  # (M[rows, cols] = weight: M derives from the weight now)
                for o in outs:
                    self.taint(o, frozen)
                if name in _SPREADS and isinstance(out, Tensor) and isinstance(args[0], Tensor):
                    self.spread[out] = (args[0], name)
                elif name in _COPIES and isinstance(out, Tensor) and args[0] in self.spread:
                    self.spread[out] = self.spread[args[0]]  # (MPNet: expand(...).contiguous())
                for s in sources:
                    s.uses.append(("free", name))
                return out
        finally:
            self.off -= 1

    def _covering(self, pid: int) -> int | None:
        for i in range(len(self.covered) - 1, -1, -1):
            if pid in self.covered[i]:
                return i
        return None

    def _hold(self, direct: list[Tensor], args: tuple, out: Any) -> None:
        """An operation used parameters directly (``direct``): their sources are tied to the
        autograd node of its output, so that they live as long as the graph through it (a
        problem found on the way is reported at the backward, never dropped with the tracker),
        and a backward that passes through it tells the engine that these parameters'
        gradients come from a forward the tracker followed (:meth:`EngineLink.direct_reached`)."""
        if not direct or self.engine is None:
            return
        outs = _out_tensors(out) or [a for a in args[:1] if isinstance(a, Tensor)]
        node = next((o.grad_fn for o in outs if o.grad_fn is not None), None)
        if node is None:
            return
        held = []
        for p in direct:
            s = self._found_source(p)
            if s is not None:
                held.append((id(p), s))
        if held:
            engine, unknown = self.engine, self.unknown
            node.register_prehook(
                lambda grad_outputs, held=tuple(held): engine.direct_reached(held, unknown)
            )

    def _found_source(self, p: Tensor) -> Source | None:
        """The source of ``p``'s direct uses made so far, if any (:meth:`_param_source`)."""
        where = self._covering(id(p))
        table = self.used[where].sources if where is not None else self.param_sources
        return table.get(id(p))

    def _param_source(self, p: Tensor) -> Source:
        """The source of ``p``'s direct uses: one per forward, or, inside a module without a
        rule that covers it (soft), one per call of that module."""
        where = self._covering(id(p))
        record = self.used[where] if where is not None else None
        table = record.sources if record is not None else self.param_sources
        s = table.get(id(p))
        if s is None:
            name, _ = self.params[id(p)]
            s = Source(name, p.shape)
            s.param = True  # type: ignore[attr-defined]
            s.soft = record is not None  # type: ignore[attr-defined]
            self.edges[s] = torch.autograd.graph.get_gradient_edge(p)
            table[id(p)] = s
            if self.engine is not None:
                self.engine.direct_source(s, p)
        return s

    def _layout_of(self, t: Any) -> Layout | None:
        return self.layouts.get(t) if isinstance(t, Tensor) else None

    def presumed_of(self, t: Any) -> Layout | None:
        """``t``'s layout, or, where it is unknown, where its examples are presumed."""
        lay = self._layout_of(t)
        return self.presumed.get(t, lay) if lay is UNKNOWN else lay

    def _propagate(self, name: str, args, kwargs, out) -> None:
        args, kwargs = _data_args(name, args, kwargs)
        outs = _out_tensors(out)
        if not outs and _is_inplace(name) and args and isinstance(args[0], Tensor):
            outs = [args[0]]  # (x[i] = v, x.add_(y): the first argument is the result)
        if not outs or name in _FREE:
            return  # (a new tensor: its values do not depend on the examples)
        ins = _tensors(args, kwargs)
        unselected = _unselected(name, args, self.layouts) | self._all_ones(name, ins)
        layout_of = self._layout_of
        if unselected:  # (a branch of torch.where that no entry takes: as if a constant)
            ins = [t for t in ins if id(t) not in unselected]

            def layout_of(t: Any) -> Layout | None:
                return None if id(t) in unselected else self._layout_of(t)

        inherited = any(self.layouts.get(t) is MIXED for t in ins)
        if inherited:
            result = MIXED
        else:
            result = output_layout(name, args, kwargs, out, layout_of, self.batch)
            if result is UNKNOWN:
                result = self._presume(name, args, kwargs, out, ins, outs)
        result = self._coupling(name, args, ins, outs, result)
        self._row_indices(name, args, ins, outs)
        reordered = next((self.reordered[t] for t in ins if t in self.reordered), None)
        if result is _REORDER:
            if reordered is None and any(o.requires_grad for o in outs):
                for o in outs:
                    self.reordered[o] = name
            result = UNKNOWN  # (reordered again: taken as put back in order)
        elif reordered is not None and name not in _TAKES_ORDER:
            ordered = [t for t in ins if t not in self.reordered and self._layout_of(t) is not
                       None and self._layout_of(t).dim >= 0]  # fmt: skip
            if ordered and any(o.requires_grad for o in outs):
                result = MIXED  # (rows of different examples combined: x[perm] + x)
                self.mixed.setdefault(reordered, None)
                inherited = True
            elif any(o.requires_grad for o in outs):
                for o in outs:
                    self.reordered[o] = reordered
        resolved = False
        if result is MIXED and not inherited and self.lineage:
            before = result
            result = self._without_candidates(name, args, kwargs, out, ins, result)
            resolved = result is not before
        if result is MIXED and self.batch == 1 and not inherited:
            # one example cannot mix with another: where two reshapes put its only entry on
            # different dimensions (heads folded in, sequence-first), take the first input's
            result = next((lay for t in ins if _followed(lay := self._layout_of(t))), UNKNOWN)
        if result is MIXED and not any(_carries(o) for o in outs) and not inherited:
            for o in outs:  # (an index or mask computed across the examples: see _coupling)
                self.coupled[o] = name
        if result is MIXED:
            if any(_carries(o) for o in outs):
                if not inherited and not any(k.startswith(f"{name} picking") for k in self.mixed):
                    self.mixed.setdefault(name, None)
                for o in outs:
                    self.layouts[o] = MIXED
                if self.used and self.used[-1].soft:
                    self.used[-1].mixed = True
                    if not inherited:
                        picked = any(
                            lay is not None and lay.owners is not None
                            for t in ins
                            if (lay := self._layout_of(t)) is not None
                        )
                        self.used[-1].mixing.add("__getitem__" if picked else name)
                return
            # an index or mask computed across the examples (which experts any token picked,
            # the longest sequence): it selects, and each row is still a constant of its
            # example's computation, where the rule's dimension reads it
            result = UNKNOWN
        if result is UNKNOWN or result is None:
            if name not in _HANDLERS:
                self.unknown[name] = None
            for o in outs:
                self.layouts[o] = UNKNOWN
            return
        if not isinstance(result, list):
            result = [result] * len(outs)
        for o, lay in zip(outs, result):
            if lay is None:
                continue
            if lay is MIXED:  # (one of several outputs: a chunk with some of the examples)
                if not _carries(o):
                    lay = UNKNOWN
                else:
                    self.mixed.setdefault(name, None)
            if lay.dim >= 0 and (o.dim() <= lay.dim or o.shape[lay.dim] != lay.size(self.batch)):
                lay = UNKNOWN  # (a handler's guess that the shapes contradict)
            self.layouts[o] = lay
        if resolved:
            self._meet_after(name, args, kwargs, out)
        elif self.lineage:
            self._inherit(ins, outs)

    def _inherit(self, ins: list, outs: list) -> None:
        """The lineage of an operation's outputs (:attr:`lineage`): its inputs' where every input
        with examples has one; an operation that combines such an input with other examples
        joins its candidates to the batch for good."""
        every, would, firm = frozenset(), frozenset(), False
        for t in ins:
            if self._layout_of(t) is None:
                continue
            found = self.lineage.get(t)
            if found is None:
                firm = True
                continue
            every |= found
            would |= self.would.get(t, frozenset())
        if not every:
            return
        if firm:
            self.joined |= every
            return
        for o in outs:
            if self._layout_of(o) is not None:
                self.lineage[o] = every
                if would:
                    self.would[o] = would

    def _all_ones(self, name: str, ins: list) -> set[int]:
        """The ids of the operands of a product that are a mask computed across the examples
        (:meth:`_coupling`) whose every entry is one: multiplying by it keeps every entry, as
        a constant would (NLLB-MoE's expert capacity where no token overflows it)."""
        if name not in _PRODUCTS:
            return set()
        return {
            id(t) for t in ins
            if t in self.coupled and not _carries(t) and bool((t == 1).all())
        }  # fmt: skip

    def _coupling(self, name: str, args, ins: list, outs: list, result: Any) -> Any:
        """Indices and masks computed across the examples (which tokens an expert keeps under
        a capacity counted over the whole batch, ``cumsum`` along it) are followed as
        *coupled*: what they select for one example depends on the others. Rows picked from
        the batch by one are refused (mixed: the per-example computation would pick other
        rows); one that picks along another dimension (which expert, from the experts any
        token chose) only selects, and its result is not coupled."""
        found = [self.coupled[t] for t in ins if t in self.coupled]
        if not found:
            return result
        lays = result if isinstance(result, list) else [result]
        picks = name in _PICKS and args and isinstance(args[0], Tensor)
        if picks:
            x_lay = self._layout_of(args[0])
            fresh = [
                lay for lay in lays
                if isinstance(lay, Layout) and lay.owners is not None
                and (x_lay is None or x_lay.owners is None or lay.owners != x_lay.owners)
            ]  # fmt: skip
            index_only = args[0] not in self.coupled
            if fresh and index_only:
                self.mixed.setdefault(
                    f"{name} picking rows by an index computed across the batch "
                    f"({', '.join(dict.fromkeys(found))}: an expert capacity counted over the "
                    "batch?)",
                    None,
                )
                return MIXED
            if index_only and all(isinstance(lay, Layout) and lay.dim >= 0 for lay in lays):
                return result  # (a coupled index along another dimension: selects only)
        for o in outs:
            self.coupled[o] = found[0]
        return result

    def _row_indices(self, name: str, args, ins: list, outs: list) -> None:
        """Follow the positions of rows that ``nonzero`` (``torch.where(mask)``) finds in a
        tensor with examples (the tokens routed to an expert): kept through reshapes,
        concatenation and arithmetic; a part of them taken by position (``tokens[:capacity]``,
        ``narrow``, ``split``) is decided across the batch (the first tokens of the batch, not
        of each example), so it is coupled (see :meth:`_coupling`)."""
        if name in ("nonzero", "argwhere") or name == "where" and len(args) == 1:
            if any(_followed(self._layout_of(t)) for t in ins):
                for o in outs:
                    if not o.is_floating_point():
                        self.row_index[o] = True
            return
        if not any(t in self.row_index for t in ins):
            return
        x = args[0] if args and isinstance(args[0], Tensor) else None
        if x is not None and x in self.row_index and name in _PART_OF:
            index = args[1] if name == "__getitem__" and len(args) > 1 else None
            items = index if isinstance(index, tuple) else (index,)
            # (a mask or index of the rows' own, weights[tokens] > 0.1, picks per row; one
            # that does not depend on them, arange(n) < capacity, by position)
            if name != "__getitem__" or not all(
                _followed(self._layout_of(i)) or i in self.row_index
                for i in items if isinstance(i, Tensor)
            ) or not any(isinstance(i, Tensor) for i in items):  # fmt: skip
                if any(o.numel() < x.numel() for o in outs):
                    for o in outs:
                        self.coupled[o] = f"{name} of the rows an index picked"
                    return
        if name in _KEEPS_ROWS_INDEX or name in _POINTWISE_SET or name == "__getitem__":
            for o in outs:
                if not o.is_floating_point():
                    self.row_index[o] = True

    def _without_candidates(self, name: str, args, kwargs, out, ins: list, result):
        """``result`` (mixed) of an operation on some of the model's inputs taken as batched
        by their size alone, or on what was computed from them alone (a mask ``[T, T]``, a
        memory bank ``[K, D]`` or the prototypes a hooked layer computed from it, as long as
        the batch is large): where taking those inputs as shared by every example instead
        gives a layout that keeps the examples apart, they are, from now on (the hooked calls
        on them become batch-free, their outputs sources: :meth:`_take_as_shared`), and that
        layout is the result. Not where the forward already combined them with the examples
        row by row (:attr:`joined`)."""
        found = [t for t in ins if t in self.lineage]
        if not found:
            return result
        cands = frozenset().union(*(self.lineage[t] for t in found))
        if cands & self.joined:
            return result
        calls = any(not p.done and p.lineage & cands for p in self.pending)
        if calls and (self.func is None or _name(self.func) != name):
            return result  # (hooked calls to make batch-free, and no meeting to form here)

        def layout_of(t: Any) -> Layout | None:
            if isinstance(t, Tensor) and self.lineage.get(t, frozenset()) & cands:
                return None
            return self._layout_of(t)

        alt = output_layout(name, args, kwargs, out, layout_of, self.batch)
        alts = alt if isinstance(alt, list) else [alt]
        if not alts or any(a is None or a is MIXED or a is UNKNOWN for a in alts):
            return result
        self._take_as_shared(cands)
        return alt

    def _take_as_shared(self, cands: frozenset[int]) -> None:
        """The candidates ``cands`` (ids) are shared by every example: what was computed from
        them alone has no layout, and the hooked calls on them are batch-free, their outputs
        sources that taint what was computed from them."""
        for t, found in list(self.lineage.items()):
            if found & cands:
                self.layouts.pop(t, None)
                del self.lineage[t]
        for t in list(self.candidates.keys()):
            if id(t) in cands:
                del self.candidates[t]
        made: dict[int, frozenset[Source]] = {}
        for k, p in enumerate(self.pending):
            if p.done or not p.lineage & cands:
                continue
            p.done = True
            made[k] = frozenset(s for s in p.shared(p.outputs) if s is not None)
        for t, keys in list(self.would.items()):
            srcs = frozenset().union(*(made.get(k, frozenset()) for k in keys))
            if srcs:
                self.taint(t, srcs)

    def _meet_after(self, name: str, args, kwargs, out) -> None:
        """The operation that took candidates as shared (:meth:`_without_candidates`) after it
        ran: where its inputs now carry sources, it is their meeting with the batch."""
        func = self.func
        tainted = [t for t in _tensors(args, kwargs) if self.taints.get(t) and t.requires_grad]
        if func is None or _name(func) != name or not tainted:
            return
        outs = _out_tensors(out)
        lays = [self.layouts.get(o) for o in outs]
        srcs = {t: self._sources(t) for t in tainted}
        if _is_inplace(name):  # (no meeting can run an in-place operation again)
            for s in set().union(*srcs.values()):
                s.problem = s.problem or f"the in-place '{name}' writes the batch into it"
            return
        self.meetings.append(_Meeting(self, func, name, args, kwargs, tainted, srcs, outs, lays))
        for s in set().union(*srcs.values()):
            s.uses.append(("meet", name))

    def _presume(self, name: str, args, kwargs, out, ins: list, outs: list) -> Layout:
        """Where the batch is not followed through an operation (one without a handler, or one
        taking a tensor of unknown layout), a hooked layer after it reads the examples from its
        rule's dimension, checking only the batch size. So that nothing after such an operation
        mixes the examples unseen, they are presumed where they were (an output as long as the
        batch on the input's batch dimension), and an operation that would mix them there (a
        reduction, shift or product along it) counts as mixing. This only ever adds refusals:
        a presumed layout is never handed to a rule."""

        def presumed_of(t: Any) -> Layout | None:
            lay = self._layout_of(t)
            return self.presumed.get(t, lay) if lay is UNKNOWN else lay

        # (an operation without a handler along the examples' dimension: across the batch)
        dims = _torch.dim_arguments(name, args, kwargs) if name not in _HANDLERS else []
        for t in ins if dims else ():
            lay, n = presumed_of(t), t.dim()
            if (
                lay is not None
                and lay.dim >= 0
                and any(-n <= d < n and _norm_dim(d, n) == lay.dim for d in dims)
            ):
                return MIXED
        guess = None
        if any(self._layout_of(t) is UNKNOWN for t in ins):
            again = output_layout(name, args, kwargs, out, presumed_of, self.batch)
            if again is MIXED:
                return MIXED
            if isinstance(again, Layout) and again.dim >= 0:
                guess = again
        if guess is None:
            firm = {lay for t in ins if (lay := presumed_of(t)) is not None and lay.dim >= 0}
            guess = next(iter(firm)) if len(firm) == 1 else None
        if guess is not None:
            for o in outs:
                if o.dim() > guess.dim and o.shape[guess.dim] == guess.size(self.batch):
                    self.presumed[o] = guess
        return UNKNOWN

    # -- meetings ---------------------------------------------------------------------------------

    def _meeting(self, func, name, args, kwargs, tensors, direct) -> Any:
        """An operation where tensors derived from sources meet tensors with a layout."""
        ids = {id(d) for d in direct}
        tainted = list({id(t): t for t in tensors if self.taints.get(t) or id(t) in ids}.values())
        for t in tensors if self.lineage else ():
            self.joined |= self.lineage.get(t, frozenset())  # (met as batched)
        if self.engine is not None and direct and not any(self.taints.get(t) for t in tensors):
            out = self.engine.functional_use(func, name, args, kwargs, direct, self)
            if out is not NotImplemented:
                for p in direct:  # (a module without a rule that covers it leaves it to this)
                    where = self._covering(id(p))
                    if where is not None:
                        self.used[where].functional.add(id(p))
                return out
        for p in direct:
            self._param_source(p)
        if any(not t.requires_grad for t in tainted):
            if not torch.is_grad_enabled():
                # (inside a custom autograd.Function's forward, whose own backward gives the
                # sources a gradient gradhooks cannot split by example, or under no_grad)
                out = func(*args, **kwargs)
                self._propagate(name, args, kwargs, out)
                why = (
                    f"'{name}' combines it with the batch where autograd records no graph "
                    "(inside a custom autograd.Function's forward, or under torch.no_grad), "
                    "so gradhooks cannot follow its gradient from there"
                )
                for t in tainted:
                    for s in self._sources(t):
                        s.problem = s.problem or why
                        if self.engine is not None:  # (no graph holds it: kept to be told)
                            self.engine.unheld(s)
                return out
            tainted = [t for t in tainted if t.requires_grad]  # (detached: no gradient back)
            if not tainted:
                out = func(*args, **kwargs)
                self._propagate(name, args, kwargs, out)
                return out
        fast = self._expanded(func, name, args, kwargs, tainted)
        if fast is None:
            fast = self._spread(func, name, args, kwargs, tainted)
        if fast is not None:
            return fast
        out = func(*args, **kwargs)
        self._propagate(name, args, kwargs, out)
        outs = [o for o in _out_tensors(out)]
        lays = [self.layouts.get(o) for o in outs]
        srcs = {t: self._sources(t) for t in tainted}
        soft = {s for ss in srcs.values() for s in ss if getattr(s, "soft", False)}
        for s in soft:  # (its module's fallback takes it over: cheaper than a masked backward)
            s.needs_fallback = True
        srcs = {t: ss - soft for t, ss in srcs.items()}
        tainted = [t for t in tainted if srcs[t]]
        if not tainted:
            return out
        if name in _POINTWISE_SET and all(o.dim() == 0 for o in outs):
            for s in set().union(*srcs.values()):  # a term added to the loss itself (weight
                s.uses.append(("loss", name))  # decay): no example's; not delivered
            return out
        followed = not any(lay is None or lay.dim < 0 for lay in lays)
        if followed and _is_inplace(name) and not any(args and t is args[0] for t in tainted):
            # added in place into the batch (TAPAS: embeddings += token_type_embeddings(ids)):
            # as the operation out of place where each source's output is used as it is, row
            # by row with the batch; else (no meeting can run an in-place operation again)
            # refused below
            aligned = self._aligned(name, args, kwargs, tainted, outs, lays)
            every = set().union(*(srcs[t] for t in tainted))
            if every <= set(aligned):
                for s in every:
                    s.uses.append(("aligned", aligned[s]))
                self.unmet |= every  # (no meeting holds them: finish still sees them)
                return out
        if not followed or _is_inplace(name):
            met = {*lays, *(self.layouts.get(t) for t in tensors)}
            if _is_inplace(name):
                why = f"the in-place '{name}' writes the batch into a tensor derived from it"
            elif PACKED in met:
                why = (
                    f"'{name}' combines it with the data of a PackedSequence (the examples' "
                    "time steps packed together), whose rows gradhooks follows only into the "
                    "recurrent layers it has rules for"
                )
            elif MIXED in met:
                why = (
                    f"'{name}' combines it with a tensor whose entries depend on several "
                    f"examples at once ({', '.join(self.mixed) or name}), so the examples' shares "
                    "of its gradient do not exist"
                )
            else:
                lost = ", ".join(self.unknown)
                why = f"'{name}' combines it with the batch in a way gradhooks cannot follow" + (
                    f" (the batch was lost before it, through {lost})" if lost else ""
                )
            for s in set().union(*srcs.values()):
                s.problem = s.problem or why
            return out
        srcs = {t: srcs[t] for t in tainted}
        meeting = _Meeting(self, func, name, args, kwargs, tainted, srcs, outs, lays)
        self.meetings.append(meeting)
        aligned = self._aligned(name, args, kwargs, tainted, outs, lays)
        for s in set().union(*srcs.values()):
            s.uses.append(("aligned", aligned[s]) if s in aligned else ("meet", name))
        return out

    def _aligned(self, name, args, kwargs, tainted, outs, lays) -> dict[Source, Layout]:
        """The sources that an elementwise operation uses as they are, row by row with the
        batch (a lookup of positions expanded to the batch before the layer, added to the
        batch): ``{source: where its output holds the examples}``."""
        if name not in _POINTWISE_SET or len(outs) != 1 or lays[0] is None:
            return {}
        out, lay = outs[0], lays[0]
        found = {}
        for t in tainted:
            srcs = self.taints.get(t, frozenset())
            j = lay.dim - (out.dim() - t.dim())
            if len(srcs) != 1 or j < 0 or t.shape[j] != out.shape[lay.dim]:
                continue
            (s,) = srcs
            if self.edges[s] == torch.autograd.graph.get_gradient_edge(t) and not hasattr(
                s, "param"
            ):
                found[s] = lay.at(j)
        return found

    def _sources(self, t: Tensor) -> frozenset[Source]:
        s = self.taints.get(t, frozenset())
        if id(t) in self.params:
            where = self._covering(id(t))
            if where is None:
                s = s | {self.param_sources[id(t)]}
            elif self.used[where].soft:
                s = s | {self.used[where].sources[id(t)]}
        return s

    def _expanded(self, func, name, args, kwargs, tainted) -> Any:
        """An elementwise meeting: run it with each batch-free operand expanded along the batch
        dimension of the result; the expanded operands' gradients are per example."""
        if name not in _EXPANDABLE or not tainted or _torch.saved_tensor_hooks_active():
            return None  # (checkpointed: the expanded operand would be saved in its place)
        others = [t for t in _tensors(args, kwargs) if self.layouts.get(t) is not None]
        if not others or any(self.layouts[t].dim < 0 for t in others):
            return None  # (unknown, packed or mixed: no batch dimension to expand along)
        if any(self.layouts[t].owners is not None for t in others):
            return None  # (rows picked by an index: the general meeting, by example masks)
        if _is_inplace(name) and any(args and t is args[0] for t in tainted):
            return None  # the batch written into a batch-free tensor
        try:
            shape = torch.broadcast_shapes(*(t.shape for t in _tensors(args, kwargs)))
        except RuntimeError:
            return None
        n = len(shape)
        lay = None
        for t in others:
            cand = self.layouts[t].at(self.layouts[t].dim + n - t.dim())
            if lay not in (None, cand):
                return None
            lay = cand
        size = lay.size(self.batch)
        if shape[lay.dim] != size:
            return None
        plan = []
        for t in tainted:
            j = lay.dim - (n - t.dim())
            if j >= 0 and t.shape[j] != 1:
                return None  # aligned with the batch row by row: the general path
            plan.append(t)
        swaps, hooks = {}, []
        for t in plan:
            v = t.reshape((1,) * (n - t.dim()) + tuple(t.shape))
            sizes = [-1] * n
            sizes[lay.dim] = size
            e = v.expand(sizes)
            swaps[id(t)] = e
            hooks.append((e, t, self._sources(t)))
        swap = lambda a: swaps.get(id(a), a) if isinstance(a, Tensor) else (  # noqa: E731
            type(a)(swaps.get(id(x), x) if isinstance(x, Tensor) else x for x in a)
            if type(a) in (list, tuple) else a
        )  # fmt: skip
        new_args = tuple(swap(a) for a in args)
        new_kwargs = {k: swap(v) for k, v in kwargs.items()}
        out = func(*new_args, **new_kwargs)
        self._propagate(name, new_args, new_kwargs, out)
        batch = self.batch
        for e, t, srcs in hooks:
            for s in srcs:
                s.uses.append(("expanded", name))
            t_shape, t_ref = t.shape, torch.autograd.graph.get_gradient_edge(t)
            srcs_list = tuple(srcs)
            edges = {s: self.edges[s] for s in srcs_list}
            engine = self.engine

            def hook(g, lay=lay, t_shape=t_shape, t_ref=t_ref, edges=edges, engine=engine):
                # [batch, ..., outer * inner, ...]: each example's rows summed, as broadcasting
                # would have summed all of them
                per = batch_rows(g, lay, batch).sum(lay.dim + 1, keepdim=True)
                per = per.reshape(batch, *t_shape)
                _deliver(engine, edges, per, t_ref)

            e.register_hook(hook)
        return out

    def _spread(self, func, name, args, kwargs, tainted) -> Any:
        """A meeting whose batch-free operands were expanded (or repeated) to the batch before
        it (a class token, ``cls.expand(batch, -1, -1)``, concatenated with the patches): the
        operation treats them row by row with the batch, so its plain gradient of each, taken
        through an alias, holds each example's share in that example's rows; summed over the
        rows the expansion copied, it is the per-example gradient of what was expanded."""
        if name not in _ROWWISE:
            return None
        if _is_inplace(name) and any(args and t is args[0] for t in tainted):
            return None  # the batch written into what was expanded
        others = [t for t in _tensors(args, kwargs) if self.layouts.get(t) is not None]
        if any(self.layouts[t].owners is not None for t in others):
            return None  # (rows picked by an index: the general meeting, by example masks)
        plans = []
        for t in tainted:
            found = self.spread.get(t)
            x = next((o for o in others if o.dim() == t.dim()), None)
            if found is None or x is None:
                return None
            lay = self.layouts[x]
            if lay.dim < 0 or t.shape[lay.dim] != x.shape[lay.dim]:
                return None  # (unknown, packed or mixed: no batch dimension to take rows of)
            if name in ("cat", "concat", "concatenate"):
                dim = _arg(args, kwargs, 1, "dim", 0)
                if _norm_dim(dim, t.dim()) == lay.dim:
                    return None
            elif name not in _POINTWISE_SET and lay.dim >= t.dim() - 2:
                return None  # (a matrix product's rows or columns: not row by row)
            source, how = found
            j = lay.dim
            k = source.dim() - (t.dim() - j)  # the source's dimension along the batch
            if how != "repeat" and k >= 0 and source.shape[k] != 1:
                return None  # (already as long as the batch: the expansion copied nothing)
            if how == "repeat":
                k = source.dim() - (t.dim() - j)  # the source's dimension that was repeated
                if k < 0 or source.shape[k] != lay.inner or any(
                    a != b for i, (a, b) in enumerate(zip(t.shape, (1,) * (t.dim() - source.dim())
                                                          + tuple(source.shape))) if i != j
                ):  # fmt: skip
                    return None
            plans.append((t, lay, source, how))
        swaps, hooks = {}, []
        for t, lay, source, how in plans:
            alias = t.view_as(t)
            swaps[id(t)] = alias
            hooks.append((alias, lay, source, how, self._sources(source)))
        swap = lambda a: swaps.get(id(a), a) if isinstance(a, Tensor) else (  # noqa: E731
            type(a)(swaps.get(id(x), x) if isinstance(x, Tensor) else x for x in a)
            if type(a) in (list, tuple) else a
        )  # fmt: skip
        new_args = tuple(swap(a) for a in args)
        new_kwargs = {k: swap(v) for k, v in kwargs.items()}
        out = func(*new_args, **new_kwargs)
        self._propagate(name, new_args, new_kwargs, out)
        batch, engine = self.batch, self.engine
        for alias, lay, source, how, srcs in hooks:
            for s in srcs:
                s.uses.append(("spread", name))
            edges = {s: self.edges[s] for s in srcs}
            at = torch.autograd.graph.get_gradient_edge(source)
            shape = source.shape

            def hook(g, lay=lay, how=how, shape=shape, edges=edges, at=at):
                rows = batch_rows(g, lay, batch)  # [batch, ..., outer * inner, ...]
                d = lay.dim + 1
                if how == "repeat":
                    rows = rows.unflatten(d, (lay.outer, lay.inner)).sum(d)
                else:
                    rows = rows.sum(d, keepdim=True)
                lead = (1,) * (rows.dim() - 1 - len(shape))
                per = rows.sum_to_size(batch, *lead, *shape).reshape(batch, *shape)
                _deliver(engine, edges, per, at)

            alias.register_hook(hook)
        return out

    def finish(self) -> None:
        """At the end of the forward: a source whose every use took it row by row with the
        batch is *aligned* (its call's rows are examples after all: ``Source.aligned``); the
        meetings of the others hook the backward."""
        seen = {s for m in self.meetings for srcs in m.sources for s in srcs}
        seen |= {s for ss in self.taints.values() for s in ss} | self.unmet
        self.unmet = set()
        for s in seen:
            kinds = {u for u in s.uses}
            if kinds and all(k == "aligned" for k, _ in kinds) and len(kinds) == 1:
                s.aligned = next(iter(kinds))[1]
        for m in self.meetings:
            if not all(s.aligned is not None for srcs in m.sources for s in srcs):
                m.arm()
        self.meetings = []
        self.pending = []


@dataclass
class _Pending:
    """A hooked call on tensors computed from candidates alone (:meth:`Tracker.note_call`)."""

    lineage: frozenset[int]  # the candidates' ids
    outputs: list[Tensor]
    shared: Callable[[list], list]  # makes the call batch-free: its outputs' sources
    done: bool = False


_ACTIVE: list[Tracker] = []
# operations that pick or put back rows by an index: inside a module without a rule, the
# fallback's recomputation one example at a time tells whether they kept the examples apart
# conversions that return their tensor itself where it already is what they make
_MAYBE_SAME = frozenset(
    """to type type_as contiguous float double half bfloat16 cpu cuda""".split()
)
# operations that take a part of a tensor by position, and those that keep every entry of an
# index of rows (see Tracker._row_indices)
_PART_OF = frozenset(
    """__getitem__ narrow select split chunk tensor_split split_with_sizes unsafe_split unbind
    topk kthvalue""".split()
)
_KEEPS_ROWS_INDEX = frozenset(
    """view reshape flatten ravel squeeze unsqueeze contiguous clone cat concat concatenate
    stack expand expand_as sort msort""".split()
)
# products by a mask (see Tracker._all_ones)
_PRODUCTS = frozenset(
    """mul mul_ __mul__ __rmul__ __imul__ logical_and __and__ __rand__ __iand__
    bitwise_and""".split()
)
_PICKS = frozenset(
    """__getitem__ __setitem__ index_select index_add index_add_ index_copy index_copy_
    index_put index_put_ gather scatter scatter_ scatter_add scatter_add_ take_along_dim
    masked_select masked_scatter masked_scatter_""".split()
)


def note(func: Any, args: tuple, kwargs: dict, out: Any) -> None:
    """Tell the running forward's tracker that ``func(*args, **kwargs)`` gave ``out``: for a
    ``TorchFunctionMode`` of a rule's own that computes a torch function another way (the
    tracker then never sees that function, only the operations it was computed with)."""
    if _ACTIVE and not _ACTIVE[-1].off:
        tracker = _ACTIVE[-1]
        layouts = [tracker.layouts.get(t) for t in _tensors(args, kwargs or {})]
        if any(lay is not None for lay in layouts):
            tracker._propagate(_name(func), args, kwargs or {}, out)


def _out_tensors(out: Any) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, list | tuple):
        return [o for o in out if isinstance(o, Tensor)]
    return []


def _deliver(
    engine: EngineLink | None, edges: dict[Source, Any], per_example: Tensor, at_edge
) -> None:
    """Give each source (``edges``: its tensor's gradient edge) its per-example
    output-gradients, from ``per_example`` (``[batch, *shape]``), the per-example gradient of a
    tensor derived from them (at gradient edge ``at_edge``): through the batch-free operations
    between them, by one batched backward."""
    if engine is not None and engine.probing:
        return  # (the engine's check of one example, which captures nothing)
    task = _torch.graph_task_id()
    direct = [s for s, e in edges.items() if e == at_edge]
    through = [s for s, e in edges.items() if e != at_edge]
    for s in direct:
        _add(s, task, per_example)
    if not through:
        return
    ctx = engine.nested() if engine is not None else contextlib.nullcontext()
    with ctx:
        try:
            grads = torch.autograd.grad(
                [at_edge], [edges[s] for s in through], per_example, retain_graph=True,
                allow_unused=True, is_grads_batched=True,
            )  # fmt: skip
        except RuntimeError:
            grads = _grads_one_by_one(at_edge, [edges[s] for s in through], through, per_example)
    for s, g in zip(through, grads):
        if g is not None:
            _add(s, task, g)


def _grads_one_by_one(at_edge, edges, sources, grads):
    def one(b: int) -> tuple[Tensor | None, ...]:
        return torch.autograd.grad([at_edge], edges, grads[b], retain_graph=True, allow_unused=True)

    return loop.per_example(grads.shape[0], one) or [None] * len(sources)


def _add(s: Source, task: int, g: Tensor) -> None:
    old = s.grads.get(task)
    s.grads[task] = g if old is None else old + g


class _Meeting:
    """An operation that combines tensors derived from sources with tensors that have a layout,
    not elementwise: at the backward, it is differentiated again with respect to its
    batch-free operands, one example's share of the output-gradient at a time."""

    # at most this many elements of masked output-gradients at once
    CHUNK = 1 << 24

    def __init__(self, tracker, func, name, args, kwargs, tainted, sources, outs, layouts):
        self.engine, self.batch = tracker.engine, tracker.batch
        self.func, self.name = func, name
        # detached: the recomputation needs the values, never the graph (and holding the
        # graph's tensors from a hook on that graph would make a cycle)
        self.args = tuple(_detached(a) for a in args)
        self.kwargs = {k: _detached(v) for k, v in kwargs.items()}
        self.versions = [(t, _torch.version(t)) for t in _tensors(self.args, self.kwargs)]
        # where each tainted tensor is: its (argument position or keyword, index in a list or
        # tuple argument or None), every place it is passed (torch.cat([past, k]))
        where: dict[int, list] = {id(t): [] for t in tainted}
        for key, a in [*enumerate(args), *kwargs.items()]:
            if isinstance(a, Tensor) and id(a) in where:
                where[id(a)].append((key, None))
            elif type(a) in (list, tuple):
                for j, x in enumerate(a):
                    if isinstance(x, Tensor) and id(x) in where:
                        where[id(x)].append((key, j))
        self.positions = [where[id(t)] for t in tainted]
        self.edges = [torch.autograd.graph.get_gradient_edge(t) for t in tainted]
        self.sources = [tuple(sources[t]) for t in tainted]
        self.src_edges = [{s: tracker.edges[s] for s in srcs} for srcs in self.sources]
        self.nodes = [(o.grad_fn, o.output_nr) for o in outs]
        self.layouts = layouts
        self.shapes = [o.shape for o in outs]

    def arm(self) -> None:
        if not self.nodes:
            return  # (no output that a gradient reaches)
        node, nr = self.nodes[0]
        if node is None:
            return
        if len(self.nodes) == 1 or all(n is node for n, _ in self.nodes):
            node.register_prehook(lambda grad_outputs: self.backward(grad_outputs))
        else:  # (outputs from several nodes: not met in practice)
            for s in {x for srcs in self.sources for x in srcs}:
                s.problem = s.problem or f"'{self.name}' has outputs from several autograd nodes"

    def backward(self, grad_outputs) -> None:
        if self.engine is not None and self.engine.probing:
            return  # (the engine's check of one example, which captures nothing)
        grads = [grad_outputs[nr] if nr < len(grad_outputs) else None for _, nr in self.nodes]
        if all(g is None for g in grads):
            return
        for t, v in self.versions:
            if _torch.version(t) != v:
                for srcs in self.sources:
                    for s in srcs:
                        s.problem = s.problem or (
                            f"an input of '{self.name}' was modified in place after it"
                        )
                return
        per_example = self._per_example(grads)
        for e, per, edges in zip(self.edges, per_example, self.src_edges):
            _deliver(self.engine, edges, per, e)

    def _per_example(self, grads) -> list[Tensor]:
        batch = self.batch

        with torch.enable_grad():
            leaves = []
            args, kwargs = list(self.args), dict(self.kwargs)
            for places in self.positions:
                key, j = places[0]
                table = args if isinstance(key, int) else kwargs
                leaf = (table[key] if j is None else table[key][j]).detach().requires_grad_()
                leaves.append(leaf)
                for key, j in places:
                    table = args if isinstance(key, int) else kwargs
                    if j is None:
                        table[key] = leaf
                    else:
                        table[key] = type(table[key])(
                            leaf if i == j else x for i, x in enumerate(table[key])
                        )
            outs = _out_tensors(self.func(*args, **kwargs))
            pairs = [(o, g, lay) for o, g, lay in zip(outs, grads, self.layouts) if g is not None]
            per_elem = sum(g.numel() for _, g, _ in pairs)
            step = max(1, self.CHUNK // max(per_elem, 1))
            parts: list[list[Tensor]] = [[] for _ in leaves]
            for start in range(0, batch, step):
                stop = min(batch, start + step)
                cots = []
                for _, g, lay in pairs:
                    mask = example_mask(g.shape, lay, batch, g.device)[start:stop]
                    cots.append(g.unsqueeze(0) * mask)
                got = torch.autograd.grad(
                    [o for o, _, _ in pairs], leaves, cots, retain_graph=True,
                    allow_unused=True, is_grads_batched=True,
                )  # fmt: skip
                for j, (leaf, gj) in enumerate(zip(leaves, got)):
                    parts[j].append(
                        torch.zeros((stop - start, *leaf.shape), dtype=leaf.dtype,
                                    device=leaf.device) if gj is None else gj
                    )  # fmt: skip
        return [torch.cat(p) for p in parts]


def _detached(a: Any) -> Any:
    if isinstance(a, Tensor):
        return a.detach()
    if type(a) in (list, tuple):
        return type(a)(_detached(x) for x in a)
    return a

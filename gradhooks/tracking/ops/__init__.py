"""How each torch function moves the batch: one module per family of operations, each
registering its handlers by torch function name (:data:`~.common.HANDLERS`), and
:func:`output_layout`, which the tracker asks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ... import _torch
from ..layout import CONTRACTED, MIXED, PACKED, UNKNOWN, Layout
from . import fft, indexing, joins, linalg, nn, pointwise, reductions, views  # noqa: F401 (each registers its handlers)
from .common import HANDLERS, NeedsBatch, carries, is_inplace, op_name, out_tensors, tensor_args
from .names import MAYBE_SAME
from .pointwise import POINTWISE, is_pointwise
from .reductions import REDUCTIONS

# the operations that follow rows picked by an index (:class:`Owners`): every other one makes
# them mixed (see output_layout)
_OWNER_AWARE = (
    (POINTWISE - {"masked_scatter", "masked_scatter_", "set_"})
    | set(REDUCTIONS)
    | {
        "softmax",
        "log_softmax",
        "special_softmax",
        "special_log_softmax",
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
        "scaled_dot_product_attention",
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
        "repeat_interleave",
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
    | nn.PER_ROW
    | set(HANDLERS)
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


# operations whose outputs never depend on the examples (creation, shape queries)
FREE = """arange range zeros ones full empty eye linspace logspace rand randn randint
    randperm tensor as_tensor from_numpy zeros_like ones_like empty_like full_like rand_like
    randn_like randint_like new_zeros new_ones new_empty new_full tril_indices triu_indices
    empty_strided scalar_tensor""".split()


def _free(*args: Any) -> None:
    return None


HANDLERS.update({n: _free for n in FREE})


def _module_of(handler: Any) -> str | None:
    return getattr(getattr(handler, "fn", handler), "__module__", None)


# the operations whose handlers read tensors' values, not only their layouts, shapes and the
# other arguments (an index's entries, torch.where's condition, a fake quantizer's observer
# switch), and those that find rows (nonzero): their results are never kept (:mod:`..memo`)
READS_VALUES = frozenset(
    {n for n, h in HANDLERS.items() if _module_of(h) == indexing.__name__}
    | {"where", "fused_moving_avg_obs_fake_quant", "nonzero", "argwhere"}
)
# ... except ``x[index]`` and ``x[index] = v`` whose index holds no tensor (slices, integers,
# None, ...), which read shapes only: kept where the index is so (OpFacts.kept: INDEX)
INDEX = 2
_PLAIN_INDEX = frozenset({"__getitem__", "__setitem__"})

# what reads a tensor's metadata, not its values: a parameter handed to one of these is not used
# (by a hook reading ``p.dtype`` inside a call, or the engine reading ``p.requires_grad``)
METADATA = frozenset(
    """.requires_grad .dtype .device .shape .ndim .is_leaf .grad_fn .layout .names .is_cuda
    .is_sparse .is_quantized .is_meta .itemsize .nbytes dim size numel nelement
    element_size is_floating_point is_complex is_contiguous stride storage_offset data_ptr
    get_device""".split()
)

# operations that read only the dtype and device, or the shape, of their tensor arguments after
# the first (``w.to(x)``, ``w.type_as(x)``, ``w.view_as(x)``): their result holds the first
# argument's values alone, so a batch in the others is not the result's
LIKE = frozenset({"to", "type_as", "view_as", "reshape_as", "expand_as"})


def data_args(name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments whose values ``name`` computes with: for :data:`LIKE`, the first alone."""
    if name in LIKE and args and isinstance(args[0], Tensor):
        return args[:1], {k: v for k, v in kwargs.items() if not isinstance(v, Tensor)}
    return args, kwargs


def output_layout(
    name: str, args: tuple, kwargs: dict, out: Any, layout_of, batch: int, ins: list | None = None
):
    """The layout(s) of ``out``, the result of the torch function ``name`` on ``args``, some of
    which have layouts (``layout_of``). Rows picked by an index (:class:`Owners`) are followed
    only through the operations that know them (:func:`owner_aware`), and never lost: where
    one of these cannot say where they went, its result is mixed (refused where it is used),
    never of unknown layout (which a rule would read as the batch). (An index or mask computed
    from them, which selects only, may be of unknown layout.) ``ins``: the tensors among the
    arguments, where the caller has them. A PackedSequence's data (:data:`PACKED`) is
    followed by :func:`_packed_rows`, but by the operations that read it as such."""
    owned = packed = False
    for t in tensor_args(args, kwargs) if ins is None else ins:
        lay = layout_of(t)
        if lay is PACKED:
            packed = True
        elif lay is not None and lay.owners is not None:
            owned = True
    if packed and name not in _READ_PACKED:
        return _packed_rows(name, args, kwargs, out, layout_of, ins)
    if owned:
        lost = MIXED if any(map(carries, out_tensors(out))) else UNKNOWN
        if not owner_aware(name):
            return lost
        found = _output_layout(name, args, kwargs, out, layout_of, batch)
        if (
            found is UNKNOWN
            or found is CONTRACTED
            or (isinstance(found, list) and UNKNOWN in found)
        ):
            return lost
        return found
    return _output_layout(name, args, kwargs, out, layout_of, batch)


def handler_for(name: str) -> Any:
    """The handler of torch function ``name``: its own, or, for an elementwise operation torch
    tags as such, :func:`.pointwise.pointwise` (``None``: the tracker does not know it)."""
    handler = HANDLERS.get(name)
    if handler is None and is_pointwise(name):
        return pointwise.pointwise
    return handler


def owner_aware(name: str) -> bool:
    """Whether torch function ``name`` follows rows picked by an index (:class:`Owners`)."""
    return name in _OWNER_AWARE or (name not in HANDLERS and is_pointwise(name))


@dataclass(frozen=True, slots=True)
class OpFacts:
    """What the tracker asks of a torch function on every call of it, found once: its name
    (:func:`.common.op_name`), whether it is in :data:`LIKE`, :data:`METADATA`,
    :data:`.names.MAYBE_SAME`, :data:`FREE`, whether it works in place
    (:func:`.common.is_inplace`), its handler (:func:`handler_for`), and whether what its
    handler gives may be kept for calls with the same arguments (:mod:`..memo`: a handler
    that does not read values)."""

    name: str
    like: bool
    metadata: bool
    maybe_same: bool
    free: bool
    inplace: bool
    handler: Any
    kept: int = 0  # (0: never, 1: always, INDEX: where the index holds no tensor)


# per torch function (and per name), by whether torch's operator schemas are read (the
# in-place test and the pointwise tag read them; ``_torch.disabled`` switches them off)
_FACTS: tuple[dict[Any, OpFacts], dict[Any, OpFacts]] = ({}, {})
_NAMED: tuple[dict[str, OpFacts], dict[str, OpFacts]] = ({}, {})


def facts_named(name: str) -> OpFacts:
    """The :class:`OpFacts` of the torch function named ``name``."""
    table = _NAMED[_torch.available("op_schema")]
    found = table.get(name)
    if found is None:
        handler = handler_for(name)
        found = table[name] = OpFacts(
            name,
            name in LIKE,
            name in METADATA,
            name in MAYBE_SAME,
            name in FREE,
            is_inplace(name),
            handler,
            0 if handler is None or name in FREE
            else INDEX if name in _PLAIN_INDEX
            else int(name not in READS_VALUES),
        )  # fmt: skip
    return found


def facts(func: Any) -> OpFacts:
    """The :class:`OpFacts` of torch function ``func`` (what it is never changes: the handler
    table is complete once this package is imported)."""
    table = _FACTS[_torch.available("op_schema")]
    try:
        found = table.get(func)
    except TypeError:  # (not hashable)
        return facts_named(op_name(func))
    if found is None:
        found = facts_named(op_name(func))
        # (a closure may hold tensors, and one made afresh for each call would fill the table:
        # neither is kept)
        if len(table) < _MAX_FUNCTIONS and getattr(func, "__closure__", None) is None:
            table[func] = found
            if quick_kind(found) or found.metadata or found.free:
                _QUICK[_torch.available("op_schema")][func] = found
    return found


_MAX_FUNCTIONS = 4096


def quick_kind(op: OpFacts) -> bool:
    """Whether a call of ``op`` may take the tracker's short way
    (:meth:`~gradhooks.tracking.Tracker.__torch_function__`): its handler's layouts are kept
    for any call (:data:`READS_VALUES`: none read values), it changes none of its arguments
    (so that its key, built before it runs, is the one built after), and it is no question
    about a tensor's metadata (a parameter given to one is not used)."""
    return op.kept == 1 and not op.inplace and not op.metadata and not op.free


# the functions of :data:`_FACTS` that are :func:`quick_kind`, :data:`METADATA` or :data:`FREE`,
# by the same two tables
_QUICK: tuple[dict[Any, OpFacts], dict[Any, OpFacts]] = ({}, {})


def quick_table() -> dict[Any, OpFacts]:
    """The functions that may take the tracker's short way (:func:`quick_kind`, or a question
    about a tensor's metadata, or one that makes a new tensor), as torch's operator schemas
    are read now (filled as :func:`facts` meets them)."""
    return _QUICK[_torch.available("op_schema")]


# the operations whose handlers read a PackedSequence's data as such (its batch sizes beside it)
_READ_PACKED = frozenset({"lstm", "gru", "rnn_tanh", "rnn_relu", "_pad_packed_sequence"})


def _packed_rows(name: str, args: tuple, kwargs: dict, out: Any, layout_of, ins):
    """The layouts of ``out`` where an input is a PackedSequence's data (:data:`PACKED`: each
    row one example's time step, the examples' steps packed longest first), for an operation
    that does not read it as such: asked of its handler as if each row were an example of a
    batch on dimension 0. What keeps every row apart and in place (a function of each row:
    ``F.linear``, an activation, dropout, a norm over the features) is such data again; rows
    picked in their order (a slice) are part of it; rows combined (a sum or a cumulative sum
    along them) are mixed; anything else (rows reordered, moved to another dimension,
    reshaped: ``d.view(2, -1, F)``, which no handler may take for blocks of examples) is
    unknown. An input of another layout beside it: unknown."""
    tensors = tensor_args(args, kwargs) if ins is None else ins
    rows = None
    for t in tensors:
        lay = layout_of(t)
        if lay is PACKED:
            rows = t.shape[0] if t.dim() else None
        elif lay is not None:
            return UNKNOWN
    if rows is None:
        return UNKNOWN
    as_rows = Layout(0)

    def rows_of(t: Any) -> Layout | None:
        lay = layout_of(t)
        return as_rows if lay is PACKED else lay

    found = _output_layout(name, args, kwargs, out, rows_of, rows)

    def back(lay: Any) -> Any:
        if lay is None or lay is MIXED or lay is CONTRACTED:
            return lay
        if lay == as_rows:
            return PACKED
        owners = getattr(lay, "owners", None)
        if lay.dim == 0 and owners is not None and not owners.shuffled:
            picked = owners.rows
            if picked.numel() < 2 or bool((picked[1:] > picked[:-1]).all()):
                return PACKED  # (rows picked in their order: part of the data)
        return UNKNOWN

    if isinstance(found, list):
        return [back(lay) for lay in found]
    return back(found)


def _output_layout(name: str, args: tuple, kwargs: dict, out: Any, layout_of, batch: int):
    handler = facts_named(name).handler
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
    if isinstance(handler, NeedsBatch):
        return handler.fn(args, kwargs, out, layout_of, batch)
    return handler(args, kwargs, out, layout_of)

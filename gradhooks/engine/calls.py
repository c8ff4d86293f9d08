"""Where the examples are in a captured call, as the forward's tracker followed them
(:mod:`gradhooks.tracking.layout`), and the call handed to its rule in that form. :class:`CallLayouts` is
the part of :class:`gradhooks.Hooks` that asks the tracker.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from .. import _torch
from .. import pieces as P
from .._torch import tree_flatten, tree_map, tree_unflatten
from ..errors import (
    BatchNotFoundError,
    MixedExamplesError,
    RuleError,
    StateError,
    UnsupportedError,
)
from ..loop import per_example
from ..rules.fallback import FALLBACK
from ..rules.registry import Call, CallBatch
from ..tracking import MIXED, PACKED, UNKNOWN, Layout, Source, Tracker, batch_rows
from ..tracking.layout import owned, sole_owner
from .plan import Target
from .records import CallLayout, CallState, Frame, args_leaves, tree_leaves, with_fields
from .state import CaptureState


class _Unview(torch.autograd.Function):
    """``x``'s memory as a tensor that autograd does not take for a view (its gradient passes
    unchanged), so that an in-place change of it keeps the hooks on it."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        return g


def own_node(t: Any) -> Any:
    if isinstance(t, Tensor) and t.requires_grad:
        return _Unview.apply(t)
    return t


def unview(t: Any) -> Any:
    if isinstance(t, Tensor) and t.requires_grad and _torch.is_view(t):
        return _Unview.apply(t)
    return t


def carry_layouts(tracker: Tracker | None, old: Any, new: Any) -> Any:
    """The layouts (and sources) of a call's outputs, for the outputs the engine replaced them
    with."""
    if tracker is not None and new is not None:
        for a, b in zip(tree_leaves(old), tree_leaves(new)):
            if isinstance(a, Tensor) and isinstance(b, Tensor):
                tracker.carry(a, b)
    return new


def keeps_rows(layout: CallLayout | None) -> bool:
    """Whether a call's rule sees its input as the forward ran it (what ``taps`` were taken
    from): not where the engine moves or adds a batch dimension."""
    return layout is None or layout.kind in ("plain", "fold", "unknown", "owners")


def _changed_in_place(target: Target, what: str, t: Tensor, version: int, advice: str) -> None:
    """Raise, in autograd's words, where ``t`` (``what`` of ``target``'s call) is no longer at
    the ``version`` its forward saw."""
    if _torch.version(t) != version:
        raise StateError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: {what} of {target.where} of shape {tuple(t.shape)} is at version "
            f"{_torch.version(t)}; expected version {version} instead. {advice}"
        )


def check_parameter_versions(
    target: Target, params: dict[str, Tensor], versions: dict[str, int]
) -> None:
    """A call autograd recorded nothing of (its rule gives its whole backward, from the
    parameters as they are then) must find the parameters of its forward, as autograd requires
    of the tensors it saves."""
    for n, p in params.items():
        _changed_in_place(
            target, f"parameter '{n}'", p, versions[n],
            "The layer's backward would use the changed values: change parameters after the "
            "backward (optimizer.step() after loss.backward()), as autograd requires.",
        )  # fmt: skip


def check_versions(target: Target, state: CallState) -> None:
    """The inputs a rule computes from must be those of the forward, as autograd requires of
    the tensors it saves (the paths that run a call detached do not let autograd see them)."""
    for t, version in state.versions:
        if _torch.version(t) == version:
            continue  # (the usual: unchanged; the refusal's words made only where it is not)
        _changed_in_place(
            target, "an input", t, version,
            "gradhooks computes the layer's per-example gradients from its input, as autograd "
            "computes its weight gradient: change a copy of it (x = x.clone()), or out of place.",
        )  # fmt: skip


def unchanged_outputs(call: Call, versions: tuple) -> Call:
    """The kept output with every leaf changed in place since the forward (a residual added
    into it: ``x += shortcut``) left out (``None``): it no longer is what the call gave."""
    leaves, spec = tree_flatten(call.output)
    changed = {i for i, v in versions if _torch.version(leaves[i]) != v}
    if not changed:
        return call
    kept = [None if i in changed else t for i, t in enumerate(leaves)]
    return with_fields(call, output=tree_unflatten(kept, spec))


def _kind_of(dim: Any, lay: Layout) -> str | None:
    """The :class:`CallLayout` kind of a call whose rule reads the examples on ``dim`` (a
    dimension, or ``"positions"``), given an input laid out as ``lay``; ``None`` where the
    examples are on another dimension of a layer that is not position-wise."""
    if dim == "positions":
        return "plain" if lay.dim == 0 and lay.plain else "moved"
    if lay.dim == dim:
        return "plain" if lay.plain else "fold"
    return None


def aligned_call(target: Target, layout: CallLayout, call: Call) -> CallLayout | None:
    """A call that does not depend on the examples whose output every operation took row by
    row with the batch (positions looked up already expanded to the batch, then added to it):
    its rows are examples after all, where the tracker found them (``Source.aligned``)."""
    found = {s.aligned for s in layout.sources if s is not None}
    if len(found) != 1 or None in found:
        return None
    (lay,) = found
    leaves = tree_leaves((call.inputs, call.kwargs))
    first = next((i for i, t in enumerate(leaves) if isinstance(t, Tensor)), None)
    if first is None or leaves[first].dim() <= lay.dim:
        return None
    kind = _kind_of(target.entry.batch_dim_of(target.module), lay)
    if kind is None:
        return None
    inputs = tuple(lay if i == first else None for i in range(len(leaves)))
    outputs = tuple(lay for _ in layout.outputs)
    return CallLayout(kind, layout.batch, lay, inputs, outputs)


def rule_pieces(
    target: Target, params: dict[str, nn.Parameter], call: Call, layout: CallLayout | None
) -> dict[str, P.Piece | None]:
    """The rule's pieces for a call, with one row per example: the call handed to the rule
    with its examples where the rule reads them (moved, added), or the rule's rows of one
    example summed (folded), or the rule run one example at a time (a call that does not
    depend on the examples, of a layer that reads its batch from a fixed dimension). Every
    piece in its parameter's dtype (:meth:`gradhooks.pieces.Piece.in_dtype`)."""
    rule = in_params_dtype(target.entry.rule, params, target)
    if target.entry is FALLBACK:
        if layout is None:
            return rule(call)
        shares = frozenset(i for i, s in enumerate(layout.sources) if s is not None)
        batch = CallBatch(
            layout.batch, layout.inputs, layout.outputs, layout.kind == "shared", frozenset(params),
            shares=shares if layout.kind != "shared" else frozenset(),
        )  # fmt: skip
        return rule(with_fields(call, batch=batch))
    if layout is None or layout.kind in ("plain", "unknown"):
        return rule(call)
    if layout.kind == "mismatch":
        rule(call)  # (its own error, where it has one, says more: an unbatched input)
        raise BatchNotFoundError(layout.lost[0])
    if layout.kind == "owners":
        return _owned_pieces(rule(call), params, layout)
    if target.entry.batch_dim_of(target.module) == "positions":
        return rule(_positions_call(call, layout))
    if layout.kind == "fold":
        first = layout.first
        pieces = dict(rule(call))
        rows = next((pc.batch_size for pc in pieces.values() if pc is not None), None)
        if rows != first.size(layout.batch):
            return pieces  # the rule's rows are not its input's (bags): checked by the caller
        for n, piece in pieces.items():
            if piece is not None and n in params:
                merged = piece.merged(params[n].shape, first.outer, layout.batch, first.inner)
                pieces[n] = _carried(merged, piece)
        return pieces
    return _one_by_one(rule, call, params, layout.batch)


def in_params_dtype(rule, params: dict[str, nn.Parameter], target: Target):
    """``rule`` with each piece it gives checked against its parameter (:func:`check_pieces`)
    and brought to the parameter's dtype: a layer run in a lower precision than its
    parameters (autocast) gives a lower-precision output-gradient beside the input it was
    handed (float32), whose product no kernel takes as it is."""

    def cast(call: Call) -> dict[str, P.Piece | None]:
        pieces = rule(call)
        check_pieces(rule, target, pieces, params)
        found = {}
        for n, pc in pieces.items():
            if pc is not None and n in params:
                new = pc.in_dtype(params[n].dtype)
                if new is not pc:  # (in its parameter's dtype already: nothing to carry over)
                    pc = _carried(new, pc)
            found[n] = pc
        return found

    return cast


def check_pieces(rule, target: Target, pieces: Any, params: dict[str, nn.Parameter]) -> None:
    """Refuse what a rule returned for a call of ``target`` where it is not ``{name: Piece}``
    or where a piece's gradient has not as many entries per example as its parameter: a
    ``grad1`` would fail to reshape, and the norms, squared sums and DP sums, which never form
    it, inside torch (or, where the sizes happen to broadcast, give numbers). (The names in
    the messages are made only for them: this runs at every call of every backward.)"""
    if not isinstance(pieces, dict):
        raise RuleError(
            f"rule {_rule_name(rule)} for {target.where} returned {type(pieces).__qualname__}, "
            "not {parameter name: Piece} (gradhooks.Outer, Direct or Rows; None for a parameter "
            "whose gradient this call does not give)"
        )
    for n, piece in pieces.items():
        if piece is None or n not in params:
            continue
        p = params[n]
        if not isinstance(piece, P.Piece):
            raise RuleError(
                f"rule {_rule_name(rule)} for {target.where}: its piece for '{n}' is a "
                f"{type(piece).__qualname__}, not a gradhooks.Piece: wrap a per-example "
                f"gradient [batch, *{tuple(p.shape)}] in gradhooks.Direct(...), or return "
                "gradhooks.Outer(a, g) for a layer's input and output-gradient"
            )
        elements = piece.example_elements
        if elements is not None and elements != p.numel() and p.numel():
            raise RuleError(
                f"rule {_rule_name(rule)} for {target.where}: its piece for '{n}' "
                f"({type(piece).__name__}) gives each of its {piece.batch_size} examples a "
                f"gradient of {elements} entries, but '{n}' has shape {tuple(p.shape)} "
                f"({p.numel()} entries): a Direct piece holds [batch, *{tuple(p.shape)}]; an "
                "Outer piece a [batch, *groups, shared, in] input and a [batch, *groups, shared, "
                "out] output-gradient, for a parameter [*groups, out, in] (check the rule with "
                "gradhooks.check_rule); or the parameter's .data was set to a tensor of another "
                "shape between the forward and its backward (a vocabulary resized): change it "
                "after the backward"
            )


def _rule_name(rule) -> str:
    return getattr(rule, "__qualname__", type(rule).__qualname__)


def _carried(new: P.Piece, old: P.Piece) -> P.Piece:
    """``new``, a form of ``old``, with what ``old``'s rule said of autograd's own kernel
    (:attr:`gradhooks.pieces.Piece.rounded_terms`, :attr:`~gradhooks.pieces.Piece.input_scale`)."""
    if old.rounded_terms and new is not old:
        new.rounded_terms = old.rounded_terms
        if old.input_scale:
            new.input_scale = old.input_scale
    return new


def _shared_outputs(
    target: Target, outs: list, lout: tuple, grads: list, tracker: Tracker
) -> tuple:
    """A call of a module without a rule on inputs with examples, some of whose outputs with
    a gradient do not depend on them (Glow's ActNorm and invertible convolution, beside
    their output, a log-determinant of their parameters alone, which every example's loss
    adds): those outputs become the tracker's sources, as a shared call's do, so that each
    example's share of their gradient is found where they meet the batch. Per output leaf,
    its :class:`Source` (or ``None``); ``()`` where there is none."""
    found = [
        Source(target.name, t.shape)
        if lay is None and isinstance(t, Tensor) and any(t is g for g in grads)
        else None
        for t, lay in zip(outs, lout)
    ]
    for t, s in zip(outs, found):
        if s is not None:
            tracker.add_source(t, s)
    return tuple(found) if any(s is not None for s in found) else ()


def _packed_in_order(args: tuple, kwargs: dict, tracker: Tracker) -> Layout | None:
    """Where a layer is given a PackedSequence without ``sorted_indices`` of the batch the
    model put in another order before packing it (ESIM's and many text models' encoders sort
    the batch by length, ``index_select``, then ``pack_padded_sequence`` with
    ``enforce_sorted=True``): its rule's rows, its padded examples in the order they were
    packed, as rows picked from the batch (row ``r`` example ``order[r]``); ``None`` for a
    PackedSequence in the batch's order, or one whose ``sorted_indices`` put its rows back."""
    whole = tree_flatten((args, kwargs), is_leaf=lambda a: isinstance(a, PackedSequence))[0]
    packed = [a for a in whole if isinstance(a, PackedSequence)]
    if len(packed) != 1 or packed[0].sorted_indices is not None:
        return None
    order = tracker.packed_orders.get(packed[0].batch_sizes)
    if order is None:
        return None
    rows = owned(0, order, Layout(0), tracker.batch)
    return rows if rows.owners is not None else None


def _owned_pieces(pieces: dict, params: dict, layout: CallLayout) -> dict[str, P.Piece | None]:
    """A call on rows picked by an index (tokens routed to an expert): the rule's rows are its
    input's, each one example's part (:class:`gradhooks.tracking.layout.Owners`); each example's are
    summed."""
    owners = layout.first.owners.rows
    found = dict(pieces)
    for n, piece in found.items():
        if piece is None or n not in params:
            continue
        if piece.batch_size != owners.numel():
            raise BatchNotFoundError(
                f"the rule gave {piece.batch_size} rows for '{n}' of a call on {owners.numel()} "
                "rows picked by an index (each one example's): it cannot tell which example "
                "each belongs to. Register a rule whose rows are its input's, or freeze the "
                "parameter."
            )
        found[n] = _carried(piece.owned(params[n].shape, owners, layout.batch), piece)
    return found


def _positions_call(call: Call, layout: CallLayout) -> Call:
    """A position-wise layer's call with its examples on a new dimension 0: moved there
    (with any fold) from where they are, or, for a call that does not depend on them, its
    inputs repeated for every example (a view) beside the per-example output-gradients."""
    batch = layout.batch
    if layout.kind == "shared":

        def grow(t):
            return t.unsqueeze(0).expand(batch, *t.shape) if isinstance(t, Tensor) else t

        return with_fields(
            call, inputs=tree_map(grow, call.inputs), kwargs=tree_map(grow, call.kwargs),
            taps=None, saved=None,
        )  # fmt: skip
    leaves, rebuild = args_leaves(call.inputs, call.kwargs)
    moved = [
        batch_rows(t, lay, batch) if isinstance(t, Tensor) and _followed(lay) else t
        for t, lay in zip(leaves, layout.inputs)
    ]
    inputs, kwargs = rebuild(moved)
    grads = []
    for i, g in enumerate(call.grad_outputs):
        lay = layout.outputs[i] if i < len(layout.outputs) else None
        grads.append(None if g is None else batch_rows(g, lay if _followed(lay) else layout.first,
                                                       batch))  # fmt: skip
    return with_fields(
        call, inputs=inputs, kwargs=kwargs, grad_outputs=tuple(grads), taps=None, saved=None
    )


def _followed(lay: Layout | None) -> bool:
    return lay is not None and lay.dim >= 0


def _one_by_one(rule, call: Call, params: dict, batch: int) -> dict[str, P.Piece | None]:
    """A call that does not depend on the examples, of a layer that reads its batch from a
    fixed dimension: the rule once per example, with that example's output-gradients; every
    row the rule gives belongs to that example."""

    def one(b: int) -> list[Tensor | None]:
        pieces = rule(
            with_fields(
                call, grad_outputs=tuple(None if g is None else g[b] for g in call.grad_outputs)
            )
        )
        return [
            None if (piece := pieces.get(n)) is None else piece.grad1(p.shape).sum(0)
            for n, p in params.items()
        ]

    rows = per_example(batch, one) or [None] * len(params)
    return {n: None if r is None else P.Direct(r) for n, r in zip(params, rows)}


def input_tensors(args: tuple, kwargs: dict) -> list[Tensor]:
    """The model's tensor inputs: the tensors among its arguments (and in their tuples, lists
    and dicts), or where there are none, those an argument holds as attributes (a torchtext
    ``Batch``, a ``SimpleNamespace``): the batch is followed from them as from any input."""
    leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
    if leaves:
        return leaves
    held = [a for a in (*args, *kwargs.values()) if hasattr(a, "__dict__")]
    held = [vars(a) for a in held if not isinstance(a, nn.Module)]
    return [t for d in held for t in d.values() if isinstance(t, Tensor)]


def root_batch(
    args: tuple, kwargs: dict, batch_dim, leaves: list[Tensor] | None = None
) -> tuple[int, list[tuple[Tensor, Layout]]] | None:
    """The model's batch size and the layouts of its tensor inputs: dimension ``batch_dim``
    (0 for ``"auto"``) of its first tensor input is the batch, and every tensor input whose
    dimension ``batch_dim`` has that size holds the examples there; a ``PackedSequence``'s
    batch is its first batch size. ``leaves``: :func:`input_tensors` of the call, where the
    caller has them."""
    dim = 0 if batch_dim == "auto" else batch_dim
    packed = [a for a in (*args, *kwargs.values()) if isinstance(a, PackedSequence)]
    if leaves is None:
        leaves = input_tensors(args, kwargs)
    if packed:
        batch = int(packed[0].batch_sizes[0])
        found = [(ps.data, PACKED) for ps in packed]
        skip = {id(t) for ps in packed for t in ps if isinstance(t, Tensor)}
        leaves = [t for t in leaves if id(t) not in skip]
    else:
        first = next((t for t in leaves if t.dim() > dim), None)
        if first is None:
            return None
        batch = first.shape[dim]
        found = [(first, Layout(dim))]
        leaves = [t for t in leaves if t is not first]
    # (the others by their size alone: the tracker's candidates, dropped where taking them as
    # batched is all that makes an operation mix the examples)
    found += [(t, Layout(dim)) for t in leaves if t.dim() > dim and t.shape[dim] == batch]
    return batch, found


def listed_with(first: Tensor, args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensors held with ``first`` in one list or tuple among the model's arguments
    (``model([x1, x2])``, ``model(batch)`` with ``batch`` a list), ``first`` included; none
    where it is an argument itself (``model(a, b)``) or a field of a named record. (A walk by
    hand, depth first in order: a nested function that calls itself would hold ``first`` in
    a reference cycle, kept until the garbage collector runs.)"""
    todo: list[Any] = list(reversed((*args, *kwargs.values())))
    while todo:
        tree = todo.pop()
        if type(tree) in (list, tuple):
            if any(x is first for x in tree):
                return [x for x in tree if isinstance(x, Tensor)]
            todo.extend(reversed(tree))
        elif type(tree) is dict:
            todo.extend(reversed(list(tree.values())))
    return []


class Rows(NamedTuple):
    """Where a forward's examples lie in the memory its first batched input shares
    (:func:`rows_in_memory`)."""

    memory: tuple  # the tensor it views: (address, dtype, strides, the batch's stride)
    first: int  # the index of its first example on that tensor's batch dimension
    count: int  # its examples
    shape: tuple[int, ...] | None  # that tensor's shape, where it is a view
    every: int = 1  # the step between its examples there (x[1::2]: 2)


def rows_in_memory(t: Tensor, dim: int) -> Rows | None:
    """Which examples of the tensor whose memory ``t`` views ``t`` holds on its dimension
    ``dim``: two forwards of one backward whose inputs view one tensor at other indices of its
    batch dimension hold other examples of one batch (``x.chunk(2)``, ``x[:4]`` and ``x[4:]``,
    ``x[0::2]`` and ``x[1::2]``), where two on the same rows (``x[:, 0]`` and ``x[:, 1]``: two
    views of each example) hold the same ones. ``None`` where that cannot be told: an empty ``t``, a batch without a stride of
    its own, memory that overlaps, a tensor without strides or memory (sparse, fake)."""
    if t.layout is not torch.strided or type(t) is not Tensor and not isinstance(t, nn.Parameter):
        return None
    strides = t.stride()
    step = strides[dim]
    if t.numel() == 0 or step == 0:
        return None
    base = _torch.view_base(t)
    if base is None and t.shape[dim] > 1 and t.storage_offset() == 0 and t.is_contiguous():
        # (the usual batch: a tensor of its own, from its memory's start, its examples the
        # first index of each stride; as the walk below finds, at a third of the cost)
        return Rows((t.data_ptr(), t.dtype, strides, step), 0, t.shape[dim], None)
    ref = t if base is None else base
    try:
        start = ref.data_ptr() - (ref.storage_offset() if base is None else 0) * t.element_size()
        offset, rest = divmod(t.data_ptr() - start, t.element_size())
    except RuntimeError:  # (no memory: a tensor of torch.export's tracing)
        return None
    if rest:
        return None
    first = None
    strides = sorted((s for s, n in zip(ref.stride(), ref.shape) if n > 1), reverse=True)
    # (the viewed tensor's stride of the batch: the largest of its strides that the batch's
    # is a multiple of, every so many of its examples where ``t`` is a strided slice)
    batch = next((s for s in strides if s and step % s == 0), step)
    for i, s in enumerate(strides):  # (the largest first)
        if s == 0 or (i and s == strides[i - 1]):
            return None  # (memory that overlaps: no one index per entry)
        index, offset = divmod(offset, s)
        if s == batch:
            first = index
    if offset or first is None:
        return None
    shape = None if base is None else tuple(base.shape)
    return Rows((start, t.dtype, ref.stride(), batch), first, t.shape[dim], shape, step // batch)


def other_rows(a: Rows, b: Rows) -> bool:
    """Whether two forwards' rows are other examples of one batch (:func:`rows_in_memory`).
    Not where each has one row: a policy called on each state of an episode (``states[t :
    t + 1]``), whose gradients add up to the episode's, one example. Row ``i`` of each is
    example ``first + i * every`` of the tensor both view."""
    if a.memory != b.memory or (a.count < 2 and b.count < 2):
        return False
    return a.first != b.first or (a.every != b.every and min(a.count, b.count) > 1)


def describe_call(call: Call) -> str:
    def shapes(tree: Any) -> str:
        return ", ".join(
            str(tuple(t.shape)) if isinstance(t, Tensor) else type(t).__name__
            for t in tree_leaves(tree)
        )

    grads = ", ".join("None" if g is None else str(tuple(g.shape)) for g in call.grad_outputs)
    return f"inputs [{shapes(call.inputs)}], output-gradients [{grads}]"


def may_lack_batch(call: Call) -> bool:
    """Whether a call's tensors may lack the batch dimension its rule reads as dimension 0: a
    tensor input of fewer than 2 dimensions (``[features]`` for ``[batch, features]``), or
    tensor inputs and output-gradients whose dimensions 0 differ."""
    tensors = [t for t in tree_leaves(call.inputs) if isinstance(t, Tensor)]
    if any(t.dim() < 2 for t in tensors):
        return True
    tensors += [g for g in call.grad_outputs if isinstance(g, Tensor) and g.dim() > 0]
    return len({t.shape[0] for t in tensors}) > 1


def _shapes(args: tuple, kwargs: dict) -> str:
    return ", ".join(
        str(tuple(t.shape)) if isinstance(t, Tensor) else type(t).__name__
        for t in tree_leaves((args, kwargs))
    )


def examples_of_empty_call(
    batch_dim, call: Call, frame: Frame | None, layout: CallLayout | None
) -> int | None:
    """The number of examples of a call whose per-example gradients are all zeros, formed
    without its rule: a forward without examples (on an int ``batch_dim``, also other than 0,
    where the layers may see the batch elsewhere: ``[time, 0, features]``; a call on a shared
    input, a memory bank, in a forward whose batch is empty), or a call whose tensor inputs
    and output-gradients have no entries, with the examples where its rule reads them
    (``[batch, 0, features]``).
    ``None`` otherwise (the rule runs)."""
    if frame is not None and frame.batch == 0:
        if (layout is None or layout.kind == "plain") and _first_rows(call) == 0:
            return None  # (the rule reads 0 rows where it reads them: its pieces, empty,
            # still say what they are of, as K-FAC's factors summed over ranks need)
        return 0
    if not blank_call(call):
        return None
    if layout is not None and layout.kind in ("plain", "fold"):
        return layout.batch  # (where the rule reads the examples: empty, each of them)
    return None


def _first_rows(call: Call) -> int | None:
    """The size of dimension 0 of a call's first tensor input (``None``: no tensor input)."""
    first = next((t for t in tree_leaves(call.inputs) if isinstance(t, Tensor)), None)
    return None if first is None or first.dim() == 0 else first.shape[0]


def blank_call(call: Call) -> bool:
    """Whether a call's tensor inputs and output-gradients have no entries (a bias with
    nothing to add to still has a gradient: ``nn.Linear(0, n)``)."""
    inputs = call.inputs
    if type(inputs) is tuple and inputs and type(inputs[0]) is Tensor and inputs[0].numel():
        return False  # (the usual case: the first leaf, a tensor with entries)
    found = False
    for t in tree_leaves((call.inputs, call.kwargs)):
        if isinstance(t, Tensor):
            if t.numel():
                return False  # (the usual case, told by the first input)
            found = True
    return found and not any(isinstance(g, Tensor) and g.numel() for g in call.grad_outputs)


@dataclass(eq=False)
class KeptCall:
    """A captured call waiting for its output-gradients: what the gradient hook on its outputs
    hands to :meth:`BackwardWriter.output_grads` (and, for a rule with taps, the hooks on the
    tapped nodes to :meth:`BackwardWriter.node_grads`). Holds neither the call's outputs nor its
    nodes (a reference cycle through autograd's graph)."""

    target: Target
    state: CallState
    call: Call
    args: tuple  # the call's inputs as it got them
    kwargs: dict
    live: dict[str, nn.Parameter]  # the parameters it writes grad1 for
    hooked: tuple[int, ...]  # which leaves of its output have the gradient hook
    n_leaves: int  # the leaves of its output
    carried: Any  # its capture._Carried, where its first input carries its parameters
    n_nodes: int = 0  # the nodes its rule taps
    # a tapped call's gradients so far: "outputs", then each node's by its index
    pending: dict = field(default_factory=dict)
    released: bool = False  # (release: its inputs let go of)

    @property
    def sums(self) -> dict[str, Tensor] | None:
        """Where the call's parameters are carried: the batch gradients its rule gives."""
        return self.carried.sums if self.carried is not None else None

    def release(self) -> None:
        """Let go of the call's inputs (a backward that did not keep its graph ran its rule), as
        autograd frees what it saved once such a backward is through: a graph kept alive by a
        loss from an earlier step (``loss = model(x)...`` reassigned only after the next
        forward) would otherwise keep every hooked call's inputs of that step too."""
        self.call = None  # type: ignore[assignment]
        self.args, self.kwargs = (), {}
        self.state.versions = ()
        self.pending.clear()
        self.released = True


@dataclass(eq=False)
class Held:
    """What the backward of a call captured otherwise than by a :class:`KeptCall` (a call run
    detached, a torch function of a parameter) keeps from its forward, until
    :meth:`release` (as :meth:`KeptCall.release`)."""

    call: Call | None
    args: tuple
    kwargs: dict
    inputs: list
    state: CallState
    released: bool = False

    def release(self) -> None:
        self.call, self.args, self.kwargs, self.inputs = None, (), {}, []
        self.state.versions = ()
        self.released = True


def release_spent(state: CaptureState) -> None:
    """The calls whose rule ran in a backward that did not keep its graph let go of their
    inputs (:meth:`KeptCall.release`), as autograd let go of what it saved for them: at that
    backward's end, and at the next forward for any left (a backward that failed on the way).
    A backward through them again is refused."""
    spent, state.spent = state.spent, []
    for ref in spent:
        held = ref()
        if held is not None:
            held.release()


def released_call(name: str, module: nn.Module) -> str:
    """The refusal of a backward that reaches a call whose inputs were let go of."""
    where = name if name.startswith("'") else f"'{name or '<model>'}'"  # (a function's use)
    return (
        f"{where} ({type(module).__qualname__}): this backward goes through a call whose "
        "backward has already run without keeping its graph; gradhooks let go of the call's "
        "inputs when that backward ended (as autograd frees what it saved), so its "
        "per-example gradients cannot be formed. Pass retain_graph=True to the backward before (as autograd needs for a second "
        "backward through a graph), or detach what a later step takes from this one "
        "(h = h.detach(), as in truncated backpropagation through time)."
    )


def _unbatched_hint(shape: tuple[int, ...] | None) -> str:
    """What a refusal adds where the model's first input has one dimension: one example given
    alone (a vector the model reshapes to a batch of one) is a batch of its entries here."""
    if shape is None or len(shape) != 1:
        return ""
    return (
        f" It is 1-d ({tuple(shape)}): if it is one example given alone, unbatched (a vector "
        "the model reshapes to one row), give it as a batch of one, x.unsqueeze(0)."
    )


class CallLayouts:
    """The tracker's view of each call (a part of :class:`gradhooks.Hooks`)."""

    def __init__(self, state: CaptureState) -> None:
        self.state = state

    def call_layout(
        self, target: Target, args: tuple, kwargs: dict, output: Any, tracker: Tracker | None,
        ins: list | None = None, outs: list | None = None,
    ) -> CallLayout | None:  # fmt: skip
        """Where the examples are in a captured call, from the tracker's layouts of its inputs
        (``None`` without a tracker). A call on inputs that do not depend on the examples is
        ``"shared"``: its outputs become the tracker's sources. Raises where the rule would
        read the examples from a dimension that does not hold them."""
        if tracker is None:
            return None
        batch = tracker.batch
        if ins is None:  # (else given by the caller: the same)
            ins = tree_leaves((args, kwargs))
        if outs is None:
            outs = tree_leaves(output)
        if len(ins) == 1 and len(outs) == 1 and target.entry is not FALLBACK:
            usual = self._usual_layout(target, ins[0], outs[0], tracker)
            if usual is not None:
                return usual
        # (the fallback may split where the examples are presumed: its recomputation one
        # example at a time must reproduce the call's output; a rule is never handed them)
        of = tracker.presumed_of if target.entry is FALLBACK else tracker.layout
        lin = tuple([of(t) for t in ins])
        lout = tuple([of(t) for t in outs])
        first = None
        for lay in lin:
            if lay is not None:
                first = lay
                break
        if target.entry is FALLBACK and first is not None and first.dim >= 0:
            # (an input whose examples were lost but whose rows line up with the first's:
            # split like it, which the recomputation checks)
            size = first.size(batch)
            lin = tuple(
                first if lay is UNKNOWN and t.dim() > first.dim and t.shape[first.dim] == size
                else lay
                for t, lay in zip(ins, lin)
            )  # fmt: skip
        if any([lay is MIXED for lay in lin]):
            alone = [tracker.alone.get(t) for t, lay in zip(ins, lin) if lay is MIXED]
            if all(alone):
                raise MixedExamplesError(self._one_example(target, args, kwargs, alone[0], batch))
            ops = tracker.mixing()
            raise MixedExamplesError(
                f"{target.where}: its input ({_shapes(args, kwargs)}) was computed across the "
                f"examples of the batch ({ops}: a reduction, shift or product along it, "
                "entries picked from it, rows that are not examples put among them, or a "
                "reshape that leaves no dimension holding each example whole), so its "
                "rows are not one example each. Where one "
                "example's loss depends on another's, per-example gradients do not exist. Keep "
                "the examples apart in the forward (compute what needs the whole batch outside "
                "the model, or use running statistics: a statistic of the batch, even detached, "
                "makes each example's result depend on the others'), or freeze this layer's "
                "parameters."
                + self._batch_taken(batch, "a sequence-first model, [seq, batch, ...]")
                + (_unbatched_hint(tracker.given_shape) if self.state.batch_dim == "auto" else "")
            )
        if first is PACKED:
            whole = tree_flatten((args, kwargs), is_leaf=lambda a: isinstance(a, PackedSequence))
            rows = None
            if not any(isinstance(a, PackedSequence) for a in whole[0]):
                # (the whole data of a PackedSequence given to a layer with a rule: each row
                # one example's time step, which the rule's rows are, summed per example)
                if target.entry is not FALLBACK:
                    rows = tracker.packed_owners(ins)
            if rows is not None:
                n = rows.size(batch)

                def owned(t: Any, lay: Layout | None) -> Layout | None:
                    entire = lay is PACKED and isinstance(t, Tensor) and t.dim() and len(t) == n
                    return rows if entire else lay

                lin = tuple([owned(t, lay) for t, lay in zip(ins, lin)])
                lout = tuple([owned(t, lay) for t, lay in zip(outs, lout)])
                first = rows
            elif not any(isinstance(a, PackedSequence) for a in whole[0]):
                raise UnsupportedError(
                    f"{target.where}: its input ({_shapes(args, kwargs)}) is the data of a "
                    "PackedSequence, or part of it (the examples' time steps packed together, "
                    "longest sequences first), taken out of the PackedSequence, so its rows are "
                    "not one example each and its rule cannot tell which example each belongs "
                    "to. Give the layer the PackedSequence itself (a recurrent layer), or the "
                    "padded batch (pad_packed_sequence), or freeze its parameters."
                )
        moved = None
        reordered = tracker.reordered
        if reordered:
            moved = next((reordered[t] for t in ins if isinstance(t, Tensor)
                          and t in reordered), None)  # fmt: skip
        if moved is not None:
            raise BatchNotFoundError(
                f"{target.where}: its input ({_shapes(args, kwargs)}) has the examples of the batch in "
                f"another order ({moved} with a permutation of the batch), so its rule would give "
                "each example the gradient of another. Put them back in order before the layer "
                "(x[perm.argsort()]), or freeze its parameters."
            )
        grads = [t for t in outs if isinstance(t, Tensor) and t.requires_grad]
        free = True  # (no output with examples)
        for t, lay in zip(outs, lout):
            if lay is not None and isinstance(t, Tensor):
                free = False
                break
        if first is not None and free and target.entry is not FALLBACK:
            raise BatchNotFoundError(
                f"{target.where}: its input ({_shapes(args, kwargs)}) depends on the examples but "
                "gradhooks lost them inside its forward (an operation it does not see, such as "
                "a custom kernel), so it cannot tell which example each part of its gradient "
                "belongs to. Register a rule for it, or freeze its parameters."
            )
        if first is None or free:
            if not free:
                raise BatchNotFoundError(
                    f"{target.where}: its inputs ({_shapes(args, kwargs)}) do not depend on the "
                    "examples, but its output does: the module reads the batch from somewhere "
                    "else than its inputs (an attribute set by another module?), so its rule "
                    "cannot tell which example each part of its gradient belongs to. Pass that "
                    "tensor as an input, or register a rule for it."
                )
            sources = []
            for t in outs:
                if any(t is g for g in grads):
                    s = Source(target.name, t.shape)
                    tracker.add_source(t, s)
                    sources.append(s)
                else:
                    sources.append(None)
            layout = CallLayout("shared", batch, None, lin, lout)
            layout.sources = tuple(sources)
            return layout
        if first is UNKNOWN:
            layout = CallLayout("unknown", batch, first, lin, lout)
            layout.lost = tuple(tracker.unknown)
            return layout
        frame = self.state.frames[-1] if self.state.frames else None
        root = frame is not None and any(
            x is r for r in frame.roots for x, lay in zip(ins, lin) if lay is first
        )
        if (
            target.entry is FALLBACK
            and any(lay is not None and lay.owners is not None for lay in (*lin, *lout))
            and sole_owner((*lin, *lout)) is None
        ):
            raise UnsupportedError(
                f"{target.where}: a module without a rule given rows picked from the batch by an index "
                f"({_shapes(args, kwargs)}: tokens routed to an expert, or unpadded), so the "
                "examples have different numbers of rows and its torch.func fallback cannot "
                "split them. Make its weights nn.Linear children (each with a rule), register "
                "a rule for it with @gradhooks.register, or freeze its parameters."
            )
        if root and lout and self._reseed_from_output(target, ins, outs, lout, tracker):
            lout = tuple([tracker.layout(t) for t in outs])
        if first.owners is not None or target.entry is FALLBACK:
            tracker.note_placed(target.module, target.where, _shapes(args, kwargs), lin)
        if first is PACKED and target.entry is not FALLBACK:
            packed = _packed_in_order(args, kwargs, tracker)
            if packed is not None:
                return CallLayout("owners", batch, packed, lin, lout, root=root)
        if first is PACKED or target.entry is FALLBACK:
            layout = CallLayout("plain", batch, first, lin, lout, root=root)
            if target.entry is FALLBACK and first is not PACKED:
                layout.sources = _shared_outputs(target, outs, lout, grads, tracker)
            return layout
        dim = target.entry.batch_dim_of(target.module)
        if first.owners is not None:
            want = 0 if dim == "positions" else dim
            # (an output may hold the rows on another dimension, as a recurrent layer's
            # states [layers, rows, hidden] do: where each of its rows is, is its rule's)
            same = [lay == first for lay in lin if lay is not None] + [
                lay.owners == first.owners for lay in lout if lay is not None
            ]
            if first.dim == want and all(same):
                return CallLayout("owners", batch, first, lin, lout, root=root)
            layout = CallLayout("mismatch", batch, first, lin, lout)
            layout.lost = (
                f"{target.where}: its input ({_shapes(args, kwargs)}) holds rows picked from the "
                f"batch by an index on {first.describe(batch)}, but its rule reads each "
                f"row's example from dimension {want}, or its inputs and outputs hold "
                "different rows. Give the layer the picked rows on dimension "
                f"{want}, or freeze its parameters.",
            )
            return layout
        if dim == "positions":
            kind = "plain" if first.dim == 0 and first.plain else "moved"
            return CallLayout(kind, batch, first, lin, lout, root=root)
        if first.dim != dim:
            first = self._aligned_first(ins, lin, first, dim, batch)
        if first.dim != dim and self._reseed(target, tracker, ins, outs, dim):
            return self.call_layout(target, args, kwargs, output, tracker)
        if first.dim != dim:
            layout = CallLayout("mismatch", batch, first, lin, lout)
            layout.lost = (
                f"{target.where}: the examples are on {first.describe(batch)} of its input "
                f"({_shapes(args, kwargs)}), but its rule reads them from dimension {dim}. Its "
                "per-example gradients would mix examples. Give the layer its input with the "
                f"batch on dimension {dim} (batch_first=..., x.transpose(...)), or say where the "
                "model's batch is with add_hooks(..., batch_dim=k).",
            )
            return layout
        return CallLayout("plain" if first.plain else "fold", batch, first, lin, lout, root=root)

    def _usual_layout(self, target: Target, x: Any, y: Any, tracker: Tracker) -> CallLayout | None:
        """:meth:`call_layout` of the usual call of a module with a rule, its one input ``x``
        and one output ``y`` followed by the tracker (``ins`` and ``outs`` of one leaf each),
        in fewer steps: where ``x`` holds the examples (not rows picked by an index, nor a
        tensor of the forward's own inputs, whose layout may be reseeded), on the dimension
        the rule reads them from, no tensor of the forward is reordered along the batch, and
        ``y`` has a layout too. ``None`` where any of that does not hold: then the call is
        judged as any other, whose every refusal this path never reaches."""
        lx = tracker.layout(x)
        if lx is None or lx.dim < 0 or lx.owners is not None or tracker.reordered.entries:
            return None
        ly = tracker.layout(y)
        if ly is None:
            return None
        if self.state.frames:
            for r in self.state.frames[-1].roots:
                if r is x:
                    return None
        kind = _kind_of(target.entry.batch_dim_of(target.module), lx)
        if kind is None:
            return None
        return CallLayout(kind, tracker.batch, lx, (lx,), (ly,))

    def _one_example(
        self, target: Target, args: tuple, kwargs: dict, alone: tuple[str, int], batch: int
    ) -> str:
        """The refusal of a call given one example taken out of the batch alone (``x[i]``,
        ``x.unbind(0)``, ``for xi in x``): each such call sees one example, but no dimension of
        its input holds the batch, where the rules read each row's example."""
        op, dim = alone
        before = ":, " * dim
        if dim == 0:
            pick, keep = (
                "x[i], x.unbind(0) or for xi in x",
                "x[i : i + 1], x[i][None] or x.split(1)",
            )
        else:
            pick = f"x[{before}i] or x.unbind({dim})"
            keep = f"x.transpose(0, {dim})[i : i + 1] or x.transpose(0, {dim}).split(1)"
        return (
            f"{target.where}: its input ({_shapes(args, kwargs)}) is one example taken out of "
            f"the batch alone (by {op}: {pick}, on the batch's dimension {dim}). Each such call "
            "sees one example, but its input has no batch dimension left, where the rule reads "
            f"which example each row is. Keep that dimension, of size 1, first: {keep} gives "
            "each call its example as a batch of one, which gradhooks follows (join the "
            "outputs with torch.cat, not torch.stack)."
            + self._batch_taken(
                batch, "a sequence-first input looped over its time steps, [seq, batch, ...]"
            )
        )

    def _batch_taken(self, batch: int, other: str) -> str:
        """Under ``batch_dim="auto"``, the sentence of a refusal that says which dimension of
        the model's first input was taken for the batch (``other``: a layout where it would be
        another); nothing under a ``batch_dim`` the user gave."""
        if self.state.batch_dim != "auto":
            return ""
        frame = self.state.frames[-1] if self.state.frames else None
        if frame is not None and frame.reseeded is not None:
            dim, where = frame.reseeded
            return (
                f" The batch was taken as dimension {dim} of the model's first input ({batch} "
                f"examples), where its first layer, {where}, reads it (a sequence-first "
                "layer: batch_first=False). If the examples are on dimension 0 ([batch, seq, "
                "...]), that layer runs along the batch as its time steps: give it "
                "batch_first=True, or x.transpose(0, 1) as its input."
            )
        return (
            f" The batch was taken as dimension 0 of the model's first input ({batch} "
            f"examples): if it is another dimension ({other}), say which with "
            "add_hooks(model, batch_dim=k)."
        )

    @staticmethod
    def _aligned_first(ins: list, lin: tuple, first: Layout, dim: int, batch: int) -> Layout:
        """Where the call's first input does not depend on the examples but has as many rows as
        the batch on dimension ``dim``, and another input holds the examples elsewhere (a
        recurrent layer's batch-free first step, a start token's embedding, run from each
        example's state ``[layers, batch, hidden]``): the module takes that input's rows with
        the examples', so the examples are on ``dim``. Else ``first``."""
        x = next(((t, lay) for t, lay in zip(ins, lin) if isinstance(t, Tensor)), None)
        if x is None or x[1] is not None or first.dim < 0 or first.owners is not None:
            return first
        t = x[0]
        if t.dim() <= dim or t.shape[dim] != first.size(batch):
            return first
        return first.at(dim)

    def _reseed(self, target: Target, tracker: Tracker, ins: list, outs: list, dim: int) -> bool:
        """``batch_dim="auto"`` takes dimension 0 of the model's first input as the batch;
        where the first hooked call takes that very input and reads its batch from dimension
        ``dim`` (a sequence-first layer), the batch is dimension ``dim`` instead (once, at the
        first call of the forward)."""
        frame = self.state.frames[-1] if self.state.frames else None
        if self.state.batch_dim != "auto" or frame is None or frame.signature or not frame.roots:
            return False
        x = next((t for t in ins if isinstance(t, Tensor)), None)
        if x is None or not any(x is r for r in frame.roots) or x.dim() <= dim:
            return False
        batch = x.shape[dim]
        tracker.batch = batch
        tracker.layouts.clear()
        for t in frame.roots:
            if t.dim() > dim and t.shape[dim] == batch:
                tracker.set_layout(t, Layout(dim))
        for t in outs:  # (computed under the other reading: not followed further)
            if isinstance(t, Tensor):
                tracker.set_layout(t, UNKNOWN)
        frame.roots = []
        frame.reseeded = (dim, target.where)
        return True

    def _reseed_from_output(
        self, target: Target, ins: list, outs: list, lout: tuple, tracker: Tracker
    ) -> bool:
        """``batch_dim="auto"`` takes each entry of a 1-D first input for an example; where the
        first hooked call takes that very input, its rule reads the examples from dimension 0
        of the output, and the tracker lost them inside the call (``nn.EmbeddingBag`` given
        every example's tokens in one flat tensor, cut into bags by ``offsets``), the rows of
        the output are the examples instead (once, at the first call of the forward). The
        layer's own count is checked at the backward (as without the tracker)."""
        frame = self.state.frames[-1] if self.state.frames else None
        if (
            self.state.batch_dim != "auto" or frame is None or frame.signature or not frame.roots
            or target.entry is FALLBACK or target.entry.batch_dim_of(target.module) != 0
        ):  # fmt: skip
            return False
        x = next((t for t in ins if isinstance(t, Tensor)), None)
        if x is None or x.dim() != 1 or not any(x is r for r in frame.roots):
            return False
        found = [t for t in outs if isinstance(t, Tensor)]
        if not found or any(lay is not UNKNOWN for lay in lout) or found[0].dim() == 0:
            return False
        rows = found[0].shape[0]
        if rows == tracker.batch or any(t.dim() == 0 or t.shape[0] != rows for t in found):
            return False
        tracker.batch = rows
        tracker.layouts.clear()
        for t in found:
            tracker.set_layout(t, Layout(0))
        frame.roots = []
        return True

    def reseed_before(
        self, target: Target, module: nn.Module, args: tuple, kwargs: dict, tracker: Tracker
    ) -> None:
        """:meth:`_reseed` as the first hooked call starts (a sequence-first layer given the
        model's input), so that the operations inside it are followed from the right batch."""
        if target.entry is FALLBACK:
            return
        frame = self.state.frames[-1] if self.state.frames else None
        if self.state.batch_dim != "auto" or frame is None or frame.signature or not frame.roots:
            return  # (as _reseed would find, before the inputs' layouts are looked up)
        dim = target.entry.batch_dim_of(module)
        if not isinstance(dim, int) or isinstance(dim, bool):
            return
        ins = tree_leaves((args, kwargs))
        first = next((tracker.layout(t) for t in ins if tracker.layout(t) is not None), None)
        if first is not None and first.dim >= 0 and first.dim != dim:
            self._reseed(target, tracker, ins, [], dim)

    def direct_source(self, source: Source, p: nn.Parameter) -> None:
        """The tracker saw ``p`` used outside its module's call (a parent's
        ``F.linear(h, self.wte.weight)``, a table read as ``self.emb.weight``): its per-example
        gradients from that use are the source's, given to ``p.grad1`` when its gradient is
        complete (:meth:`BackwardWriter.param_hook`)."""
        self.state.direct.setdefault(id(p), weakref.WeakSet()).add(source)
        if self.state.frames:
            frame = self.state.frames[-1]
            self.state.source_frames[source] = frame
            frame.direct.append(id(p))
        if self.state.collector is not None:
            self.state.collector.expect({source.name: p})

    def plain_call(self, target: Target, module: nn.Module, args: tuple, kwargs: dict) -> bool:
        """Whether a call about to run has its examples where its rule reads them (the paths
        that run a call detached assume so); true without a tracker."""
        tracker = self.state.tracker()
        if tracker is None:
            return True
        first = next((tracker.layout(t) for t in tree_leaves((args, kwargs))
                      if tracker.layout(t) is not None), None)  # fmt: skip
        if first is None or first is UNKNOWN:
            return False
        if first is PACKED:
            return True
        dim = target.entry.batch_dim_of(module)
        want = 0 if dim == "positions" else dim
        if first.dim != want and self._reseed(
            target, tracker, tree_leaves((args, kwargs)), [], want
        ):
            first = next(tracker.layout(t) for t in tree_leaves((args, kwargs))
                         if tracker.layout(t) is not None)  # fmt: skip
        return first.plain and first.dim == want

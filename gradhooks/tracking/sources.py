"""Sources and meetings: batch-free tensors whose per-example gradients are wanted, and the
operations where they meet the batch (see :mod:`gradhooks.tracking.tracker`)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .. import _torch, loop
from ..autocast import autocast_as, autocast_state
from .layout import Layout, batch_rows, example_mask, owner_vector
from .link import EngineLink
from .ops.common import arg, is_inplace, norm_dim, out_tensors, tensor_args
from .ops.pointwise import is_pointwise

if TYPE_CHECKING:
    from .tracker import Tracker


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


# along the batch (elementwise, concatenation along another dimension, batched matrix products)
SPREADS = frozenset({"expand", "expand_as", "broadcast_to", "repeat"})
COPIES = frozenset({"contiguous", "clone"})  # (the same values: an expansion stays one)
_ROWWISE = frozenset({"cat", "concat", "concatenate", "bmm", "matmul", "__matmul__", "baddbmm"})


def rowwise(name: str) -> bool:
    """Whether ``name`` uses an operand expanded to the batch row by row with it: elementwise,
    or :data:`_ROWWISE`."""
    return name in _ROWWISE or is_pointwise(name)


# elementwise operations through which a batch-free operand may be expanded along the batch
EXPANDABLE = frozenset(
    """add sub mul div true_divide addcmul addcdiv lerp where masked_fill maximum minimum pow
    atan2 hypot fmod remainder clamp float_power xlogy logaddexp copysign
    __add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__
    __truediv__ __rtruediv__ __itruediv__ __pow__ __rpow__ add_ sub_ mul_ div_ addcmul_
    addcdiv_ lerp_ masked_fill_ clamp_ pow_""".split()
)


def aligned_sources(
    tracker: Tracker, name, args, kwargs, tainted, outs, lays
) -> dict[Source, Layout]:
    """The sources that an elementwise operation uses as they are, row by row with the
    batch (a lookup of positions expanded to the batch before the layer, added to the
    batch): ``{source: where its output holds the examples}``."""
    if not is_pointwise(name) or len(outs) != 1 or lays[0] is None:
        return {}
    out, lay = outs[0], lays[0]
    found = {}
    for t in tainted:
        srcs = tracker.taints.get(t, frozenset())
        j = lay.dim - (out.dim() - t.dim())
        if len(srcs) != 1 or j < 0 or t.shape[j] != out.shape[lay.dim]:
            continue
        (s,) = srcs
        if tracker.edges[s] == torch.autograd.graph.get_gradient_edge(t) and not hasattr(
            s, "param"
        ):
            found[s] = lay.at(j)
    return found


def expanded_meeting(tracker: Tracker, func, name, args, kwargs, tainted) -> Any:
    """An elementwise meeting: run it with each batch-free operand expanded along the batch
    dimension of the result; the expanded operands' gradients are per example."""
    if name not in EXPANDABLE or not tainted or _torch.saved_tensor_hooks_active():
        return None  # (checkpointed: the expanded operand would be saved in its place)
    others = [t for t in tensor_args(args, kwargs) if tracker.layouts.get(t) is not None]
    if not others or any(tracker.layouts[t].dim < 0 for t in others):
        return None  # (unknown, packed or mixed: no batch dimension to expand along)
    if is_inplace(name) and any(args and t is args[0] for t in tainted):
        return None  # the batch written into a batch-free tensor
    try:
        shape = torch.broadcast_shapes(*(t.shape for t in tensor_args(args, kwargs)))
    except RuntimeError:
        return None
    n = len(shape)
    lay = None
    for t in others:
        cand = tracker.layouts[t].at(tracker.layouts[t].dim + n - t.dim())
        if lay not in (None, cand):
            return None
        lay = cand
    size = lay.size(tracker.batch)
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
        hooks.append((e, t, tracker.all_sources(t), e.shape == v.shape))
    new_args, new_kwargs = swapped(args, kwargs, swaps)
    out = func(*new_args, **new_kwargs)
    tracker.propagate(name, new_args, new_kwargs, out)
    batch = tracker.batch
    for e, t, srcs, same in hooks:
        for s in srcs:
            s.uses.append(("expanded", name))
        t_shape, t_ref = t.shape, torch.autograd.graph.get_gradient_edge(t)
        srcs_list = tuple(srcs)
        edges = {s: tracker.edges[s] for s in srcs_list}
        engine = tracker.engine

        def hook(g, lay=lay, t_shape=t_shape, t_ref=t_ref, edges=edges, engine=engine, same=same):
            # [batch, ..., outer * inner, ...]: each example's rows summed, as broadcasting
            # would have summed all of them
            per = _rows_summed(g, lay, batch).reshape(batch, *t_shape)
            deliver(engine, edges, per, t_ref)
            # an expand of nothing (a batch of one) and the reshape pass the gradient on as
            # views of it, where broadcasting would have summed it into a tensor of its own:
            # two parameters added to one activation would each receive a view of one
            # gradient, which autograd keeps as both .grad (one memory, into which a later
            # zero_grad(set_to_none=False) and backward add both): a copy of its own
            return g.clone() if same else None

        e.register_hook(hook)
    return out


def _rows_summed(g: Tensor, lay: Layout, batch: int) -> Tensor:
    """``[batch, *g.shape]`` but for ``lay``'s dimension, of one entry: each example's rows of
    ``g`` summed (rows picked by an index: by their owners, as many as each has)."""
    if lay.owners is None:
        return batch_rows(g, lay, batch).sum(lay.dim + 1, keepdim=True)
    rows = g.movedim(lay.dim, 0)
    per = rows.new_zeros(batch, *rows.shape[1:])
    per.index_add_(0, owner_vector(lay, batch, g.device), rows)
    return per.unsqueeze(1).movedim(1, lay.dim + 1)


# in-place operations whose result's gradient is its first operand's (``self``'s)
INTO_SELF = frozenset({"add_", "sub_", "__iadd__", "__isub__"})


def into_meeting(tracker: Tracker, func, name, args, kwargs, tainted) -> Any:
    """The batch added in place into a batch-free tensor derived from sources (normalizing
    flows: ``log_q = torch.zeros(len(x))``, then ``log_q += log_det``, a number of no example,
    then ``log_q += the batch's``). The tensor's gradient is the result's, so each example's
    share of it is the example's rows of the result's gradient; from then on the tensor holds
    the batch, and is no longer derived from the sources (what reaches them through it has
    been given here)."""
    t = args[0] if args else None
    if name not in INTO_SELF or len(tainted) != 1 or tainted[0] is not t:
        return None
    if tracker.batch * t.numel() > Meeting.CHUNK:
        return None  # (its examples' gradients, [batch, *shape], would not fit: refused)
    others = [o for o in tensor_args(args, kwargs) if o is not t]
    lays = [tracker.layouts.get(o) for o in others]
    if not others or any(lay is None or lay.dim < 0 or lay.owners is not None for lay in lays):
        return None  # (a batch-free operand, or one of unknown, mixed or picked rows)
    n = t.dim()
    found = {lay.at(lay.dim + n - o.dim()) for o, lay in zip(others, lays)}
    if len(found) != 1:
        return None
    (lay,) = found
    if lay.dim < 0 or t.shape[lay.dim] != lay.size(tracker.batch):
        return None
    srcs = tracker.all_sources(t)
    if any(getattr(s, "soft", False) for s in srcs):
        return None  # (its module's fallback takes it over: the general meeting)
    before = torch.autograd.graph.get_gradient_edge(t)
    out = func(*args, **kwargs)
    tracker.propagate(name, args, kwargs, out)
    if t in tracker.taints:
        del tracker.taints[t]
    for s in srcs:
        s.uses.append(("meet", name))
    edges = {s: tracker.edges[s] for s in srcs}
    batch, engine = tracker.batch, tracker.engine

    def hook(grad_outputs, lay=lay, edges=edges, before=before, engine=engine):
        g = grad_outputs[0]
        if g is not None:
            per = g.unsqueeze(0) * example_mask(g.shape, lay, batch, g.device)
            deliver(engine, edges, per, before)

    t.grad_fn.register_prehook(hook)
    return out


def spread_meeting(tracker: Tracker, func, name, args, kwargs, tainted) -> Any:
    """A meeting whose batch-free operands were expanded (or repeated) to the batch before
    it (a class token, ``cls.expand(batch, -1, -1)``, concatenated with the patches): the
    operation treats them row by row with the batch, so its plain gradient of each, taken
    through an alias, holds each example's share in that example's rows; summed over the
    rows the expansion copied, it is the per-example gradient of what was expanded."""
    if not rowwise(name):
        return None
    if is_inplace(name) and any(args and t is args[0] for t in tainted):
        return None  # the batch written into what was expanded
    others = [t for t in tensor_args(args, kwargs) if tracker.layouts.get(t) is not None]
    if any(tracker.layouts[t].owners is not None for t in others):
        return None  # (rows picked by an index: the general meeting, by example masks)
    plans = []
    for t in tainted:
        found = tracker.spread.get(t)
        x = next((o for o in others if o.dim() == t.dim()), None)
        if found is None or x is None:
            return None
        lay = tracker.layouts[x]
        if lay.dim < 0 or t.shape[lay.dim] != x.shape[lay.dim]:
            return None  # (unknown, packed or mixed: no batch dimension to take rows of)
        if name in ("cat", "concat", "concatenate"):
            dim = arg(args, kwargs, 1, "dim", 0)
            if norm_dim(dim, t.dim()) == lay.dim:
                return None
        elif not is_pointwise(name) and lay.dim >= t.dim() - 2:
            return None  # (a matrix product's rows or columns: not row by row)
        source, how = found
        j = lay.dim
        k = source.dim() - (t.dim() - j)  # the source's dimension along the batch
        if how != "repeat" and k >= 0 and source.shape[k] != 1:
            return None  # (already as long as the batch: the expansion copied nothing)
        if how == "repeat":
            k = source.dim() - (t.dim() - j)  # the source's dimension that was repeated
            if k < 0 or source.shape[k] != lay.inner:
                return None
        plans.append((t, lay, source, how))
    swaps, hooks = {}, []
    for t, lay, source, how in plans:
        alias = t.view_as(t)
        swaps[id(t)] = alias
        hooks.append((alias, lay, source, how, tracker.all_sources(source)))
    new_args, new_kwargs = swapped(args, kwargs, swaps)
    out = func(*new_args, **new_kwargs)
    tracker.propagate(name, new_args, new_kwargs, out)
    batch, engine = tracker.batch, tracker.engine
    for alias, lay, source, how, srcs in hooks:
        for s in srcs:
            s.uses.append(("spread", name))
        edges = {s: tracker.edges[s] for s in srcs}
        at = torch.autograd.graph.get_gradient_edge(source)
        shape = source.shape

        def hook(g, lay=lay, how=how, shape=shape, edges=edges, at=at):
            rows = batch_rows(g, lay, batch)  # [batch, ..., outer * inner, ...]
            d = lay.dim + 1
            if how == "repeat":
                rows = rows.unflatten(d, (lay.outer, lay.inner)).sum(d)
                # tiled along other dimensions too (MAE's mask tokens, ``repeat(batch,
                # masked, 1)``): each tile's gradient summed into the source's
                for i in reversed(range(rows.dim() - len(shape), rows.dim())):
                    size = shape[i - rows.dim() + len(shape)]
                    if rows.shape[i] != size:
                        rows = rows.unflatten(i, (rows.shape[i] // size, size)).sum(i)
            else:
                rows = rows.sum(d, keepdim=True)
            lead = (1,) * (rows.dim() - 1 - len(shape))
            per = rows.sum_to_size(batch, *lead, *shape).reshape(batch, *shape)
            deliver(engine, edges, per, at)

        alias.register_hook(hook)
    return out


def deliver(
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


class Meeting:
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
        self.versions = [(t, _torch.version(t)) for t in tensor_args(self.args, self.kwargs)]
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
        # run again at the backward, outside the forward's autocast: under it again, which
        # gives the operation its forward's dtypes (a bfloat16 input, float32 parameters)
        self.autocast = autocast_state()

    def arm(self) -> None:
        """Hook the autograd node of each output. Outputs from several nodes
        (``multi_head_attention_forward``'s output and its attention weights) are differentiated
        again at each node's backward with that node's gradients alone: the per-example
        gradients are linear in the output-gradients, so their sum is the whole's."""
        for node in {id(n): n for n, _ in self.nodes if n is not None}.values():
            node.register_prehook(lambda grad_outputs, node=node: self.backward(grad_outputs, node))

    def backward(self, grad_outputs, node) -> None:
        if self.engine is not None and self.engine.probing:
            return  # (the engine's check of one example, which captures nothing)
        grads = [
            grad_outputs[nr] if n is node and nr < len(grad_outputs) else None
            for n, nr in self.nodes
        ]
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
        per_example = self._per_example(grads, node)
        for e, per, edges in zip(self.edges, per_example, self.src_edges):
            deliver(self.engine, edges, per, e)

    def _per_example(self, grads, node) -> list[Tensor]:
        """Each example's share of the gradient of every tainted operand, from the gradients
        ``grads`` of the outputs of ``node``. Where another output, from another node, is
        computed on the way to these (an LSTM cell's ``c'``, which its ``h'`` is made from,
        where torch runs the cell as several nodes), the share that reaches the operands
        through it is left out here: it is in that output's gradient, counted at its node."""
        batch = self.batch

        with torch.enable_grad(), autocast_as(self.autocast):
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
            outs = out_tensors(self.func(*args, **kwargs))
            pairs = [(o, g, lay) for o, g, lay in zip(outs, grads, self.layouts) if g is not None]
            others = [o for o, (n, _) in zip(outs, self.nodes) if n is not node and o.requires_grad]
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
                if others:
                    got = self._less_through(others, [o for o, _, _ in pairs], cots, leaves, got)
                for j, (leaf, gj) in enumerate(zip(leaves, got)):
                    parts[j].append(
                        torch.zeros((stop - start, *leaf.shape), dtype=leaf.dtype,
                                    device=leaf.device) if gj is None else gj
                    )  # fmt: skip
        return [torch.cat(p) for p in parts]

    @staticmethod
    def _less_through(others, outs, cots, leaves, got) -> list[Tensor | None]:
        """``got`` (the operands' gradients from ``outs`` with cotangents ``cots``, batched)
        less what reaches them through ``others``: with one other output on the way, exactly
        the share its own node's gradient holds again; with more, the paths through several of
        them would be taken off more than once, so nothing is (the check of the sums refuses
        the call then, naming it)."""
        into = torch.autograd.grad(
            outs, others, cots, retain_graph=True, allow_unused=True, is_grads_batched=True
        )
        reached = [(o, c) for o, c in zip(others, into) if c is not None]
        if len(reached) != 1:
            return got
        ((other, c),) = reached
        back = torch.autograd.grad(
            [other], leaves, [c], retain_graph=True, allow_unused=True, is_grads_batched=True
        )
        return [g if b is None else (-b if g is None else g - b) for g, b in zip(got, back)]


def _detached(a: Any) -> Any:
    if isinstance(a, Tensor):
        return a.detach()
    if type(a) in (list, tuple):
        return type(a)(_detached(x) for x in a)
    return a


def swapped(args: tuple, kwargs: dict, swaps: dict[int, Tensor]) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with each tensor whose id is in ``swaps`` replaced by its swap,
    also inside a list or tuple argument."""

    def swap(a: Any) -> Any:
        if isinstance(a, Tensor):
            return swaps.get(id(a), a)
        if type(a) in (list, tuple):
            return type(a)(swaps.get(id(x), x) if isinstance(x, Tensor) else x for x in a)
        return a

    return tuple(swap(a) for a in args), {k: swap(v) for k, v in kwargs.items()}

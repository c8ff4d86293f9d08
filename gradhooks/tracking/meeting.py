"""Where tensors derived from sources meet the batch, as the tracker sees it happen.

See :mod:`.sources` for what a source is, and the module docstring of :mod:`.tracker` for why
meetings are followed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .. import _torch
from .layout import MIXED, PACKED
from .ops.common import is_inplace, op_name, out_tensors, tensor_args
from .ops.names import UNFUSED
from .ops.pointwise import is_pointwise
from .sources import Meeting, aligned_sources, expanded_meeting, into_meeting, spread_meeting

if TYPE_CHECKING:
    from .tracker import Tracker


def meet(tr: Tracker, func, name, args, kwargs, tensors, direct) -> Any:
    """An operation where tensors derived from sources meet tensors with a layout."""
    ids = {id(d) for d in direct}
    tainted = list({id(t): t for t in tensors if tr.taints.get(t) or id(t) in ids}.values())
    for t in tensors if tr.lineage else ():
        tr.joined |= tr.lineage.get(t, frozenset())  # (met as batched)
    # (the graph turned off inside the call: its parameters' gradients from here come
    # from a backward written by hand)
    lost = not torch.is_grad_enabled() and tr.graph_where_called()
    if tr.engine is not None and direct and not lost and not any(tr.taints.get(t) for t in tensors):
        out = tr.engine.functional_use(func, name, args, kwargs, direct, tr)
        if out is not NotImplemented:
            for p in direct:  # (a module without a rule that covers it leaves it to this)
                where = tr.covering(id(p))
                if where is not None:
                    tr.used[where].functional.add(id(p))
            return out
    for p in direct:
        tr.param_source(p)
    if lost or any(not t.requires_grad for t in tainted):
        if not torch.is_grad_enabled():
            # (inside a custom autograd.Function's forward, whose own backward gives the
            # sources a gradient gradhooks cannot split by example, or under no_grad)
            out = func(*args, **kwargs)
            tr.propagate(name, args, kwargs, out)
            why = (
                f"'{name}' combines it with the batch where autograd records no graph "
                "(inside a custom autograd.Function's forward, or under torch.no_grad), "
                "so gradhooks cannot follow its gradient from there"
            )
            for t in tainted:
                for s in tr.all_sources(t):
                    s.problem = s.problem or why
                    if tr.engine is not None:  # (no graph holds it: kept to be told)
                        tr.engine.unheld(s)
            return out
        tainted = [t for t in tainted if t.requires_grad]  # (detached: no gradient back)
        if not tainted:
            out = func(*args, **kwargs)
            tr.propagate(name, args, kwargs, out)
            return out
    fast = expanded_meeting(tr, func, name, args, kwargs, tainted)
    if fast is None:
        fast = into_meeting(tr, func, name, args, kwargs, tainted)
    if fast is None:
        fast = spread_meeting(tr, func, name, args, kwargs, tainted)
    if fast is not None:
        return fast
    out = func(*args, **kwargs)
    tr.propagate(name, args, kwargs, out)
    outs = [o for o in out_tensors(out)]
    lays = [tr.layouts.get(o) for o in outs]
    srcs = {t: tr.all_sources(t) for t in tainted}
    soft = {s for ss in srcs.values() for s in ss if getattr(s, "soft", False)}
    for s in soft:  # (its module's fallback takes it over: cheaper than a masked backward)
        s.needs_fallback = True
    srcs = {t: ss - soft for t, ss in srcs.items()}
    tainted = [t for t in tainted if srcs[t]]
    if not tainted:
        return out
    if is_pointwise(name) and all(o.dim() == 0 for o in outs):
        for s in set().union(*srcs.values()):  # a term added to the loss itself (weight
            s.uses.append(("loss", name))  # decay): no example's; not delivered
        return out
    followed = not any(lay is None or lay.dim < 0 for lay in lays)
    if followed and is_inplace(name) and not any(args and t is args[0] for t in tainted):
        # added in place into the batch (TAPAS: embeddings += token_type_embeddings(ids)):
        # as the operation out of place where each source's output is used as it is, row
        # by row with the batch; else (no meeting can run an in-place operation again)
        # refused below
        aligned = aligned_sources(tr, name, args, kwargs, tainted, outs, lays)
        every = set().union(*(srcs[t] for t in tainted))
        if every <= set(aligned):
            for s in every:
                s.uses.append(("aligned", aligned[s]))
            tr.unmet |= every  # (no meeting holds them: finish still sees them)
            return out
    if not followed or is_inplace(name):
        met = {*lays, *(tr.layouts.get(t) for t in tensors)}
        if is_inplace(name):
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
                f"examples at once ({tr.mixing(name)}), so the examples' shares "
                "of its gradient do not exist"
            )
        elif name in UNFUSED:
            why = f"'{name}' is a fused operation no rule covers yet: {UNFUSED[name]}"
        else:
            lost = ", ".join(tr.unknown)
            why = f"'{name}' combines it with the batch in a way gradhooks cannot follow" + (
                f" (the batch was lost before it, through {lost})" if lost else ""
            )
        for s in set().union(*srcs.values()):
            s.problem = s.problem or why
        return out
    srcs = {t: srcs[t] for t in tainted}
    meeting = Meeting(tr, func, name, args, kwargs, tainted, srcs, outs, lays)
    tr.meetings.append(meeting)
    aligned = aligned_sources(tr, name, args, kwargs, tainted, outs, lays)
    for s in set().union(*srcs.values()):
        s.uses.append(("aligned", aligned[s]) if s in aligned else ("meet", name))
    return out


def note_transformed(tr: Tracker, func, args: tuple, kwargs: dict) -> None:
    """A call inside a ``torch.func`` transform (``vmap``, ``grad``) run in the forward:
    the transform's tensors wrap the forward's, which the tracker cannot follow through it.
    A parameter used outside its module's call, or a tensor made from one, that enters it
    may meet the batch there unseen, so its per-example gradient would miss that use:
    marked, so that a backward that reaches it refuses rather than leaves it out."""
    why = (
        f"'{op_name(func)}' runs it inside a torch.func transform (vmap, grad) in the "
        "forward, where gradhooks cannot follow the examples"
    )
    for t in tensor_args(args, kwargs):
        base = _torch.functorch_base(t)
        if base is t:
            continue
        for s in tr.all_sources(base):
            s.problem = s.problem or why


def vmapped_rows(tr: Tracker, func, args: tuple, kwargs: dict) -> str | None:
    """Why a call inside a ``torch.func.vmap`` run in the forward (not one of gradhooks' own)
    may combine the examples; ``None`` where each of its vmapped calls sees one example's
    rows alone. The tracker cannot follow the examples through the ``vmap`` (its result
    depends on no example, as far as it can tell), so it checks the tensors that enter it:
    one that holds the examples must be batched by the ``vmap`` over the dimension that holds
    them, in order. Captured from outside it unbatched (``vmap(lambda o: o - h.mean(0))(h)``,
    every example meeting the others), batched over another dimension (``in_dims=1``), or
    holding rows that are not the examples in order (``h.roll(1, 0)`` beside ``h``), it may
    mix them. Without the internal that reads a ``vmap``'s dimension, any tensor with the
    examples is taken so."""
    tensors = tensor_args(args, kwargs)
    internal = _torch.available("functorch_batched")
    if internal and not any(_torch.is_batched(t) for t in tensors):
        return None  # (a torch.func.grad's tensors alone, or none transformed: not a vmap)
    for t in tensors:
        base = _torch.functorch_base(t)
        lay = tr.layout(base)
        if lay is None:
            continue  # (no example in it: made inside the vmap, or shared by the batch)
        got = _torch.batched_on(t)
        shape = tuple(base.shape)
        if lay.dim < 0 or not lay.plain:  # (MIXED, UNKNOWN, PACKED, rows picked or folded)
            what = f"a tensor {shape} computed across the examples, or not holding them in order"
        elif got is None or got[0] is not base:
            what = (
                f"a tensor {shape} that holds the {tr.batch} examples unbatched (captured "
                "from outside the vmap, or vmapped more than once): each call meets them all"
            )
        elif got[1] != lay.dim:
            what = (
                f"a tensor {shape} vmapped over its dimension {got[1]}, while the examples "
                f"are on its dimension {lay.dim}"
            )
        else:
            continue
        return f"{tr.in_call(op_name(func))} inside a torch.func.vmap in the forward, given {what}"
    return None


def guard_vmapped(tr: Tracker, func, args: tuple, kwargs: dict, why: str) -> Any:
    """Run a call that :func:`vmapped_rows` says may mix the examples (``why``), and arm the
    autograd node of each of its results: a backward that writes ``grad1`` and reaches it is
    refused (:meth:`~.link.EngineLink.lost_reached`), as one through an operation that lost
    the examples' rows is."""
    out = func(*args, **kwargs)
    engine = tr.engine
    if engine is None:
        return out
    for o in out_tensors(out):
        node = _torch.functorch_base(o).grad_fn
        if node is None:
            continue
        # (the hook holds the nodes after this one, not this one: no cycle through the graph)
        after = tuple(n for n, _ in node.next_functions if n is not None)
        node.register_prehook(lambda grad_outputs, after=after: engine.lost_reached(why, after))
    return out

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
    lost = not torch.is_grad_enabled() and tr._graph_where_called()
    if tr.engine is not None and direct and not lost and not any(tr.taints.get(t) for t in tensors):
        out = tr.engine.functional_use(func, name, args, kwargs, direct, tr)
        if out is not NotImplemented:
            for p in direct:  # (a module without a rule that covers it leaves it to this)
                where = tr._covering(id(p))
                if where is not None:
                    tr.used[where].functional.add(id(p))
            return out
    for p in direct:
        tr._param_source(p)
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

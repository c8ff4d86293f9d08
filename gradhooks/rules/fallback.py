"""The fallback rule: per-example gradients of any module, by ``torch.func``, from its captured call.

A module with trainable parameters and no rule (a custom layer, a layer no rule covers yet, or a
module whose ``forward`` uses bare ``nn.Parameter`` s such as a ViT class token) is recomputed one
example at a time from the inputs its forward hook captured::

    grad1[b] = vjp(θ ↦ module(θ, x[b:b+1]), θ)(g[b:b+1])      for b in batch (torch.func.vmap)

with ``θ`` the module's own trainable parameters (``recurse=False``), every other parameter and
buffer held fixed, and ``g`` the captured gradient of the loss with respect to the call's outputs.
Children keep their own rules: inside the recomputation they run under ``torch.func``, where the
engine's forward hook captures nothing, so nothing is counted twice.

A module can use a submodule's parameter without calling the submodule
(``nn.MultiheadAttention`` reads ``out_proj.weight``); the fallback sees which hooked submodules
its recomputation called and also differentiates with respect to the parameters of those that
were not called.

Assumptions, all checked (a clear error otherwise):

- Dimension 0 of every output tensor that receives a gradient is the batch ``B``; besides
  them, one output of shape ``()`` (an auxiliary loss a gate returns) may receive one: its
  value must be the mean or the sum of each example's, recomputed alone, and each example
  gets that share of its gradient (``1/B`` or all of it) (not under ``create_graph``).
- A tensor input (positional or keyword) whose dimension 0 has size ``B`` is batched; any other
  tensor input (an attention mask ``[seq, seq]``) is shared by every example. When a shared
  tensor's dimension 0 happens to equal ``B``, the first recomputation fails or differs and the
  fallback retries with that tensor shared.
- The module does not mix examples or draw random numbers: the per-example recomputation must
  reproduce the batched output (compared, so that a violated assumption is an error, never a
  silently wrong ``grad1``). A module that changes its buffers in its forward is recomputed
  from them as its call found them (a counter, a running mean updated after its use), else as
  its call left them (Glow's ActNorm, which initialises its parameters from its first batch and
  marks it in a buffer): where neither reproduces the output, it is refused.

Not detected: a module that both calls a hooked submodule and uses that submodule's parameter
directly (``self.proj(x) + F.linear(y, self.proj.weight)``) misses the direct use; write a rule.

Scaling: the pieces are the vjp of the backpropagated loss; the engine multiplies them by ``B``
for a mean-reduced loss, as for every rule. Cost: one extra forward and backward of the module,
vmapped over the batch, per call.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap
from torch.nn.utils.rnn import PackedSequence
from torch.overrides import TorchFunctionMode

from .. import _torch
from .._torch import tree_flatten, tree_unflatten
from ..autocast import autocast_as
from ..engine.pause import paused
from ..errors import MixedExamplesError, RuleError, UnsupportedError, UnsupportedInputError
from ..loop import per_example
from ..pieces import Direct, Piece, cast
from ..tracking import PACKED, Layout, batch_rows
from ..tracking.layout import sole_owner
from .registry import Call, ModuleState, _Entry

__all__ = ["fallback", "FALLBACK", "fallback_params"]

# What the fallback keeps in a call's memo (per module, per handle):
# "uncalled": the names of submodule parameters its last call used without calling their module;
# "loop": torch.func cannot vmap the module: recomputed with a loop over the examples;
# "pattern": which tensor inputs were split over the examples, for the shapes of its last call.
_MAX_RETRIES = 4


def fallback_params(module: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters the fallback may give pieces for: the module's own (``recurse=False``;
    every slot, also one parameter held in two), then those of its submodules (for a
    submodule it uses without calling it)."""
    own = dict(module.named_parameters(recurse=False, remove_duplicate=False))
    ids = {id(p) for p in own.values()}
    nested = {n: p for n, p in module.named_parameters() if id(p) not in ids}
    return {**own, **nested}


def fallback(call: Call) -> dict[str, Piece | None]:
    """Per-example gradients of ``call.module``'s parameters by ``vmap`` of a ``vjp``.

    Returns ``{name: Direct([batch, *param.shape])}`` for the module's own trainable parameters
    and for those of submodules it used without calling them, and ``{name: None}`` for the
    parameters of submodules it called (their own hooks have them).

    The recomputation runs without the forward hooks and pre-hooks of the module (its captured
    inputs are those its pre-hooks gave), of the modules inside it and the global ones, so that
    a user's hooks fire as often as without gradhooks. Where it then fails or does not
    reproduce the call's output, a hook inside takes part in what the module computes (it
    changes an output): it is recomputed with those, still without the module's own; where
    that fails too, with its pre-hooks, as before. A module inside that holds a tensor
    requiring grad outside its parameters and buffers (set by a pre-hook from parameters, as
    ``nn.utils.weight_norm`` and ``nn.utils.prune`` do) is recomputed with its pre-hooks at once.
    """
    tries = () if _set_by_hooks(call.module) else (True, False)
    for within in tries:
        try:
            with _torch.forward_hooks_off_within(call.module, within):
                return _fallback(call)
        except Exception:
            continue  # (a hook takes part: with more of them, below, which raises if it fails)
    return _fallback(call)


def _set_by_hooks(module: nn.Module) -> bool:
    """Whether a module in ``module`` holds a tensor that requires grad outside its parameters
    and buffers: computed from its parameters by a forward pre-hook (the old
    ``nn.utils.weight_norm``'s ``weight`` from ``weight_g`` and ``weight_v``, a pruned
    ``weight`` from ``weight_orig``), which the recomputation must run again to use the
    parameters it differentiates."""
    return any(
        isinstance(v, Tensor) and v.requires_grad
        for m in module.modules()
        for v in vars(m).values()
    )


def _fallback(call: Call) -> dict[str, Piece | None]:
    """The pieces of ``call``, recomputed from the buffers as the call found them; where that
    fails or does not reproduce the output of a call that changed its buffers, from the
    buffers as it left them (with the parameters as they are: as the call left them).

    The second serves a module that initialises itself from its first batch (Glow's ActNorm:
    in its first call it sets its parameters from the batch's statistics, marks an
    ``initialized`` buffer, then computes its output as an affine layer with those
    parameters). Recomputed from where it started, each example would initialise it from
    itself; from where it ended, the recomputation is the affine layer the output came from.
    The output check guards both: a module that mixes the examples (a batch's statistics in
    the output) reproduces from neither, and stays refused with the first error."""
    if call.buffers_left is None:
        return _from_state(call)
    memo = dict(call.memo)
    try:
        return _from_state(call)
    except Exception as e:
        first = e
    call.memo.clear()
    call.memo.update(memo)  # (what the failed recomputation learnt is not this one's)
    try:
        return _from_state(dataclasses.replace(call, buffers=call.buffers_left))
    except Exception:
        call.memo.clear()
        call.memo.update(memo)
        raise first from None


def _ran_with(call: Call, name: str, p: Tensor) -> Tensor:
    """The tensor ``call`` ran with in the slot of the module's parameter ``name`` (another,
    where ``torch.func.functional_call`` put one there for the call), else ``p``, the module's
    own now: what a recomputation of the call must compute with (refused where it was
    changed in place since the forward: :meth:`Call.parameter`)."""
    return call.parameter(name) if call.params is not None and name in call.params else p


def _from_state(call: Call) -> dict[str, Piece | None]:
    module = call.module
    own = {
        n: _ran_with(call, n, p)
        for n, p in module.named_parameters(recurse=False, remove_duplicate=False)
        if p.requires_grad
    }
    nested = {
        n: _ran_with(call, n, p)
        for n, p in fallback_params(module).items()
        if n not in own and p.requires_grad
    }
    returned = tree_flatten(call.output, is_leaf=lambda a: isinstance(a, PackedSequence))[0]
    if any(isinstance(o, PackedSequence) for o in returned) or (
        call.batch is not None and PACKED in call.batch.outputs
    ):
        raise UnsupportedInputError(
            f"fallback for '{call.name or '<model>'}' ({type(module).__qualname__}): it returns "
            f"a PackedSequence ({_describe(call)}), whose data packs the examples' time steps "
            "together, longest sequences first, so a recomputation one example at a time cannot "
            "be matched with its rows. Return the padded output (pad_packed_sequence) from "
            "the module, or register a rule for it with @gradhooks.register."
        )
    if _followed(call):
        # The forward was followed (gradhooks.tracking.layout): which tensors hold the examples, and
        # where, is known, and so is which parameters the call used in operations of its own
        # (call.batch.params); only those are differentiated.
        wrt = {n: p for n, p in {**own, **nested}.items() if n in call.batch.params}
        pieces: dict[str, Piece | None] = {n: None for n in {**own, **nested}}
        pieces.update({n: Direct(g) for n, g in _by_layout(call, wrt).items()})
        return pieces
    hooked = call.hooked
    if hooked is None:  # not a handle's call: no way to tell which submodules are hooked
        nested = {}
        hooked = {}

    def handled(name: str, called: set[int]) -> bool:
        """Whether a called hooked submodule computes ``name``'s gradient itself."""
        parts = name.split(".")
        for k in range(len(parts) - 1, 0, -1):
            sub = module.get_submodule(".".join(parts[:k]))
            params = hooked.get(id(sub))
            if params is not None and id(sub) in called and ".".join(parts[k:]) in params:
                return True
        return False

    # (a called submodule's parameter that operations of the call's own used, and the
    # submodule's call did not: the engine leaves it to this call, as in a method of the
    # submodule the module calls besides its forward)
    direct = call.batch.params if call.batch is not None else frozenset()
    guess = call.memo.get("uncalled", frozenset()) & nested.keys()
    for _ in range(2):
        wrt = {**own, **{n: nested[n] for n in sorted(guess)}}
        grads, called = _per_example_vjp(call, wrt)
        uncalled = frozenset(n for n in nested if n in direct or not handled(n, called))
        if uncalled == guess:
            break
        guess = uncalled  # the recomputation called other submodules than last time: redo
    else:
        raise UnsupportedError(
            f"fallback for '{call.name}' ({type(module).__qualname__}): the submodules its "
            "forward calls changed between two recomputations of the same call; register a rule "
            "for it with @gradhooks.register."
        )
    call.memo["uncalled"] = guess
    pieces: dict[str, Piece | None] = {n: None for n in nested}
    pieces.update({n: Direct(g) for n, g in grads.items()})
    return pieces


def _followed(call: Call) -> bool:
    """Whether the engine followed the batch into this call (its ``batch``), through every
    tensor the recomputation splits or compares."""
    info = call.batch
    if info is None:
        return False
    lays = [*info.inputs, *(info.outputs if not info.shared else ())]
    return all(lay is None or lay.dim >= 0 for lay in lays)


# the most combinations of expanded inputs tried split (:func:`_by_layout`)
_SPLIT_TRIES = 8


def _by_layout(call: Call, wrt: Mapping[str, nn.Parameter]) -> dict[str, Tensor]:
    """``{name: [batch, *shape]}`` for the parameters in ``wrt``, from a call whose tensors'
    layouts are known (``call.batch``): example ``b``'s recomputation gets its own part of every
    tensor input that holds the examples (where they are: the layout's dimension, keeping its
    windows or heads) and the rest as they are; ``b``'s part of each output-gradient is its
    cotangent. A call that does not depend on the examples (``shared``) is recomputed once per
    example on the same inputs, against that example's share of the output-gradients.

    An input that does not depend on the examples but was expanded to the batch (a class token,
    ``cls.expand(batch, -1, -1)``) is passed whole at first; where the recomputation then fails
    or does not reproduce the output, it is tried again split where the inputs with as many
    dimensions hold the examples (dimension 0, or 1 in a sequence-first module such as
    XLNet's attention; the output check decides)."""
    info = call.batch
    owner = sole_owner((*info.inputs, *info.outputs))
    if owner is not None:
        return _of_one_example(call, wrt, owner)
    leaves = tree_flatten((tuple(call.inputs), dict(call.kwargs)))[0]
    split = [
        not info.shared and isinstance(t, Tensor) and lay is not None
        for t, lay in zip(leaves, info.inputs)
    ]

    def dim_of(t: Tensor) -> int:
        # (where the inputs of as many dimensions that hold the examples hold them, on one
        # dimension: a sequence-first module's dimension 1; else dimension 0)
        dims = {lay.dim for u, lay in zip(leaves, info.inputs)
                if isinstance(u, Tensor) and u.dim() == t.dim() and lay is not None
                and lay.dim >= 0 and lay.plain}  # fmt: skip
        return dims.pop() if len(dims) == 1 else 0

    def expanded_at(t: Any, sp: bool) -> Layout | None:
        """Where an input not split with the examples would be, tried again."""
        if sp or info.shared or not isinstance(t, Tensor):
            return None
        d = dim_of(t)
        return Layout(d) if t.dim() > d and t.shape[d] == info.size else None

    aligned = [expanded_at(t, sp) for t, sp in zip(leaves, split)]
    try:
        return _by_layout_split(call, wrt, split)
    except Exception as e:
        error = e
    # (which of the expanded inputs hold the batch is told by the output check alone: all of
    # them first, then fewer; a [T, T] mask as long as the batch is not one)
    extra = [k for k, lay in enumerate(aligned) if lay is not None]
    tries = [c for n in range(len(extra), 0, -1) for c in itertools.combinations(extra, n)]
    for chosen in tries[:_SPLIT_TRIES]:
        try:
            return _by_layout_split(
                call, wrt, [sp or k in chosen for k, sp in enumerate(split)], aligned
            )
        except Exception as e:
            if chosen == tries[0]:
                error = e  # (the message of the widest try)
    raise error


def _of_one_example(call: Call, wrt: Mapping[str, nn.Parameter], owner: int) -> dict[str, Tensor]:
    """:func:`_by_layout` of a call whose every row is example ``owner``'s
    (:func:`~gradhooks.tracking.layout.sole_owner`):
    the call recomputed whole, as that one example's (its rows folded into a batch of one), its
    gradients in row ``owner`` and zeros in the others."""
    info = call.batch

    def whole(lay: Layout | None) -> Layout | None:
        return None if lay is None else Layout(lay.dim, 1, lay.owners.rows.numel())

    alone = dataclasses.replace(
        info, size=1, inputs=tuple(map(whole, info.inputs)), outputs=tuple(map(whole, info.outputs))
    )
    grads = _by_layout(dataclasses.replace(call, batch=alone), wrt)
    index = torch.tensor([owner])
    return {
        n: g.new_zeros((info.size, *g.shape[1:])).index_copy(0, index.to(g.device), g)
        for n, g in grads.items()
    }


def _by_layout_split(
    call: Call,
    wrt: Mapping[str, nn.Parameter],
    split: list[bool],
    aligned: list[Layout | None] | None = None,
    as_given: bool | None = None,
):
    if as_given is None:
        # Under autocast, the inputs as the forward gave them first (the call as it ran: a
        # module may branch on its input's dtype, as denoising-diffusion-pytorch's
        # weight-standardized convolution takes its eps from it), then in the parameters'
        # precision (see _per_example_vjp); the output check judges each
        if not call.autocast:
            return _by_layout_split(call, wrt, split, aligned, False)
        order = (False, True) if call.memo.get("cast") else (True, False)
        try:
            found = _by_layout_split(call, wrt, split, aligned, order[0])
        except Exception:
            found = _by_layout_split(call, wrt, split, aligned, order[1])
            call.memo["cast"] = not order[1]
            return found
        call.memo["cast"] = not order[0]
        return found
    module, name = call.module, f"'{call.name or '<model>'}' ({type(call.module).__qualname__})"
    info = call.batch
    batch = info.size
    out_idx = [i for i, g in enumerate(call.grad_outputs) if g is not None]
    gs = [call.grad_outputs[i] for i in out_idx]
    if not gs or not wrt:
        return {}
    if batch == 0:
        return {n: p.new_zeros((0, *p.shape)) for n, p in wrt.items()}
    create_graph = torch.is_grad_enabled()
    own = _holder(call, create_graph)
    fixed = {
        n: own(_ran_with(call, n, p))
        for n, p in module.named_parameters(remove_duplicate=False)
        if n not in wrt
    }
    buffers = _buffers(call)
    primals = {n: own(p) for n, p in wrt.items()}
    leaves, spec = tree_flatten((tuple(call.inputs), dict(call.kwargs)))
    if not as_given:  # (in the parameters' precision: see _per_example_vjp)
        dtype = next(iter(wrt.values())).dtype
        leaves = [cast(t, dtype) if isinstance(t, Tensor) else t for t in leaves]
    xs = [
        batch_rows(t, lay if lay is not None else aligned[k] if aligned else Layout(0), batch)
        for k, (t, lay, sp) in enumerate(zip(leaves, info.inputs, split))
        if sp
    ]
    outs_lay = [info.outputs[i] if i < len(info.outputs) else None for i in out_idx]
    shares = [info.shared or i in info.shares for i in out_idx]
    if any(lay is None and not sh for lay, sh in zip(outs_lay, shares)):
        raise UnsupportedInputError(
            f"fallback for {name}: an output that receives a gradient does not depend on the "
            f"examples while its inputs do ({_describe(call)}); register a rule for this module "
            "with @gradhooks.register (see docs/extending.md), or freeze its parameters."
        )
    cots = [g if sh else batch_rows(g, lay, batch) for g, lay, sh in zip(gs, outs_lay, shares)]

    def args_of(parts) -> tuple:
        it = iter(parts)
        return tree_unflatten([next(it) if sp else t for t, sp in zip(leaves, split)], spec)

    def one(xs_b, cots_b):
        args, kwargs = args_of(xs_b)

        def f(params):
            state = {**fixed, **buffers(), **params}
            out = functional_call(module, state, args, kwargs, tie_weights=False)
            out = tree_flatten(out)[0]
            return tuple(out[i] for i in out_idx)

        outs, pullback = vjp(f, primals)
        _check_example_shapes(name, outs, cots_b, _describe(call))
        (grads,) = pullback(tuple(cast(c, o.dtype) for c, o in zip(cots_b, outs)))
        return grads, outs

    def one_out(xs_b, params) -> list[Tensor]:
        args, kwargs = args_of(xs_b)
        state = {**fixed, **buffers(), **params}  # (the buffers as the call found them)
        out = functional_call(module, state, args, kwargs, tie_weights=False)
        out = tree_flatten(out)[0]
        return [out[i] for i in out_idx]

    called: set[int] = set()
    try:
        # (its own forward hooks are the caller's business, not the recomputation's: a hook
        # that calls output.requires_grad_() fails under torch.func)
        with torch.set_grad_enabled(create_graph), warnings.catch_warnings(), \
                _torch.forward_hooks_off(module), _torch.backward_hooks_off(module), \
                autocast_as(call.autocast):  # fmt: skip
            warnings.filterwarnings("ignore", message="There is a performance drop")
            grads = outs = None
            if "loop" not in call.memo and not create_graph:  # (see _attempt)
                try:
                    with _torch.own_transform(), _NoDataAssignment():
                        grads, outs = vmap(one, randomness="error")(xs, cots)
                except RuntimeError as e:
                    if "random operation" in str(e) or isinstance(e, (ValueError, TypeError)):
                        raise  # (random numbers, or a refusal of ours: not for the loop)
            vmapped = grads is not None
            if grads is None:

                def example(b: int) -> list[Tensor | None]:
                    # (by autograd, not torch.func: some operations cannot run on the tensors
                    # torch.func wraps even one example at a time, such as packing sequences.
                    # Each example's inputs in the standard layout: a row of a channels-last
                    # [batch, C, 1, 1] is both layouts at once, which torch 2.13's CPU
                    # group_norm backward reads wrong, to a segmentation fault)
                    with torch.enable_grad(), paused():
                        return _autograd_one(name, one_out, primals, [_standard(x[b]) for x in xs],
                                             [c[b] for c in cots], create_graph)  # fmt: skip

                rows = per_example(batch, example, like=[*primals.values(), *[None] * len(out_idx)])
                grads = dict(zip(primals, rows[: len(primals)]))
                outs = tuple(rows[len(primals) :])
                if not create_graph:
                    grads = {n: g.detach() for n, g in grads.items()}
                call.memo["loop"] = True
    except Exception as e:
        if str(e).startswith("fallback for"):
            raise  # ours, already clear
        raise _recomputation_failed(name, call, f"batch {batch}", e) from e
    del called
    if call.output is not None:
        captured = tree_flatten(call.output)[0]
        for j, i in enumerate(out_idx):
            want = captured[i]
            if want is None:
                continue
            want = want.expand(batch, *want.shape) if shares[j] else batch_rows(
                want, info.outputs[i], batch
            )  # fmt: skip
            try:
                _compare(name, call, i, outs[j], want, batch)
            except MixedExamplesError:
                if not (vmapped and call.autocast):
                    raise
                call.memo["loop"] = True  # (see _attempt)
                return _by_layout_split(call, wrt, split, aligned, as_given)
    return grads


def _check_example_shapes(name: str, outs, cots_b, where: str | None = None) -> None:
    """One example's outputs must have the shapes of their parts of the output-gradient."""
    for o, c in zip(outs, cots_b):
        if o.shape != c.shape:
            raise UnsupportedInputError(
                f"fallback for {name}: one example's output has shape {tuple(o.shape)}, its "
                f"part of the output-gradient {tuple(c.shape)}"
                + (f" ({where})" if where else "")
                + "; register a rule for this module with @gradhooks.register."
            )


def _standard(t: Tensor) -> Tensor:
    """``t`` in the standard (row-major) layout, copied where its strides are others."""
    if not isinstance(t, Tensor) or t.layout != torch.strided:
        return t
    standard, step = [], 1
    for size in reversed(t.shape):
        standard.append(step)
        step *= max(size, 1)
    if t.stride() == tuple(reversed(standard)):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _autograd_one(
    name: str, f, primals: dict, xs_b: list, cots_b: list, create_graph: bool
) -> list:
    """One example's ``[*gradients, *outputs]`` by autograd: ``f(xs_b, params)`` gives the
    outputs, ``cots_b`` their gradients (an alias of each parameter, as :func:`_loop`'s)."""
    params = {
        n: p.view_as(p) if create_graph else p.detach().requires_grad_() for n, p in primals.items()
    }
    outs = f(xs_b, params)
    _check_example_shapes(name, outs, cots_b)
    found = [(o, c) for o, c in zip(outs, cots_b) if o.requires_grad]
    grads = torch.autograd.grad(
        [o for o, _ in found], list(params.values()), [c for _, c in found],
        allow_unused=True, create_graph=create_graph,
    ) if found else (None,) * len(params)  # fmt: skip
    grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params.values())]
    return [*grads, *(o.detach() for o in outs)]


def _describe(call: Call) -> str:
    def shapes(tree) -> str:
        return ", ".join(_shown(t) for t in tree_flatten(tree)[0])

    grads = [None if g is None else tuple(g.shape) for g in call.grad_outputs]
    kwargs = f"; keyword inputs {shapes(call.kwargs)}" if call.kwargs else ""
    return f"inputs {shapes(call.inputs)}{kwargs}; output gradients {grads}"


def _shown(leaf: Any) -> str:
    """One leaf of a call's inputs in an error: a tensor by its shape; a mapping that pytree
    takes for one leaf (a ``UserDict``), which the recomputation hands every example whole,
    by the shapes it holds, and said so."""
    if isinstance(leaf, Tensor):
        return str(tuple(leaf.shape))
    if isinstance(leaf, Mapping):
        held = ", ".join(f"{k!r}: {_shown(v)}" for k, v in leaf.items())
        return (
            f"a {type(leaf).__qualname__} {{{held}}}, which pytree takes for one leaf and the "
            "recomputation does not split per example (a dict would be split)"
        )
    return repr(leaf)


def _trainable(module: nn.Module) -> str:
    """The module's trainable parameters, named, with their shapes."""
    return ", ".join(
        f"'{n}' {tuple(p.shape)}" for n, p in module.named_parameters() if p.requires_grad
    )


def _freeze_hint(module: nn.Module) -> str:
    """The advice to freeze the module's parameters, naming those trainable now."""
    return (
        f"freeze its parameters ({_trainable(module)}, trainable at this backward: a forward "
        "that makes them anew, nn.Parameter(...) at each call as an EMA codebook does, makes "
        "them trainable again unless it passes requires_grad=False)"
    )


def _per_example_vjp(
    call: Call, wrt: Mapping[str, nn.Parameter]
) -> tuple[dict[str, Tensor], set[int]]:
    """``{name: [batch, *shape]}`` for the parameters in ``wrt``, and the ids of the submodules
    the recomputation called."""
    name = f"'{call.name or '<model>'}' ({type(call.module).__qualname__})"
    out_idx = [i for i, g in enumerate(call.grad_outputs) if g is not None]
    gs = [call.grad_outputs[i] for i in out_idx]
    if not gs:
        return {}, set()
    batched_gs = [g for g in gs if g.dim()]
    batch = batched_gs[0].shape[0] if batched_gs else -1
    if (
        not batched_gs
        or len(gs) - len(batched_gs) > 1
        or (len(batched_gs) < len(gs) and torch.is_grad_enabled())
    ):
        raise UnsupportedInputError(
            f"fallback for {name}: an output of shape () receives a gradient ({_describe(call)})"
            ": a loss computed in the module's forward from the whole batch, which the "
            "per-example fallback, recomputing the module one example at a time, cannot split "
            "into examples. Return the per-example outputs (the logits) and compute the loss "
            "outside the module, or register a rule for it with @gradhooks.register (see "
            f"docs/extending.md), or {_freeze_hint(call.module)}."
        )
    if any(g.shape[0] != batch for g in batched_gs):
        raise UnsupportedInputError(
            f"fallback for {name}: the per-example fallback needs the batch on dimension 0 of "
            f"every output that receives a gradient; got {_describe(call)}. Register a rule "
            "for this module with @gradhooks.register (see docs/extending.md), or freeze its "
            "parameters."
        )
    if batch == 0:
        return {n: p.new_zeros((0, *p.shape)) for n, p in wrt.items()}, set()
    leaves, spec = tree_flatten((tuple(call.inputs), dict(call.kwargs)))
    # Recomputed from inputs in the parameters' precision (under autocast a previous layer's
    # output may be bfloat16 beside float32 parameters), under the autocast the forward ran
    # under (Call.autocast): as the call ran
    dtype = next(iter(wrt.values())).dtype
    leaves = [cast(t, dtype) if isinstance(t, Tensor) else t for t in leaves]
    batched = [isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == batch for t in leaves]
    # A tensor whose dimension 0 only happens to equal the batch size (an attention mask
    # [seq, seq] with seq == batch) makes the recomputation fail or differ: then retry with one
    # such tensor (any batched one but the first) shared by every example instead.
    candidates = [j for j, is_b in enumerate(batched) if is_b][1 : _MAX_RETRIES + 1]
    patterns = [batched] + [[is_b and k != j for k, is_b in enumerate(batched)] for j in candidates]
    shapes = (batch, tuple(tuple(t.shape) if isinstance(t, Tensor) else None for t in leaves))
    cached = call.memo.get("pattern")
    if cached is not None and cached[0] == shapes:
        patterns.insert(0, cached[1])  # what worked for the last call with these shapes
    first: Exception | None = None
    for pattern in patterns:
        try:
            result = _attempt(call, name, wrt, leaves, spec, pattern, gs, out_idx, batch)
            call.memo["pattern"] = (shapes, pattern)
            return result
        except Exception as e:  # noqa: PERF203
            if "draws random numbers" in str(e):
                raise
            first = first or e
    assert first is not None
    raise first


def _attempt(call, name, wrt, leaves, spec, batched, gs, out_idx, batch):
    """One recomputation, with the tensor inputs flagged in ``batched`` split over examples."""
    module = call.module
    # A create_graph backward: the per-example gradients keep the graph through the parameters,
    # inputs and output-gradients (autograd, one example at a time: below).
    create_graph = torch.is_grad_enabled()
    own = _holder(call, create_graph)
    xs = [t for t, b in zip(leaves, batched) if b]
    scalar = [g.dim() == 0 for g in gs]
    fixed = {
        n: own(_ran_with(call, n, p))
        for n, p in module.named_parameters(remove_duplicate=False)
        if n not in wrt
    }
    buffers = _buffers(call)
    primals = {n: own(p) for n, p in wrt.items()}
    called: set[int] = set()

    def record(m: nn.Module, args: object) -> None:
        called.add(id(m))

    def one(xs_b: list[Tensor], gs_b: list[Tensor]):
        it = iter(xs_b)
        args, kwargs = tree_unflatten(
            [next(it).unsqueeze(0) if b else t for t, b in zip(leaves, batched)], spec
        )

        def f(params):
            state = {**fixed, **buffers(), **params}
            out = functional_call(module, state, args, kwargs, tie_weights=False)
            out = tree_flatten(out)[0]
            return tuple(out[i] for i in out_idx)

        outs, pullback = vjp(f, primals)
        for o, g, k in zip(outs, gs_b, scalar):
            if k and o.shape == ():
                continue
            if o.shape != (1, *g.shape):
                raise UnsupportedInputError(
                    f"fallback for {name}: it takes dimension 0 of the inputs and outputs as the "
                    f"batch ({batch}, from the output gradients), but one example's output has "
                    f"shape {tuple(o.shape)}, not {(1, *g.shape)}; got {_describe(call)}. "
                    "Register a rule for this module with @gradhooks.register (see "
                    "docs/extending.md)."
                )
        if not any(scalar):
            (grads,) = pullback(tuple(cast(g, o.dtype).unsqueeze(0) for g, o in zip(gs_b, outs)))
            return grads, {}, tuple(o.squeeze(0) for o in outs)
        # (a scalar of the batch, a mean or a sum of each example's: its share of the
        # gradient apart, weighted once the outputs say which)
        rows = [torch.zeros_like(o) if k else cast(g, o.dtype).unsqueeze(0)
                for g, o, k in zip(gs_b, outs, scalar)]  # fmt: skip
        whole = [cast(g, o.dtype) if k else torch.zeros_like(o)
                 for g, o, k in zip(gs_b, outs, scalar)]  # fmt: skip
        (grads,) = pullback(tuple(rows))
        (shares,) = pullback(tuple(whole))
        return grads, shares, tuple(o if k else o.squeeze(0) for o, k in zip(outs, scalar))

    handle = nn.modules.module.register_module_forward_pre_hook(record)
    try:
        with torch.set_grad_enabled(create_graph), warnings.catch_warnings(), \
                _torch.forward_hooks_off(module), _torch.backward_hooks_off(module), \
                autocast_as(call.autocast):  # fmt: skip
            warnings.filterwarnings("ignore", message="There is a performance drop")
            # (a create_graph backward by autograd, one example at a time: under vmap, torch
            # 2.13 drops the graph from some operations' gradients to their inputs, such as
            # layer_norm's, and a derivative of grad1 through them would miss those terms)
            vmapped = "loop" not in call.memo and not create_graph
            if vmapped:
                try:
                    with _torch.own_transform(), _NoDataAssignment():
                        in_dims = (0, [None if k else 0 for k in scalar])
                        grads, shares, outs = vmap(one, in_dims, randomness="error")(xs, gs)
                except RuntimeError as e:
                    if "random operation" in str(e) or isinstance(e, (ValueError, TypeError)):
                        raise  # (random numbers, or a refusal of ours: not for the loop)
                    # Some operators cannot be vmapped (nn.LSTM in float64 on CPU writes a
                    # batched tensor into an unbatched one): one example at a time instead.
                    vmapped = False
            if not vmapped:
                called.clear()
                grads, shares, outs = _loop(
                    module, name, fixed, buffers, primals, leaves, batched, spec, gs, out_idx,
                    create_graph,
                )  # fmt: skip
                call.memo["loop"] = True
    except Exception as e:
        if str(e).startswith("fallback for"):
            raise  # ours, already clear
        raise _recomputation_failed(name, call, f"batch {batch} on dimension 0", e) from e
    finally:
        handle.remove()
    called.discard(id(module))
    if any(scalar):
        outs, weights = _reduced(call, name, out_idx, outs, scalar)
        grads = {n: g + weights[0] * shares[n] for n, g in grads.items()}
    try:
        _check_output(call, name, out_idx, outs, batch)
    except MixedExamplesError:
        if not (vmapped and call.autocast):
            raise
        # (under autocast, torch.func's batched kernels may round otherwise than the forward's,
        # a unit of bfloat16 behind a float32 output: recomputed by the loop, which runs the
        # forward's kernels, and judged by the rounding of the call's tensors again)
        call.memo["loop"] = True
        return _attempt(call, name, wrt, leaves, spec, batched, gs, out_idx, batch)
    return grads, called


def _reduced(call: Call, name: str, out_idx: list[int], outs, scalar: list[bool]):
    """The outputs of shape () as the batch's (each example's, ``[batch]``, averaged or
    summed: whichever the forward's value is), and the weight of each example's share of
    their gradient (``1/batch`` or 1). A scalar that is neither, a statistic of the batch
    (a variance, a product of means), is refused."""
    captured = tree_flatten(call.output)[0] if call.output is not None else None
    reduced, weights = list(outs), []
    for k, (i, got, is_scalar) in enumerate(zip(out_idx, outs, scalar)):
        if not is_scalar:
            continue
        want = captured[i] if captured is not None else None
        if want is None:
            raise UnsupportedInputError(
                f"fallback for {name}: an output of shape () receives a gradient, and the "
                "forward's value of it, which says whether it averages or sums its examples', "
                "was not kept; register a rule for the module with @gradhooks.register."
            )
        eps = max(torch.finfo(got.dtype).eps, torch.finfo(want.dtype).eps)
        tol = min(1e3 * eps, 5e-2) * (1.0 + want.detach().abs().item())
        for weight, value in ((1.0 / got.shape[0], got.mean()), (1.0, got.sum())):
            if abs(value.item() - want.detach().to(value.dtype).item()) <= tol:
                reduced[k], weights = want.detach().to(value.dtype), [*weights, weight]
                break
        else:
            raise MixedExamplesError(
                f"fallback for {name}: output {i}, of shape (), a number of the whole batch "
                f"({want.item():.6g}), is neither the mean ({got.mean().item():.6g}) nor the "
                f"sum ({got.sum().item():.6g}) of each example's, recomputed alone: a "
                "statistic that mixes the examples, whose per-example gradients do not exist. "
                "Return each example's value and reduce it outside the module, register a "
                f"rule with @gradhooks.register, or {_freeze_hint(call.module)}."
            )
    return tuple(reduced), weights


def _recomputation_failed(name: str, call: Call, batch: str, e: Exception) -> Exception:
    """What a per-example recomputation of ``name``'s call that failed with ``e`` raises: an
    error that says what to do."""
    if isinstance(e, RuntimeError) and "random operation" in str(e):
        return UnsupportedError(
            f"fallback for {name}: its forward draws random numbers (dropout in training "
            "mode?), which a per-example recomputation cannot reproduce. Call model.eval() "
            "or set the dropout to 0 for the backward you capture, or register a rule for "
            "this module with @gradhooks.register."
        )
    return RuleError(
        f"fallback for {name} could not recompute the module one example at a time "
        f"({_describe(call)}; {batch}): {e}\nIf the module mixes the examples of a batch "
        "(BatchNorm in training mode), it has no per-example gradients; otherwise register a "
        "rule for it with @gradhooks.register (see docs/extending.md), or freeze its parameters."
    )


def _holder(call: Call, create_graph: bool):
    """How a recomputation of ``call`` holds the module's parameters: as they are (under
    ``create_graph``, for a graph through them) or detached; copied where the call changed its
    buffers in its forward, whose recomputation may change its parameters as the forward did
    (an ActNorm initialising itself writes into ``param.data``) and must not write into the
    module's own."""
    if call.buffers is not None:
        return Tensor.clone if create_graph else lambda t: t.detach().clone()
    # (detached with a version counter of their own, ``t.data``: a forward that writes into
    # its weight through ``.data``, PixelCNN's ``self.weight.data *= self.mask``, makes
    # torch.func raise only once it has written, and the write then counted as a change of the
    # module's parameter, whose value the forward's graph saved: the user's backward failed)
    return (lambda t: t) if create_graph else _own_version


def _own_version(t: Tensor) -> Tensor:
    return t.data


def _buffers(call: Call):
    """What the recomputations of ``call`` take for the module's buffers, a function giving a
    dict: fresh copies, for each recomputation (which changes them as the forward did, and
    must start where it started), of the buffers as the call found them where its forward
    changed them in place (:attr:`Call.buffers`), else of the buffers as they are. (Copies
    there too: a forward that writes a buffer through ``.data``, a usage count updated by
    ``buffer.data.mul_(decay).add_(...)``, changes it without a trace in its version, and its
    recomputations must not write into the module's.)"""
    before = call.buffers
    if before is None:
        slots = call.saved.tensors if isinstance(call.saved, BufferSlots) else None
        if slots is None:
            slots = dict(call.module.named_buffers(remove_duplicate=False))
        before = {n: b.detach() for n, b in slots.items()}
    return lambda: {n: b.clone() for n, b in before.items()}


@dataclasses.dataclass(frozen=True)
class BufferSlots(ModuleState):
    """The fallback's ``saved``: the tensors in a module's buffer slots as its call ran, by
    name (others than its own where ``torch.func.functional_call`` put them there for the
    call; references, not copies: a forward that changes a buffer in place is what
    :attr:`Call.buffers` keeps copies for)."""

    tensors: dict[str, Tensor]


def _buffer_slots(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> BufferSlots | None:
    """The tensors in ``module``'s buffer slots after its call (``None`` without buffers)."""
    found = dict(module.named_buffers(remove_duplicate=False))
    return BufferSlots(found) if found else None


def _loop(
    module, name, fixed, buffers, primals, leaves, batched, spec, gs, out_idx, create_graph=False
):
    """What the vmapped vjp computes, by one forward and ``autograd.grad`` per example
    (``create_graph``: the primals as they are, the gradients with a graph)."""

    def example(b: int) -> list[Tensor | None]:
        args, kwargs = tree_unflatten(
            [t[b : b + 1] if is_b else t for t, is_b in zip(leaves, batched)], spec
        )
        # (create_graph: an alias of each parameter, so that the gradient is taken through
        # its use here only, not through an input computed from it: as vjp's primals)
        params = {
            n: p.view_as(p) if create_graph else p.detach().requires_grad_()
            for n, p in primals.items()
        }
        with torch.enable_grad(), paused():
            state = {**fixed, **buffers(), **params}
            out = functional_call(module, state, args, kwargs, tie_weights=False)
            out = tree_flatten(out)[0]
            out = [out[i] for i in out_idx]
            for o, g in zip(out, gs):
                if g.dim() == 0 and o.shape == ():
                    continue
                if o.shape != (1, *g.shape[1:]):
                    raise UnsupportedInputError(
                        f"fallback for {name}: it takes dimension 0 of the inputs and outputs "
                        f"as the batch, but one example's output has shape {tuple(o.shape)}, "
                        f"not {(1, *g.shape[1:])}. Register a rule for this module with "
                        "@gradhooks.register (see docs/extending.md)."
                    )
            rowed = [(o, g) for o, g in zip(out, gs) if o.requires_grad and g.dim()]
            whole = [(o, g) for o, g in zip(out, gs) if o.requires_grad and not g.dim()]
            grads = (
                [None] * len(params)
                if not rowed
                else torch.autograd.grad(
                    [o for o, _ in rowed],
                    list(params.values()),
                    [cast(g[b : b + 1], o.dtype) for o, g in rowed],
                    allow_unused=True,
                    create_graph=create_graph,
                    retain_graph=bool(whole) or None,
                )
            )
            # (a scalar of the batch: each example's share apart, as in _attempt's one)
            shares = torch.autograd.grad(
                [o for o, _ in whole],
                list(params.values()),
                [cast(g, o.dtype) for o, g in whole],
                allow_unused=True,
                create_graph=create_graph,
            ) if whole else [None] * len(params)  # fmt: skip
        return [*grads, *shares, *(o.detach() if o.dim() == 0 else o.detach()[0] for o in out)]

    like = [*primals.values(), *primals.values(), *[None] * len(out_idx)]
    batch = next(g.shape[0] for g in gs if g.dim())
    rows = per_example(batch, example, like=like)
    n = len(primals)
    return (
        dict(zip(primals, rows[:n])),
        dict(zip(primals, rows[n : 2 * n])),
        tuple(rows[2 * n :]),
    )


def _check_output(call: Call, name: str, out_idx: list[int], outs, batch: int) -> None:
    """The per-example recomputation must reproduce the captured batched output."""
    if call.output is None:
        return  # registered by hand without needs_output=True: nothing to compare with
    captured = tree_flatten(call.output)[0]
    for i, got in zip(out_idx, outs):
        if captured[i] is not None:
            _compare(name, call, i, got, captured[i], batch)


def _compare(name: str, call: Call, i: int, got: Tensor, want: Tensor, batch: int) -> None:
    """Output ``i`` as recomputed per example (``got``, examples on dimension 0) against the
    forward's (``want``, the same layout)."""
    if not want.numel():
        return
    eps = torch.finfo(want.dtype).eps if want.is_floating_point() else 0.0
    if got.is_floating_point() and want.is_floating_point() and got.dtype != want.dtype:
        # (recomputed in the parameters' precision, the forward's under autocast: compared
        # in the wider, within the rounding of the narrower)
        eps = max(eps, torch.finfo(got.dtype).eps)
        got, want = (t.to(torch.promote_types(got.dtype, want.dtype)) for t in (got, want))
    # (a floating-point input in a lower precision than the parameters', which the
    # recomputation casts to theirs: the forward may have computed in it, as a router's float32
    # weights make an experts' sum float32)
    eps = max(eps, _eps_of(tree_flatten((tuple(call.inputs), dict(call.kwargs)))[0]))
    finite = want[torch.isfinite(want)]
    scale = 1.0 + (finite.abs().max().item() if finite.numel() else 0)
    tol = min(1e3 * eps, 5e-2) * scale
    close = torch.isclose(got, want, rtol=0.0, atol=tol, equal_nan=True).all()
    if not close and not call.autocast and (inner := _inner_eps(call)) > eps:
        # (computed in a lower precision inside than at its boundary, a float64 model's
        # module that takes .float() of its input: judged by that rounding. Not under
        # autocast, where the outputs' dtypes say it, and where torch.func's batched kernels
        # may differ from the loop by more than it: the callers then recompute by the loop)
        tol = min(1e3 * inner, 5e-2) * scale
        close = torch.isclose(got, want, rtol=0.0, atol=tol, equal_nan=True).all()
    if not close:
        diff = (got - want).abs().nan_to_num(nan=float("inf")).max().item()
        raise MixedExamplesError(
            f"fallback for {name}: recomputing the module one example at a time does not "
            f"reproduce its output {i} (max difference {diff:.3e}; {_describe(call)}). "
            "The module mixes the examples of a batch (BatchNorm in training mode), changes "
            "its state in its forward, or takes a tensor whose dimension 0 happens to equal "
            f"the batch size {batch} but is not a batch. Per-example gradients from its call "
            "would be wrong: register a rule with @gradhooks.register, or freeze its "
            "parameters."
        )


def _eps_of(tensors) -> float:
    """The coarsest rounding (machine epsilon) among the floating-point ``tensors`` (0: none)."""
    found = {t.dtype for t in tensors if isinstance(t, Tensor) and t.is_floating_point()}
    return max((torch.finfo(d).eps for d in found), default=0.0)


_DATA = inspect.getattr_static(torch.Tensor, "data")  # (the property, whose setter is refused)


class _DataAssignment(RuntimeError):
    """An assignment to ``.data`` met in a ``torch.func`` recomputation: a ``RuntimeError``, as
    torch's own refusals there are, so that it goes the way of an operation ``vmap`` cannot
    run (to the loop)."""


class _NoDataAssignment(TorchFunctionMode):
    """Refuses an assignment to a tensor's ``.data`` in a ``torch.func`` recomputation, which
    then runs one example at a time by autograd. A forward that moves its modules where they
    already are (``module.to(device)`` on every call, as soft-moe-pytorch's experts do) sets
    each parameter's ``.data`` to itself; under ``torch.func.vjp`` that crashes the process
    (torch 2.13, a segmentation fault in the next operation on the parameter)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__self__", None) is _DATA and func.__name__ == "__set__":
            raise _DataAssignment("an assignment to .data cannot run under torch.func")
        return func(*args, **(kwargs or {}))


class _Rounding(TorchFunctionMode):
    """The coarsest rounding among the floating-point results of the torch functions run."""

    def __init__(self) -> None:
        super().__init__()
        self.eps = 0.0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.eps = max(self.eps, _eps_of(out if isinstance(out, tuple | list) else (out,)))
        return out


def _inner_eps(call: Call) -> float:
    """The coarsest rounding of the floating-point results of ``call``'s forward, run once more
    on its inputs under :class:`_Rounding` (only where a recomputation differs from the
    forward by more than the rounding of the call's tensors: never on the common path); 0
    where it cannot run."""
    module = call.module
    own = _holder(call, create_graph=False)
    state = {
        n: own(_ran_with(call, n, p)) for n, p in module.named_parameters(remove_duplicate=False)
    }
    state.update(_buffers(call)())
    mode = _Rounding()
    try:
        with torch.no_grad(), paused(), torch.random.fork_rng(devices=[]), \
                _torch.forward_hooks_off(module), _torch.backward_hooks_off(module), \
                autocast_as(call.autocast), mode:  # fmt: skip
            functional_call(module, state, tuple(call.inputs), dict(call.kwargs), tie_weights=False)
    except Exception:
        return 0.0
    return mode.eps


#: The fallback as a registry entry: the engine hooks every module with trainable parameters
#: and no rule with it when ``unsupported="fallback"`` (the default).
FALLBACK = _Entry(rule=fallback, owns_children=False, needs_output=True, saved=_buffer_slots)

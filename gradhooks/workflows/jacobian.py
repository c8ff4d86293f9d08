"""Per-example Jacobians of every output with respect to every parameter, from the hooks.

One forward on the batch; then one backward of the identity over the outputs, batched with
``torch.func.vmap`` (``vmap`` over the ``outputs`` one-hot output-gradients; one backward per
output where gradhooks cannot read vmap's batched tensors, see ``gradhooks._torch``; where the
forward used a parameter outside its module's call or called a layer on what does not depend
on the examples, whose per-example shares the tracker forms one backward at a time; and under
autocast, where torch's own vmapped backward of some layers fails on the mixed dtypes). In
that backward every hooked call sees a batch of output-gradients, its rule makes its pieces once
(a convolution's im2col is computed once, not once per output), and the pieces' ``grad1`` *is*
the Jacobian: ``J[b, c] = ∂ out[b, c] / ∂ p``. Every layer with a rule is covered; reused
modules, tied weights and a parameter's uses outside its module's call (a tied head
``F.linear(h, self.wte.weight)``, a table read as ``self.pos.weight[:T]``) are summed as for
``grad1``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .. import _torch
from .._torch import tree_flatten
from ..engine.api import engine_of
from ..engine.handle import Hooks, add_hooks, require_module
from ..engine.records import autocast_dtype
from ..errors import (
    CheckFailedError,
    ConfigurationError,
    ConfigurationTypeError,
    UnsupportedInputError,
)
from ..rules.registry import REGISTRY, Registry
from ..tracking import MIXED, UNKNOWN, Tracker

__all__ = ["jacobians"]

# the model's positional inputs: one tensor, or a tuple (list) of them
Inputs = Tensor | Sequence[Any]


def jacobians(
    model: nn.Module,
    inputs: Inputs,
    *,
    kwargs: Mapping[str, Any] | None = None,
    flatten: bool = False,
    registry: Registry = REGISTRY,
) -> dict[str, Tensor] | Tensor:
    """Per-example Jacobians of ``model``'s output with respect to its trainable parameters.

    The model is called once, ``model(*inputs, **kwargs)``, on the whole batch.

    Args:
        model: a model whose examples are independent (no batch statistics), not hooked.
        inputs: the model's input ``[batch, ...]``, or a tuple of its positional inputs
            (``(x, y)`` for ``model(x, y)``). The batch is dimension 0 of the first tensor
            among them (then among ``kwargs``), as for :func:`gradhooks.add_hooks`; every other
            input with that many rows on dimension 0 holds the examples there too, the rest
            (a mask ``[T, T]``, ``position_ids`` ``[1, T]``) are shared by every example.
        kwargs: the model's keyword inputs, ``{"attention_mask": mask}`` for a Hugging Face
            model (tensors per example ``[batch, ...]``, or shared; anything else passed as is).
        flatten: return one ``[batch, outputs, P]`` tensor, parameters concatenated in
            ``named_parameters()`` order, each flattened row-major (as the ``torch.func``
            ``vmap(jacrev)`` recipe concatenates them).
        registry: the rules to use (default: the built-in ones).

    The output must be one tensor ``[batch, *out]`` whose row ``b`` is example ``b``'s (a
    Hugging Face model's ``ModelOutput``: wrap the model in a module that returns
    ``.logits``); its ``outputs = prod(out)`` entries are flattened row-major. An output
    without the batch on dimension 0 (a scalar, ``model(x).sum(0)``, ``model(x).T``) or that
    mixes the examples is refused with an error, as is a model under ``add_hooks``.

    Returns:
        ``{name: [batch, outputs, *p.shape]}`` with ``J[name][b, c] = ∂ out[b, c] / ∂ p``, or
        the flattened tensor. No loss is involved, so there is no mean/sum scaling. A parameter
        used several times (a module called twice, a weight shared by two modules, a tied head
        ``F.linear(h, self.wte.weight)``, a parameter used directly in a parent's ``forward``)
        gets the sum over its uses, the derivative of the output as the model computes it
        (``vmap(jacrev)`` of ``torch.func.functional_call``); frozen parameters are left out.
        Under ``torch.autocast`` the Jacobians are in the parameters' dtype, of the
        computation autocast ran. Under ``torch.no_grad()`` or ``torch.inference_mode()`` they
        are the same (the forward and backward record and run regardless). They are values,
        with no autograd history: an input that requires grad (with grad mode on) is refused,
        since a loss built from the Jacobians would get no gradient through them.

    Example::

        >>> import torch, gradhooks
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        >>> J = gradhooks.jacobians(net, torch.randn(5, 4))
        >>> J["0.weight"].shape
        torch.Size([5, 3, 8, 4])
        >>> gradhooks.jacobians(net, torch.randn(5, 4), flatten=True).shape   # P = 32+8+24+3
        torch.Size([5, 3, 67])
        >>> class Scaled(torch.nn.Module):  # several inputs and keyword arguments
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.fc = torch.nn.Linear(4, 2)
        ...     def forward(self, x, y, scale=1.0):
        ...         return scale * self.fc(x * y)
        >>> x, y = torch.randn(5, 4), torch.randn(5, 4)
        >>> gradhooks.jacobians(Scaled(), (x, y), kwargs={"scale": 2.0})["fc.weight"].shape
        torch.Size([5, 2, 2, 4])
    """
    require_module(model, "jacobians")
    if not isinstance(flatten, bool):
        raise ConfigurationTypeError(
            f"jacobians: flatten takes True or False, got {type(flatten).__qualname__} {flatten!r}"
        )
    args, kwargs = model_inputs(inputs, kwargs, "jacobians")
    _refuse_differentiable_inputs(args, kwargs)
    named: dict[str, nn.Parameter] = {}
    for name, p in model.named_parameters():
        if p.requires_grad and all(q is not p for q in named.values()):
            named[name] = p
    params = list(named.values())
    with (
        recording(),
        add_hooks(model, loss_reduction="sum", registry=registry, quantities=("_jacobian",)) as h,
    ):
        # The backward is taken with respect to the hooked calls' outputs (and the parameters
        # no hooked module covers, or used outside their modules' calls), not the parameters:
        # autograd then never forms the others' own gradients (batched over the outputs, for
        # a convolution the largest part of the work), which the hooks' pieces replace.
        run = hooked_forward(h, model, args, kwargs)
        out = checked_output(run, model, "jacobians", "[batch, *out]")
        batch = out.shape[0]
        engine = engine_of(h)
        covered = engine.covered()
        wrt = run.reached + [p for p in params if id(p) not in covered or id(p) in run.direct]
        outputs = math.prod(out.shape[1:])
        # the results, allocated once; the backward writes each parameter's block in place
        total = sum(p.numel() for p in params)
        dtype = params[0].dtype if params else out.dtype  # (under autocast: not out's)
        flat = out.new_empty(batch, outputs, total, dtype=dtype) if flatten else None
        result, offset = {}, 0
        for name, p in named.items():
            if flat is not None:
                block = flat[:, :, offset : offset + p.numel()].unflatten(-1, p.shape)
                offset += p.numel()
            else:
                block = p.new_empty(batch, outputs, *p.shape)
            result[name] = engine.collector.jacobian[id(p)] = block
        if batch and outputs and wrt:
            eye = torch.eye(outputs, dtype=out.dtype, device=out.device)
            # [outputs, batch, *out]: output-gradient c is one-hot at output c for every example
            vs = eye[:, None, :].expand(outputs, batch, outputs).reshape(outputs, *out.shape)

            def backward(v: Tensor):
                torch.autograd.grad(out, wrt, v, retain_graph=True, allow_unused=True)
                return v  # the results are written by the hooks; vmap wants a tensor back

            if _torch.batched_backwards() and not run.sources and not run.autocast:
                with _torch.own_transform():
                    torch.func.vmap(backward)(vs)
            else:  # one output at a time, each added into its column
                for block in result.values():
                    block.zero_()
                collector = engine.collector
                try:
                    for c in range(outputs):
                        collector.jacobian_column = c
                        backward(vs[c])
                finally:
                    collector.jacobian_column = None
        unwritten = {
            n: p for n, p in named.items() if id(p) not in engine.collector.jacobian_written
        }
        if unwritten and batch and outputs and out.requires_grad:
            _refuse_missed(h, out, unwritten)
        for p in unwritten.values():  # reached by no output: the Jacobian is zero
            engine.collector.jacobian[id(p)].zero_()
    return flat if flat is not None else result


def _refuse_differentiable_inputs(args: tuple, kwargs: dict[str, Any]) -> None:
    """The Jacobians are values the hooks write, with no autograd history: a loss built from
    them (a predictive variance ``J Σ Jᵀ`` trained through, laplace's ``enable_backprop``)
    would get no gradient through them, and no error would say so. An input that requires
    grad, with grad mode on, asks for that: refuse it."""
    if not torch.is_grad_enabled():
        return
    wanting = [t for t in input_tensors((args, kwargs)) if t.requires_grad]
    if wanting:
        raise UnsupportedInputError(
            f"jacobians(): an input of shape {tuple(wanting[0].shape)} requires grad, but the "
            "Jacobians are returned as values, with no autograd history: a loss built from "
            "them would get no gradient through them. For Jacobians to differentiate, use "
            "torch.func.vmap(torch.func.jacrev(...)); for their values, pass the input "
            "detached (x.detach()) or call jacobians() under torch.no_grad()"
        )


def _refuse_missed(h: Hooks, out: Tensor, unwritten: dict[str, nn.Parameter]) -> None:
    """Parameters no hook wrote a Jacobian for must be those the outputs do not depend on
    (their Jacobian is zero): autograd, asked for their gradient, finds no path to them. One
    it reaches was missed by the hooks, and a zero block would be wrong."""
    with h.paused():
        grads = torch.autograd.grad(
            out, list(unwritten.values()), torch.ones_like(out), retain_graph=True,
            allow_unused=True,
        )  # fmt: skip
    missed = [n for n, g in zip(unwritten, grads, strict=True) if g is not None]
    if missed:
        raise CheckFailedError(
            f"jacobians: the outputs depend on {', '.join(repr(n) for n in missed)}, but no "
            "hooked call gave a Jacobian for it (a backward the hooks did not see through the "
            "layer that uses it): its block would be zeros. Compute it with "
            "torch.func.jacrev, or report the model."
        )


# -- what jacobians() and kfac() share ---------------------------------------------------------


@contextmanager
def recording() -> Iterator[None]:
    """Autograd recording on, whatever the caller's mode: the Jacobians and K-FAC factors are
    derivatives of the model's output, and a forward under ``torch.no_grad()`` or
    ``torch.inference_mode()`` (an evaluation loop, a predictive) records nothing for their
    backwards to run through: they would be zeros."""
    with torch.inference_mode(False), torch.enable_grad():
        yield


def model_inputs(
    inputs: Inputs, kwargs: Mapping[str, Any] | None, who: str
) -> tuple[tuple, dict[str, Any]]:
    """``(args, kwargs)`` of the model's call from ``inputs`` (a tensor, or a tuple or list of
    positional inputs) and ``kwargs``; refuses a call with no tensor to take the batch from."""
    if not isinstance(inputs, (Tensor, tuple, list)):  # (None, a number: a bare TypeError)
        raise ConfigurationTypeError(
            f"{who}(): inputs must be the model's input [batch, ...] or a tuple (list) of its "
            f"positional inputs, got {type(inputs).__qualname__}; give keyword inputs as "
            "kwargs={...}"
        )
    args = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise ConfigurationTypeError(
            f"{who}(kwargs=...) takes the model's keyword inputs as a dict, got "
            f"{type(kwargs).__name__}"
        )
    kwargs = dict(kwargs or {})
    if not input_tensors((args, kwargs)):
        raise ConfigurationError(
            f"{who}(): no tensor among the model's inputs ({len(args)} positional, keywords "
            f"{sorted(kwargs)}): the batch is dimension 0 of the first tensor input; give "
            "inputs=x or inputs=(x, ...), and the keyword inputs as kwargs={...}"
        )
    return args, kwargs


def input_tensors(tree: Any) -> list[Tensor]:
    """The tensors among a call's inputs, in pytree's order, also those inside a mapping that
    is no pytree node (a ``UserDict``, a ``MappingProxyType``), which pytree takes for a leaf:
    a model may read its input from one (curvlinops' test models do), and the hooked layers
    inside find the batch in what it reads."""
    found: list[Tensor] = []
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, Tensor):
            found.append(leaf)
        elif isinstance(leaf, Mapping):
            found.extend(input_tensors(dict(leaf)))
    return found


@dataclass
class HookedForward:
    """One forward of the hooked model: its output, the gradient edges of the hooked calls'
    outputs, the parameters used outside their modules' calls (by id), whether the tracker
    collected per-example shares anywhere, the tracker itself (``None`` where the forward was
    not followed), and whether autocast was on. Where the tracker collected shares or autocast
    was on, the backwards run one at a time, not under ``vmap``."""

    output: Any
    reached: list
    direct: set[int]
    sources: bool
    tracker: Tracker | None
    batch: int
    autocast: bool  # (torch's vmapped backward of a LayerNorm in mixed dtypes fails)


def hooked_forward(h: Hooks, model: nn.Module, args: tuple, kwargs: dict) -> HookedForward:
    """``model(*args, **kwargs)`` under the hooks ``h``, noting what :func:`jacobians` and
    :func:`gradhooks.kfac` need for their backwards."""
    with _frame_tracker(h, model) as seen, engine_of(h).output_edges() as reached:
        out = model(*args, **kwargs)
    tracker = seen.get("tracker")
    first = input_tensors((args, kwargs))[0]
    batch = tracker.batch if tracker is not None else (first.shape[0] if first.dim() else 1)
    direct = engine_of(h).directly_used()
    sources = tracker is not None and bool(tracker.edges)
    return HookedForward(
        out, reached, direct, sources, tracker, batch, autocast_dtype() is not None
    )


@contextmanager
def _frame_tracker(h: Hooks, model: nn.Module) -> Iterator[dict]:
    """The tracker of the next forward of ``model`` (its frame is opened by the hooks' own
    forward pre-hook, which runs before this one)."""
    seen: dict = {}
    engine = engine_of(h)

    def grab(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if "tracker" not in seen and engine.running():
            seen["tracker"] = engine.tracker()

    handle = model.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def checked_output(run: HookedForward, model: nn.Module, who: str, expected: str) -> Tensor:
    """The model's output, refused unless it is one tensor with the examples on dimension 0,
    row ``b`` example ``b``'s."""
    out, batch = run.output, run.batch
    name = type(model).__qualname__
    if not isinstance(out, Tensor):
        raise ConfigurationTypeError(
            f"{who}(): {name} returned a {type(out).__qualname__}, not a tensor; {who} needs one "
            f"tensor {expected} with example b's outputs in row b: wrap the model in a module "
            "that returns it (a Hugging Face model's .logits)"
        )
    lay = run.tracker.layout(out) if run.tracker is not None else UNKNOWN
    problem = None
    if out.dim() == 0:
        problem = (
            "it is a scalar, with no dimension for the examples (a loss summed over the batch?)"
        )
    elif lay is None:
        problem = "it depends on no example"
    elif lay is MIXED:
        problem = "each entry depends on several examples (computed across the batch)"
    elif lay is not UNKNOWN and lay.dim >= 0 and (lay.dim != 0 or not lay.plain):
        problem = f"the examples are on {lay.describe(batch)}, not in the rows of dimension 0"
    elif out.shape[0] != batch:
        problem = f"dimension 0 has {out.shape[0]} rows, not one per example"
    if problem is not None:
        raise ConfigurationError(
            f"{who}(): {name}'s output {tuple(out.shape)} for a batch of {batch} examples "
            f"(dimension 0 of the first input): {problem}; {who} needs one tensor {expected} "
            "with example b's outputs in row b: return the per-example outputs (before any "
            "reduction over the batch), moved to dimension 0"
        )
    return out

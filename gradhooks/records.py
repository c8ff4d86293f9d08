"""What the engine keeps while it captures: per call, per forward of the model, per backward."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from . import _torch
from ._torch import tree_flatten, tree_map
from .inert import InertHook
from .layout import Layout, Tracker


@dataclass
class CallLayout:
    """Where the examples are in one captured call (from the forward's :class:`Tracker`).

    ``kind``: ``"plain"`` (where the rule reads them), ``"moved"`` (a position-wise layer's
    examples on another dimension, or folded: moved to dimension 0 before the rule),
    ``"fold"`` (another layer's examples folded into its batch dimension: the rule's rows of
    one example summed), ``"shared"`` (the call does not depend on the examples: its
    per-example output-gradients come from where its output meets the batch) or
    ``"unknown"`` (not followed: the rule's dimension is taken, and the batch size checked) or
    ``"owners"`` (rows picked from the batch by an index, each one example's: the rule's rows
    of one example summed, :meth:`gradhooks.pieces.Piece.owned`).
    """

    kind: str  # also "mismatch": the examples are not where the rule reads them (an error)
    batch: int
    first: Layout | None = None  # of the first input with examples
    inputs: tuple = ()  # per leaf of (args, kwargs)
    outputs: tuple = ()  # per leaf of the output
    sources: tuple = ()  # "shared": per output leaf, its Source (or None)
    lost: tuple = ()  # "unknown": the operations the tracker could not follow the batch through
    root: bool = False  # its first input is one of the forward's own (auto: a guess to check)


@dataclass
class CallState:
    """One captured forward call, until its backward."""

    params: dict[str, nn.Parameter]
    frame: Frame | None  # the model's forward it was called in (None: outside one)
    derived: bool = False  # a create_graph backward went through it (see Hooks._on_grads)
    cancelled: bool = False  # its forward raised: never captured
    layout: CallLayout | None = None
    versions: tuple = ()  # (tensor, version) of its kept inputs, to refuse in-place changes
    out_versions: tuple = ()  # (leaf index, version) of its kept output


@dataclass
class Frame:
    """One root forward of the model (kept by its calls until their backward)."""

    batch: int | None  # dimension batch_dim of the first tensor input (an int batch_dim)
    states: list[CallState]
    grad_enabled: bool = True
    owner: Any = None  # the module whose call it is (the root, or an entry: _entry_hooks)
    sizes: set[int] = field(default_factory=set)  # dims 0, 1 of its tensor inputs and outputs
    seen: dict[int, str] = field(default_factory=dict)  # batch sizes the layers saw -> a layer
    tracker: Tracker | None = None  # follows the batch through this forward
    roots: list = field(default_factory=list)  # the forward's tensor inputs
    signature: list = field(default_factory=list)  # (call, kind) of its captured calls
    # a call of it ran under saved-tensor hooks or with grad mode off (activation
    # checkpointing: run again at the backward), or under autocast: no probe (_arm_probe)
    unprobed: bool = False


@dataclass
class Backward:
    """One backward pass (autograd graph task), while it runs."""

    reached: set[int]  # ids of parameters whose calls this backward captured
    computed: set[int]  # ids of parameters whose gradient this backward computes
    before: dict[int, Tensor | None]  # grad1 before this backward first wrote it (rollback)
    missed: list[str]  # parameters it computed without a captured call
    # parameters it reached through their direct uses in a followed forward: (id) -> (sources,
    # the operations whose effect on the batch that forward did not know)
    direct: dict[int, tuple[set, dict]] = field(default_factory=dict)
    memory_checked: bool = False
    derived: str | None = None  # a call it reached through an earlier create_graph backward
    pending: dict[int, Any] = field(default_factory=dict)  # tapped calls still waiting
    verify: frozenset = frozenset()  # the forwards' signatures this backward verifies
    grads: dict[int, Tensor] = field(default_factory=dict)  # (verify) each parameter's gradient
    frames: set[int] = field(default_factory=set)  # ids of the forwards whose calls it reached
    probe: Probe | None = None  # (verify) one example's gradient, by autograd alone
    # (verify, without grad1) every call's pieces, (pieces, params, scale), for the norms' check
    kept: list[tuple[dict, dict, float]] = field(default_factory=list)


@dataclass
class Probe:
    """Every parameter's gradient as autograd gives it from the model's output-gradients with
    each example's rows weighted by ``weights[i]`` (:meth:`Hooks._probe`): ``Σ_i weights[i] ·
    grad1[i]`` must equal it (without ``grad1``: formed from the pieces, :func:`pieces.weighted_sums`)."""

    frame: int  # id of the forward whose outputs it started from
    weights: Tensor  # [batch]
    grads: dict[int, Tensor]  # by parameter id
    # from the output-gradients as they are: where it is not autograd's gradient of the
    # parameter in the backward itself, the loss reached it otherwise (a term on an
    # activation a hook kept), and that parameter is not compared
    plain: dict[int, Tensor]
    last: dict[int, Tensor]  # (without grad1) the last example's gradient alone
    lost: tuple[str, ...] = ()  # operations the forward's tracker lost the examples through

    @property
    def batch(self) -> int:
        return self.weights.shape[0]


class Hook:
    """A hook object (not a closure), so that a hooked model deep-copies and pickles: the copy
    gets an inert hook. Under ``torch.compile`` it runs eagerly (a graph break), on real
    tensors."""

    def __init__(self, fn) -> None:
        self.fn = fn
        # removed while its module's call runs (the hooks planned again at the root's forward
        # pre-hook): torch still calls it once, from its copy of the module's hooks
        self.dead = False

    def __call__(self, *args: Any) -> Any:
        if self.dead:
            return None
        if is_compiling():
            return torch.compiler.disable(self.fn)(*args)
        return self.fn(*args)

    def __reduce__(self):
        return (InertHook, ())


# Looked up once, not in every hook call (each hooked call asks both several times).
_COMPILER_IS_COMPILING = getattr(getattr(torch, "compiler", None), "is_compiling", None)


def is_compiling() -> bool:
    return _COMPILER_IS_COMPILING is not None and bool(_COMPILER_IS_COMPILING())


def drop_box(box: dict) -> None:
    """Let go of what :meth:`Hooks._arm_probe` held of a forward's graph."""
    handle = box.get("handle")
    box.clear()
    if handle is not None:
        handle.remove()


def power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def autocast_on() -> bool:
    """Whether autocast is on for the CPU or CUDA."""
    try:
        return any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))
    except TypeError:  # (torch before 2.4: no device argument)
        return torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()


def graph_task() -> int:
    """The id of the running backward (-1 outside any)."""
    return _torch.graph_task_id()


def detach_tree(tree: Any) -> Any:
    if type(tree) is Tensor:
        return tree.detach()
    if _flat(tree):
        return tuple(t.detach() for t in tree) if type(tree) is tuple else tree
    return tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, tree)


def tree_leaves(tree: Any) -> list[Any]:
    """``tree_flatten(tree)[0]``, without pytree (which costs more per call, and leaves a
    reference cycle for the garbage collector) for a tensor and where :func:`_flat`."""
    if type(tree) is Tensor:
        return [tree]
    return list(tree) if _flat(tree) else tree_flatten(tree)[0]


def _flat(tree: Any) -> bool:
    """A tuple of tensors or an empty dict: a call's usual args and kwargs."""
    if type(tree) is tuple:
        return all(type(t) is Tensor for t in tree)
    return type(tree) is dict and not tree

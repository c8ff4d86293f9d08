"""What the engine keeps while it captures: per call, per forward of the model, per backward."""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from .. import _torch
from .._torch import tree_flatten, tree_map, tree_unflatten
from ..autocast import autocast_enabled
from ..errors import ConfigurationTypeError, UnsupportedError
from ..inert import InertHook
from ..pieces import CallPieces
from ..tracking import Layout, Tracker
from . import compiled
from .compiled import FULLGRAPH


@dataclass(frozen=True)
class BackwardMode:
    """How the engine treats the backwards run now: as the model's own (the default), or as
    one of a workflow's, set for a block by :meth:`gradhooks.engine.api.EngineAPI.backward_mode`.

    ``capture=False``: the backwards write nothing (no ``grad1``, no quantity, no
    bookkeeping), as a reweighted backward of DP's own that only wants ``.grad``.
    ``param_grads=False``: the backwards' parameter gradients are not used (only the
    quantities are), so calls run detached need not give theirs."""

    capture: bool = True
    param_grads: bool = True


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
    derived: bool = False  # a create_graph backward went through it (see BackwardWriter.on_grads)
    cancelled: bool = False  # its forward raised: never captured
    layout: CallLayout | None = None
    versions: tuple = ()  # (tensor, version) of its kept inputs, to refuse in-place changes
    out_versions: tuple = ()  # (leaf index, version) of its kept output
    # the lowest floating-point precision its forward ran in (see :func:`lowest_precision`)
    precision: torch.dtype | None = None
    in_backward: bool = False  # its forward ran while a backward ran (a backward's own forward)


class BufferStates(NamedTuple):
    """The buffers of a call whose forward changed them in place, copied as the call found
    them and as it left them (``{name: tensor}``, ``named_buffers(remove_duplicate=False)``)."""

    found: dict[str, Tensor]
    left: dict[str, Tensor]


@dataclass
class Frame:
    """One root forward of the model (kept by its calls until their backward)."""

    # dimension batch_dim of the first tensor input (an int batch_dim; or 0: no example)
    batch: int | None
    states: list[CallState]
    grad_enabled: bool = True
    owner: Any = None  # the module whose call it is (the root, or an entry: _entry_hooks)
    # the thread that runs it (a forward of the model started in another thread meanwhile is
    # refused: ForwardCapture.refuse_concurrent)
    thread: int = field(default_factory=threading.get_ident)
    sizes: set[int] = field(default_factory=set)  # dims 0, 1 of its tensor inputs and outputs
    seen: dict[int, str] = field(default_factory=dict)  # batch sizes the layers saw -> a layer
    tracker: Tracker | None = None  # follows the batch through this forward
    roots: list = field(default_factory=list)  # the forward's tensor inputs
    signature: list = field(default_factory=list)  # (call, kind) of its captured calls
    # the parameters the tracker saw it use directly, outside a call with a rule (by id, in
    # order, repeated): where it captured no call, they stand for its calls (on_root_post)
    direct: list = field(default_factory=list)
    # a call of it ran under saved-tensor hooks or with grad mode off (activation
    # checkpointing: run again at the backward): no probe (_arm_probe)
    unprobed: bool = False
    # per module without a rule running in training mode, by id: its buffers as each of its
    # calls (innermost last) found them, (name, buffer, version, copy) (ForwardCapture._buffers_of)
    buffers: dict[int, list] = field(default_factory=dict)
    # per module without a rule, by id: the tensors it kept in its attributes as each of its
    # calls (innermost last) found them (ForwardCapture._kept_before), held for the call alone
    kept: dict[int, list] = field(default_factory=dict)
    # (batch_dim "auto") the shape of its first tensor input where that has no entries but a
    # dimension 0 of some size: a batch of empty examples, or no example on another dimension
    empty: tuple[int, ...] | None = None
    # (batch_dim "auto") where its first hooked call moved the batch, a sequence-first layer
    # given the first input: (that dimension, the call's description) (CallLayouts._reseed)
    reseeded: tuple[int, str] | None = None
    # where its examples lie in the memory its first batched input shares (calls.Rows)
    rows: Any = None
    # the forward hook that follows the batch through its TorchScript calls (opaque.py)
    scripted: Any = None
    # the precision its float32 calls' products ran in where torch lowers it
    # (:func:`float32_products`: bfloat16 under set_float32_matmul_precision("medium"))
    products: torch.dtype | None = None
    # the model's inputs as long as the batch that its tracker took as shared by every example
    # (tracking.propagate.SharedInput): their rows are no example's own
    shared: tuple = ()
    _ref: Any = field(default=None, repr=False, compare=False)  # (see ref)

    def ref(self) -> weakref.ref:
        """A weak reference to this frame (one for all who ask)."""
        if self._ref is None:
            self._ref = weakref.ref(self)
        return self._ref


class HeldCall(NamedTuple):
    """A call's pieces a nested backward holds for the quantities until its end (the
    arguments of :meth:`gradhooks.quantities.collector.Collector.add`)."""

    name: str  # the call's qualified name
    pieces: dict[str, Any]  # its pieces, by parameter name
    params: dict[str, Tensor]  # the parameters they are of
    scale: float


@dataclass
class Backward:
    """One backward pass (autograd graph task), while it runs."""

    reached: set[int]  # ids of parameters whose calls this backward captured
    computed: set[int]  # ids of parameters whose gradient this backward computes
    before: dict[int, Tensor | None]  # grad1 before this backward first wrote it (rollback)
    missed: list[str]  # parameters it computed without a captured call
    # (by id) the parameter and the grad1 it held from before a reset, off the parameter
    # while this backward runs, since it is not this backward's (BackwardWriter._restart)
    hidden: dict[int, tuple[nn.Parameter, Tensor]] = field(default_factory=dict)
    # (by id) parameters whose .grad an earlier backward added to and left None (an optimizer
    # step fused into it), None still at this one's start: their grad1 goes at its end unless
    # it computes their gradient (GradTrail.emptied)
    emptied: dict[int, nn.Parameter] = field(default_factory=dict)
    # ids of parameters its calls reached that a planning since their forward dropped and
    # that are frozen now (Hooks._hook_dropped): their grad1 is left as autograd leaves .grad
    frozen: set[int] = field(default_factory=set)
    # parameters it reached through their direct uses in a followed forward: (id) -> (sources,
    # the operations whose effect on the batch that forward did not know)
    direct: dict[int, tuple[set, dict]] = field(default_factory=dict)
    memory_checked: bool = False
    derived: str | None = None  # a call it reached through an earlier create_graph backward
    pending: dict[int, Any] = field(default_factory=dict)  # tapped calls still waiting
    verify: frozenset = frozenset()  # the forwards' signatures this backward verifies
    # (verify) each parameter's gradient, as compare.hold keeps it
    grads: dict[int, Tensor] = field(default_factory=dict)
    frames: set[int] = field(default_factory=set)  # ids of the forwards whose calls it reached
    # each parameter's forwards among those (ids): whose calls of it the backward reached
    frames_of: dict[int, set[int]] = field(default_factory=dict)
    # where the examples of those forwards lie in memory (Frame.rows), and a call of each
    rows_of: list[tuple[Any, str]] = field(default_factory=list)
    probe: Probe | None = None  # (verify) one example's gradient, by autograd alone
    # (not verify) the parameter the spot check compares (Verifier.spot_check): its id, and
    # its gradient's entries that it compares, as autograd gave them
    spot: int | None = None
    spot_grad: Tensor | None = None
    # (verify, without grad1) for the norms' check, per parameter id, its calls' pieces weighted
    # over the examples as the probe's rows were, summed as they come (as compare.hold keeps
    # it; None: a layer that counts its examples otherwise); the pieces of calls before the
    # probe ran, as they are
    weighted: dict[int, Tensor | None] = field(default_factory=dict)
    kept: list[CallPieces] = field(default_factory=list)
    # per parameter id, the terms autograd's kernels added one by one in a half precision to
    # form its gradient, over this backward's calls (pieces.Piece.rounded_terms)
    rounded: dict[int, int] = field(default_factory=dict)
    # how many of its calls ran with grad mode off (owned: their rule gives the parameters'
    # and inputs' gradients, in the parameters' dtype, and the probe's reference through them
    # is autograd's in that dtype too, capture._rerun_as_rule), and per parameter id whether
    # every call of it that it reached was owned (Verifier's probe_precision)
    owned_calls: int = 0
    owned_only: dict[int, bool] = field(default_factory=dict)
    # per parameter id with rounded terms, the largest entry of the sum of their magnitudes, the
    # scale of their rounding (pieces.Piece.terms_scale), over this backward's calls; or of
    # several calls' shares, each rounded (shares, taken in by the check)
    terms_scale: dict[int, Tensor] = field(default_factory=dict)
    # (verify, in a half precision) per parameter id, the largest entry of each of its calls'
    # share of the gradient, and of that share weighted over the examples as the probe's rows
    # are (None: no probe): autograd rounds each share, and the shares of a layer called
    # several times may cancel (a triplet network's last bias, whose gradient is zero), so
    # that the sum is rounding of the shares, not of what is left
    shares: dict[int, list[tuple[Tensor, Tensor | None]]] = field(default_factory=dict)
    batch: int | None = None  # the examples of the grad1 it wrote
    # the batch sizes its calls gave -> (the first call of each, whether its forward was an
    # entry's: a submodule called outside the model's forward)
    rows: dict[int, tuple[str, bool]] = field(default_factory=dict)
    capturing: bool = True  # captured (not paused; marked where capture="marked")
    # the lowest floating-point precision its calls ran in (see :func:`lowest_precision`)
    precision: torch.dtype | None = None
    # started while another backward of the handle ran (reentrant checkpointing, a backward
    # taken in a custom autograd.Function's backward or a gradient hook): what it hands the
    # quantities waits in ``held`` until its end says whether it computed parameter gradients
    nested: bool = False
    held: list[HeldCall] = field(default_factory=list)
    attached: set[int] = field(default_factory=set)  # reached through calls autograd runs
    accumulated: set[int] = field(default_factory=set)  # parameters whose .grad it accumulated
    # it adds into .grad (a backward(), not a torch.autograd.grad): seen at a parameter whose
    # AccumulateGrad node it runs (BackwardWriter.set_aside)
    adds: bool = False
    # per parameter id, what it did to .grad, for a refusal to undo (BackwardWriter.undo_grads):
    # (.grad before it, the gradient autograd added into that .grad; None, None: .grad was None)
    added: dict[int, tuple[Tensor | None, Tensor | None]] = field(default_factory=dict)
    # each parameter's gradient as autograd gave it to gradhooks' hook, (tensor, version), until
    # the parameter's accumulation, where a hook of the user's may have changed it
    raw: dict[int, tuple[Tensor, int]] = field(default_factory=dict)
    # per parameter id, the factor such a hook multiplied its gradient by: the grad1 of a call
    # written after the accumulation (MultiheadAttention's out_proj, whose .grad autograd
    # accumulates before the layer's rule runs) is multiplied alike
    factors: dict[int, float] = field(default_factory=dict)
    batched: str | None = None  # an is_grads_batched backward (under vmap): what it reached
    inside: bool = False  # it reached a call whose forward ran during a backward
    # the devices autocast is on for in it (autocast_devices, read at its start: the hooks'
    # own products run with autocast off there)
    autocast: tuple[str, ...] = ()


@dataclass
class Probe:
    """Every parameter's gradient as autograd gives it from the model's output-gradients with
    each example's rows weighted by ``weights[i]`` (:meth:`Verifier._probe`): ``Σ_i weights[i] ·
    grad1[i]`` must equal it (without ``grad1``: formed from the pieces, :func:`pieces.weighted_sums`)."""

    frame: int  # id of the forward whose outputs it started from
    weights: Tensor  # [batch]
    grads: dict[int, Tensor]  # by parameter id (as compare.hold keeps them)
    # from the output-gradients as they are: where it is not autograd's gradient of the
    # parameter in the backward itself, the loss reached it otherwise (a term on an
    # activation a hook kept), and that parameter is not compared
    plain: dict[int, Tensor]
    last: dict[int, float]  # (without grad1) the norm of the last example's gradient alone
    lost: tuple[str, ...] = ()  # operations the forward's tracker lost the examples through
    exact: bool = False  # weights of powers of two (pieces.example_weights): no rounding
    # the lowest precision the forward computed the examples' tensors in (its calls', and the
    # operations' between them: a softmax in float32 inside a float64 model)
    precision: torch.dtype | None = None

    @property
    def batch(self) -> int:
        return self.weights.shape[0]


_DYNAMO = "torch._dynamo"  # (imported by torch.compile; importing it takes seconds)


class Hook:
    """A hook object (not a closure), so that a hooked model deep-copies and pickles: the copy
    gets an inert hook. Under ``torch.compile`` it is a graph break after which the rest of
    the compiled call runs eagerly, on real tensors (:mod:`gradhooks.engine.compiled`)."""

    made = 0  # how many hooks were made so far: each one's ``serial``

    def __init__(self, fn, owner: Any = None) -> None:
        self.fn = fn
        self.serial = Hook.made
        Hook.made += 1
        # the handle whose hook it is: kept alive by its modules' hooks, as long as they are
        # (the registries of hooked modules hold it weakly)
        self.owner = owner
        # removed while its module's call runs (the hooks planned again at the root's forward
        # pre-hook): torch still calls it once, from its copy of the module's hooks
        self.dead = False
        # fn for code dynamo traces (compiled.eager), made outside any compilation where
        # torch's compiler is loaded: made while torch.compile traces, fullgraph=True would
        # fail naming torch.compiler.disable itself rather than why
        self._eager: Any = None
        if _DYNAMO in sys.modules:
            self._prepare()

    def _prepare(self) -> None:
        self._eager = compiled.eager(self.fn)
        compiled.prepare()

    def __call__(self, *args: Any) -> Any:
        if self.dead:
            return None
        # (is_compiling's test, without the frame of a call to it: asked by every hook)
        if _COMPILER_IS_COMPILING is not None and _COMPILER_IS_COMPILING():
            if _DYNAMO_COMPILING is not None and not _DYNAMO_COMPILING():
                return self.fn(*args)  # (run for real: torch.export without dynamo)
            if self._eager is not None:
                if compiled.leave():  # (a graph break: from here on, eager)
                    return self.fn(*args)
                return self._eager(*args)
            # (no wrapper yet: torch.compile traces this, and would trace the making of one.
            # Raised here, the frame runs eagerly, where the wrapper is made; with
            # fullgraph=True, torch.compile fails with this message)
            raise UnsupportedError(FULLGRAPH)
        if self._eager is None:
            if _DYNAMO not in sys.modules:
                return self.fn(*args)
            self._prepare()
        # (run for real in a frame dynamo would compile, one it gave up tracing: the rest of
        # the compiled call, if any, runs eagerly)
        _torch.leave_compiled()
        return self.fn(*args)

    def __reduce__(self):
        return (InertHook, ())


# Looked up once, not in every hook call (each hooked call asks both several times).
_COMPILER_IS_COMPILING = getattr(getattr(torch, "compiler", None), "is_compiling", None)
_DYNAMO_COMPILING = getattr(getattr(torch, "compiler", None), "is_dynamo_compiling", None)


def is_compiling() -> bool:
    return _COMPILER_IS_COMPILING is not None and bool(_COMPILER_IS_COMPILING())


def drop_box(box: dict) -> None:
    """Let go of what :meth:`Verifier.arm_probe` held of a forward's graph."""
    handle = box.get("handle")
    box.clear()
    if handle is not None:
        handle.remove()


def power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def autocast_dtype() -> torch.dtype | None:
    """The lower of the dtypes autocast runs its eligible operations in, on the CPU and CUDA
    (``None`` where it is off on both)."""
    found = None
    for device in ("cpu", "cuda"):
        try:
            on = torch.is_autocast_enabled(device)
            dtype = torch.get_autocast_dtype(device) if on else None
        except (TypeError, AttributeError):  # (torch before 2.4: no device argument)
            on = torch.is_autocast_cpu_enabled() if device == "cpu" else torch.is_autocast_enabled()
            get = torch.get_autocast_cpu_dtype if device == "cpu" else torch.get_autocast_gpu_dtype
            dtype = get() if on else None
        found = lowest_precision(found, dtype)
    return found


def lowest_precision(*dtypes: torch.dtype | None) -> torch.dtype | None:
    """Of the floating-point ``dtypes`` (``None`` and the others are passed over), the one
    that rounds the most (the largest ``finfo(dtype).eps``: bfloat16 before float16 before
    float32). The checks of a backward derive their tolerance from it: two computations of a
    gradient that each rounded in bfloat16 differ by many more float32 units than two that
    stayed in float32."""
    found = None
    low = 0.0
    for d in dtypes:
        if d is None or d is found:
            continue
        eps = _EPS.get(d)
        if eps is None:
            eps = _EPS[d] = torch.finfo(d).eps if d.is_floating_point else 0.0
        if eps and (found is None or eps > low):
            found, low = d, eps
    return found


_EPS: dict[torch.dtype, float] = {}  # finfo(dtype).eps by dtype (0.0: not floating-point)


def half_precision(dtype: torch.dtype | None) -> bool:
    """Whether ``dtype`` rounds more coarsely than float32 (bfloat16, float16)."""
    return (
        dtype is not None
        and dtype.is_floating_point
        and torch.finfo(dtype).eps > torch.finfo(torch.float32).eps
    )


def call_precision(
    args: Any, output: Any, autocast: bool | None = None, leaves: list | None = None
) -> torch.dtype | None:
    """The lowest precision a call ran in: its floating-point inputs' and outputs' dtypes, and
    autocast's where it is on (an operation inside the call may have run in it, and the
    gradients through it round in it too, whatever the dtypes at the call's boundary).
    ``autocast``: :func:`autocast_on`, ``leaves``: ``tree_leaves((args, output))``, where the
    caller has them."""
    if leaves is None:
        leaves = tree_leaves((args, output))
    dtypes = {t.dtype for t in leaves if isinstance(t, Tensor)}
    if autocast is None:
        autocast = autocast_on()
    if not autocast and len(dtypes) == 1:
        (dtype,) = dtypes
        return dtype if _EPS.get(dtype) else lowest_precision(dtype)
    return lowest_precision(autocast_dtype() if autocast else None, *dtypes)


def float32_products() -> torch.dtype | None:
    """bfloat16 where torch may run float32 matrix products, convolutions or recurrent layers
    in it: ``torch.set_float32_matmul_precision("medium")`` (on the CPU, oneDNN's bfloat16
    products, where the processor has them) or a ``torch.backends`` ``fp32_precision`` of
    ``"bf16"`` (the generic one, oneDNN's, or its matmul's, conv's or rnn's); else ``None``.
    A float32 call's gradients then round as bfloat16's do, and the checks allow for it (also
    where an operation set back to ``"ieee"`` below a ``"bf16"`` one does not round: a looser
    check, never a false alarm)."""
    try:
        found = _torch.fp32_precisions()
    except (AttributeError, RuntimeError):  # (torch before the fp32_precision settings)
        found = {torch.get_float32_matmul_precision()}
    return torch.bfloat16 if found & {"bf16", "medium"} else None


def autocast_off(devices: tuple[str, ...] | None = None) -> contextlib.AbstractContextManager:
    """Autocast switched off for the devices it is on for (``devices``: those, as
    :func:`autocast_devices` gave them). The hooks' own products (pieces into ``grad1``, norms,
    factors) run in the precision the engine chose for them
    (:meth:`gradhooks.pieces.Piece.in_dtype`), also where the backward runs inside the
    autocast block, which would otherwise cast them back to bfloat16 or float16."""
    if devices is None:
        devices = autocast_devices()
    if not devices:
        return NOTHING  # (the usual)
    return _autocast_off(list(devices))


def autocast_devices() -> tuple[str, ...]:
    """The devices autocast is on for now (``()``, the usual: none). A backward runs in the
    autocast state it started in (autograd hands its thread-local state to every node), so
    that one reads it once (:attr:`Backward.autocast`)."""
    if not autocast_on():
        return ()
    return tuple(d for d in ("cpu", "cuda") if autocast_enabled(d))


# what autocast_off gives where autocast is off (a caller may skip entering it)
NOTHING = contextlib.nullcontext()


@contextlib.contextmanager
def _autocast_off(devices: list[str]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for d in devices:
            stack.enter_context(torch.autocast(d, enabled=False))
        yield


def autocast_on() -> bool:
    """Whether autocast is on for the CPU or CUDA."""
    try:
        return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")
    except TypeError:  # (torch before 2.4: no device argument)
        return torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()


# The id of the running backward (-1 outside any): _torch.graph_task_id, torch's own function
graph_task: Callable[[], int] = _torch.graph_task_id


def leaves_of(t: Tensor) -> list[Tensor]:
    """The tensors requiring grad that autograd gives ``t``'s gradient to: the leaves of the
    graph that computed it, in the order first reached."""
    found: dict[int, Tensor] = {}
    seen: set[int] = set()
    stack = [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        leaf = getattr(node, "variable", None)  # (AccumulateGrad)
        if isinstance(leaf, Tensor) and leaf.requires_grad:
            found.setdefault(id(leaf), leaf)
        stack.extend(nxt for nxt, _ in node.next_functions)
    return list(found.values())


def with_fields(record: Any, **changes: Any) -> Any:
    """``dataclasses.replace(record, **changes)`` for a dataclass without ``__post_init__``,
    init-only or non-init fields (a :class:`~gradhooks.rules.registry.Call`): its fields copied
    as they are, at a quarter of the cost (a call's record is renewed several times per call)."""
    fields = type(record).__dataclass_fields__
    for name in changes:
        if name not in fields:
            unknown = sorted(changes.keys() - fields.keys())
            raise ConfigurationTypeError(f"{type(record).__name__} has no field {unknown}")
    new = object.__new__(type(record))
    new.__dict__.update(record.__dict__)
    new.__dict__.update(changes)
    return new


def args_leaves(args: tuple, kwargs: dict) -> tuple[list[Any], Callable[[list], tuple]]:
    """The leaves of a call's ``(args, kwargs)`` (``tree_flatten``'s), and what puts leaves in
    their places again (``tree_unflatten`` with its spec: ``(args, kwargs)`` back), without
    pytree where both are plain (:func:`tree_leaves`)."""
    if (
        type(args) is tuple
        and type(kwargs) is dict
        and all(type(a) in _LEAF_TYPES for a in args)
        and all(type(v) in _LEAF_TYPES for v in kwargs.values())
    ):
        n, keys = len(args), tuple(kwargs)
        return [*args, *kwargs.values()], lambda new: (
            tuple(new[:n]),
            dict(zip(keys, new[n:], strict=True)),
        )
    leaves, spec = tree_flatten((args, kwargs))
    return leaves, lambda new: tree_unflatten(new, spec)


def detach_tree(tree: Any) -> Any:
    """``tree`` with every tensor detached (pytree's ``tree_map``, without pytree for a tensor
    and a plain tuple or dict of leaves: :func:`tree_leaves`)."""
    if type(tree) is Tensor:
        return tree.detach()
    if type(tree) is tuple and len(tree) == 1 and type(tree[0]) is Tensor:
        return (tree[0].detach(),)  # (a module's usual input: no generator to run)
    if type(tree) is dict and not tree:
        return {}  # (and no keyword)
    if type(tree) is tuple and all(type(t) in _LEAF_TYPES for t in tree):
        return tuple([t.detach() if isinstance(t, Tensor) else t for t in tree])
    if type(tree) is dict and all(type(t) in _LEAF_TYPES for t in tree.values()):
        return {k: t.detach() if isinstance(t, Tensor) else t for k, t in tree.items()}
    return tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, tree)


class OwnWork:
    """``with OwnWork(tracker):`` the engine's own torch functions inside a forward (a hook's
    ``.dim()`` and ``.detach()``, a rule's checks of a call) are not the model's: ``tracker``
    (``None``: no forward followed) does not see them. It is taken off torch's mode stack for
    the block (:func:`gradhooks._torch.pop_mode`), which costs them nothing; where it cannot
    be (another mode entered inside it, the internal missing) or where it hands detached
    aliases of parameters to every torch function (:attr:`Tracker.aliases`: a call run
    detached is running, and the hooks of the calls inside it must see the aliases too), it
    stays on, paused (:meth:`Tracker.paused`), and passes them on unseen."""

    __slots__ = ("tracker", "popped", "paused")

    def __init__(self, tracker: Tracker | None) -> None:
        self.tracker = tracker
        self.popped = False
        self.paused: Any = None

    def __enter__(self) -> None:
        tracker = self.tracker
        if tracker is None:
            return
        if not tracker.aliases and _torch.pop_mode(tracker):
            self.popped = True
        else:
            self.paused = tracker.paused()
            self.paused.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.popped:
            _torch.push_mode(self.tracker)
        elif self.paused is not None:
            self.paused.__exit__(*exc)


def tree_leaves(tree: Any) -> list[Any]:
    """``tree_flatten(tree)[0]``, without pytree (which costs more per call, and leaves a
    reference cycle for the garbage collector) for what a call's arguments and outputs
    usually are: tensors, numbers, strings and ``None`` in plain tuples, lists and dicts,
    nested. Any other type (a namedtuple, a ``torch.Size``, a ``ModelOutput``, a registered
    node or an unknown leaf) is flattened by pytree where it stands: a tree's leaves are its
    children's, in order, so the result is pytree's, element for element."""
    if type(tree) is Tensor:
        return [tree]
    out: list[Any] = []
    _leaves_into(tree, out)
    return out


# the types pytree takes as leaves that a call's arguments usually hold (exact types: a
# subclass may be a registered node)
_LEAF_TYPES = frozenset({Tensor, nn.Parameter, int, float, bool, complex, str, type(None)})


def _leaves_into(tree: Any, out: list[Any]) -> None:
    kind = type(tree)
    if kind in _LEAF_TYPES:
        out.append(tree)
    elif kind is tuple or kind is list:
        for x in tree:
            if type(x) in _LEAF_TYPES:
                out.append(x)
            else:
                _leaves_into(x, out)
    elif kind is dict:  # (pytree flattens a dict in its keys' order, as iterated)
        for x in tree.values():
            if type(x) in _LEAF_TYPES:
                out.append(x)
            else:
                _leaves_into(x, out)
    else:
        out.extend(tree_flatten(tree)[0])

"""The engine: hooks, capture and accumulation. It never names a layer type.

A forward hook on every module that has a rule keeps that call's inputs (detached; autograd keeps
them alive anyway) and registers a gradient hook on the call's output tensors. When backward
reaches those outputs, the rule turns (inputs, output-gradients) into pieces and the per-example
gradient of each trainable parameter is added to ``param.grad1``.

Pairing the gradient hook with the call it came from (rather than with the module) is what makes
a module called twice in one forward correct; accumulating on the parameter object is what makes
tied weights correct.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import sys
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from . import _torch
from . import pieces as P
from ._torch import tree_flatten, tree_map, tree_unflatten
from .check import CheckReport, check_hooks
from .errors import GradhooksWarning
from .fallback import FALLBACK, fallback_params
from .inert import InertHook
from .layout import MIXED, PACKED, UNKNOWN, Layout, Source, Tracker, batch_rows, example_mask
from .memory import refuse_if_too_large
from .pause import PROCESS, Pause, set_enabled
from .quantities import _INTERNAL, QUANTITIES, Collector, total_norms
from .registry import REGISTRY, Call, CallBatch, Registry, _Entry

__all__ = ["Hooks", "add_hooks", "remove_hooks", "hooks_of", "clear_grad1"]

LossReduction = Literal["mean", "sum"]
Unsupported = Literal["fallback", "error", "skip"]
Capture = Literal["always", "marked"]

# Models and modules currently hooked, so that hooks are never added twice (which would count
# every gradient twice). Weak: a model that is garbage collected leaves nothing behind here.
_ACTIVE: weakref.WeakKeyDictionary[nn.Module, Hooks] = weakref.WeakKeyDictionary()
_HOOKED_MODULES: weakref.WeakKeyDictionary[nn.Module, Hooks] = weakref.WeakKeyDictionary()


@dataclass
class _Target:
    """One hooked module: its rule and the parameters the rule is responsible for."""

    name: str
    module: nn.Module
    entry: _Entry
    params: dict[str, nn.Parameter]
    memo: dict[str, Any] = field(default_factory=dict)  # the rule's, between calls


@dataclass
class _CallLayout:
    """Where the examples are in one captured call (from the forward's :class:`Tracker`).

    ``kind``: ``"plain"`` (where the rule reads them), ``"moved"`` (a position-wise layer's
    examples on another dimension, or folded: moved to dimension 0 before the rule),
    ``"fold"`` (another layer's examples folded into its batch dimension: the rule's rows of
    one example summed), ``"shared"`` (the call does not depend on the examples: its
    per-example output-gradients come from where its output meets the batch) or
    ``"unknown"`` (not followed: the rule's dimension is taken, and the batch size checked).
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
class _CallState:
    """One captured forward call, until its backward."""

    params: dict[str, nn.Parameter]
    frame: _Frame | None  # the model's forward it was called in (None: outside one)
    derived: bool = False  # a create_graph backward went through it (see Hooks._on_grads)
    cancelled: bool = False  # its forward raised: never captured
    layout: _CallLayout | None = None
    versions: tuple = ()  # (tensor, version) of its kept inputs, to refuse in-place changes
    out_versions: tuple = ()  # (leaf index, version) of its kept output


@dataclass
class _Frame:
    """One root forward of the model (kept by its calls until their backward)."""

    batch: int | None  # dimension batch_dim of the first tensor input (an int batch_dim)
    states: list[_CallState]
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
class _Backward:
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
    probe: _Probe | None = None  # (verify) one example's gradient, by autograd alone
    # (verify, without grad1) every call's pieces, (pieces, params, scale), for the norms' check
    kept: list[tuple[dict, dict, float]] = field(default_factory=list)


@dataclass
class _Probe:
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


class _Sums(dict):
    """The batch gradients a call's rule gives (:meth:`Hooks._backward` fills it), for the
    parameters in ``names`` only."""

    def __init__(self, names) -> None:
        super().__init__()
        self.names = frozenset(names)


@dataclass
class _Carried:
    """A call run with its parameters detached whose rule has ``taps`` (see
    :meth:`Hooks._detach_hook`): the parameters are attached to its first input through a
    :class:`_Carry` node, whose backward runs after every node of the call, so after the rule.
    Never holds a tensor of the call's own graph (a cycle through autograd's graph)."""

    target: _Target
    detached: dict[str, nn.Parameter]
    input: Tensor  # the carried input, as the caller passed it
    args: tuple  # as the caller passed them (the input not yet carried)
    kwargs: dict
    sums: _Sums
    outputs: tuple | None = None  # the call's output-gradients, once the backward has them


class _Hook:
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
        if _is_compiling():
            return torch.compiler.disable(self.fn)(*args)
        return self.fn(*args)

    def __reduce__(self):
        return (InertHook, ())


# Looked up once, not in every hook call (each hooked call asks both several times).
_COMPILER_IS_COMPILING = getattr(getattr(torch, "compiler", None), "is_compiling", None)


def _is_compiling() -> bool:
    return _COMPILER_IS_COMPILING is not None and bool(_COMPILER_IS_COMPILING())


def _drop_box(box: dict) -> None:
    """Let go of what :meth:`Hooks._arm_probe` held of a forward's graph."""
    handle = box.get("handle")
    box.clear()
    if handle is not None:
        handle.remove()


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _autocast() -> bool:
    """Whether autocast is on for the CPU or CUDA."""
    try:
        return any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))
    except TypeError:  # (torch before 2.4: no device argument)
        return torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()


def _graph_task() -> int:
    """The id of the running backward (-1 outside any)."""
    return _torch.graph_task_id()


class Hooks:
    """Per-example gradient hooks on one model. Returned by :func:`add_hooks`.

    Use it as a context manager to remove the hooks on exit::

        with gradhooks.add_hooks(model) as h:
            F.cross_entropy(model(x), y).backward()
        model.fc.weight.grad1          # [batch, *model.fc.weight.shape]

    After each captured backward, every trainable parameter that received a gradient holds
    ``param.grad1``, of shape ``[batch, *param.shape]``: ``grad1[i]`` is the gradient of example
    ``i``'s own loss. For ``loss_reduction="mean"`` (loss = mean of per-example losses)
    ``grad1.mean(0)`` equals ``param.grad``; for ``"sum"``, ``grad1.sum(0)`` does.

    A second backward without :meth:`clear` adds to ``grad1``, as ``.grad`` accumulates;
    :meth:`clear` makes the next backward start afresh (call it between training steps).

    Which backwards write ``grad1``: those that compute the model's parameter gradients
    (``torch.autograd.grad`` with respect to the input only leaves it alone), not under
    :meth:`paused`, and with ``capture="marked"`` only under :meth:`capturing`. A backward
    through derivatives taken with ``create_graph=True`` is refused (hooks cannot see the
    double backward). :meth:`check` verifies ``grad1`` after a backward.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_reduction: LossReduction = "mean",
        unsupported: Unsupported = "fallback",
        registry: Registry = REGISTRY,
        quantities: tuple[str, ...] | str = ("grad1",),
        *,
        batch_dim: int | str | None = "auto",
        max_grad1_bytes: int | str | None = "auto",
        capture: Capture = "always",
        verify: bool = True,
    ) -> None:
        _torch.require()
        quantities = (quantities,) if isinstance(quantities, str) else tuple(quantities)
        unknown = [q for q in quantities if q not in QUANTITIES + _INTERNAL]
        if unknown or not quantities:
            raise ValueError(f"quantities must be some of {QUANTITIES}, got {quantities!r}")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        if unsupported not in ("fallback", "error", "skip"):
            raise ValueError(
                f"unsupported must be 'fallback', 'error' or 'skip', got {unsupported!r}"
            )
        if not isinstance(model, nn.Module):
            raise TypeError(f"add_hooks expects an nn.Module, got {type(model).__qualname__}")
        if capture not in ("always", "marked"):
            raise ValueError(f"capture must be 'always' or 'marked', got {capture!r}")
        if batch_dim not in (None, "auto") and (not isinstance(batch_dim, int) or batch_dim < 0):
            raise ValueError(f"batch_dim must be 'auto', an int >= 0 or None, got {batch_dim!r}")
        if not (max_grad1_bytes in (None, "auto") or isinstance(max_grad1_bytes, int)):
            raise ValueError(
                f"max_grad1_bytes must be bytes, 'auto' or None, got {max_grad1_bytes!r}"
            )
        self.batch_dim = batch_dim
        self.max_grad1_bytes = max_grad1_bytes
        self.capture: Capture = capture
        self.loss_reduction: LossReduction = loss_reduction
        self.unsupported = unsupported
        self.registry = registry
        self._model_ref = weakref.ref(model)
        # parameters sharded by FSDP2 (DTensors), by qualified name (every slot): the hooks are
        # planned with these, whatever stand-in FSDP2 has put in their slots at the time
        self._shards = _fsdp_shards(model)
        self._sharded = {id(p) for p in self._shards.values()}  # per-example norms, no grad1
        self._targets = _plan(model, registry, unsupported, self._shards)
        self._check_not_hooked(model)
        self._written: dict[int, nn.Parameter] = {}
        self._removed = False
        self.quantities = quantities
        self._grad1 = "grad1" in quantities
        self._collector = Collector(model, quantities) if quantities != ("grad1",) else None
        self._ignore_backward = False  # set by dp_sgd_step for its second (reweighted) backward
        # set by dp_sgd_step's book-keeping backward, whose parameter gradients are not used:
        # calls run detached then give none (and the backward still counts as the model's)
        self._no_param_grads = False
        self._pause = Pause(PROCESS)  # `with h.paused():`, under gradhooks.paused()
        self._marked = 0  # depth of `with h.capturing()`
        self._frames: list[_Frame] = []  # root forwards running
        self._tasks: dict[int, _Backward] = {}  # backwards running, by graph task id
        self._missed: dict[str, None] = {}  # parameters a backward computed without capture
        # the bookkeeping of backwards (which parameters each computes) is off for the
        # Jacobians and kfac(), whose backwards run under vmap and write no grad1
        self._track = not {"_jacobian", "_vmapped"} & set(quantities)
        self._handles: list = []
        # calls run with their parameters detached, {id(module): [(module, {name: param},
        # (args, kwargs) where the call runs with grad mode off, else None, its _Carried where
        # its input carries them, else None, (its rule's record, what it gave) where one is
        # entered, else None)]}
        self._detached: dict[int, list[tuple[nn.Module, dict, Any, Any, Any]]] = {}
        self._rerunning = 0  # inside _rerun_vjp, or a per-example backward of the tracker's
        self._probing = False  # inside _probe's backward
        self._backwards = 0  # backwards that captured a call, since the hooks were added
        # a call ran with grad mode off inside a forward (reentrant activation checkpointing:
        # run again by a backward, but not by torch.autograd.grad, which gradhooks.dp then
        # avoids)
        self._recomputes = False
        self._probe_box: dict | None = None  # the outputs of the forward _probe starts from
        # parameters used outside their modules' calls, by id: the sources of their uses
        self._direct: dict[int, weakref.WeakSet] = {}
        # sources with a problem that no autograd graph holds (found where the forward recorded
        # none): kept until a backward ends, so that the parameter's gradient reports it
        self._unheld: list = []
        # autograd-hacks' backprop_hess: per backward, {id(param): raw per-example gradients}
        self._hessian_backprops: list[dict[int, Tensor]] = []
        self._direct_targets: dict[int, _Target] = {}
        self._functional_targets: dict[tuple, _Target] = {}
        self._target_handles: list = []
        self._module_hooks: list[_Hook] = []  # the hooks _install put on the planned modules
        self._current: dict[int, nn.Parameter] = {}  # sharded id -> its unsharded parameter
        if self._sharded and self._grad1:
            name = next(n for n, p in model.named_parameters() if id(p) in self._sharded)
            raise ValueError(
                f"'{name}' is sharded by FSDP2 (a DTensor): its grad1 would be [batch, *full "
                "shape] on every rank, which is what sharding avoids, so gradhooks does not form "
                "it. Use add_hooks(model, quantities=('norms',)) and "
                "gradhooks.distributed.dp_sgd_step (per-example norms, clipping and noise, the "
                "clipped sum sharded like the parameter)."
            )
        # the last line of defence (_verify): signatures of the calls of a forward
        self.verify = verify
        self._verified: set[tuple] = set()
        self._unverified: set[tuple] = set()
        self._exempt: set[int] = set()  # parameters whose grad1 does not sum to .grad by design
        # the quantities _probe checks one example of
        self._checks_examples = self._track and (self._grad1 or "norms" in quantities)
        _refuse_scripted(model, self._targets)
        _refuse_lazy(model)
        _refuse_complex(model, quantities)
        try:
            self._handles.append(
                model.register_forward_pre_hook(_Hook(self._on_root_pre), with_kwargs=True)
            )
            self._install(model)
            self._handles.append(
                model.register_forward_hook(
                    _Hook(self._on_root_post), with_kwargs=True, always_call=True
                )
            )
        except BaseException:
            self.remove()  # (nothing left on the model)
            raise
        _ACTIVE[model] = self

    def _install(self, model: nn.Module) -> None:
        """Hook every planned module and every trainable parameter they cover."""
        self._params: dict[int, tuple[str, nn.Parameter]] = {}  # trainable, covered, unique
        covered = {id(q) for t in self._targets for q in t.params.values()}
        for name, p in self._named_parameters(model):
            if p.requires_grad and id(p) in covered and id(p) not in self._params:
                self._params[id(p)] = (name, p)
        self._numel = sum(p.numel() for _, p in self._params.values())
        handles = self._target_handles

        def hook(fn) -> _Hook:
            made = _Hook(fn)
            self._module_hooks.append(made)
            return made

        for target in self._targets:
            detaches = target.entry.grad_from_grad1 is not None
            handles.append(
                target.module.register_forward_pre_hook(
                    hook(self._enter_hook(target)), with_kwargs=True
                )
            )
            handle = target.module.register_forward_hook(
                hook(self._forward_hook(target)), with_kwargs=True, always_call=True
            )
            handles.append(handle)
            if detaches:
                handles.append(
                    target.module.register_forward_pre_hook(
                        hook(self._detach_hook(target, handle.id)), with_kwargs=True
                    )
                )
        for entry in _entries(model, self._targets):
            pre, post = self._entry_hooks(entry)
            handles.append(
                entry.register_forward_pre_hook(hook(pre), with_kwargs=True, prepend=True)
            )
            handles.append(
                entry.register_forward_hook(hook(post), with_kwargs=True, always_call=True)
            )
        if self._track:
            for pid, (name, p) in self._params.items():
                if pid not in self._sharded:  # (FSDP2 gives them no autograd gradient)
                    handles.append(p.register_hook(self._param_hook(pid, name)))
        for target in self._targets:
            _HOOKED_MODULES[target.module] = self
        self._hooked = {id(t.module): frozenset(t.params) for t in self._targets}
        self._structure = _structure(model, bool(self._sharded))

    def _follow_changes(self, model: nn.Module) -> None:
        """At each forward: where modules were added, swapped or removed, or parameters frozen
        or unfrozen since the hooks were planned, plan them again (a new layer gets ``grad1``
        too); after :meth:`clear`, a parameter that is no longer trainable loses its
        ``grad1``."""
        if _structure(model, bool(self._sharded)) == self._structure:
            return
        if not self._shards and any(
            isinstance(m, _torch.fsdp_module_class()) for m in model.modules()
        ):
            raise RuntimeError(
                "the model was sharded with FSDP2 (fully_shard) after add_hooks: the hooks were "
                "planned with its parameters before sharding. Remove them and add them to the "
                "sharded model (add_hooks(model, quantities=('norms',)) after fully_shard)."
            )
        before = dict(self._params)
        for made in self._module_hooks:
            made.dead = True
        self._module_hooks = []
        for h in self._target_handles:
            h.remove()
        self._target_handles = []
        for t in self._targets:
            if _HOOKED_MODULES.get(t.module) is self:
                del _HOOKED_MODULES[t.module]
        self._targets = _plan(model, self.registry, self.unsupported, self._shards)
        for t in self._targets:
            other = _HOOKED_MODULES.get(t.module)
            if other is not None and other is not self:
                raise RuntimeError(
                    f"module '{t.name}' ({type(t.module).__qualname__}), added after add_hooks, "
                    f"is already hooked by another gradhooks handle ({other!r}); remove those "
                    "hooks first."
                )
        self._install(model)
        if self._collector is not None:
            for name, p in self._named_parameters(model):
                self._collector.names.setdefault(id(p), name)
        if not self._written:  # (cleared since the last backward)
            for pid, (_, p) in before.items():
                if pid not in self._params and hasattr(p, "grad1"):
                    del p.grad1

    def _named_parameters(self, model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
        """``model.named_parameters()`` with the parameters the hooks were planned with: where
        FSDP2 holds a stand-in in a sharded parameter's slot (its unsharded parameter while a
        call runs, and at the root from the forward to the backward, or one resharded after
        the forward on a smaller mesh), the sharded parameter."""
        for name, p in model.named_parameters():
            yield name, self._shards.get(name, p)

    # -- public -------------------------------------------------------------------------------

    @property
    def model(self) -> nn.Module | None:
        return self._model_ref()

    @property
    def active(self) -> bool:
        return not self._removed

    def modules(self) -> Iterator[tuple[str, nn.Module]]:
        """The hooked modules, by qualified name."""
        for t in self._targets:
            yield t.name, t.module

    def fallback_modules(self) -> Iterator[tuple[str, nn.Module]]:
        """The modules without a rule whose ``grad1`` the ``torch.func`` fallback computes
        (``unsupported="fallback"``), by qualified name."""
        for t in self._targets:
            if t.entry is FALLBACK:
                yield t.name, t.module

    def clear(self) -> None:
        """Start a new accumulation: the next backward replaces ``grad1`` instead of adding to
        it. The current ``grad1`` tensors stay readable (those of a backward that failed half
        way are put back as they were before it)."""
        if _graph_task() == -1:
            self._drop_stale()
        self._written.clear()
        self._missed.clear()
        self._hessian_backprops.clear()
        if self._collector is not None:
            self._collector.clear()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Within the block this handle captures nothing: forwards are not kept and backwards
        write no ``grad1`` (other handles are not affected). For backwards that are not the
        training loss: derivatives for a Laplacian or an input-gradient, or differentiating a
        function of ``grad1`` after a ``create_graph=True`` backward."""
        with self._pause():
            yield

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """With ``add_hooks(..., capture="marked")``, only backwards run inside this block write
        ``grad1`` (forwards are always kept)::

            h = gradhooks.add_hooks(model, capture="marked")
            out = model(x)
            dx, = torch.autograd.grad(out.sum(), x, retain_graph=True)   # not captured
            with h.capturing():
                loss_fn(out, y).backward()                                # captured
        """
        self._marked += 1
        try:
            yield
        finally:
            self._marked -= 1

    def check(
        self, loss_fn=None, inputs=None, target=None, *, examples: int = 2,
        raise_on_error: bool = True,
    ) -> CheckReport:  # fmt: skip
        """Check, after a backward, that ``grad1`` is what it claims to be; raise a
        ``RuntimeError`` naming every problem (or return them, ``raise_on_error=False``).

        Always: every parameter's ``grad1`` reduces (``mean``/``sum`` as declared) to its
        ``.grad`` (it does not when ``.grad`` accumulated over earlier steps, when the loss has a
        term that bypasses the hooked layers, such as weight decay added to the loss, or
        derivatives of the model); NaN/Inf in ``grad1`` (carried through as autograd does)
        with the examples they are in; backwards that computed gradients without a captured
        forward. ``.grad1`` reduces to ``.grad`` whatever the loss's real reduction, so the
        reduction itself needs the loss: with ``loss_fn(model(x[i:i+1]), target[i:i+1])``
        (and the ``inputs``/``target`` of the captured forward), the first ``examples``
        examples are recomputed one at a time and the report says which reduction the loss
        really used. Returns a :class:`gradhooks.CheckReport`.
        """
        return check_hooks(
            self, loss_fn, inputs, target, examples=examples, raise_on_error=raise_on_error
        )

    def rescale(self, loss_reduction: LossReduction) -> None:
        """Declare that the captured backward used ``loss_reduction`` after all, rescaling the
        ``grad1`` computed since the last :meth:`clear` (what autograd-hacks' ``compute_grad1``
        ``loss_type`` says), and use it for later backwards."""
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_type must be 'mean' or 'sum', got {loss_reduction!r}")
        if loss_reduction == self.loss_reduction:
            return
        for p in self._written.values():
            batch = p.grad1.shape[0]
            if loss_reduction == "sum":  # it was computed as mean (times batch): undo
                p.grad1.div_(max(batch, 1))
            else:
                p.grad1.mul_(batch)
        self.loss_reduction = loss_reduction

    @property
    def captured(self) -> bool:
        """Whether a backward has written ``grad1`` since the hooks were added or cleared."""
        return bool(self._written)

    # -- quantities other than grad1 (add_hooks(..., quantities=...)) -------------------------
    # Of the last backward (each backward replaces them), except kfac_factors, which accumulate
    # until clear(). All are of the per-example losses' own gradients (as grad1 is).

    def param_norms(self) -> dict[str, Tensor]:
        """Per-example gradient norms per parameter, ``{name: [batch]}`` (``"norms"``).
        ``norms[name][i] == p.grad1[i].norm()``, computed without forming ``grad1``; a reused
        module's calls and a tied weight's users are summed before the norm is taken."""
        return {n: v.sqrt() for n, v in self._results("norms").param_sq_norms.items()}

    def norm_forms(self) -> dict[str, str]:
        """How the last backward formed each parameter's per-example norm (``"norms"``),
        ``{name: form}``, chosen per parameter by cost:

        - ``"outer"``: one position per example, ``‖g‖·‖a‖`` (Goodfellow);
        - ``"gram"``: several positions ``T``, from the two ``[T, T]`` Gram matrices of the
          layer's inputs and output-gradients, ``T²·(in + out)`` per example;
        - ``"materialized"``: ``grad1`` formed a slice of the batch at a time, ``T·in·out`` per
          example, where that is cheaper than the Gram form;
        - ``"direct"``: the rule gives ``grad1`` itself (a bias, a norm layer's scale);
        - ``"rows"``: an embedding's looked-up rows, never the whole table.
        """
        return dict(self._results("norms").norm_forms)

    def norms(self) -> Tensor:
        """Per-example norm of the whole model's gradient, ``[batch]`` (``"norms"``), of the
        last backward (each backward replaces them; they do not accumulate as ``grad1``)."""
        c = self._results("norms")
        if not c.param_sq_norms:
            raise RuntimeError(
                "no backward has been captured since the hooks were added or cleared"
            )
        if c.missed:
            names = ", ".join(f"'{n}'" for n in c.missed[:5])
            raise RuntimeError(
                f"the last backward computed the gradient of {names} but captured no "
                "per-example gradient for them (used outside the hooked model's modules: in "
                "the loss, or in a method of the model other than forward outside any "
                "submodule's call), so the whole-model norms would leave them out. Use them "
                "inside a module's forward, or freeze them; param_norms() has the others."
            )
        return total_norms(c.param_sq_norms)

    def sum_grad_sq(self) -> dict[str, Tensor]:
        """``Σ_i grad1[i]²`` per parameter, ``{name: [*p.shape]}`` (``"sum_grad_sq"``): the
        diagonal of the empirical Fisher, summed over examples (BackPACK's SumGradSquared for a
        sum-reduced loss)."""
        return dict(self._results("sum_grad_sq").sum_grad_sq)

    def grad_variance(self) -> dict[str, Tensor]:
        """Per-example gradient variance per parameter, ``{name: [*p.shape]}``
        (``"sum_grad_sq"``): ``mean_i grad1[i]² - (mean_i grad1[i])²`` (population variance,
        clamped at 0). The mean of a Linear on ``[batch, features]`` or of an Embedding, where
        its input and output-gradient (its lookups' gradients) take no more memory than the
        mean, is formed by the first call, from those kept until then; only
        :meth:`sum_grad_sq` asked for, it is never formed."""
        c = self._results("sum_grad_sq")
        batch = max(c.batch or 0, 1)
        means = {n: m() if callable(m) else m for n, m in c.grad_mean.items()}  # (formed now)
        return {n: (sq / batch - means[n] ** 2).clamp_min(0) for n, sq in c.sum_grad_sq.items()}

    def kfac_factors(self, reduction: LossReduction = "mean") -> dict:
        """K-FAC factors ``{weight_name: KFactors(A, G, bias)}`` accumulated since the last
        :meth:`clear` (``"kfac"``); conventions in :mod:`gradhooks.kfac`. Over several
        backwards of one forward (your own sampled labels, or the columns of a loss Hessian's
        square root), ``G`` sums them; ``"mean"`` then divides by the examples of every
        backward, which averages over the backwards (right for samples; for columns, multiply
        by their number, or use :func:`gradhooks.kfac`, which sums them)."""
        return self._results("kfac").kfac.factors(reduction)

    def _results(self, quantity: str) -> Collector:
        if self._collector is None or quantity not in self.quantities:
            raise RuntimeError(
                f"this handle does not compute {quantity!r} (quantities={self.quantities!r}): "
                f"add_hooks(model, quantities=({quantity!r}, ...))"
            )
        return self._collector

    def remove(self) -> None:
        """Remove every hook. Idempotent. ``grad1`` stays on the parameters (like ``.grad``);
        :func:`clear_grad1` deletes it."""
        if self._removed:
            return
        self._removed = True
        for h in (*self._handles, *self._target_handles):
            h.remove()
        self._handles.clear()
        self._target_handles.clear()
        model = self.model
        if model is not None and _ACTIVE.get(model) is self:
            del _ACTIVE[model]
        for t in self._targets:
            if _HOOKED_MODULES.get(t.module) is self:
                del _HOOKED_MODULES[t.module]
        self._written.clear()
        self._unheld.clear()
        if self._probe_box is not None:
            _drop_box(self._probe_box)
            self._probe_box = None
        for frame in self._frames[::-1]:
            self._stop_tracker(frame)
        self._frames.clear()
        self._tasks.clear()
        for stack in self._detached.values():  # removed during a forward
            for module, detached, owned, _, recording in stack[::-1]:
                _torch.own_parameters(module).update(detached)
                if recording is not None:
                    recording[0].__exit__(None, None, None)
                if owned is not None:
                    torch.set_grad_enabled(True)
        self._detached.clear()
        if self._collector is not None:
            self._collector.discard_backward()
            self._collector._expected = {}

    def __enter__(self) -> Hooks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self._removed else f"{len(self._targets)} modules"
        return f"Hooks({state}, loss_reduction={self.loss_reduction!r})"

    # -- internals ----------------------------------------------------------------------------

    def _check_not_hooked(self, model: nn.Module) -> None:
        if model in _ACTIVE:
            raise RuntimeError(
                f"{type(model).__qualname__} already has gradhooks hooks ({_ACTIVE[model]!r}); "
                "adding them again would count every gradient twice. Call "
                "gradhooks.remove_hooks(model) first, or keep using the existing handle."
            )
        for t in self._targets:
            if t.module in _HOOKED_MODULES:
                raise RuntimeError(
                    f"module '{t.name}' ({type(t.module).__qualname__}) is already hooked by "
                    f"another gradhooks handle ({_HOOKED_MODULES[t.module]!r}), e.g. on a model "
                    "that contains this one; remove those hooks first."
                )

    def _capturing_backward(self) -> bool:
        return self._pause.on and (self.capture == "always" or self._marked > 0)

    def _detach_hook(self, target: _Target, forward_hook: int):
        """The forward pre-hook of a module whose rule has ``grad_from_grad1``: where it says
        so, the call runs with the module's own parameters detached (autograd then computes no
        batch gradient for them), and :meth:`_forward_hook` (handle id ``forward_hook``)
        replaces the output by one attached to them again through :class:`_Attach`, whose
        backward gives ``.grad`` the sum of the call's ``grad1``. Not where another forward hook
        would see the output before it is attached: a loss built on that output would give
        the parameters no gradient. Where the rule's entry has ``input_grads``, the call runs
        with grad mode off: autograd records nothing of it (:meth:`_capture_owned`). Where it
        has ``taps`` (and ``grad1`` is computed), the rule runs only once the backward has
        reached nodes inside the call, after its output: the parameters are attached to the
        call's first floating-point input instead, through a :class:`_Carry` node that takes
        its place (every occurrence: ``query is key is value`` stays true), and whose backward
        runs after the call's (:meth:`_carried_backward`)."""

        carries = target.entry.taps is not None and not target.entry.input_grads

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if (
                module is not target.module
                or _torch.first_forward_hook(module) != forward_hook
                or _torch.global_forward_hooks()
                or self._removed
                or not (self._grad1 or {"norms", "sum_grad_sq"} & set(self.quantities))
                or not self._track
                or not self._capturing_backward()
                or not torch.is_grad_enabled()
                or _is_compiling()
                or _torch.in_transform(args, kwargs)
                or not target.entry.grad_from_grad1(module, args)
                or not self._plain_call(target, module, args, kwargs)
                or (carries and not self._grad1)
                or ((target.entry.input_grads or carries) and not _last_pre_hook(module, hook))
            ):
                return  # (a later pre-hook could change what the forward gets)
            own = _torch.own_parameters(module)
            detached = {
                n: p for n, p in target.params.items() if p.requires_grad and own.get(n) is p
            }
            carried = None
            if carries:
                carried = next(
                    (t for t in [*_leaves(args), *_leaves(kwargs)]
                     if isinstance(t, Tensor) and t.is_floating_point()),
                    None,
                )  # fmt: skip
            if not detached or (carries and carried is None):
                return
            owned = (args, kwargs) if target.entry.input_grads else None
            recording = None  # (context manager, what it gave), left in _reattach
            if owned is not None and target.entry.record is not None:
                manager = target.entry.record(module)
                recording = (manager, manager.__enter__())
            for n, p in detached.items():
                own[n] = p.detach()
            box = None
            if carries:
                box = _Carried(target, detached, carried, args, kwargs, _Sums(detached))
                attached = _Carry.apply(
                    lambda g: self._carried_backward(box, g), carried, *detached.values()
                )
                swap = lambda t: attached if t is carried else t  # noqa: E731
                args, kwargs = tuple(map(swap, args)), {k: swap(v) for k, v in kwargs.items()}
            self._detached.setdefault(id(module), []).append(
                (module, detached, owned, box, recording)
            )
            if owned is not None:
                torch.set_grad_enabled(False)  # back on in _reattach, at the forward's end
            if box is not None:
                return args, kwargs

        return hook

    def _reattach(self, module: nn.Module) -> tuple[dict[str, nn.Parameter], Any, Any, Any]:
        """Put back the parameters :meth:`_detach_hook` detached for the call now ending;
        returns them, the call's ``(args, kwargs)`` where it ran with grad mode off (else
        ``None``), its :class:`_Carried` where its first input carries them (else ``None``)
        and what its rule's ``record`` gave (else ``None``), the recording now left."""
        stack = self._detached.get(id(module))
        if not stack:
            return {}, None, None, None
        _, detached, owned, carried, recording = stack.pop()
        if not stack:
            del self._detached[id(module)]
        _torch.own_parameters(module).update(detached)
        if owned is not None:
            torch.set_grad_enabled(True)  # (it was on: _detach_hook)
        recorded = None
        if recording is not None:
            manager, recorded = recording
            manager.__exit__(*sys.exc_info())
        return detached, owned, carried, recorded

    def _enter_hook(self, target: _Target):
        """The forward pre-hook of every hooked module: the tracker (if this forward has one)
        learns which parameters the call covers, so that an operation using a parameter
        outside its module's call is seen as a direct use."""
        own = list(target.params.values())

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if module is not target.module:
                return
            now = own
            if self._sharded:
                now = self._unsharded(target)
            tracker = self._tracker()
            if tracker is not None:
                self._reseed_before(target, module, args, kwargs, tracker)
                tracker.enter_call(now, module, soft=target.entry is FALLBACK)

        return hook

    def _reseed_before(
        self, target: _Target, module: nn.Module, args: tuple, kwargs: dict, tracker: Tracker
    ) -> None:
        """:meth:`_reseed` as the first hooked call starts (a sequence-first layer given the
        model's input), so that the operations inside it are followed from the right batch."""
        if target.entry is FALLBACK:
            return
        dim = target.entry.batch_dim_of(module)
        if not isinstance(dim, int) or isinstance(dim, bool):
            return
        ins = tree_flatten((args, kwargs))[0]
        first = next((tracker.layout(t) for t in ins if tracker.layout(t) is not None), None)
        if first is not None and first.dim >= 0 and first.dim != dim:
            self._reseed(tracker, ins, [], dim)

    def _tracker(self) -> Tracker | None:
        return self._frames[-1].tracker if self._frames else None

    def _unsharded(self, target: _Target) -> list[nn.Parameter]:
        """A module sharded by FSDP2 holds, while it runs, unsharded parameters in place of
        the sharded ones the hooks were planned with: the parameters its call uses now, each
        known to the tracker under its sharded one's name (and kept for the DP step's
        backward, :func:`gradhooks.dp_sgd_step`)."""
        slots = dict(target.module.named_parameters(remove_duplicate=False))
        now = []
        for name, planned in target.params.items():
            current = slots.get(name, planned)
            now.append(current)
            if current is not planned:
                self._current[id(planned)] = current
                tracker = self._tracker()
                if tracker is not None and id(planned) in self._params:
                    tracker.params[id(current)] = (self._params[id(planned)][0], planned)
        return now

    def _forward_hook(self, target: _Target):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            tracker = self._tracker()
            if tracker is None or module is not target.module or not tracker.covered:
                return body(module, args, kwargs, output, None, True)
            used = tracker.exit_call()
            with tracker.paused():
                return body(module, args, kwargs, output, tracker, used)

        def body(module, args, kwargs, output, tracker, used) -> Any:
            args, kwargs = _positional(module, args, kwargs)
            detached, owned, carried, recorded = (
                self._reattach(module) if self._detached else ({}, None, None, None)
            )
            if output is None and sys.exc_info()[1] is not None:
                return  # the forward raised (an always_call hook, for _reattach)
            if owned is not None:
                new = self._capture_owned(target, detached, owned, args, kwargs, output, recorded)
                return _carry_layouts(tracker, output, new)
            if detached and carried is None:
                new = self._capture_detached(target, detached, args, kwargs, output)
                return _carry_layouts(tracker, output, new)
            # (a carried call goes on as any other: its rule gives the sums as well)
            sums = carried.sums if carried is not None else None
            if self._removed or not self._pause.on:
                return
            if not torch.is_grad_enabled():
                if self._frames and self._frames[-1].grad_enabled:
                    # no_grad inside a training forward: reentrant activation checkpointing,
                    # which reruns this call during the backward. The collector then waits for
                    # the end of the backward to reduce these parameters' pieces.
                    self._frames[-1].unprobed = True
                    self._recomputes = True
                    if self._collector is not None:
                        self._collector.defer.update(id(p) for p in target.params.values())
                return
            if module is not target.module:
                return  # a deep copy of a hooked module carries our hook: the copy is not hooked
            if _torch.in_transform(args, kwargs, output):
                return  # inside vmap/grad (an oracle, the fallback rule): not ours to capture
            if target.entry.on_forward is not None:
                target.entry.on_forward(module, target.name)  # raises where grad1 cannot exist
            live = {n: p for n, p in target.params.items() if p.requires_grad}
            if tracker is not None and target.entry is not FALLBACK:
                # a parameter its call never used, followed where it was used instead (the old
                # nn.utils.weight_norm makes `weight` from `weight_g` and `weight_v` in a
                # forward pre-hook, before the call): its grad1 comes from there
                live = {
                    n: p
                    for n, p in live.items()
                    if id(self._current.get(id(p), p)) in used.params
                    or id(p) not in tracker.param_sources
                }
            if not live:
                return
            leaves = _leaves(output)
            hooked = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.requires_grad]
            if not hooked:
                return
            if target.entry is FALLBACK and tracker is not None:
                if used.mixed:
                    ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
                    outs = [t for t in _leaves(output) if isinstance(t, Tensor)]
                    tracker.absorb(used, ins, outs)
                live = _used_by_fallback(target, live, used, tracker, output)
                if not live:
                    return  # the tracker follows every use (or there was none)
            replaced = None
            if len(hooked) > 1 or any(_torch.is_view(leaves[i]) for i in hooked):
                # an output that is a view (nn.Linear on [batch, seq, in]) loses its gradient
                # hooks to an in-place change (a ReLU(inplace=True) next): the same memory, as
                # an output of its own. Several outputs each get a node of their own: where one
                # is computed from another inside the call (LSTMCell's h' from c'), the gradient
                # reaching the other would include what flowed in through the first.
                old = output
                output = tree_map(_unview if len(hooked) == 1 else _own_node, output)
                replaced = _carry_layouts(tracker, old, output)
                leaves = _leaves(output)
            layout = self._call_layout(target, args, kwargs, output, tracker)
            call, state = self._kept_call(target, live, args, kwargs, output, layout)

            n_leaves = len(leaves)
            taps = None
            if (
                target.entry.taps is not None
                and self._track
                and _keeps_rows(layout)
                and not _torch.saved_tensor_hooks_active()  # (reading what it saved would rerun it)
            ):
                # (not for the Jacobians: their backward stops at the hooked calls' outputs)
                taps = target.entry.taps(module, args, kwargs, output)
            nodes = list(taps.nodes) if taps is not None else []
            # the closures below count the nodes and never hold them (see _without_nodes)
            n_nodes = len(nodes)
            if taps is not None:
                call = replace(call, taps=_without_nodes(taps))

            def on_grads(grads) -> None:
                if self._rerunning and not (self._probing and carried is not None):
                    return  # a backward of the engine's own
                full: list[Tensor | None] = [None] * n_leaves
                for i, g in zip(hooked, grads):
                    full[i] = g
                if carried is not None:  # (sums a backward that never reached it left: gone)
                    carried.outputs = tuple(full)
                    carried.sums.clear()
                    if self._rerunning:
                        return  # the probe's: the carried parameters' gradients by a rerun
                capturing = not (self._removed or self._ignore_backward or state.cancelled)
                if n_nodes and capturing and self._capturing_backward():
                    # The rule runs when the backward reaches the tapped nodes too, or, if it
                    # never does (a backward for some parameters only), at its end without them
                    pending["outputs"] = tuple(full)
                    bw = self._backward_state()
                    bw.reached.update(id(p) for p in live.values())  # before their own grads
                    bw.pending[id(pending)] = lambda: self._on_grads(
                        target, state, replace(call, grad_outputs=pending.pop("outputs"),
                                               taps=None), args, kwargs, sums,
                    )  # fmt: skip
                    return
                filled = replace(call, grad_outputs=tuple(full))
                self._on_grads(target, state, filled, args, kwargs, sums)

            if nodes:
                pending: dict[Any, Any] = {}

                def on_node(i: int, grad_outputs: tuple) -> None:
                    if "outputs" not in pending or self._rerunning:
                        return  # a backward not captured
                    pending[i] = tuple(grad_outputs)
                    if len(pending) < n_nodes + 1:
                        return
                    tapped = tuple(pending[j] for j in range(n_nodes))
                    outputs = pending.pop("outputs")
                    pending.clear()
                    bw = self._tasks.get(_graph_task())
                    if bw is not None:
                        bw.pending.pop(id(pending), None)
                    done = replace(call, grad_outputs=outputs, tap_grads=tapped)
                    self._on_grads(target, state, done, args, kwargs, sums)

                for i, node in enumerate(nodes):
                    node.register_prehook(lambda grad_outputs, i=i: on_node(i, grad_outputs))

            if self._collector is not None:
                self._collector.expect(live)
            if len(hooked) == 1:
                leaves[hooked[0]].register_hook(lambda g: on_grads((g,)))
            else:
                torch.autograd.graph.register_multi_grad_hook(
                    [leaves[i] for i in hooked], on_grads, mode="all"
                )
            return replaced

        return hook

    def _kept_call(
        self,
        target: _Target,
        live: dict,
        args: tuple,
        kwargs: dict,
        output: Any,
        layout: _CallLayout | None = None,
    ) -> tuple[Call, _CallState]:
        """What a captured forward call keeps until its backward, registered with the root
        forward it runs in."""
        call = Call(
            module=target.module,
            inputs=_detach(args),
            kwargs=_detach(kwargs),
            output=_detach(output) if target.entry.needs_output else None,
            grad_outputs=(),
            name=target.name,
            registry=self.registry,
            hooked=self._hooked,
            memo=target.memo,
        )
        frame = self._frames[-1] if self._frames else None
        kept = [t for t in _leaves((call.inputs, call.kwargs)) if isinstance(t, Tensor)]
        if target.entry is not FALLBACK:
            kept = kept[:1]  # (a rule computes from its first input; the fallback from all)
        versions = tuple((t, _torch.version(t)) for t in kept)
        state = _CallState(live, frame, layout=layout, versions=versions)
        if call.output is not None:
            state.out_versions = tuple(
                (i, _torch.version(t))
                for i, t in enumerate(_leaves(call.output))
                if isinstance(t, Tensor)
            )
        if frame is not None:
            frame.states.append(state)
            frame.signature.append((id(target), None if layout is None else layout.kind))
            if not frame.unprobed and (_torch.saved_tensor_hooks_active() or _autocast()):
                frame.unprobed = True  # (run again at the backward, or in lower precision)
        return call, state

    def _keep_unhooked_call(self, target: _Target, args: tuple, kwargs: dict, output: Any):
        """The start of capturing a call whose parameters autograd does not see (run detached,
        or with grad mode off): its forward check, its kept call and the collector's
        expectation of its live parameters. Returns ``(call, state)``."""
        if target.entry.on_forward is not None:
            target.entry.on_forward(target.module, target.name)
        live = {n: p for n, p in target.params.items() if p.requires_grad}
        layout = self._call_layout(target, args, kwargs, output, self._tracker())
        call, state = self._kept_call(target, live, args, kwargs, output, layout)
        if self._collector is not None:
            self._collector.expect(live)
        return call, state

    # -- where the examples are (the forward's Tracker) ----------------------------------------

    def _call_layout(
        self, target: _Target, args: tuple, kwargs: dict, output: Any, tracker: Tracker | None
    ) -> _CallLayout | None:
        """Where the examples are in a captured call, from the tracker's layouts of its inputs
        (``None`` without a tracker). A call on inputs that do not depend on the examples is
        ``"shared"``: its outputs become the tracker's sources. Raises where the rule would
        read the examples from a dimension that does not hold them."""
        if tracker is None:
            return None
        batch = tracker.batch
        ins, outs = tree_flatten((args, kwargs))[0], tree_flatten(output)[0]
        # (the fallback may split where the examples are presumed: its recomputation one
        # example at a time must reproduce the call's output; a rule is never handed them)
        of = tracker.presumed_of if target.entry is FALLBACK else tracker.layout
        lin = tuple(of(t) for t in ins)
        lout = tuple(of(t) for t in outs)
        first = next((lay for lay in lin if lay is not None), None)
        if target.entry is FALLBACK and first is not None and first.dim >= 0:
            # (an input whose examples were lost but whose rows line up with the first's:
            # split like it, which the recomputation checks)
            size = first.size(batch)
            lin = tuple(
                first if lay is UNKNOWN and t.dim() > first.dim and t.shape[first.dim] == size
                else lay
                for t, lay in zip(ins, lin)
            )  # fmt: skip
        where = f"'{target.name or '<model>'}' ({type(target.module).__qualname__})"
        if any(lay is MIXED for lay in lin):
            ops = ", ".join(tracker.mixed) or "an operation across the batch"
            raise RuntimeError(
                f"{where}: its input ({_shapes(args, kwargs)}) was computed across the "
                f"examples of the batch ({ops}: a reduction, shift or product along it, "
                "entries picked from it, rows that are not examples put among them, or a "
                "reshape that leaves no dimension holding each example whole), so its "
                "rows are not one example each. Where one "
                "example's loss depends on another's, per-example gradients do not exist. Keep "
                "the examples apart in the forward (compute what needs the whole batch outside "
                "the model, or use running statistics: a statistic of the batch, even detached, "
                "makes each example's result depend on the others'), or freeze this layer's "
                "parameters."
                + (
                    f" The batch was taken as dimension 0 of the model's first input ({batch} "
                    "examples): if it is another dimension (a sequence-first model, [seq, "
                    "batch, ...]), say which with add_hooks(model, batch_dim=k)."
                    if self.batch_dim == "auto"
                    else ""
                )
            )
        if first is PACKED:
            whole = tree_flatten((args, kwargs), is_leaf=lambda a: isinstance(a, PackedSequence))
            if not any(isinstance(a, PackedSequence) for a in whole[0]):
                raise RuntimeError(
                    f"{where}: its input ({_shapes(args, kwargs)}) is the data of a "
                    "PackedSequence, or part of it (the examples' time steps packed together, "
                    "longest sequences first), taken out of the PackedSequence, so its rows are "
                    "not one example each and its rule cannot tell which example each belongs "
                    "to. Give the layer the PackedSequence itself (a recurrent layer), or the "
                    "padded batch (pad_packed_sequence), or freeze its parameters."
                )
        moved = next((tracker.reordered[t] for t in ins if isinstance(t, Tensor)
                      and t in tracker.reordered), None)  # fmt: skip
        if moved is not None:
            raise RuntimeError(
                f"{where}: its input ({_shapes(args, kwargs)}) has the examples of the batch in "
                f"another order ({moved} with a permutation of the batch), so its rule would give "
                "each example the gradient of another. Put them back in order before the layer "
                "(x[perm.argsort()]), or freeze its parameters."
            )
        grads = [t for t in outs if isinstance(t, Tensor) and t.requires_grad]
        free = not any(lay is not None for t, lay in zip(outs, lout) if isinstance(t, Tensor))
        if first is not None and free and target.entry is not FALLBACK:
            raise RuntimeError(
                f"{where}: its input ({_shapes(args, kwargs)}) depends on the examples but "
                "gradhooks lost them inside its forward (an operation it does not see, such as "
                "a custom kernel), so it cannot tell which example each part of its gradient "
                "belongs to. Register a rule for it, or freeze its parameters."
            )
        if first is None or free:
            if not free:
                raise RuntimeError(
                    f"{where}: its inputs ({_shapes(args, kwargs)}) do not depend on the "
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
            layout = _CallLayout("shared", batch, None, lin, lout)
            layout.sources = tuple(sources)
            return layout
        if first is UNKNOWN:
            layout = _CallLayout("unknown", batch, first, lin, lout)
            layout.lost = tuple(tracker.unknown)
            return layout
        frame = self._frames[-1] if self._frames else None
        root = frame is not None and any(
            x is r for r in frame.roots for x, lay in zip(ins, lin) if lay is first
        )
        if first is PACKED or target.entry is FALLBACK:
            return _CallLayout("plain", batch, first, lin, lout, root=root)
        dim = target.entry.batch_dim_of(target.module)
        if dim == "positions":
            kind = "plain" if first.dim == 0 and first.plain else "moved"
            return _CallLayout(kind, batch, first, lin, lout, root=root)
        if first.dim != dim and self._reseed(tracker, ins, outs, dim):
            return self._call_layout(target, args, kwargs, output, tracker)
        if first.dim != dim:
            layout = _CallLayout("mismatch", batch, first, lin, lout)
            layout.lost = (
                f"{where}: the examples are on {first.describe(batch)} of its input "
                f"({_shapes(args, kwargs)}), but its rule reads them from dimension {dim}. Its "
                "per-example gradients would mix examples. Give the layer its input with the "
                f"batch on dimension {dim} (batch_first=..., x.transpose(...)), or say where the "
                "model's batch is with add_hooks(..., batch_dim=k).",
            )
            return layout
        return _CallLayout("plain" if first.plain else "fold", batch, first, lin, lout, root=root)

    def _reseed(self, tracker: Tracker, ins: list, outs: list, dim: int) -> bool:
        """``batch_dim="auto"`` takes dimension 0 of the model's first input as the batch;
        where the first hooked call takes that very input and reads its batch from dimension
        ``dim`` (a sequence-first layer), the batch is dimension ``dim`` instead (once, at the
        first call of the forward)."""
        frame = self._frames[-1] if self._frames else None
        if self.batch_dim != "auto" or frame is None or frame.signature or not frame.roots:
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
        return True

    def _plain_call(self, target: _Target, module: nn.Module, args: tuple, kwargs: dict) -> bool:
        """Whether a call about to run has its examples where its rule reads them (the paths
        that run a call detached assume so); true without a tracker."""
        tracker = self._tracker()
        if tracker is None:
            return True
        first = next((tracker.layout(t) for t in tree_flatten((args, kwargs))[0]
                      if tracker.layout(t) is not None), None)  # fmt: skip
        if first is None or first is UNKNOWN:
            return False
        if first is PACKED:
            return True
        dim = target.entry.batch_dim_of(module)
        want = 0 if dim == "positions" else dim
        if first.dim != want and self._reseed(tracker, tree_flatten((args, kwargs))[0], [], want):
            first = next(tracker.layout(t) for t in tree_flatten((args, kwargs))[0]
                         if tracker.layout(t) is not None)  # fmt: skip
        return first.plain and first.dim == want

    def _direct_source(self, source: Source, p: nn.Parameter) -> None:
        """The tracker saw ``p`` used outside its module's call (a parent's
        ``F.linear(h, self.wte.weight)``, a table read as ``self.emb.weight``): its per-example
        gradients from that use are the source's, given to ``p.grad1`` when its gradient is
        complete (:meth:`_param_hook`)."""
        self._direct.setdefault(id(p), weakref.WeakSet()).add(source)
        if self._collector is not None:
            self._collector.expect({source.name: p})

    def _functional_use(self, func, name: str, args: tuple, kwargs: dict, direct: list, tracker):
        """A parameter used directly in a torch function the registry has a rule for
        (``F.linear``: a tied output layer): the function's call is captured as a hooked
        module's would be. ``NotImplemented`` where that does not apply."""
        spec = self.registry.function(name)
        if spec is None:
            return NotImplemented
        entry, roles, (in_pos, in_key), applies = spec
        if not applies(args, kwargs):
            return NotImplemented
        x = args[in_pos] if len(args) > in_pos else kwargs.get(in_key)
        lay = tracker.layout(x)
        if lay is None or lay is UNKNOWN or lay is PACKED:
            return NotImplemented
        named = {}
        for role, (pos, key) in roles.items():
            t = args[pos] if len(args) > pos else kwargs.get(key)
            if isinstance(t, Tensor) and any(t is d for d in direct):
                named[role] = t
        if len(named) != len(direct):
            return NotImplemented
        out = func(*args, **kwargs)
        tracker._propagate(name, args, kwargs, out)
        if not isinstance(out, Tensor) or not out.requires_grad:
            return out
        key = (name, *(id(p) for p in named.values()))
        target = self._functional_targets.get(key)
        if target is None:
            names = [self._params[id(p)][0] for p in named.values()]
            owner = self._owner(names[0])
            label = ", ".join(f"'{n}'" for n in names)
            target = _Target(f"{label} used in {name}", owner, entry, named)
            self._functional_targets[key] = target
        call, state = self._kept_call(target, named, (x,), {}, out, self._call_layout(
            target, (x,), {}, out, tracker))  # fmt: skip
        if self._collector is not None:
            self._collector.expect(named)
        out.register_hook(lambda g: None if self._rerunning else self._on_grads(
            target, state, replace(call, grad_outputs=(g,)), (x,), {}))  # fmt: skip
        return out

    @contextlib.contextmanager
    def _nested(self) -> Iterator[None]:
        """A backward the engine runs inside one of the model's (per-example gradients through
        batch-free operations): the hooks it reaches are not the model's."""
        self._rerunning += 1
        try:
            yield
        finally:
            self._rerunning -= 1

    def _capture_detached(
        self,
        target: _Target,
        detached: dict[str, nn.Parameter],
        args: tuple,
        kwargs: dict,
        output: Any,
    ) -> Tensor:
        """Capture a call that ran with ``detached`` detached (:meth:`_detach_hook`); return
        its output attached to them again (the forward hook's replacement output)."""
        module = target.module
        if not isinstance(output, Tensor):
            raise RuntimeError(
                f"'{target.name}' ({type(module).__qualname__}) returned "
                f"{type(output).__qualname__}, but its rule's grad_from_grad1 is only for "
                "modules that return one tensor"
            )
        call, state = self._keep_unhooked_call(target, args, kwargs, output)
        leaves = [*_leaves(args), *_leaves(kwargs)]
        inputs = [t for t in leaves if isinstance(t, Tensor) and t.requires_grad]

        def backward(g: Tensor) -> tuple[Tensor | None, ...]:
            sums: dict[str, Tensor] = {}
            filled = replace(call, grad_outputs=(g,))
            if not self._probing:  # (the probe's: autograd's own, by a rerun; no rule runs)
                self._on_grads(target, state, filled, args, kwargs, sums)
                if self._no_param_grads:
                    return (None,) * (len(detached) + len(inputs))
                if len(sums) < len(detached) and not torch.is_grad_enabled():
                    # this backward writes nothing (paused, the second backward of a ghost DP
                    # step): the batch gradients of the rule's pieces
                    pieces = target.entry.rule(filled)
                    for n, p in detached.items():
                        if n not in sums and pieces.get(n) is not None:
                            sums[n] = pieces[n].batch_sum(p.shape).to(p.dtype)
            self._rerunning += 1  # its backwards are not the model's: not tracked
            try:
                grads, corrections = _rerun_vjp(module, detached, sums, args, kwargs, inputs, g)
            finally:
                self._rerunning -= 1
            return (*(grads[n] for n in detached), *corrections)

        return _Attach.apply(backward, output, *detached.values(), *inputs)

    def _capture_owned(
        self,
        target: _Target,
        detached: dict[str, nn.Parameter],
        owned: tuple[tuple, dict],
        args: tuple,
        kwargs: dict,
        output: Any,
        recorded: Any = None,
    ) -> Any:
        """Capture a call that ran with grad mode off (its rule's entry has ``input_grads``):
        autograd recorded nothing of it. Return its output with every tensor leaf attached to
        the parameters and to the inputs that require grad (``owned``: ``(args, kwargs)``)
        through one :class:`_AttachAll` node. Its backward runs the rule, whose pieces give
        the parameters' batch gradients and which gives the inputs' gradients
        (``call.input_grads``); where the rule gives none, or in a ``create_graph`` backward,
        autograd through the call's forward run again (:func:`_rerun_owned`). ``recorded``:
        what the rule's ``record`` gave at the forward (``call.recorded``)."""
        module = target.module
        call, state = self._keep_unhooked_call(target, args, kwargs, output)
        if recorded is not None:
            call = replace(call, recorded=recorded)
        in_leaves = tree_flatten(owned)[0]
        in_idx = [i for i, t in enumerate(in_leaves) if isinstance(t, Tensor) and t.requires_grad]
        out_leaves, spec = tree_flatten(output)
        out_idx = [i for i, t in enumerate(out_leaves) if isinstance(t, Tensor)]
        n_out = len(out_leaves)  # (the closure must not hold the attached outputs: see below)

        def backward(grads: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
            full: list[Tensor | None] = [None] * n_out
            for i, g in zip(out_idx, grads):
                full[i] = g
            if self._probing:  # (autograd's own gradients, by a rerun: no rule runs)
                wanted = [*detached.values(), *(in_leaves[i] for i in in_idx)]
                with self._nested():
                    return tuple(_rerun_owned(module, owned, full, wanted, False))
            create_graph = torch.is_grad_enabled()
            sums: dict[str, Tensor] = {}
            filled = replace(call, grad_outputs=tuple(full), input_grads=[])
            self._on_grads(target, state, filled, args, kwargs, sums)
            found = filled.input_grads
            incomplete = len(sums) < len(detached) and not self._no_param_grads
            if not create_graph and (incomplete or not found):
                # the rule did not run (paused, not capturing): run it for both
                again = replace(filled, input_grads=[])
                pieces = target.entry.rule(again)
                for n, p in detached.items():
                    if n not in sums and pieces.get(n) is not None:
                        sums[n] = pieces[n].batch_sum(p.shape).to(p.dtype)
                found = again.input_grads
            param_grads = {} if create_graph else dict(sums)
            input_grads = [None if create_graph or not found else found[i] for i in in_idx]
            # (a backward whose parameter gradients are not used, the book-keeping DP step's,
            # needs none: no rerun, whose nested backward would reach earlier calls' hooks)
            missing = [] if self._no_param_grads else [n for n in detached if n not in param_grads]
            if missing or (in_idx and not found) or create_graph:
                self._rerunning += 1  # its backwards are not the model's: not tracked
                try:
                    wanted = [detached[n] for n in missing] + [in_leaves[i] for i in in_idx]
                    got = _rerun_owned(module, owned, full, wanted, create_graph)
                finally:
                    self._rerunning -= 1
                param_grads.update(zip(missing, got))
                if create_graph or not found:
                    input_grads = got[len(missing) :]
            if self._no_param_grads:
                return (*(None for _ in detached), *input_grads)
            return (*(param_grads[n] for n in detached), *input_grads)

        outs = _AttachAll.apply(
            backward, len(out_idx), *(out_leaves[i] for i in out_idx), *detached.values(),
            *(in_leaves[i] for i in in_idx),
        )  # fmt: skip
        # A new list: the attached outputs hold the node, whose backward must not hold them (a
        # cycle through autograd's graph, which Python's garbage collector cannot see: every
        # call's graph and tensors would stay alive for good)
        attached = list(out_leaves)
        for i, t in zip(out_idx, outs):
            attached[i] = t
        return spec.unflatten(attached)

    def _carried_backward(self, carried: _Carried, g: Tensor | None) -> tuple:
        """The backward of a :class:`_Carry` node: the carried input's gradient ``g`` on, and
        the batch gradients of the call's detached parameters. They are the sums the rule gave
        (it ran when the backward reached the call's taps, before this node); where it gave
        none (a paused backward, one not captured) or in a ``create_graph`` backward,
        autograd through the call's forward run again (:func:`_rerun_carried`)."""
        detached = carried.detached
        outputs, carried.outputs = carried.outputs, None
        create_graph = torch.is_grad_enabled()
        if self._no_param_grads and not create_graph:
            return (g, *(None for _ in detached))
        grads: dict[str, Tensor | None] = {} if create_graph else dict(carried.sums)
        carried.sums.clear()
        missing = [n for n in detached if n not in grads]
        if (missing or create_graph) and outputs is not None:
            self._rerunning += 1  # its backwards are not the model's: not tracked
            try:
                found, correction = _rerun_carried(carried, missing, outputs, create_graph)
            finally:
                self._rerunning -= 1
            grads.update(found)
            if correction is not None:
                g = correction if g is None else g + correction
        return (g, *(grads.get(n) for n in detached))

    def _on_grads(
        self,
        target: _Target,
        state: _CallState,
        call: Call,
        args,
        kwargs,
        sums: dict[str, Tensor] | None = None,
    ) -> None:
        """The backward reached the outputs of one captured call. ``sums``: filled with the
        call's batch gradient of each parameter it writes ``grad1`` for."""
        if self._removed or self._ignore_backward or state.cancelled or self._probing:
            return
        # Inside a backward, grad mode is on exactly when it was asked for with create_graph.
        create_graph = torch.is_grad_enabled()
        if not self._capturing_backward():
            state.derived |= create_graph
            return
        bw = self._backward_state() if self._track else None
        if state.derived:
            # Wrong only if this backward computes parameter gradients (not for the next
            # derivative of a Laplacian, with respect to the input): decided at its end.
            where = f"'{target.name or '<model>'}' ({type(target.module).__qualname__})"
            if bw is None:
                raise RuntimeError(_higher_order(where))
            bw.derived = bw.derived or where
            return
        state.derived = create_graph
        if create_graph:  # grad1 gets a graph: through the inputs too, so not detached
            call = replace(call, inputs=args, kwargs=kwargs)
        if bw is not None:
            bw.reached.update(id(p) for p in state.params.values())
            if state.frame is not None:
                bw.frames.add(id(state.frame))
        try:
            _check_versions(target, state)
            if state.out_versions:
                call = _unchanged_outputs(call, state.out_versions)
            layout = state.layout
            if layout is not None and layout.kind == "shared":
                aligned = _aligned_call(target, layout, call)
                if aligned is not None:
                    layout = aligned
                else:
                    call = _per_example_outputs(target, layout, call, create_graph)
            self._backward(target, state.params, call, state.frame, bw, sums, layout)
        except BaseException:
            self._abort_backward()
            raise

    def _backward(
        self,
        target: _Target,
        params: dict[str, nn.Parameter],
        call: Call,
        frame: _Frame | None = None,
        bw: _Backward | None = None,
        sums: dict[str, Tensor] | None = None,
        layout: _CallLayout | None = None,
    ) -> None:
        rule = target.entry.rule
        try:
            pieces = _pieces(target, params, call, layout)
        except Exception as e:
            msg = str(e)
            names = (f"'{target.name}'", f"'{target.name or '<model>'}'")
            if msg.startswith("fallback for") or any(n in msg for n in names):
                raise  # already names the module
            raise RuntimeError(
                f"rule {rule.__qualname__} for '{target.name or '<model>'}' "
                f"({type(target.module).__qualname__}) failed on {_describe(call)}: {e}\n"
                "Rules take dimension 0 of the layer's input and output-gradient as the batch; "
                "an input without a batch dimension (x of shape [features] rather than "
                "[batch, features]) needs one: x.unsqueeze(0)."
            ) from e
        live: dict[str, nn.Parameter] = {}
        for pname, p in params.items():
            if pieces.get(pname) is not None:
                live[pname] = p
            elif pname not in pieces:
                raise RuntimeError(
                    f"rule {rule.__qualname__} for '{target.name}' ({type(target.module).__qualname__}) "
                    f"returned no piece for trainable parameter '{pname}' (got {sorted(pieces)}). "
                    "A parameter the rule does not know is used by something around the layer "
                    "(a forward pre-hook that makes its weight from it, as the old "
                    "torch.nn.utils.weight_norm does), which gradhooks follows only while it "
                    "tracks the batch (batch_dim not None): use "
                    "torch.nn.utils.parametrizations.weight_norm, or register a rule for "
                    "the layer."
                )
            # else: None, the rule says this call's gradient for it is computed elsewhere
        if not live:
            return
        first = next(iter(live))
        batch = pieces[first].batch_size
        if (
            layout is not None
            and batch != layout.batch
            and self.batch_dim == "auto"
            and (layout.root and frame is not None)
        ):
            # the model's first input was taken as the batch, and the layer that reads it
            # counts its examples otherwise (bags of a flat index list): its count is checked
            # as without the tracker
            self._check_batch(target, first, call, batch, frame)
        elif layout is not None:
            if batch != layout.batch:
                raise RuntimeError(
                    f"'{target.name or '<model>'}' ({type(target.module).__qualname__}): its "
                    f"rule gives '{first}' a per-example gradient for {batch} examples, but the "
                    f"model's forward has {layout.batch} ({_describe(call)}). gradhooks could "
                    f"not follow the batch to this layer (through: "
                    f"{', '.join(layout.lost) or 'its own operations'}); say where the model's "
                    "batch is with add_hooks(..., batch_dim=k), or register a rule."
                )
        elif frame is not None and self.batch_dim is not None:
            self._check_batch(target, first, call, batch, frame)
        if self._grad1 and bw is not None and not bw.memory_checked:
            bw.memory_checked = True  # before the first grad1 of this backward is formed
            self._refuse_large(batch)
        scale = float(batch) if self.loss_reduction == "mean" else 1.0
        formed: dict[int, Tensor] | None = None
        if sums is not None and not self._grad1 and not self._no_param_grads:
            formed = {}
        for pname, p in live.items():
            if not pieces[pname].sums_to_grad:
                self._exempt.add(id(p))
        if not self._grad1 and bw is not None and bw.verify:
            # (fresh pieces: none of the columns the norms may cache)
            bw.kept.append(({n: pieces[n].select(slice(None)) for n in live}, live, scale))
        if self._collector is not None:
            self._collector.add(target.name, {n: pieces[n] for n in live}, live, scale, formed)
        wanted = getattr(sums, "names", None)  # (a _Sums: for these parameters only)
        if not self._grad1:
            if formed is not None:  # a call run detached without grad1 (norms): batch gradients
                for pname, p in live.items():  # as a by-product of the norms, else from the piece
                    if wanted is not None and pname not in wanted:
                        continue
                    total = formed.pop(id(p), None)
                    if total is not None:
                        total = total / scale if scale else total
                    else:
                        total = pieces[pname].batch_sum(p.shape)
                    sums[pname] = total.to(p.dtype)
            return
        for pname, p in live.items():
            piece = pieces[pname]
            qualname = f"{target.name}.{pname}" if target.name else pname
            if bw is not None and id(p) not in bw.before:
                # kept for a rollback; a kept grad1 is then never written in place
                bw.before[id(p)] = p.grad1 if id(p) in self._written else None
            accumulate = id(p) in self._written
            out = self._writable_grad1(qualname, p, piece.batch_size, accumulate)
            summed = sums is not None and (wanted is None or pname in wanted)
            if accumulate and summed:
                out = None  # this call's own grad1 is summed below: not added in place
            try:
                if out is not None:
                    piece.grad1_into(out, scale, accumulate)
                else:
                    g1 = piece.grad1(p.shape, scale)
            except RuntimeError as e:
                raise RuntimeError(
                    f"rule {rule.__qualname__} for '{target.name}' ({type(target.module).__qualname__}): "
                    f"its piece for '{pname}' does not give a [batch, *{tuple(p.shape)}] gradient: {e}"
                ) from e
            if summed:
                own = out if out is not None else g1
                total = own.sum(0, dtype=p.dtype)
                sums[pname] = total / scale if scale else total
            if out is None:
                self._accumulate(qualname, p, g1)
            self._written[id(p)] = p

    def _writable_grad1(
        self, qualname: str, p: nn.Parameter, batch: int, accumulate: bool
    ) -> Tensor | None:
        """``p.grad1``, if this call's gradient can be written into its memory: it has the
        right shape, dtype and device, and nothing but ``p`` refers to it or to its memory (the
        test autograd makes before reusing ``.grad``). Writing in place skips a fresh
        allocation, whose page faults cost more than the writing itself on CPU; a ``grad1``
        the caller kept (a reference, a view, a numpy array) is never changed."""
        if torch.is_grad_enabled():
            return None  # a create_graph backward: grad1 gets a graph, never written in place
        old = _sole_grad1(p)
        if old is None:
            return None
        if accumulate and old.shape[0] != batch:
            return None  # _accumulate explains
        if tuple(old.shape) != (batch, *p.shape) or old.dtype != p.dtype or old.device != p.device:
            return None
        return old

    def _check_batch(self, target, pname, call, batch: int, frame: _Frame) -> None:
        """Every hooked layer of one forward of the model must see its batch on dimension 0."""
        if len(frame.seen) == 1 and batch in frame.seen:
            return  # the usual case, checked once per forward: as the layers before it
        name = f"'{target.name or '<model>'}' ({type(target.module).__qualname__})"
        other = next((n for b, n in frame.seen.items() if b != batch), None)
        if frame.batch is not None and batch != frame.batch:
            why = (
                f"but the model's forward got a batch of {frame.batch} (dimension "
                f"{self.batch_dim} of its first tensor input)"
            )
        elif other is not None:
            seen = next(b for b, n in frame.seen.items() if n == other)
            why = f"but {other} in the same forward of the model saw a batch of {seen}"
        elif frame.batch is None and frame.sizes and batch not in frame.sizes:
            why = (
                f"but dimensions 0 and 1 of the model's tensor inputs and outputs have sizes "
                f"{sorted(frame.sizes)}, none {batch}"
            )
        else:
            frame.seen.setdefault(batch, name)
            return
        what = (
            f"{name} gives '{pname}' a per-example gradient for {batch} examples (dimension 0 of "
            f"what its rule sees: {_describe(call)})"
        )
        raise RuntimeError(
            f"{what}, {why}. A layer that does not see the examples on dimension 0 (the model "
            "folds time or patches into the batch, x.view(B * T, ...), or runs a layer "
            "sequence-first, [seq, batch, ...]) would get grad1 rows that are not examples. Keep "
            "the batch on dimension 0 of every hooked layer's input (nn.Linear takes "
            "[batch, *, features]: no need to fold; batch_first=True, or x.transpose(0, 1)). "
            "add_hooks(..., batch_dim=k) says the model's batch is dimension k of its first "
            "input; batch_dim=None turns this check off (grad1 then has one row per entry of "
            "each layer's dimension 0)."
        )

    def _refuse_large(self, batch: int) -> None:
        if not self._params:
            return
        p = next(iter(self._params.values()))[1]
        model = self.model
        refuse_if_too_large(
            f"'{type(model).__qualname__}'" if model is not None else "the model",
            batch, self._numel, p.element_size(), p.device, self.max_grad1_bytes,
        )  # fmt: skip

    # -- the root forward and the backward's bookkeeping --------------------------------------

    def _on_root_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if module is not self.model:
            return  # a copy
        self._open_frame(module, args, kwargs)

    def _entry_hooks(self, module: nn.Module) -> tuple[Any, Any]:
        """The forward pre- and post-hook of a module of the model other than the root that
        holds a hooked module (or is one): where it is called outside the model's own forward
        (``model.encoder(x)``, a method such as ``get_image_features`` that calls submodules
        rather than ``forward``), its call is a forward of the model's, with the batch followed
        from its inputs, as the root's would be."""
        ref = weakref.ref(module)

        def pre(m: nn.Module, args: tuple, kwargs: dict) -> None:
            # (not during a backward: activation checkpointing running a block again)
            if not self._frames and m is ref() and _graph_task() == -1:
                self._open_frame(m, args, kwargs)

        def post(m: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if m is ref():
                self._on_root_post(m, args, kwargs, output)

        return pre, post

    def _open_frame(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A forward of the model starts: ``module``'s call (the root's, or an entry's:
        :meth:`_entry_hooks`)."""
        frame = _Frame(None, [], torch.is_grad_enabled(), owner=module)
        self._frames.append(frame)  # first: the post-hook pops it even if this raises
        if self._removed or not self._pause.on:
            return
        if not torch.is_grad_enabled() or _torch.in_transform(args, kwargs):
            return
        if _graph_task() == -1:
            self._drop_stale()
        self._follow_changes(self.model)
        leaves = [t for t in [*_leaves(args), *_leaves(kwargs)] if isinstance(t, Tensor)]
        if not leaves or self.batch_dim is None:
            return
        if self.batch_dim == "auto":
            frame.sizes.update(n for t in leaves for n in t.shape[:2])
            if all(t.dim() == 0 for t in leaves):
                raise ValueError(
                    f"{type(module).__qualname__}'s tensor inputs have no dimensions "
                    f"({', '.join(str(tuple(t.shape)) for t in leaves)}): no batch of examples. "
                    "Add a batch dimension (x.unsqueeze(0) for one example)."
                )
            self._start_tracker(frame, args, kwargs)
            return
        first = leaves[0]
        if first.dim() <= self.batch_dim:
            raise ValueError(
                f"{type(module).__qualname__}'s first tensor input has shape "
                f"{tuple(first.shape)}: no batch dimension {self.batch_dim}. gradhooks needs a "
                "batch of examples; for one example add the batch dimension (x.unsqueeze(0))."
            )
        frame.batch = first.shape[self.batch_dim]
        if self._grad1:
            self._refuse_large(frame.batch)  # before the forward allocates anything
        self._start_tracker(frame, args, kwargs)

    def _start_tracker(self, frame: _Frame, args: tuple, kwargs: dict) -> None:
        """Follow the batch through this forward (:mod:`gradhooks.layout`)."""
        if not self._track or _is_compiling():
            return
        found = _root_batch(args, kwargs, self.batch_dim)
        if found is None:
            return
        batch, layouts = found
        if batch == 0:
            return  # (no example: nothing to follow)
        tracker = Tracker(batch, self._params, self)
        for i, (t, lay) in enumerate(layouts):
            tracker.set_layout(t, lay)
            if i and lay is not PACKED:
                tracker.candidates[t] = True
        frame.roots = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        frame.tracker = tracker
        tracker.__enter__()

    def _stop_tracker(self, frame: _Frame) -> None:
        tracker, frame.tracker = frame.tracker, None
        if tracker is not None:
            tracker.__exit__(None, None, None)
            tracker.finish()

    def _on_root_post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self._frames or self._frames[-1].owner is not module:
            return  # (a copy; an entry called inside the model's forward)
        frame = self._frames.pop()
        tracker = frame.tracker
        self._stop_tracker(frame)
        if tracker is not None and sys.exc_info()[1] is None:
            self._check_output(module, tracker, output)
        if frame.signature:
            sig = tuple(frame.signature)
            # (verified by the next backward that captures: the first of each new set of calls,
            # and again at the 2nd, 4th, 8th... backward of the handle, where what changed since
            # without changing the calls, a hook or a loss term added later, shows)
            if sig not in self._verified or (self.verify and _power_of_two(self._backwards + 1)):
                self._verified.add(sig)
                self._unverified.add(sig)
                if tracker is not None and sys.exc_info()[1] is None:
                    self._arm_probe(frame, tracker, output)
        if self.batch_dim == "auto" and frame.sizes:
            frame.sizes.update(
                n for t in _leaves(output) if isinstance(t, Tensor) for n in t.shape[:2]
            )
        if output is None and sys.exc_info()[1] is not None:
            # the forward raised: what it captured will never be backpropagated
            for state in frame.states:
                state.cancelled = True
                if self._collector is not None:
                    self._collector.unexpect(state.params)

    def _arm_probe(self, frame: _Frame, tracker: Tracker, output: Any) -> None:
        """Get ready to check, at the next backward that verifies, one example's ``grad1``
        against autograd's gradient of that example's rows of the model's outputs alone
        (:meth:`_probe`): what mixes the examples where neither the tracker nor the sum over
        the batch can see it (a custom ``autograd.Function`` or kernel that computes across the
        batch) shows there."""
        if self._probe_box is not None:  # (an earlier forward never backpropagated)
            _drop_box(self._probe_box)
            self._probe_box = None
        if (
            not (self.verify and self._checks_examples)
            or self._sharded
            or frame.unprobed
            or tracker.batch < 2
            or _is_compiling()
        ):
            return
        outs, layouts = [], []
        for t in _leaves(output):
            if not (isinstance(t, Tensor) and t.requires_grad and t.grad_fn is not None):
                continue
            lay = tracker.layout(t)
            if lay is UNKNOWN:
                # the tracker lost the examples on the way: where it presumes them, or on the
                # model's batch dimension (a guess: wrong, the check can only refuse)
                dim = self.batch_dim if isinstance(self.batch_dim, int) else 0
                lay = tracker.presumed.get(t)
                if lay is None and t.dim() > dim and t.shape[dim] == tracker.batch:
                    lay = Layout(dim)
            outs.append(t)
            layouts.append(lay if lay is not None and lay.dim >= 0 else None)
        if not any(layouts):
            return
        box = {
            "edges": [torch.autograd.graph.get_gradient_edge(t) for t in outs],
            "layouts": layouts,
            "batch": tracker.batch,
            "frame": id(frame),
            "lost": tuple(tracker.unknown),
        }
        self._probe_box = box
        if len(outs) == 1:
            outs[0].register_hook(lambda g: self._probe(box, (g,)))
        else:  # (its closure holds the outputs' nodes: removed once it ran, see _drop_box)
            box["handle"] = torch.autograd.graph.register_multi_grad_hook(
                outs, lambda grads: self._probe(box, grads), mode="all"
            )

    def _probe(self, box: dict, grads: tuple) -> None:
        """At the start of a backward that verifies (the first of each new set of calls), with
        the model's output-gradients in hand: every parameter's gradient from them with each
        example's rows weighted (:func:`pieces.example_weights`), by a backward of autograd's own through the
        same graph (the hooks stand aside). :meth:`_verify` compares it with ``grad1`` (or, for
        norms, the pieces' batch sum) weighted alike. Only where every output that has a gradient holds the examples
        where the tracker followed them, and none is computed from another (whose gradient
        would then be counted twice); an output that lost them (a loss computed inside the
        model) leaves the check out."""
        if (
            "edges" not in box
            or self._removed
            or self._ignore_backward
            or self._rerunning
            or torch.is_grad_enabled()  # (a create_graph backward)
            or not self._capturing_backward()
        ):
            return
        bw = self._backward_state()
        if not bw.verify or bw.probe is not None:
            return
        used = [(e, g, lay) for e, g, lay in zip(box["edges"], grads, box["layouts"])
                if g is not None]  # fmt: skip
        if (
            not used
            or any(lay is None for _, _, lay in used)
            or _dependent([e for e, _, _ in used])
        ):
            return
        batch, box_frame, lost = box["batch"], box["frame"], box["lost"]
        weights = P.example_weights(batch)
        masked, last = [], []
        for _, g, lay in used:
            if lay.size(batch) != g.shape[lay.dim]:
                return
            mask = example_mask(g.shape, lay, batch, g.device)  # [batch, *shape]
            w = weights.to(device=g.device, dtype=g.dtype)
            masked.append(g * torch.einsum("b,b...->...", w, mask.to(g.dtype)))
            last.append(g * mask[-1].to(g.dtype))
        pids = list(self._params)
        params = [self._params[pid][1] for pid in pids]
        edges = [e for e, _, _ in used]
        try:
            with self._standing_aside():
                found = torch.autograd.grad(
                    edges, params, masked, retain_graph=True, allow_unused=True
                )
                plain = torch.autograd.grad(
                    edges, params, [g for _, g, _ in used], retain_graph=True, allow_unused=True
                )
                # (without grad1, the norms themselves are checked too: the last example's)
                alone = None if self._grad1 else torch.autograd.grad(
                    edges, params, last, retain_graph=True, allow_unused=True
                )  # fmt: skip
        except Exception:  # (reentrant checkpointing refuses it; the backward raises the rest)
            found = plain = alone = None
        # (the graph's edges and hooks: no cycle through the hook that holds them)
        _torch.queue_backward_callback(lambda: _drop_box(box))
        if self._probe_box is box:
            self._probe_box = None
        if found is not None:
            grads_of = {pid: g for pid, g in zip(pids, found) if g is not None}
            plain_of = {pid: g for pid, g in zip(pids, plain) if g is not None}
            alone_of = {pid: g for pid, g in zip(pids, alone or ()) if g is not None}
            bw.probe = _Probe(box_frame, weights, grads_of, plain_of, alone_of, lost)

    @contextlib.contextmanager
    def _standing_aside(self) -> Iterator[None]:
        """A backward of autograd's own through the model's graph, to check against (one
        example's gradient): the hooks capture nothing, and calls run detached or owned give
        autograd's gradients by running their forward again (no rule runs)."""
        no_param_grads, self._no_param_grads = self._no_param_grads, False
        self._probing = True
        self._rerunning += 1
        try:
            yield
        finally:
            self._rerunning -= 1
            self._probing = False
            self._no_param_grads = no_param_grads

    def _check_output(self, module: nn.Module, tracker: Tracker, output: Any) -> None:
        """Refuses a forward whose outputs lost the examples by mixing them (a mean over what
        was taken as the batch: a sequence-first model read batch-first), where no output keeps
        them apart."""
        outs = [t for t in _leaves(output) if isinstance(t, Tensor) and t.requires_grad]
        lays = [tracker.layout(t) for t in outs]
        mixed = [t for t, lay in zip(outs, lays) if lay is MIXED and t.dim() > 0]
        if not mixed or any(lay is not None and lay is not MIXED for lay in lays):
            return  # (an output that keeps the examples, or whose layout was lost)
        ops = ", ".join(tracker.mixed) or "an operation across the batch"
        where = (
            "dimension 0 of its first input"
            if self.batch_dim == "auto"
            else (f"dimension {self.batch_dim}")
        )
        shapes = ", ".join(str(tuple(t.shape)) for t in mixed)
        raise RuntimeError(
            f"{type(module).__qualname__}: its output ({shapes}) mixes the {tracker.batch} examples that gradhooks took from {where} "
            f"({ops}), so per-example gradients do not exist. If the model's batch is another "
            "dimension (a sequence-first model), say which with add_hooks(model, batch_dim=k)."
        )

    def _backward_state(self) -> _Backward:
        task = _graph_task()
        bw = self._tasks.get(task)
        if bw is None:
            nested = bool(self._tasks)  # (a backward inside another: reentrant checkpointing)
            bw = self._tasks[task] = _Backward(set(), set(), {}, [])
            if nested:  # their gradients are split between the two: not verified
                for other in self._tasks.values():
                    other.verify = frozenset()
            elif self.verify and self._checks_examples and self._unverified:
                bw.verify = frozenset(self._unverified)
            _torch.queue_backward_callback(lambda: self._end_backward(task))
        return bw

    def _param_hook(self, pid: int, name: str):
        def hook(grad: Tensor) -> None:
            if self._removed or self._ignore_backward or self._rerunning:
                return
            if pid in self._direct and self._capturing_backward():
                self._direct_uses(pid, name)
            bw = self._backward_state()
            bw.computed.add(pid)
            if bw.verify and self._capturing_backward():
                # (a copy: autograd may take this very tensor as .grad, which DDP then
                # all-reduces in place)
                bw.grads[pid] = grad.detach().clone()
            if pid not in bw.reached and self._capturing_backward():
                if pid in bw.direct:
                    self._lost(pid, name, *bw.direct[pid])
                bw.missed.append(name)

        return hook

    def _direct_reached(self, held: tuple, unknown: dict) -> None:
        """The backward passes through an operation of a followed forward that used these
        parameters directly (``held``: ``(id, source)`` pairs, see :meth:`Tracker._hold`)."""
        if self._rerunning or self._removed or self._ignore_backward or not self._track:
            return
        if not (self._capturing_backward()):
            return
        bw = self._backward_state()
        for pid, source in held:
            sources, _ = bw.direct.setdefault(pid, (set(), unknown))
            sources.add(source)

    def _lost(self, pid: int, name: str, sources: set, unknown: dict) -> None:
        """A parameter used directly in a followed forward whose gradient this backward computed
        with no per-example gradient at all: never left without one in silence."""
        uses = {kind for s in sources for kind, _ in s.uses}
        if "loss" in uses and not self.verify:
            return  # (a term of the loss alone: verify=False keeps the per-example terms)
        ops = ", ".join(unknown)
        self._abort_backward()
        raise RuntimeError(
            f"'{name}' is used outside its module's call, and this backward computed its "
            "gradient, but no per-example gradient reached it: "
            + (
                f"gradhooks lost the examples on the way (through {ops}, whose effect on the "
                "batch it does not know)"
                if ops
                else "its gradient never met the batch where gradhooks could follow it (a "
                "term of the loss computed from the parameter alone?)"
            )
            + ". Its grad1 was not written. Use the parameter through a module with a rule "
            "(or register one with @gradhooks.register), or freeze it."
        )

    def _direct_uses(self, pid: int, name: str) -> None:
        """A parameter's gradient is complete: its per-example gradients from its uses outside
        its module's call (the tracker's sources) go into ``grad1`` as one more piece."""
        task = _graph_task()
        found = [
            s for s in list(self._direct[pid]) if not s.discarded and (task in s.grads or s.problem)
        ]
        if not found:
            return
        p = self._params[pid][1]
        target = self._direct_targets.get(pid)
        if target is None:
            prefix, leaf = _owner_name(name)
            entry = _Entry(
                rule=lambda call, leaf=leaf: {leaf: P.Direct(call.grad_outputs[0])},
                owns_children=False, needs_output=False,
            )  # fmt: skip
            target = _Target(prefix, self._owner(name), entry, {leaf: p})
            self._direct_targets[pid] = target
        problem = next((s.problem for s in found if s.problem), None)
        if problem is not None:
            self._abort_backward()
            raise RuntimeError(
                f"'{name}' is used outside its module's call, in operations that do not depend "
                f"on the examples until they meet the batch, and {problem}: gradhooks cannot "
                "tell each example's share of its gradient. Use it through its module, or "
                "freeze it."
            )
        per = None
        for s in found:
            g = s.grads.pop(task)
            per = g if per is None else per + g
        call = Call(
            target.module, (), {}, None, (per.to(p.dtype),), name=target.name,
            registry=self.registry,
        )  # fmt: skip
        state = _CallState(dict(target.params), None)
        self._on_grads(target, state, call, (), {})

    def _owner(self, name: str) -> nn.Module:
        prefix, _ = _owner_name(name)
        model = self.model
        return model.get_submodule(prefix) if model is not None else None

    def _end_backward(self, task: int) -> None:
        waiting = self._tasks.get(task)
        while waiting is not None and waiting.pending:  # taps the backward never reached
            waiting.pending.pop(next(iter(waiting.pending)))()
        bw = self._tasks.pop(task, None)
        if bw is None or self._removed:
            return
        self._unheld.clear()
        if bw.reached:
            self._backwards += 1
        if bw.derived is not None and bw.computed:
            self._rollback(bw)
            if self._collector is not None:
                self._collector.discard_backward()
            raise RuntimeError(_higher_order(bw.derived))
        # A backward that computes the gradient of none of the model's parameters
        # (torch.autograd.grad with respect to the inputs: an input-gradient, a Laplacian)
        # leaves grad1 and the other quantities as they were.
        if bw.reached and not bw.computed and not self._no_param_grads and not self._sharded:
            self._rollback(bw)
            if self._collector is not None:
                self._collector.discard_backward()
        if bw.verify and bw.grads and bw.reached and self._grad1:
            self._verify(bw)
        elif bw.verify and not self._grad1:
            if bw.reached and bw.probe is not None and bw.frames == {bw.probe.frame}:
                # (after the collector's own callback, which forms the norms)
                _torch.queue_backward_callback(lambda: self._verify_norms(bw, bw.probe))
            self._unverified -= bw.verify
        if self._collector is not None:
            self._collector.missed = list(bw.missed)
        if bw.missed:
            missed = set(bw.missed)
            for name, p in self._params.values():
                if name in missed and id(p) not in self._written and hasattr(p, "grad1"):
                    del p.grad1  # (an earlier step's, never to be read for this one's)
            for name in bw.missed:
                self._missed[name] = None
            names = ", ".join(f"'{n}'" for n in bw.missed[:5])
            more = f" and {len(bw.missed) - 5} more" if len(bw.missed) > 5 else ""
            warnings.warn(
                f"gradhooks: a backward computed the gradient of {names}{more} but no forward "
                "call of their modules was captured for it: the forward ran before add_hooks, "
                "or while capture was paused, or outside the hooked model's modules (a "
                "parameter used in the loss, or in a method of the model other than forward "
                "outside any submodule's call). They have no grad1 from this backward. Run the "
                "forward after add_hooks, through the model's modules.",
                GradhooksWarning,
                stacklevel=2,
            )

    def _verify(self, bw: _Backward) -> None:
        """The last line of defence, on the first backward of each new set of calls: every
        parameter's ``grad1`` of this backward reduces to the gradient autograd computed for it
        (a use of a parameter that the hooks did not see would show here), and one example's
        ``grad1`` is autograd's gradient from that example's rows of the model's
        output-gradients alone (:meth:`_probe`: what mixes the examples unseen would show
        there). A mismatch undoes the backward's ``grad1`` and raises, naming the
        parameters."""
        wrong = []
        grads = {pid: g.to_dense() if g.is_sparse else g for pid, g in bw.grads.items()}
        # (a parameter whose gradient is zero by symmetry, a key's bias, is compared against
        # the model's scale, not its own rounding)
        overall = max((float(g.abs().max()) for g in grads.values() if g.numel()), default=0.0)
        for pid, grad in grads.items():
            name, p = self._params[pid]
            if pid in self._exempt:
                continue
            g1 = self._grad1_of_backward(bw, pid, p)
            if g1 is None:
                got = torch.zeros_like(grad)
            else:
                got = g1.mean(0) if self.loss_reduction == "mean" else g1.sum(0)
            diff = _mismatch(got, grad.to(got.dtype), g1, overall)
            if diff is not None:
                wrong.append(f"'{name}' ({diff})")
        if wrong:
            self._rollback(bw)
            if self._collector is not None:
                self._collector.discard_backward()
            raise RuntimeError(
                f"gradhooks: grad1 does not add up ({self.loss_reduction} over the batch) to the "
                f"gradient autograd computed in the same backward, for {_listed(wrong)}. Its "
                "grad1 was not written. Either a use of the parameter that the hooks did not "
                "see (a custom operation or kernel: register a rule for the module), or a term "
                "of the loss that does not come from the examples (weight decay or a penalty "
                "added to the loss: add its gradient to .grad yourself, or pass add_hooks(..., "
                "verify=False) to keep grad1 of the per-example terms alone). This is checked "
                "on the first backward of each new set of layer calls."
            )
        probe = bw.probe
        if probe is not None and bw.frames == {probe.frame}:
            self._verify_probe(bw, probe)
        self._unverified -= bw.verify

    def _through_outputs(self, bw: _Backward, probe: _Probe) -> set[int]:
        """The parameters whose gradient in this backward came through the model's outputs
        alone: the probe's gradient from the output-gradients as they are is autograd's."""
        grads = {pid: g.to_dense() if g.is_sparse else g for pid, g in bw.grads.items()}
        overall = max((float(g.abs().max()) for g in grads.values() if g.numel()), default=0.0)
        found = set()
        for pid, grad in grads.items():
            plain = probe.plain.get(pid)
            plain = torch.zeros_like(grad) if plain is None else plain
            plain = plain.to_dense() if plain.is_sparse else plain
            if _mismatch(plain.to(grad.dtype), grad, None, overall, **_PROBE_TOLERANCE) is None:
                found.add(pid)
        return found

    def _verify_probe(self, bw: _Backward, probe: _Probe) -> None:
        """:meth:`_verify`'s second part: ``grad1`` of this backward, weighted over the examples
        as the probe's output rows were, against autograd's gradient from those rows."""
        scale = float(probe.batch) if self.loss_reduction == "mean" else 1.0
        through = self._through_outputs(bw, probe)
        want_of = {pid: (g.to_dense() if g.is_sparse else g) * scale
                   for pid, g in probe.grads.items() if pid in through}  # fmt: skip
        overall = max((float(g.abs().max()) for g in want_of.values() if g.numel()), default=0.0)
        wrong = []
        for pid, want in want_of.items():
            name, p = self._params[pid]
            if pid in self._exempt:
                continue
            g1 = self._grad1_of_backward(bw, pid, p)
            if g1 is not None and g1.shape[0] != probe.batch:
                continue  # (a layer that counts its examples otherwise: bags)
            if g1 is None:
                got = torch.zeros_like(want)
            else:
                w = probe.weights.to(device=g1.device, dtype=g1.dtype)
                got = torch.einsum("b,b...->...", w, g1)
            diff = _mismatch(got, want.to(got.dtype), None, overall, **_PROBE_TOLERANCE)
            if diff is not None:
                wrong.append(f"'{name}' ({diff})")
        if not wrong:
            return
        self._rollback(bw)
        if self._collector is not None:
            self._collector.discard_backward()
        raise RuntimeError(
            "gradhooks: grad1 is not the examples' own gradients: weighted over the examples, "
            "it is not the gradient autograd gives from the model's output-gradients with each "
            f"example's rows weighted alike, for {_listed(wrong)}. Its grad1 was not written. "
            + _EXAMPLES_NOT_APART.format(lost=_lost(probe))
        )

    def _verify_norms(self, bw: _Backward, probe: _Probe) -> None:
        """:meth:`_verify_probe` for a handle without ``grad1``: the per-example gradients the
        norms of this backward were formed from, weighted over the examples as the probe's
        output rows were (:func:`pieces.weighted_sums` of the kept pieces), against autograd's gradient from those rows."""
        collector = self._collector
        if collector is None or not collector.param_sq_norms:
            return
        scale = float(probe.batch) if self.loss_reduction == "mean" else 1.0
        through = self._through_outputs(bw, probe)
        want_of = {pid: (g.to_dense() if g.is_sparse else g) * scale
                   for pid, g in probe.grads.items()
                   if pid not in self._exempt and pid in through}  # fmt: skip
        overall = max((float(g.abs().max()) for g in want_of.values() if g.numel()), default=0.0)
        weighted = P.weighted_sums(bw.kept, probe.weights)
        bw.kept = []
        alone = {pid: float((g.to_dense() if g.is_sparse else g).norm()) * scale
                 for pid, g in probe.last.items() if pid in want_of}  # fmt: skip
        largest = max(alone.values(), default=0.0)
        wrong = []
        for pid, want in want_of.items():
            name = collector.names.get(pid)
            if name not in collector.param_sq_norms:
                continue  # (reached otherwise than by a captured call: collector.missed)
            got = weighted.get(pid, 0)
            if got is None:
                continue  # (a layer that counts its examples otherwise: bags)
            got = torch.zeros_like(want) + got
            diff = _mismatch(got.to(want.dtype), want, None, overall, **_PROBE_TOLERANCE)
            if diff is not None:
                wrong.append(f"'{name}' ({diff})")
                continue
            # the norms formed from those gradients: the last example's, against autograd's
            sq = collector.param_sq_norms[name]
            norm, norm_want = float(sq[-1].clamp_min(0).sqrt()), alone.get(pid, 0.0)
            tol = {torch.float64: _PROBE_TOLERANCE["float64"],
                   torch.float32: _PROBE_TOLERANCE["float32"]}.get(sq.dtype, 1e-1)  # fmt: skip
            miss = abs(norm - norm_want)
            if miss > tol * max(norm, norm_want) + 1e-3 * tol * largest and miss > 0:
                wrong.append(f"'{name}' (the last example's norm {norm:.4g}, autograd's "
                             f"{norm_want:.4g})")  # fmt: skip
        if not wrong:
            return
        collector.discard_backward()
        collector.param_sq_norms, collector.norm_forms = {}, {}
        collector.sum_grad_sq, collector.grad_mean = {}, {}
        raise RuntimeError(
            "gradhooks: the per-example norms are not those of the examples' own gradients: "
            "the gradients they were formed from, weighted over the examples, are not the "
            "gradient autograd gives from the model's output-gradients with each example's "
            f"rows weighted alike, for {_listed(wrong)}. The norms of this backward were not "
            "kept. " + _EXAMPLES_NOT_APART.format(lost=_lost(probe))
        )

    def _grad1_of_backward(self, bw: _Backward, pid: int, p: nn.Parameter) -> Tensor | None:
        """What backward ``bw`` added to ``p.grad1`` (``None``: nothing)."""
        if pid not in self._written or pid not in bw.before:
            return None
        g1 = p.grad1.detach()
        before = bw.before[pid]
        return g1 if before is None else g1 - before

    def _rollback(self, bw: _Backward) -> None:
        """Put back the grad1 a backward started from. ``bw.before`` holds a reference to it,
        so it was never written in place (``_writable_grad1`` refuses a referenced grad1)."""
        for pid, before in bw.before.items():
            p = self._written.get(pid)
            if p is None:
                continue
            if before is None:
                del self._written[pid]
                if hasattr(p, "grad1"):
                    del p.grad1
            else:
                p.grad1 = before

    def _abort_backward(self) -> None:
        """A hook of ours raised: the backward fails; leave nothing of it behind."""
        bw = self._tasks.pop(_graph_task(), None)
        if bw is not None:
            self._rollback(bw)
        if self._collector is not None:
            self._collector.discard_backward()

    def _drop_stale(self) -> None:
        """At a forward outside any backward: a backward still recorded as running failed
        (an exception elsewhere in it); undo what it wrote."""
        for bw in self._tasks.values():
            self._rollback(bw)
        self._tasks.clear()
        if self._collector is not None and self._collector._queued:
            self._collector.discard_backward()

    def _accumulate(self, qualname: str, p: nn.Parameter, g1: Tensor) -> None:
        if g1.dtype != p.dtype:
            g1 = g1.to(p.dtype)
        if id(p) in self._written:
            old = p.grad1
            if old.shape != g1.shape:
                raise RuntimeError(
                    f"grad1 of '{qualname}' holds {tuple(old.shape)} from an earlier call in this "
                    f"accumulation, this call gives {tuple(g1.shape)}: the batch size changed. "
                    "Call clear() (autograd-hacks: clear_backprops(model)) between steps, or "
                    "make every hooked layer see the same batch."
                )
            p.grad1 = old + g1
        else:
            p.grad1 = g1


class _Edges(list):
    """:func:`_output_edges`' list of gradient edges; ``numel``: the elements of the outputs
    they lead to (what one backward through them writes at least)."""

    numel = 0


@contextlib.contextmanager
def _output_edges(hooks: Hooks) -> Iterator[_Edges]:
    """While a forward of the hooked model runs inside: the gradient edges of every hooked
    call's output tensors that require grad, in a list (the outputs themselves are not kept
    alive). A backward taken with respect to them, ``torch.autograd.grad(out, edges)``, reaches
    every hooked call, whose hooks then fire, without forming any parameter's batch gradient
    (for a convolution batched over several output-gradients, the largest part of the work)."""
    from torch.autograd.graph import get_gradient_edge

    targets = {id(t.module) for t in hooks._targets}
    edges = _Edges()

    def collect(module: nn.Module, args, output) -> None:
        if id(module) in targets:
            for t in tree_flatten(output)[0]:
                if isinstance(t, Tensor) and t.requires_grad:
                    edges.append(get_gradient_edge(t))
                    edges.numel += t.numel()

    handle = nn.modules.module.register_module_forward_hook(collect)
    try:
        yield edges
    finally:
        handle.remove()


def _without_nodes(taps: Any) -> Any:
    """``taps`` as the rule sees them (``call.taps``): without their ``nodes``, which the engine
    has hooked by then. Each node's hook refers to the kept call; a call referring back to the
    node would make a reference cycle through autograd's graph, which keeps the forward's
    tensors (and the graph's) alive after the backward until Python's garbage collector runs:
    several steps' activations at once, and fresh memory for every step."""
    if not getattr(taps, "nodes", None):
        return taps
    kept = copy.copy(taps)
    kept.nodes = ()
    return kept


class _Attach(torch.autograd.Function):
    """``_Attach.apply(backward, output, *params, *inputs)``: ``output``, computed with
    ``params`` detached, attached to them again (:meth:`Hooks._detach_hook`): the same memory,
    not a view for autograd (an in-place ReLU may follow). Its backward hands the
    output-gradient on unchanged and asks ``backward(g)`` for the gradients of ``params`` and
    ``inputs``."""

    @staticmethod
    def forward(ctx, backward, output: Tensor, *params_and_inputs: Tensor) -> Tensor:
        ctx.backward = backward
        return output.detach()

    @staticmethod
    def backward(ctx, g: Tensor):
        return (None, g, *ctx.backward(g))


class _Carry(torch.autograd.Function):
    """``_Carry.apply(backward, x, *params)``: ``x`` (the same memory), attached to ``params``
    that the call it goes into runs detached (:meth:`Hooks._detach_hook`). Its backward asks
    ``backward(g)`` for the gradients of ``x`` and ``params``."""

    @staticmethod
    def forward(ctx, backward, x: Tensor, *params: Tensor) -> Tensor:
        ctx.backward = backward
        ctx.set_materialize_grads(False)
        return x.detach()

    @staticmethod
    def backward(ctx, g: Tensor | None):
        return (None, *ctx.backward(g))


@contextlib.contextmanager
def _parameters_replaced(module: nn.Module, tensors: dict[str, Tensor]) -> Iterator[None]:
    """``module``'s parameters named in ``tensors`` (qualified names) replaced by them."""
    owners = {}
    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        owner = module.get_submodule(prefix) if prefix else module
        slots = _torch.own_parameters(owner)
        owners[name] = (slots, leaf, slots[leaf])
        slots[leaf] = t
    try:
        yield
    finally:
        for slots, leaf, p in owners.values():
            slots[leaf] = p


def _rerun_carried(
    carried: _Carried, missing: list[str], outputs: tuple, create_graph: bool
) -> tuple[dict[str, Tensor | None], Tensor | None]:
    """What a :class:`_Carry` node needs of autograd through the call's forward run again,
    hooks bypassed, against the call's output-gradients ``outputs``: the batch gradients of
    the ``missing`` parameters and, in a ``create_graph`` backward, a correction of value zero
    for the carried input. Its gradient as the call's own nodes computed it has no graph
    through the detached parameters; the correction carries exactly that part: the forward
    runs on a fresh leaf for the input, against detached output-gradients, with every other
    parameter of the call detached."""
    module, detached = carried.target.module, carried.detached
    args, kwargs = carried.args, carried.kwargs
    found: dict[str, Tensor | None] = {}
    if missing:
        call = (args, kwargs) if create_graph else _detach((args, kwargs))
        wanted = [detached[n] for n in missing]
        found = dict(zip(missing, _rerun_owned(module, call, outputs, wanted, create_graph)))
    correction = None
    if create_graph:
        x = carried.input
        leaf = x.detach().requires_grad_()
        swap = lambda t: leaf if t is x else t.detach() if isinstance(t, Tensor) else t  # noqa: E731
        others = {n: p.detach() for n, p in carried.target.params.items() if n not in detached}
        with _parameters_replaced(module, others):
            (full,) = _rerun_owned(
                module, tree_map(swap, (args, kwargs)),
                [None if g is None else g.detach() for g in outputs], [leaf], True,
            )  # fmt: skip
        if full is not None:
            correction = full - full.detach()
    return found, correction


def _last_pre_hook(module: nn.Module, fn: Any) -> bool:
    """Whether ``fn`` is the forward pre-hook ``module`` runs last (none global)."""
    last = _torch.last_forward_pre_hook(module)
    return getattr(last, "fn", None) is fn and not _torch.global_forward_pre_hooks()


class _AttachAll(torch.autograd.Function):
    """``_AttachAll.apply(backward, n, *outputs, *params_and_inputs)``: the ``n`` ``outputs`` of a
    call that autograd recorded nothing of (:meth:`Hooks._capture_owned`), attached to
    ``params_and_inputs``: the same memory. Its backward asks ``backward(grads)`` (one per
    output, ``None`` where none flowed) for the gradients of ``params_and_inputs``."""

    @staticmethod
    def forward(ctx, backward, n: int, *tensors: Tensor):
        ctx.backward, ctx.n = backward, n
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in tensors[:n])

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *(None for _ in range(ctx.n)), *ctx.backward(grads))


def _rerun_owned(
    module: nn.Module,
    owned: tuple[tuple, dict],
    grads: list,
    wanted: list[Tensor],
    create_graph: bool,
) -> list[Tensor | None]:
    """The gradients of ``wanted`` (parameters, inputs) through ``module``'s forward run again
    on the ``(args, kwargs)`` of a call (``owned``, as called: inputs attached), hooks
    bypassed, against ``grads`` (one per leaf of the output, ``None`` where none flowed)."""
    with torch.enable_grad():
        args, kwargs = owned
        leaves = tree_flatten(module.forward(*args, **kwargs))[0]
    pairs = [
        (t, g) for t, g in zip(leaves, grads)
        if g is not None and isinstance(t, Tensor) and t.requires_grad
    ]  # fmt: skip
    if not pairs or not wanted:
        return [None] * len(wanted)
    outs, gs = zip(*pairs)
    return list(torch.autograd.grad(outs, wanted, gs, create_graph=create_graph, allow_unused=True))


def _rerun_vjp(
    module: nn.Module,
    detached: dict[str, nn.Parameter],
    sums: dict[str, Tensor],
    args: tuple,
    kwargs: dict,
    inputs: list[Tensor],
    g: Tensor,
) -> tuple[dict[str, Tensor | None], list[Tensor | None]]:
    """The gradients an :class:`_Attach` node gives: for each detached parameter, the call's
    batch gradient (``sums``: from ``grad1``, the norms or the rule's pieces; where none gave
    one, a ``create_graph`` backward that writes nothing, by running the call's forward
    again, hooks bypassed). For the
    call's ``inputs``, nothing (``None``), except in a ``create_graph`` backward: the
    input-gradient the output's own node computed has no graph through the detached
    parameters, so each input gets a correction of value zero that carries it."""
    create_graph = torch.is_grad_enabled()
    grads: dict[str, Tensor | None] = dict(sums)
    missing = [n for n in detached if n not in grads]
    if missing:
        with torch.enable_grad():
            a, k = (args, kwargs) if create_graph else _detach((args, kwargs))
            found = torch.autograd.grad(
                module.forward(*a, **k), [detached[n] for n in missing], g,
                create_graph=create_graph, allow_unused=True,
            )  # fmt: skip
        grads.update(zip(missing, found))
    corrections: list[Tensor | None] = [None] * len(inputs)
    if create_graph and inputs:
        leaves = [t.detach().requires_grad_() for t in inputs]
        swap = dict(zip(map(id, inputs), leaves))
        a, k = tree_map(lambda t: swap.get(id(t), t), (args, kwargs))
        found = torch.autograd.grad(
            module.forward(*a, **k), leaves, g.detach(), create_graph=True, allow_unused=True
        )
        corrections = [None if c is None else c - c.detach() for c in found]
    return grads, corrections


def _grad1_refs(owner: Any) -> int:
    t = owner.__dict__.get("grad1")
    return sys.getrefcount(t)


def _sole_refs() -> int | None:
    """What :func:`_grad1_refs` counts for a ``grad1`` that nothing else refers to, or ``None``
    where one more reference would not show (then ``grad1`` is never written in place)."""
    try:
        owner = nn.Parameter(torch.zeros(2))
        owner.grad1 = torch.zeros(1, 2)
        alone = _grad1_refs(owner)
        kept = owner.grad1  # noqa: F841  (one more reference)
        return alone if _grad1_refs(owner) == alone + 1 else None
    except Exception:
        return None


_SOLE_REFS = _sole_refs()


def _sole_grad1(p: nn.Parameter) -> Tensor | None:
    """``p.grad1`` if it is a plain contiguous tensor that only ``p`` refers to: no other
    Python reference, no view or other tensor on its memory, not saved by autograd."""
    if _SOLE_REFS is None or type(p.__dict__.get("grad1")) is not Tensor:
        return None
    if _grad1_refs(p) != _SOLE_REFS:
        return None
    t = p.grad1
    return t if t.is_contiguous() and _torch.unshared(t) else None


def _plan(
    model: nn.Module, registry: Registry, unsupported: Unsupported,
    shards: dict[str, nn.Parameter] | None = None,
) -> list[_Target]:  # fmt: skip
    """Which modules to hook, checking that every trainable parameter is covered. ``shards``:
    the parameters sharded by FSDP2 by qualified name (:func:`_fsdp_shards`), which the
    targets hold in place of what is in their slots now (a stand-in of FSDP2's)."""
    targets: list[_Target] = []
    owned: list[str] = []
    uncovered: list[tuple[str, nn.Module, dict[str, nn.Parameter]]] = []
    covered: set[int] = set()
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in owned):
            continue
        entry = registry.lookup(module)
        recurse = entry is not None and entry.owns_children
        # Every slot, also one Parameter held in two slots of a module (bias = weight): each
        # slot's piece is added to it.
        own = dict(module.named_parameters(recurse=recurse, remove_duplicate=recurse))
        if entry is None:
            trainable = {n: p for n, p in own.items() if p.requires_grad}
            if trainable and unsupported == "fallback":
                params = fallback_params(module)
                targets.append(_Target(name, module, FALLBACK, params))
                covered.update(id(p) for p in params.values())
            elif trainable:
                uncovered.append((name, module, trainable))
            continue
        if entry.owns_children:
            owned.append(f"{name}." if name else "")
        if own:
            targets.append(_Target(name, module, entry, own))
            covered.update(id(p) for p in own.values())
    if uncovered:
        lines = [
            f"'{name or '<model>'}' ({type(m).__qualname__}): {', '.join(ps)}"
            for name, m, ps in uncovered
        ]
        # Skipping a parameter that a covered module also uses (tied) would make its grad1 hold
        # only part of the gradient: never allowed.
        tied = [
            f"'{name}.{pn}'"
            for name, _, ps in uncovered
            for pn, p in ps.items()
            if id(p) in covered
        ]
        if unsupported == "error" or tied:
            why = (
                f"\nThese are tied to hooked modules, so skipping them would make grad1 wrong: "
                f"{', '.join(tied)}."
                if tied
                else ""
            )
            raise TypeError(
                "gradhooks has no rule for these modules with trainable parameters:\n  "
                + "\n  ".join(lines)
                + why
                + "\nRegister one with @gradhooks.register(ModuleType) (see the README), freeze "
                "those parameters, pass unsupported='fallback' (the default) to compute them with "
                "torch.func, or unsupported='skip' to leave them without grad1. Nothing was hooked."
            )
    if shards:
        for t in targets:
            prefix = f"{t.name}." if t.name else ""
            t.params = {n: shards.get(prefix + n, p) for n, p in t.params.items()}
    return targets


_SIGNATURES: weakref.WeakKeyDictionary[type, inspect.Signature | None] = (
    weakref.WeakKeyDictionary()
)  # (a module class's forward signature, while the class exists)


def _refuse_scripted(model: nn.Module, targets: list[_Target]) -> None:
    """TorchScript modules take no hooks: refused before anything is hooked."""
    scripted = [t for t in targets if isinstance(t.module, torch.jit.ScriptModule)]
    if not scripted:
        return
    t = scripted[0]
    params = ", ".join(f"'{n}'" for n in t.params)
    raise TypeError(
        f"module '{t.name or '<model>'}' is a TorchScript module "
        f"({type(t.module).__qualname__}), which takes no forward or backward hooks, so "
        f"gradhooks cannot capture its calls for its trainable parameters ({params}). Hook the "
        "module before torch.jit.script, or freeze its parameters (requires_grad_(False))."
    )


def _refuse_complex(model: nn.Module, quantities: tuple) -> None:
    """Norms, squared sums and curvature are formed for real parameters only."""
    formed = [q for q in quantities if q != "grad1"]
    found = [n for n, p in model.named_parameters() if p.requires_grad and p.is_complex()]
    if formed and found:
        raise ValueError(
            f"'{found[0]}' is complex: quantities {tuple(formed)} are formed for real "
            "parameters only. Use quantities=('grad1',) and take what you need from grad1 "
            "(p.grad1.abs().pow(2) for the squares), or freeze the complex parameters."
        )


def _refuse_lazy(model: nn.Module) -> None:
    """A lazy module's parameters take their shapes at its first forward: refused before."""
    lazy = [n for n, p in model.named_parameters() if isinstance(p, nn.UninitializedParameter)]
    if lazy:
        raise ValueError(
            f"'{lazy[0]}' is not initialized yet (a lazy module, nn.LazyLinear and the like, "
            "takes its shapes at its first forward): run one forward of the model (under "
            "torch.no_grad()) before add_hooks."
        )


def _entries(model: nn.Module, targets: list[_Target]) -> list[nn.Module]:
    """The modules of ``model`` other than itself that hold a hooked module or are one: each
    may be called on its own (:meth:`Hooks._entry_hooks`)."""
    hooked = {id(t.module) for t in targets}
    found: dict[int, nn.Module] = {}

    def walk(m: nn.Module) -> bool:
        holds = id(m) in hooked
        for child in m.children():
            holds |= walk(child)
        if holds and m is not model and not isinstance(m, torch.jit.ScriptModule):
            found[id(m)] = m
        return holds

    walk(model)
    return list(found.values())


def _forward_signature(cls: type) -> inspect.Signature | None:
    if cls not in _SIGNATURES:
        try:
            _SIGNATURES[cls] = inspect.signature(cls.forward)
        except (TypeError, ValueError):
            _SIGNATURES[cls] = None
    return _SIGNATURES[cls]


def _positional(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A call's arguments as its forward's signature binds them: those passed by keyword that
    the forward also takes by position (``linear(input=x)``) join ``args``, which is where the
    rules read them."""
    if not kwargs:
        return args, kwargs
    sig = _forward_signature(type(module))
    if sig is None:
        return args, kwargs
    try:
        bound = sig.bind(module, *args, **kwargs)
    except TypeError:
        return args, kwargs
    return tuple(bound.args[1:]), dict(bound.kwargs)


def _detach(tree: Any) -> Any:
    if type(tree) is Tensor:
        return tree.detach()
    if _flat(tree):
        return tuple(t.detach() for t in tree) if type(tree) is tuple else tree
    return tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, tree)


def _leaves(tree: Any) -> list[Any]:
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


def _higher_order(module: str) -> str:
    return (
        f"{module}: this backward computes parameter gradients through a call through which "
        "an earlier backward was run with create_graph=True (torch.autograd.grad(..., "
        "create_graph=True): an input-gradient, a Laplacian, a gradient penalty, or grad1 "
        "itself). A loss built from such derivatives has per-example gradients with terms "
        "through the double backward that hooks do not see, so grad1 would be wrong (it was not "
        "written). To differentiate grad1 or those derivatives on purpose, run this backward "
        "under `with h.paused():`; for per-example gradients of such a loss use torch.func "
        "(gradhooks.oracle.vmap_grad); if the derivatives are not part of this loss, compute "
        "them without create_graph=True (or detach them)."
    )


def _used_by_fallback(target: _Target, live: dict, used, tracker: Tracker, output) -> dict:
    """The parameters a call of a module without a rule used in operations of its own (not
    inside its hooked submodules' calls) that the fallback differentiates: those the tracker
    could not follow to where they met the batch cheaply (its sources for them are then
    dropped). A submodule's parameter it uses directly while also calling that submodule
    cannot be told apart in the recomputation (both uses would be counted): an error."""
    escaped = set()
    for t in tree_flatten(output)[0]:
        escaped |= tracker.sources_of(t)
    kept = {}
    for n, p in live.items():
        if id(p) not in used.params:
            continue
        source = used.sources.get(id(p))
        if source is None and id(p) in used.functional:
            continue  # the tracker's: captured as F.linear's call
        if source is not None and not (
            source.needs_fallback or source.problem or source in escaped
        ):  # fmt: skip
            continue  # the tracker's
        if source is not None:
            source.discarded = True
        kept[n] = p
    for n in kept:
        prefix, _, _ = n.rpartition(".")
        if prefix and id(target.module.get_submodule(prefix)) in used.called:
            raise RuntimeError(
                f"'{target.name or '<model>'}' ({type(target.module).__qualname__}) calls its "
                f"submodule '{prefix}' and also uses its parameter '{n}' directly; its "
                "per-example gradients cannot tell the two uses apart. Register a rule for "
                f"{type(target.module).__qualname__} with @gradhooks.register, or use the "
                "parameter only through the submodule."
            )
    return kept


def _structure(model: nn.Module, by_name: bool = False) -> tuple:
    """What the hooks were planned for: the modules, and which parameters are trainable (by
    name where FSDP2 shards them: it swaps a module's parameters for unsharded ones while it
    runs)."""
    return (
        tuple(map(id, model.modules())),
        tuple(n if by_name else (n, id(p)) for n, p in model.named_parameters() if p.requires_grad),
    )


def _fsdp_shards(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters of ``model`` sharded by FSDP2 (DTensors), by qualified name, every slot.

    FSDP2 registers a module's sharded parameters only while its group is resharded: while a
    call runs its slots hold unsharded parameters, and the root's group (where the parameters
    of every module not sharded on its own live) stays unsharded from the forward to the
    backward, or after a forward under ``no_grad``. Its modules are resharded first
    (``FSDPModule.reshard``: local, it frees the gathered copies, which the next forward gathers
    again), so that the sharded parameters are those found."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # (a torch without distributed tensors)
        return {}
    for m in model.modules():
        if isinstance(m, _torch.fsdp_module_class()):
            m.reshard()
    return {
        n: p for n, p in model.named_parameters(remove_duplicate=False) if isinstance(p, DTensor)
    }


def _owner_name(name: str) -> tuple[str, str]:
    prefix, _, leaf = name.rpartition(".")
    return prefix, leaf


def _shapes(args: tuple, kwargs: dict) -> str:
    return ", ".join(
        str(tuple(t.shape)) if isinstance(t, Tensor) else type(t).__name__
        for t in tree_flatten((args, kwargs))[0]
    )


class _Unview(torch.autograd.Function):
    """``x``'s memory as a tensor that autograd does not take for a view (its gradient passes
    unchanged), so that an in-place change of it keeps the hooks on it."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        return g


def _own_node(t: Any) -> Any:
    if isinstance(t, Tensor) and t.requires_grad:
        return _Unview.apply(t)
    return t


def _unview(t: Any) -> Any:
    if isinstance(t, Tensor) and t.requires_grad and _torch.is_view(t):
        return _Unview.apply(t)
    return t


def _carry_layouts(tracker: Tracker | None, old: Any, new: Any) -> Any:
    """The layouts (and sources) of a call's outputs, for the outputs the engine replaced them
    with."""
    if tracker is not None and new is not None:
        for a, b in zip(tree_flatten(old)[0], tree_flatten(new)[0]):
            if isinstance(a, Tensor) and isinstance(b, Tensor):
                tracker.set_layout(b, tracker.layout(a))
                tracker.taint(b, tracker.sources_of(a))
    return new


def _keeps_rows(layout: _CallLayout | None) -> bool:
    """Whether a call's rule sees its input as the forward ran it (what ``taps`` were taken
    from): not where the engine moves or adds a batch dimension."""
    return layout is None or layout.kind in ("plain", "fold", "unknown")


def _check_versions(target: _Target, state: _CallState) -> None:
    """The inputs a rule computes from must be those of the forward, as autograd requires of
    the tensors it saves (the paths that run a call detached do not let autograd see them)."""
    for t, version in state.versions:
        if _torch.version(t) != version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: an input of '{target.name or '<model>'}' "
                f"({type(target.module).__qualname__}) of shape {tuple(t.shape)} is at version "
                f"{_torch.version(t)}; expected version {version} instead. gradhooks computes the "
                "layer's per-example gradients from its input, as autograd computes its "
                "weight gradient: change a copy of it (x = x.clone()), or out of place."
            )


def _unchanged_outputs(call: Call, versions: tuple) -> Call:
    """The kept output with every leaf changed in place since the forward (a residual added
    into it: ``x += shortcut``) left out (``None``): it no longer is what the call gave."""
    leaves, spec = tree_flatten(call.output)
    changed = {i for i, v in versions if _torch.version(leaves[i]) != v}
    if not changed:
        return call
    kept = [None if i in changed else t for i, t in enumerate(leaves)]
    return replace(call, output=tree_unflatten(kept, spec))


def _mismatch(
    got: Tensor,
    want: Tensor,
    rows: Tensor | None,
    overall: float,
    float32: float = 2e-2,
    float64: float = 1e-6,
) -> str | None:
    """How ``got`` differs from ``want`` (``None``: within rounding). ``rows``: the per-example
    gradients ``got`` was reduced from (examples' gradients that cancel in the sum set the
    scale too); ``overall``: the largest entry of the model's gradients; ``float32``: the
    relative tolerance in float32 (the default leaves room for lower-precision matrix products
    under autocast)."""
    if not want.numel():
        return None
    if not (torch.isfinite(want).all() and torch.isfinite(got).all()):
        return None
    tol = {torch.float64: float64, torch.float32: float32}.get(want.dtype, 1e-1)
    scale = max(float(want.abs().max()), float(got.abs().max()) if rows is None else 0.0)
    if rows is not None and rows.numel():
        scale = max(scale, float(rows.abs().max()))
    diff = float((got - want).abs().max())
    # float64: a gradient that is zero but for rounding (an InstanceNorm's scale under a
    # summed output) is not compared with its own rounding
    floor = 64 * torch.finfo(want.dtype).eps if want.dtype == torch.float64 else 0.0
    if diff > tol * scale + 1e-3 * tol * overall + floor and diff > 0:
        return f"differs by {diff:.2e}, largest {scale:.2e}"
    return None


# The probe compares two computations, not one reduced two ways: room for a model's own float32
# parts inside a float64 one (Hugging Face's norms and softmax), and, in float32, for TF32
# convolutions on a GPU (autocast leaves the probe out).
_PROBE_TOLERANCE = {"float64": 1e-5, "float32": 5e-3}


def _dependent(edges: list) -> bool:
    """Whether one of the outputs (their gradient edges) is computed from another: the
    gradient reaching the other then holds what flowed in through the first."""
    if len(edges) < 2:
        return False
    nodes = {e.node for e in edges if e.node is not None}
    for e in edges:
        seen, todo = set(), [n for n, _ in e.node.next_functions if n is not None]
        while todo:
            n = todo.pop()
            if n in nodes:
                return True
            if n in seen:
                continue
            seen.add(n)
            todo.extend(m for m, _ in n.next_functions if m is not None)
    return False


_EXAMPLES_NOT_APART = (
    "Either the model mixes the examples of the batch between these parameters and its output "
    "(an operation, custom autograd.Function or kernel that computes across the rows of the "
    "batch, in its forward or its backward; or a layer that computes a parameter's use once "
    "and keeps it): one example's loss then depends on the others' and per-example gradients "
    "do not exist; keep the examples apart (compute what needs the whole batch outside the "
    "model, or use running statistics) or freeze these parameters. Or gradhooks read the examples from the wrong place{lost}: say "
    "where the model's batch is with add_hooks(..., batch_dim=k), or register a rule for the "
    "layer. This is checked on the first backward of each new set of layer calls, and again at the "
    "2nd, 4th, 8th... backward."
)


def _lost(probe: _Probe) -> str:
    if not probe.lost:
        return ""
    return f" after {', '.join(probe.lost)}, whose effect on the batch it does not know"


def _listed(items: list[str], n: int = 5) -> str:
    more = f" and {len(items) - n} more" if len(items) > n else ""
    return ", ".join(items[:n]) + more


def _tolerance(t: Tensor) -> float:
    return {torch.float64: 1e-7, torch.float32: 1e-4}.get(t.dtype, 2e-2)


def _aligned_call(target: _Target, layout: _CallLayout, call: Call) -> _CallLayout | None:
    """A call that does not depend on the examples whose output every operation took row by
    row with the batch (positions looked up already expanded to the batch, then added to it):
    its rows are examples after all, where the tracker found them (``Source.aligned``)."""
    found = {s.aligned for s in layout.sources if s is not None}
    if len(found) != 1 or None in found:
        return None
    (lay,) = found
    dim = target.entry.batch_dim_of(target.module)
    leaves = tree_flatten((call.inputs, call.kwargs))[0]
    first = next((i for i, t in enumerate(leaves) if isinstance(t, Tensor)), None)
    if first is None or leaves[first].dim() <= lay.dim:
        return None
    if dim == "positions":
        kind = "plain" if lay.dim == 0 and lay.plain else "moved"
    elif lay.dim == dim:
        kind = "plain" if lay.plain else "fold"
    else:
        return None
    inputs = tuple(lay if i == first else None for i in range(len(leaves)))
    outputs = tuple(lay for _ in layout.outputs)
    return _CallLayout(kind, layout.batch, lay, inputs, outputs)


def _per_example_outputs(
    target: _Target, layout: _CallLayout, call: Call, create_graph: bool
) -> Call:
    """A call that does not depend on the examples: its output-gradients per example, from
    where its outputs met the batch (the tracker's sources), checked against autograd's."""
    where = f"'{target.name or '<model>'}' ({type(target.module).__qualname__})"
    task = _graph_task()
    grads = []
    for g, source in zip(call.grad_outputs, layout.sources):
        if g is None:
            grads.append(None)
            continue
        per = None if source is None else source.grads.pop(task, None)
        problem = None if source is None else source.problem
        shape = tuple(g.shape)
        if create_graph:
            problem = "a create_graph=True backward runs through it"
        if problem is not None:
            raise RuntimeError(
                f"{where}: its inputs do not depend on the examples (its output {shape} is "
                f"broadcast into the batch later), and {problem}, so gradhooks cannot tell each "
                "example's share of its gradient. Compute its input per example (expand it to "
                "the batch before the layer), or freeze its parameters."
            )
        if per is None:
            raise RuntimeError(
                f"{where}: its inputs do not depend on the examples, and its output {shape} "
                "received a gradient that never met the batch (the model returns it, or a loss "
                "term uses it alone): that gradient belongs to no example. Compute that term "
                "from per-example outputs, or freeze the layer's parameters."
            )
        total = per.sum(0)
        tol = _tolerance(g)
        finite = g[torch.isfinite(g)]  # (NaN and Inf are carried through, as autograd does)
        scale = max(float(finite.abs().max()) if finite.numel() else 0.0, 1e-30)
        if not torch.isclose(total, g, rtol=tol, atol=tol * scale, equal_nan=True).all():
            diff = float((total - g).abs().nan_to_num(nan=float("inf")).max())
            raise RuntimeError(
                f"{where}: its inputs do not depend on the examples; the per-example shares of "
                f"its output's gradient found where it meets the batch add up to within "
                f"{diff:.2e} of the gradient autograd gives it (largest {scale:.2e}): part of "
                "its gradient reached it another way (a term of the loss that uses it alone?). "
                "Its per-example gradients would be wrong: freeze its parameters, or compute "
                "its input per example."
            )
        grads.append(per)
    return replace(call, grad_outputs=tuple(grads), taps=None)


def _pieces(
    target: _Target, params: dict[str, nn.Parameter], call: Call, layout: _CallLayout | None
) -> dict[str, P.Piece | None]:
    """The rule's pieces for a call, with one row per example: the call handed to the rule
    with its examples where the rule reads them (moved, added), or the rule's rows of one
    example summed (folded), or the rule run one example at a time (a call that does not
    depend on the examples, of a layer that reads its batch from a fixed dimension)."""
    rule = target.entry.rule
    if target.entry is FALLBACK:
        if layout is None:
            return rule(call)
        batch = CallBatch(
            layout.batch, layout.inputs, layout.outputs, layout.kind == "shared", frozenset(params)
        )
        return rule(replace(call, batch=batch))
    if layout is None or layout.kind in ("plain", "unknown"):
        return rule(call)
    if layout.kind == "mismatch":
        rule(call)  # (its own error, where it has one, says more: an unbatched input)
        raise RuntimeError(layout.lost[0])
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
                pieces[n] = piece.merged(params[n].shape, first.outer, layout.batch, first.inner)
        return pieces
    return _one_by_one(rule, call, params, layout.batch)


def _positions_call(call: Call, layout: _CallLayout) -> Call:
    """A position-wise layer's call with its examples on a new dimension 0: moved there
    (with any fold) from where they are, or, for a call that does not depend on them, its
    inputs repeated for every example (a view) beside the per-example output-gradients."""
    batch = layout.batch
    if layout.kind == "shared":

        def grow(t):
            return t.unsqueeze(0).expand(batch, *t.shape) if isinstance(t, Tensor) else t

        return replace(
            call, inputs=tree_map(grow, call.inputs), kwargs=tree_map(grow, call.kwargs),
            taps=None,
        )  # fmt: skip
    leaves, spec = tree_flatten((call.inputs, call.kwargs))
    moved = [
        batch_rows(t, lay, batch) if isinstance(t, Tensor) and _followed(lay) else t
        for t, lay in zip(leaves, layout.inputs)
    ]
    inputs, kwargs = tree_unflatten(moved, spec)
    grads = []
    for i, g in enumerate(call.grad_outputs):
        lay = layout.outputs[i] if i < len(layout.outputs) else None
        grads.append(None if g is None else batch_rows(g, lay if _followed(lay) else layout.first,
                                                       batch))  # fmt: skip
    return replace(call, inputs=inputs, kwargs=kwargs, grad_outputs=tuple(grads), taps=None)


def _followed(lay: Layout | None) -> bool:
    return lay is not None and lay.dim >= 0


def _one_by_one(rule, call: Call, params: dict, batch: int) -> dict[str, P.Piece | None]:
    """A call that does not depend on the examples, of a layer that reads its batch from a
    fixed dimension: the rule once per example, with that example's output-gradients; every
    row the rule gives belongs to that example."""
    per: dict[str, list] = {n: [] for n in params}
    for b in range(batch):
        one = replace(
            call, grad_outputs=tuple(None if g is None else g[b] for g in call.grad_outputs)
        )
        pieces = rule(one)
        for n, p in params.items():
            piece = pieces.get(n)
            per[n].append(None if piece is None else piece.grad1(p.shape).sum(0))
    out: dict[str, P.Piece | None] = {}
    for n, rows in per.items():
        if all(r is None for r in rows):
            out[n] = None
        else:
            like = next(r for r in rows if r is not None)
            out[n] = P.Direct(
                torch.stack([torch.zeros_like(like) if r is None else r for r in rows])
            )
    return out


def _root_batch(
    args: tuple, kwargs: dict, batch_dim
) -> tuple[int, list[tuple[Tensor, Layout]]] | None:
    """The model's batch size and the layouts of its tensor inputs: dimension ``batch_dim``
    (0 for ``"auto"``) of its first tensor input is the batch, and every tensor input whose
    dimension ``batch_dim`` has that size holds the examples there; a ``PackedSequence``'s
    batch is its first batch size."""
    dim = 0 if batch_dim == "auto" else batch_dim
    packed = [a for a in (*args, *kwargs.values()) if isinstance(a, PackedSequence)]
    leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
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


def _describe(call: Call) -> str:
    def shapes(tree: Any) -> str:
        return ", ".join(
            str(tuple(t.shape)) if isinstance(t, Tensor) else type(t).__name__
            for t in tree_flatten(tree)[0]
        )

    grads = ", ".join("None" if g is None else str(tuple(g.shape)) for g in call.grad_outputs)
    return f"inputs [{shapes(call.inputs)}], output-gradients [{grads}]"


def add_hooks(
    model: nn.Module,
    loss_reduction: LossReduction = "mean",
    unsupported: Unsupported = "fallback",
    registry: Registry = REGISTRY,
    quantities: tuple[str, ...] | str = ("grad1",),
    *,
    batch_dim: int | str | None = "auto",
    max_grad1_bytes: int | str | None = "auto",
    capture: Capture = "always",
    verify: bool = True,
) -> Hooks:
    """Hook ``model`` so that every ``backward()`` writes ``param.grad1``.

    Args:
        model: any ``nn.Module``.
        loss_reduction: ``"mean"`` when the loss is the mean of per-example losses (the default
            of torch losses), ``"sum"`` when it is their sum. ``grad1[i]`` is the gradient of
            example ``i``'s own loss in both cases.
        unsupported: what to do with a module that has trainable parameters and no rule.
            ``"fallback"`` (default): compute its per-example gradients with ``torch.func``
            from the captured call (:mod:`gradhooks.fallback`; slower than a rule, see
            :meth:`Hooks.fallback_modules`). ``"error"``: raise, before anything is hooked.
            ``"skip"``: leave its parameters without ``grad1``.
        registry: the rules to use (default: the built-in registry).
        quantities: what each backward computes, any of ``"grad1"`` (``param.grad1``),
            ``"norms"`` (:meth:`Hooks.norms`, :meth:`Hooks.param_norms`), ``"sum_grad_sq"``
            (:meth:`Hooks.sum_grad_sq`, :meth:`Hooks.grad_variance`) and ``"kfac"``
            (:meth:`Hooks.kfac_factors`). Without ``"grad1"`` no per-example gradient of the
            whole model is ever formed.
        batch_dim: the check that every hooked layer sees the examples on dimension 0 of
            its input (rules for sequence-first layers, such as ``nn.LSTM`` without
            ``batch_first``, handle their own layout). ``"auto"`` (default): all hooked
            layers of one forward of the model must agree on the batch size, and it must be
            the size of dimension 0 or 1 of some tensor input or output of the model (so a
            model that folds time into the batch, ``x.view(B * T, ...)``, is an error naming
            the layer and both sizes; a lone layer run sequence-first is not caught). An int
            ``k``: the batch is dimension ``k`` of the model's first
            tensor input, and every layer must see exactly that (stricter; also checks the
            memory limit at the forward). ``None``: no check.
        max_grad1_bytes: refuse a ``grad1`` (batch × trainable parameters × element size)
            larger than this many bytes (:class:`gradhooks.Grad1TooLarge`, raised at the
            first captured call of the backward, before any ``grad1`` is formed; at the
            forward with an int ``batch_dim``). ``"auto"``: :func:`gradhooks.set_memory_limit`'s
            value, by default half of the memory of the parameters' device. ``None``: no limit.
        capture: which backwards write ``grad1``. ``"always"`` (default): every backward
            that computes the parameters' gradients (``.backward()``, ``torch.autograd.grad``
            with respect to some of them), except under :meth:`Hooks.paused`; a backward
            that computes none of the model's parameter gradients (``torch.autograd.grad``
            with respect to the input only) leaves ``grad1`` as it was. ``"marked"``:
            only backwards run inside ``with h.capturing():``.
        verify: on the first backward of each new set of layer calls (the first step, a new
            sequence length), check that every parameter's ``grad1`` adds up to the gradient
            autograd computed, and raise, naming the parameters, where it does not (a use the
            hooks did not see; a loss term that is not per example, such as weight decay
            added to the loss: ``verify=False`` keeps ``grad1`` of the per-example terms).

    Returns:
        A :class:`Hooks` handle; also a context manager that removes the hooks on exit.

    Like autograd-hacks' ``add_hooks``, it turns capture back on where
    :func:`set_enabled` (``disable_hooks()``) turned it off.

    Example::

        >>> import torch, gradhooks
        >>> model = torch.nn.Linear(3, 2)
        >>> x, y = torch.randn(5, 3), torch.randn(5, 2)
        >>> with gradhooks.add_hooks(model):
        ...     torch.nn.functional.mse_loss(model(x), y).backward()
        >>> model.weight.grad1.shape
        torch.Size([5, 2, 3])
        >>> torch.allclose(model.weight.grad1.mean(0), model.weight.grad, atol=1e-6)
        True
    """
    hooks = Hooks(
        model, loss_reduction=loss_reduction, unsupported=unsupported, registry=registry,
        quantities=quantities, batch_dim=batch_dim, max_grad1_bytes=max_grad1_bytes,
        capture=capture, verify=verify,
    )  # fmt: skip
    set_enabled(True)  # (as autograd-hacks' add_hooks undoes its disable_hooks)
    return hooks


def hooks_of(model: nn.Module) -> Hooks:
    """The active handle of a hooked model (raises if it has none)."""
    try:
        return _ACTIVE[model]
    except KeyError:
        raise ValueError(
            f"{type(model).__qualname__} has no gradhooks hooks: call gradhooks.add_hooks(model) "
            "first (or it was already removed)"
        ) from None


def remove_hooks(model: nn.Module) -> None:
    """Remove the hooks :func:`add_hooks` put on ``model``. ``grad1`` stays on the parameters."""
    hooks_of(model).remove()


def clear_grad1(model: nn.Module) -> None:
    """Delete ``grad1`` from every parameter of ``model`` (a handle on it then starts afresh,
    as after :meth:`Hooks.clear`)."""
    hooks = _ACTIVE.get(model)
    if hooks is not None:
        hooks.clear()
    for p in model.parameters():
        if hasattr(p, "grad1"):
            del p.grad1

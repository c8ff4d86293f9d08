"""The engine: hooks, capture and accumulation. It never names a layer type.

A forward hook on every module that has a rule keeps that call's inputs (detached; autograd keeps
them alive anyway) and registers a gradient hook on the call's output tensors. When backward
reaches those outputs, the rule turns (inputs, output-gradients) into pieces and the per-example
gradient of each trainable parameter is added to ``param.grad1``.

Pairing the gradient hook with the call it came from (rather than with the module) is what makes
a module called twice in one forward correct; accumulating on the parameter object is what makes
tied weights correct.

:class:`Hooks` is this module's: what is hooked (installing, following changes, removing) and
what a user reads. Its parts live beside it: :mod:`.plan` (which modules are hooked, with which
rule), :mod:`.forward` (a forward of the model: frames, the tracker, each hooked call kept),
:mod:`.backward` (a backward: each call's pieces into ``grad1`` and the quantities, and the
backward's bookkeeping), :mod:`.records` (what is kept per call, forward and backward),
:mod:`.calls` (where the examples are in each call, from the forward's tracker),
:mod:`.capture` (calls run detached, owned or carried, for the rules that ask) and
:mod:`.verify` (the checks of a backward against autograd, and :meth:`Hooks.check`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch import Tensor, nn

from .. import _torch
from ..loop import per_example
from ..quantities import _INTERNAL, QUANTITIES, Collector, total_norms
from ..rules.fallback import FALLBACK
from ..rules.registry import REGISTRY, Registry
from .accumulation import GradTrail
from .backprops import KeptBackprops
from .backward import Backwards
from .calls import CallLayouts
from .capture import DetachedCalls
from .forward import Forwards
from .pause import PROCESS, Pause, set_enabled
from .plan import (
    Target,
    Unsupported,
    entry_modules,
    fsdp_shards,
    plan_targets,
    refuse_complex,
    refuse_lazy,
    refuse_scripted,
    structure_of,
)
from .records import Backward, Frame, Hook, drop_box, graph_task
from .verify import CheckReport, Verification, check_hooks

__all__ = ["Hooks", "add_hooks", "remove_hooks", "hooks_of", "clear_grad1"]

LossReduction = Literal["mean", "sum"]
Capture = Literal["always", "marked"]

# Models and modules currently hooked, so that hooks are never added twice (which would count
# every gradient twice). Weak: a model that is garbage collected leaves nothing behind here.
_ACTIVE: weakref.WeakKeyDictionary[nn.Module, Hooks] = weakref.WeakKeyDictionary()
_HOOKED_MODULES: weakref.WeakKeyDictionary[nn.Module, Hooks] = weakref.WeakKeyDictionary()


class Hooks(Forwards, Backwards, CallLayouts, DetachedCalls, Verification):
    """Per-example gradient hooks on one model. Returned by :func:`add_hooks`.

    Use it as a context manager to remove the hooks on exit::

        with gradhooks.add_hooks(model) as h:
            F.cross_entropy(model(x), y).backward()
        model.fc.weight.grad1          # [batch, *model.fc.weight.shape]

    After each captured backward, every trainable parameter that received a gradient holds
    ``param.grad1``, of shape ``[batch, *param.shape]``: ``grad1[i]`` is the gradient of example
    ``i``'s own loss. For ``loss_reduction="mean"`` (loss = mean of per-example losses)
    ``grad1.mean(0)`` equals ``param.grad``; for ``"sum"``, ``grad1.sum(0)`` does.

    ``grad1`` accumulates exactly when ``.grad`` does: a backward adds to it where ``.grad``
    still holds what the backwards before it left (micro-batches, ``retain_graph``), and starts
    it afresh where ``.grad`` was reset (``optimizer.zero_grad()`` / ``model.zero_grad()``,
    either ``set_to_none``); after a reset, a parameter the backward does not reach loses its
    ``grad1`` (zeros where ``.grad`` is zeros). :meth:`clear` starts afresh as a reset does.

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
        keep_backprops: bool = False,
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
        self._shards = fsdp_shards(model)
        self._sharded = {id(p) for p in self._shards.values()}  # per-example norms, no grad1
        self._targets = plan_targets(model, registry, unsupported, self._shards)
        self._check_not_hooked(model)
        # the parameters whose grad1 the next captured backward adds to (the accumulation
        # goes on), and whose grad1 it replaces if it reaches them, else deletes or zeroes
        # (left from before a zero_grad or clear(): stale), by id
        self._written: dict[int, nn.Parameter] = {}
        self._stale: dict[int, nn.Parameter] = {}
        self._trail = GradTrail()  # the .grad the backwards left (gradhooks.engine.accumulation)
        self._depth: dict[int, int] = {}  # captured backwards in each parameter's grad1
        self._forward_of: dict[int, weakref.ref] = {}  # the forward its last grad1 came from
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
        self._frames: list[Frame] = []  # root forwards running
        self._tasks: dict[int, Backward] = {}  # backwards running, by graph task id
        self._missed: dict[str, None] = {}  # parameters a backward computed without capture
        # the Jacobians' and kfac()'s handles run their backwards batched under vmap themselves:
        # a batched output-gradient there is theirs, not a user's is_grads_batched backward
        self._vmapped = bool({"_jacobian", "_vmapped"} & set(quantities))
        # the lowest precision the calls of the backwards since clear() ran in (the checks'
        # tolerance: records.lowest_precision)
        self._precision: torch.dtype | None = None
        self._handles: list = []
        # calls run with their parameters detached, {id(module): [(module, {name: param},
        # (args, kwargs) where the call runs with grad mode off, else None, its _Carried where
        # its input carries them, else None, (its rule's record, what it gave) where one is
        # entered, else None)]}
        self._detached: dict[int, list[tuple[nn.Module, dict, Any, Any, Any, Any]]] = {}
        self._aliases_checked: set[int] = set()  # modules whose detached call was checked
        self._rerunning = (
            0  # inside a rerun of a detached call, or a per-example backward of the tracker's
        )
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
        # autograd-hacks' layer.activations and layer.backprops_list (keep_backprops=True)
        self._kept_backprops = KeptBackprops() if keep_backprops else None
        self._direct_targets: dict[int, Target] = {}
        self._functional_targets: dict[tuple, Target] = {}
        self._target_handles: list = []
        self._module_hooks: list[Hook] = []  # the hooks _install put on the planned modules
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
        self._checks_examples = self._grad1 or "norms" in quantities
        refuse_scripted(model, self._targets)
        refuse_lazy(model)
        refuse_complex(model, quantities)
        try:
            self._handles.append(
                model.register_forward_pre_hook(Hook(self._on_root_pre), with_kwargs=True)
            )
            self._install(model)
            self._handles.append(
                model.register_forward_hook(
                    Hook(self._on_root_post), with_kwargs=True, always_call=True
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
        # tensors computed from parameters in the parameters' slots (torch.func.functional_call
        # with fast weights, p - lr * g): grad1 goes on, through the computation, to the
        # tensors autograd gives the gradient (_derived_hook)
        derived = {pid: p for pid, (_, p) in self._params.items() if p.grad_fn is not None}
        if derived:
            self._refuse_derived(derived)
            for pid, p in derived.items():
                name = self._params[pid][0]
                for leaf in leaves_of(p):
                    if id(leaf) in self._params:
                        continue
                    known = name if leaf.shape == p.shape else f"{name} (a tensor it was made from)"
                    self._params[id(leaf)] = (known, leaf)
        self._numel = sum(p.numel() for _, p in self._params.values())
        handles = self._target_handles

        def hook(fn) -> Hook:
            made = Hook(fn)
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
        for entry in entry_modules(model, self._targets):
            pre, post = self._entry_hooks(entry)
            handles.append(
                entry.register_forward_pre_hook(hook(pre), with_kwargs=True, prepend=True)
            )
            handles.append(
                entry.register_forward_hook(hook(post), with_kwargs=True, always_call=True)
            )
        self._accumulators = []  # (held: a leaf's AccumulateGrad node lives while referred to)
        for pid, (name, p) in self._params.items():
            if pid not in self._sharded:  # (FSDP2 gives them no autograd gradient)
                handles.append(p.register_hook(self._param_hook(pid, name)))
                node = torch.autograd.graph.get_gradient_edge(p).node
                handles.append(node.register_prehook(self._accumulate_hook(pid, name)))
                self._accumulators.append(node)
        for pid, p in derived.items():
            handles.append(p.register_hook(self._derived_hook(pid, weakref.ref(p))))
        for target in self._targets:
            _HOOKED_MODULES[target.module] = self
        self._hooked = {id(t.module): frozenset(t.params) for t in self._targets}
        self._structure = structure_of(model, bool(self._sharded))

    def _follow_changes(self, model: nn.Module) -> None:
        """At each forward: where modules were added, swapped or removed, or parameters frozen
        or unfrozen since the hooks were planned, plan them again (a new layer gets ``grad1``
        too); after :meth:`clear`, a parameter that is no longer trainable loses its
        ``grad1``."""
        now = structure_of(model, bool(self._sharded))
        if now == self._structure:
            return
        if not self._sharded:  # parameters swapped (torch.utils.swap_tensors): hooks dropped
            impls = {pid: impl for _, pid, impl in self._structure[1]}
            for p in model.parameters():
                if impls.get(id(p), _torch.tensor_impl(p)) != _torch.tensor_impl(p):
                    _torch.drop_stale_hooks(p)
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
        self._targets = plan_targets(model, self.registry, self.unsupported, self._shards)
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

    def _refuse_derived(self, derived: dict[int, Tensor]) -> None:
        """Per-example gradients pass through a computation in a parameter's slot as
        ``grad1`` only: the other quantities are formed from the slot's pieces, which are
        not the gradients of the tensors it was computed from."""
        if self.quantities != ("grad1",) or self._sharded:
            name = self._params[next(iter(derived))][0]
            raise ValueError(
                f"'{name}' holds a tensor computed from other tensors (torch.func.functional_call "
                f"with weights such as p - lr * g), not a parameter: quantities "
                f"{self.quantities!r} of its pieces are not those of the tensors autograd gives "
                "its gradient. Use add_hooks(model, quantities=('grad1',)) and form them from "
                "grad1, or pass leaf tensors (p.detach().requires_grad_()) to functional_call."
            )

    def _derived_hook(self, pid: int, ref: weakref.ref):
        """When the backward has the whole gradient of a tensor computed from parameters that
        stands in a parameter's slot (:meth:`_install`), each example's share of it, its
        ``grad1`` of this backward, is taken back through the computation to the tensors it
        was computed from (one batched backward, ``is_grads_batched``): their ``grad1``.
        Fast weights ``p - lr * g`` with ``g`` detached give ``p`` the slot's own."""

        def hook(grad: Tensor | None) -> None:
            if grad is None or self._removed or self._ignore_backward or self._rerunning:
                return
            t = ref()
            bw = self._tasks.get(graph_task())
            if t is None or bw is None or not self._capturing_backward():
                return
            g1 = self._grad1_of_backward(bw, pid, t)
            if g1 is None:
                return
            leaves = [q for q in leaves_of(t) if id(q) in self._params]
            edge = torch.autograd.graph.get_gradient_edge(t)
            create_graph = torch.is_grad_enabled()
            with self._nested():
                try:
                    grads = torch.autograd.grad(
                        [edge], leaves, g1, retain_graph=True, allow_unused=True,
                        is_grads_batched=True, create_graph=create_graph,
                    )  # fmt: skip
                except RuntimeError:  # (an operation vmap cannot batch): one at a time

                    def one(b: int) -> tuple:
                        return torch.autograd.grad(
                            [edge], leaves, g1[b], retain_graph=True, allow_unused=True,
                            create_graph=create_graph,
                        )  # fmt: skip

                    grads = tuple(per_example(g1.shape[0], one, like=leaves))
            for q, g in zip(leaves, grads):
                if g is None:
                    continue
                qid = id(q)
                bw.reached.add(qid)
                if qid not in bw.before:
                    bw.before[qid] = q.grad1 if qid in self._written else None
                self._accumulate(self._params[qid][0], q, g)
                self._written[qid] = q

        return hook

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
        it, and a parameter it does not reach loses its ``grad1``, as after
        ``optimizer.zero_grad()`` (which is all an ordinary training loop needs). The current
        ``grad1`` tensors stay readable until then (those of a backward that failed half way
        are put back as they were before it)."""
        if graph_task() == -1:
            self._drop_stale()
        self._stale.update(self._written)
        self._written.clear()
        self._trail.clear()
        self._depth.clear()
        self._missed.clear()
        self._precision = None
        self._hessian_backprops.clear()
        if self._kept_backprops is not None:
            self._kept_backprops.clear()
        if self._collector is not None:
            self._collector.clear()

    def activations(self, module: nn.Module) -> Tensor | None:
        """autograd-hacks' ``module.activations``: the first positional input of the last call
        of ``module`` in the forward that the last captured backward reaching it went through,
        detached (``None`` where that input is not a tensor). Needs ``add_hooks(..., keep_backprops=True)``; see
        :mod:`gradhooks.engine.backprops`."""
        return self._backprops_of(module, "activations").activations(module)

    def backprops(self, module: nn.Module) -> list[Tensor | None]:
        """autograd-hacks' ``module.backprops_list``: the gradient of the loss with respect to
        ``module``'s (first) output, one per call of it that a captured backward reached since
        :meth:`clear`, in that order, detached (``None`` where none flowed). For a
        mean-reduced loss each holds the ``1/batch`` of the mean. Needs
        ``add_hooks(..., keep_backprops=True)``."""
        return self._backprops_of(module, "backprops").backprops(module)

    def _backprops_of(self, module: nn.Module, what: str) -> KeptBackprops:
        kept = self._kept_backprops
        if kept is None:
            raise RuntimeError(
                f"Hooks.{what}: this handle keeps no layer inputs or output-gradients; add the "
                "hooks with gradhooks.add_hooks(model, keep_backprops=True) (they then stay in "
                "memory until h.clear())"
            )
        if not any(t.module is module for t in self._targets):
            raise ValueError(
                f"Hooks.{what}: {type(module).__qualname__} is not a module this handle hooks "
                "(h.modules() lists them: modules with trainable parameters and a rule, or the "
                "fallback)"
            )
        if not kept.reached(module):
            name = next(t.name for t in self._targets if t.module is module)
            raise RuntimeError(
                f"Hooks.{what}: no captured backward reached '{name}' "
                f"({type(module).__qualname__}) since the hooks were added or h.clear(); run "
                "the forward and the backward first"
            )
        return kept

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
        ``grad1`` of the current accumulation (since the last ``zero_grad`` or :meth:`clear`;
        what autograd-hacks' ``compute_grad1`` ``loss_type`` says), and use it for later
        backwards."""
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

    @property
    def accumulated(self) -> int:
        """How many captured backwards ``grad1`` holds the sum of (the most over parameters;
        0 before any): 1 after each ``zero_grad()``, forward and backward, ``k`` after ``k``
        micro-batches without ``zero_grad`` (or a ``retain_graph`` backward run ``k`` times)."""
        return max((self._depth.get(pid, 1) for pid in self._written), default=0)

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
        :meth:`clear` (``"kfac"``); conventions in :mod:`gradhooks.workflows.kfac`. Over several
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
        self._accumulators = []
        model = self.model
        if model is not None and _ACTIVE.get(model) is self:
            del _ACTIVE[model]
        for t in self._targets:
            if _HOOKED_MODULES.get(t.module) is self:
                del _HOOKED_MODULES[t.module]
        self._written.clear()
        self._stale.clear()
        self._trail.clear()
        self._depth.clear()
        self._forward_of.clear()
        self._unheld.clear()
        if self._probe_box is not None:
            drop_box(self._probe_box)
            self._probe_box = None
        for frame in self._frames[::-1]:
            self._stop_tracker(frame)
        self._frames.clear()
        self._tasks.clear()
        for stack in self._detached.values():  # removed during a forward
            for _, _, owned, _, recording, undo in stack[::-1]:
                if undo is not None:
                    undo()
                if recording is not None:
                    recording[0].__exit__(None, None, None)
                if owned is not None:
                    torch.set_grad_enabled(True)
        self._detached.clear()
        self._aliases_checked.clear()
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
    keep_backprops: bool = False,
) -> Hooks:
    """Hook ``model`` so that every ``backward()`` writes ``param.grad1``.

    Args:
        model: any ``nn.Module``.
        loss_reduction: ``"mean"`` when the loss is the mean of per-example losses (the default
            of torch losses), ``"sum"`` when it is their sum. ``grad1[i]`` is the gradient of
            example ``i``'s own loss in both cases.
        unsupported: what to do with a module that has trainable parameters and no rule.
            ``"fallback"`` (default): compute its per-example gradients with ``torch.func``
            from the captured call (:mod:`gradhooks.rules.fallback`; slower than a rule, see
            :meth:`Hooks.fallback_modules`). ``"error"``: raise, before anything is hooked.
            ``"skip"``: leave its parameters without ``grad1``.
        registry: the rules to use (default: the built-in registry).
        quantities: what each backward computes, any of ``"grad1"`` (``param.grad1``),
            ``"norms"`` (:meth:`Hooks.norms`, :meth:`Hooks.param_norms`), ``"sum_grad_sq"``
            (:meth:`Hooks.sum_grad_sq`, :meth:`Hooks.grad_variance`) and ``"kfac"``
            (:meth:`Hooks.kfac_factors`). Without ``"grad1"`` no per-example gradient of the
            whole model is ever formed.
        batch_dim: where the examples are. ``"auto"`` (default): dimension 0 of the model's
            first tensor input (a ``PackedSequence``: its first batch size), and of every
            other tensor input of that size unless only that would make it mix the examples
            (a mask as long as the batch); an int ``k``: dimension ``k`` of the first tensor
            input (a sequence-first model: ``batch_dim=1``; also checks the memory limit at
            the forward). From there the batch is followed through the forward: a layer that
            sees the examples folded into its batch (``x.view(B * T, ...)``: each example's
            rows are summed) or on another dimension (moved) is right; a layer whose input
            was computed across the batch is an error naming the layer and the shapes.
            Sequences packed along one dimension without padding (a ``cu_seqlens``,
            ``cu_seq_lens_q/k`` or ``seq_idx`` input; ``position_ids`` that start again within
            a row, with no ``attention_mask``: ``DataCollatorWithFlattening``) are refused
            before the forward runs: give a padded batch. ``None``: nothing is followed, and ``grad1`` has a row per entry of each layer's
            dimension 0.
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
            The check runs backwards of autograd's own through the model's graph (two; three
            without ``"grad1"``), from its output-gradients weighted per example, in which a
            gradient hook put on an activation during the forward (``h.register_hook``) runs
            again, so that what it does to the examples' gradients is checked too (a hook that
            mixes them is refused): on a backward that verifies, such a hook runs three times
            (four without ``"grad1"``), on every other backward once. Backward hooks of the
            user's on modules (also global ones) and on parameters run once on every backward:
            where there are any, that part of the check is left out. ``verify=False``: every hook
            runs once per backward.
        keep_backprops: keep, per hooked module, the input of its last captured call and
            the output-gradient of each captured call, for :meth:`Hooks.activations` and
            :meth:`Hooks.backprops` (autograd-hacks' ``layer.activations`` and
            ``layer.backprops_list``), until :meth:`Hooks.clear`: the memory of those tensors.

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
        capture=capture, verify=verify, keep_backprops=keep_backprops,
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

"""Which modules of a model the hooks cover, with which rule, and what is refused before any
hook is added (TorchScript, complex parameters, lazy modules)."""

from __future__ import annotations

import functools
import inspect
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from .. import _torch
from ..errors import ConfigurationError, UnsupportedModuleError, describe_module
from ..rules.fallback import FALLBACK, fallback_params
from ..rules.registry import Registry, _Entry

Unsupported = Literal["fallback", "error", "skip"]


@dataclass
class Target:
    """One hooked module: its rule and the parameters the rule is responsible for."""

    name: str
    module: nn.Module
    entry: _Entry
    params: dict[str, nn.Parameter]
    memo: dict[str, Any] = field(default_factory=dict)  # the rule's, between calls

    @property
    def quoted(self) -> str:
        """The module's qualified name as the errors quote it (``'<model>'`` for the root); a
        parameter's use in a torch function is named by its quoted parameters already."""
        name = self.name or "<model>"
        return name if name.startswith("'") else f"'{name}'"

    @property
    def where(self) -> str:
        """The module as the errors name it: its qualified name and class."""
        return f"{self.quoted} ({type(self.module).__qualname__})"

    @functools.cached_property
    def modules(self) -> tuple[nn.Module, ...]:
        """``module.modules()``, walked once: a module added or removed below it changes the
        model's structure, for which the hooks are planned again (new targets)."""
        return tuple(self.module.modules())


def plan_targets(
    model: nn.Module, registry: Registry, unsupported: Unsupported,
    shards: dict[str, nn.Parameter] | None = None, again: bool = False,
) -> list[Target]:  # fmt: skip
    """Which modules to hook, checking that every trainable parameter is covered. ``shards``:
    the parameters sharded by FSDP2 by qualified name (:func:`fsdp_shards`), which the
    targets hold in place of what is in their slots now (a stand-in of FSDP2's). ``again``:
    planned again at a forward, the model changed since ``add_hooks`` (a refusal then says
    that the hooks stay as they were and the forward did not run)."""
    targets: list[Target] = []
    owned: list[str] = []
    uncovered: list[tuple[str, nn.Module, dict[str, nn.Parameter]]] = []
    covered: set[int] = set()
    made = parametrizations(model)
    for name, module in model.named_modules():
        if any(name.startswith(prefix) for prefix in owned) and not _under(name, made):
            continue
        entry = registry.lookup(module)
        recurse = entry is not None and entry.owns_children
        # Every slot, also one Parameter held in two slots of a module (bias = weight): each
        # slot's piece is added to it.
        own = dict(module.named_parameters(recurse=recurse, remove_duplicate=recurse))
        if recurse:
            # (a parametrization's originals are its own target's, the tensor it makes for the
            # owned layer's slot given their per-example gradients as any layer's weight is)
            prefix = f"{name}." if name else ""
            own = {n: p for n, p in own.items() if not _under(prefix + n, made)}
        if entry is None:
            trainable = {n: p for n, p in own.items() if p.requires_grad}
            if trainable and unsupported == "fallback":
                params = fallback_params(module)
                targets.append(Target(name, module, FALLBACK, params))
                covered.update(id(p) for p in params.values())
            elif trainable:
                uncovered.append((name, module, trainable))
            continue
        if entry.owns_children:
            owned.append(f"{name}." if name else "")
        if own:
            targets.append(Target(name, module, entry, own))
            covered.update(id(p) for p in own.values())
    if uncovered:
        lines = [
            f"'{name or '<model>'}' ({type(m).__qualname__}"
            + (", its forward replaced on the module" if "forward" in m.__dict__ else "")
            + f"): {', '.join(ps)}"
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
            raise UnsupportedModuleError(
                "gradhooks has no rule for these modules with trainable parameters:\n  "
                + "\n  ".join(lines)
                + why
                + "\nRegister one with @gradhooks.register(ModuleType) (see docs/extending.md), "
                "freeze those parameters, pass unsupported='fallback' (the default) to compute "
                "them with torch.func, or unsupported='skip' to leave them without grad1. "
                + (
                    "They were added or unfrozen since add_hooks: the hooks stay as they were, "
                    "and this forward did not run."
                    if again
                    else "Nothing was hooked."
                )
            )
    if shards:
        for t in targets:
            prefix = f"{t.name}." if t.name else ""
            t.params = {n: shards.get(prefix + n, p) for n, p in t.params.items()}
    return targets


def parametrizations(model: nn.Module) -> tuple[str, ...]:
    """The qualified names of the ``parametrizations`` containers of ``model``'s parametrized
    modules (``torch.nn.utils.parametrize``), each ending in a dot: ``"att.out_proj.parametrizations."``."""
    return tuple(
        f"{name}.parametrizations." if name else "parametrizations."
        for name, module in model.named_modules()
        if parametrize.is_parametrized(module)
    )


def _under(name: str, containers: tuple[str, ...]) -> bool:
    """Whether the module or parameter ``name`` is one of ``containers`` or inside it."""
    return any(f"{name}.".startswith(c) for c in containers)


_SIGNATURES: weakref.WeakKeyDictionary[type, inspect.Signature | None] = (
    weakref.WeakKeyDictionary()
)  # (a module class's forward signature, while the class exists)


def refuse_scripted(model: nn.Module, targets: list[Target]) -> None:
    """TorchScript modules take no hooks: refused before anything is hooked."""
    scripted = [t for t in targets if isinstance(t.module, torch.jit.ScriptModule)]
    if not scripted:
        return
    t = scripted[0]
    params = ", ".join(f"'{n}'" for n in t.params)
    raise UnsupportedModuleError(
        f"module '{t.name or '<model>'}' is a TorchScript module "
        f"({type(t.module).__qualname__}), which takes no forward or backward hooks, so "
        f"gradhooks cannot capture its calls for its trainable parameters ({params}). Hook the "
        "module before torch.jit.script, or freeze its parameters (requires_grad_(False))."
    )


def scripted_modules(model: nn.Module) -> dict[int, str]:
    """The TorchScript modules of ``model`` (frozen: :func:`refuse_scripted` refuses the
    others), by id, with their qualified names (``'<model>'`` for the model itself)."""
    return {
        id(m): n or "<model>"
        for n, m in model.named_modules()
        if isinstance(m, torch.jit.ScriptModule)
    }


def refuse_complex(model: nn.Module, quantities: tuple) -> None:
    """Norms, squared sums and curvature are formed for real parameters only."""
    formed = [q for q in quantities if q != "grad1"]
    found = [n for n, p in model.named_parameters() if p.requires_grad and p.is_complex()]
    if formed and found:
        raise ConfigurationError(
            f"'{found[0]}' is complex: quantities {tuple(formed)} are formed for real "
            "parameters only. Use quantities=('grad1',) and take what you need from grad1 "
            "(p.grad1.abs().pow(2) for the squares), or freeze the complex parameters."
        )


def refuse_lazy(model: nn.Module) -> None:
    """A lazy module's parameters take their shapes at its first forward: refused before."""
    lazy = [n for n, p in model.named_parameters() if isinstance(p, nn.UninitializedParameter)]
    if lazy:
        raise ConfigurationError(
            f"'{lazy[0]}' is not initialized yet (a lazy module, nn.LazyLinear and the like, "
            "takes its shapes at its first forward): run one forward of the model (under "
            "torch.no_grad()) before add_hooks."
        )


def refuse_parameterless(model: nn.Module) -> None:
    """A model without any parameter (``nn.ReLU()``, a model whose layers are registered
    later) has no gradient to take per example: hooking it would capture nothing, without a
    word. (A model whose parameters are all frozen is hooked: they may be unfrozen later.)"""
    if next(model.parameters(), None) is None:
        raise ConfigurationError(
            f"add_hooks: the model {describe_module(None, model)} has no parameters, so there "
            "is no per-example gradient to compute: hook the model whose parameters you train "
            "(add_hooks(model), not one of its parameter-free layers), after its layers are "
            "made."
        )


def entry_modules(model: nn.Module, targets: list[Target]) -> list[nn.Module]:
    """The modules of ``model`` other than itself that hold a hooked module or are one: each
    may be called on its own (:meth:`ForwardCapture.entry_hooks`)."""
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


def positional(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
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


def higher_order(module: str) -> str:
    return (
        f"{module}: this backward computes parameter gradients through a call through which "
        "an earlier backward was run with create_graph=True (torch.autograd.grad(..., "
        "create_graph=True): an input-gradient, a Laplacian, a gradient penalty, or grad1 "
        "itself). A loss built from such derivatives has per-example gradients with terms "
        "through the double backward that hooks do not see, so grad1 would be wrong (it was not "
        "written). A meta-learning step (MAML, ANIL) whose inner gradients are taken with "
        "create_graph=True: run that inner step (its forward and its torch.autograd.grad) under "
        "`with h.paused():`, and the outer backward's grad1 is each query example's gradient "
        "through the inner step. To differentiate grad1 or those derivatives on purpose, run "
        "this backward under `with h.paused():`; for per-example gradients of such a loss use "
        "torch.func "
        "(gradhooks.oracle.vmap_grad); if the derivatives are not part of this loss, compute "
        "them without create_graph=True (or detach them). A loss that holds none of them but "
        "runs through the same calls (GradNorm's weighted task losses, after the norms of "
        "their gradients were taken) is refused too, as the hooks cannot tell it apart: run "
        "its backward before the create_graph=True one (with retain_graph=True)."
    )


def structure_of(model: nn.Module, by_name: bool = False) -> tuple:
    """What the hooks were planned for: the modules, and which parameters are trainable (by
    name where FSDP2 shards them: it swaps a module's parameters for unsharded ones while it
    runs), each with the C++ tensor under it: ``torch.utils.swap_tensors`` (``model.to(...)``,
    ``.double()``, ``.float()`` under
    ``torch.__future__.set_swap_module_params_on_conversion(True)``) changes it under the same
    Python object and drops the gradient hooks the parameter had, which are then added
    again. (By default those conversions set ``p.data`` instead: the same tensor, followed by
    :func:`storages_of`.)"""
    return structure_and_parameters(model, by_name)[0]


def structure_and_parameters(model: nn.Module, by_name: bool = False) -> tuple[tuple, list]:
    """:func:`structure_of`, and the trainable parameters it lists, from one walk."""
    modules, params = modules_and_parameters(model)
    trainable = [p for _, p in params if p.requires_grad]
    return (modules, tuple(
        n if by_name else (n, id(p), _torch.tensor_impl(p)) for n, p in params if p.requires_grad
    )), trainable  # fmt: skip


def state_key(model: nn.Module) -> tuple | None:
    """Everything :func:`structure_and_parameters` and :func:`storages_of` read of ``model``,
    from one walk that builds no names: each module's id, class and ``forward`` set on itself,
    its backward hooks' ids (:class:`gradhooks.engine.module_hooks.BackwardHookGuards`),
    its parameters' slot names, ids, ``requires_grad``, C++ tensors and data, and its children's
    slot names and ids. Equal keys at two forwards mean that neither changed between them; the
    hooks compare it at every forward, and walk the model again by name only where it differs
    (a third of the time on a GPT-2 of 35 modules). ``None`` where a parameter has no data
    (the fake parameters of ``torch.export``'s tracing): then always walked by name."""
    key: list = []
    add = key.append
    seen = {id(model)}
    stack = [model]
    try:
        while stack:
            module = stack.pop()
            add(id(module))
            add(id(type(module)))
            add(id(module.__dict__.get("forward")))
            add(_torch.module_backward_hooks(module))
            params = _torch.own_parameters(module)
            add(len(params))
            for leaf, p in params.items():
                add(leaf)
                if p is not None:
                    add(id(p))
                    add(p.requires_grad)
                    add(_torch.tensor_impl(p))
                    add(p.data_ptr())
            children = _torch.own_children(module)
            add(len(children))
            for leaf, child in children.items():
                add(leaf)
                add(id(child))
                if child is not None and id(child) not in seen:
                    seen.add(id(child))
                    stack.append(child)
    except RuntimeError:
        return None
    return tuple(key)


def accumulator_of(p: Tensor) -> Any:
    """The ``AccumulateGrad`` node of the trainable leaf ``p``, where autograd adds its
    gradient into ``.grad``: ``torch.autograd.graph.get_gradient_edge(p).node``, found through
    one view of ``p`` where that function makes two (a view costs about 10 µs of host time,
    and the node of the first parameter is looked at every forward). Under
    ``torch.inference_mode()`` a view has no ``grad_fn``, so it is taken outside it (and with
    gradients on: where both already hold, as in a training forward, without the two context
    managers, which cost more than the view). ``None`` where autograd records nothing through
    ``p`` (a tensor left behind by a ``torch.func`` transform in place of a parameter)."""
    if torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
        fn = p.view_as(p).grad_fn
        return None if fn is None else fn.next_functions[0][0]
    with torch.inference_mode(False), torch.enable_grad():
        fn = p.view_as(p).grad_fn
    return None if fn is None else fn.next_functions[0][0]


def storages_of(params: list[Tensor]) -> list[int | None]:
    """Where each parameter's data is (``data_ptr``). Setting ``p.data`` to a tensor of another
    dtype or device (``model.double()``, ``.half()`` then ``.float()``, ``.to(device)``: what
    torch's conversions do by default, and Lightning's precision plugins) gives the parameter a
    new ``AccumulateGrad`` node without the hooks registered on the one before; such a change
    moves the data, and the hooks check the node of a parameter whose data moved. (``None``
    for all where one has no data: the fake parameters of ``torch.export``'s tracing.)"""
    try:
        return [p.data_ptr() for p in params]
    except RuntimeError:
        return [None] * len(params)


def modules_and_parameters(model: nn.Module) -> tuple[tuple[int, ...], list]:
    """One walk of ``model``: the ids of its modules as ``modules()`` gives them, each
    followed by the id of its class and by that of the ``forward`` set on the module itself
    (``module.forward = ...``) where there is one (a class swapped, ``module.__class__ = ...``,
    or a forward replaced changes what the module computes, and so its rule), and each
    parameter once, ``(name, parameter)``, as ``named_parameters()`` gives them (a parameter
    shared by several modules under its first name)."""
    modules, params, seen = [], [], set()
    for prefix, module in model.named_modules():
        modules.append(id(module))
        modules.append(id(module.__class__))  # (its class swapped: planned again)
        replaced = module.__dict__.get("forward")
        if replaced is not None:  # (a forward set on the module itself: planned again)
            modules.append(id(replaced))
        for leaf, p in _torch.own_parameters(module).items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            params.append((f"{prefix}.{leaf}" if prefix else leaf, p))
    return tuple(modules), params


def fsdp_shards(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters of ``model`` sharded by FSDP2 (DTensors), by qualified name, every slot.

    FSDP2 registers a module's sharded parameters only while its group is resharded: while a
    call runs its slots hold unsharded parameters, and the root's group (where the parameters
    of every module not sharded on its own live) stays unsharded from the forward to the
    backward, or after a forward under ``no_grad``. Its modules are resharded first
    (``FSDPModule.reshard``: local, it frees the gathered copies, which the next forward gathers
    again), so that the sharded parameters are those found. Where no module has imported
    distributed tensors, no parameter is one (and importing them costs about half a second)."""
    if "torch.distributed.tensor" not in sys.modules:
        return {}
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


def owner_name(name: str) -> tuple[str, str]:
    prefix, _, leaf = name.rpartition(".")
    return prefix, leaf


def frozen_model(model: nn.Module | None) -> str:
    """Where ``model`` has no trainable parameter, why no backward was captured (to add to a
    refusal that says none was); else ``""``."""
    if model is None or any(p.requires_grad for p in model.parameters()):
        return ""
    return (
        f" ({type(model).__qualname__} has no trainable parameter: requires_grad is False on "
        "every one, model.requires_grad_(False)?, so a backward reaches none of them and "
        "there is no per-example gradient to capture. Unfreeze the ones to train: "
        "layer.requires_grad_(True), before the forward)"
    )

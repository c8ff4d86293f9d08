"""The registry of layer rules: an explicit object keyed by module type.

A rule is a function ``rule(call) -> {param_name: Piece}``. ``call`` is a :class:`Call`: the
module, the inputs of one forward call (detached) and the gradients of the loss with respect to
that call's outputs. The returned pieces (:mod:`gradhooks.pieces`) say how each trainable
parameter's per-example gradient is formed; the engine does the rest (scaling, accumulation over
repeated calls and tied weights, every quantity).

Example, a layer that multiplies its input by a learned vector::

    class Scale(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(n))

        def forward(self, x):
            return x * self.scale

    @gradhooks.register(Scale)
    def scale_rule(call):
        (x,) = call.inputs                 # [batch, *, n]
        g = call.grad_output               # [batch, *, n]
        per_example = (x * g).reshape(x.shape[0], -1, x.shape[-1]).sum(1)
        return {"scale": gradhooks.Direct(per_example)}

Lookup: the module's exact type first; then its base classes, but only when the subclass does
not override ``forward`` (a subclass that computes something else must get its own rule, never
its parent's silently). A class of another library may be registered by name,
``"package.module.Class"``, without importing that library (Hugging Face's ``Conv1D``): the name
covers the class importable under it, and no other class that happens to share its name.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .. import _torch
from ..errors import (
    ConfigurationError,
    ConfigurationTypeError,
    RuleError,
    StateError,
    describe_module,
)
from ..pieces import Piece

__all__ = [
    "Call",
    "CallBatch",
    "Registry",
    "Rule",
    "REGISTRY",
    "register",
    "batch_first",
    "saved_tensor_hooks_active",
    "ModuleState",
]


class ModuleState:
    """The base of a rule's ``saved`` that is the state of the module its call ran with (its
    buffers: a batch norm's running statistics), not what the call's nodes saved: it holds in
    whatever layout the engine hands the call to its rule in (a call that does not depend on
    the examples, given their output-gradients), so the engine keeps it there too."""

    __slots__ = ()


def saved_tensor_hooks_active() -> bool:
    """Whether the tensors autograd saves for the backward go through saved-tensor hooks now
    (non-reentrant activation checkpointing, offloading to the CPU): a rule's ``saved``
    function that reads what a call's nodes saved returns ``None`` then, since reading it
    would run the forward again. (Where torch cannot tell, ``True``.)"""
    return _torch.saved_tensor_hooks_active()


@dataclass
class Call:
    """One forward call of a hooked module, seen from its backward.

    ``inputs``: the positional arguments of the forward, tensors detached.
    ``kwargs``: the keyword arguments of the forward, tensors detached.
    ``output``: the forward's output, tensors detached (a tensor or a tuple, as returned).
    ``grad_outputs``: one entry per tensor in the output (flattened in order), the gradient of
    the backpropagated loss with respect to it, or ``None`` where none flowed.
    ``taps``, ``tap_grads``: what the rule's ``taps`` function returned for this call (or
    ``None``) and, per node in ``taps.nodes``, the gradients with respect to its outputs.
    ``saved``: what the rule's ``saved`` function returned for this call (or ``None``).
    ``input_grads``: ``None``, or (a call run with grad mode off: the rule's entry has
    ``owns_backward``) an empty list the rule may fill with the gradients of the backpropagated
    loss with respect to the call's inputs: one per leaf of ``tree_flatten((inputs,
    kwargs))``, ``None`` where there is none. Left empty, autograd computes them.
    ``recorded``: for a call run with grad mode off whose rule's entry has ``owns_backward``
    given as a recording, what the recording gave at its forward; else ``None``.
    ``batch``: where the examples are in this call's tensors, as the engine followed them
    through the forward (a :class:`CallBatch`), or ``None`` where it did not. Rules whose
    layer reads its batch from a fixed dimension need not look: the engine hands them calls
    in that form. The ``torch.func`` fallback reads it.
    ``registry``: the rules the call's handle uses (``add_hooks(registry=...)``), for a rule
    that hands its module's parts to their own rules; ``None`` means the default registry.
    ``hooked``: the modules the call's handle hooks, by ``id``, each with the names of the
    parameters its rule computes (``None``: not known, the call is not a handle's).
    ``memo``: what the rule keeps from one call of this module to the next under the same
    handle (a cache; removing the hooks drops it).
    ``buffers``: for a call of a module without a rule whose forward changed its buffers in
    place (spectral_norm's power iteration in training mode), copies of the buffers as the call
    found them, ``{name: tensor}`` (``named_buffers(remove_duplicate=False)``); else ``None``.
    The fallback recomputes the call from copies of these, so that it reproduces the call and
    the module's own buffers change once, by its forward, as without hooks.
    ``buffers_left``: for the same calls, copies of the buffers as the call left them (else
    ``None``): the state of a module that initialises itself from its first batch (Glow's
    ActNorm sets its parameters and an ``initialized`` buffer, then computes its output with
    them), which the fallback recomputes the call from where the state it found does not
    reproduce the output.
    ``autocast``: the ``torch.autocast`` the forward ran under, ``((device, dtype), ...)`` for
    each device it was on for (empty: none), for a rule that recomputes the call as it ran.
    ``params``: the tensors the call ran with in the slots of the parameters the rule computes,
    by their names relative to the module (``None``: not known, a call built by hand): the
    module's own parameters, or the tensors ``torch.func.functional_call`` put in their place
    for that call alone (back on the module by the backward). A rule that reads a
    parameter's value reads :meth:`parameter`.
    ``versions``: the version counter of each tensor of ``params`` at the forward (``None``:
    not known): :meth:`parameter` refuses one changed in place since, as autograd refuses a
    saved tensor changed so. Under autocast with its cache on, the version autocast cast it
    at, at its first call in the autocast block (:class:`gradhooks.autocast.CastCache`): a
    step inside the block leaves the block's forwards running with the cast of before.
    ``modes``: the ``training`` flag of each of ``module.modules()`` at the forward, in that
    order (``None``: not known, a call built by hand). A loop may switch the model between
    ``train()`` and ``eval()`` after the forward and before the backward: a rule that asks
    whether the call ran in training mode reads :attr:`training`, and one that runs the
    module's forward again does so under :meth:`modes_at_forward`.
    """

    module: nn.Module
    inputs: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any
    grad_outputs: tuple[Tensor | None, ...]
    name: str = ""
    taps: Any = None
    tap_grads: tuple[tuple[Tensor | None, ...], ...] = ()
    saved: Any = None
    input_grads: list[Tensor | None] | None = None
    recorded: Any = None
    batch: CallBatch | None = None
    registry: Registry | None = None
    hooked: Mapping[int, frozenset[str]] | None = None
    memo: dict[str, Any] = field(default_factory=dict)
    buffers: Mapping[str, Tensor] | None = None
    buffers_left: Mapping[str, Tensor] | None = None
    autocast: tuple[tuple[str, torch.dtype], ...] = ()
    params: Mapping[str, Tensor] | None = None
    versions: Mapping[str, int] | None = None
    modes: tuple[bool, ...] | None = None

    @property
    def training(self) -> bool:
        """Whether the module was in training mode at the call's forward (where not known,
        whether it is now)."""
        return self.modes[0] if self.modes else self.module.training

    @contextmanager
    def modes_at_forward(self) -> Iterator[None]:
        """Within: every submodule of the module in the mode it had at the call's forward
        (:attr:`modes`), each set back on the way out; nothing changes where the modes are not
        known or the module's submodules are no longer those of the forward."""
        now = list(self.module.modules())
        if self.modes is None or len(now) != len(self.modes):
            yield
            return
        changed = [(m, m.training) for m, was in zip(now, self.modes) if m.training != was]
        for m, is_training in changed:
            m.training = not is_training
        try:
            yield
        finally:
            for m, is_training in changed:
                m.training = is_training

    def parameter(self, name: str) -> Tensor | None:
        """The tensor the call ran with for the module's parameter ``name`` (``"weight"``,
        ``"out_proj.weight"``): the one in ``params``, else the module's own now. Refused
        where it was changed in place since the forward (an optimizer's step, or an average of
        the weights, between two backwards of a retained graph): a rule that reads it would
        compute with values the call did not run with, where autograd, which may not have
        kept the parameter (a recurrent cell's weights at a first step), gives the gradient
        of the forward as it ran."""
        if self.params is not None and name in self.params:
            t = self.params[name]
            kept = None if self.versions is None else self.versions.get(name)
            if kept is not None and _torch.version(t) != kept:
                cached = (
                    " Under torch.autocast, this is also a step taken inside the autocast "
                    "block the forward ran in: autocast's cast cache kept the parameter's cast "
                    f"of version {kept}, and the forward ran with those values. Enter autocast "
                    "around each forward and its loss alone, as torch advises (the backward "
                    "and the optimizer's step outside), or pass cache_enabled=False."
                    if self.autocast
                    else ""
                )
                raise StateError(
                    "one of the variables needed for gradient computation has been modified "
                    f"by an inplace operation: parameter '{name}' of "
                    f"{describe_module(self.name, self.module)} of shape {tuple(t.shape)} is "
                    f"at version {_torch.version(t)}; expected version {kept} instead. Its "
                    "rule computes from the parameter's values at the call: change parameters "
                    "after the backward (optimizer.step() after loss.backward()), or take the "
                    f"graph's second backward before the step.{cached}"
                )
            return t
        owner, _, leaf = name.rpartition(".")
        module = self.module.get_submodule(owner) if owner else self.module
        return getattr(module, leaf)

    @property
    def grad_output(self) -> Tensor:
        """The gradient with respect to the first output tensor."""
        g = self.grad_outputs[0]
        if g is None:
            raise RuleError(
                f"{describe_module(self.name, self.module)}: no gradient reached its first "
                "output, and the rule reads call.grad_output; read call.grad_outputs[0] and "
                "handle None (an output the loss does not use)"
            )
        return g


@dataclass(frozen=True)
class CallBatch:
    """Where the examples are in one call's tensors.

    ``size``: the number of examples. ``inputs``: per leaf of ``tree_flatten((inputs,
    kwargs))``, its :class:`~gradhooks.tracking.layout.Layout` (``None``: the same for every example).
    ``outputs``: likewise per leaf of the output. ``shared``: the call does not depend on the
    examples (a position embedding looked up with ``arange``): its output is broadcast into the
    batch downstream, and ``grad_outputs`` hold each example's share, ``[size, *output.shape]``.
    ``params``: the names of the module's parameters (its own, or a submodule's it did not
    call) that operations of the call's own used. ``shares``: the output leaves of a call that
    is not ``shared`` which do not depend on the examples (a log-determinant of the
    parameters alone beside a batched output), whose ``grad_outputs`` hold each example's
    share, ``[size, *output.shape]``, as a shared call's do.
    """

    size: int
    inputs: tuple[Any, ...]
    outputs: tuple[Any, ...]
    shared: bool = False
    params: frozenset[str] = frozenset()
    shares: frozenset[int] = frozenset()


Rule = Callable[[Call], Mapping[str, Piece]]
# torch function name -> (module type whose rule captures it, its parameters' arguments)
_FUNCTIONS: dict[str, tuple[Any, dict[str, tuple[int, str]], tuple[int, str], Callable]] = {}
BatchDim = int | Callable[[nn.Module], int] | str


@dataclass
class _Entry:
    rule: Rule
    owns_children: bool
    needs_output: bool
    on_forward: Callable[[nn.Module, str], None] | None = None
    grad_from_grad1: Callable[[nn.Module, tuple], bool] | None = None
    taps: Callable[[nn.Module, tuple, dict, Any], Any] | None = None
    saved: Callable[[nn.Module, tuple, dict, Any], Any] | None = None
    owns_backward: bool | Callable[[nn.Module], AbstractContextManager] = False
    batch_dim: BatchDim = 0
    detach_without_grads: Callable[[nn.Module, tuple], bool] | None = None

    def batch_dim_of(self, module: nn.Module) -> int | str:
        """The dimension of the call's first input the rule reads the batch from, or
        ``"positions"``."""
        return self.batch_dim(module) if callable(self.batch_dim) else self.batch_dim


def _is_argument(p: Any) -> bool:
    """``(position, keyword)`` of a torch function's argument."""
    return (
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], int)
        and not isinstance(p[0], bool) and isinstance(p[1], str)
    )  # fmt: skip


@dataclass
class Registry:
    """Rules keyed by module type.

    ``owns_children``: the rule computes the gradients of the parameters of the module's
    submodules too (``nn.MultiheadAttention`` uses ``out_proj.weight`` without calling
    ``out_proj``); those submodules are then not hooked on their own.
    ``needs_output``: the rule reads ``call.output`` (otherwise it is not kept, to save memory).
    ``on_forward``: ``on_forward(module, qualname)`` runs at every captured forward of the
    module, before anything is kept; it raises when per-example gradients cannot exist for
    that call (``nn.BatchNorm2d`` in train mode), so the error points at the forward.
    ``grad_from_grad1``: ``grad_from_grad1(module, args) -> bool``, asked before a captured
    forward call while ``grad1`` is being computed. True: the call runs with the module's own
    parameters detached (the forward's tracker hands every torch function of the call a
    detached alias of each; nothing is swapped on the module, and autograd's in-place checks
    still see the parameters' versions), and their ``.grad`` is the sum of the call's
    ``grad1``, so that
    autograd does not compute the batch weight gradient a second time (worth it where many
    positions per example share the weight: the sum reads ``batch x parameters`` floats, the
    batch gradient costs ``2 x batch x positions x parameters`` flops). Only for a module that
    returns one tensor, calls no hooked submodule and hands its parameters to torch functions
    (one handed to an ``autograd.Function`` would keep autograd's batch gradient as well: the
    module's first call refuses it); its rule must give a piece for each of its own
    parameters. Not asked where another's forward pre-hook runs before gradhooks' (the old
    ``nn.utils.weight_norm`` makes the weight from its parameters there). With ``taps`` too (the rule runs after the call's output, when the
    backward reaches nodes inside the call), it is asked only while ``grad1`` is computed; the
    parameters are then attached to the call's first floating-point input instead of its
    output, and the output may be any tree of tensors.
    ``detach_without_grads`` (with ``grad_from_grad1``): ``detach_without_grads(module, args)
    -> bool``, asked in its place while the backward to come is expected to want no
    parameter gradient (the last one wanted none: the book-keeping DP step's): whether the
    call runs detached there. Such a backward then forms no batch gradient of the call's
    parameters at all, where autograd's would be thrown away; running a call detached costs
    the host a little, so a rule says yes where that product is large.
    ``owns_backward`` (with ``grad_from_grad1``): ``True``, or ``record(module)``, a context
    manager. Where ``grad_from_grad1`` says so, the call runs with grad mode off, so that
    autograd records nothing of it (no backward of the module's own is run), and the rule
    gives the gradients of its inputs (``call.input_grads``) with its pieces. The output may
    then be any tree of tensors; ``create_graph`` backwards run the forward again under
    autograd. A parameter changed in place between the forward and the backward is refused,
    as autograd refuses a saved tensor changed so. The rule computes in the parameters' dtype,
    also under autocast: the run-time check's reference of such a call is autograd's through
    it run again in that dtype, autocast off. Given ``record``, its context manager is
    entered around the call's forward (a ``TorchFunctionMode`` can keep what the forward
    computes on the way), and what its ``__enter__`` returned reaches the rule as
    ``call.recorded``. ``nn.LSTM`` keeps its lower layers' outputs this way.
    ``batch_dim``: where the layer reads its examples: the dimension of its first input (``0``,
    the default; a function of the module for a layer with ``batch_first``), or
    ``"positions"``: the layer maps every position of its input alike, so every dimension but
    its feature dimensions is a position and the engine may put the batch on dimension 0
    itself (``nn.Linear``, ``nn.Embedding``, ``nn.LayerNorm``). Where the examples are
    elsewhere in a call (folded into dimension 0 with windows or heads, on another dimension, or
    nowhere: a call on positions alone), the engine then moves them to dimension 0 or adds it;
    for other layers it sums the pieces of rows that belong to one example, or refuses.
    ``taps``: ``taps(module, args, kwargs, output)``, asked after a captured forward call: an
    object with ``nodes``, autograd nodes inside the call (found from ``output.grad_fn``)
    whose output-gradients the rule needs, or ``None``. The rule then runs when the backward
    has reached all of them (they come after the call's outputs), with ``call.taps`` and
    ``call.tap_grads``: gradients of intermediate results that the module does not return
    (the projections inside ``nn.MultiheadAttention``), so nothing has to be recomputed.
    With no ``nodes``, the rule runs as usual, with ``call.taps`` only.
    ``saved``: ``saved(module, args, kwargs, output)``, asked after a captured forward call:
    what the call's own autograd nodes saved for their backward that the rule would otherwise
    recompute (a LayerNorm's mean and 1/std), or the state of the module the call ran with (a
    batch norm's running statistics, which ``torch.func.functional_call`` may have replaced
    for the call), or ``None``; the rule reads it as ``call.saved``. Dropped where the rule
    gets the call in another layout than it ran in, unless it is a :class:`ModuleState` (the
    module's state, which holds in any layout). Asked under saved-tensor hooks too, where
    reading what a node saved would run the forward again: a function that reads nodes
    returns ``None`` where :func:`saved_tensor_hooks_active`.
    """

    _rules: dict[type, _Entry] = field(default_factory=dict)
    # rules registered by the name of a class, "package.module.Class" (its __module__ and
    # __qualname__), for a class of a library gradhooks does not import
    _names: dict[str, _Entry] = field(default_factory=dict)

    def register(
        self,
        *types: type[nn.Module] | str,
        overwrite: bool = False,
        owns_children: bool = False,
        needs_output: bool = False,
        on_forward: Callable[[nn.Module, str], None] | None = None,
        grad_from_grad1: Callable[[nn.Module, tuple], bool] | None = None,
        taps: Callable[[nn.Module, tuple, dict, Any], Any] | None = None,
        saved: Callable[[nn.Module, tuple, dict, Any], Any] | None = None,
        owns_backward: bool | Callable[[nn.Module], AbstractContextManager] = False,
        batch_dim: BatchDim = 0,
        detach_without_grads: Callable[[nn.Module, tuple], bool] | None = None,
    ) -> Callable[[Rule], Rule]:
        """Decorator: use the function as the rule for ``types``.

        The rule is ``rule(call: Call) -> {param_name: Piece}``, one piece per trainable
        parameter of the module (``None`` for one the call did not use), in the canonical
        layout of :mod:`gradhooks.pieces`. A second rule for a type is refused unless
        ``overwrite=True``; a subclass inherits its parent's rule only when it does not
        override ``forward``. A type may be given by its name, ``"package.module.Class"``
        (``__module__`` and ``__qualname__``), for a class of a library that need not be
        imported (``"transformers.pytorch_utils.Conv1D"``): the rule then covers the class
        found under that name once its module is imported, never another class of the same
        name.

        Options, what the rule needs of a call:

        - ``batch_dim``: where the layer reads its examples: ``0`` (default), a function of
          the module (:func:`batch_first` for a layer with a ``batch_first`` flag), or
          ``"positions"`` for a layer that treats every position alike (Linear, Embedding,
          LayerNorm: the engine hands it calls with the examples folded, elsewhere or absent
          moved to, or put on, dimension 0). ``call.batch`` tells the rule where they are.
        - ``owns_children``: the rule also computes its submodules' parameters
          (``nn.MultiheadAttention`` uses ``out_proj.weight`` without calling ``out_proj``).
        - ``needs_output``: the rule receives ``call.output``.
        - ``on_forward``: ``check(module, name)``, called at each forward call; raise there to
          refuse the call (BatchNorm in train mode does).
        - ``saved``: ``read(module, args, kwargs, output)`` returns what the call's own nodes
          saved for their backward (a norm's mean and 1/std) or the module's state it ran
          with (a batch norm's running statistics), read in ``call.saved`` (a ``read`` of
          nodes returns ``None`` where saved-tensor hooks are on).
        - ``taps``: ``find(module, args, kwargs, output)`` returns an object whose ``nodes``
          are autograd nodes inside the call; the rule runs once the backward has reached
          them and reads their output-gradients in ``call.tap_grads``.

        Speed-ups over autograd, each keeping autograd's own checks:

        - ``grad_from_grad1``: ``predicate(module, args)``; where true, the call runs with its
          parameters detached and their ``.grad`` is the sum of the call's ``grad1`` (or a
          by-product of the norms), so that autograd does not also form the batch gradient.
        - ``detach_without_grads`` (with ``grad_from_grad1``): ``predicate(module, args)``,
          asked instead while the backward to come is expected to want no parameter gradient
          (after a book-keeping DP step): where true, the call runs detached, and that
          backward forms no batch gradient of its parameters, which autograd would throw away.
        - ``owns_backward`` (with ``grad_from_grad1``): ``True``, or ``record(module)``, a
          context manager entered around the call's forward (what its ``__enter__`` returns
          reaches the rule as ``call.recorded``). The call runs with grad mode off and the
          rule owns its whole backward: besides its pieces it fills ``call.input_grads``.

        Example::

            @gradhooks.register(MyLinear)
            def my_linear(call):
                x, g = call.inputs[0], call.grad_outputs[0]  # [batch, in], [batch, out]
                return {"weight": gradhooks.Outer(x[:, None], g[:, None])}
        """
        if not (callable(batch_dim) or batch_dim == "positions" or
                (isinstance(batch_dim, int) and batch_dim >= 0)):  # fmt: skip
            raise ConfigurationTypeError(
                f"register(batch_dim=...) takes an int >= 0, a function of the module or "
                f"'positions', got {batch_dim!r}"
            )
        if not types:
            raise ConfigurationTypeError("register() needs at least one module type")
        for name, fn in (("on_forward", on_forward), ("grad_from_grad1", grad_from_grad1),
                         ("taps", taps), ("saved", saved),
                         ("detach_without_grads", detach_without_grads)):  # fmt: skip
            if fn is not None and not callable(fn):  # (else a TypeError in the first forward)
                raise ConfigurationTypeError(
                    f"register({name}=...) takes a function or None, got "
                    f"{type(fn).__qualname__} {fn!r}"
                )
        flags = (("overwrite", overwrite), ("owns_children", owns_children),
                 ("needs_output", needs_output))  # fmt: skip
        for name, flag in flags:
            if not isinstance(flag, bool):  # (a string taken by its truth)
                raise ConfigurationTypeError(
                    f"register({name}=...) takes True or False, got {type(flag).__qualname__} "
                    f"{flag!r}"
                )
        if detach_without_grads is not None and grad_from_grad1 is None:
            raise ConfigurationTypeError(
                "register(detach_without_grads=...) needs grad_from_grad1: the rule's pieces "
                "then give the parameters' .grad where a backward wants it after all"
            )
        if owns_backward is not False and grad_from_grad1 is None:
            raise ConfigurationTypeError(
                "register(owns_backward=...) needs grad_from_grad1: it says which calls run "
                "with grad mode off"
            )
        if not (isinstance(owns_backward, bool) or callable(owns_backward)):
            raise ConfigurationTypeError(
                "register(owns_backward=...) takes True or a function of the module giving a "
                f"context manager, got {owns_backward!r}"
            )

        def decorate(rule: Rule) -> Rule:
            if not callable(rule):
                raise ConfigurationTypeError(
                    f"register(...) decorates a rule, a function rule(call) -> {{name: Piece}}, "
                    f"got {type(rule).__qualname__} {rule!r}"
                )
            _check_signature(rule)
            for t in types:
                if isinstance(t, str):
                    if not _is_class_name(t):
                        raise ConfigurationTypeError(
                            f"register() takes a class by its name as 'package.module.Class' "
                            f"(its __module__ and __qualname__), got {t!r}"
                        )
                elif not (isinstance(t, type) and issubclass(t, nn.Module)):
                    raise ConfigurationTypeError(
                        f"register() takes nn.Module subclasses or their names, got {t!r}"
                    )
                table = self._names if isinstance(t, str) else self._rules
                if t in table and not overwrite:
                    old = table[t].rule
                    shown = t if isinstance(t, str) else t.__qualname__
                    raise ConfigurationError(
                        f"a rule for {shown} is already registered "
                        f"({old.__module__}.{old.__qualname__}); pass overwrite=True to replace it"
                    )
            for t in types:
                table = self._names if isinstance(t, str) else self._rules
                table[t] = _Entry(
                    rule, owns_children, needs_output, on_forward=on_forward,
                    grad_from_grad1=grad_from_grad1, taps=taps, saved=saved,
                    owns_backward=owns_backward, batch_dim=batch_dim,
                    detach_without_grads=detach_without_grads,
                )  # fmt: skip
            return rule

        return decorate

    def unregister(self, t: type[nn.Module] | str) -> None:
        """Remove the rule registered for ``t`` (a type, or a name as registered)."""
        table = self._names if isinstance(t, str) else self._rules
        if t not in table:
            shown = t if isinstance(t, str) else getattr(t, "__qualname__", repr(t))
            raise ConfigurationError(
                f"unregister: no rule is registered for {shown} in this registry (a subclass "
                "uses its parent's rule without one of its own: registry.lookup(module) finds "
                "it; types() and names() list what is registered)"
            )
        del table[t]

    def register_function(
        self,
        name: str,
        rule: Rule,
        params: dict[str, tuple[int, str]],
        input: tuple[int, str] = (0, "input"),
        applies: Callable[[tuple, dict], bool] = lambda args, kwargs: True,
    ) -> None:
        """Capture a call of the torch function ``name`` with ``rule`` where a parameter is
        passed to it directly, outside its module's call (``F.linear(h, self.wte.weight)``, a
        tied output layer; ``torch.addmm(self.bias, x, self.weight)`` in a layer without a
        rule, written as Hugging Face's ``Conv1D`` is): ``params`` maps the rule's parameter
        names to the function's arguments ``(position, keyword)``, ``input`` is the argument
        the rule receives as ``call.inputs[0]``, and ``applies(args, kwargs)`` may refuse a
        form the rule does not cover. The rule is position-wise (``batch_dim="positions"``).
        Shared by every registry: what is refused leaves the rule already there."""
        where = f"register_function({name!r})"
        if not isinstance(name, str):
            raise ConfigurationTypeError(
                f"register_function: name is the torch function's name ('linear', 'addmm'), "
                f"got {type(name).__qualname__}"
            )
        for what, fn in (("rule", rule), ("applies", applies)):
            if not callable(fn):  # (else every later call of the function fails in the hook)
                raise ConfigurationTypeError(
                    f"{where}: {what} must be a function, got {type(fn).__qualname__}"
                )
        pairs = list(params.values()) if isinstance(params, Mapping) else None
        if pairs is None or not all(_is_argument(p) for p in [*pairs, input]):
            raise ConfigurationTypeError(
                f"{where}: params maps each of the rule's parameter names to the function's "
                "argument (position, keyword), as {'weight': (1, 'weight')}, and input is one "
                f"such pair; got params={params!r}, input={input!r}"
            )
        entry = _Entry(rule, False, False, batch_dim="positions")
        _FUNCTIONS[name] = (entry, dict(params), input, applies)

    def function(self, name: str):
        """``(entry, params, input, applies)`` for the torch function ``name``, or ``None``."""
        return _FUNCTIONS.get(name)

    def lookup(self, module: nn.Module) -> _Entry | None:
        """The entry for this module, or ``None`` when no rule covers it: its class's, else
        the nearest base class's where the class does not override ``forward``; a class
        registered by name counts where it is the class importable under that name. A module
        whose ``forward`` was replaced on the module itself (``module.forward = ...``, a
        patch of Liger-Kernel's or a user's) computes what that function does: no rule of
        its class covers it."""
        if not isinstance(module, nn.Module):
            what = f"{type(module).__qualname__} {module!r}"
            if isinstance(module, type):
                what = f"the class {module.__qualname__}"
            raise ConfigurationTypeError(
                f"lookup takes a module instance (torch.nn.Linear(3, 2)), got {what}: for a "
                "class, `cls in registry` says whether it has a rule of its own"
            )
        if "forward" in module.__dict__:
            return None
        cls = type(module)
        entry = self._rules.get(cls)
        if entry is not None:
            return entry
        for base in cls.__mro__:
            entry = self._rules.get(base) if base is not cls else None
            if entry is None and self._names:
                entry = self._named(base)
            if entry is not None:
                return entry if base is cls or cls.forward is base.forward else None
        return None

    def _named(self, cls: type) -> _Entry | None:
        """The entry registered under ``cls``'s name, where ``cls`` is the class that name
        finds (not another class given the same ``__module__`` and ``__qualname__``)."""
        entry = self._names.get(f"{cls.__module__}.{cls.__qualname__}")
        if entry is None:
            return None
        found: Any = sys.modules.get(cls.__module__)  # (imports nothing)
        for part in cls.__qualname__.split("."):
            found = getattr(found, part, None)
        return entry if found is cls else None

    def __contains__(self, t: type | str) -> bool:
        return t in (self._names if isinstance(t, str) else self._rules)

    def types(self) -> list[type]:
        """The module types registered as types (see :meth:`names` for those by name)."""
        return list(self._rules)

    def names(self) -> list[str]:
        """The module types registered by name, ``"package.module.Class"``."""
        return list(self._names)

    def __repr__(self) -> str:
        # Short: the default registry shows in add_hooks' signature (help(add_hooks)).
        n = len(self._rules) + len(self._names)
        return f"{type(self).__name__}(rules for {n} module types)"


REGISTRY = Registry()


def _check_signature(rule: Rule) -> None:
    """Refuse a rule that cannot be called as ``rule(call)`` (else its first backward fails)."""
    try:
        signature = inspect.signature(rule)
    except (TypeError, ValueError):  # (a builtin without one: called as it is)
        return
    try:
        signature.bind(None)
    except TypeError:
        name = getattr(rule, "__qualname__", type(rule).__qualname__)
        raise ConfigurationTypeError(
            f"register(...) decorates a rule called as rule(call), with the layer's Call (its "
            f"module, inputs and output-gradients), but {name} takes {signature}"
        ) from None


def _is_class_name(name: str) -> bool:
    """``"package.module.Class"``: dotted identifiers, at least a module and a class."""
    parts = name.split(".")
    return len(parts) >= 2 and all(part.isidentifier() for part in parts)


def batch_first(module: nn.Module) -> int:
    """The ``batch_dim`` of a layer with a ``batch_first`` flag (``nn.LSTM``,
    ``nn.MultiheadAttention``): 0 where it is set, else 1."""
    return 0 if module.batch_first else 1


def register(
    *types: type[nn.Module] | str,
    overwrite: bool = False,
    owns_children: bool = False,
    needs_output: bool = False,
    on_forward: Callable[[nn.Module, str], None] | None = None,
    grad_from_grad1: Callable[[nn.Module, tuple], bool] | None = None,
    taps: Callable[[nn.Module, tuple, dict, Any], Any] | None = None,
    saved: Callable[[nn.Module, tuple, dict, Any], Any] | None = None,
    owns_backward: bool | Callable[[nn.Module], AbstractContextManager] = False,
    batch_dim: BatchDim = 0,
    detach_without_grads: Callable[[nn.Module, tuple], bool] | None = None,
) -> Callable[[Rule], Rule]:
    return REGISTRY.register(
        *types,
        overwrite=overwrite,
        owns_children=owns_children,
        needs_output=needs_output,
        on_forward=on_forward,
        grad_from_grad1=grad_from_grad1,
        taps=taps,
        saved=saved,
        owns_backward=owns_backward,
        batch_dim=batch_dim,
        detach_without_grads=detach_without_grads,
    )


register.__doc__ = (  # (the options are Registry.register's: one text for both)
    "Register a rule in :data:`REGISTRY`, the default registry: ``@register(MyLayer)``.\n\n"
    + inspect.cleandoc(Registry.register.__doc__).split("\n", 1)[1].lstrip("\n")
)

"""Every undocumented torch internal gradhooks uses, reached through this module only.

gradhooks avoids torch's private names; where no public API serves, the internal is looked up
here once, at import, guarded, and used through one small function below. Where it is missing
(a later torch renamed it) or switched off (:func:`disabled`, for the tests), that function
gives its fallback: a slower path with the same numbers, never a wrong one. Where no such path
exists the internal is *required*: :func:`require`, which :func:`gradhooks.add_hooks` calls,
refuses with a clear error naming it. ``tests/test_torch_internals.py`` checks every fallback
against the internal, and that no private torch name is used outside this module.

Each internal, its name here, where it is used, and its fallback:

- ``functorch_stack``: ``torch._C._functorch.peek_interpreter_stack`` (:func:`in_transform`),
  whether this runs inside a ``torch.func`` transform. The engine does not capture calls
  there (the oracles, the fallback rule, a user's ``vmap``); pieces, LayerNorm's rule and the
  RNN rule write out of place there. Fallback: inside one of gradhooks' own transforms
  (:func:`own_transform`), or a tensor of the call is a functorch tensor
  (``torch.func.debug_unwrap``).
- ``functorch_batched``: ``torch._C._functorch.is_batchedtensor``, ``get_unwrapped``,
  ``maybe_get_bdim`` (:func:`unbatched`, :func:`batched_on`), the physical tensor of a
  ``vmap``-batched one.
  :func:`gradhooks.jacobians` and :func:`gradhooks.kfac` run their backwards under ``vmap``
  over the output-gradients and write the hooks' batched pieces into plain tensors
  (``quantities``, ``kfac``; the Jacobian forms of ``pieces.Rows`` and ``rules/conv.py``).
  With ``is_legacy_batchedtensor`` (:func:`is_grads_batched`), the engine tells a user's
  ``is_grads_batched`` backward, whose gradients are batched by the older ``vmap``, and
  writes no ``grad1`` from it (``backward.py``, ``verify.py``).
  The tracker reads from them which dimension a ``vmap`` run in the forward is over.
  Fallback: one backward per output-gradient, no ``vmap``; a user's batched backward reaches
  the rules, whose pieces then fail with an error; a ``vmap`` in the forward given the
  examples is taken as one over another dimension (a backward through it refused).
- ``saved_tensor_hooks``: ``torch._C._autograd._top_saved_tensors_default_hooks``
  (:func:`saved_tensor_hooks_active`): whether saved-tensor hooks (non-reentrant activation
  checkpointing, offloading) are on. Used by the engine (no ``taps`` then, and no call run
  detached: ``capture.py``) and the tracker (no expanded elementwise meetings then). Fallback:
  "on" (the rules recompute what they would have read, every call runs as autograd does, the
  meetings are differentiated example by example).
- ``mutation_on_saved``: ``torch.autograd.graph._allow_mutation_on_saved_tensors_enabled``
  (:func:`mutation_on_saved_allowed`): whether ``allow_mutation_on_saved_tensors()`` is on, under
  which autograd keeps a copy of a saved tensor changed in place after the forward; the engine
  then keeps copies of what each call keeps for its rule (``forward.py``). Fallback: "off" (a
  tensor changed in place after the forward is refused, as outside the context).
- ``use_counts``: ``Tensor._use_count``, ``torch._C._storage_Use_Count``, ``Tensor._base``
  (:func:`unshared`): that nothing but one tensor object holds its memory, the test autograd
  makes before reusing ``.grad``; the engine then writes the next ``grad1`` into the old one.
  Fallback: never reuse (a fresh ``grad1`` every backward).
- ``autograd_saved``: an autograd node's ``_saved_<name>`` fields (:func:`saved`), the
  tensors torch saved for its backward: LayerNorm / GroupNorm's mean and ``rstd``
  (``rules/norm.py``), a self-attention's projections and context (``rules/attention.py``);
  the factor of a DP step's losses' last product, which ``workflows/dp.py`` refuses where a
  GradScaler holds it (losses already scaled). Fallback: ``None``; the rules recompute them,
  and scaled losses are not told from others.
- ``fused_lstm``: ``torch._VF.lstm`` (:func:`fused_lstm`), the fused multi-layer LSTM that
  ``nn.LSTM.forward`` calls: ``rules/rnn.py`` recognizes it to keep each layer's outputs and
  runs it one layer at a time for the states. Fallback: the states are computed by the rule's
  own recurrence, step by step.
- ``python_dispatcher``: ``torch._dispatch.python.enable_python_dispatcher``
  (:func:`python_dispatcher`), which lets ``vmap`` run torch's decompositions of the RNN ops
  it has no batching rule for, in :func:`gradhooks.oracle.vmap_grad`. Fallback: a model with
  an RNN gets :func:`gradhooks.oracle.loop_grad`'s per-example loop instead.
- ``conv_padding``: a convolution's ``_reversed_padding_repeated_twice`` (:func:`conv_padding`),
  the ``F.pad`` padding its forward applies (``rules/conv.py``). Fallback: the same computed
  from its public ``padding``, ``kernel_size`` and ``dilation``, as torch's constructor does.
- ``is_view``: ``Tensor._is_view`` (:func:`is_view`): the engine gives a hooked output that is
  a view a node of its own, so that an in-place change after it keeps its hooks. Fallback:
  every output gets one.
- ``view_base``: ``Tensor._base`` (:func:`view_base`), the tensor whose memory a view shares:
  where two forwards of one backward read different examples of one tensor (``x.chunk(2)``),
  the engine refuses (``engine/calls.py`` ``rows_in_memory``). Fallback: the view's own
  strides, which cannot tell a chunk of the batch from a step along a dimension before it: an
  RNN cell stepped over a sequence-first tensor (``x[t]``) is refused too.
- ``engine_executes``: ``torch._C._will_engine_execute_node`` (:func:`adds_to_grad`), whether
  the running backward adds a parameter's gradient into ``.grad`` (runs its ``AccumulateGrad``
  node: a ``backward()``) or returns it (``torch.autograd.grad``, for whose inputs it raises,
  naming ``autograd.grad``), known before that node runs:
  a ``torch.autograd.grad`` backward of another forward starts ``grad1`` afresh even right
  after a ``backward()`` that added to ``.grad`` (``backward.py``). Fallback: it adds to the
  ``grad1`` that backward left. Also :func:`all_grads_hook`, torch's
  ``register_multi_grad_hook(mode="all")`` counting the backward's root among the tensors
  whose gradients it waits for (torch's does not, and never fires where a call's outputs are
  hooked together and one of them is the root: ``out.backward(v)`` on an RNN's or an
  attention's output, the Jacobians' backwards). Fallback: torch's own. And
  :func:`late_hook`, which tells whether the node that computed a layer's output will run
  (the nodes after it will), or the backward stops at the output (an ``autograd.grad``
  input): there the hook on the output takes its gradient. Fallback: a hook on the output
  alone, before the hooks put on it after the layer's call (a mask they apply is missed).
- ``autograd_node``: ``torch._C._current_autograd_node`` (:func:`enclosing_backward`),
  whether a backward ends inside another (taken in a custom ``autograd.Function``'s backward
  or a gradient hook: an adjoint ODE solver, implicit differentiation), where the backward's
  parameter gradients go back to the code that asked for them (``backward.py``). Fallback: a
  backward inside another is seen only where the other reached a hooked call first.
- ``mode_stack``: ``torch._C._len_torch_function_stack``, ``_get_function_stack_at``,
  ``_pop_torch_function_stack``, ``_push_on_torch_function_stack`` (:func:`pop_mode`,
  :func:`push_mode`): the engine takes the forward's batch tracker (a ``TorchFunctionMode``)
  off torch's mode stack while its own hooks work (``engine/records.py`` ``OwnWork``), so
  that their ``.dim()``, ``.detach()`` and rules' checks cost no trip through torch's
  override machinery. Fallback: the tracker stays on and passes them on unseen
  (:meth:`gradhooks.tracking.Tracker.paused`).
- ``eval_frame``: ``torch._C._dynamo.eval_frame.get_eval_frame_callback`` and
  ``set_eval_frame`` (:func:`leave_compiled`), the frame evaluation ``torch.compile`` sets for
  the code it runs: the first hook of a hooked model that code reaches turns it off for the rest
  of that compiled call (``engine/compiled.py``), so that the forward runs eagerly, every torch
  function seen by the tracker, with no graph break at each; ``torch.compile``'s own wrapper
  puts it back when the call returns. No public API turns compilation off from inside a
  compiled call (``torch.compiler.disable`` does so only within the function it wraps).
  Fallback: the hooks run through ``torch.compiler.disable`` and dynamo traces the forward
  between them, a graph break at nearly every torch function the tracker sees (slower than
  eager, the same numbers).
- ``foreach``: ``torch._foreach_div_``, ``_foreach_div`` (:func:`foreach_div_`,
  :func:`foreach_div`), the per-tensor-list arithmetic torch's optimizers use for their
  ``foreach`` implementations: the DP step divides its noised sums by the batch in one call per
  step instead of one per parameter (``workflows/dp.py``). Fallback: a loop over the tensors, the same numbers (on CPU
  they run the same per-tensor kernels).
- ``fp32_precision``: ``torch._C._get_fp32_precision_getter`` (:func:`fp32_precisions`), the
  ``fp32_precision`` settings of ``torch.backends`` (the generic one, oneDNN's, and its
  matmul's, conv's and rnn's) read straight from torch's C++ side: the engine reads them at
  every forward (``records.py`` ``float32_products``), where the public attributes pass through
  several Python descriptors each (about five times the cost). Fallback: those attributes.

Required (no fallback; :func:`require` refuses without them):

- ``graph_task_id``: ``torch._C._current_graph_task_id`` (:func:`graph_task_id`), which
  backward runs now (``records.py``, ``tracking/sources.py``): a backward inside another (reentrant
  checkpointing) or a failed one is told apart by it.
- ``keep_graph``: ``torch._C._autograd._get_current_graph_task_keep_graph``
  (:func:`backward_keeps_graph`), whether the running backward keeps its graph
  (``retain_graph=True``, ``create_graph=True``). After one that does not, autograd has freed
  what its nodes saved, and the engine lets go of what its calls kept for it at the next
  forward (``backward.py``, ``capture.py``, ``forward.py``): a loss kept until the next step's
  forward no longer keeps the step's inputs alive. Fallback: every backward is taken as keeping
  its graph, and a call's inputs live as long as the graph does.
- ``backward_callback``: ``torch.autograd.Variable._execution_engine.queue_callback``
  (:func:`queue_backward_callback`), a function run when the running backward ends: where the
  engine verifies and reduces what it captured (``backward.py``, ``verify.py``,
  ``quantities/collector.py``); a backward that fails lets go of it unrun, which tells the
  engine to take back the ``grad1`` the backward wrote (``backward.py``; without it, the next
  forward does).
- ``version_counter``: ``Tensor._version`` (:func:`version`), the version counter autograd's
  in-place checks use (documented in autograd's notes; ``torch.autograd.graph.increment_version``
  bumps it), read under its private name: the engine refuses an input changed in place after
  the forward (``forward.py``, ``calls.py``, ``tracking/sources.py``), ``pieces.Rows`` knows where its
  ``grad1`` is zero.
- ``module_state``: ``nn.Module._parameters``, ``_modules``, ``_forward_hooks``, ``_forward_pre_hooks`` and
  ``torch.nn.modules.module._global_forward_hooks`` / ``_global_forward_pre_hooks``
  (:func:`own_parameters`, :func:`own_children`, :func:`first_forward_hook`,
  :func:`put_forward_hook_first`, :func:`put_forward_pre_hooks_last`,
  :func:`last_forward_pre_hook`,
  :func:`forward_pre_hooks`,
  :func:`global_forward_hooks`, :func:`first_global_forward_hook`, :func:`forward_hooks_off`),
  and the backward hooks of
  modules, of every module and of tensors (:func:`user_backward_hooks`,
  :func:`module_backward_hooks`): the engine checks
  that its hooks run where it needs them (``capture.py``), runs no backward of its own
  checks through a user's backward hooks (``verify.py``, ``dp.py``) but puts its own around a
  module's (``module_hooks.py``), the oracle puts back
  parameters
  that ``torch.func.functional_call`` may leave replaced (``oracle.py``); the fallback runs a module again without its
  forward hooks (``fallback.py``: a hook that calls ``output.requires_grad_()``, as Hugging Face's
  ``enable_input_require_grads`` adds, fails under ``torch.func``), and without the forward
  hooks and pre-hooks of the modules inside it and the global ones
  (:func:`forward_hooks_off_within`: a user's hooks fire as often as without gradhooks), and
  without its own backward hooks (:func:`backward_hooks_off`). The DP step refuses an
  optimizer fused into the backward (:func:`accumulate_hooks`; :func:`backward_optimizers`,
  the optimizers ``torch.distributed.optim._apply_optimizer_in_backward`` keeps on a
  parameter as ``_in_backward_optimizers``, an attribute read with a default: where a later
  torch drops it, such an optimizer is not seen, as before).
- ``tensor_impl``: ``Tensor._cdata`` and ``Tensor._backward_hooks`` (:func:`tensor_impl`,
  :func:`drop_stale_hooks`): ``torch.utils.swap_tensors`` puts another C++ tensor under the
  same Python object (``model.to(...)``, ``.double()``, even ``.float()`` of a float model, do so
  under ``torch.__future__.set_swap_module_params_on_conversion(True)``), and the gradient
  hooks registered on the tensor stay behind with the old one: its dict of hooks moves with the
  Python object but is no longer registered with autograd, so no hook added to it later fires
  either. The engine (``plan.py``, ``engine.py``) sees the swap by the address ``_cdata`` and
  drops the stale dict before hooking the parameter again. No public API shows the swap or
  undoes it. The same dict orders the hooks (:func:`put_tensor_hook_first`): autograd runs
  them in the order of the dict's own entries, so the engine's hook on a parameter is put
  first, in front of those the user registered before ``add_hooks``, and sees the gradient
  autograd computed (``backward.py``: a hook that scales it is followed by its factor).
- ``fsdp_module``: ``torch.distributed._composable.fsdp.FSDPModule`` (:func:`fsdp_module_class`),
  the class ``fully_shard`` gives a module, public as ``torch.distributed.fsdp.FSDPModule``
  from torch 2.6; read under the private name before. Without either, no module is taken as
  sharded by FSDP2.
- ``op_schema``: an aten operator's ``OpOverload._schema`` (:func:`dim_arguments`), the names of
  its arguments: the tracker reads which dimension an operation it has no handler for works
  along, passed by position (``torch.fft.fft(h, None, 0)``), and refuses one along the batch;
  and it puts arguments passed by keyword in their places (:func:`positional`,
  ``F.linear(input=x, weight=w)``) for the handlers that read them by position. Fallback:
  every integer passed by position is taken as a dimension (more refusals, none missed); the
  keyword arguments stay where they are (the layout of such a call is then unknown). The
  schema's alias annotations (:func:`writes_first`, ``Tensor(a!) self -> Tensor(a!)``) tell
  the tracker which operations change their first argument in place; fallback: a name that
  ends in ``_`` (the same decision for every public torch function). The operators' tags
  (:func:`tagged`, ``torch.Tag.pointwise``) give the elementwise operations the tracker's
  own list lacks (``torch.special.i1``, ``torch.lcm``); fallback: that list alone.
- ``pytree``: ``torch.utils._pytree`` (:func:`tree_flatten`, :func:`tree_unflatten`,
  :func:`tree_map`): the tensors in a call's arguments and outputs, containers registered with
  torch included (a Hugging Face ``ModelOutput``).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .errors import ConfigurationError, GradhooksWarning, UnsupportedError

__all__ = [
    "INTERNALS",
    "Internal",
    "accumulate_hooks",
    "all_grads_hook",
    "late_hook",
    "available",
    "backward_optimizers",
    "batched_backwards",
    "conv_padding",
    "dim_arguments",
    "enclosing_backward",
    "leave_compiled",
    "positional",
    "disabled",
    "backward_hooks_off",
    "foreach_div",
    "foreach_div_",
    "fp32_precisions",
    "drop_stale_hooks",
    "put_tensor_hook_first",
    "first_forward_hook",
    "put_forward_hook_first",
    "put_forward_pre_hooks_last",
    "forward_hooks_off_within",
    "forward_hooks_off",
    "forward_pre_hooks",
    "fsdp_module_class",
    "fused_lstm",
    "global_forward_hooks",
    "global_forward_pre_hooks",
    "graph_task_id",
    "backward_keeps_graph",
    "batched_on",
    "in_own_transform",
    "in_transform",
    "is_batched",
    "is_grads_batched",
    "is_view",
    "last_forward_pre_hook",
    "missing",
    "own_children",
    "own_parameters",
    "own_transform",
    "pop_mode",
    "push_mode",
    "python_dispatcher",
    "queue_backward_callback",
    "require",
    "saved",
    "saved_tensor_hooks_active",
    "mutation_on_saved_allowed",
    "tensor_hooks",
    "tree_flatten",
    "tree_map",
    "tree_unflatten",
    "tensor_impl",
    "module_backward_hooks",
    "unbatched",
    "unshared",
    "user_backward_hooks",
    "version",
]


@dataclass(frozen=True)
class Internal:
    """One torch internal: what it reads, and what gradhooks does without it."""

    name: str
    reads: str
    fallback: str  # "" where required
    required: bool = False


INTERNALS: dict[str, Internal] = {
    i.name: i
    for i in (
        Internal(
            "functorch_stack",
            "torch._C._functorch.peek_interpreter_stack",
            "gradhooks' own transforms are marked; a call's tensors are looked at",
        ),
        Internal(
            "functorch_batched",
            "torch._C._functorch.is_batchedtensor, get_unwrapped, maybe_get_bdim, "
            "is_legacy_batchedtensor",
            "jacobians() and kfac() run one backward per output-gradient, without vmap",
        ),
        Internal(
            "saved_tensor_hooks",
            "torch._C._autograd._top_saved_tensors_default_hooks",
            "taken to be on: no taps, no expanded meetings (recomputed)",
        ),
        Internal(
            "mutation_on_saved",
            "torch.autograd.graph._allow_mutation_on_saved_tensors_enabled",
            "taken to be off: a tensor changed in place after the forward is refused",
        ),
        Internal(
            "use_counts",
            "Tensor._use_count, torch._C._storage_Use_Count, Tensor._base",
            "grad1's memory is never reused",
        ),
        Internal(
            "autograd_saved",
            "autograd nodes' _saved_<name> fields",
            "the norm and attention rules recompute what torch saved",
        ),
        Internal(
            "fused_lstm",
            "torch._VF.lstm",
            "the RNN rule's own recurrence gives each layer's states",
        ),
        Internal(
            "python_dispatcher",
            "torch._dispatch.python.enable_python_dispatcher",
            "vmap_grad of a model with an RNN is loop_grad",
        ),
        Internal(
            "conv_padding",
            "_ConvNd._reversed_padding_repeated_twice",
            "computed from padding, kernel_size and dilation",
        ),
        Internal("is_view", "Tensor._is_view", "every hooked output gets a node of its own"),
        Internal(
            "view_base",
            "Tensor._base",
            "forwards on x[t] of a sequence-first x in one backward are refused as chunks",
        ),
        Internal(
            "engine_executes",
            "torch._C._will_engine_execute_node",
            "an autograd.grad backward adds to the grad1 a backward() of another forward left",
        ),
        Internal(
            "autograd_node",
            "torch._C._current_autograd_node",
            "a backward inside another is seen only where the other reached a hooked call",
        ),
        Internal(
            "op_schema",
            "OpOverload._schema (an aten operator's argument names and alias annotations)",
            "every integer passed by position is taken as a dimension; in place by the name",
        ),
        Internal(
            "mode_stack",
            "torch._C._len_torch_function_stack, _get_function_stack_at, "
            "_pop_torch_function_stack, _push_on_torch_function_stack",
            "the tracker stays on the mode stack, paused, and passes the hooks' own work on",
        ),
        Internal(
            "eval_frame",
            "torch._C._dynamo.eval_frame.get_eval_frame_callback, set_eval_frame",
            "hooks through torch.compiler.disable: a graph break at nearly every torch function",
        ),
        Internal(
            "foreach",
            "torch._foreach_div_, _foreach_div",
            "a loop over the tensors, the same numbers",
        ),
        Internal(
            "fp32_precision",
            "torch._C._get_fp32_precision_getter",
            "the torch.backends attributes, the same settings",
        ),
        Internal("graph_task_id", "torch._C._current_graph_task_id", "", required=True),
        Internal(
            "keep_graph",
            "torch._C._autograd._get_current_graph_task_keep_graph",
            "every backward is taken as keeping its graph: a call's inputs live with the graph",
        ),
        Internal(
            "backward_callback",
            "torch.autograd.Variable._execution_engine.queue_callback",
            "",
            required=True,
        ),
        Internal("version_counter", "Tensor._version", "", required=True),
        Internal(
            "module_state",
            "nn.Module._parameters, _modules, _forward_hooks, _forward_pre_hooks, _backward_hooks, "
            "_backward_pre_hooks, _is_full_backward_hook, "
            "torch.nn.modules.module._global_forward_hooks, "
            "_global_forward_pre_hooks, _global_backward_hooks, _global_backward_pre_hooks, "
            "Tensor._backward_hooks, _post_accumulate_grad_hooks",
            "",
            required=True,
        ),
        Internal("pytree", "torch.utils._pytree", "", required=True),
        Internal("tensor_impl", "Tensor._cdata, Tensor._backward_hooks", "", required=True),
    )
}

_off: set[str] = set()  # switched off by disabled()
_missing: set[str] = set()  # not found in this torch at import


def available(name: str) -> bool:
    """Whether internal ``name`` is used now (found in this torch, not switched off)."""
    return name not in _off and name not in _missing


def missing() -> list[str]:
    """The internals this torch lacks (their fallbacks are used)."""
    return sorted(_missing)


@contextlib.contextmanager
def disabled(*names: str) -> Iterator[None]:
    """Use the fallbacks of internals ``names`` (every one when none is given) within the
    block, as on a torch without them."""
    unknown = set(names) - INTERNALS.keys()
    if unknown:
        raise ConfigurationError(
            f"no torch internal named {sorted(unknown)}; known: {sorted(INTERNALS)}"
        )
    added = set(names or INTERNALS) - _off
    _off.update(added)
    try:
        yield
    finally:
        _off.difference_update(added)


def require() -> None:
    """Raise where a required internal is missing (or switched off)."""
    lacking = [i for i in INTERNALS.values() if i.required and not available(i.name)]
    if lacking:
        names = "; ".join(f"{i.name} ({i.reads})" for i in lacking)
        raise UnsupportedError(
            f"gradhooks needs torch internals missing here (torch {torch.__version__}): "
            f"{names}. No public torch API replaces them; use a torch version that has them "
            "(gradhooks is tested with torch >= 2.1)."
        )


def _lookup(name: str, find: Callable[[], Any]) -> Any:
    """``find()``, or ``None`` (and ``name`` recorded as missing) where it fails."""
    try:
        found = find()
    except Exception:
        found = None
    if found is None:
        _missing.add(name)
    return found


# -- functorch_stack ---------------------------------------------------------------------------

_PEEK = _lookup("functorch_stack", lambda: torch._C._functorch.peek_interpreter_stack)
_DEBUG_UNWRAP = getattr(getattr(torch, "func", None), "debug_unwrap", None)


_own_transforms = 0  # how many of gradhooks' own torch.func transforms are running


@contextlib.contextmanager
def own_transform() -> Iterator[None]:
    """Mark a ``torch.func`` transform gradhooks itself runs (the Jacobians' and K-FAC's
    ``vmap`` over backwards, the fallback rule's), for :func:`in_transform`'s fallback."""
    global _own_transforms
    _own_transforms += 1
    try:
        yield
    finally:
        _own_transforms -= 1


def in_own_transform() -> bool:
    """Whether one of gradhooks' own ``torch.func`` transforms is running
    (:func:`own_transform`)."""
    return _own_transforms > 0


def in_transform(*trees: Any) -> bool:
    """Whether this runs inside a ``torch.func`` transform (``vmap``, ``grad``, ...).

    Reads ``torch._C._functorch.peek_interpreter_stack()``: torch has no public way to ask
    (``torch.compiler.is_compiling`` is for ``torch.compile`` only). Without it: inside one of
    gradhooks' own transforms (:func:`own_transform`), or a tensor in ``trees`` (the call's
    arguments, outputs, gradients) is a functorch tensor, batched or tracked by ``grad`` (the
    public ``torch.func.debug_unwrap`` unwraps it)."""
    if _PEEK is not None and "functorch_stack" not in _off:
        return _PEEK() is not None
    if _own_transforms:
        return True
    if _DEBUG_UNWRAP is None:
        return False
    try:
        return any(
            isinstance(t, Tensor) and _DEBUG_UNWRAP(t, recurse=False) is not t
            for t in tree_flatten(trees)[0]
        )
    except Exception:
        return True


def functorch_base(t: Tensor) -> Tensor:
    """The tensor under ``t``'s ``torch.func`` wrappers (``vmap``'s batched tensor, ``grad``'s
    tracked one), by the public ``torch.func.debug_unwrap``; ``t`` itself where it has none
    (or where that function is missing)."""
    if _DEBUG_UNWRAP is None:
        return t
    try:
        return _DEBUG_UNWRAP(t, recurse=True)
    except Exception:
        return t


# -- functorch_batched -------------------------------------------------------------------------

_BATCHED = _lookup(
    "functorch_batched",
    lambda: (
        torch._C._functorch.is_batchedtensor,
        torch._C._functorch.get_unwrapped,
        torch._C._functorch.maybe_get_bdim,
    ),
)


def unbatched(t: Tensor | None) -> Tensor | None:
    """The physical tensor of ``t``, batched by the innermost ``vmap``, with its vmapped
    dimension first; ``None`` where ``t`` is not batched, or where this internal is missing.

    Reads ``torch._C._functorch.is_batchedtensor``, ``get_unwrapped`` and ``maybe_get_bdim``:
    ``torch.func`` has no public way out of a ``vmap`` (``debug_unwrap`` is for debugging and
    loses the batched dimension). Without them nothing is batched: :func:`gradhooks.jacobians`
    and :func:`gradhooks.kfac` then do not ``vmap`` their backwards (see
    :func:`batched_backwards`)."""
    if _BATCHED is None or "functorch_batched" in _off or t is None:
        return None
    is_batched, get_unwrapped, bdim = _BATCHED
    if not is_batched(t):
        return None
    return get_unwrapped(t).movedim(bdim(t), 0)


def batched_on(t: Tensor | None) -> tuple[Tensor, int] | None:
    """``(physical, dim)``: the tensor under ``t``'s innermost ``vmap`` as it is (not moved)
    and the dimension of it that the ``vmap`` runs over; ``None`` where ``t`` is not batched,
    or where this internal is missing. The tracker's check of a ``vmap`` run in the forward
    (``tracking/meeting.py``), which without it takes no ``vmap`` for one over the batch."""
    if _BATCHED is None or "functorch_batched" in _off or t is None:
        return None
    is_batched, get_unwrapped, bdim = _BATCHED
    if not is_batched(t):
        return None
    return get_unwrapped(t), int(bdim(t))


def is_batched(t: Tensor | None) -> bool:
    """Whether :func:`unbatched` of ``t`` is a tensor (``False`` without the internal)."""
    if _BATCHED is None or "functorch_batched" in _off or t is None:
        return False
    return bool(_BATCHED[0](t))


_LEGACY_BATCHED = getattr(getattr(torch._C, "_functorch", None), "is_legacy_batchedtensor", None)


def is_grads_batched(t: Tensor | None) -> bool:
    """Whether ``t`` is batched by a ``vmap`` or by the older one that
    ``torch.autograd.grad(..., is_grads_batched=True)`` runs its backward under
    (``torch._C._functorch.is_legacy_batchedtensor``); ``False`` without the internal."""
    if _BATCHED is None or "functorch_batched" in _off or t is None:
        return False
    return bool(_BATCHED[0](t)) or (_LEGACY_BATCHED is not None and bool(_LEGACY_BATCHED(t)))


def batched_backwards() -> bool:
    """Whether several backwards may run batched under ``vmap`` and their batched pieces be
    read (:func:`unbatched`); else one backward per output-gradient."""
    return available("functorch_batched")


# -- saved_tensor_hooks ------------------------------------------------------------------------

_TOP_HOOKS = _lookup(
    "saved_tensor_hooks", lambda: torch._C._autograd._top_saved_tensors_default_hooks
)


def saved_tensor_hooks_active() -> bool:
    """Whether the tensors autograd saves for the backward go through saved-tensor hooks now
    (``torch.autograd.graph.saved_tensors_hooks``: non-reentrant activation checkpointing,
    offloading to the CPU). Such a forward is run again, untracked, when its saved tensors are
    needed: it must save exactly what it saves untracked (the same operations on the same
    shapes), and reading a saved tensor in the forward would run it again there.

    Reads ``torch._C._autograd._top_saved_tensors_default_hooks``: torch pushes the hooks
    publicly but has no public way to ask whether any are on. Without it: True (the answer
    that makes the callers recompute rather than read what was saved)."""
    if _TOP_HOOKS is None or "saved_tensor_hooks" in _off:
        return True
    try:
        return _TOP_HOOKS(True) is not None
    except Exception:
        return True


_MUTATION_ON_SAVED = _lookup(
    "mutation_on_saved",
    lambda: hasattr(torch.autograd.graph, "_allow_mutation_on_saved_tensors_enabled") or None,
)


def mutation_on_saved_allowed() -> bool:
    """Whether ``torch.autograd.graph.allow_mutation_on_saved_tensors()`` is on: autograd then
    keeps a copy of a tensor it saved that is changed in place, and its backward computes from
    the forward's values. Reads ``torch.autograd.graph._allow_mutation_on_saved_tensors_enabled``
    (the context manager's own flag; torch has no public way to ask). Without it: False (a
    tensor changed in place after the forward is refused, as outside the context)."""
    if _MUTATION_ON_SAVED is None or "mutation_on_saved" in _off:
        return False
    return bool(getattr(torch.autograd.graph, "_allow_mutation_on_saved_tensors_enabled", False))


# -- use_counts --------------------------------------------------------------------------------


def _storage_users_alone() -> int | None:
    """What ``torch._C._storage_Use_Count`` counts for a storage one tensor holds."""
    t = torch.zeros(2)
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


_STORAGE_ALONE = _lookup("use_counts", _storage_users_alone)


def unshared(t: Tensor) -> bool:
    """Whether nothing but the tensor object ``t`` holds its memory: no other tensor on the
    same ``TensorImpl`` (autograd's saved variables, a ``detach()``), none on its storage (a
    view, a NumPy array), and ``t`` is no view itself. Python references are the caller's to
    count (``sys.getrefcount``).

    Reads ``Tensor._use_count``, ``torch._C._storage_Use_Count`` and ``Tensor._base``, as
    autograd does (in C++) before it accumulates into ``.grad`` in place; torch has no public
    way to ask. Without them: False (the caller allocates anew)."""
    if _STORAGE_ALONE is None or "use_counts" in _off:
        return False
    try:
        return (
            t._use_count() == 1
            and torch._C._storage_Use_Count(t.untyped_storage()._cdata) == _STORAGE_ALONE
            and t._base is None
        )
    except (AttributeError, RuntimeError, TypeError):
        return False


# -- autograd_saved ----------------------------------------------------------------------------


def saved(node: Any, name: str) -> Tensor | None:
    """The tensor autograd node ``node`` saved for its backward as ``name`` (``node._saved_``
    + ``name``: ``"input"``, ``"result1"``, ``"mat2"``...), or ``None``.

    The ``_saved_*`` fields are how torch exposes what a node saved (autograd's notes show
    them, but their names follow each op's private derivative formula and may change); there
    is no public accessor. ``None`` where the node has no such field, its saved tensors were
    freed, the field is no tensor, or this internal is off: callers then recompute."""
    if "autograd_saved" in _off:
        return None
    try:
        value = getattr(node, "_saved_" + name)
    except (AttributeError, RuntimeError):
        return None
    return value if isinstance(value, Tensor) else None


# -- fused_lstm --------------------------------------------------------------------------------

_FUSED_LSTM = _lookup("fused_lstm", lambda: torch._C._VariableFunctions.lstm)


def fused_lstm() -> Callable | None:
    """``torch._VF.lstm``, the fused multi-layer LSTM ``nn.LSTM.forward`` calls with its
    flattened weights, or ``None``.

    There is no public function of an LSTM's weights that runs torch's kernel (the module
    itself is one); the RNN rule runs it one layer at a time for the lower layers' states,
    and recognizes the module's own call of it. ``None`` where missing or off: the rule then
    computes the states by its own recurrence."""
    return None if "fused_lstm" in _off else _FUSED_LSTM


# -- python_dispatcher -------------------------------------------------------------------------


def _python_dispatcher_factory():
    from torch._dispatch.python import enable_python_dispatcher

    return enable_python_dispatcher


_PYTHON_DISPATCHER = _lookup("python_dispatcher", _python_dispatcher_factory)


def python_dispatcher() -> contextlib.AbstractContextManager | None:
    """A context in which ``vmap`` runs torch's Python decompositions of the composite ops it
    has no batching rule for (``aten::lstm``, ``gru``, ``rnn_tanh``, ``rnn_relu``), or ``None``.

    Reads ``torch._dispatch.python.enable_python_dispatcher``: ``torch.func`` has no public
    switch for it. ``None`` where missing or off: :func:`gradhooks.oracle.vmap_grad` then
    computes an RNN model's per-example gradients by its per-example loop."""
    if _PYTHON_DISPATCHER is None or "python_dispatcher" in _off:
        return None
    return _PYTHON_DISPATCHER()


# -- conv_padding ------------------------------------------------------------------------------


def _public_conv_padding(module: nn.Module) -> list[int]:
    """``_reversed_padding_repeated_twice`` as ``_ConvNd.__init__`` computes it."""
    kernel, dilation, padding = module.kernel_size, module.dilation, module.padding
    if isinstance(padding, str):
        pads = [0, 0] * len(kernel)
        if padding == "same":
            for d, k, i in zip(dilation, kernel, range(len(kernel) - 1, -1, -1)):
                total = d * (k - 1)
                pads[2 * i] = total // 2
                pads[2 * i + 1] = total - total // 2
        return pads
    return [p for p in reversed(padding) for _ in range(2)]


def conv_padding(module: nn.Module) -> list[int]:
    """The padding a convolution's forward passes to ``F.pad`` (string padding, a padding mode
    other than zeros): ``(left, right)`` per spatial axis, last axis first.

    Reads ``module._reversed_padding_repeated_twice``, what the forward itself reads (public
    ``padding`` changed after construction is not applied by it). Where missing or off: the
    same computed from ``padding``, ``kernel_size`` and ``dilation``."""
    if "conv_padding" not in _off:
        pads = getattr(module, "_reversed_padding_repeated_twice", None)
        if pads is not None:
            return list(pads)
    return _public_conv_padding(module)


# -- is_view -----------------------------------------------------------------------------------


def is_view(t: Tensor) -> bool:
    """Whether autograd takes ``t`` for a view of another tensor (``Tensor._is_view()``; the
    tensor views notes show no public test). True where missing or off: the caller then
    treats every tensor as a view, which costs one node and is right for every tensor."""
    if "is_view" in _off:
        return True
    try:
        return t._is_view()
    except AttributeError:
        return True


# -- view_base ---------------------------------------------------------------------------------


def view_base(t: Tensor) -> Tensor | None:
    """The tensor whose memory ``t`` views (``Tensor._base``: the tensor views notes name it,
    with no public accessor), or ``None``: ``t`` is no view, or the attribute is missing or
    off."""
    if "view_base" in _off:
        return None
    return getattr(t, "_base", None)


# -- mode_stack --------------------------------------------------------------------------------

_MODE_STACK = _lookup(
    "mode_stack",
    lambda: (
        torch._C._len_torch_function_stack,
        torch._C._get_function_stack_at,
        torch._C._pop_torch_function_stack,
        torch._C._push_on_torch_function_stack,
    ),
)


def pop_mode(mode: Any) -> bool:
    """Take ``mode`` off torch's stack of torch-function modes where it is the one torch
    functions reach first (the innermost), for :func:`push_mode` to put back; whether it did.
    ``False`` where missing or off, or where another mode was entered inside it: the caller
    then leaves it on (its fallback)."""
    if _MODE_STACK is None or "mode_stack" in _off:
        return False
    length, at, pop, _ = _MODE_STACK
    n = length()
    if n == 0 or at(n - 1) is not mode:
        return False
    pop()
    return True


# Put back the mode :func:`pop_mode` took off (called only where it did, so where the stack's
# functions were found): torch's own push, without a Python call around it (once per hook)
push_mode: Callable[[Any], None] = (
    _MODE_STACK[3] if _MODE_STACK is not None else (lambda mode: None)
)


# -- tensor_impl (required) -------------------------------------------------------------------

_lookup(
    "tensor_impl",
    lambda: torch.zeros(1)._cdata if hasattr(torch.zeros(1), "_backward_hooks") else None,
)


def tensor_impl(t: Tensor) -> int:
    """The address of the C++ tensor under ``t`` (``Tensor._cdata``), which
    ``torch.utils.swap_tensors`` changes under the same Python object. Required
    (:func:`require`)."""
    return t._cdata


def drop_stale_hooks(t: Tensor) -> None:
    """Forget the gradient hooks of a tensor whose C++ tensor was swapped
    (``torch.utils.swap_tensors``): its dict of hooks (``Tensor._backward_hooks``) moved with
    the Python object but is no longer registered with autograd, and ``register_hook`` would
    add to it, never to fire. Without the dict, the next ``register_hook`` registers a new
    one. Required (:func:`require`)."""
    t._backward_hooks = None


def put_tensor_hook_first(t: Tensor, hook_id: int) -> None:
    """Run the gradient hook ``hook_id`` of ``t`` (from ``t.register_hook``) before the others
    (``Tensor._backward_hooks``, an ordered dict, rebuilt: autograd walks the entries in the
    order they were put in, which ``move_to_end`` does not change). Required
    (:func:`require`)."""
    hooks = t._backward_hooks
    if not hooks or next(iter(hooks)) == hook_id or hook_id not in hooks:
        return
    entries = list(hooks.items())
    hooks.clear()
    hooks[hook_id] = dict(entries)[hook_id]
    for key, hook in entries:
        if key != hook_id:
            hooks[key] = hook


# -- eval_frame --------------------------------------------------------------------------------


def _eval_frame() -> tuple | None:
    frames = torch._C._dynamo.eval_frame
    return frames.get_eval_frame_callback, frames.set_eval_frame


_EVAL_FRAME = _lookup("eval_frame", _eval_frame)


def leave_compiled() -> bool:
    """Turn off ``torch.compile``'s frame evaluation for the rest of the compiled call this
    runs in (``torch._C._dynamo.eval_frame.set_eval_frame(None)``), where it is on; whether it
    was. The code that call then runs, its frames and those they call, runs eagerly, as if
    never compiled; ``torch.compile``'s wrapper of the call sets the evaluation it found again
    when the call returns or raises. Outside a compiled call, and where missing or off: nothing
    (``False``)."""
    if _EVAL_FRAME is None or "eval_frame" in _off:
        return False
    callback, set_callback = _EVAL_FRAME
    if callback() is None:
        return False
    set_callback(None)
    return True


# -- graph_task_id (required) ------------------------------------------------------------------

_GRAPH_TASK_ID = _lookup("graph_task_id", lambda: torch._C._current_graph_task_id)


def _no_graph_task_id() -> int:
    return 0


# The id of the running backward (``torch._C._current_graph_task_id`` itself: asked several
# times per hooked call, it is not wrapped), -1 outside any. torch has no public way to tell
# one backward from another running inside it (reentrant checkpointing). Required
# (:func:`require`); 0 where missing.
graph_task_id: Callable[[], int] = (
    _GRAPH_TASK_ID if _GRAPH_TASK_ID is not None else _no_graph_task_id
)


# -- keep_graph ---------------------------------------------------------------------------------

_KEEP_GRAPH = _lookup("keep_graph", lambda: torch._C._autograd._get_current_graph_task_keep_graph)


def backward_keeps_graph() -> bool:
    """Whether the running backward keeps its graph for another (``retain_graph=True``, or
    ``create_graph=True``), as ``torch._C._autograd._get_current_graph_task_keep_graph`` says;
    torch has no public way to ask. Without it: True (nothing is let go of early)."""
    if _KEEP_GRAPH is None or "keep_graph" in _off:
        return True
    try:
        return bool(_KEEP_GRAPH())
    except RuntimeError:
        return True


# -- backward_callback (required) --------------------------------------------------------------

_QUEUE_CALLBACK = _lookup(
    "backward_callback", lambda: torch.autograd.Variable._execution_engine.queue_callback
)


def queue_backward_callback(
    fn: Callable[[], None], failed: Callable[[], None] | None = None
) -> None:
    """Run ``fn`` when the running backward ends
    (``torch.autograd.Variable._execution_engine.queue_callback``, as DDP and FSDP use it);
    ``failed`` where it fails instead (an error raised in it: torch lets go of the callbacks
    of a backward that fails, unrun, before the error reaches its caller).

    No public hook fires once a backward is done, or has failed. Required (:func:`require`)."""
    _QUEUE_CALLBACK(fn if failed is None else _Callback(fn, failed))


class _Callback:
    """A backward's callback that calls ``failed`` where it is let go of unrun."""

    __slots__ = ("_fn", "_failed")

    def __init__(self, fn: Callable[[], None], failed: Callable[[], None]) -> None:
        self._fn: Callable[[], None] | None = fn
        self._failed = failed

    def __call__(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()

    def __del__(self) -> None:
        if self._fn is not None:
            self._failed()


# -- version_counter (required) ----------------------------------------------------------------

_lookup("version_counter", lambda: torch.zeros(1)._version)


def version(t: Tensor) -> int:
    """``t``'s version counter (``Tensor._version``), which every in-place change of it or of a
    view of it bumps: autograd's own in-place check reads it, and
    ``torch.autograd.graph.increment_version`` bumps it publicly, but reading it has only its
    private name. Required (:func:`require`)."""
    return t._version


# -- module_state (required) -------------------------------------------------------------------


def _module_state():
    """The global hook dicts, once a module is seen to have the attributes read below."""
    m = nn.Module()
    for name in ("_parameters", "_modules", "_forward_hooks", "_forward_pre_hooks"):
        if not isinstance(getattr(m, name), dict):
            return None
    return nn.modules.module._global_forward_hooks, nn.modules.module._global_forward_pre_hooks


_GLOBAL_HOOKS = _lookup("module_state", _module_state)


def own_children(module: nn.Module) -> dict[str, Any]:
    """``module._modules``: its own submodules by name (``None`` where a slot is empty), the
    dict ``named_children()`` walks, read without the generator and the names it builds for
    each module below (:func:`gradhooks.engine.plan.state_key`, at every forward). Required
    (:func:`require`)."""
    return module._modules


def own_parameters(module: nn.Module) -> dict[str, Any]:
    """``module._parameters``: its own parameters by name, the dict its ``__getattr__`` reads.
    Setting an entry replaces the parameter for the module's forward without the checks of
    ``setattr`` (a plain tensor for a parameter), as ``torch.func.functional_call`` does
    internally; torch has no public way to do it. Required (:func:`require`)."""
    return module._parameters


@contextlib.contextmanager
def forward_hooks_off(module: nn.Module) -> Iterator[None]:
    """Within the block, ``module``'s own forward hooks (``module._forward_hooks``: its
    pre-hooks stay) do not run when it is called: torch has no public way to call a module
    with its forward pre-hooks but not its hooks."""
    kept = module._forward_hooks
    module._forward_hooks = type(kept)()
    try:
        yield
    finally:
        module._forward_hooks = kept


@contextlib.contextmanager
def backward_hooks_off(module: nn.Module) -> Iterator[None]:
    """Within the block, ``module``'s own backward hooks and pre-hooks (``_backward_hooks``,
    ``_backward_pre_hooks``) are not set up when it is called, so that a recomputation's
    backward does not fire them once more: torch has no public way to call a module without
    them. Required (:func:`require`)."""
    kept = module._backward_hooks, module._backward_pre_hooks
    module._backward_hooks, module._backward_pre_hooks = type(kept[0])(), type(kept[1])()
    try:
        yield
    finally:
        module._backward_hooks, module._backward_pre_hooks = kept


@contextlib.contextmanager
def forward_hooks_off_within(module: nn.Module, within: bool = True) -> Iterator[None]:
    """Within the block, ``module``'s forward hooks and pre-hooks (``_forward_hooks``,
    ``_forward_pre_hooks``) do not run when it is called, and, ``within``, neither do those of
    the modules inside it nor the global ones (``torch.nn.modules.module._global_forward_hooks``
    and ``_global_forward_pre_hooks``); one registered inside the block runs. The dicts are
    emptied in place and filled again, in their order, on exit. torch has no public way to
    call a module without its hooks. Required (:func:`require`)."""
    modules = module.modules() if within else (module,)
    dicts = {id(d): d for m in modules for d in (m._forward_pre_hooks, m._forward_hooks)}
    for d in _GLOBAL_HOOKS or () if within else ():
        dicts[id(d)] = d
    kept = [(d, list(d.items())) for d in dicts.values() if d]
    for d, _ in kept:
        d.clear()
    try:
        yield
    finally:
        for d, items in kept:
            added = list(d.items())
            d.clear()
            d.update(items)
            d.update(added)


def first_forward_hook(module: nn.Module) -> Any:
    """The forward hook ``module`` runs first (``module._forward_hooks``), or ``None``: torch
    has no public way to list a module's hooks. Required (:func:`require`)."""
    return next(iter(module._forward_hooks), None)


def put_forward_hook_first(module: nn.Module, hook_id: int) -> None:
    """Run the forward hook ``hook_id`` of ``module`` first again, where one registered later
    with ``prepend=True`` went in front of it (``module._forward_hooks``, an ordered dict):
    torch has no public way to reorder a module's hooks. Required (:func:`require`)."""
    hooks = module._forward_hooks
    if hooks and next(iter(hooks)) != hook_id and hook_id in hooks:
        hooks.move_to_end(hook_id, last=False)


def put_forward_pre_hooks_last(module: nn.Module, hook_ids: tuple[int, ...]) -> None:
    """Run the forward pre-hooks ``hook_ids`` of ``module`` last again, in that order, where
    others were registered after them (``module._forward_pre_hooks``, an ordered dict): torch
    has no public way to reorder a module's hooks. Required (:func:`require`)."""
    hooks = module._forward_pre_hooks
    if not hook_ids or not hooks or next(reversed(hooks)) == hook_ids[-1]:
        return
    for hook_id in hook_ids:
        if hook_id in hooks:
            hooks.move_to_end(hook_id)


def last_forward_pre_hook(module: nn.Module) -> Any:
    """The forward pre-hook ``module`` runs last (``module._forward_pre_hooks``), or ``None``.
    Required (:func:`require`)."""
    hooks = module._forward_pre_hooks
    return hooks[next(reversed(hooks))] if hooks else None


def forward_pre_hooks(module: nn.Module) -> list:
    """``module``'s forward pre-hooks in the order they run (``module._forward_pre_hooks``).
    Required (:func:`require`)."""
    return list(module._forward_pre_hooks.values())


def global_forward_hooks() -> bool:
    """Whether global forward hooks (``nn.modules.module.register_module_forward_hook``) are
    registered, which run before a module's own. Required (:func:`require`)."""
    return bool(_GLOBAL_HOOKS[0]) if _GLOBAL_HOOKS is not None else True


def global_forward_hook_count() -> int:
    """How many global forward hooks are registered. Required (:func:`require`)."""
    return len(_GLOBAL_HOOKS[0]) if _GLOBAL_HOOKS is not None else 0


def first_global_forward_hook(hook: Callable, handle: Any = None) -> Any:
    """``hook`` registered as a global forward hook that runs before every other global one
    (and so before every module's own), or, given its ``handle``, moved back to the front if
    others came before it since; returns the handle. ``register_module_forward_hook`` has no
    ``prepend``: the hook is moved to the front of
    ``torch.nn.modules.module._global_forward_hooks``. Required (:func:`require`)."""
    hooks = _GLOBAL_HOOKS[0]
    if handle is None:
        handle = nn.modules.module.register_module_forward_hook(hook)
    if next(iter(hooks), None) != handle.id:
        hooks.move_to_end(handle.id, last=False)
    return handle


def global_forward_pre_hooks() -> bool:
    """Whether global forward pre-hooks are registered, which run before a module's own.
    Required (:func:`require`)."""
    return bool(_GLOBAL_HOOKS[1]) if _GLOBAL_HOOKS is not None else True


def user_backward_hooks(modules: Any, params: Any, own: int = 0) -> bool:
    """Whether a backward through ``modules`` would run backward hooks of the user's: a
    module's full backward (pre-)hook, a global one, or a hook on one of ``params`` other than
    the ``own`` each holds of gradhooks' (``Tensor._backward_hooks``,
    ``_post_accumulate_grad_hooks``). torch has no public way to list them. Required
    (:func:`require`)."""
    g = nn.modules.module
    if g._global_backward_hooks or g._global_backward_pre_hooks:
        return True
    if any(m._backward_hooks or m._backward_pre_hooks for m in modules):
        return True
    return any(len(p._backward_hooks or ()) > own or p._post_accumulate_grad_hooks for p in params)


def module_backward_hooks(m: nn.Module) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids of the full backward hooks (``register_full_backward_hook``; not the old
    ``register_backward_hook``, which cannot share a module with them) and of the backward
    pre-hooks ``m`` holds itself, in the order they run (their handles' ids, which grow with
    each hook registered: ``_backward_hooks``, ``_is_full_backward_hook``,
    ``_backward_pre_hooks``). Required (:func:`require`)."""
    full = tuple(m._backward_hooks or ()) if m._is_full_backward_hook else ()
    return full, tuple(m._backward_pre_hooks or ())


def accumulate_hooks(p: Tensor) -> int:
    """How many post-accumulate-grad hooks ``p`` holds (``Tensor._post_accumulate_grad_hooks``).
    Required (:func:`require`)."""
    return len(p._post_accumulate_grad_hooks or ())


def backward_optimizers(p: Tensor) -> int:
    """How many optimizers torch's ``torch.distributed.optim._apply_optimizer_in_backward``
    steps in ``p``'s backward (``Parameter._in_backward_optimizers``, the list it keeps on the
    parameter, which its ``_get_in_backward_optimizers`` reads): they step from a hook on the
    ``AccumulateGrad`` node, which no tensor attribute shows. ``0`` where torch set none."""
    return len(getattr(p, "_in_backward_optimizers", None) or ())


def tensor_hooks(t: Tensor) -> int:
    """How many gradient hooks ``t`` holds (``Tensor._backward_hooks``, what
    ``t.register_hook`` adds). Required (:func:`require`)."""
    return len(t._backward_hooks or ())


# -- engine_executes ---------------------------------------------------------------------------

_WILL_EXECUTE = _lookup("engine_executes", lambda: torch._C._will_engine_execute_node)


def adds_to_grad(p: Tensor, node: Any = None) -> bool | None:
    """During a backward: ``True`` where it adds ``p``'s gradient into ``p.grad`` (runs its
    ``AccumulateGrad`` node: a ``backward()``), ``False`` where it returns it (a
    ``torch.autograd.grad`` with ``p`` among its inputs); ``None``: neither (it does not compute
    ``p``'s gradient), or unknown (the internal is missing). ``node``: ``p``'s ``AccumulateGrad``
    node where the caller holds it (else found through two views of ``p``)."""
    if _WILL_EXECUTE is None or "engine_executes" in _off:
        return None
    try:
        if node is None:
            node = torch.autograd.graph.get_gradient_edge(p).node
        return True if _WILL_EXECUTE(node) else None
    except RuntimeError as e:
        # (a leaf whose gradient the running torch.autograd.grad returns: torch refuses to say,
        # naming autograd.grad)
        return False if "autograd.grad" in str(e) else None
    except (TypeError, ValueError):
        return None


def late_hook(t: Tensor, fn: Callable[[Tensor], None]) -> Any:
    """``fn(grad)`` in a backward that reaches ``t``, after every gradient hook on ``t`` (also
    those put on it later: a mask a user's ``t.register_hook`` applies is in ``grad``): a
    pre-hook of the node that computed ``t`` (``Node.register_prehook``, which torch runs after
    the tensors' hooks), for its slot. Where that node does not run (``t`` among the
    ``inputs`` of ``torch.autograd.grad``, where the backward stops: none of the nodes after
    it will, by ``torch._C._will_engine_execute_node``), ``fn`` takes the gradient in a hook
    on ``t`` itself, as it is when that hook runs, once per backward; also for a leaf, and
    where that internal is missing. Returns the handle."""
    node, slot = t.grad_fn, t.output_nr
    if node is None or _WILL_EXECUTE is None or "engine_executes" in _off:
        return t.register_hook(fn)
    # (the nodes after it, not the node itself: the hooks, which the node holds where the
    # garbage collector cannot see them, would keep it and its graph alive for good)
    after = [n for n, _ in node.next_functions if n is not None]
    took = [-2]  # the backward in which the hook on t took the gradient

    def early(grad: Tensor) -> None:
        # (leaves' nodes last: asked about a leaf whose gradient a torch.autograd.grad
        # returns, torch raises, which costs about 12 µs; a node before it that runs answers
        # first)
        after.sort(key=_is_accumulator)
        if not any(_runs(n) for n in after):
            took[0] = graph_task_id()
            fn(grad)

    def pre(grads: tuple) -> None:
        if took[0] != graph_task_id() and grads[slot] is not None:
            fn(grads[slot])

    return _Handles([t.register_hook(early), node.register_prehook(pre)])


def _is_accumulator(node: Any) -> bool:
    """Whether ``node`` is a leaf's ``AccumulateGrad`` node (by its class's name: the class is
    not public)."""
    return type(node).__name__ == "AccumulateGrad"


def _runs(node: Any) -> bool:
    """Whether the running backward runs ``node`` or takes a gradient there; for a leaf's node
    in a ``torch.autograd.grad`` (torch refuses to say), ``True``: where the leaf is among its
    inputs, the nodes before it run."""
    try:
        return bool(_WILL_EXECUTE(node))
    except RuntimeError:
        return True


def all_grads_hook(
    tensors: list[Tensor], fn: Callable[[list[Tensor | None]], None], late: bool = False
) -> Any:
    """``torch.autograd.graph.register_multi_grad_hook(tensors, fn, mode="all")``: ``fn`` of
    the gradients of ``tensors`` (non-leaf; ``None`` for those the backward does not reach),
    once per backward, when the last it reaches has its gradient. Returns the handle.

    torch's counts the tensors whose nodes ``torch._C._will_engine_execute_node`` says will
    run; for the root of a backward of one root (``out.backward(v)``), which torch runs as the
    graph's first node, it says no, so that where ``out`` is one of ``tensors`` the hook never
    fires. The root's hook is the first to run: a tensor whose hook runs is counted here.
    ``late``: each tensor's gradient as every hook on it leaves it (:func:`late_hook`)."""
    if (
        _WILL_EXECUTE is None
        or "engine_executes" in _off
        or any(t.grad_fn is None for t in tensors)
    ):
        return torch.autograd.graph.register_multi_grad_hook(tensors, fn, mode="all")
    # (each hook is held by a node, so the hooks hold the nodes weakly where they can, a
    # custom Function's: a node that held itself through its hook would outlive the graph,
    # with every tensor the hook's owner keeps; torch's own nodes take no weak reference)
    nodes = [_weak_or_strong(t.grad_fn) for t in tensors]
    waiting: dict[int, list] = {}  # backward id -> [gradients still to come, the gradients]
    lock = threading.Lock()

    def will_run(node: Any) -> bool:
        node = node() if isinstance(node, weakref.ref) else node
        return node is not None and bool(_WILL_EXECUTE(node))

    def hook_of(i: int) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            task = graph_task_id()
            with lock:
                if task not in waiting:
                    runs = sum(k == i or will_run(node) for k, node in enumerate(nodes))
                    waiting[task] = [runs, [None] * len(nodes)]
                entry = waiting[task]
                entry[1][i] = grad
                entry[0] -= 1
                done = entry[0] == 0
                if done:
                    del waiting[task]
            if done:
                fn(entry[1])

        return hook

    register = late_hook if late else Tensor.register_hook
    return _Handles([register(t, hook_of(i)) for i, t in enumerate(tensors)])


def _weak_or_strong(node: Any) -> Any:
    try:
        return weakref.ref(node)
    except TypeError:
        return node


class _Handles:
    """The handles of :func:`all_grads_hook`'s hooks, removed together."""

    def __init__(self, handles: list) -> None:
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


# -- autograd_node -----------------------------------------------------------------------------

_CURRENT_NODE = _lookup("autograd_node", lambda: torch._C._current_autograd_node)


def enclosing_backward() -> bool | None:
    """At the end of a backward (in its callback): whether it runs inside another backward
    (``torch._C._current_autograd_node``, the node whose backward or hook took it, ``None`` at
    the end of an outermost backward); ``None``: unknown (the internal is missing)."""
    if _CURRENT_NODE is None or "autograd_node" in _off:
        return None
    return _CURRENT_NODE() is not None


# -- pytree (required) -------------------------------------------------------------------------


def _pytree_module():
    import torch.utils._pytree as pytree

    return pytree


_PYTREE = _lookup("pytree", _pytree_module)


def _no_pytree(*args: Any, **kwargs: Any) -> Any:
    require()
    raise UnsupportedError("torch.utils._pytree is missing")  # (require raised already)


# torch.utils._pytree: the leaves of nested containers, those registered with torch included.
# No public module yet (torch.utils.pytree is planned); required (:func:`require`).
tree_flatten: Callable = getattr(_PYTREE, "tree_flatten", _no_pytree)
tree_unflatten: Callable = getattr(_PYTREE, "tree_unflatten", _no_pytree)
tree_map: Callable = getattr(_PYTREE, "tree_map", _no_pytree)


if _missing - {n for n, i in INTERNALS.items() if i.required}:
    warnings.warn(
        "gradhooks: this torch lacks internals that gradhooks uses where they exist: "
        + "; ".join(
            f"{INTERNALS[n].reads} (instead: {INTERNALS[n].fallback})"
            for n in sorted(_missing)
            if not INTERNALS[n].required
        )
        + ". The numbers are the same; some computations are slower.",
        GradhooksWarning,
        stacklevel=2,
    )


# where FSDP2's module class lives (the second: torch < 2.6)
_FSDP_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")


def fsdp_module_class() -> type | tuple:
    """FSDP2's ``FSDPModule`` (the class ``fully_shard`` gives a module), or ``()`` (no class:
    ``isinstance`` is then false) where this torch has none, or where no module has imported
    it yet (no module can be one then: importing it costs about half a second)."""
    if not any(name in sys.modules for name in _FSDP_MODULES):
        return ()
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        try:  # (torch < 2.6: the same class under its private name)
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            return ()
    return FSDPModule


# -- op_schema --------------------------------------------------------------------------------

_DIM_NAMES = ("dim", "dims", "axis")
_lookup("op_schema", lambda: torch.ops.aten.sum.default._schema.arguments)


@functools.cache
def _argument_names(name: str) -> tuple[tuple[str, ...], ...]:
    """The argument names of every overload of ``aten::name`` (none where there is no such
    operator)."""
    try:
        packet = getattr(torch.ops.aten, name)
        return tuple(
            tuple(a.name for a in getattr(packet, o)._schema.arguments) for o in packet.overloads()
        )
    except Exception:
        return ()


def positional(name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of a call of torch function ``name`` with the arguments passed by
    keyword that come next by position (``F.linear(input=x, weight=w)``) moved into ``args``,
    in the order of the overload of the aten operator of that name that takes the most of
    them (``input`` standing for ``self``). Unchanged without the internal."""
    if not kwargs or not available("op_schema"):
        return args, kwargs
    best: tuple[tuple, dict] = (args, kwargs)
    for names in _argument_names(name):
        moved, rest = list(args), dict(kwargs)
        for n in names[len(args) :]:
            key = n if n in rest else "input" if n == "self" and "input" in rest else None
            if key is None:
                break
            moved.append(rest.pop(key))
        if len(rest) < len(best[1]):
            best = (tuple(moved), rest)
    return best


def dim_arguments(name: str, args: tuple, kwargs: dict) -> list[int]:
    """The dimensions torch function ``name`` is called to work along: its arguments named
    ``dim``, ``dims`` or ``axis``, by keyword, or by position where an overload of the aten
    operator of that name puts one there."""
    found = [kwargs[k] for k in _DIM_NAMES if kwargs.get(k) is not None]
    if available("op_schema"):
        for names in _argument_names(name):
            found += [a for n, a in zip(names, args) if n in _DIM_NAMES and a is not None]
    else:  # (every integer passed by position might be one: more refusals, none missed)
        found += [a for a in args if isinstance(a, (int, list, tuple))]
    dims: list[int] = []
    for d in found:
        items = d if isinstance(d, (list, tuple)) else [d]
        dims += [int(i) for i in items if isinstance(i, int) and not isinstance(i, bool)]
    return list(dict.fromkeys(dims))


@functools.cache
def _tensor_overloads(name: str) -> tuple:
    """The overloads of ``aten::name`` that take a tensor first and have no ``out`` argument
    (none where there is no such operator)."""
    try:
        packet = getattr(torch.ops.aten, name)
        found = [getattr(packet, o) for o in packet.overloads()]
    except Exception:
        return ()
    keep = []
    for ov in found:
        args = ov._schema.arguments
        if args and isinstance(args[0].type, torch.TensorType) and not any(a.is_out for a in args):
            keep.append(ov)
    return tuple(keep)


def _writes_and_returns_first(ov: Any) -> bool:
    first, returns = ov._schema.arguments[0], ov._schema.returns
    written = first.alias_info is not None and first.alias_info.is_write
    return written and bool(returns) and returns[0].alias_info is not None


def writes_first(name: str) -> bool | None:
    """Whether the aten operator ``name`` changes its first argument in place and returns it
    (``add_``, ``index_put_``: ``Tensor(a!) self -> Tensor(a!)`` in one of its overloads);
    ``None`` where there is no such operator (``__setitem__``), or without the internal."""
    if not available("op_schema"):
        return None
    overloads = _tensor_overloads(name)
    if not overloads:
        return None
    return any(_writes_and_returns_first(ov) for ov in overloads)


def tagged(name: str, tag: str) -> bool:
    """Whether every overload of the aten operator ``name`` that takes a tensor first carries
    ``torch.Tag.<tag>`` (``"pointwise"``); false where there is no such operator, or without
    the internal."""
    if not available("op_schema"):
        return False
    overloads = _tensor_overloads(name)
    want = getattr(torch.Tag, tag)
    return bool(overloads) and all(want in ov.tags for ov in overloads)


# -- foreach -------------------------------------------------------------------------------------

_FOREACH = _lookup(
    "foreach",
    lambda: (torch._foreach_div_, torch._foreach_div),
)


def foreach_div_(xs: list[Tensor], denom: float) -> None:
    """Each of ``xs`` divided by ``denom`` in place (``torch._foreach_div_``; a loop where
    missing or off)."""
    if xs and _FOREACH is not None and "foreach" not in _off:
        _FOREACH[0](xs, denom)
    else:
        for x in xs:
            x.div_(denom)


def foreach_div(xs: list[Tensor], denom: float) -> list[Tensor]:
    """Each of ``xs`` divided by ``denom``, new tensors (``torch._foreach_div``; a loop where
    missing or off)."""
    if xs and _FOREACH is not None and "foreach" not in _off:
        return list(_FOREACH[1](xs, denom))
    return [x / denom for x in xs]


# -- fp32_precision ------------------------------------------------------------------------------

_FP32_GETTER = _lookup("fp32_precision", lambda: torch._C._get_fp32_precision_getter)
# (backend, operation) of torch.backends' fp32_precision, mkldnn.fp32_precision and
# mkldnn.matmul's, conv's and rnn's
_FP32_SETTINGS = (
    ("generic", "all"), ("mkldnn", "all"), ("mkldnn", "matmul"), ("mkldnn", "conv"),
    ("mkldnn", "rnn"),
)  # fmt: skip


def fp32_precisions() -> set[str]:
    """The ``fp32_precision`` settings of ``torch.backends``: the generic one, oneDNN's, and
    oneDNN's matmul's, conv's and rnn's (``torch._C._get_fp32_precision_getter``; the
    attributes where missing or off). Raises ``AttributeError`` on a torch without them."""
    if _FP32_GETTER is not None and "fp32_precision" not in _off:
        return {_FP32_GETTER(backend, op) for backend, op in _FP32_SETTINGS}
    b = torch.backends
    return {
        b.fp32_precision,
        b.mkldnn.fp32_precision,
        b.mkldnn.matmul.fp32_precision,
        b.mkldnn.conv.fp32_precision,
        b.mkldnn.rnn.fp32_precision,
    }

"""The narrow interface through which gradhooks' workflows drive a handle's engine.

The DP steps (:mod:`gradhooks.workflows.dp`, :mod:`gradhooks.workflows.distributed`), the
Jacobians and K-FAC (:mod:`gradhooks.workflows.jacobian`, :mod:`gradhooks.workflows.kfac`) and
the autograd-hacks layer (:mod:`gradhooks.compat`) need more of a handle than a user does: which
parameters it covers, what the current accumulation wrote, the collector of the quantities, and
backwards of their own that the engine must treat otherwise than the model's. They ask for it
here, through :func:`engine_of`, and never read or set the handle's private state::

    engine = engine_of(hooks)
    with engine.backward_mode(capture=False):   # a backward that writes nothing
        torch.autograd.grad(loss, params)
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from ..errors import ConfigurationError, StateError
from ..quantities import Collector
from ..tracking import SharedInput, Tracker
from .forward import output_edges
from .handle import Hooks
from .records import BackwardMode

__all__ = ["EngineAPI", "engine_of"]


def engine_of(hooks: Hooks) -> EngineAPI:
    """The engine of ``hooks``, as the workflows drive it."""
    return EngineAPI(hooks)


class EngineAPI:
    """What the workflows may read of one handle's engine, and the backwards they may run
    through it (:meth:`backward_mode`, :meth:`standing_aside`). Holds its handle weakly."""

    def __init__(self, hooks: Hooks) -> None:
        self._ref = weakref.ref(hooks)

    @property
    def _hooks(self) -> Hooks:
        hooks = self._ref()
        if hooks is None:
            raise StateError("the gradhooks handle this engine belonged to is gone")
        return hooks

    # -- what is hooked ----------------------------------------------------------------------

    @property
    def sharded(self) -> bool:
        """Whether some of the model's parameters are sharded by FSDP2 (DTensors)."""
        return bool(self._hooks._state.sharded)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The model's ``named_parameters()`` with the parameters the hooks were planned with
        (FSDP2: the sharded ones, whatever stand-in is in their slots now)."""
        hooks = self._hooks
        model = hooks.model
        if model is None:
            return iter(())
        return hooks._named_parameters(model)

    @property
    def structure(self) -> tuple:
        """What the hooks are planned for (:func:`~gradhooks.engine.plan.structure_of`: the
        modules, and the trainable parameters), walked again at each forward of the model:
        the same object as long as the walks find the model as it was planned."""
        return self._hooks._structure

    def follow_dropped(self) -> None:
        """Where the hooks were last planned without trainable parameters the plan before
        covered (a forward through ``torch.func.functional_call`` with other tensors in their
        slots, since returned), plan them again for the model as it is now, as its next
        forward would: a step between the two reads the plan."""
        hooks = self._hooks
        model = hooks.model
        if (hooks._state.dropped or hooks._state.rehooked) and model is not None:
            hooks._follow_changes(model)

    def covered(self) -> set[int]:
        """The ids of the parameters of the hooked modules (trainable or not)."""
        return {id(p) for t in self._hooks._state.targets for p in t.params.values()}

    def parameters(self) -> dict[int, tuple[str, Tensor]]:
        """The trainable parameters the hooks write ``grad1`` for, ``{id: (name, param)}``."""
        return dict(self._hooks._state.params)

    def in_use(self, p: Tensor) -> Tensor:
        """The tensor that stands for ``p`` in the last forward (FSDP2: its unsharded
        parameter), with respect to which a backward computes ``p``'s gradient."""
        return self._hooks._state.current.get(id(p), p)

    def in_use_of(self, params: list[Tensor]) -> list[Tensor]:
        """:meth:`in_use` of each of ``params``, in order (the handle looked up once: a step
        asks for every parameter)."""
        current = self._hooks._state.current
        return [current.get(id(p), p) for p in params]

    def output_edges(self):
        """While a forward of the model runs inside: the gradient edges of every hooked call's
        outputs, of its modules and of the torch functions captured as calls
        (:func:`~gradhooks.engine.forward.output_edges`), for a backward that reaches every
        hooked call without forming the parameters' batch gradients."""
        hooks = self._hooks
        return output_edges((m for _, m in hooks.modules()), hooks._forwards)

    def directly_used(self) -> set[int]:
        """The ids of the hooked parameters the forwards used outside their modules' calls."""
        hooks = self._hooks
        return {pid for pid in hooks._state.direct if pid in hooks._state.params}

    def running(self) -> bool:
        """Whether a forward of the model is running now."""
        return bool(self._hooks._state.frames)

    def tracker(self) -> Tracker | None:
        """The tracker of the forward running now (``None`` outside one, or not followed)."""
        return self._hooks._forwards.tracker()

    # -- what the backwards left -------------------------------------------------------------

    def wrote(self, p: Tensor) -> bool:
        """Whether the current accumulation wrote ``p.grad1``."""
        return id(p) in self._hooks._state.written

    def by_design_unsummed(self, p: Tensor) -> bool:
        """Whether ``p``'s per-example gradients, by its rule's design, do not add up to its
        batch gradient (:attr:`gradhooks.pieces.Piece.sums_to_grad`)."""
        return id(p) in self._hooks._state.exempt

    def any_unsummed(self, params: list[Tensor]) -> bool:
        """Whether :meth:`by_design_unsummed` holds for any of ``params``."""
        exempt = self._hooks._state.exempt
        return bool(exempt) and any(id(p) in exempt for p in params)

    def rounded_terms(self, p: Tensor) -> int:
        """The terms of ``p``'s gradient autograd's kernels rounded one by one in a half
        precision (:attr:`gradhooks.pieces.Piece.rounded_terms`: the checks against autograd
        allow that many units): over the backwards accumulated into ``p.grad1`` since it last
        started afresh (without ``grad1``: the most in one backward since ``clear()``)."""
        return self._hooks._state.rounded.get(id(p), 0)

    def discard_written(self) -> None:
        """A step refused after its backward: the ``grad1`` that backward wrote is deleted and
        the quantities it collected are dropped, so that no number of the refused step is left
        to read (the backward started them afresh, reusing the memory of those before)."""
        state = self._hooks._state
        for p in state.written.values():
            if "grad1" in p.__dict__:
                del p.grad1
        state.written.clear()
        state.depth.clear()
        if state.collector is not None:
            state.collector.clear()

    def written(self) -> list[Tensor]:
        """The parameters whose ``grad1`` the current accumulation wrote."""
        return list(self._hooks._state.written.values())

    @property
    def collector(self) -> Collector | None:
        """The collector of the quantities other than ``grad1`` (``None`` for ``grad1``
        alone)."""
        return self._hooks._state.collector

    def results(self, quantity: str) -> Collector:
        """The collector, refused unless the handle computes ``quantity``."""
        return self._hooks._results(quantity)

    @property
    def precision(self) -> torch.dtype | None:
        """The lowest precision the calls of the backwards since ``clear()`` ran in."""
        return self._hooks._state.precision

    @property
    def shared_inputs(self) -> list[SharedInput]:
        """The model's inputs as long as the batch that the forwards whose calls the backwards
        since ``clear()`` captured took as shared by every example (the tracker's decision,
        :func:`gradhooks.tracking.propagate.take_as_shared`): their rows are in every example's
        gradient, no example's own."""
        return list(self._hooks._state.shared_inputs)

    @property
    def recomputes(self) -> bool:
        """Whether a forward ran calls with grad mode off (reentrant activation
        checkpointing), which only a backward without ``inputs`` runs again."""
        return self._hooks._state.recomputes

    @property
    def hessian_backprops(self) -> list[dict[int, Tensor]]:
        """autograd-hacks' ``backprop_hess`` records: per backward, ``{id(param): grad1}``
        (emptied by ``clear()``)."""
        return self._hooks._hessian_backprops

    # -- the check of a step -----------------------------------------------------------------

    @property
    def unverified(self) -> bool:
        """Whether a new set of layer calls awaits its check (``verify=True``)."""
        hooks = self._hooks
        return bool(hooks.verify and hooks._state.unverified)

    def mark_verified(self) -> None:
        """The sets of calls awaiting their check were checked (by the caller)."""
        self._hooks._state.unverified.clear()

    def mark_refused(self) -> None:
        """The caller's check of those calls refused the step: every set of calls is checked
        again at its next forward (:meth:`CaptureState.recheck`)."""
        self._hooks._state.recheck()

    def user_backward_hooks(self) -> bool:
        """Whether the model holds backward hooks of the user's, which a backward of the
        check's own would run."""
        return self._hooks._verifier.user_backward_hooks()

    def probe_precision(self) -> torch.dtype | None:
        """The precision of the forward the engine's own check is armed for (else ``None``)."""
        box = self._hooks._verifier.probe_box
        return None if box is None else box.get("precision")

    def drop_probe(self, weights: Tensor | None = None) -> None:
        """The caller checks this step itself: the engine's check is not needed. ``weights``:
        what the caller's check weighs the examples by (:func:`pieces.example_weights`), for
        :meth:`shares_size` to tell its room after the next backward."""
        hooks = self._hooks
        hooks._verifier.drop_boxes()
        hooks._state.check_weights = weights
        hooks._state.check_shares = {}

    def shares_size(self, p: Tensor) -> float:
        """After the backward that :meth:`drop_probe`'s weights were for: where several calls
        reached ``p`` in a half precision, the sum of the largest entries of their shares of
        its gradient weighted so, each rounded by autograd (the room of the caller's check of
        a gradient whose shares cancel); else 0."""
        return self._hooks._state.check_shares.get(id(p), 0.0)

    # -- backwards of the workflows' own -----------------------------------------------------

    @contextlib.contextmanager
    def backward_mode(
        self,
        *,
        capture: bool = True,
        param_grads: bool = True,
        keep: list | None = None,
    ) -> Iterator[None]:
        """Within the block, the backwards are the caller's, not the model's:

        - ``capture=False``: they write nothing (no ``grad1``, no quantity): a reweighted
          backward that only wants ``.grad``;
        - ``param_grads=False``: their parameter gradients are not used, only the quantities,
          so calls run detached give none; the forwards after it run detached the calls
          whose rules find that worth it where no batch gradient is wanted, until a backward
          that takes the parameters' gradients;
        - ``keep``: a list the collector appends each call's ``(pieces, params, scale)`` to.
        """
        hooks = self._hooks
        collector = hooks._state.collector
        if keep is not None and collector is None:
            raise ConfigurationError("backward_mode(keep=...) needs a handle with quantities")
        before = hooks._state.mode
        kept = collector.keep if collector is not None else None
        hooks._state.mode = BackwardMode(capture=capture, param_grads=param_grads)
        if keep is not None:
            collector.keep = keep
        try:
            yield
        finally:
            hooks._state.mode = before
            if keep is not None:
                collector.keep = kept
        if capture:  # (not where the block raised: the next step is not known to be alike)
            hooks._state.grads_unused = not param_grads

    @contextlib.contextmanager
    def standing_aside(self) -> Iterator[None]:
        """A backward of autograd's own through the model's graph, to check against: the hooks
        capture nothing, and calls run detached give autograd's gradients."""
        with self._hooks._verifier.standing_aside():
            yield

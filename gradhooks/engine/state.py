"""What the parts of one handle's engine share: :class:`CaptureState`.

A :class:`gradhooks.Hooks` handle owns its parts, each an object with its own methods:
:class:`~gradhooks.engine.forward.ForwardCapture` (a forward: frames, the tracker, the calls kept),
:class:`~gradhooks.engine.backward.BackwardWriter` (a backward: pieces into ``grad1`` and the
quantities, its bookkeeping), :class:`~gradhooks.engine.calls.CallLayouts` (where the examples are
in each call), :class:`~gradhooks.engine.capture.DetachedCalls` (calls run detached, owned or
carried) and :class:`~gradhooks.engine.verify.Verifier` (the checks of a backward). What more than
one of them reads or writes is here, in one record they are each given, so that a reader finds
every piece of shared state, and what it means, in one place.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor, nn

from ..quantities import Collector
from ..rules.registry import Registry
from ..tracking import Tracker
from .accumulation import GradTrail
from .backprops import KeptBackprops
from .link import TrackerLink
from .pause import PROCESS, Pause
from .plan import Target
from .records import Backward, BackwardMode, Frame

__all__ = ["CaptureState"]


class CaptureState:
    """The state one handle's parts share (see the module docstring). The settings are those of
    :func:`gradhooks.add_hooks`; the rest is set as the hooks are planned and as forwards and
    backwards run."""

    def __init__(
        self,
        model: nn.Module,
        *,
        loss_reduction: str,
        unsupported: str,
        registry: Registry,
        quantities: tuple[str, ...],
        batch_dim: int | str | None,
        max_grad1_bytes: int | str | None,
        capture: str,
        verify: bool,
    ) -> None:
        # -- the settings ---------------------------------------------------------------------
        self.model_ref = weakref.ref(model)
        self.loss_reduction = loss_reduction
        self.unsupported = unsupported
        self.registry = registry
        self.quantities = quantities
        self.batch_dim = batch_dim
        self.max_grad1_bytes = max_grad1_bytes
        self.capture = capture
        self.verify = verify
        self.grad1 = "grad1" in quantities
        # the Jacobians' and kfac()'s handles run their backwards batched under vmap themselves:
        # a batched output-gradient there is theirs, not a user's is_grads_batched backward
        self.vmapped = bool({"_jacobian", "_vmapped"} & set(quantities))
        # the quantities the probe (Verifier.probe) checks one example of
        self.checks_examples = self.grad1 or "norms" in quantities
        self.collector = Collector(model, quantities) if quantities != ("grad1",) else None

        # -- what is hooked (set by the handle's planning) -------------------------------------
        # parameters sharded by FSDP2 (DTensors), by qualified name (every slot): the hooks are
        # planned with these, whatever stand-in FSDP2 has put in their slots at the time
        self.shards: dict[str, nn.Parameter] = {}
        self.sharded: set[int] = set()  # their ids: per-example norms, no grad1
        # each hooked parameter's AccumulateGrad node, the handle of the pre-hook on it and the
        # parameter's shape then, by id (held: a leaf's node lives while referred to)
        self.accumulators: dict[int, tuple[Any, Any, torch.Size]] = {}
        self.targets: list[Target] = []
        self.params: dict[int, tuple[str, nn.Parameter]] = {}  # trainable, covered, unique
        self.numel = 0  # the elements of params
        # the TorchScript modules of the model, by id, with their qualified names: no torch
        # function they run reaches the tracker (see :mod:`.opaque`)
        self.scripted: dict[int, str] = {}
        self.hooked: dict[int, frozenset[str]] = {}  # id(module) -> its hooked parameter names
        self.current: dict[int, nn.Parameter] = {}  # sharded id -> its unsharded parameter
        self.link: TrackerLink | None = None  # what a forward's tracker reports to
        # autograd-hacks' layer.activations and layer.backprops_list (keep_backprops=True)
        self.kept_backprops: KeptBackprops | None = None

        # -- whether and how what runs is captured ---------------------------------------------
        self.removed = False
        self.pause = Pause(PROCESS)  # `with h.paused():`, under gradhooks.paused()
        self.marked = 0  # depth of `with h.capturing()`
        self.mode = BackwardMode()  # (a workflow's own backwards: EngineAPI.backward_mode)
        # the last backward of a workflow's took no parameter gradient (the book-keeping DP
        # step's): the next forwards run detached the calls whose rules say it is worth it
        # where no batch gradient is wanted (register(detach_without_grads=...)), until a
        # backward computes the parameters' gradients again
        self.grads_unused = False
        self.frames: list[Frame] = []  # root forwards running
        self.tasks: dict[int, Backward] = {}  # backwards running, by graph task id
        # what the calls of forwards whose backward has run keep for it (weak references to
        # KeptCall or Held): let go of at its end (calls.release_spent)
        self.spent: list = []
        # inside a rerun of a detached call, or a per-example backward of the tracker's
        self.rerunning = 0
        self.probing = False  # inside the probe's backward
        # a call ran with grad mode off inside a forward, or given an input that requires grad
        # (reentrant activation checkpointing, also of the model or of its layers one by one:
        # run again by a backward, but not by torch.autograd.grad, which gradhooks.dp then
        # avoids)
        self.recomputes = False
        # where such a call's input held the examples, by id of its module, for its rerun
        # during the backward (ForwardCapture.note_rerun): None where on the rule's dimension
        # as given, else that layout in words; and the batch
        self.reruns: dict[int, tuple[str | None, int]] = {}
        # the trainable parameters the last planning left out that the one before covered,
        # {id: (name, weak reference to the parameter)}: a forward through torch.func.functional_call with other
        # tensors in their slots plans the hooks for those; a backward of an earlier forward
        # that reaches calls of these parameters (a student's, after its teacher's
        # functional_call) hooks them again, alongside the plan's (Hooks._hook_dropped), and
        # notes them in ``rehooked``, until the next planning
        self.dropped: dict[int, tuple[str, weakref.ref]] = {}
        self.rehooked: set[int] = set()

        # -- the accumulation of grad1 ---------------------------------------------------------
        # the parameters whose grad1 the next captured backward adds to (the accumulation
        # goes on), and whose grad1 it replaces if it reaches them, else deletes or zeroes
        # (left from before a zero_grad or clear(): stale), by id
        self.written: dict[int, nn.Parameter] = {}
        self.stale: dict[int, nn.Parameter] = {}
        self.trail = GradTrail()  # the .grad the backwards left (gradhooks.engine.accumulation)
        self.depth: dict[int, int] = {}  # captured backwards in each parameter's grad1
        self.forward_of: dict[int, weakref.ref] = {}  # the forward its last grad1 came from
        # set aside while torch.autograd.grad passes add to grad1 what they return: the grad1
        # that .grad's rows were (None: none), with its depth, rounded terms and their scale,
        # which the next backward adding into .grad puts back before adding
        # (BackwardWriter.set_aside)
        self.aside: dict[int, tuple[Tensor | None, int | None, int | None, Tensor | None]] = {}
        self.missed: dict[str, None] = {}  # parameters a backward computed without capture
        # the lowest precision the calls of the backwards since clear() ran in (the checks'
        # tolerance: records.lowest_precision)
        self.precision: torch.dtype | None = None
        # the model's inputs as long as the batch taken as shared by every example in the
        # forwards whose calls the backwards since clear() captured (records.Frame.shared)
        self.shared_inputs: dict[Any, None] = {}
        # per parameter id, the terms autograd's kernels rounded one by one in a half precision
        # (pieces.Piece.rounded_terms: the checks' room) in the backwards accumulated into its
        # grad1 since it last started afresh (without grad1: the most in one backward since
        # clear())
        self.rounded: dict[int, int] = {}
        # and the scale of their rounding, as rounded holds them (pieces.Piece.terms_scale)
        self.terms_scale: dict[int, Tensor] = {}
        self.backwards = 0  # backwards that captured a call, since the hooks were added
        # the model's training flag at the last captured forward: check() recomputes the
        # examples in the mode the model is in at its call (None: no forward captured yet)
        self.training_at_forward: bool | None = None
        self.exempt: set[int] = set()  # parameters whose grad1 does not sum to .grad by design

        # -- the last line of defence (Verifier) -----------------------------------------------
        self.verified: set[tuple] = set()  # signatures of the calls of a forward
        self.unverified: set[tuple] = set()
        # the weights a workflow's own check of the next verified backward weighs the examples
        # by, where the engine's probe stands aside (dp_sgd_step's), and, per parameter id
        # that several calls of that backward reached in a half precision, the sum of the
        # largest entries of their shares weighted so (records.Backward.shares): the room of
        # that check
        self.check_weights: Tensor | None = None
        self.check_shares: dict[int, float] = {}
        # the spot check of the backwards in between (Verifier.spot_check): the position,
        # among params, of the parameter the next one compares; the entries compared, by id
        self.spot_next = 0
        # (its numel then, the entries, their flat indices in a grad1 of each batch, and a row
        # of ones of each batch: the sum over the examples)
        self.spot_entries: dict[int, list] = {}

        # -- parameters used outside their modules' calls --------------------------------------
        # by id: the sources of their uses
        self.direct: dict[int, weakref.WeakSet] = {}
        # source -> the forward it was seen in (for forward_of, and the probe's check of a forward
        # whose parameters are all used directly): held as long as the source, which the
        # forward's graph holds, as a captured call holds its forward
        self.source_frames: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # sources with a problem that no autograd graph holds (found where the forward recorded
        # none): kept until a backward ends, so that the parameter's gradient reports it
        self.unheld: list = []

        # -- calls running with their parameters detached (DetachedCalls) ----------------------
        # innermost last, by id(module): their capture.DetachedCall records
        self.detached: dict[int, list] = {}
        self.aliases_checked: set[int] = set()  # modules whose detached call was checked

    @property
    def model(self) -> nn.Module | None:
        return self.model_ref()

    def tracker(self) -> Tracker | None:
        """The tracker of the forward running now (``None`` outside one, or not followed)."""
        return self.frames[-1].tracker if self.frames else None

    def capturing_backward(self) -> bool:
        """Whether a backward starting now is captured (not paused, and marked where
        ``capture="marked"``)."""
        return self.pause.on and (self.capture == "always" or self.marked > 0)

    def recheck(self) -> None:
        """A check refused a backward (the calls' sums, the probe of the examples, a step's
        own): every set of calls is checked again at its next forward, as a new one is, until
        a check passes, not at the 2nd, 4th, 8th... backward alone. A loop that catches the
        refusal and goes on is refused again at the next step that mixes the examples, rather
        than given its ``grad1`` unchecked."""
        self.verified.clear()

    def __repr__(self) -> str:
        return f"CaptureState({len(self.targets)} modules)"

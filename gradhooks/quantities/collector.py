"""Quantities other than ``grad1``, computed from the pieces of one backward, for every layer.

The engine hands every piece of a backward to a :class:`Collector` (one per :class:`Hooks`
handle). The collector keeps each parameter's pieces until the backward ends (a callback queued
on the autograd engine from inside the first gradient hook), then computes what was asked:

- ``"norms"``: per-example gradient norms per parameter and in total (the ghost norm), with the
  cross terms between the calls of a reused module and between the users of a tied weight:
  ``‖Σ_j G_j‖² = Σ_j Σ_k ⟨G_j, G_k⟩``.
- ``"sum_grad_sq"``: ``Σ_b grad1[b]²`` per parameter (diagonal empirical Fisher) and the
  per-example gradient variance.
- ``"kfac"``: Kronecker factors (see :mod:`gradhooks.workflows.kfac`).

``grad1`` is never materialized for a whole model: where a layer's maths needs it, it is formed
for one parameter and a slice of the batch at a time.

Every result is of the per-example losses' own gradients: the engine's ``scale`` (batch size
for a mean-reduced loss, 1 for a sum) is applied, as for ``grad1``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .. import _torch, devices
from .. import pieces as P
from ..engine.records import autocast_off
from ..errors import BatchNotFoundError, UnsupportedError
from ..tuning import TUNING
from .kfac import KfacAccumulator

__all__ = ["QUANTITIES", "Collector", "total_norms"]

QUANTITIES = ("grad1", "norms", "sum_grad_sq", "kfac")
# internal: gradhooks.jacobians() runs the backward under torch.func.vmap over the outputs
_INTERNAL = ("_jacobian", "_vmapped")  # "_vmapped": gradhooks.kfac's backwards run under vmap


@dataclass
class _Held:
    """The pieces of one parameter in the current backward, each with the engine's scale."""

    param: nn.Parameter
    pieces: list[tuple[P.Piece, float]] = field(default_factory=list)


class Collector:
    """Keeps the pieces of one backward and computes the requested quantities at its end."""

    def __init__(self, model: nn.Module, quantities: tuple[str, ...]) -> None:
        self.quantities = quantities
        self.names = {}
        for name, p in model.named_parameters():
            self.names.setdefault(id(p), name)
        self._order: dict[str, int] = {}  # name -> its place in self.names (the results' order)
        self._ordered_for = -1  # (len(self.names) when _order was made)
        self._held: dict[int, _Held] = {}
        # calls per parameter in the forward(s) not yet backpropagated: a parameter's pieces are
        # reduced (and freed) as soon as all its calls' pieces arrived, not at the end
        self._expected: dict[int, int] = {}
        # parameters whose pieces wait for the end of the backward (a call of theirs is rerun
        # during the backward: reentrant activation checkpointing)
        self.defer: set[int] = set()
        self._done: dict[str, tuple] = {}
        self._queued = False
        self.param_sq_norms: dict[str, Tensor] = {}
        # parameters the last backward computed a gradient for without capturing their calls:
        # left out of param_sq_norms, so the whole-model norms would be too small
        self.missed: list[str] = []
        # parameters the last backward computed a gradient for while it reached none of the
        # calls captured: the results of the backward before are not that one's, none published
        self.unreached: list[str] = []
        self.norm_forms: dict[str, str] = {}  # how each parameter's norm was formed
        self._forms: dict[str, str] = {}  # (of the backward running)
        # per parameter whose norms kept the Gram form's rounding (on a device: see
        # _gram_rounding_repaired), the scale of that rounding, [batch]
        # (gram_rounding_bound: its bound on each example's squared norm)
        self.gram_rounding: dict[str, Tensor] = {}
        self._rounding: dict[str, Tensor] = {}  # (of the backward running)
        self.sum_grad_sq: dict[str, Tensor] = {}
        self.grad_mean: dict[str, Tensor | _Deferred] = {}  # a _Deferred: formed when asked
        self.batch: int | None = None
        # whether a backward's results were published since the hooks were added or cleared
        self.published = False
        self.kfac = KfacAccumulator(self.names) if "kfac" in quantities else None
        self.jacobian: dict[int, Tensor] = {}  # id(param) -> [batch, outputs, *shape], preset
        self.jacobian_written: set[int] = set()
        # the output whose backward runs, where the Jacobians' backwards run one at a time
        # (without vmap: gradhooks._torch.batched_backwards); None under vmap
        self.jacobian_column: int | None = None
        # while a list: every call's pieces of the backward, (pieces, params, scale), for
        # dp_sgd_step's book-keeping path (gradhooks.workflows.dp)
        self.keep: list[P.CallPieces] | None = None
        # while a dict (keeping_grad1): the per-example gradients the norms formed, kept
        self._grad1_store: dict[int, list[Tensor]] | None = None

    @contextmanager
    def keeping_grad1(self) -> Iterator[dict[int, list[Tensor]]]:
        """Within: where the norms of a parameter are computed from its per-example gradient,
        formed a slice of the batch at a time (the cheapest exact form: see
        :meth:`gradhooks.Hooks.norm_forms`, ``"materialized"``), and the whole of it takes no
        more elements than the pieces of the parameter held for that (so no more than a
        book-keeping step keeps of it anyway), the slices are kept in the dict yielded:
        ``{id(param): [grad1[rows], ...]}``, the slices in the batch's order, each
        ``[rows, *param.shape]`` (the gradient of each example's own loss). A weighted sum of
        them is then the weighted batch gradient, without a product of the pieces again."""
        self._grad1_store = store = {}
        try:
            yield store
        finally:
            self._grad1_store = None

    def clear(self) -> None:
        self._held.clear()
        self._done = {}
        self.param_sq_norms = {}
        self.missed = []
        self.unreached = []
        self.norm_forms, self._forms = {}, {}
        self.gram_rounding, self._rounding = {}, {}
        self.sum_grad_sq = {}
        self.grad_mean = {}
        self.batch = None
        self.published = False
        self.jacobian_written = set()
        if self.kfac is not None:
            self.kfac.clear()

    def results(self) -> tuple:
        """The results published now (for :meth:`restore`: the dicts themselves, which a
        backward's end replaces, never changes)."""
        return (
            self.param_sq_norms, self.norm_forms, self.gram_rounding, self.sum_grad_sq,
            self.grad_mean, self.batch, self.published, self.unreached,
        )  # fmt: skip

    def restore(self, results: tuple) -> None:
        """Publish again what :meth:`results` gave (a later backward's were refused)."""
        (
            self.param_sq_norms, self.norm_forms, self.gram_rounding, self.sum_grad_sq,
            self.grad_mean, self.batch, self.published, self.unreached,
        ) = results  # fmt: skip

    def forget_results(self, names: list[str]) -> None:
        """A backward computed the gradient of ``names`` and reached none of the calls
        captured: what is published is an earlier backward's, never to be read for this one."""
        self.param_sq_norms, self.norm_forms, self.gram_rounding = {}, {}, {}
        self.sum_grad_sq, self.grad_mean, self.batch = {}, {}, None
        self.unreached = list(names)

    def rescale(self, factor: Callable[[int], float]) -> None:
        """The per-example gradients were ``factor(batch)`` times what they are taken for
        (:meth:`gradhooks.Hooks.rescale`): multiply the published norms by it, the squared sums
        by its square, the gradient means by it, and the K-FAC ``G`` by its square (see
        :meth:`KfacAccumulator.rescale`). New dicts, as a backward's end publishes them
        (:meth:`results`)."""
        f = factor(self.batch or 0)
        self.param_sq_norms = {n: v * f**2 for n, v in self.param_sq_norms.items()}
        self.gram_rounding = {n: v * abs(f) for n, v in self.gram_rounding.items()}
        self.sum_grad_sq = {n: v * f**2 for n, v in self.sum_grad_sq.items()}
        self.grad_mean = {n: _scaled(m, f) for n, m in self.grad_mean.items()}
        if self.kfac is not None:
            self.kfac.rescale(factor)

    def restart(self, params: list[nn.Parameter]) -> None:
        """These parameters' ``.grad`` was reset (``zero_grad``) since the last backward: what
        accumulates over backwards (the K-FAC factors) starts afresh for them. The other
        quantities are each backward's own."""
        if self.kfac is not None:
            self.kfac.restart(self.names[id(p)] for p in params if id(p) in self.names)

    def add(
        self,
        qualname: str,
        call_pieces: dict,
        params: dict,
        scale: float,
        sums: dict[int, Tensor] | None = None,
    ) -> None:
        """Called by the engine for every call of a hooked module in a backward. ``sums``: where
        a parameter's norms are computed now from this call's ``grad1`` formed a slice at a
        time, ``sums[id(param)]`` gets its batch sum ``Σ_b grad1[b]`` (scaled) as a by-product
        (the engine's batch gradient for a call run with its parameters detached)."""
        # (under autocast a rule's pieces may be narrower than the parameters: widened to
        # their dtype first, for every quantity and the Jacobians)
        call_pieces = {
            n: pc if n not in params else pc.in_dtype(P.accumulation_dtype(params[n].dtype))
            for n, pc in call_pieces.items()
        }
        if "_jacobian" in self.quantities:
            self._add_jacobian(call_pieces, params, scale)
            return
        if not self._queued:
            _torch.queue_backward_callback(self._finish)
            self._queued = True
        if self.keep is not None:  # fresh pieces: none of the columns the norms may cache
            self.keep.append(
                P.CallPieces({n: call_pieces[n].select(slice(None)) for n in params}, params, scale)
            )
        if self.kfac is not None:
            self.kfac.add(qualname, call_pieces, params, scale)
        if "norms" in self.quantities or "sum_grad_sq" in self.quantities:
            for pname, p in params.items():
                held = self._held.get(id(p))
                if held is None:
                    held = self._held[id(p)] = _Held(p)
                held.pieces.append((call_pieces[pname], scale))
                expected = self._expected.get(id(p), 0)
                if expected and len(held.pieces) >= expected and id(p) not in self.defer:
                    del self._held[id(p)]
                    self._expected[id(p)] = 0
                    self._reduce(held, sums if len(held.pieces) == 1 else None)

    def expect(self, params: dict) -> None:
        """Called by the engine for every captured forward call: one more piece will come."""
        if "norms" in self.quantities or "sum_grad_sq" in self.quantities:
            for p in params.values():
                self._expected[id(p)] = self._expected.get(id(p), 0) + 1

    def unexpect(self, params: dict) -> None:
        """A captured call whose forward raised: its piece will never come."""
        for p in params.values():
            if self._expected.get(id(p), 0) > 0:
                self._expected[id(p)] -= 1
                if not self._expected[id(p)]:
                    del self._expected[id(p)]

    def drop(self, pids: set[int]) -> None:
        """Forget what the running backward gave for the parameters of these ids: autograd
        computed no gradient for them (a ``backward(inputs=...)`` that left them out)."""
        for pid in pids:
            self._held.pop(pid, None)
            self._done.pop(self.names.get(pid, f"<param {pid}>"), None)

    def discard_backward(self) -> None:
        """Forget what the running backward gave (it failed, or computed no parameter's
        gradient); the results of earlier backwards stay."""
        self._held.clear()
        self._done = {}
        self._queued = False

    def _add_jacobian(self, call_pieces: dict, params: dict, scale: float) -> None:
        """Under ``vmap`` over the outputs: ``grad1`` is batched; its physical tensor,
        ``[outputs, batch, *shape]``, goes into ``self.jacobian[id(p)]`` (``[batch, outputs,
        *shape]``, allocated by the caller), summed over calls (reuse) and users (tied). One
        output at a time (``jacobian_column``, no vmap): ``grad1`` is added into its column,
        which the caller zeroed."""
        if self.jacobian_column is not None:
            for pname, p in params.items():
                self.jacobian_written.add(id(p))
                column = self.jacobian[id(p)][:, self.jacobian_column]
                column.add_(call_pieces[pname].grad1(p.shape, scale))
            return
        for pname, p in params.items():
            piece = call_pieces[pname]
            into = self.jacobian[id(p)].transpose(0, 1)  # [outputs, batch, *shape]
            first = id(p) not in self.jacobian_written
            self.jacobian_written.add(id(p))
            if piece.jacobian_into(into, scale, first):  # (its own form)
                continue
            g1 = piece.grad1(p.shape, scale)
            physical = _torch.unbatched(g1)
            # (not batched: the same for every output; cannot happen for a vmapped
            # output-gradient)
            g1 = g1.unsqueeze(0) if physical is None else physical
            if first:
                into.copy_(g1)
            else:
                into.add_(g1)

    # -- at the end of the backward ---------------------------------------------------------------

    def _reduce(self, h: _Held, sums: dict[int, Tensor] | None = None) -> None:
        """This parameter's quantities from all its pieces of this backward (``sums``: see
        :meth:`add`)."""
        name = self.names.get(id(h.param), f"<param {id(h.param)}>")
        if name in self._done:
            raise UnsupportedError(
                f"'{name}' received another call's gradient after its per-example quantities were "
                "computed in this backward (a forward re-run during the backward, e.g. activation "
                "checkpointing?): norms/sum_grad_sq cannot include that call; use grad1 instead"
            )
        batch = h.pieces[0][0].batch_size
        sq = None
        if "norms" in self.quantities:
            sq, self._forms[name] = _sq_norm(h, sums, self._grad1_store, self._rounding, name)
        sum_sq = mean = None
        if "sum_grad_sq" in self.quantities:
            # the batch gradient (for the mean) once: a by-product of the squares or of the
            # norms where they form grad1 a slice at a time, else from the pieces; it is also
            # the engine's batch gradient of a call run detached (``sums``)
            found: dict[int, Tensor] = {}
            sum_sq = _sum_sq(h, found)
            total = found.get(id(h.param))
            if total is None and sums is not None:
                total = sums.get(id(h.param))
            if (
                total is None
                and sums is None
                and sum(pc.kept_elements for pc, _ in h.pieces) <= h.param.numel()
            ):
                # what autograd's .grad also forms (a product, a scatter), only if asked for,
                # where keeping its pieces takes no more memory than the mean would
                mean: Tensor | _Deferred = _Deferred(h.pieces, h.param.shape, batch)
            else:
                if total is None:
                    total = _batch_total(h.pieces, h.param.shape)
                if sums is not None:
                    sums.setdefault(id(h.param), total)
                mean = total / max(batch, 1)
        self._done[name] = (batch, sq, sum_sq, mean)

    def _finish(self) -> None:
        """At the end of the backward: reduce what is still held, publish the results."""
        with autocast_off():
            self._finish_backward()

    def _finish_backward(self) -> None:
        self._queued = False
        self.published = True
        self.unreached = []
        held, self._held = self._held, {}
        self._expected = {}  # the forward's calls are consumed by this backward
        if self.kfac is not None:
            self.kfac.end_backward()
        for h in held.values():
            self._reduce(h)
        done, self._done = self._done, {}
        if not done:
            return
        batches = {d[0] for d in done.values()}
        if len(batches) != 1:
            raise BatchNotFoundError(
                f"the hooked layers saw different batch sizes in one backward ({sorted(batches)}): "
                "per-example quantities need every layer to see the same batch"
            )
        # (in the model's order of its parameters, as named_parameters() gives them, rather
        # than the order the backward reached them)
        if self._ordered_for != len(self.names):  # (names are only ever added)
            self._order = {}
            for i, n in enumerate(self.names.values()):
                self._order.setdefault(n, i)
            self._ordered_for = len(self.names)
        order = self._order
        done = dict(sorted(done.items(), key=lambda item: order.get(item[0], len(order))))
        self.param_sq_norms = {n: d[1] for n, d in done.items() if d[1] is not None}
        self.norm_forms, self._forms = {n: self._forms[n] for n in self.param_sq_norms}, {}
        self.gram_rounding, self._rounding = self._rounding, {}
        self.sum_grad_sq = {n: d[2] for n, d in done.items() if d[2] is not None}
        self.grad_mean = {n: d[3] for n, d in done.items() if d[3] is not None}
        (self.batch,) = batches


def _materialized(h: _Held) -> Iterator[tuple[slice, Tensor]]:
    """The parameter's per-example gradient ``Σ_j scale_j grad1_j``, ``[rows, *shape]``, a slice
    of the batch at a time (so that at most ~``TUNING.chunk_elements`` elements exist at once)."""
    batch = h.pieces[0][0].batch_size
    per_example = max([h.param.numel()] + [piece.transient for piece, _ in h.pieces])
    rows = max(1, TUNING.chunk_elements // max(per_example, 1))
    cache_slices = all(piece.cache_slices for piece, _ in h.pieces)
    cache_rows = TUNING.cache_elements // max(per_example, 1)
    if cache_slices and cache_rows >= TUNING.cache_min_rows:
        rows = min(rows, cache_rows)
    # no slice larger than a piece forms in one call (it would be formed in parts and copied)
    rows = min([rows] + [r for p, _ in h.pieces if (r := p.call_rows)])
    # (a tied weight: the pieces after the first added into its grad1 in place, an embedding's
    # by a scatter of its rows, where that grad1 is a new tensor of its own: an Outer's or Rows')
    owned = isinstance(h.pieces[0][0], (P.Outer, P.Rows))
    for start in range(0, batch, rows):
        sl = slice(start, min(start + rows, batch))
        total = None
        for piece, scale in h.pieces:
            part = piece.select(sl)
            if total is None:
                total = part.grad1(h.param.shape, scale)
            elif owned and not total.requires_grad and not _torch.in_transform(total):
                part.grad1_into(total, scale, accumulate=True)
            else:
                total = total + part.grad1(h.param.shape, scale)
        yield sl, total


def _gram_with_sum_is_cheaper(piece: P.Piece) -> bool:
    """For a piece whose norms are wanted together with its batch gradient (a call run with its
    parameters detached): whether the Gram form (``piece.gram_macs`` per example: ``T²·(in +
    out)``, less for a convolution whose input has few positions) and then the batch
    gradient's own ``batch·T·in·out`` cost less than forming ``grad1`` a slice at a time (the
    same ``batch·T·in·out``, more where it forms duplicated columns: ``grad1_extra_macs``,
    then a few passes over ``batch·in·out`` floats, the batch gradient among them). A bias
    (``a is None``): never (its ``grad1`` is the Gram form's first step)."""
    if not isinstance(piece, P.Outer) or not piece.has_input:
        return False
    per_example = math.prod(piece.g.shape[1:-2]) * piece.in_features * piece.g.shape[-1]
    return piece.gram_macs < TUNING.pass_macs * per_example + piece.grad1_extra_macs


def _one_sq_norm(
    piece: P.Piece, scale: float, param: nn.Parameter, sums: dict[int, Tensor] | None
) -> tuple[Tensor, str] | None:
    """:func:`_sq_norm` of a parameter with one piece in the backward (no reuse, no tie), where
    no product is needed (:meth:`gradhooks.pieces.Piece.sq_norm`: one shared position, a bias,
    ``grad1`` at hand; an Embedding's rows). On small layers the general path's bookkeeping
    costs more than this arithmetic. With its form (see :meth:`gradhooks.Hooks.norm_forms`);
    ``None``: the general path."""
    found = piece.sq_norm(param.shape, scale, with_sum=sums is not None)
    if found is None:
        return None
    sq, form, total = found
    if sums is not None and total is not None:
        sums[id(param)] = total
    return sq, form


def _sq_norm(
    h: _Held,
    sums: dict[int, Tensor] | None = None,
    store: dict | None = None,
    rounding: dict[str, Tensor] | None = None,
    name: str = "",
) -> tuple[Tensor, str]:
    """``‖Σ_j scale_j grad1_j[b]‖²`` for every example ``b``, shape ``[batch]``, and how it
    was formed (see :meth:`gradhooks.Hooks.norm_forms`). Where that forms the per-example
    gradient, ``sums[id(param)]`` (if given) gets its batch sum, and ``store`` (if given) its
    slices where they take no more elements than the pieces (:meth:`Collector.keeping_grad1`).
    Where it keeps the Gram form's rounding, ``rounding[name]`` (if given) gets its bound."""
    if len(h.pieces) == 1:
        single = _one_sq_norm(*h.pieces[0], h.param, sums)
        if single is not None:
            return single
    shape = h.param.shape
    rows = [(p, s) for p, s in h.pieces if isinstance(p, P.Rows)]
    ps = [(p, s) for p, s in h.pieces if not isinstance(p, P.Rows)]
    cheap = all(P.gram_is_cheaper(p, q) for i, (p, _) in enumerate(ps) for q, _ in ps[i:])
    if cheap and sums is not None and len(ps) == 1 and not _gram_with_sum_is_cheaper(ps[0][0]):
        cheap = False  # grad1 a slice at a time gives the batch gradient as a by-product
    total = None
    if cheap and rows and ps:  # a tied weight: embedding rows and an output layer's outer
        cross = []
        for p, sp in rows:
            for q, sq in ps:
                term = P.rows_outer_inner(p, q) if isinstance(q, P.Outer) else None
                if term is None:
                    cheap = False
                    break
                cross.append(term * (2 * sp * sq))
            if not cheap:
                break
        if cheap:
            total = sum(cross[1:], cross[0])
    if cheap:
        if rows:  # every Rows piece together, cross terms included, on the rows they touch
            term = P.rows_sq_norm(rows)
            total = term if total is None else total + term
        scale = None  # Σ_j |scale_j| Σ_s ‖a_j[s]‖·‖g_j[s]‖ of the Gram forms (their rounding)
        for i, (p, sp) in enumerate(ps):
            for j in range(i, len(ps)):
                q, sq = ps[j]
                if i == j:
                    term, spread = P.gram_sq_norm(p, shape)
                    if sp != 1.0:  # (a loss's sum: the scale is 1)
                        term = term * (sp * sp)
                    if spread is not None:
                        spread = spread if sp == 1.0 else spread * abs(sp)
                        scale = spread if scale is None else scale + spread
                else:
                    term = P.inner(p, q, shape) * (2 * sp * sq)
                total = term if total is None else total + term
        if scale is not None:
            total, kept_scale = _gram_rounding_repaired(h, total, scale)
            if kept_scale is not None and rounding is not None:
                rounding[name] = kept_scale
        return total, "gram"
    kept = None
    if store is not None and h.pieces[0][0].batch_size * h.param.numel() <= _elements(h):
        kept = []
    parts, total = [], None
    for _, g in _materialized(h):
        parts.append(torch.linalg.vector_norm(P.flat_rows(g), dim=1).square())
        if sums is not None:
            total = g.sum(0) if total is None else total + g.sum(0)
        if kept is not None:
            kept.append(g)
    if total is not None:
        sums[id(h.param)] = total
    if kept is not None:
        store[id(h.param)] = kept
    return (torch.cat(parts) if parts else h.param.new_zeros(0)), "materialized"


# The Gram form's rounding of a squared norm, in units of ``eps · scale²`` (measured below 0.5
# where the positions' gradients cancel exactly; tests/test_fuzz_regressions.py)
GRAM_ROUNDING_UNITS = 16


def gram_rounding_bound(scale: Tensor) -> Tensor:
    """The bound of the Gram form's rounding of the squared norms whose ``scale`` (``[batch]``:
    see :func:`gradhooks.pieces.gram_sq_norm`) :func:`_gram_rounding_repaired` kept:
    ``GRAM_ROUNDING_UNITS · eps · scale²``."""
    return GRAM_ROUNDING_UNITS * torch.finfo(scale.dtype).eps * scale.square()


def _gram_rounding_repaired(h: _Held, sq: Tensor, scale: Tensor) -> tuple[Tensor, Tensor | None]:
    """The Gram form's squared norms ``sq`` of ``h``'s parameter, ``[batch]``, at least 0, with
    the examples whose value is below ``sqrt(eps) · scale²`` formed again from ``grad1``, one
    example at a time, where reading the values costs no wait (:func:`devices.reads_are_free`);
    and, where they are not (a device: the values stand), ``scale`` itself, for the run-time
    check to allow for their rounding (:func:`gram_rounding_bound`; else ``None``): formed
    only where a check reads it, not at every backward.

    The Gram form's rounding is about ``eps · scale²`` (``scale``: see
    :func:`gradhooks.pieces.gram_sq_norm`), so below that bound its norm has kept fewer than
    half the dtype's digits: where the shared positions' gradients cancel (a weight whose
    per-example gradient is 0 while each position's is not) it gives ``sqrt(eps) · scale``
    for 0, or a negative square. ``grad1`` formed rounds each entry relative to ``scale``."""
    if not devices.reads_are_free(sq):
        return sq.clamp_min(0), scale
    # (sq - sqrt(eps)·scale² < 0: one fused operation, and the rows found in the same pass)
    eps = torch.finfo(sq.dtype).eps
    lost = (torch.addcmul(sq, scale, scale, value=-math.sqrt(eps)) < 0).nonzero()
    if not lost.numel():
        return sq, None
    sq = sq.clone()
    for b in lost[:, 0].tolist():
        one = _Held(h.param, [(piece.select(slice(b, b + 1)), s) for piece, s in h.pieces])
        for _, g in _materialized(one):
            sq[b] = torch.linalg.vector_norm(g).square()
    return sq, None
    sq = sq.clone()
    for b in lost.nonzero()[:, 0].tolist():
        one = _Held(h.param, [(piece.select(slice(b, b + 1)), s) for piece, s in h.pieces])
        for _, g in _materialized(one):
            sq[b] = torch.linalg.vector_norm(g).square()
    return sq, None


def _elements(h: _Held) -> int:
    """The elements of the tensors the parameter's pieces hold (layer inputs, output-gradients)."""
    return sum(t.numel() for pc, _ in h.pieces for t in vars(pc).values() if isinstance(t, Tensor))


class _Deferred:
    """The gradient mean of :meth:`Collector._reduce` (``Σ_b grad1[b] / batch``), formed
    from the pieces only when :meth:`gradhooks.Hooks.grad_variance` asks for it (once)."""

    def __init__(self, pieces: list, shape: torch.Size, batch: int) -> None:
        self.pieces, self.shape, self.batch = list(pieces), shape, batch
        self.value: Tensor | None = None

    def __call__(self) -> Tensor:
        if self.value is None:
            with autocast_off():
                total = _batch_total(self.pieces, self.shape)
            self.value, self.pieces = total / max(self.batch, 1), []
        return self.value


def _scaled(mean: Tensor | _Deferred, f: float) -> Tensor | _Deferred:
    """A gradient mean times ``f``; one not yet formed stays so, its pieces' scales times
    ``f``."""
    if isinstance(mean, Tensor):
        return mean * f
    if mean.value is not None:
        return mean.value * f
    return _Deferred([(pc, s * f) for pc, s in mean.pieces], mean.shape, mean.batch)


def _batch_total(pieces: list, shape: torch.Size) -> Tensor:
    """``Σ_b Σ_j scale_j grad1_j[b]``, shape ``shape``, from the (scaled) pieces."""
    return sum(s * pc.batch_sum(shape) for pc, s in pieces)


def _sum_sq(h: _Held, sums: dict[int, Tensor] | None = None) -> Tensor:
    """``Σ_b (Σ_j scale_j grad1_j[b])²``, shape ``param.shape``. Where that forms the
    per-example gradient, ``sums[id(param)]`` (if given) gets its batch sum."""
    if all(isinstance(p, P.Rows) for p, _ in h.pieces):
        return P.rows_sum_sq(h.pieces, h.param.shape)
    if len(h.pieces) == 1:
        piece, scale = h.pieces[0]
        direct = piece.sum_sq(h.param.shape)
        if direct is not None:
            return direct * scale**2
    total = batch_sum = None
    for _, g in _materialized(h):
        part = g.square().sum(0)
        total = part if total is None else total + part
        if sums is not None:
            part = g.sum(0)
            batch_sum = part if batch_sum is None else batch_sum + part
    if total is None:  # empty batch
        total = torch.zeros_like(h.param)
    if batch_sum is not None:
        sums[id(h.param)] = batch_sum
    return total


def total_norms(sq_norms: dict[str, Tensor]) -> Tensor:
    """Per-example norm of the gradient of all parameters together, ``[batch]``."""
    return torch.stack(list(sq_norms.values())).sum(0).sqrt()

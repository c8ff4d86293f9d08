"""Products that couple the examples' gradients after the batch was reduced.

A reduction over the batch (``loss.mean()``, ``probs.mean(0)``) is *mixed*
(:data:`~.layout.MIXED`): a layer given it is refused. What is computed from it without a layer
(a loss inside the model's forward) is not, and most of it is harmless: a sum of per-example
losses, divided by a number common to every example (the batch's token count, a padding mask's
sum), has each example's gradient as its share, up to that common factor. A *product* of such a
reduction with another term that depends on the examples is not:

- two reductions over the batch multiplied (``P.mean(0) * Q.mean(0)``, ``P.mean(0) ** 2``),
  or one multiplied with the examples' own rows: each example's share of the gradient depends on
  the other examples through the other factor;
- a statistic of the batch without a gradient that holds more than one number (the share of the
  batch's tokens routed to each expert), multiplying a term with a gradient component by
  component: each component of an example's gradient is weighted by the whole batch, so the
  shares are no example's gradient of its own loss, not even up to a common factor.

A mixture of experts' load-balancing loss (Switch Transformer's ``num_experts · Σ_e f_e · P_e``
over every token of the batch, Hugging Face's ``output_router_logits=True``) is the second. Such
a product is followed here: its result's autograd node, if a backward that writes ``grad1``
reaches it, makes the engine refuse that backward (:meth:`EngineLink.coupled_reached`), naming
the parameters nearest to it. A forward that computes it without backpropagating through it (the
logits' own loss, the term left out) is not refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import Tensor

from .layout import MIXED, Layout

if TYPE_CHECKING:
    from .link import EngineLink

# the operations that multiply their tensor operands (elementwise or as matrices)
PRODUCTS = frozenset(
    """mul mul_ __mul__ __rmul__ __imul__ multiply div div_ divide true_divide __truediv__
    __rtruediv__ __itruediv__ addcmul addcmul_ addcdiv addcdiv_ matmul __matmul__ __rmatmul__
    mm bmm mv dot vdot inner outer ger einsum tensordot baddbmm addmm addbmm addmv kron
    bilinear""".split()
)
# powers of one operand: a product of it with itself
POWERS = frozenset("pow pow_ __pow__ square square_ float_power".split())


def coupling(
    name: str, args: tuple, ins: list[Tensor], layout_of: Callable[[Any], Layout | None],
    mixed: dict[str, None],
) -> str | None:  # fmt: skip
    """Why ``name`` on the tensors ``ins`` (their layouts: ``layout_of``; at least one is mixed)
    couples the examples' gradients (see the module docstring), or ``None`` where it does not.
    ``mixed``: the operations that mixed the batch so far, for the message."""
    power = name in POWERS
    if not power and name not in PRODUCTS:
        return None
    reduced: list[Tensor] = []  # mixed, with a gradient
    rows: list[Tensor] = []  # each example's own rows, with a gradient
    stats: list[Tensor] = []  # mixed, without a gradient, more than one number
    for t in ins:
        lay = layout_of(t)
        if lay is None:
            continue
        if lay is MIXED:
            if t.requires_grad:
                reduced.append(t)
            elif (t.is_floating_point() or t.is_complex()) and t.numel() > 1:
                stats.append(t)
        elif lay.dim >= 0 and t.requires_grad:
            rows.append(t)
    ops = ", ".join(mixed) or "an operation across the batch"
    if power:
        if reduced and reduced[0].numel() > 1 and args and args[0] is reduced[0]:
            exponent = args[1] if len(args) > 1 else 2
            if not isinstance(exponent, int | float) or exponent not in (0, 1):
                return (
                    f"'{name}' takes a power of a reduction over the batch ({ops}; shape "
                    f"{tuple(reduced[0].shape)}) entry by entry: each example's share of its "
                    "gradient is weighted by the whole batch"
                )
        return None
    if len(reduced) >= 2 and not (
        all(t is reduced[0] for t in reduced) and reduced[0].numel() == 1
    ):
        return (
            f"'{name}' multiplies two reductions over the batch ({ops}; shapes "
            f"{', '.join(str(tuple(t.shape)) for t in reduced)}): each example's share of "
            "the gradient depends on the other examples through the other factor"
        )
    if reduced and rows:
        return (
            f"'{name}' multiplies a reduction over the batch ({ops}; shape "
            f"{tuple(reduced[0].shape)}) with the examples' own rows: each example's share of "
            "the gradient depends on the other examples"
        )
    if stats and (reduced or rows):
        with_grad = (reduced or rows)[0]
        return (
            f"'{name}' weights a term that depends on the examples (shape "
            f"{tuple(with_grad.shape)}) component by component by a statistic of the whole "
            f"batch without a gradient ({ops}; shape {tuple(stats[0].shape)}, such as the "
            "share of the batch's tokens routed to each expert): each component of an "
            "example's gradient is weighted by the other examples"
        )
    return None


def arm(engine: EngineLink, outs: list[Tensor], why: str) -> None:
    """Tell ``engine`` if a backward reaches the autograd node of ``outs`` (the results of a
    coupling product, ``why``)."""
    node = next((o.grad_fn for o in outs if o.requires_grad and o.grad_fn is not None), None)
    if node is None:
        return
    # (the hook holds the nodes after this one, not this one: no cycle through the graph)
    after = tuple(n for n, _ in node.next_functions if n is not None)
    node.register_prehook(lambda grad_outputs: engine.coupled_reached(why, after))


# functions of whole matrices (and statistics of pairs of rows): where the examples are among
# a matrix's rows or columns, the result depends on every example at once, and not as a sum of
# per-example terms (a trace is one: each example's own diagonal entry)
MATRIX_FUNCTIONS = frozenset(
    """matrix_exp inverse cholesky det logdet slogdet pinverse linalg_inv linalg_inv_ex
    linalg_det linalg_slogdet linalg_cholesky linalg_cholesky_ex linalg_matrix_exp linalg_pinv
    linalg_cond linalg_matrix_power linalg_eigvalsh linalg_svdvals cov corrcoef pdist""".split()
)
# what is linear in a tensor: applied to a reduction over the batch, a sum of per-example terms
# still (the products are judged by coupling)
LINEAR = frozenset(
    """add add_ sub sub_ rsub neg neg_ positive __add__ __radd__ __iadd__ __sub__ __rsub__
    __isub__ __neg__ __pos__ sum mean nansum nanmean cumsum trace diagonal diag clone contiguous
    detach detach_ to float double half bfloat16 type_as view reshape view_as reshape_as flatten
    unflatten ravel squeeze unsqueeze expand expand_as broadcast_to permute transpose t
    movedim moveaxis swapaxes swapdims __getitem__ select narrow split split_with_sizes chunk
    unbind cat concat concatenate stack where masked_fill masked_fill_ real imag conj
    sum_to_size""".split()
)


def nonlinear(
    name: str, ins: list[Tensor], layout_of: Callable[[Any], Layout | None],
    mixed: dict[str, None],
) -> str | None:  # fmt: skip
    """Why ``name``, on the tensors ``ins`` (one is mixed), couples the examples' gradients:
    it is not linear in a reduction over the batch of more than one entry that has a gradient
    (``det`` or ``softmax`` of the Gram matrix ``h @ h.T``, ``log`` of the batch's mean
    probability of each class), so that each example's share of the gradient is weighted by
    the other examples, entry by entry. ``None`` where it is linear, or a product (see
    :func:`coupling`), or the reduction a single number (a loss: a function of it scales
    every example's share alike)."""
    if name in LINEAR or name in PRODUCTS or name in POWERS:
        return None
    for t in ins:
        if layout_of(t) is MIXED and t.requires_grad and t.numel() > 1:
            ops = ", ".join(mixed) or "an operation across the batch"
            return (
                f"'{name}' is not linear in a tensor computed across the batch ({ops}; shape "
                f"{tuple(t.shape)}): each example's share of its gradient is weighted by the "
                "other examples"
            )
    return None


def whole_matrix(
    name: str, args: tuple, kwargs: dict, ins: list[Tensor],
    layout_of: Callable[[Any], Layout | None],
) -> str | None:  # fmt: skip
    """Why ``name``, a function of whole matrices that mixed the examples (they are among
    their rows or columns: ``linalg.cond`` of ``[batch, features]``), couples their
    gradients; ``None`` for another function. (A matrix norm other than Frobenius's is one;
    Frobenius's is a function of the sum of every example's squares, as a loss's mean.)"""
    if name == "linalg_matrix_norm":
        order = args[1] if len(args) > 1 else kwargs.get("ord", "fro")
        if order == "fro":
            return None
    elif name not in MATRIX_FUNCTIONS:
        return None
    t = next((t for t in ins if layout_of(t) is not None and t.requires_grad), None)
    if t is None:
        return None
    return (
        f"'{name}' takes the examples as rows or columns of one matrix (shape "
        f"{tuple(t.shape)}, the examples on {layout_of(t).describe(t.shape[layout_of(t).dim])}"
        "): its value depends on all of them at once"
    )

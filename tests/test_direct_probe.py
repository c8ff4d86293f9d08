"""Forwards without a hooked call: a module without a rule that uses its weight directly
(``op(x * w)``, the tracker giving ``w`` its per-example gradients itself), where ``op`` mixes
the rows of the batch. Each is right (float64, against :func:`gradhooks.oracle.loop_grad`) or
refused, never a ``grad1`` without an error: the run-time check against autograd is armed for
such a forward as for one of hooked calls, and an operation the tracker has no handler for
is run again on its first and on its last example alone before its rows are taken as theirs
(what ``python -m bench.unhandled_ops`` found given silently)."""

from __future__ import annotations

import pytest
import torch
from test_tracking_ops import _after_a_linear, _assert_loop, _op_alone, _sum_sq, _Unfollowed

import gradhooks
from gradhooks.errors import CheckFailedError, GradhooksError
from gradhooks.oracle import loop_grad
from harness import MixedBackward, assert_close, one_thread  # noqa: F401 (a fixture)

D = torch.float64


def _near_identity(h):
    """``h`` (``[n, n]``) turned into a lower triangle close to the identity: an operation
    of the whole matrix then mixes the rows by little (below the probe's tolerance)."""
    n = h.shape[0]
    return torch.eye(n, dtype=h.dtype) + 1e-3 * h.tril()


def _constant(*shape):
    g = torch.Generator().manual_seed(1)
    return torch.randn(*shape, dtype=D, generator=g)


# op, the batch's shape: each takes the batch's rows as one matrix, a flat tensor or
# positions along its dimension 0, or reads the batch's size as another count
MIXING = {
    "linalg.eigh": (lambda h: torch.linalg.eigh(h)[0], (4, 4)),
    "linalg.eigvalsh": (lambda h: torch.linalg.eigvalsh(h), (4, 4)),
    "linalg.lu_factor": (lambda h: torch.linalg.lu_factor(h)[0], (3, 5)),
    "linalg.solve_ex": (lambda h: torch.linalg.solve_ex(h, _constant(4, 2))[0], (4, 4)),
    "linalg.householder_product": (
        lambda h: torch.linalg.householder_product(h, _constant(3)),
        (4, 4),
    ),
    "cholesky_inverse": (lambda h: torch.cholesky_inverse(_near_identity(h)), (5, 5)),
    "gradient": (lambda h: torch.gradient(h, dim=0)[0], (4, 3)),
    "take": (lambda h: torch.take(h, torch.tensor([0, 5, 7])), (3, 4)),
    "put": (lambda h: h.put(torch.tensor([1, 6]), _constant(2)), (3, 3)),
    "linalg.diagonal": (lambda h: torch.linalg.diagonal(h), (4, 4)),
    "diagonal_scatter": (lambda h: torch.diagonal_scatter(h, _constant(4)), (4, 4)),
    "as_strided_scatter": (
        lambda h: torch.as_strided_scatter(h, _constant(2, 2), (2, 2), (1, 2)),
        (3, 3),
    ),
    "linalg.vecdot over the batch": (
        lambda h: torch.linalg.vecdot(h, _constant(4, 4), dim=0),
        (4, 4),
    ),  # fmt: skip
    "linalg.vander": (lambda h: torch.linalg.vander(h[:, 0]), (4, 3)),
    "native_group_norm of N examples": (
        lambda h: torch.native_group_norm(h, None, None, 4, 6, 1, 2, 1e-5)[0],
        (4, 6),
    ),
}

# op, the batch's shape: each example's rows are its own (elementwise, reductions and
# products over the other dimensions, unfollowed operations on each example's rows)
KEEPING = {
    "x * w": (lambda h: h, (4, 3)),
    "sin": (torch.sin, (4, 3)),
    "sum over the features": (lambda h: h.sum(1), (4, 3)),
    "logsumexp over the features": (lambda h: h.logsumexp(-1), (4, 3)),
    "each example's Gram matrix": (lambda h: (h @ h.transpose(-1, -2)).sum(-1), (4, 3, 3)),
    "linalg.cross": (
        lambda h: torch.linalg.cross(h, _constant(3).to(h).expand_as(h), dim=-1),
        (4, 3),
    ),  # fmt: skip
    "linalg.vecdot over the features": (lambda h: torch.linalg.vecdot(h, h.flip(-1)), (4, 3)),
    "as_strided to its own shape": (lambda h: h.as_strided(h.shape, h.stride()), (4, 3)),
    "linalg.eigh of each example's matrix": (
        lambda h: torch.linalg.eigh(h + h.transpose(-1, -2))[0],
        (4, 3, 3),
    ),
    "cholesky_inverse of each example's matrix": (
        lambda h: torch.cholesky_inverse(torch.eye(3, dtype=D) + 1e-3 * h.tril()),
        (4, 3, 3),
    ),
}


def _model(op, shape):
    """``op(x * w)``, ``w`` of the shape of an example."""
    torch.manual_seed(0)
    model = _Unfollowed(op, shape[-1])
    if len(shape) > 2:
        model.w = torch.nn.Parameter(1 + 0.1 * torch.randn(shape[1:], dtype=D))
    return model


def _batch(shape):
    torch.manual_seed(2)
    return torch.randn(*shape, dtype=D)


@pytest.mark.parametrize("name", sorted(MIXING))
def test_an_operation_that_mixes_the_rows_is_refused(name):
    """Refused with a typed error, at the forward or at the backward, with no ``grad1``
    written (the loop cannot run one example alone through most of them, or gives another
    gradient)."""
    op, shape = MIXING[name]
    model, x = _model(op, shape), _batch(shape)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with pytest.raises(GradhooksError):
            _sum_sq(model(x)).backward()
        assert getattr(model.w, "grad1", None) is None


@pytest.mark.parametrize("name", sorted(KEEPING))
def test_an_operation_that_keeps_the_rows_matches_the_loop(name):
    op, shape = KEEPING[name]
    _assert_loop(_model(op, shape), _batch(shape))


def test_an_unfollowed_operation_that_keeps_the_rows_after_a_linear_matches_the_loop():
    op, shape = KEEPING["linalg.vecdot over the features"]
    _assert_loop(_after_a_linear(op), _batch(shape))


def test_an_unfollowed_operation_that_mixes_the_rows_after_a_linear_is_refused():
    """The same check where a hooked call comes first (whose ``grad1`` is not written)."""
    op, shape = MIXING["cholesky_inverse"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 5).double(), _Unfollowed(op, 5))
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with pytest.raises(GradhooksError):
            _sum_sq(model(_batch(shape))).backward()
        assert all(getattr(p, "grad1", None) is None for p in model.parameters())


def test_a_mixing_only_the_backward_shows_is_refused_without_a_hooked_call():
    """``op(x * w)`` with a custom ``autograd.Function`` whose backward mixes the examples:
    nothing the tracker sees is wrong, and the run-time check, armed for a forward of direct
    uses alone, refuses it (``grad1`` was given silently before)."""
    model, x = _op_alone(MixedBackward.apply), _batch((5, 3))
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with pytest.raises(CheckFailedError):
            _sum_sq(model(x)).backward()
        assert getattr(model.w, "grad1", None) is None


def test_two_forwards_on_parts_of_one_batch_are_refused_without_a_hooked_call():
    """``model(x[:2])`` and ``model(x[2:])`` in one backward: each forward's row 0 would be
    taken for one example (refused as it is for hooked calls)."""
    model, x = _op_alone(torch.sin), _batch((5, 3))
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with pytest.raises(GradhooksError):
            (_sum_sq(model(x[:2])) + _sum_sq(model(x[2:]))).backward()


def test_a_training_loop_of_direct_uses_matches_the_loop_at_every_step():
    """``zero_grad``, a step of the optimizer, several steps, with an unfollowed operation
    that keeps the rows: ``grad1`` is the loop's at each step, and the checks (armed at the
    1st, 2nd, 4th... backward) refuse nothing."""
    op, shape = KEEPING["linalg.cross"]
    model = _model(op, shape)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with gradhooks.add_hooks(model, loss_reduction="sum") as h:
        for step in range(5):
            torch.manual_seed(10 + step)
            x = torch.randn(*shape, dtype=D)
            with h.paused():
                want = loop_grad(model, _sum_sq, x)["w"]
            opt.zero_grad()
            _sum_sq(model(x)).backward()
            assert_close(model.w.grad1, want, f"step {step}")
            opt.step()


def test_an_unfollowed_operation_that_keeps_the_rows_under_bfloat16_autocast():
    """Under bfloat16 autocast, the Linear before it in bfloat16: the rows of one example
    alone are its rows of the batch to that precision, and nothing is refused."""
    torch.manual_seed(0)
    op, shape = KEEPING["linalg.cross"]
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), _Unfollowed(op).float())
    x = _batch(shape).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = loop_grad(model, _sum_sq, x)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        _sum_sq(out.float()).backward()
        for n, p in model.named_parameters():
            scale = float(want[n].abs().max())
            assert torch.allclose(p.grad1, want[n], rtol=5e-2, atol=5e-2 * scale), n


class _GramSum(torch.nn.Module):
    """A Linear, then the sum of the batch's Gram matrix, ``(h @ h.T).sum()``: ``‖Σ_i h_i‖²``,
    no sum of per-example losses (each example's term is ``h_i · Σ_j h_j``)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3).double()

    def forward(self, x):
        h = self.lin(x)
        return (h @ h.T).sum()


@pytest.mark.xfail(strict=True, reason="the sum of the Gram matrix of the batch is not seen "
                   "as a product of two reductions over it: grad1 is each example's share")  # fmt: skip
def test_the_sum_of_the_batchs_gram_matrix_is_refused():
    torch.manual_seed(0)
    model, x = _GramSum(), _batch((4, 3))
    want = loop_grad(model, lambda out: out, x)
    try:
        with gradhooks.add_hooks(model, loss_reduction="sum"):
            model(x).backward()
    except GradhooksError:
        return
    for n, p in model.named_parameters():
        assert_close(p.grad1, want[n], n)

"""A refused backward leaves the model as it was: every parameter's ``.grad`` (``None``, zeros
or an earlier micro-batch's sum), its ``grad1`` and the collected quantities, whether the
refusal comes from a hook in the middle of the backward (after autograd accumulated ``.grad``
of the layers it reached first) or from the run-time check at its end. Each is then checked
by going on: the next, accepted backward gives what the float64 per-example loop gives."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from harness import MixedBackward, assert_close, sq


class _Clamped(nn.Module):
    """Three Linear layers (3 to 5 to 5 to 2); while ``clamp`` is set, a hook of the user's
    on the middle layer's weight clamps each entry of its gradient (refused: no per-example
    gradient gives that), after autograd has accumulated the last layer's ``.grad``."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 5), nn.Linear(5, 5), nn.Linear(5, 2)
        self.clamp = False
        self.b.weight.register_hook(lambda g: g.clamp(-1e-3, 1e-3) if self.clamp else g)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class _Mixing(nn.Module):
    """Linear, then a step whose backward mixes the examples while ``mix`` is set (only the
    run-time check's probe sees it, at the backward's end), then Linear."""

    def __init__(self):
        super().__init__()
        self.a, self.c = nn.Linear(3, 5), nn.Linear(5, 2)
        self.mix = False

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.c(MixedBackward.apply(h) if self.mix else h)


def _model(cls):
    torch.manual_seed(0)
    return cls().double()


def _refuse(model) -> type[Exception]:
    if isinstance(model, _Clamped):
        model.clamp = True
        return gradhooks.UnsupportedError
    model.mix = True
    return gradhooks.CheckFailedError


def _accept(model) -> None:
    model.clamp = model.mix = False


def _state(model) -> dict:
    """Each parameter's ``.grad`` and ``grad1`` (clones; ``None`` where absent)."""
    return {
        n: (
            None if p.grad is None else p.grad.clone(),
            p.grad1.clone() if hasattr(p, "grad1") else None,
        )
        for n, p in model.named_parameters()
    }


def _assert_state(model, kept: dict, what: str) -> None:
    for n, p in model.named_parameters():
        grad, grad1 = kept[n]
        if grad is None:
            assert p.grad is None, f"{what}: {n}.grad written by a refused backward"
        else:
            # (an earlier sum: autograd's addition of this backward's gradient, subtracted)
            assert_close(p.grad, grad, f"{what}: {n}.grad")
        if grad1 is None:
            assert not hasattr(p, "grad1"), f"{what}: {n}.grad1 written by a refused backward"
        else:
            assert torch.equal(p.grad1, grad1), f"{what}: {n}.grad1"


MODELS = [pytest.param(_Clamped, id="mid-backward"), pytest.param(_Mixing, id="at-its-end")]


@pytest.mark.parametrize("cls", MODELS)
def test_a_refused_backward_leaves_grad_none_and_no_grad1(cls):
    """``.grad`` ``None`` before (``zero_grad()``): ``None`` after, and no ``grad1``; the next
    backward's ``grad1`` and ``.grad`` are the float64 loop's."""
    model = _model(cls)
    x = torch.randn(6, 3, dtype=torch.float64)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        kept = _state(model)
        error = _refuse(model)
        with pytest.raises(error):
            sq(model(x)).backward()
        _assert_state(model, kept, "refused")
        _accept(model)
        sq(model(x)).backward()
    want = loop_grad(model, sq, x)
    for n, p in model.named_parameters():
        assert_close(p.grad1, want[n], f"after the refusal: {n}.grad1")
        assert_close(p.grad, want[n].sum(0), f"after the refusal: {n}.grad")


@pytest.mark.parametrize("cls", MODELS)
@pytest.mark.parametrize("set_to_none", [True, False], ids=["none", "zeros"])
def test_a_refused_micro_batch_leaves_the_earlier_sum(cls, set_to_none):
    """Gradient accumulation: a first micro-batch, a refused second (the run-time check's
    second backward), an accepted third. After the refusal, ``.grad`` and ``grad1`` hold the
    first micro-batch's (where ``.grad`` started as zeros, as ``zero_grad(set_to_none=False)``
    leaves it: those zeros plus it); at the end, the first and the third, as the float64 loop
    gives them."""
    model = _model(cls)
    torch.manual_seed(1)
    x1, x2, x3 = (torch.randn(6, 3, dtype=torch.float64) for _ in range(3))
    if not set_to_none:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(x1)).backward()
        kept = _state(model)
        error = _refuse(model)
        with pytest.raises(error):
            sq(model(x2)).backward()
        _assert_state(model, kept, "refused")
        _accept(model)
        sq(model(x3)).backward()
    one, three = loop_grad(model, sq, x1), loop_grad(model, sq, x3)
    for n, p in model.named_parameters():
        assert_close(p.grad1, one[n] + three[n], f"micro-batches 1 and 3: {n}.grad1")
        assert_close(p.grad, (one[n] + three[n]).sum(0), f"micro-batches 1 and 3: {n}.grad")


def test_a_refused_backward_leaves_zeros_exactly():
    """After ``zero_grad(set_to_none=False)``, a refused backward leaves ``.grad`` zeros, bit
    for bit (the gradient autograd added into the zeros, subtracted)."""
    model = _model(_Clamped)
    x = torch.randn(6, 3, dtype=torch.float64)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(x)).backward()
        model.zero_grad(set_to_none=False)
        _refuse(model)
        with pytest.raises(gradhooks.UnsupportedError):
            sq(model(x)).backward()
    assert model.c.weight.grad is not None
    for n, p in model.named_parameters():
        assert not p.grad.any(), f"{n}.grad not zeros"


@pytest.mark.parametrize("cls", MODELS)
def test_a_refused_backward_leaves_the_norms(cls):
    """Without ``grad1``: the per-example norms of the accepted backward stay (also where the
    check that refuses comes after they were formed, at the backward's end), those of the
    refused one are not kept, and ``.grad`` is back to ``None``."""
    model = _model(cls)
    torch.manual_seed(1)
    x1, x2 = (torch.randn(6, 3, dtype=torch.float64) for _ in range(2))
    with gradhooks.add_hooks(model, quantities=("norms",), loss_reduction="sum") as h:
        sq(model(x1)).backward()
        norms = h.norms().clone()
        model.zero_grad()
        error = _refuse(model)
        with pytest.raises(error):
            sq(model(x2)).backward()
        assert all(p.grad is None for p in model.parameters())
        assert torch.equal(h.norms(), norms)
    _accept(model)
    want = loop_grad(model, sq, x1)
    total = sum(g.flatten(1).square().sum(1) for g in want.values()).sqrt()
    assert_close(norms, total, "the accepted backward's norms")


@pytest.mark.parametrize("method", ["grad1", "bookkeeping"])
def test_a_refused_dp_step_leaves_grad_and_grad1(method):
    """``dp_sgd_step``: a step refused (by its check of the examples, after its backward)
    leaves ``.grad`` as the step before left it, and no ``grad1`` or norms of its own (each
    step starts them afresh); ``DPOptimizer.backward``: the buffer of the accepted physical
    batch, so that the step is the float64 loop's clipped sum of the accepted batches."""
    model = _model(_Mixing)
    torch.manual_seed(1)
    x1, x2 = (torch.randn(6, 3, dtype=torch.float64) for _ in range(2))

    def losses(out):
        return 0.5 * out.square().sum(1)

    quantities = ("grad1", "norms") if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=quantities, loss_reduction="sum") as h:
        gradhooks.dp_sgd_step(
            h, losses(model(x1)), max_norm=1.0, noise_multiplier=0.0, method=method
        )
        assert h.norms().shape == (6,)
        kept = {n: (g, None) for n, (g, _) in _state(model).items()}
        _refuse(model)
        with pytest.raises(gradhooks.CheckFailedError):
            gradhooks.dp_sgd_step(
                h, losses(model(x2)), max_norm=1.0, noise_multiplier=0.0, method=method
            )
        _assert_state(model, kept, "refused step")
        with pytest.raises(gradhooks.StateError):
            h.norms()  # (none of the refused step's)
        _accept(model)
    model = _model(_Mixing)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with gradhooks.add_hooks(model, quantities=quantities, loss_reduction="sum") as h:
        dp = gradhooks.DPOptimizer(
            opt, h, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=6,
            method=method,
        )  # fmt: skip
        dp.backward(losses(model(x1)))
        _refuse(model)
        with pytest.raises(gradhooks.CheckFailedError):
            dp.backward(losses(model(x2)))
        _accept(model)
        dp.step()
    want = loop_grad(model, lambda out: losses(out).sum(), x1)
    norms = sum(g.flatten(1).square().sum(1) for g in want.values()).sqrt()
    factors = (1.0 / norms).clamp(max=1.0)
    for n, p in model.named_parameters():
        clipped = torch.einsum("b,b...->...", factors, want[n]) / 6
        assert_close(p.grad, clipped, f"DPOptimizer after a refused backward: {n}")


@pytest.mark.parametrize("cls", MODELS)
def test_a_refused_step_after_zero_grad(cls):
    """A step, ``zero_grad()``, a refused step: ``.grad`` is ``None`` again; each ``grad1`` is
    the earlier step's, untouched (a layer the refused backward did not reach), or deleted (one
    it was writing afresh, in the earlier ``grad1``'s memory): none holds a number of the
    refused backward. The next step's are the float64 loop's."""
    model = _model(cls)
    torch.manual_seed(1)
    x1, x2, x3 = (torch.randn(6, 3, dtype=torch.float64) for _ in range(3))
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        sq(model(x1)).backward()
        first = {n: p.grad1.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        error = _refuse(model)
        with pytest.raises(error):
            sq(model(x2)).backward()
        for n, p in model.named_parameters():
            assert p.grad is None, n
            assert not hasattr(p, "grad1") or torch.equal(p.grad1, first[n]), n
        _accept(model)
        sq(model(x3)).backward()
    want = loop_grad(model, sq, x3)
    for n, p in model.named_parameters():
        assert_close(p.grad1, want[n], f"the next step: {n}.grad1")
        assert_close(p.grad, want[n].sum(0), f"the next step: {n}.grad")

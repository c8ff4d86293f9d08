"""Backwards run inside another backward, and batched backwards, on a hooked model.

Two models differentiate themselves with ``torch.autograd.grad`` inside the model's backward:

- an adjoint ODE (the ``torchdiffeq`` ``odeint_adjoint`` recipe): the forward integrates under
  ``torch.no_grad``, the backward integrates the adjoint system, calling ``torch.autograd.grad``
  on the dynamics with respect to the state *and the parameters*, and sums the parameters' parts
  over the steps, scaled by the step size. Per-example gradients of those parameters cannot be
  followed through that code: refused, nothing written;
- a deep equilibrium model: a fixed point ``z = tanh(W z + U x)`` solved without autograd, one
  call with autograd on, and implicit differentiation by a gradient hook that solves the adjoint
  fixed point with ``torch.autograd.grad`` with respect to the state only (and the same through
  a custom ``autograd.Function``). The parameters' gradients come from the ordinary call:
  ``grad1``, the norms and every DP step are the per-example loop's.

``is_grads_batched`` backwards (``torch.autograd.functional.jacobian(vectorize=True)``) with
respect to the input leave ``grad1`` alone; with respect to parameters they are refused.

Each model's oracle is itself with a batch of one (:func:`gradhooks.oracle.loop_grad`), in
float64.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from gradhooks.workflows.dp import clip_factors
from harness import assert_close

B = 5


class Dynamics(nn.Module):
    """``f(t, h) = tanh(lin(h)) · (1 + t)``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, t: float, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(h)) * (1 + t)


class Adjoint(torch.autograd.Function):
    """Euler steps forward; backward, the adjoint system integrated back in time."""

    @staticmethod
    def forward(ctx, h0, func, steps, *params):
        dt = 1.0 / steps
        h = h0
        for k in range(steps):  # (grad mode is off in a Function's forward)
            h = h + dt * func(k * dt, h)
        ctx.func, ctx.steps, ctx.params = func, steps, params
        ctx.save_for_backward(h)
        return h

    @staticmethod
    def backward(ctx, a):
        (h,) = ctx.saved_tensors
        dt = 1.0 / ctx.steps
        params = [p for p in ctx.params if p.requires_grad]
        adj = [torch.zeros_like(p) for p in params]
        for k in reversed(range(ctx.steps)):
            with torch.enable_grad():
                state = h.detach().requires_grad_()
                f = ctx.func((k + 1) * dt, state)
                vh, *vp = torch.autograd.grad(f, (state, *params), a, allow_unused=True)
            h = h - dt * f.detach()
            a = a + dt * vh
            adj = [s + dt * v for s, v in zip(adj, vp)]
        found = dict(zip(map(id, params), adj))
        return (a, None, None, *(found.get(id(p)) for p in ctx.params))


class ODENet(nn.Module):
    def __init__(self, head: bool = True, steps: int = 6) -> None:
        super().__init__()
        self.enc = nn.Linear(3, 4)
        self.func = Dynamics(4)
        self.head = nn.Linear(4, 2) if head else None
        self.steps = steps

    def forward(self, x):
        h = Adjoint.apply(self.enc(x), self.func, self.steps, *self.func.parameters())
        return self.head(h) if self.head is not None else h[:, :2]


class DEQ(nn.Module):
    """Implicit differentiation by a gradient hook (``implicit="hook"``), by a custom
    ``autograd.Function`` (``"function"``), or by a Function whose backward also takes the
    parameters' gradients with ``torch.autograd.grad`` (``"params"``: refused)."""

    def __init__(self, implicit: str = "hook", iters: int = 30) -> None:
        super().__init__()
        self.enc = nn.Linear(3, 4)
        self.W = nn.Linear(4, 4, bias=False)
        self.U = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.implicit, self.iters = implicit, iters
        with torch.no_grad():
            self.W.weight.mul_(0.3)  # (a contraction)

    def f(self, z, x):
        return torch.tanh(self.W(z) + self.U(x))

    def solve(self, step, start):
        y = start
        for _ in range(self.iters):  # (a fixed count: each example its own iteration)
            y = step(y)
        return y

    def forward(self, inp):
        x = self.enc(inp)
        with torch.no_grad():
            z = self.solve(lambda z: self.f(z, x), torch.zeros_like(x))
        if self.implicit == "params":
            return self.head(_ImplicitAll.apply(z, x, self, *self.parameters()))
        z = self.f(z, x)  # one call with autograd on: the parameters' gradients come from it
        if torch.is_grad_enabled():
            z0 = z.detach().requires_grad_()
            f0 = self.f(z0, x)

            def adjoint(grad):
                return self.solve(
                    lambda g: torch.autograd.grad(f0, z0, g, retain_graph=True)[0] + grad, grad
                )

            if self.implicit == "hook":
                z.register_hook(adjoint)
            else:
                z = _Implicit.apply(z, adjoint)
        return self.head(z)


class _Implicit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, adjoint):
        ctx.adjoint = adjoint
        return z.view_as(z)

    @staticmethod
    def backward(ctx, grad):
        return ctx.adjoint(grad), None


class _ImplicitAll(torch.autograd.Function):
    """``z*`` out; backward: the adjoint fixed point, then the parameters' (and ``x``'s)
    gradients by ``torch.autograd.grad`` through one call of ``f``."""

    @staticmethod
    def forward(ctx, z, x, model, *params):
        ctx.model = model
        ctx.save_for_backward(z, x)
        return z.clone()

    @staticmethod
    def backward(ctx, grad):
        z, x = ctx.saved_tensors
        params = [p for p in ctx.model.parameters()]
        with torch.enable_grad():
            z0, x0 = z.detach().requires_grad_(), x.detach().requires_grad_()
            f0 = ctx.model.f(z0, x0)
            g = ctx.model.solve(
                lambda g: torch.autograd.grad(f0, z0, g, retain_graph=True)[0] + grad, grad
            )
            gx, *gp = torch.autograd.grad(f0, (x0, *params), g, allow_unused=True)
        return (None, gx, None, *gp)


def per_example(out, y):
    return ((out - y) ** 2).sum(1)


def data(seed: int = 0):
    torch.manual_seed(seed)
    return torch.randn(B, 3, dtype=torch.float64), torch.randn(B, 2, dtype=torch.float64)


def loss_of(reduction):
    if reduction == "mean":
        return lambda out, y: per_example(out, y).mean()
    return lambda out, y: per_example(out, y).sum()


# -- implicit differentiation of a fixed point ---------------------------------------------------


@pytest.mark.parametrize("implicit", ["hook", "function"])
@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_deq_grad1(implicit, verify, reduction):
    torch.manual_seed(0)
    model = DEQ(implicit).double()
    x, y = data()
    want = loop_grad(model, per_example, x, y)
    with gradhooks.add_hooks(model, loss_reduction=reduction, verify=verify):
        loss_of(reduction)(model(x), y).backward()
    for n, p in model.named_parameters():
        assert_close(p.grad1, want[n], n)


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_deq_norms(verify):
    """The backwards inside (with respect to the state only) leave the pieces the outer
    backward had collected: every parameter's norm is the loop's (they were left out)."""
    torch.manual_seed(0)
    model = DEQ().double()
    x, y = data()
    want = loop_grad(model, per_example, x, y)
    with gradhooks.add_hooks(
        model, loss_reduction="sum", quantities=("norms",), verify=verify
    ) as h:
        per_example(model(x), y).sum().backward()
        norms = h.param_norms()
        total = h.norms()
    assert sorted(norms) == sorted(want)
    for n, g in want.items():
        assert_close(norms[n], g.flatten(1).norm(dim=1), n)
    assert_close(total, torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1), "total")


@pytest.mark.parametrize("method", ["grad1", "bookkeeping", "ghost"])
def test_deq_dp_step(method):
    """The DP step (clipping only): the clipped mean of the loop's gradients."""
    torch.manual_seed(0)
    model = DEQ().double()
    x, y = data()
    want = loop_grad(model, per_example, x, y)
    norms = torch.cat([g.flatten(1) for g in want.values()], 1).norm(dim=1)
    max_norm = float(norms.median())
    factors = clip_factors(norms, max_norm)
    q = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=q) as h:
        got = gradhooks.dp_sgd_step(
            h, per_example(model(x), y), max_norm=max_norm, noise_multiplier=0.0, method=method
        )
    assert_close(got, norms, "norms")
    for n, p in model.named_parameters():
        assert_close(p.grad, torch.einsum("b,b...->...", factors, want[n]) / B, n)


def test_deq_taking_parameter_gradients_inside_is_refused():
    """A Function whose backward takes the parameters' gradients itself: refused."""
    torch.manual_seed(0)
    model = DEQ("params").double()
    x, y = data()
    with gradhooks.add_hooks(model):
        with pytest.raises(gradhooks.UnsupportedError, match="inside another backward") as e:
            per_example(model(x), y).mean().backward()
    assert "'W.weight'" in str(e.value) and "'U.weight'" in str(e.value)
    assert not any(hasattr(p, "grad1") for p in model.parameters())


# -- an adjoint ODE ------------------------------------------------------------------------------


@pytest.mark.parametrize("head", [True, False], ids=["head", "ode-last"])
@pytest.mark.parametrize("quantities", [("grad1",), ("norms",)], ids=["grad1", "norms"])
@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_adjoint_is_refused_and_grad1_left_as_it_was(head, quantities, verify):
    """The adjoint's inner backwards hand the dynamics' parameter gradients back to the
    Function, which sums them over the steps, scaled by ``dt``: refused, naming them, and every
    ``grad1`` as it was before the backward (that of an earlier backward, accumulating)."""
    torch.manual_seed(0)
    model = ODENet(head).double()
    x, y = data()
    with gradhooks.add_hooks(model, verify=verify, quantities=quantities) as h:
        model.func.requires_grad_(False)  # an earlier step, with the dynamics frozen
        per_example(model(x), y).mean().backward()
        model.func.requires_grad_(True)
        before = {n: p.grad1.clone() for n, p in model.named_parameters() if hasattr(p, "grad1")}
        with pytest.raises(gradhooks.UnsupportedError, match="inside another backward") as e:
            per_example(model(x), y).mean().backward()
        assert "'func.lin.weight', 'func.lin.bias'" in str(e.value)
        if "norms" in quantities:
            assert before == {}
        else:
            assert sorted(before) == ["enc.bias", "enc.weight"] + (
                ["head.bias", "head.weight"] if head else []
            )
        for n, p in model.named_parameters():
            assert hasattr(p, "grad1") == (n in before), n
            if n in before:
                assert torch.equal(p.grad1, before[n]), n
        # and the hooks go on: a backward with the dynamics frozen again
        model.func.requires_grad_(False)
        h.clear()
        model.zero_grad()
        per_example(model(x), y).mean().backward()
        want = loop_grad(model, per_example, x, y)
        if "grad1" in quantities:
            for n in want:
                assert_close(model.get_parameter(n).grad1, want[n], n)
        else:
            for n, v in h.param_norms().items():
                assert_close(v, want[n].flatten(1).norm(dim=1), n)


@pytest.mark.parametrize("method", ["grad1", "bookkeeping"])
def test_adjoint_dp_step_is_refused(method):
    torch.manual_seed(0)
    model = ODENet().double()
    x, y = data()
    q = ("grad1",) if method == "grad1" else ("norms",)
    with gradhooks.add_hooks(model, quantities=q) as h:
        with pytest.raises(gradhooks.UnsupportedError, match="inside another backward"):
            gradhooks.dp_sgd_step(h, per_example(model(x), y), max_norm=1.0, noise_multiplier=1.0)
    assert all(p.grad is None for p in model.parameters())


# -- is_grads_batched backwards ------------------------------------------------------------------


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
def test_batched_input_backwards_leave_grad1(verify):
    """An ``is_grads_batched`` backward and a vectorized Jacobian with respect to the input
    give what they give without hooks, leave ``grad1`` (of an earlier backward) as it was, and
    a later backward adds its own (checked by the probe, with ``verify``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    plain = copy.deepcopy(model)
    x, y = data()
    want = loop_grad(model, per_example, x, y)
    v = torch.randn(3, B, 2, dtype=torch.float64)
    with gradhooks.add_hooks(model, loss_reduction="sum", verify=verify):
        per_example(model(x), y).sum().backward()
        first = {n: p.grad1.clone() for n, p in model.named_parameters()}
        xs = x.clone().requires_grad_()
        (got,) = torch.autograd.grad(model(xs), xs, v, is_grads_batched=True)
        (ref,) = torch.autograd.grad(plain(xs), xs, v, is_grads_batched=True)
        assert_close(got, ref, "is_grads_batched")
        J = torch.autograd.functional.jacobian(model, x, vectorize=True)
        assert_close(J, torch.autograd.functional.jacobian(plain, x, vectorize=True), "jacobian")
        for n, p in model.named_parameters():
            assert torch.equal(p.grad1, first[n]), n
        per_example(model(x), y).sum().backward()
    for n, p in model.named_parameters():
        assert_close(p.grad1, 2 * want[n], n)


def test_batched_parameter_backward_is_refused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, _ = data()
    v = torch.randn(3, B, 2, dtype=torch.float64)
    with gradhooks.add_hooks(model):
        with pytest.raises(gradhooks.UnsupportedError, match="is_grads_batched=True"):
            torch.autograd.grad(model(x), list(model.parameters()), v, is_grads_batched=True)
    assert not any(hasattr(p, "grad1") for p in model.parameters())

"""The eigenvalue-corrected K-FAC (:func:`gradhooks.ekfac_eigenvalues`, ``KFactors.inverse(...,
eigenvalues=...)``) against a float64 reference built from the per-example loop's gradients:
the diagonal of ``(Q_G ⊗ Q_A)ᵀ F (Q_G ⊗ Q_A)`` with ``F = Σ_b vec(M_b) vec(M_b)ᵀ / batch``
formed explicitly, ``M_b`` example ``b``'s gradient of the weight as a matrix (bias column
appended), and the preconditioned gradient as the explicit damped solve with that matrix. Over
a Linear on features and on positions, a grouped convolution, a transposed convolution and
Hugging Face's ``Conv1D``; in float64, under bfloat16 autocast, and in a training loop with
``zero_grad`` and several steps; and the refusals of what does not fit."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks
from gradhooks.oracle import loop_grad
from gradhooks.quantities.kfac import weight_matrix
from harness import one_thread  # noqa: F401  (autouse fixture)


class Positions(nn.Module):
    """A Linear over positions, pooled, then a head: per-example gradients sum over positions."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(3, 5), nn.Linear(5, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(x)).mean(1))


class Convs(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, groups=2)
        self.up = nn.ConvTranspose2d(4, 2, 2, stride=1)
        self.fc = nn.Linear(2 * 5 * 5, 3)

    def forward(self, x):
        return self.fc(self.up(torch.relu(self.conv(x))).flatten(1))


class HFConv1D(nn.Module):
    def __init__(self):
        super().__init__()
        from transformers.pytorch_utils import Conv1D

        self.proj, self.head = Conv1D(6, 3), nn.Linear(6, 4)

    def forward(self, x):
        return self.head(torch.relu(self.proj(x)).sum(1))


def mlp():
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 4))


CASES = {
    "mlp": (mlp, lambda g: torch.randn(6, 3, generator=g)),
    "positions": (Positions, lambda g: torch.randn(5, 7, 3, generator=g)),
    "convs": (Convs, lambda g: torch.randn(4, 2, 6, 6, generator=g)),
    "hf_conv1d": (HFConv1D, lambda g: torch.randn(5, 4, 3, generator=g)),
}


def _case(name: str, seed: int = 0):
    make, inputs = CASES[name]
    torch.manual_seed(seed)
    model = make().double()
    g = torch.Generator().manual_seed(seed + 1)
    x = inputs(g).double()
    y = torch.randint(4 if name != "convs" else 3, (x.shape[0],), generator=g)
    return model, x, y


def _loss(out, y):
    return F.cross_entropy(out, y, reduction="sum")


def _matrices(f, weight, bias):
    """Each example's gradient as the factors' matrix, ``[batch, *groups, out, in(+1)]``."""
    groups, rows = tuple(f.G.shape[:-2]), f.G.shape[-1]
    ms = torch.stack([weight_matrix(w, groups, rows, f.layout) for w in weight])
    if bias is not None:
        ms = torch.cat([ms, bias.reshape(bias.shape[0], *groups, rows, 1)], -1)
    return ms


def _reference(f, weight, bias, reduction="mean"):
    """The explicit diagonal of the projected second moment, group by group, in float64."""
    q_g, q_a = (torch.linalg.eigh(m)[1] for m in (f.G, f.A))
    ms = _matrices(f, weight, bias).double()
    batch, *groups, rows, cols = ms.shape
    flat = ms.reshape(batch, -1, rows * cols)  # [batch, groups, out·in]
    qg, qa = q_g.reshape(-1, rows, rows), q_a.reshape(-1, cols, cols)
    diag = []
    for k in range(flat.shape[1]):
        second = flat[:, k].T @ flat[:, k] / (batch if reduction == "mean" else 1)
        basis = torch.kron(qg[k], qa[k])
        diag.append(torch.diagonal(basis.T @ second @ basis).reshape(rows, cols))
    return torch.stack(diag).reshape(*groups, rows, cols)


def _loop(model, x, y):
    return loop_grad(model, _loss, x, y)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", list(CASES))
def test_eigenvalues_match_the_projected_second_moment_of_the_loop(name, reduction):
    model, x, y = _case(name)
    factors = gradhooks.kfac(model, x, fisher="mc", generator=torch.Generator().manual_seed(3))
    assert factors, name
    ref = _loop(model, x, y)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        _loss(model(x), y).backward()
        eig = gradhooks.ekfac_eigenvalues(model, factors, reduction=reduction)
    assert set(eig) == set(factors)
    for n, f in factors.items():
        want = _reference(f, ref[n], ref[f.bias_name] if f.bias else None, reduction)
        assert eig[n].dtype == torch.float64
        torch.testing.assert_close(eig[n], want, rtol=1e-9, atol=1e-12 * want.abs().max().item())
        # the corrected eigenvalues keep the curvature's trace in the basis: Σ eig = tr(F)
        ms = _matrices(f, ref[n], ref[f.bias_name] if f.bias else None)
        trace = ms.square().sum() / (ms.shape[0] if reduction == "mean" else 1)
        torch.testing.assert_close(eig[n].sum(), trace, rtol=1e-10, atol=0)


def test_one_example_at_one_position_gives_kfac_own_eigenvalues():
    """With one example on one position, ``A = a aᵀ`` and ``G = g gᵀ``: the per-example
    gradient ``g aᵀ`` is K-FAC's rank-one product, and the corrected eigenvalues are K-FAC's
    own ``λ_G λ_Aᵀ``."""
    model, x, y = _case("mlp")
    x, y = x[:1], y[:1]
    factors = gradhooks.kfac(model, x, y, fisher="empirical")
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x), y).backward()
        eig = gradhooks.ekfac_eigenvalues(model, factors)
    for n, f in factors.items():
        kfac = torch.linalg.eigvalsh(f.G)[:, None] * torch.linalg.eigvalsh(f.A)[None, :]
        scale = kfac.abs().max().item()
        torch.testing.assert_close(eig[n], kfac, rtol=0, atol=1e-10 * scale)


@pytest.mark.parametrize("name", ["mlp", "convs"])
def test_the_preconditioned_gradient_is_the_explicit_damped_solve(name):
    model, x, y = _case(name)
    factors = gradhooks.kfac(model, x, y, fisher="empirical", loss=_loss)
    damping = 1e-2
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        model.zero_grad()
        _loss(model(x), y).backward()
        eig = gradhooks.ekfac_eigenvalues(model, factors)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    inverses = {n: f.inverse(damping, eigenvalues=eig[n]) for n, f in factors.items()}
    gradhooks.kfac_precondition(model, inverses)
    params = dict(model.named_parameters())
    for n, f in factors.items():
        groups, rows = tuple(f.G.shape[:-2]), f.G.shape[-1]
        grad = weight_matrix(grads[n], groups, rows, f.layout)
        got = weight_matrix(params[n].grad, groups, rows, f.layout)
        if f.bias:
            grad = torch.cat([grad, grads[f.bias_name].reshape(*groups, rows, 1)], -1)
            got = torch.cat([got, params[f.bias_name].grad.reshape(*groups, rows, 1)], -1)
        cols = grad.shape[-1]
        q_g, q_a = (torch.linalg.eigh(m)[1] for m in (f.G, f.A))
        qg, qa = q_g.reshape(-1, rows, rows), q_a.reshape(-1, cols, cols)
        e, gr = eig[n].reshape(-1, rows * cols), grad.reshape(-1, rows * cols)
        want = []
        for k in range(qg.shape[0]):
            basis = torch.kron(qg[k], qa[k])
            matrix = basis @ torch.diag(e[k] + damping) @ basis.T
            want.append(torch.linalg.solve(matrix, gr[k]))
        torch.testing.assert_close(got.reshape(-1, rows * cols), torch.stack(want))


def test_bf16_autocast_eigenvalues_are_the_float64_ones_within_its_rounding():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 5))
    x, y = torch.randn(16, 8), torch.randint(5, (16,))
    double = mlp_copy(model)
    factors = gradhooks.kfac(double, x.double(), y, fisher="empirical")
    ref = _loop(double, x.double(), y)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        _loss(out.float(), y).backward()
        got = gradhooks.ekfac_eigenvalues(model, {n: _float(f) for n, f in factors.items()})
    for n, f in factors.items():
        want = _reference(f, ref[n], ref[f.bias_name])
        # bfloat16 keeps 8 bits: each example's gradient within about 2⁻⁷ of its scale
        scale = want.abs().max().item()
        err = (got[n].double() - want).abs().max().item()
        assert err < 0.05 * scale, f"{n}: {err:.3g} against {scale:.3g}"
        assert err > 0 or scale == 0  # (bfloat16 did round: a check that can fail)


def mlp_copy(model):
    return copy.deepcopy(model).double()


def _float(f):
    return gradhooks.KFactors(f.A.float(), f.G.float(), f.bias, f.bias_name, f.layout)


def test_a_training_loop_preconditioned_by_ekfac_follows_the_float64_reference():
    """Three steps of SGD on EK-FAC-preconditioned gradients (factors and eigenvalues refreshed
    each step, ``zero_grad`` between), against the same steps taken from the loop's gradients and
    the explicit solve."""
    torch.manual_seed(0)
    model = mlp().double()
    twin = mlp_copy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    damping = 1e-1
    h = gradhooks.add_hooks(model, loss_reduction="sum")
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 3, generator=g).double(), torch.randint(4, (8,), generator=g)
        with h.paused():
            factors = gradhooks.kfac(mlp_copy(model), x, y, fisher="empirical", loss=_loss)
        opt.zero_grad()
        _loss(model(x), y).backward()
        eig = gradhooks.ekfac_eigenvalues(model, factors)
        gradhooks.kfac_precondition(
            model, {n: f.inverse(damping, eigenvalues=eig[n]) for n, f in factors.items()}
        )
        # the reference step, by hand on the twin
        ref = _loop(twin, x, y)
        with torch.no_grad():
            for n, f in factors.items():
                bias = f.bias_name
                w, b = dict(twin.named_parameters())[n], dict(twin.named_parameters())[bias]
                e = _reference(f, ref[n], ref[bias])
                grad = torch.cat([ref[n].sum(0), ref[bias].sum(0)[:, None]], 1)
                q_g, q_a = (torch.linalg.eigh(m)[1] for m in (f.G, f.A))
                basis = torch.kron(q_g, q_a)
                matrix = basis @ torch.diag(e.flatten() + damping) @ basis.T
                nat = torch.linalg.solve(matrix, grad.flatten()).reshape(grad.shape)
                w -= 0.1 * nat[:, :-1]
                b -= 0.1 * nat[:, -1]
        opt.step()
        for (n, p), q in zip(model.named_parameters(), twin.parameters()):
            torch.testing.assert_close(p, q, msg=lambda m, s=step, n=n: f"step {s}, {n}: {m}")
    h.remove()


def test_refusals_name_the_parameter_and_shapes():
    model, x, y = _case("mlp")
    factors = gradhooks.kfac(model, x, y, fisher="empirical")
    with pytest.raises(
        gradhooks.ConfigurationError, match=r"weight' \(shape \(\d, \d\)\) has no grad1"
    ):
        gradhooks.ekfac_eigenvalues(model, factors)  # no backward under hooks yet
    other, xo, yo = _case("positions")
    with gradhooks.add_hooks(other):
        F.cross_entropy(other(xo), yo).backward()
        with pytest.raises(gradhooks.ConfigurationError, match="does not have"):
            gradhooks.ekfac_eigenvalues(other, factors)  # another model's factors
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x), y).backward()
        mismatched = {"2.weight": dataclasses.replace(factors["0.weight"], bias_name="2.bias")}
        with pytest.raises(gradhooks.ConfigurationError, match=r"\(4, 6\)"):
            gradhooks.ekfac_eigenvalues(model, mismatched)
        inverse = {n: f.inverse(1e-3) for n, f in factors.items()}
        with pytest.raises(gradhooks.ConfigurationTypeError, match="KFactors"):
            gradhooks.ekfac_eigenvalues(model, inverse)
        with pytest.raises(gradhooks.ConfigurationError, match="reduction"):
            gradhooks.ekfac_eigenvalues(model, factors, reduction="max")
    f = gradhooks.kfac(model, x, y, fisher="empirical")["2.weight"]
    with pytest.raises(gradhooks.ConfigurationError, match=r"\(4, 7\)"):
        f.inverse(1e-3, eigenvalues=torch.ones(3, 3))
    with pytest.raises(gradhooks.ConfigurationError, match=">= 0"):
        f.inverse(1e-3, eigenvalues=-torch.ones(4, 7, dtype=torch.float64))
    with pytest.raises(gradhooks.ConfigurationTypeError, match="tensor"):
        f.inverse(1e-3, eigenvalues=[[1.0]])


def test_a_stack_of_gradients_is_preconditioned_example_by_example():
    """``KFactorsInverse.apply`` and ``KFactors.matrix`` on each example's gradients at once
    (``grad1``: influence scores) give what they give on each example alone, for every layout
    (a grouped convolution, a transposed one, a Linear)."""
    model, x, y = _case("convs")
    factors = gradhooks.kfac(model, x, y, fisher="empirical")
    ref = _loop(model, x, y)
    for n, f in factors.items():
        inverse = f.inverse(1e-2)
        stacked = f.matrix(ref[n], ref[f.bias_name], batch_dims=1)
        alone = [f.matrix(ref[n][b], ref[f.bias_name][b]) for b in range(x.shape[0])]
        torch.testing.assert_close(stacked, torch.stack(alone), rtol=0, atol=0)
        torch.testing.assert_close(
            inverse.apply(stacked), torch.stack([inverse.apply(m) for m in alone])
        )
        with pytest.raises(gradhooks.ConfigurationError, match="bias"):
            f.matrix(ref[n], None, batch_dims=1)


def test_ekfac_influence_scores_are_the_explicit_inverse_products():
    """Influence scores of training examples on test examples through the EK-FAC curvature,
    ``g_testᵀ (C + λI)⁻¹ g_train`` summed over the weights, with ``C`` the EK-FAC matrix
    ``(Q_G ⊗ Q_A) diag(eigenvalues) (Q_G ⊗ Q_A)ᵀ`` formed explicitly from the loop's gradients."""
    model, x, y = _case("mlp", seed=2)
    damping = 1e-2
    factors = gradhooks.kfac(model, x, fisher="mc", generator=torch.Generator().manual_seed(0))
    train, test = slice(0, 4), slice(4, 6)
    with gradhooks.add_hooks(model):
        F.cross_entropy(model(x[train]), y[train]).backward()
        eig = gradhooks.ekfac_eigenvalues(model, factors)
        p = dict(model.named_parameters())
        g_train = {n: f.matrix(p[n].grad1, p[f.bias_name].grad1, 1) for n, f in factors.items()}
        model.zero_grad()
        F.cross_entropy(model(x[test]), y[test]).backward()
        g_test = {n: f.matrix(p[n].grad1, p[f.bias_name].grad1, 1) for n, f in factors.items()}
    scores = sum(
        torch.einsum("toi,roi->tr", f.inverse(damping, eigenvalues=eig[n]).apply(g_test[n]),
                     g_train[n])
        for n, f in factors.items()
    )  # fmt: skip
    ref = _loop(model, x, y)
    want = torch.zeros(2, 4, dtype=torch.float64)
    for n, f in factors.items():
        ms = _matrices(f, ref[n], ref[f.bias_name])
        e = _reference(f, ref[n][train], ref[f.bias_name][train])
        q_g, q_a = (torch.linalg.eigh(m)[1] for m in (f.G, f.A))
        basis = torch.kron(q_g, q_a)
        matrix = basis @ torch.diag(e.flatten() + damping) @ basis.T
        want += torch.linalg.solve(matrix, ms[test].flatten(1).T).T @ ms[train].flatten(1).T
    torch.testing.assert_close(scores, want)

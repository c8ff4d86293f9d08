"""K-FAC against the cases its peers' suites check (curvlinops' ``KFACLinearOperator``,
BackPACK's ``KFAC``/``KFLR``, ASDL, nngeometry), each against the definition, computed by hand
in float64 by a per-example loop.

The definition (:func:`_by_hand`): for each example alone, the inputs ``a`` of a layer
(``[positions, in]``, a ones column for the bias; a convolution's unfolded patches) and the
output-gradients ``g`` (``[positions, out]``) of each backpropagated vector (the columns of the
square root of the loss Hessian for the GGN, curvlinops' ``"type-2"``, BackPACK's ``KFLR``;
the true labels' gradient for the empirical Fisher); then ``A = Σ a aᵀ`` and ``G = Σ g gᵀ``
over examples and positions (``expand``), or of ``mean_s a`` and ``Σ_s g`` (``reduce``).

Normalisations. gradhooks: ``A`` divides by ``batch · positions`` (expand) or ``batch``
(reduce); ``G`` is of each example's own loss (``F.cross_entropy(..., reduction="sum")``
over its positions, ``F.mse_loss(..., reduction="sum")``), divided by ``batch`` under
``reduction="mean"``, kept a sum under ``"sum"``. curvlinops takes the loss as given:
``A`` is the same; ``G`` under ``reduction="sum"`` is gradhooks' ``"sum"``; under
``reduction="mean"`` (torch's mean over ``batch · positions`` terms, and for ``MSELoss`` also
over the ``C`` outputs) it is gradhooks' ``"mean"`` divided by ``positions`` (CE) or
``positions · C`` (MSE), so that ``kron(G, A)`` is the curvature of that mean loss:
:func:`_curvlinops_G` converts, and the tests below check the conversion against the peer's
own recipe (backpropagate the reduced batch loss, rescale by ``(N·T)² / (N·T)``) and, where
K-FAC is exact (a deep linear network under MSE, in the expand and the reduce setting), against
the GGN of the reduced loss itself.

BackPACK (``KFLR``, ``KFAC``) sums a convolution's ``A`` over its positions and divides by
the batch only, keeps the bias out of ``A`` (factors of its own), and backpropagates the
square root of the Hessian of the batch loss as given (a mean's carries ``1/N``): its ``A``
is gradhooks' (``bias=False``) times the positions, its ``G`` gradhooks' of the same
``reduction``. ASDL and nngeometry use the curvlinops conventions for a Linear.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks


@pytest.fixture(autouse=True)
def _float64():
    """Every model and tensor of these tests in float64 (the bf16 test casts its own)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def _close(actual, expected, what, rtol=1e-9, atol=1e-11):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


# -- the definition, by hand ------------------------------------------------------------------


def _rows(module: nn.Module, x: torch.Tensor, y: torch.Tensor, gy: torch.Tensor | None):
    """One example's inputs ``[positions, in(+1)]`` and output-gradients ``[positions, out]``
    of ``module`` (a Linear over ``[1, ..., in]`` or a Conv2d via unfold)."""
    if isinstance(module, nn.Conv2d):
        a = F.unfold(x, module.kernel_size, module.dilation, module.padding, module.stride)
        a = a[0].T  # [positions, in·k·k], ordered as weight.flatten(1)
        g = None if gy is None else gy[0].flatten(1).T  # [positions, out]
    else:
        a = x.reshape(-1, x.shape[-1])
        g = None if gy is None else gy.reshape(-1, gy.shape[-1])
    if module.bias is not None:
        a = torch.cat([a, torch.ones(a.shape[0], 1)], 1)
    return a, g


def _by_hand(model, names, x, vectors_of, expand=True, reduction="mean"):
    """gradhooks' factors of the layers ``names`` by a per-example loop (see the module).
    ``vectors_of(out_i, i)``: the vectors to backpropagate for example ``i`` (its output
    ``out_i``, ``[1, ...]``). A layer called several times per example (a tied weight): its
    calls' positions are stacked (expand), or each call reduced over its own positions and
    the calls stacked as rows (reduce), as gradhooks counts them."""
    modules = dict(model.named_modules())
    A = {n: 0.0 for n in names}
    G = {n: 0.0 for n in names}
    N = x.shape[0]
    count = {n: 0 for n in names}
    for i in range(N):
        seen = {n: [] for n in names}
        hooks = [
            modules[n].register_forward_hook(
                lambda m, inp, out, into=seen[n]: into.append((inp[0], out))
            )
            for n in names
        ]
        try:
            out = model(x[i : i + 1])
        finally:
            for h in hooks:
                h.remove()
        vectors = vectors_of(out, i)
        for n in names:
            ins = [_rows(modules[n], inp, o, None)[0] for inp, o in seen[n]]
            if expand:
                a = torch.cat(ins)  # [positions of every call, in]
            else:  # each call reduced over its own positions: one row per call
                a = torch.cat([a.mean(0, keepdim=True) for a in ins])
            A[n] = A[n] + a.T @ a
            count[n] += a.shape[0]
        for v in vectors:
            outs = [o for n in names for _, o in seen[n]]
            grads = torch.autograd.grad(out, outs, v, retain_graph=True)
            k = 0
            for n in names:
                gs = []
                for inp, o in seen[n]:
                    g = _rows(modules[n], inp, o, grads[k])[1]
                    gs.append(g if expand else g.sum(0, keepdim=True))
                    k += 1
                g = torch.cat(gs)
                G[n] = G[n] + g.T @ g
    return {n: (A[n] / count[n], G[n] / N if reduction == "mean" else G[n]) for n in names}


def _sqrt_hessian_columns(loss):
    """``vectors_of`` for the GGN: the columns of the square root of example ``i``'s loss
    Hessian with respect to its output, ``loss(out_i, i)`` its own loss."""

    def vectors_of(out, i):
        flat = out.detach().reshape(-1)
        h = torch.func.hessian(lambda o: loss(o.view_as(out), i))(flat)
        lam, q = torch.linalg.eigh(h)
        s = q * lam.clamp(min=0).sqrt()
        return [s[:, j].view_as(out) for j in range(s.shape[1]) if lam[j] > 1e-14]

    return vectors_of


def _gradient(loss):
    """``vectors_of`` for the empirical Fisher: the gradient of example ``i``'s own loss."""

    def vectors_of(out, i):
        o = out.detach().requires_grad_()
        return [torch.autograd.grad(loss(o, i), o)[0]]

    return vectors_of


def _check(factors, hand):
    for n, (A, G) in hand.items():
        f = factors[f"{n}.weight"]
        _close(f.A, A, f"{n}: A")
        _close(f.G, G, f"{n}: G")


def _curvlinops_G(G, reduction, positions, outputs=1):
    """gradhooks' ``G`` as curvlinops reports it for the same loss (the module's docstring):
    ``"mean"`` divides by the loss terms of one example (``positions``, times the ``outputs``
    for ``MSELoss``)."""
    return G if reduction == "sum" else G / (positions * outputs)


# -- models -----------------------------------------------------------------------------------


class Tokens(nn.Module):
    """A Linear shared over positions, [batch, T, d] -> [batch, T, C] (weight sharing)."""

    def __init__(self, d=3, h=4, c=3, act=True):
        super().__init__()
        self.l1, self.l2, self.act = nn.Linear(d, h), nn.Linear(h, c), act

    def forward(self, x):
        z = self.l1(x)
        return self.l2(torch.tanh(z) if self.act else z)


class Pooled(nn.Module):
    """The reduce setting: positions pooled before the last layer."""

    def __init__(self, d=3, h=4, c=2, act=True):
        super().__init__()
        self.l1, self.l2, self.act = nn.Linear(d, h), nn.Linear(h, c), act

    def forward(self, x):
        z = self.l1(x)
        return self.l2((torch.tanh(z) if self.act else z).mean(1))


class Flat(nn.Module):
    """A model's [batch, T, C] output flattened to [batch, T·C] (fisher="exact" wants a
    [batch, classes] output; the MSE loss is the same)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x).flatten(1)


def _ce_per_position(target, C):
    """Example ``i``'s own cross-entropy, summed over its positions (gradhooks' convention)."""
    return lambda o, i: F.cross_entropy(o.reshape(-1, C), target[i].reshape(-1), reduction="sum")


def _mse(target):
    return lambda o, i: F.mse_loss(o, target[i : i + 1].reshape(o.shape), reduction="sum")


# -- against the definition: losses, reductions, expand and reduce --------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss", ["mse", "cross_entropy"])
def test_type2_of_an_mlp_equals_the_per_example_loop(loss, reduction):
    """curvlinops ``fisher_type="type-2"`` / BackPACK ``KFLR`` on an MLP (no weight sharing)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    x = torch.randn(6, 4)
    y = torch.randn(6, 3) if loss == "mse" else torch.randint(3, (6,))
    own = _mse(y) if loss == "mse" else _ce_per_position(y, 3)
    factors = gradhooks.kfac(model, x, y, fisher="exact", loss=loss, reduction=reduction)
    hand = _by_hand(model, ["0", "2"], x, _sqrt_hessian_columns(own), reduction=reduction)
    _check(factors, hand)


@pytest.mark.parametrize("expand", [True, False], ids=["expand", "reduce"])
def test_empirical_fisher_over_positions_equals_the_per_example_loop(expand):
    """curvlinops ``fisher_type="empirical"``, ``kfac_approx="expand" | "reduce"``: a Linear
    shared over the positions of a sequence, cross-entropy at every position."""
    torch.manual_seed(1)
    model = Tokens()
    x, y = torch.randn(5, 4, 3), torch.randint(3, (5, 4))
    factors = gradhooks.kfac(model, x, y, fisher="empirical", expand=expand)
    hand = _by_hand(model, ["l1", "l2"], x, _gradient(_ce_per_position(y, 3)), expand=expand)
    _check(factors, hand)


@pytest.mark.parametrize("expand", [True, False], ids=["expand", "reduce"])
def test_type2_over_positions_equals_the_per_example_loop(expand):
    """``"type-2"`` with weight sharing (MSE over every position and output)."""
    torch.manual_seed(2)
    model = Flat(Tokens())
    x, y = torch.randn(4, 3, 3), torch.randn(4, 3 * 3)
    factors = gradhooks.kfac(model, x, y, fisher="exact", loss="mse", expand=expand)
    names = ["inner.l1", "inner.l2"]
    hand = _by_hand(model, names, x, _sqrt_hessian_columns(_mse(y)), expand=expand)
    _check(factors, hand)


def test_mc_fisher_is_the_per_example_loop_of_its_own_samples():
    """curvlinops ``fisher_type="mc"``: with the samples fixed by ``output_grads``, ``G`` is
    the loop's over those very vectors (the sampling itself is the user's)."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    x = torch.randn(6, 4)
    drawn = torch.randn(6, 3)
    factors = gradhooks.kfac(model, x, fisher="mc", output_grads=lambda out, g: drawn)
    hand = _by_hand(model, ["0", "2"], x, lambda out, i: [drawn[i : i + 1]])
    _check(factors, hand)


@pytest.mark.parametrize(("loss", "samples"), [("mse", 3000), ("cross_entropy", 400)])
def test_mc_fisher_converges_to_type2(loss, samples):
    """curvlinops checks that ``"mc"`` with many samples approaches ``"type-2"``: ``G`` of
    ``M`` sampled backwards per example, over ``N`` examples, is a sample second moment whose
    entries have a relative standard deviation of about ``sqrt(2 / (M·N))`` of the largest
    (1.1% for MSE at M = 3000, N = 6; 2.9% for cross-entropy at M = 400): compared at six of
    them. ``A`` does not depend on the samples."""
    torch.manual_seed(13)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    x = torch.randn(6, 4)
    exact = gradhooks.kfac(model, x, fisher="exact", loss=loss)
    generator = torch.Generator().manual_seed(0)
    mc = gradhooks.kfac(model, x, fisher="mc", loss=loss, mc_samples=samples, generator=generator)
    bound = 6 * (2 / (samples * x.shape[0])) ** 0.5
    for name, f in exact.items():
        _close(mc[name].A, f.A, f"{name}: A")
        _close(mc[name].G, f.G, f"{name}: G", rtol=0, atol=bound * float(f.G.abs().max()))


@pytest.mark.parametrize("expand", [True, False], ids=["expand", "reduce"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_conv2d_via_unfold_equals_the_per_example_loop(expand, bias):
    """A Conv2d (stride, padding, dilation), its input unfolded into patches as curvlinops and
    BackPACK do; bias or not."""
    torch.manual_seed(4)
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1, dilation=1, bias=bias),
        nn.ReLU(),
        nn.Conv2d(3, 2, 2, dilation=2, bias=bias),
        nn.Flatten(),
        nn.Linear(2 * 1 * 1, 3, bias=bias),
    )
    x, y = torch.randn(4, 2, 6, 6), torch.randint(3, (4,))
    factors = gradhooks.kfac(model, x, y, fisher="exact", expand=expand)
    own = _ce_per_position(y, 3)
    hand = _by_hand(model, ["0", "2", "4"], x, _sqrt_hessian_columns(own), expand=expand)
    _check(factors, hand)
    assert all(f.bias == bias for f in factors.values())
    assert factors["0.weight"].A.shape == ((2 * 9 + bias),) * 2


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.l, self.out = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.l(torch.tanh(self.l(x)))))


@pytest.mark.parametrize("expand", [True, False], ids=["expand", "reduce"])
def test_a_tied_weight_counts_both_uses_as_positions(expand):
    """A Linear called twice per example (weight sharing across calls): one pair of factors,
    the calls counted as rows of each example; ``reduce`` reduces each call over its own
    positions (curvlinops' hook-based operator also takes each call on its own, adding the
    calls' ``A`` where gradhooks averages them)."""
    torch.manual_seed(5)
    model = _Twice()
    x, y = torch.randn(5, 3), torch.randint(2, (5,))
    factors = gradhooks.kfac(model, x, y, fisher="exact", expand=expand)
    own = _ce_per_position(y, 2)
    hand = _by_hand(model, ["l", "out"], x, _sqrt_hessian_columns(own), expand=expand)
    _check(factors, hand)


def test_a_frozen_layer_gets_no_factors_and_leaves_the_others_unchanged():
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    x, y = torch.randn(6, 4), torch.randint(3, (6,))
    before = gradhooks.kfac(model, x, y, fisher="empirical")
    model[0].requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a frozen layer is not a left-out one)
        after = gradhooks.kfac(model, x, y, fisher="empirical")
    assert set(after) == {"2.weight"}
    _close(after["2.weight"].A, before["2.weight"].A, "A")
    _close(after["2.weight"].G, before["2.weight"].G, "G")


# -- converting to the peers' normalisation -----------------------------------------------


def _recipe_of_curvlinops(model, names, x, loss_fn, fisher, expand, vector_scale=1.0):
    """curvlinops' own recipe (read in its ``KFACLinearOperator``), by hand: backpropagate
    vectors at the output, sum ``g gᵀ`` (expand: over examples and positions; reduce: of
    ``Σ_s g``); the caller then scales by ``(N·T)² / (N·T)`` under a mean (``T`` the loss
    terms per example), 1 under a sum. The vectors: ``"empirical"``, the gradient of the
    reduced batch loss ``loss_fn(out)``; ``"type-2"``, the columns of the square root of the
    Hessian of ``loss_fn(out)``, here the sum of the loss terms (each as torch reduces it
    over its own outputs), times ``vector_scale`` (``1/(N·T)`` under a mean: scaled as a
    gradient of the mean is)."""
    modules = dict(model.named_modules())
    seen = {n: [] for n in names}
    hooks = [
        modules[n].register_forward_hook(lambda m, i, o, n=n: seen[n].append(o)) for n in names
    ]
    try:
        out = model(x)
    finally:
        for h in hooks:
            h.remove()
    flat = out.detach().reshape(-1)
    if fisher == "type-2":
        h = torch.func.hessian(lambda o: loss_fn(o.view_as(out)))(flat)
        lam, q = torch.linalg.eigh(h)
        s = q * lam.clamp(min=0).sqrt()
        vectors = [vector_scale * s[:, j].view_as(out) for j in range(s.shape[1]) if lam[j] > 1e-14]
    else:
        o = out.detach().requires_grad_()
        vectors = [torch.autograd.grad(loss_fn(o), o)[0]]
    G = {n: 0.0 for n in names}
    for v in vectors:
        grads = torch.autograd.grad(out, [seen[n][0] for n in names], v, retain_graph=True)
        for n, g in zip(names, grads):
            g = g if expand else g.sum(1)
            g = g.reshape(-1, g.shape[-1])
            G[n] = G[n] + g.T @ g
    return G


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("expand", [True, False], ids=["expand", "reduce"])
def test_converted_G_is_curvlinops_recipe_for_cross_entropy(reduction, expand):
    """Cross-entropy over ``T`` positions, torch's ``reduction``: curvlinops' ``G`` (its recipe,
    by hand) is gradhooks' divided by ``T`` under a mean; ``A`` is the same."""
    torch.manual_seed(7)
    model, T = Tokens(), 4
    x, y = torch.randn(5, T, 3), torch.randint(3, (5, T))
    N = x.shape[0]
    ours = gradhooks.kfac(model, x, y, fisher="empirical", expand=expand, reduction=reduction)

    def loss_fn(o):
        return F.cross_entropy(o.reshape(-1, 3), y.reshape(-1), reduction=reduction)

    theirs = _recipe_of_curvlinops(model, ["l1", "l2"], x, loss_fn, "empirical", expand)
    scale = {"sum": 1.0, "mean": (N * T) ** 2 / (N * T)}[reduction]
    for n in ("l1", "l2"):
        _close(_curvlinops_G(ours[f"{n}.weight"].G, reduction, T), theirs[n] * scale, n)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_converted_G_is_curvlinops_recipe_for_mse(reduction):
    """MSE over ``T`` positions and ``C`` outputs, ``"type-2"``: curvlinops' ``G`` is
    gradhooks' divided by ``T · C`` under a mean (torch's ``MSELoss`` averages the outputs
    too)."""
    torch.manual_seed(8)
    T, C = 3, 2
    model = Flat(Tokens(c=C))
    x, y = torch.randn(4, T, 3), torch.randn(4, T * C)
    N = x.shape[0]
    ours = gradhooks.kfac(model, x, y, fisher="exact", loss="mse", reduction=reduction)
    names = ["inner.l1", "inner.l2"]

    def terms(o):  # each position's loss term, torch's MSELoss over its C outputs
        per_output = F.mse_loss(o.view(N, T, C), y.view(N, T, C), reduction="none")
        return (per_output.mean(-1) if reduction == "mean" else per_output.sum(-1)).sum()

    vector_scale = 1 / (N * T) if reduction == "mean" else 1.0
    theirs = _recipe_of_curvlinops(model, names, x, terms, "type-2", True, vector_scale)
    scale = {"sum": 1.0, "mean": (N * T) ** 2 / (N * T)}[reduction]
    for n in names:
        _close(_curvlinops_G(ours[f"{n}.weight"].G, reduction, T, C), theirs[n] * scale, n)


def _ggn_block(model, param_names, x, loss_fn):
    """The GGN block of ``loss_fn(model(x))`` over the weight (bias as last column) of each
    named Linear, ``[out·(in+1), out·(in+1)]`` row-major: ``Jᵀ H J`` by autograd."""
    params = dict(model.named_parameters())
    out = {}
    for n in param_names:
        w, b = params[f"{n}.weight"], params[f"{n}.bias"]
        theta = torch.cat([w, b[:, None]], 1).detach()

        def f(t, n=n):
            subs = {f"{n}.weight": t[:, :-1], f"{n}.bias": t[:, -1]}
            return torch.func.functional_call(model, subs, (x,))

        o = f(theta)
        J = torch.autograd.functional.jacobian(f, theta).reshape(o.numel(), -1)
        H = torch.func.hessian(lambda z, o=o: loss_fn(z.view_as(o)))(o.detach().reshape(-1))
        out[n] = J.T @ H @ J
    return out


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("setting", ["expand", "reduce"], ids=["expand-setting", "reduce-setting"])
def test_kfac_is_the_ggn_of_a_deep_linear_network(setting, reduction):
    """Where K-FAC is exact (Eschenhagen et al. 2023): a deep linear network under MSE, KFAC-
    expand in the expand setting (the loss at every position), KFAC-reduce in the reduce
    setting (positions pooled before the loss). ``kron(G, A)`` converted to curvlinops'
    normalisation equals the GGN block of torch's ``mse_loss(reduction=...)`` itself."""
    torch.manual_seed(9)
    T, C = 3, 2
    inner = Tokens(c=C, act=False) if setting == "expand" else Pooled(c=C, act=False)
    model = Flat(inner)
    x = torch.randn(5, T, 3)
    y = torch.randn(5, T * C if setting == "expand" else C)
    factors = gradhooks.kfac(
        model, x, y, fisher="exact", loss="mse", reduction=reduction, expand=setting == "expand"
    )
    terms = T if setting == "expand" else 1
    names = ["inner.l1", "inner.l2"]
    ggn = _ggn_block(model, names, x, lambda o: F.mse_loss(o, y, reduction=reduction))
    for n in names:
        f = factors[f"{n}.weight"]
        G = _curvlinops_G(f.G, reduction, terms, C)
        _close(torch.kron(G, f.A), ggn[n], f"{n}: kron(G, A) vs the GGN", rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_converted_factors_are_backpacks_kflr_of_a_convolution(reduction):
    """BackPACK's ``KFLR`` of a Conv2d (its recipe, read in its ``conv2d`` KFLR module, by
    hand): ``A = Σ_{b,s} a aᵀ / N`` (summed over the positions, divided by the batch only; no
    bias column, the bias has factors of its own), ``G = Σ g gᵀ`` of the columns of the square
    root of the Hessian of the *batch* loss (a mean's carries ``1/N``), summed over positions.
    Converted: ``A`` is gradhooks' (``bias=False``) times the positions, ``G`` gradhooks'
    ``G`` of the same ``reduction``."""
    torch.manual_seed(10)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4 * 4, 3))
    x, y = torch.randn(5, 2, 6, 6), torch.randint(3, (5,))
    N, positions = x.shape[0], 4 * 4
    ours = gradhooks.kfac(model, x, y, fisher="exact", reduction=reduction, bias=False)
    seen = []
    hook = model[0].register_forward_hook(lambda m, i, o: seen.append((i[0], o)))
    try:
        out = model(x)
    finally:
        hook.remove()
    (inp, conv_out) = seen[0]
    cols = F.unfold(inp, 3)  # [N, in·k·k, positions]
    A_backpack = torch.einsum("bik,bjk->ij", cols, cols) / N
    h = torch.func.hessian(lambda o: F.cross_entropy(o.view_as(out), y, reduction=reduction))(
        out.detach().reshape(-1)
    )
    lam, q = torch.linalg.eigh(h)
    roots = q * lam.clamp(min=0).sqrt()
    G_backpack = 0.0
    for j in range(roots.shape[1]):
        if lam[j] > 1e-14:
            (g,) = torch.autograd.grad(out, conv_out, roots[:, j].view_as(out), retain_graph=True)
            g = g.flatten(2)  # [N, out, positions]
            G_backpack = G_backpack + torch.einsum("bik,bjk->ij", g, g)
    f = ours["0.weight"]
    _close(f.A * positions, A_backpack, "A times the positions")
    _close(f.G, G_backpack, "G")


# -- a training loop, mixed precision -------------------------------------------------------


def test_hooked_factors_start_afresh_after_zero_grad_and_add_up_without():
    """Several steps of a training loop through ``add_hooks(quantities=("kfac",))``: after
    ``zero_grad`` the factors are the new batch's alone (as curvlinops recomputes them per
    batch); two backwards without it add up."""
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(6, 4), torch.randint(3, (6,))) for _ in range(3)]
    own = lambda y: lambda o, i: F.cross_entropy(o, y[i : i + 1], reduction="sum")
    with gradhooks.add_hooks(model, "sum", quantities=("kfac",)) as h:
        for x, y in batches:
            opt.zero_grad()
            F.cross_entropy(model(x), y, reduction="sum").backward()
            hand = _by_hand(model, ["0", "2"], x, _gradient(own(y)))
            _check(h.kfac_factors("mean"), hand)
            opt.step()
        x, y = batches[0]
        opt.zero_grad()
        F.cross_entropy(model(x), y, reduction="sum").backward()
        one = {k: f.G.clone() for k, f in h.kfac_factors("sum").items()}
        F.cross_entropy(model(x), y, reduction="sum").backward()  # no zero_grad: accumulates
        two = h.kfac_factors("sum")
    for k in one:
        _close(two[k].G, 2 * one[k], f"{k}: G of two backwards")


def test_bf16_autocast_factors_are_within_bf16_rounding_of_float64():
    """Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` the hidden layer's inputs and the
    output-gradients pass through bfloat16 (8 significant bits: a relative rounding of up to
    2⁻⁸ ≈ 0.39% per value); a factor entry sums products of two such values (2·2⁻⁸ each), and
    over 32 examples the roundings, of either sign, do not add up coherently: compared at
    4·2⁻⁸ ≈ 1.6% of the factor's largest entry (measured: at most 0.3%)."""
    torch.manual_seed(12)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).float()
    x, y = torch.randn(32, 8, dtype=torch.float32), torch.randint(4, (32,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = gradhooks.kfac(model, x, y, fisher="empirical")
    ref = model.double()
    own = lambda o, i: F.cross_entropy(o, y[i : i + 1], reduction="sum")
    hand = _by_hand(ref, ["0", "2"], x.double(), _gradient(own))
    for n, (A, G) in hand.items():
        f = low[f"{n}.weight"]
        for got, want, what in ((f.A, A, "A"), (f.G, G, "G")):
            bound = 4 * 2**-8 * float(want.detach().abs().max())
            _close(got.double(), want.detach(), f"{n}: {what}", rtol=0, atol=bound)

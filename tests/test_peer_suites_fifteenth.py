"""A fifteenth set of the cases that other projects check in their own test suites, written in
gradhooks' terms and compared with float64 references (per-example Jacobians and gradients of
``torch.func`` ``jacrev`` and :mod:`gradhooks.oracle`). The first fourteen sets are
:mod:`test_peer_suites`, :mod:`test_peer_suites_more`, :mod:`test_peer_suites_third` to
:mod:`test_peer_suites_fourteenth`; this one adds the K-FAC cases of curvlinops and
nngeometry that no set has ported:

- curvlinops (``f-dangel/curvlinops``: ``test/test_kfac.py``, ``test/kfac_cases.py``,
  ``test/utils.py``): ``test_kfac_one_datum``, ``test_kfac_ef_one_datum`` and
  ``test_kfac_mc_one_datum`` (its deep linear networks under ``CrossEntropyLoss`` and
  ``BCEWithLogitsLoss``, weight and bias in one block or the weight alone: K-FAC is the GGN
  block, the empirical Fisher's block, and the GGN within Monte-Carlo error); the forward-only
  Fisher (FOOF, ``test_forward_only_fisher_type_exact_case`` and ``..._weight_sharing_case``:
  ``GGN = 2·N·(I ⊗ A)`` for one Linear under a summed MSE, ``2·N·S·(I ⊗ A)`` over ``S`` shared
  positions expanded, ``2·N·(I ⊗ A)`` reduced, ``2/C·(I ⊗ A)`` under the mean), which checks
  ``A``'s normalisation alone; ``test_kfac_type2_weight_sharing`` on its ``WeightShareModel``,
  a deep linear network over ``[N, 4, 8, 5]`` whose output it post-processes per datum with
  ``torch.func.vmap`` inside ``forward`` (``grad1`` of it too, in each of its settings, and
  of its cross-entropy case of ``test/cases.py``, the classes moved first by that ``vmap``),
  and a ``vmap`` in the forward given more than each example's own rows, refused;
- nngeometry (``tfjgeorge/nngeometry``: ``tests/test_torch_hooks_kfac.py``,
  ``tests/tasks.py``): ``test_jacobian_kfac_vs_pblockdiag`` (K-FAC against the block-diagonal
  Fisher of the output Jacobians where they coincide: a Conv1d and a Conv2d summed over
  positions of an all-ones input, equal up to the number of positions, and its MLP on one
  input repeated), ``test_pspace_kfac_eigendecomposition`` (the Kronecker eigenbasis that
  :meth:`~gradhooks.KFactors.inverse` holds: ``M v = λ_G λ_A v``) and ``test_jacobian_kfac``'s
  damped solve (``(M + r I)⁻¹ (M² v + r M v) = M v``) on its conv1d, conv and linear-3d tasks.

Conventions. gradhooks' ``G`` is of each example's own loss, divided by the batch under
``reduction="mean"``; curvlinops' ``"mean"`` losses also average over the outputs (MSE, BCE)
and positions, so their K-FAC is gradhooks' ``"mean"`` divided by those (each test says how).
Every comparison is in float64 at the harness's ``rtol=1e-7, atol=1e-9`` unless a test says
otherwise.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacrev

import gradhooks
from harness import Case, assert_close, check, seeded

D = torch.float64


# -- shared functions ---------------------------------------------------------------------------


def jacobians_of_one(model: nn.Module, x1: Tensor) -> dict[str, Tensor]:
    """``{name: [outputs, *param.shape]}``: the Jacobian of the flattened output of one example
    ``x1`` (``[1, ...]``) with respect to each parameter, by ``jacrev``."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    with gradhooks.paused():
        return jacrev(lambda p: functional_call(model, p, (x1,)).reshape(-1))(params)


def kfac_block(J: dict[str, Tensor], weight: str, bias: str | None) -> Tensor:
    """``[outputs, out · (in + 1)]``: the Jacobian of ``cat([W, b[:, None]], 1)`` flattened
    row-major (the order ``torch.kron(G, A)`` is in), ``W`` as ``[out, in]`` (a convolution's
    ``[out, in · prod(kernel)]``); without ``bias``, of ``W`` alone."""
    w = J[weight].flatten(2)
    if bias is not None:
        w = torch.cat([w, J[bias][..., None]], -1)
    return w.flatten(1)


def half_sq(out: Tensor, target: Tensor | None = None) -> Tensor:
    """``½‖out‖²``: a loss whose Hessian in the output is the identity (nngeometry's Fisher of
    the output Jacobians, ``Jᵀ J``)."""
    return 0.5 * out.pow(2).sum()


def bce_sum(out: Tensor, target: Tensor) -> Tensor:
    return F.binary_cross_entropy_with_logits(out, target, reduction="sum")


def ce_sum(out: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(out, target, reduction="sum")


def mse_sum(out: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(out, target, reduction="sum")


# == curvlinops: test/test_kfac.py, one datum (KFAC_EXACT_ONE_DATUM_CASES) ======================

# its deep linear networks: Linear(5, 4) - Linear(4, 3) under CrossEntropyLoss, Linear(4, 3) -
# Linear(3, 2) under BCEWithLogitsLoss (targets rand(1, 2)); "mean" and "sum" for each
ONE_DATUM = {
    "ce": dict(
        model=lambda: nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3)),
        x=lambda: torch.rand(1, 5, dtype=D),
        y=lambda: torch.randint(3, (1,)),
        loss="cross_entropy",
        fn=ce_sum,
        classes=3,
    ),
    "bce": dict(
        model=lambda: nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)),
        x=lambda: torch.rand(1, 4, dtype=D),
        y=lambda: torch.rand(1, 2, dtype=D),
        loss=bce_sum,
        fn=bce_sum,
        classes=2,
    ),
}


def _one_datum(name: str):
    case = ONE_DATUM[name]
    model = seeded(case["model"]).to(D)
    x, y = seeded(case["x"], 1), seeded(case["y"], 2)
    return case, model, x, y


def _per_example_curvature(model, x, y, fn, fisher: str) -> dict[str, Tensor]:
    """The Jacobians ``J`` of the one datum and the matrix ``M`` between them: the loss's
    Hessian in the output (GGN, ``"exact"``) or its gradient's outer product (``"empirical"``,
    the empirical Fisher ``Jᵀ ∇ℓ ∇ℓᵀ J``)."""
    J = jacobians_of_one(model, x)
    out = model(x).detach()
    if fisher == "exact":
        M = hessian(lambda o: fn(o, y))(out).reshape(out.numel(), out.numel())
    else:
        g = torch.func.grad(lambda o: fn(o, y))(out).reshape(-1, 1)
        M = g @ g.T
    return J, M


@pytest.mark.parametrize("fisher", ["exact", "empirical"])
@pytest.mark.parametrize("name", list(ONE_DATUM))
def test_curvlinops_kfac_of_one_datum_is_its_curvature_block(name, fisher):
    """``test_kfac_one_datum`` (``FisherType.TYPE2`` against the GGN) and
    ``test_kfac_ef_one_datum`` (``FisherType.EMPIRICAL`` against the empirical Fisher) on its
    one-datum cases: for a single example ``kron(G, A)`` is that example's block, for each
    Linear with its bias as a column (curvlinops' ``separate_weight_and_bias=False``) and for
    its weight alone (``bias=False``; ``True``'s weight block). curvlinops' ``"mean"`` is the
    same for the cross-entropy (one datum) and halves the BCE's (its 2 outputs averaged)."""
    case, model, x, y = _one_datum(name)
    J, M = _per_example_curvature(model, x, y, case["fn"], fisher)
    for bias in (True, False):
        f = gradhooks.kfac(model, x, y, fisher=fisher, loss=case["loss"], bias=bias)
        for layer in ("0", "1"):
            Jw = kfac_block(J, f"{layer}.weight", f"{layer}.bias" if bias else None)
            got = torch.kron(f[f"{layer}.weight"].G, f[f"{layer}.weight"].A)
            assert_close(got, Jw.T @ M @ Jw, f"{name} {fisher} bias={bias} layer {layer}")
    # curvlinops' mean: the loss reduced over the N · C terms of BCE, over N for CE
    if name == "bce":
        mean_fn = lambda o, t: F.binary_cross_entropy_with_logits(o, t)  # noqa: E731
    else:
        mean_fn = lambda o, t: F.cross_entropy(o, t)  # noqa: E731
    J, M_mean = _per_example_curvature(model, x, y, mean_fn, fisher)
    f = gradhooks.kfac(model, x, y, fisher=fisher, loss=case["loss"], reduction="mean")["0.weight"]
    Jw = kfac_block(J, "0.weight", "0.bias")
    terms = 1 if name == "ce" else case["classes"]
    scale = terms if fisher == "exact" else terms**2  # (the EF is quadratic in the loss)
    assert_close(torch.kron(f.G, f.A) / scale, Jw.T @ M_mean @ Jw, f"{name} {fisher} mean")


class Bernoulli:
    """``sample_target`` for the BCE: labels drawn from its predictive distribution,
    ``Bernoulli(sigmoid(out))``, each draw kept."""

    def __init__(self) -> None:
        self.drawn: list[Tensor] = []

    def __call__(self, out: Tensor, generator: torch.Generator | None) -> Tensor:
        self.drawn.append(torch.bernoulli(torch.sigmoid(out), generator=generator))
        return self.drawn[-1]


@pytest.mark.parametrize("name", list(ONE_DATUM))
def test_curvlinops_mc_kfac_of_one_datum_approaches_its_ggn_block(name):
    """``test_kfac_mc_one_datum``: ``FisherType.MC`` with its 3,000 samples against the GGN
    block of the one datum, both divided by the GGN's largest entry, at its ``MC_TOLS``
    (``rtol=0.1, atol=0.015``; for the BCE ``atol=0.03``, as curvlinops doubles them on a
    GPU: the exact GGN's entries between its two independent outputs are 0, their estimate a
    mean of zero-mean products whose spread at 3,000 samples is about that tolerance). The
    BCE's labels are drawn by ``sample_target`` (gradhooks samples only its named losses
    itself), and its factors are also exactly the mean over the labels drawn of the
    per-sample ``kron(g gᵀ, a aᵀ)``, ``g = Jᵀ (sigmoid(out) - t)``."""
    case, model, x, y = _one_datum(name)
    J, M = _per_example_curvature(model, x, y, case["fn"], "exact")
    g = torch.Generator().manual_seed(0)
    sampler = Bernoulli()
    more = {} if name == "ce" else {"sample_target": sampler}
    f = gradhooks.kfac(
        model, x, fisher="mc", loss=case["loss"], mc_samples=3000, generator=g, **more
    )
    atol = 1.5e-2 if name == "ce" else 3e-2
    out = model(x).detach()
    for layer in ("0", "1"):
        Jw = kfac_block(J, f"{layer}.weight", f"{layer}.bias")
        ggn = Jw.T @ M @ Jw
        got = torch.kron(f[f"{layer}.weight"].G, f[f"{layer}.weight"].A)
        scale = ggn.abs().max()
        torch.testing.assert_close(got / scale, ggn / scale, rtol=0.1, atol=atol)
        if name == "bce":
            assert len(sampler.drawn) == 3000
            r = torch.sigmoid(out) - torch.cat(sampler.drawn)  # [samples, 2]
            grads = r @ Jw  # each sample's gradient of [W, b]
            assert_close(got, grads.T @ grads / 3000, f"bce: layer {layer}, its own samples")


# == curvlinops: test/test_kfac.py, the forward-only Fisher (FOOF) ==============================

# SINGLE_LAYER_CASES: Linear(6, 1) on two batches of 5, Linear(5, 3) on two batches of 7
SINGLE_LAYER = {
    "scalar_output": (lambda: nn.Linear(6, 1), 10, 6, 1),
    "vector_output": (lambda: nn.Linear(5, 3), 14, 5, 3),
}


def _ggn_of_summed_mse(model: nn.Module, x: Tensor, weight: str, bias: str | None) -> Tensor:
    """``Σ_n 2 J_nᵀ J_n``: the GGN block of ``[W, b]`` of the summed MSE (Hessian ``2·I``)."""
    ggn = 0
    for n in range(x.shape[0]):
        Jw = kfac_block(jacobians_of_one(model, x[n : n + 1]), weight, bias)
        ggn = ggn + 2 * Jw.T @ Jw
    return ggn


@pytest.mark.parametrize("name", list(SINGLE_LAYER))
def test_curvlinops_forward_only_fisher_of_one_linear(name):
    """``test_forward_only_fisher_type_exact_case``: for linear regression ``W x + b`` under
    MSE, the GGN is ``2·N·(I ⊗ A)`` (summed loss) and ``2/C·(I ⊗ A)`` (torch's mean over the
    ``N·C`` terms), ``A = Σ x̃ x̃ᵀ / N`` (``x̃ = [x, 1]``): curvlinops' FOOF sets ``G = I`` and
    keeps ``A``, which gradhooks gives (the same whatever the Fisher). Its exact K-FAC is the
    GGN too: ``G = 2·N·I`` under ``"sum"``."""
    factory, N, d_in, C = SINGLE_LAYER[name]
    model = seeded(factory).to(D)
    x = seeded(lambda: torch.rand(N, d_in, dtype=D), 1)
    f = gradhooks.kfac(model, x, fisher="exact", loss="mse", reduction="sum")["weight"]
    xt = torch.cat([x, torch.ones(N, 1, dtype=D)], 1)
    assert_close(f.A, xt.T @ xt / N, f"{name}: A")
    ggn = _ggn_of_summed_mse(model, x, "weight", "bias")
    eye = torch.eye(C, dtype=D)
    assert_close(2 * N * torch.kron(eye, f.A), ggn, f"{name}: FOOF, sum")
    assert_close(2 / C * torch.kron(eye, f.A), ggn / (N * C), f"{name}: FOOF, mean")
    assert_close(torch.kron(f.G, f.A), ggn, f"{name}: type-2 K-FAC, sum")


class WeightShareModel(nn.Sequential):
    """curvlinops' ``WeightShareModel`` (``test/utils.py``): a ``Sequential`` whose output
    ``[batch, ..., c]`` is post-processed one datum at a time by ``torch.func.vmap``:
    ``"reduce"`` averages over the shared positions (``... c -> c``), ``"expand-flatten"``
    flattens them with the features (``... c -> (... c)``), ``"expand"`` keeps them, with
    the classes moved first under ``loss="CE"`` (``... c -> c ...``; its einops patterns
    written in torch). ``vmapped=False``: the same post-processing written
    over the batch, as most models would."""

    def __init__(
        self,
        *layers: nn.Module,
        setting: str,
        loss: str = "MSE",
        vmapped: bool = True,
        feature_dims: int = 3,
    ):
        super().__init__(*layers)
        self.setting, self.loss = setting, loss
        self.vmapped, self.feature_dims = vmapped, feature_dims

    def _one(self, out: Tensor) -> Tensor:
        if self.setting == "reduce":
            return out.reshape(-1, out.shape[-1]).mean(0)
        if self.setting == "expand-flatten":
            return out.reshape(-1)
        if out.dim() > 1 and self.loss == "CE":  # (... c -> c ...: the classes first)
            return out.movedim(-1, 0)
        return out

    def _batched(self, out: Tensor) -> Tensor:
        if self.setting == "reduce":
            return out.reshape(out.shape[0], -1, out.shape[-1]).mean(1)
        if self.setting == "expand-flatten":
            return out.reshape(out.shape[0], -1)
        if out.dim() > 2 and self.loss == "CE":
            return out.movedim(-1, 1)
        return out

    def forward(self, x: Tensor) -> Tensor:
        out = super().forward(x)
        if out.dim() <= self.feature_dims:  # (one datum without its batch dimension)
            return self._one(out)
        return torch.func.vmap(self._one)(out) if self.vmapped else self._batched(out)


VMAP_IN_FORWARD = pytest.mark.xfail(
    strict=True,
    raises=gradhooks.ConfigurationError,
    reason="false refusal: the output of torch.func.vmap called inside forward (on the "
    "batch's rows) is a tensor the tracker never saw made, so kfac() takes it to depend on "
    "no example; grad1 of the layers before it is the loop's (test_curvlinops_weight_share_"
    "model_grad1), and a layer after it is refused (BatchNotFoundError)",
)


class Conv2dModel(nn.Module):
    """curvlinops' ``Conv2dModel``: ``Conv2d(3, 2, 4, padding=2)`` on ``[N, 3, 8, 8]``
    (``9 × 9`` output positions), its output as ``[N, 9·9·2]`` (``"expand-flatten"``, channels
    last) or averaged over the positions (``"reduce"``, ``[N, 2]``)."""

    def __init__(self, setting: str):
        super().__init__()
        self.conv, self.setting = nn.Conv2d(3, 2, 4, padding=2), setting

    def forward(self, x: Tensor) -> Tensor:
        out = self.conv(x)
        if self.setting == "reduce":
            return F.adaptive_avg_pool2d(out, 1).flatten(1)
        return out.permute(0, 2, 3, 1).flatten(1)


def _shared_patches(name: str, model: nn.Module, x: Tensor) -> Tensor:
    """``[N, S, in + 1]``: each example's inputs at its shared positions, a ones column
    appended (the convolution's unfolded patches)."""
    if name.startswith("linear"):
        a = x.reshape(x.shape[0], -1, x.shape[-1])
    else:
        a = F.unfold(x, 4, padding=2).mT
    return torch.cat([a, torch.ones(*a.shape[:2], 1, dtype=D)], -1)


@pytest.mark.parametrize(
    "name, setting",
    [
        ("linear", "expand"),
        ("linear", "reduce"),
        ("linear_vmap", "expand"),
        pytest.param("linear_vmap", "reduce", marks=VMAP_IN_FORWARD),
        ("conv", "expand"),
        ("conv", "reduce"),
    ],
)
def test_curvlinops_forward_only_fisher_over_shared_positions(name, setting):
    """``test_forward_only_fisher_type_exact_weight_sharing_case``
    (``SINGLE_LAYER_WEIGHT_SHARING_CASES``): one Linear(5, 3) on ``[7, 4, 8, 5]`` in a
    ``WeightShareModel`` (32 positions; its ``vmap`` in ``forward``, and without it), or its
    ``Conv2dModel`` on
    ``[7, 3, 8, 8]`` (81 positions), under a summed MSE. Expanded (a loss at every position):
    ``GGN = 2·N·S·(I ⊗ A)``, ``A = Σ_{n,s} x̃ x̃ᵀ / (N·S)``; reduced (the outputs averaged over
    the positions): ``GGN = 2·N·(I ⊗ A)``, ``A = Σ_n x̄ x̄ᵀ / N``, ``x̄`` each example's mean.
    Under torch's mean (over ``N·C``, and ``S`` expanded) the GGN is ``2/C·(I ⊗ A)``."""
    expand = setting == "expand"
    if name.startswith("linear"):
        vmapped = name == "linear_vmap"
        model = seeded(
            lambda: WeightShareModel(nn.Linear(5, 3), setting=setting, vmapped=vmapped)
        ).to(D)
        x, weight, bias, C = (
            seeded(lambda: torch.rand(7, 4, 8, 5, dtype=D), 1),
            "0.weight",
            "0.bias",
            3,
        )
    else:
        conv_setting = "expand-flatten" if expand else "reduce"
        model = seeded(lambda: Conv2dModel(conv_setting)).to(D)
        x, weight, bias, C = (
            seeded(lambda: torch.rand(7, 3, 8, 8, dtype=D), 1),
            "conv.weight",
            "conv.bias",
            2,
        )
    out = model(x).detach()
    y = seeded(lambda: torch.rand(out.shape, dtype=D), 2)
    f = gradhooks.kfac(model, x, y, fisher="empirical", loss=mse_sum, expand=expand)[weight]
    a = _shared_patches(name, model, x)
    N, S = a.shape[:2]
    if expand:
        want_A = torch.einsum("nsi,nsj->ij", a, a) / (N * S)
    else:
        mean = a.mean(1)
        want_A = mean.T @ mean / N
    assert_close(f.A, want_A, f"{name} {setting}: A")
    ggn = _ggn_of_summed_mse(model, x, weight, bias)
    eye = torch.eye(C, dtype=D)
    positions = S if expand else 1
    assert_close(2 * N * positions * torch.kron(eye, f.A), ggn, f"{name} {setting}: FOOF, sum")
    terms = N * C * positions
    assert_close(2 / C * torch.kron(eye, f.A), ggn / terms, f"{name} {setting}: FOOF, mean")


# == curvlinops: test_kfac_type2_weight_sharing on its WeightShareModel ============================


def _weight_share_deep_linear(setting: str, vmapped: bool = True) -> WeightShareModel:
    """``KFAC_WEIGHT_SHARING_EXACT_CASES``' deep linear network: ``WeightShareModel(
    Linear(5, 4), Linear(4, 3), num_output_feature_dims=3)``."""
    return WeightShareModel(nn.Linear(5, 4), nn.Linear(4, 3), setting=setting, vmapped=vmapped)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("setting", ["expand-flatten", "reduce"])
@pytest.mark.parametrize("vmapped", [False, pytest.param(True, marks=VMAP_IN_FORWARD)])
def test_curvlinops_kfac_of_its_weight_share_model_is_its_ggn(vmapped, setting, reduction):
    """``test_kfac_type2_weight_sharing`` on the deep linear ``WeightShareModel`` over
    ``[N, 4, 8, 5]`` (32 shared positions, its output post-processed by ``vmap`` in
    ``forward``) under MSE: expanded K-FAC (a loss at each of the ``4·8·3`` outputs, flattened
    so that ``fisher="exact"`` backpropagates each) and reduced K-FAC (the outputs averaged
    over the positions, ``expand=False``) are the GGN block of each layer, summed over the
    examples (divided by them under ``"mean"``). With the post-processing written over the
    batch; with the peer's ``vmap``, refused (a strict xfail)."""
    model = seeded(lambda: _weight_share_deep_linear(setting, vmapped)).to(D)
    N = 3
    x = seeded(lambda: torch.rand(N, 4, 8, 5, dtype=D), 1)
    f = gradhooks.kfac(
        model, x, fisher="exact", loss="mse", reduction=reduction, expand=setting != "reduce"
    )
    for layer in ("0", "1"):
        ggn = _ggn_of_summed_mse(model, x, f"{layer}.weight", f"{layer}.bias")
        got = torch.kron(f[f"{layer}.weight"].G, f[f"{layer}.weight"].A)
        assert_close(got, ggn / (N if reduction == "mean" else 1), f"{setting} layer {layer}")


@pytest.mark.parametrize("setting", ["expand", "expand-flatten", "reduce"])
def test_curvlinops_weight_share_model_grad1(setting):
    """``grad1`` of the deep linear ``WeightShareModel`` in each of its settings: the output
    post-processed per datum by ``torch.func.vmap`` inside ``forward`` (a batch of one
    through the same forward, in the oracle), against ``vmap(grad)`` and the loop."""
    check(
        Case(
            f"weight_share_{setting}",
            lambda: _weight_share_deep_linear(setting),
            lambda n: torch.rand(n, 4, 8, 5),
        ),
        batch=3,
    )


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_curvlinops_weight_share_model_for_cross_entropy_grad1(reduction):
    """``test/cases.py``'s cross-entropy case over an extra dimension: ``WeightShareModel(
    Sequential(Linear(10, 5), ReLU(), Linear(5, 3)), setting="expand", loss="CE",
    num_output_feature_dims=2)`` on ``[N, 5, 10]``, its ``vmap`` in ``forward`` moving each
    datum's classes first (``[N, 3, 5]``), under the cross-entropy of labels ``[N, 5]``:
    ``grad1`` against ``vmap(grad)`` and the loop."""
    check(
        Case(
            "weight_share_ce",
            lambda: WeightShareModel(
                nn.Sequential(nn.Linear(10, 5), nn.ReLU(), nn.Linear(5, 3)),
                setting="expand",
                loss="CE",
                feature_dims=2,
            ),
            lambda n: torch.rand(n, 5, 10),
            target=lambda n: torch.randint(3, (n, 5)),
            loss=ce_sum,
        ),
        batch=4,
        reduction=reduction,
    )


class VmapAfterLinear(nn.Module):
    """A Linear, then a ``torch.func.vmap`` over its output's rows in the forward, as
    curvlinops' ``WeightShareModel`` runs one: per example (``"own_rows"``), or given more
    than each example's own row: the batch's mean captured from outside the ``vmap``, the rows
    rolled along the batch as a second vmapped input, or vmapped over the features
    (``in_dims=1``) with a reduction over the batch inside."""

    def __init__(self, how: str):
        super().__init__()
        self.lin, self.how = nn.Linear(3, 7), how

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x)
        vmap = torch.func.vmap
        if self.how == "own_rows":
            return vmap(lambda o: o.tanh() * 2)(h)
        if self.how == "captured_batch_mean":
            return vmap(lambda o: o - h.mean(0))(h)
        if self.how == "rolled_rows":
            return vmap(lambda o, r: o * r)(h, h.roll(1, 0))
        return vmap(lambda o: o - o.mean(), in_dims=1, out_dims=1)(h)


@pytest.mark.parametrize(
    "how, says",
    [
        ("captured_batch_mean", "holds the 4 examples unbatched|computed across the examples"),
        ("rolled_rows", "computed across the examples"),
        ("over_features", "vmapped over its dimension 1"),
    ],
)
def test_a_vmap_in_the_forward_that_mixes_the_examples_is_refused(how, says):
    """A ``torch.func.vmap`` in the forward hides its calls' examples from the tracker; one
    given more than each example's own rows (the batch's mean captured from outside it, the
    rows rolled along the batch, a ``vmap`` over the features with a reduction over the
    batch inside) makes every example's loss depend on the others, and its ``grad1`` was the
    Linear's pieces summed as if it did not: silently not the loop's. Refused
    (``MixedExamplesError`` naming the Linear, the operation and the ``vmap``), nothing
    written; the ``vmap`` over each example's own rows is the loop's."""
    x = seeded(lambda: torch.rand(4, 3, dtype=D), 1)
    model = seeded(lambda: VmapAfterLinear(how)).to(D)
    with gradhooks.add_hooks(model, loss_reduction="sum"):
        with pytest.raises(gradhooks.MixedExamplesError) as info:
            half_sq(model(x)).backward()
    message = str(info.value)
    assert "'lin' (Linear)" in message and "torch.func.vmap" in message, message
    assert any(part in message for part in says.split("|")), message
    assert not any(hasattr(p, "grad1") for p in model.parameters())
    check(Case("vmap_own_rows", lambda: VmapAfterLinear("own_rows"), lambda n: torch.rand(n, 3)))


# == nngeometry: tests/test_torch_hooks_kfac.py ===================================================


class Conv1dSum(nn.Module):
    """nngeometry's ``Conv1dNet`` of ``get_conv1dnet_kfc_task``: ``Conv1d(3, 4, 3, 1)``, the
    output summed over its positions."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(3, 4, 3, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv1(x).sum(dim=2)


class Conv2dSum(nn.Module):
    """nngeometry's ``ConvNet`` of ``get_convnet_kfc_task``: ``Conv2d(3, 4, 3, 1)``, the output
    summed over its positions."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv1(x).sum(dim=(2, 3))


class FCNet(nn.Module):
    """nngeometry's ``Net`` of ``get_fullyconnect_kfac_task`` (``in_size``, two hidden layers of
    25 with ReLU, 10 outputs; its 18·18 inputs made 12 here)."""

    def __init__(self, in_size: int = 12):
        super().__init__()
        sizes = [in_size, 25, 25, 10]
        layers: list[nn.Module] = []
        for s_in, s_out in zip(sizes[:-1], sizes[1:], strict=True):
            layers += [nn.Linear(s_in, s_out), nn.ReLU()]
        self.net = nn.Sequential(*layers[:-1])

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x.view(x.size(0), -1))


KFC_TASKS = {
    # name: (model, input, positions: nngeometry's "mult")
    "conv1dnet": (Conv1dSum, lambda: torch.ones(10, 3, 5, dtype=D), 3),
    "convnet": (Conv2dSum, lambda: torch.ones(10, 3, 5, 7, dtype=D), 15),
    "fullyconnect_one_x_repeated": (FCNet, lambda: torch.rand(1, 12, dtype=D).repeat(10, 1), 1),
}


@pytest.mark.parametrize("task", list(KFC_TASKS))
def test_nngeometry_kfac_is_the_block_diagonal_fisher_where_they_coincide(task):
    """``test_jacobian_kfac_vs_pblockdiag``: nngeometry's Fisher of the output Jacobians
    (``PMatBlockDiag``: ``mean_n J_nᵀ J_n`` per layer, weight and bias together) against its
    ``PMatKFAC`` on inputs where they coincide: a convolution summed over the positions of an
    all-ones input (every position the same patch: the block is ``S · kron(G, A)``, its
    ``mult`` 3 and 15) and its MLP on one input repeated (``mult`` 1). gradhooks' factors of
    the loss ``½‖out‖²`` (Hessian ``I``, ``fisher="exact"``), ``"mean"``, expanded."""
    factory, inputs, mult = KFC_TASKS[task]
    model = seeded(factory).to(D).eval()
    x = seeded(inputs, 1)
    factors = gradhooks.kfac(model, x, fisher="exact", loss=half_sq, reduction="mean")
    layers = [n[: -len(".weight")] for n in factors]
    assert layers, task
    for layer in layers:
        blocks = 0
        for n in range(x.shape[0]):
            Jw = kfac_block(
                jacobians_of_one(model, x[n : n + 1]), f"{layer}.weight", f"{layer}.bias"
            )
            blocks = blocks + Jw.T @ Jw
        f = factors[f"{layer}.weight"]
        assert_close(mult * torch.kron(f.G, f.A), blocks / x.shape[0], f"{task}: {layer}")


class NngeometryFCNet(nn.Module):
    """nngeometry's ``FCNet`` of ``get_fullyconnect_task``: the ``18 × 18`` centre of a
    ``[1, 28, 28]`` image, flattened, then ``324 - 10 - 10 - 3`` Linears with ReLUs."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(18 * 18, 10), nn.ReLU(), nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 3)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x[:, :, 5:-5, 5:-5].contiguous().view(x.size(0), -1))


def test_nngeometry_kfac_eigendecomposition_is_held_by_the_inverse():
    """``test_pspace_kfac_eigendecomposition`` on ``get_fullyconnect_task`` (30 images): for
    the three largest eigenvalues of ``A`` and of ``G`` of each layer, the Kronecker product
    of their eigenvectors (as a ``[out, in + 1]`` matrix ``V``) is an eigenvector of
    ``kron(G, A)`` (``G V A``) of eigenvalue ``λ_G λ_A``, from the eigenbases that
    ``KFactors.inverse`` keeps, and the inverse applied to it divides it by
    ``λ_G λ_A + damping``."""
    model = seeded(NngeometryFCNet).to(D).eval()
    x = seeded(lambda: torch.rand(30, 1, 28, 28, dtype=D), 1)
    damping = 1e-3
    for name, f in gradhooks.kfac(model, x, fisher="exact", loss=half_sq).items():
        inv = f.inverse(damping)
        eig_a, eig_g = torch.linalg.eigvalsh(f.A), torch.linalg.eigvalsh(f.G)
        for i_a in range(-3, 0):
            for i_g in range(-3, 0):
                V = torch.outer(inv.Q_G[:, i_g], inv.Q_A[:, i_a])
                lam = eig_g[i_g] * eig_a[i_a]
                assert_close(f.G @ V @ f.A, lam * V, f"{name}: M v, ({i_g}, {i_a})")
                assert_close(inv.apply(V), V / (lam + damping), f"{name}: inverse, ({i_g}, {i_a})")


class NngeometryConv1dNet(nn.Module):
    """nngeometry's ``Conv1dNet`` (``get_conv1d_task``): a ``[1, 28, 28]`` image as one
    channel of 784, ``Conv1d(1, 6, 3, 3)``, ``Conv1d(6, 5, 4, 8, bias=False)``,
    ``Conv1d(5, 2, 4, 4)`` with ReLUs, then ``Linear(16, 4)``."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(1, 6, 3, 3)
        self.conv2 = nn.Conv1d(6, 5, 4, 8, bias=False)
        self.conv3 = nn.Conv1d(5, 2, 4, 4)
        self.fc1 = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        x = x.reshape(x.size(0), x.size(1), -1)
        x = F.relu(self.conv3(F.relu(self.conv2(F.relu(self.conv1(x))))))
        return self.fc1(x.view(x.size(0), -1))


class NngeometryConvNet(nn.Module):
    """nngeometry's ``ConvNet`` (``get_conv_task``): ``Conv2d(1, 6, 3, 2)``, average pooling,
    ``Conv2d(6, 5, 4, 1, bias=False)``, pooling, ``Conv2d(5, 7, 3, 1, 1)`` with an in-place
    ReLU, ``Linear(7, 4)``, ``Linear(4, 3)``."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 3, 2)
        self.conv2 = nn.Conv2d(6, 5, 4, 1, bias=False)
        self.conv3 = nn.Conv2d(5, 7, 3, 1, 1)
        self.fc1, self.fc2 = nn.Linear(7, 4), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = F.avg_pool2d(F.relu(self.conv1(x)), 2, 2)
        x = F.avg_pool2d(F.relu(self.conv2(x)), 2, 2)
        x = F.relu(self.conv3(x), inplace=True).view(-1, 7)
        return self.fc2(F.relu(self.fc1(x)))


class Linear3D(nn.Module):
    """nngeometry's ``Linear3D`` (``get_linear_3d_task``): ``Linear(4, 3)`` on ``[N, 5, 4]``,
    summed over the 5 positions."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x).sum(dim=1)


SOLVE_TASKS = {
    "conv1d": (NngeometryConv1dNet, lambda: torch.rand(30, 1, 28, 28, dtype=D)),
    "conv": (NngeometryConvNet, lambda: torch.rand(30, 1, 28, 28, dtype=D)),
    "linear_3d": (Linear3D, lambda: torch.rand(7, 5, 4, dtype=D)),
}


@pytest.mark.parametrize("task", list(SOLVE_TASKS))
def test_nngeometry_kfac_damped_solve(task):
    """``test_jacobian_kfac``'s inverse and solve on its conv1d, conv and linear-3d tasks:
    with ``M = kron(G, A)`` of each layer (weights without a bias too) and ``m = M v`` for a
    random ``v``, the damped inverse gives back ``(M + r I)⁻¹ (M m + r m) = m``; and the
    diagonal of ``M`` is ``kron(diag G, diag A)`` (its ``get_diag``)."""
    factory, inputs = SOLVE_TASKS[task]
    model = seeded(factory).to(D).eval()
    x = seeded(inputs, 1)
    factors = gradhooks.kfac(model, x, fisher="exact", loss=half_sq)
    assert len(factors) == sum(1 for n, _ in model.named_parameters() if n.endswith("weight"))
    regul = 1e-7
    for name, f in factors.items():
        M = torch.kron(f.G, f.A)
        v = seeded(lambda M=M: torch.randn(M.shape[0], dtype=D), 2)
        m = M @ v
        rhs = (M @ m + regul * m).reshape(f.G.shape[-1], f.A.shape[-1])
        back = f.inverse(regul).apply(rhs).reshape(-1)
        torch.testing.assert_close(back, m, rtol=1e-6, atol=1e-6 * m.abs().max().item())
        assert_close(torch.diag(M), torch.kron(f.G.diag(), f.A.diag()), f"{task} {name}: diag")
